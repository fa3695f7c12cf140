"""With `train.engine: fsdp2` the policy's weights live on the ranks: the driver loads no copy of the policy (nor of
its reference or critic) to build the trainer, in RL runs and in SFT. Counted by wrapping `load_model` wherever it
was imported, in the driver's process only (the ranks are other processes); the inline runtime's rollout engine,
which that runtime places in the driver on purpose, is counted apart."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from asyncflow.api import open_run
from asyncflow.config import build_config
from asyncflow.models import loading


@pytest.fixture
def driver_loads(monkeypatch):
    """{"policy": paths loaded in this process outside a rollout engine, "rollout": paths a rollout engine loaded}."""
    for module in ("asyncflow.engines.torch_inference", "asyncflow.engines.fsdp2_train", "asyncflow.models.value",
                   "asyncflow.workflow.run", "asyncflow.workflow.sft", "asyncflow.workflow.serve"):
        importlib.import_module(module)  # before any is patched: each keeps its own name of `load_model`
    driver, original = os.getpid(), loading.load_model
    loads: dict[str, list[str]] = {"policy": [], "rollout": []}

    def counting(kind: str):
        def load_model(path, *args, **kwargs):
            if os.getpid() == driver:
                loads[kind].append(str(path))
            return original(path, *args, **kwargs)
        return load_model

    for name, module in list(sys.modules.items()):
        if name.startswith("asyncflow") and getattr(module, "load_model", None) is original:
            kind = "rollout" if name == "asyncflow.engines.torch_inference" else "policy"
            monkeypatch.setattr(module, "load_model", counting(kind))
    return loads


def fsdp2_config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "data.test_size=4",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=1",
        "train.micro_batch_size=4", "eval.every=0", "checkpoint.every=0", "runtime.call_timeout_s=60",
        "runtime.lend_idle_cores=false", "runtime.kind=inline", "workflow.mode=sync",
        "train.engine=fsdp2", "train.world_size=2", *overrides,
    ])  # fmt: skip


@pytest.mark.slow
def test_rl_run_with_fsdp2_loads_no_policy_in_the_driver(tmp_path, driver_loads, one_torch_thread):
    config = fsdp2_config(tmp_path, "algo.kl_coef=0.01")  # a reference model too: built on the ranks
    with open_run(config) as run:
        assert type(run.train_engine.ranks).__name__ == "ProcessRanks"
    assert driver_loads["policy"] == [], "the driver loaded the policy although its ranks hold it"
    assert len(driver_loads["rollout"]) == 1, "the inline runtime's rollout engine is the driver's one model"


@pytest.mark.slow
def test_sft_with_fsdp2_loads_no_policy_in_the_driver(tmp_path, driver_loads, one_torch_thread):
    from asyncflow.workflow.sft import run_sft

    config = fsdp2_config(tmp_path / "run", "sft.steps=1", "sft.batch_size=4")
    run_sft(config, tmp_path / "sft")
    assert driver_loads["policy"] == [], "SFT loaded the policy in the driver although its ranks hold it"

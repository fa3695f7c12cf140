"""`descendants_peak_rss_mb`: what a rollout replica reports for the processes its engine started
(`memory/peak_rss_mb/rollout_R_engine`: vLLM's worker, which holds the weights and the KV cache)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from asyncflow.observe.memory import descendants_peak_rss_mb


def test_the_peak_of_a_process_this_one_started_is_seen():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(300 << 20); x[::4096] = b'1' * "
                              "len(x[::4096]); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(0.1)
        assert descendants_peak_rss_mb() > 300
    finally:
        child.kill()
        child.wait()


FRAGMENTING = """
import sys, torch
from asyncflow.observe.memory import return_freed_blocks, rss_mb
if sys.argv[1] == "capped":
    assert return_freed_blocks()
big = torch.ones(4 << 20)
del big  # a 16 MiB block freed: glibc alone now serves blocks up to 16 MiB from the heap
before = rss_mb()
blocks = [torch.ones(2 << 20) for _ in range(48)]  # 48 blocks of 8 MiB (a layer's gathered weights, say)
pinned = torch.ones(1024)  # allocated after them: the heap cannot shrink below it
del blocks
print(rss_mb() - before)
"""


def retained_mb(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", FRAGMENTING, mode], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_freed_blocks_leave_the_resident_size_once_the_threshold_is_set():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    # glibc alone keeps the 384 MiB freed in its heap in some runs, not all (0, 64 or 384 MiB here, run to run)
    if max(retained_mb("default") for _ in range(4)) < 200:
        pytest.skip("glibc returned the freed blocks by itself in every try: nothing for the threshold to show")
    assert retained_mb("capped") < 50


@pytest.mark.parametrize("engine", ["vllm", "torch"])
def test_a_vllm_replicas_actor_returns_freed_blocks_and_a_torch_one_does_not(monkeypatch, engine):
    """The actor of a vLLM replica runs no model (vLLM's worker does) and only passes weight buckets on: it sets the
    threshold before anything else; a torch replica runs the model in its own process and keeps glibc's default."""
    ray_runtime = pytest.importorskip("asyncflow.runtime.ray_runtime")
    from asyncflow.engines.base import SamplingParams
    from asyncflow.runtime.base import RolloutSpec

    calls = []
    monkeypatch.setattr(ray_runtime, "return_freed_blocks", lambda *a: calls.append(a) or True)
    monkeypatch.setattr(ray_runtime.torch, "set_num_threads", lambda n: None)  # leave this process's threads alone
    spec = RolloutSpec(model_path="unused", dtype="float32", device="cpu", engine=engine, max_batch_size=1,
                       params=SamplingParams(), group_size=1, seed=0, make_scorer=None)
    with pytest.raises(ValueError, match="make_scorer"):  # stops before it builds an engine
        ray_runtime.RolloutActor(spec, "rollout_0")
    assert len(calls) == (1 if engine == "vllm" else 0)


@pytest.mark.slow  # preflight and a tokenizer each (~3 s)
@pytest.mark.parametrize(("engine", "runtime", "expected"), [("fsdp2", "ray", 1), ("fsdp2", "inline", 0),
                                                              ("torch", "inline", 0)])
def test_the_driver_returns_freed_blocks_only_when_its_ranks_are_ray_actors(monkeypatch, tmp_path, engine, runtime,
                                                                             expected):
    """The driver of Ray FSDP2 ranks holds no model and passes their buckets on: it sets the threshold as the run is
    built, before the runtime starts (a sentinel raised there ends the construction)."""
    from asyncflow.api import train
    from asyncflow.config import build_config
    from asyncflow.workflow import run

    class Built(Exception):
        pass

    calls = []
    monkeypatch.setattr(run, "return_freed_blocks", lambda *a: calls.append(a) or True)

    def stop(*args, **kwargs):
        raise Built

    monkeypatch.setattr(run, "make_runtime", stop)
    config = build_config({}, [f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
                               f"train.engine={engine}", f"runtime.kind={runtime}", "workflow.mode=async",
                               "train.world_size=2" if engine == "fsdp2" else "train.world_size=1"])
    with pytest.raises(Built):
        train(config)
    assert len(calls) == expected

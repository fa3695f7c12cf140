"""Every algorithm value the config accepts trains one real step; the ones it rejects are named.

The `Literal` choices of `AlgoConfig` are read from the config itself, so a new estimator or
aggregation mode is covered (or fails here) the day it is added.
"""

from __future__ import annotations

import math
import typing

import pytest

from asyncflow.config import AlgoConfig, ConfigError, build_config
from asyncflow.workflow.pipeline import make_workflow
from asyncflow.workflow.run import RLRun

REJECTED = {"advantage": {"gae"}}  # needs a critic, which no training engine trains yet


def accepted(field: str) -> list[str]:
    choices = typing.get_args(AlgoConfig.model_fields[field].annotation)
    return [c for c in choices if c not in REJECTED.get(field, set())]


def one_step(tmp_path, *overrides: str) -> dict:
    config = build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "data.test_size=4",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "train.steps=1",
        "train.micro_batch_size=4", "eval.every=0", "checkpoint.every=0", "runtime.kind=inline", *overrides,
    ])  # fmt: skip
    run = RLRun(config)
    return run.train(make_workflow(config, run))[-1]


@pytest.mark.parametrize(
    "override",
    [f"algo.advantage={v}" for v in accepted("advantage")]
    + [f"algo.loss_agg={v}" for v in accepted("loss_agg")]
    + [f"algo.kl_estimator={v}" for v in accepted("kl_estimator")]
    + [f"algo.stale_old_logprobs={v}" for v in accepted("stale_old_logprobs")]
    + ["algo.dynamic_sampling=true", "algo.overlong_filter=true", "algo.tis_cap=2.0"],
)
def test_every_accepted_algorithm_value_trains_one_step(tmp_path, override):
    extra = ["algo.kl_coef=0.1", "algo.entropy_coef=0.01"] if override.startswith("algo.kl_estimator") else []
    row = one_step(tmp_path, override, *extra)
    assert row["step"] == 1 and row["train/sequences"] + row["filtered/dropped_samples"] == 8
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    if extra:
        assert math.isfinite(row["kl"])


@pytest.mark.parametrize("field, value", [(f, v) for f, values in REJECTED.items() for v in values])
def test_rejected_algorithm_values_stop_at_config_load(field, value):
    with pytest.raises(ConfigError, match=f"algo.{field}.*{value} needs a critic"):
        build_config({}, [f"algo.{field}={value}"])

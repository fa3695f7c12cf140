"""Every algorithm value the config accepts trains one real step; the ones it rejects are named.

The choices of `AlgoConfig` (`Literal` values, the kinds of `algo.loss`) are read from the config itself, so a new
estimator or aggregation mode is covered (or fails here) the day it is added.
"""

from __future__ import annotations

import math
import typing

import pytest

from asyncflow import api
from asyncflow.config import AlgoConfig, ConfigError, build_config

REJECTED: dict[str, set[str]] = {}  # every value is accepted now (gae trains a critic)
CHOICES = ("advantage", "loss", "loss_agg", "kl_estimator", "stale_old_logprobs", "mismatch_correction")


def accepted(field: str) -> list[str]:
    """The values of a `Literal` field (also one that takes a list of them, `algo.mismatch_correction`), or the
    kinds of a field of variants (`algo.loss`)."""
    choices = []
    for choice in typing.get_args(AlgoConfig.model_fields[field].annotation):
        if typing.get_origin(choice) is typing.Literal:
            choices.extend(typing.get_args(choice))
            continue
        if typing.get_origin(choice) is list:  # a list of the values already listed
            continue
        variant = typing.get_args(choice)[0] if typing.get_origin(choice) is typing.Annotated else choice
        choices.append(variant.model_fields["kind"].default if isinstance(variant, type) else choice)
    return [c for c in choices if c not in REJECTED.get(field, set())]


def train(tmp_path, *overrides: str) -> list[dict]:
    config = build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "data.test_size=4",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "train.steps=1",
        "train.micro_batch_size=4", "eval.every=0", "checkpoint.every=0", "runtime.kind=inline", *overrides,
    ])  # fmt: skip
    return api.train(config).history


def one_step(tmp_path, *overrides: str) -> dict:
    return train(tmp_path, *overrides)[-1]


def combinations() -> list[list[str]]:
    """Few runs that together use every accepted value of every choice: run i takes the i-th value of each
    choice (cycling the shorter lists), with the KL and entropy terms on so that every estimator is used,
    and one of the DAPO switches."""
    choices = {f: accepted(f) for f in CHOICES}
    switches = [[], ["algo.dynamic_sampling=true"], ["algo.overlong_filter=true"]]
    runs = max(len(values) for values in choices.values())
    return [
        [f"algo.{f}={values[i % len(values)]}" for f, values in choices.items()] + switches[i % len(switches)]
        for i in range(runs)
    ]


@pytest.mark.parametrize("overrides", combinations(), ids=lambda o: ",".join(x.split("=")[1] for x in o))
@pytest.mark.slow
def test_every_accepted_algorithm_value_trains_one_step(tmp_path, overrides):
    row = one_step(tmp_path, *overrides, "algo.kl_coef=0.1", "algo.entropy_coef=0.01")
    assert row["step"] == 1 and row["train/sequences"] + row["filtered/dropped_samples"] == 8
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    if row["train/sequences"] > 0:  # DAPO's filters may drop every row of a random model's step
        assert math.isfinite(row["kl"])


def test_the_combinations_cover_every_accepted_value():
    used = {o for run in combinations() for o in run}
    for field in CHOICES:
        assert {f"algo.{field}={v}" for v in accepted(field)} <= used


@pytest.mark.slow
def test_a_combination_of_mismatch_corrections_trains_one_step(tmp_path):
    row = one_step(tmp_path, "algo.mismatch_correction=[icepop, seq_mask, m2po]")
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    for count in ("icepop_masked_tokens", "seq_mask_masked_sequences", "m2po_masked_tokens", "masked_tokens"):
        assert 0.0 <= row[f"mismatch/{count}_fraction"] <= 1.0


@pytest.mark.parametrize("key", ["algo.critic.kind=separate", "algo.critic.lr=1e-3", "algo.critic.value_clip=0.5",
                                 "algo.critic.value_coef=1.0"])
def test_critic_keys_without_a_critic_stop_at_config_load(key):
    with pytest.raises(ConfigError, match="applies to algo.advantage=gae"):
        build_config({}, [key])
    assert build_config({}, [key, "algo.advantage=gae"]).algo.advantage == "gae"


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
@pytest.mark.slow
def test_gspo_and_cispo_train_on_stale_rows_and_log_their_clip_fraction(tmp_path, loss):
    """Async with staleness 1: from step 2 on the rows were sampled by the previous weights, so the ratios differ
    from 1 and the losses' clip metrics are measured on them. (The entropy bonus moves the weights even when the
    random model's rewards are all 0.)"""
    rows = train(tmp_path, f"algo.loss={loss}", "workflow.mode=async", "workflow.max_staleness=1", "train.steps=3",
                 "train.lr=1e-2", "algo.entropy_coef=0.1")[1:]  # after step 0, the model before training
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        assert 0.0 <= row["clip_fraction"] <= 1.0 and math.isfinite(row["approx_kl"])
    assert rows[-1]["staleness/mean"] > 0 and rows[-1]["ratio_mean"] != pytest.approx(1.0)

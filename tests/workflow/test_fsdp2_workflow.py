"""Runs with `train.engine=fsdp2 train.world_size=2`: `sync` (ranks as local processes) survives a rank killed
mid-run: the run stops with an error naming the rank, `--resume` finishes it from the last checkpoint and every
prompt is trained exactly once; `async` on the Ray runtime (ranks as Ray actors) trains within its staleness bound,
its versions staged on the driver or forwarded from the ranks."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time

import pytest

from asyncflow.api import open_run, train
from asyncflow.config import build_config
from asyncflow.engines.fsdp2_train import RankFailedError

STEPS, PROMPTS, GROUP = 5, 4, 4


def parity_reward(completion: str, ground_truth: str, **metadata) -> float:
    """Varies within a group even for an untrained model, so every step changes the weights."""
    return float(len(completion) % 2)


def fsdp2_config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama", "data.test_size=4",
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={GROUP}", "rollout.max_new_tokens=6",
        "rollout.max_batch_size=16", f"train.steps={STEPS}", "train.micro_batch_size=8", "train.lr=1e-3",
        "eval.every=0", "checkpoint.every=1", f"checkpoint.keep={STEPS}", "runtime.call_timeout_s=60",
        "runtime.lend_idle_cores=false", "reward.fns=[test_fsdp2_workflow:parity_reward]",
        "train.engine=fsdp2", "train.world_size=2", *overrides,
    ])  # fmt: skip


@pytest.mark.slow
def test_sync_rank_killed_then_resumed_trains_every_prompt_once(tmp_path, one_torch_thread):
    config = fsdp2_config(tmp_path, "workflow.mode=sync", "runtime.kind=inline")
    killed = {}
    with open_run(config) as run:

        def kill_rank_after_checkpoint_2():
            while not (tmp_path / "checkpoints" / "step_2" / "manifest.json").exists():
                time.sleep(0.01)
            killed["at"] = time.monotonic()
            os.kill(run.train_engine.ranks.pids[1], signal.SIGKILL)

        killer = threading.Thread(target=kill_rank_after_checkpoint_2, daemon=True)
        killer.start()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code -9 during"):
            run.train()
    assert time.monotonic() - killed["at"] < 30, "the run stopped within the timeout"
    assert run.step < STEPS

    with open_run(config, resume=True) as resumed:
        assert 2 <= resumed.step < STEPS
        history = resumed.train()
    assert resumed.step == STEPS and history[-1]["step"] == STEPS
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1)), "every step logged once"
    for r in rows[1:]:  # group ids follow data order: step s trained prompts (s-1)*PROMPTS .. s*PROMPTS-1
        first = (r["step"] - 1) * PROMPTS
        assert (r["data/group_id_min"], r["data/group_id_max"]) == (first, first + PROMPTS - 1), r
        assert r["rollout/samples"] == PROMPTS * GROUP and r["grad_norm"] > 0, r
    sharded = tmp_path / "checkpoints" / f"step_{STEPS}" / "sharded"
    assert sorted(p.name for p in sharded.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "weight_path", [[], ["runtime.weight_sync=torch_distributed", "weights.stage_on_driver=false"]],
    ids=["staged", "forwarded"],
)
def test_async_on_ray_with_rank_actors(tmp_path, ray_cluster, one_torch_thread, weight_path):
    """Staged (the default) or forwarded bucket by bucket from the ranks (`weights.stage_on_driver: false`, whose
    publish waits for the replica: it must be started before the first one), each version reaches the replica."""
    config = fsdp2_config(
        tmp_path, "workflow.mode=async", "workflow.max_staleness=1", "runtime.kind=ray", "train.steps=3",
        "checkpoint.every=0", *weight_path,
    )
    with open_run(config) as run:
        assert type(run.train_engine.ranks).__name__ == "RayRanks"
        history = run.train()
    rows = [h for h in history if "loss" in h]
    assert [h["step"] for h in rows] == [1, 2, 3] and run.version == 3
    assert all(h["rollout/samples"] == PROMPTS * GROUP and 0 <= h["staleness/max"] <= 1 for h in rows)
    assert all(h["grad_norm"] > 0 for h in rows)
    assert any(not math.isnan(h["weights/update_bytes"]) for h in rows), "the replica took a version"


@pytest.mark.slow
def test_ppo_with_a_critic_on_two_ranks_resumes_from_its_sharded_checkpoint_exactly(tmp_path, one_torch_thread):
    """PPO (`algo.advantage=gae`, a value head) on 2 FSDP2 ranks: the critic trains (value metrics every step) and
    lives in the sharded checkpoint; resuming from step 2 retrains steps 3..5 to bit-identical policy weights and
    the same metrics."""
    import shutil

    import torch
    from safetensors.torch import load_file

    config = fsdp2_config(tmp_path, "workflow.mode=sync", "runtime.kind=inline", "algo.advantage=gae")
    history = train(config).history
    rows = [h for h in history if "loss" in h]
    assert len(rows) == STEPS and all(r["value/loss"] > 0 and "value/explained_variance" in r for r in rows)
    assert all(r["value/grad_norm"] > 0 for r in rows)
    final = load_file(str(tmp_path / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    assert not any(k.startswith("critic.") for k in final), "model.safetensors is a plain policy"
    for step in range(3, STEPS + 1):
        shutil.rmtree(tmp_path / "checkpoints" / f"step_{step}")
    with open_run(config, resume=True) as resumed:
        assert resumed.step == 2
        again = [h for h in resumed.train() if "loss" in h]
    measured = ("time/", "throughput/", "wall_s", "memory/", "weights/update_")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(measured)}  # noqa: E731
    assert [strip(r) for r in again] == [strip(r) for r in rows[2:]]
    weights = load_file(str(tmp_path / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    assert all(torch.equal(weights[k], final[k]) for k in final)

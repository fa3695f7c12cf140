"""The workflow semantics of issue 4, tested on tiny real models.

- `stream` equals `sync`: the same rollouts, consumed whole (sync) or group by group in a random
  completion order while they are still being written (stream), end at the same parameters.
- `async` with `max_staleness = k`: over many steps with random generation and reward delays, no
  trained row is more than k versions older than the policy (the trainer checks every row and
  raises `StalenessError`), the bound is reached, and every step trains exactly its own rows.
- Ray runtime: a rollout replica killed in the middle of a run is restarted, the rows it held are
  generated again, and the run finishes with every row trained exactly once.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from asyncflow.api import open_run, train
from asyncflow.config import AlgoConfig, TrainConfig, build_config
from asyncflow.engines.base import register_inference_engine
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.models.loading import load_model
from asyncflow.runtime.ray_runtime import RolloutFailedError
from asyncflow.transfer import GroupSampler, TransferQueue
from asyncflow.weights.base import WeightSyncError
from asyncflow.workers.trainer import PolicyTrainer

GROUP, GROUPS, MAX_NEW = 4, 6, 12


def fixed_rollouts(vocab: int, seed: int = 0) -> list[dict]:
    """GROUPS x GROUP rows with varied prompt and response lengths, random log-probs and 0/1 rewards."""
    rng = random.Random(seed)
    rows = []
    for g in range(GROUPS):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        for k in range(GROUP):
            n = rng.randint(1, MAX_NEW)
            rows.append({
                "group": g, "k": k, "prompt": prompt,
                "response": [rng.randrange(3, vocab) for _ in range(n)],
                "logprobs": [-rng.random() * 3 for _ in range(n)],
                "reward": float(rng.random() < 0.5),
            })  # fmt: skip
    return rows


def train_one_step(model_path, rows, *, stream: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One optimizer step on `rows` through the queue (whole partition at once, or streamed); returns
    the accumulated gradients before the step and the parameters after it."""
    torch.manual_seed(0)
    engine = TorchTrainEngine(load_model(model_path), lr=TrainConfig().lr, packing="off")
    trainer = PolicyTrainer(engine, AlgoConfig(), micro_batch_size=8, temperature=1.0)
    queue = TransferQueue.local(tasks=["train"], timeout=30)
    queue.create_partition("step_0", num_rows=len(rows), group_size=GROUP)
    indices = queue.append(
        "step_0", {"prompt_ids": [torch.tensor(r["prompt"]) for r in rows]},
        group_ids=[r["group"] for r in rows], metadata=[{"answer": "", "sample_index": r["k"]} for r in rows],
    )

    def write(order):
        for i in order:
            r = rows[i]
            queue.write(
                "step_0", [indices[i]],
                {"response_ids": [torch.tensor(r["response"])], "rollout_logprobs": [torch.tensor(r["logprobs"])],
                 "reward": torch.tensor([r["reward"]])},
                weight_version=0,
            )  # fmt: skip
            if stream:
                time.sleep(0.002)

    if stream:  # responses complete in a random order while the trainer consumes group by group
        order = list(range(len(rows)))
        random.Random(1).shuffle(order)
        producer = threading.Thread(target=write, args=(order,))
        producer.start()
        per_batch = 1
    else:
        write(range(len(rows)))
        per_batch = GROUPS
    consumed, _ = trainer.train_partition(
        queue, "step_0", policy_version=0, max_staleness=0, group_size=GROUP, groups_per_batch=per_batch,
        max_new_tokens=MAX_NEW, timeout=30, sampler=GroupSampler(),
    )
    if stream:
        producer.join(30)
    assert len(consumed) == len(rows)
    grads = {name: p.grad.clone() for name, p in engine.model.named_parameters() if p.grad is not None}
    trainer.finish_step()
    return grads, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


@pytest.mark.slow
def test_stream_step_equals_sync_step(tiny_llama_path):
    vocab = load_model(tiny_llama_path).config.vocab_size
    rows = fixed_rollouts(vocab)
    sync_grads, synced = train_one_step(tiny_llama_path, rows, stream=False)
    stream_grads, streamed = train_one_step(tiny_llama_path, rows, stream=True)
    scale = max(float(g.abs().max()) for g in sync_grads.values())
    grad_diff = max(float((sync_grads[k] - stream_grads[k]).abs().max()) for k in sync_grads)
    assert grad_diff <= 1e-6 * scale, f"accumulated gradients differ by {grad_diff} (max |g| {scale})"
    # Adam's first step moves each parameter by about lr * g / (|g| + eps), so a summation-order
    # difference in an element with |g| near eps shows up in proportion to lr (1e-3 gives ~5e-6).
    initial = load_model(tiny_llama_path).state_dict()
    moved = max(float((synced[k] - initial[k]).abs().max()) for k in synced)
    assert moved > 1e-5, "the step must actually change the parameters"
    diff = max(float((synced[k] - streamed[k]).abs().max()) for k in synced)
    assert diff <= 1e-6, f"stream and sync steps differ by {diff}"


# ---------------------------------------------------------------- async staleness under random delays
class JitteryEngine(TorchInferenceEngine):
    """The torch engine with a random pause before each completion is handed out."""

    def generate(self, requests, params):
        rng = random.Random(self.weight_version)
        for completion in super().generate(requests, params):
            time.sleep(rng.random() * 0.01)
            yield completion


@register_inference_engine("test_jittery_torch")
def make_jittery_engine(*, model_path, **kwargs):
    return JitteryEngine.from_pretrained(model_path, **kwargs)


def make_slow_start_engine(*, model_path, **kwargs):
    time.sleep(60)  # longer than the test's runtime.start_timeout_s
    return JitteryEngine.from_pretrained(model_path, **kwargs)


def jittery_reward(completion: str, ground_truth: str, **metadata) -> float:
    time.sleep(random.random() * 0.004)
    return float(completion.strip() == ground_truth.strip())


def flaky_reward(completion: str, ground_truth: str, **metadata) -> float:
    if random.random() < 0.3:
        raise ValueError("flaky verifier")
    return float(completion.strip() == ground_truth.strip())


def short_config(tmp_path, *overrides: str):
    return build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.max_batch_size=8",
        "train.micro_batch_size=8", "eval.every=0", "data.test_size=4", "checkpoint.every=0",
        "runtime.call_timeout_s=60", "runtime.kind=inline", *overrides,
    ])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_async_respects_staleness_bound_under_random_delays(tmp_path, k):
    steps = 10
    config = short_config(
        tmp_path, f"train.steps={steps}", "workflow.mode=async", f"workflow.max_staleness={k}",
        "rollout.engine=test_jittery_torch", "reward.fns=[test_workflows:jittery_reward]",
    )
    with open_run(config) as run:
        history = run.train()  # raises StalenessError if any trained row breaks the bound
    rows = [h for h in history if "staleness/max" in h]
    assert len(rows) == steps
    assert all(0 <= h["staleness/max"] <= k for h in rows)
    assert max(h["staleness/max"] for h in rows) >= 1, "rollout never ran ahead of training"
    assert all(h["rollout/samples"] == 16 for h in rows), "each step trains exactly its own 4 x 4 rows"
    assert run.version == steps


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "stream"])
def test_on_policy_modes_train_fresh_rows(tmp_path, mode):
    config = short_config(tmp_path, "train.steps=3", f"workflow.mode={mode}")
    history = train(config).history
    assert [h["staleness/max"] for h in history if "staleness/max" in h] == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- faults on the Ray runtime
def kill_replica_at_step(ray_cluster, run, step: int, *, restart: bool) -> tuple[threading.Thread, dict]:
    """Kill replica `rollout_0` from a thread once `run` reaches `step`; the dict gets the kill's wall time as "at"."""
    killed = {}

    def kill():
        while run.step < step:
            time.sleep(0.05)
        killed["at"] = time.time()
        ray_cluster.kill(run.runtime.actors["rollout_0"], no_restart=not restart)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread, killed


@pytest.mark.slow
def test_killed_rollout_replica_is_restarted_and_no_row_is_lost(tmp_path, ray_cluster):
    steps, per_step = 6, 16
    config = short_config(
        tmp_path, f"train.steps={steps}", "workflow.mode=async", "workflow.max_staleness=1",
        "runtime.kind=ray", "rollout.replicas=2", "runtime.rollout_cpus=0.5", "runtime.max_restarts=2",
        "rollout.max_new_tokens=24", "reward.fns=[test_workflows:flaky_reward]",
    )
    with open_run(config) as run:
        killer, killed = kill_replica_at_step(ray_cluster, run, 2, restart=True)
        history = run.train()
    killer.join(10)
    assert killed, "the replica was never killed"
    assert run.runtime.restarts >= 1
    trained = [h["rollout/samples"] for h in history if "rollout/samples" in h]
    assert trained == [per_step] * steps, "every step trains all of its rows exactly once"
    events = run.timeline.events
    restart = [e for e in events if e["worker"] == "rollout_0" and e["name"] == "restart"]
    assert restart and restart[0]["start_s"] >= killed["at"], "the restart is on the timeline"
    after = [e for e in events if e["worker"] == "rollout_0" and e["kind"] == "span" and e["start_s"] > killed["at"]]
    assert after, "the restarted replica generated again (its spans reached the driver)"
    errors = [h["reward/errors_total"] for h in history if "rollout/samples" in h]
    assert errors[-1] > 0 and errors == sorted(errors), f"reward errors carry over the restart: {errors}"


@pytest.mark.slow
def test_replica_past_its_restarts_fails_the_run_at_once(tmp_path, ray_cluster):
    config = short_config(
        tmp_path, "train.steps=50", "workflow.mode=async", "runtime.kind=ray", "runtime.max_restarts=0",
        "runtime.call_timeout_s=120",
    )
    with open_run(config) as run:
        _, killed = kill_replica_at_step(ray_cluster, run, 2, restart=False)
        with pytest.raises(RolloutFailedError, match=r"rollout replicas died 1 times \(runtime.max_restarts\)"):
            run.train()
    assert time.time() - killed["at"] < 60, "the trainer stops waiting as soon as the replica is gone, not at its 120 s"


@pytest.mark.slow
def test_a_replica_that_does_not_start_in_time_is_named(tmp_path, ray_cluster):
    """Starting (the engine's construction) has its own budget, `runtime.start_timeout_s`: past it, one error naming
    the replica, not a bare Ray timeout."""
    config = short_config(tmp_path, "train.steps=2", "workflow.mode=stream", "runtime.kind=ray",
                          "rollout.engine=test_workflows:make_slow_start_engine", "runtime.start_timeout_s=5")
    start = time.monotonic()
    with pytest.raises(RolloutFailedError, match=r"rollout_0 did not start within 5 s \(runtime.start_timeout_s"):
        train(config)
    assert time.monotonic() - start < 45, "the run ends at the start budget, not after the engine's start"


@pytest.mark.slow
def test_torch_distributed_weight_sync_runs_and_refuses_a_restarted_replica(tmp_path, ray_cluster):
    """Weights reach the replica by gloo broadcast for the first steps; a killed replica could not rejoin the
    process group, so the run stops at once with an error that names the transports that survive restarts."""
    config = short_config(
        tmp_path, "train.steps=50", "workflow.mode=async", "workflow.max_staleness=1", "runtime.kind=ray",
        "runtime.weight_sync=torch_distributed", "runtime.max_restarts=2", "runtime.call_timeout_s=120",
    )
    with open_run(config) as run:
        _, killed = kill_replica_at_step(ray_cluster, run, 3, restart=True)
        refused = "torch_distributed cannot take a restarted replica.*shared_memory"
        # whichever sees the death first names it: the supervisor (the replica's call failed) or the publisher (its
        # broadcast lost the receiver)
        with pytest.raises((RolloutFailedError, WeightSyncError), match=refused):
            run.train()
    assert time.time() - killed["at"] < 60, "stopped at once, not at runtime.call_timeout_s (120 s)"
    # with k=1, partition 2 could only be generated with version >= 1: it came over gloo
    assert run.step >= 3


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_separated_stream_trainer_borrows_the_waiting_replicas_core(tmp_path, ray_cluster, replicas):
    config = short_config(
        tmp_path, "train.steps=4", "workflow.mode=stream", "runtime.kind=ray", "runtime.num_cpus=2",
        "train.micro_batch_size=4", f"rollout.replicas={replicas}", f"runtime.rollout_cpus={1 / replicas}",
    )
    before = torch.get_num_threads()
    with open_run(config) as run:
        history = run.train()
    assert [h["staleness/max"] for h in history if "staleness/max" in h] == [0.0] * 4, "every replica is on-policy"
    threads = [e["args"]["threads"] for e in run.timeline.events if e["name"] == "train_micro_batch"]
    assert len(threads) == 4 * 4
    assert max(threads) == 2, "after generation ends the replicas wait for weights: the trainer uses both cores"
    assert torch.get_num_threads() == before, "the run hands torch's thread count back as it found it"


# ---------------------------------------------------------------- stale rows and their behaviour policy
@pytest.mark.parametrize(("setting", "row_version", "clipped"), [
    ("rollout", 0, True),  # stale row: ratio against the recorded (far-off) log-probs, so the clip bites (A > 0)
    ("policy", 0, False),  # stale row trained as if on-policy: ratio 1
    ("rollout", 1, False),  # fresh row: always the current policy
])  # fmt: skip
@pytest.mark.slow
def test_stale_rows_use_their_behaviour_policy(tiny_llama_path, setting, row_version, clipped):
    from asyncflow.workers.rollout import Rollout
    from asyncflow.workers.trainer import assign_advantages

    vocab = load_model(tiny_llama_path).config.vocab_size
    rows = [
        Rollout(r["group"], r["k"], r["prompt"], r["response"], [-8.0] * len(r["response"]), "stop", row_version, "",
                reward=r["reward"])
        for r in fixed_rollouts(vocab)
    ]  # fmt: skip
    algo = AlgoConfig(stale_old_logprobs=setting)
    groups = [[r for r in rows if r.group_id == g] for g in range(GROUPS)]
    assign_advantages(groups, algo, MAX_NEW)
    engine = TorchTrainEngine(load_model(tiny_llama_path), lr=1e-4)
    trainer = PolicyTrainer(engine, algo, micro_batch_size=8, temperature=1.0)
    trainer.accumulate(rows, policy_version=1)
    stats = trainer.finish_step()
    assert (stats["clip_fraction"] > 0.1) == clipped, stats["clip_fraction"]  # ratio 1 clips nothing

"""Soak run of `async` (k=1) in its default deployment, under faults: no row lost or duplicated, the
staleness bound never exceeded, thread count and /dev/shm flat.

Owns nothing the library uses. One run in this process: a local Ray cluster, one rollout replica (an
actor that scores its own responses), weights through /dev/shm, the trainer borrowing the replica's
idle core, a checkpoint every `--checkpoint-every` steps. Faults: the reward raises on 5% of the
samples (`--fail`), and the replica is killed (SIGKILL of its process, by `ray.kill`) at a third and at
two thirds of the run; Ray restarts it and the rows it held are generated again.

Checked and printed:
- rows: every (group id, sample index) the trainer received, from a wrapper around
  `PolicyTrainer.train_partition`: each of the N x G rows of the N prompts drawn exactly once;
- staleness: policy version minus the row's weight version, for every trained row (the trainer also
  raises `StalenessError` beyond the bound);
- threads: of the driver and of the replica's process (whichever incarnation is alive), after each step;
- /dev/shm: bytes and files of this run's segments (named after this process), and in all, after each step;
- reward failures: the run's `reward/errors_total` against the rows scored.

Run: PYTHONPATH=src .venv/bin/python benchmarks/soak_async.py [--steps 80] [--prompts 16] [--group 8]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])
FAIL_RATE = float(os.environ.get("SOAK_REWARD_FAIL", "0.05"))


def flaky_numeric_match(completion: str, ground_truth: str, **metadata) -> float:
    """`numeric_match` that raises on a `SOAK_REWARD_FAIL` fraction of the samples."""
    if random.random() < FAIL_RATE:
        raise RuntimeError("soak: injected reward failure")
    from asyncflow.rewards.verifiers import numeric_match

    return numeric_match(completion, ground_truth)


def threads_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def replica_pids() -> list[int]:
    """Processes of rollout actors descending from this one (its local Ray cluster), not other jobs' actors."""
    parent, title = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_bytes()
                parent[int(entry.name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
                title[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                continue

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return [pid for pid, cmd in title.items() if b"RolloutActor" in cmd and ours(pid)]


def shm_usage() -> tuple[int, int, int]:
    """(bytes of this process's asyncflow segments, their count, bytes of all files in /dev/shm)."""
    mine = total = count = 0
    tag = f"-{os.getpid()}."
    for entry in os.scandir("/dev/shm"):
        try:
            size = entry.stat().st_size
        except OSError:
            continue
        total += size
        if entry.name.startswith("asyncflow-") and tag in entry.name:
            mine, count = mine + size, count + 1
    return mine, count, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--output", default=None, help="run folder (default: a temporary one)")
    args = parser.parse_args()

    import ray

    from asyncflow.api import open_run
    from asyncflow.config import build_config

    out = args.output or tempfile.mkdtemp(prefix="soak_async_")
    k = 1
    config = build_config({}, [
        f"run.output_dir={out}", "run.progress=false", "model.path=preset:tiny-llama", "data.task=arithmetic",
        "data.test_size=16", "reward.fns=[soak_async:flaky_numeric_match]", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group}", "rollout.max_new_tokens=8", "rollout.max_batch_size=128",
        f"train.steps={args.steps}", "train.micro_batch_size=128", "eval.every=0",
        f"checkpoint.every={args.checkpoint_every}", "checkpoint.keep=2", "workflow.mode=async",
        f"workflow.max_staleness={k}", "runtime.kind=ray", "runtime.num_cpus=2", "runtime.max_restarts=4",
        "runtime.call_timeout_s=300",
    ])  # fmt: skip
    with open_run(config) as run:

        trained: Counter = Counter()
        staleness: list[int] = []
        train_partition = run.trainer.train_partition

        def counting_train_partition(queue, partition, **kwargs):
            rollouts, stats = train_partition(queue, partition, **kwargs)
            trained.update(r.row_id for r in rollouts)
            staleness.extend(kwargs["policy_version"] - r.weight_version for r in rollouts)
            return rollouts, stats

        run.trainer.train_partition = counting_train_partition

        samples: list[dict] = []
        workflow = run.workflow
        step = workflow.step

        def sampled_step(*args):
            result = step(*args)
            mine, count, total = shm_usage()
            samples.append({
                "step": run.step, "driver_threads": threads_of(os.getpid()),
                "replica_threads": sum(threads_of(p) for p in replica_pids()), "shm_mine": mine, "shm_files": count,
                "shm_total": total,
            })  # fmt: skip
            return result

        workflow.step = sampled_step
        kills = [args.steps // 3, 2 * args.steps // 3]
        killed: list[tuple[int, float]] = []

        def killer():
            for at in kills:
                while run.step < at:
                    time.sleep(0.05)
                ray.kill(run.runtime.actors["rollout_0"], no_restart=False)
                killed.append((run.step, time.time()))

        threading.Thread(target=killer, daemon=True).start()
        t0 = time.time()
        history = run.train()
        wall = time.time() - t0
    after_close = shm_usage()

    steps = [h for h in history if "loss" in h]
    drawn = run.next_group_id
    expected = {(g, s) for g in range(drawn) for s in range(args.group)}
    lost = len(expected - set(trained))
    duplicated = sum(n - 1 for n in trained.values() if n > 1)
    extra = len(set(trained) - expected)
    errors = steps[-1]["reward/errors_total"]
    warm = samples[2:] or samples  # after the first steps (threads and pools start up)

    def span(key: str) -> str:
        values = [s[key] for s in warm if s[key]]  # replica threads: 0 while it restarts
        return f"first {values[0]}, last {values[-1]}, min {min(values)}, max {max(values)}"

    print(f"\nsoak: async k={k}, {args.steps} steps x {args.prompts} prompts x {args.group} samples, "
          f"reward failing {FAIL_RATE:.0%}, replica killed at steps {[s for s, _ in killed]}; wall {wall:.0f} s")
    print(f"rows trained: {sum(trained.values())} ({len(trained)} distinct) of {len(expected)} drawn "
          f"({drawn} prompts); lost {lost}, duplicated {duplicated}, not drawn {extra}")
    print(f"staleness: max {max(staleness)} (bound {k}), mean {statistics.mean(staleness):.3f}; "
          f"per step max {max(h['staleness/max'] for h in steps):.0f}")
    print(f"replica restarts: {run.runtime.restarts}; reward errors {errors:.0f} "
          f"({errors / max(1, sum(trained.values())):.2%} of the rows trained; rows regenerated after a kill "
          "are scored again, and a dead replica's last unpolled counts are lost)")
    print(f"driver threads ({len(warm)} samples from step {warm[0]['step']}): {span('driver_threads')}")
    print(f"replica threads (while alive): {span('replica_threads')}")
    print(f"/dev/shm, this run's segments: bytes {span('shm_mine')}; files {span('shm_files')}; "
          f"after close {after_close[0]} bytes in {after_close[1]} files")
    print(f"/dev/shm, all files (other jobs included): {span('shm_total')}")
    ok = not lost and not duplicated and not extra and max(staleness) <= k and len(killed) == 2
    ok = ok and run.runtime.restarts == 2 and after_close[1] == 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

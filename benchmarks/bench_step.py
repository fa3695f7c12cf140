"""Benchmark: where each millisecond of a main-job RL step goes, at this commit and side by side at another.

Owns nothing the library imports. Runs `--steps` RL steps of the main job's configuration
(`examples/arithmetic_grpo.yaml`, one torch thread as `scripts/train.sh`) in a child process, starting from one
SFT model made once by this commit's code (`--sft-steps` warm-up steps; `--sft-model` reuses a model folder), and
times the run's own functions: each call is charged to one bucket (generation's prefill, decode, sampling and KV
compaction; log-prob forward, loss, backward, optimizer; queue calls; rewards; prompts; evaluation; metrics;
timeline; checkpoint ...) with the time of the buckets called inside it taken out, so the buckets of a step add up
to the step. Inside evaluation and checkpoints the buckets are named after them (`evaluation > generate: decode`).
Times are process CPU time of the one thread that runs the job (steady on a loaded machine, where wall time also
counts other jobs' turns on the cores), and the wall time of the step loop is printed beside them.
A target missing at the other commit counts nothing there.

`--baseline-ref REF` exports `REF`'s `src/` (`git archive`) into a temporary folder and runs the same profile with
that `PYTHONPATH`, alternating with this commit's runs (`--repeats` each, the order flipped every repeat, so load
changes hit both alike); it prints both tables, their medians, and the ratio baseline / current per bucket.
`--cprofile K` adds one cProfile run per commit and prints its top K functions by own time (the Python overhead;
cProfile slows Python-heavy code, so its times are not the table's).

    PYTHONPATH=src python benchmarks/bench_step.py                              # 30 steps, this commit
    PYTHONPATH=src python benchmarks/bench_step.py --baseline-ref HEAD~3 --repeats 2
    PYTHONPATH=src python benchmarks/bench_step.py --steps 50 --cprofile 25
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "arithmetic_grpo.yaml"
CHILD_TIMEOUT_S = 1800

# (bucket, "module:attribute.path", scope): a scope names the buckets called inside it after itself.
TARGETS = [
    ("run loop (other)", "asyncflow.workflow.run:RLRun._train", False),
    ("workflow start", "asyncflow.workflow.pipeline:PipelineWorkflow.start", True),
    ("prompts: sample, encode, write", "asyncflow.workflow.pipeline:PipelineWorkflow.put_prompts", False),
    ("generate: loop, requests (python)", "asyncflow.workers.rollout:RolloutWorker.run_partition", False),
    ("generate: prefill", "asyncflow.engines.torch_inference:TorchInferenceEngine._prefill", False),
    ("generate: decode", "asyncflow.engines.torch_inference:TorchInferenceEngine._decode", False),
    ("generate: sampling", "asyncflow.engines.torch_inference:TorchInferenceEngine._append", False),
    ("generate: KV compaction", "asyncflow.engines.torch_inference:SlotKVCache.move_rows", False),
    ("rewards", "asyncflow.workers.reward:RewardWorker.run_partition", False),
    ("rewards", "asyncflow.workers.reward:RewardWorker.score", False),
    ("rewards", "asyncflow.workers.reward:RewardWorker.score_ids", False),
    ("train: rows, advantages (python)", "asyncflow.workers.trainer:PolicyTrainer.train_partition", False),
    ("train: micro-batch tensors (python)", "asyncflow.workers.trainer:PolicyTrainer._micro_batch", False),
    ("train: packing plan", "asyncflow.models.tri_model:plan_shared_prompt", False),
    ("train: log-prob forward", "asyncflow.engines.torch_train:tri_model_logprobs", False),
    ("train: loss", "asyncflow.workers.trainer:PolicyLoss.__call__", False),
    ("train: backward", "torch.autograd:backward", False),
    ("train: optimizer step", "asyncflow.engines.torch_train:TorchTrainEngine.optimizer_step", False),
    ("train: finish step (python)", "asyncflow.workers.trainer:PolicyTrainer.finish_step", False),
    ("publish weights", "asyncflow.workflow.pipeline:PipelineWorkflow.publish", False),
    ("evaluation", "asyncflow.workflow.run:RLRun.evaluate", True),
    ("metrics", "asyncflow.workflow.run:RLRun._log", False),
    ("metrics", "asyncflow.workflow.run:RLRun._throughput", False),
    ("metrics", "asyncflow.workflow.run:memory_metrics", False),
    ("timeline", "asyncflow.observe.timeline:Timeline.add_span", False),
    ("timeline", "asyncflow.observe.timeline:Timeline.instant", False),
    ("checkpoint", "asyncflow.workflow.run:RLRun.save", True),
    ("end of run", "asyncflow.workflow.run:write_reports", True),
    ("end of run", "asyncflow.workflow.run:export_run", True),
]
for _name in ("write", "append", "request", "get", "create_partition", "ack", "clear", "status", "seal"):
    TARGETS.append(("queue calls", f"asyncflow.transfer.client:TransferQueue.{_name}", False))
NOT_PER_STEP = ("workflow start", "end of run")  # once per run: printed apart from the step's buckets


class Buckets:
    """Exclusive CPU and wall time per bucket: a call's time minus the time of the wrapped calls inside it."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []  # [label, cpu0, wall0, child_cpu, child_wall]

    def wrap(self, label: str, fn, scope: bool):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            scoped = next((frame[0] for frame in reversed(self.stack) if frame[5]), None)
            name = label if scoped is None or scoped == label else f"{scoped} > {label}"
            frame = [name, time.thread_time(), time.perf_counter(), 0.0, 0.0, scope]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                cpu, wall = time.thread_time() - frame[1], time.perf_counter() - frame[2]
                self.cpu[name] = self.cpu.get(name, 0.0) + cpu - frame[3]
                self.wall[name] = self.wall.get(name, 0.0) + wall - frame[4]
                self.calls[name] = self.calls.get(name, 0) + 1
                if self.stack:
                    self.stack[-1][3] += cpu
                    self.stack[-1][4] += wall

        return timed

    def install(self) -> list[str]:
        """Wrap every target that exists in the imported code; -> the targets that do not."""
        import threading

        main = threading.main_thread()
        missing = []
        for label, target, scope in TARGETS:
            module_name, path = target.split(":")
            try:
                owner = importlib.import_module(module_name)
                *parents, attr = path.split(".")
                for part in parents:
                    owner = getattr(owner, part)
                fn = getattr(owner, attr)
            except (ImportError, AttributeError):
                missing.append(target)
                continue
            timed = self.wrap(label, fn, scope)

            def on_main(*args, _fn=fn, _timed=timed, **kwargs):  # other threads' calls are not this step's
                return (_timed if threading.current_thread() is main else _fn)(*args, **kwargs)

            setattr(owner, attr, functools.wraps(fn)(on_main))
        return missing


def child(args) -> None:
    """One profiled run in this process (the `PYTHONPATH` the parent chose); writes its figures to `args.child`."""
    import torch

    import asyncflow

    torch.set_num_threads(1)
    buckets = Buckets()
    missing = buckets.install()
    out = tempfile.mkdtemp(prefix="bench_step_")
    config = asyncflow.load_config(str(CONFIG), [
        f"run.output_dir={out}", "run.progress=false", f"run.seed={args.seed}", "sft.before_rl=false",
        f"model.path={args.sft_model}", f"train.steps={args.steps}",
    ])
    profile = None
    if args.cprofile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    t0 = time.perf_counter()
    try:
        result = asyncflow.train(config, overwrite=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    wall = time.perf_counter() - t0
    top = []
    if profile is not None:
        import io
        import pstats

        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        top = text.getvalue().splitlines()
    json.dump({"cpu": buckets.cpu, "wall": buckets.wall, "calls": buckets.calls, "missing": missing,
               "train_wall_s": wall, "eval": [row.get("eval/accuracy") for row in result.history
                                              if "eval/accuracy" in row], "cprofile": top},
              open(args.child, "w"))


def run_child(src: Path, args, *, cprofile: int = 0) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", out.name, "--steps", str(args.steps),
                   "--seed", str(args.seed), "--sft-model", str(args.sft_model), "--cprofile", str(cprofile)]
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        subprocess.run(command, env=env, check=True, timeout=CHILD_TIMEOUT_S, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def make_sft_model(args, folder: Path) -> Path:
    """This commit's SFT warm-up, `--sft-steps` steps, into `folder` (every compared run starts from it)."""
    code = ("import torch, asyncflow; torch.set_num_threads(1); "
            f"c = asyncflow.load_config({str(CONFIG)!r}, ['run.output_dir={folder / 'run'}', 'run.progress=false', "
            f"'run.seed={args.seed}', 'sft.steps={args.sft_steps}']); asyncflow.sft(c)")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=True,
                   timeout=CHILD_TIMEOUT_S, stdout=subprocess.DEVNULL)
    return folder / "run" / "sft"


def export_ref(ref: str, folder: Path) -> Path:
    """`ref`'s `src/` exported into `folder` (a `git archive`, no worktree is registered); -> its src path."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], check=True, capture_output=True,
                             timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True, timeout=120)
    return folder / "src"


def median_of(runs: list[dict], key: str, label: str) -> float:
    return statistics.median(run[key].get(label, 0.0) for run in runs)


def print_table(results: dict[str, list[dict]], steps: int) -> None:
    names = list(results)
    labels = sorted({label for runs in results.values() for run in runs for label in run["cpu"]},
                    key=lambda label: -median_of(results[names[-1]], "cpu", label))
    per_step = [label for label in labels if not label.startswith(NOT_PER_STEP)]
    header = " | ".join(f"{name} ms/step" for name in names)
    ratio = " | baseline / current" if len(names) == 2 else ""
    print(f"\nCPU ms per RL step (median of {len(results[names[0]])} runs of {steps} steps; calls per step of "
          f"the last column)\n| bucket | calls/step | {header}{ratio} |")
    print("|---" * (2 + len(names) + bool(ratio)) + "|")

    def row(label: str, values: list[float], calls: float | str) -> None:
        cells = " | ".join(f"{v:.1f}" for v in values)
        r = f" | {values[0] / values[1]:.2f}" if ratio and values[1] > 0 else (" | -" if ratio else "")
        print(f"| {label} | {calls} | {cells}{r} |")

    for label in per_step:
        values = [1000 * median_of(results[n], "cpu", label) / steps for n in names]
        calls = statistics.median(run["calls"].get(label, 0) for run in results[names[-1]]) / steps
        row(label, values, f"{calls:.2f}")
    totals = [1000 * statistics.median(sum(v for k, v in run["cpu"].items() if not k.startswith(NOT_PER_STEP))
                                       for run in results[n]) / steps for n in names]
    row("**step total (CPU)**", totals, "")
    walls = [1000 * statistics.median(sum(v for k, v in run["wall"].items() if not k.startswith(NOT_PER_STEP))
                                      for run in results[n]) / steps for n in names]
    row("step total (wall)", walls, "")
    for label in [label for label in labels if label.startswith(NOT_PER_STEP)]:
        row(f"{label} (ms per run)", [1000 * median_of(results[n], "cpu", label) for n in names], "")
    for name in names:
        missing = results[name][0]["missing"]
        evals = sorted({tuple(run["eval"]) for run in results[name]})
        print(f"{name}: held-out accuracy at the evaluated steps {evals}"
              + (f"; not in this code: {', '.join(missing)}" if missing else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run (evaluation every 25, as the job)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per commit, alternating")
    parser.add_argument("--baseline-ref", help="a git ref profiled side by side (its src/ exported)")
    parser.add_argument("--sft-steps", type=int, default=200, help="SFT warm-up steps of the model RL starts from")
    parser.add_argument("--sft-model", help="an SFT model folder to start from (no warm-up is run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", type=int, default=0, help="also one cProfile run per commit: top K functions")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        if args.sft_model is None:
            args.sft_model = make_sft_model(args, Path(tmp))
        sources = {"current": ROOT / "src"}
        if args.baseline_ref:
            (Path(tmp) / "baseline").mkdir()
            sources = {f"baseline {args.baseline_ref}": export_ref(args.baseline_ref, Path(tmp) / "baseline"),
                       **sources}
        results: dict[str, list[dict]] = {name: [] for name in sources}
        for repeat in range(args.repeats):
            order = list(sources) if repeat % 2 == 0 else list(reversed(sources))
            for name in order:
                t0 = time.perf_counter()
                results[name].append(run_child(sources[name], args))
                print(f"run {repeat + 1}/{args.repeats} {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        print_table(results, args.steps)
        if args.cprofile:
            for name, src in sources.items():
                print(f"\ncProfile, {name} (top {args.cprofile} by own time):")
                print("\n".join(run_child(src, args, cprofile=args.cprofile)["cprofile"]))


if __name__ == "__main__":
    main()

"""Peak resident memory of the driver process of an async run on Ray, for this checkout and (optionally) another.

The driver holds the policy being trained; rollout replicas (Ray actors) hold the inference engines. This
measures what the driver itself keeps (with one held-out prompt, so each checkout builds what evaluation
needs): each run trains in a fresh process, which prints its peak RSS
(`getrusage(RUSAGE_SELF).ru_maxrss`, the driver alone: Ray's processes are not counted) and the policy's size.

    .venv/bin/python benchmarks/bench_driver_memory.py                        # this checkout
    git worktree add /tmp/asyncflow-before <commit>
    .venv/bin/python benchmarks/bench_driver_memory.py --before-src /tmp/asyncflow-before/src

With `--before-src`, both run side by side (alternating, `--repeats` each) and the difference is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def child(args) -> None:
    """Train `--steps` async steps on Ray in this process; print peak RSS and the policy's parameter bytes."""
    import resource

    import torch

    from asyncflow.config import build_config

    try:
        from asyncflow.api import open_run
    except ImportError:  # a checkout from before `open_run` built its runs directly
        from asyncflow.workflow.run import RLRun

        def open_run(config):
            return contextlib.closing(RLRun(config))

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        config = build_config({}, [
            f"run.output_dir={out}", "run.progress=false", f"model.path={args.model}", "workflow.mode=async",
            "runtime.kind=ray", "runtime.num_cpus=2", "rollout.prompts_per_step=8", "rollout.group_size=4",
            "rollout.max_new_tokens=8", "train.micro_batch_size=32", f"train.steps={args.steps}", "eval.every=0",
            "data.test_size=1", "checkpoint.every=0", "observe.tensorboard=false", "export.at_end=false",
        ])  # fmt: skip
        with open_run(config) as run:
            policy_bytes = sum(t.numel() * t.element_size() for t in run.train_engine.state_dict().values())
            try:
                from asyncflow.workflow.pipeline import make_workflow  # checkouts before the explicit wiring
            except ImportError:
                run.train()
            else:
                run.train(make_workflow(config, run))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_rss_mb": round(peak_mb, 1), "policy_mb": round(policy_bytes / 2**20, 1)}))


def measure(src: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:small-llama")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--before-src", type=Path, help="the src/ folder of another checkout to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sources = {"this": SRC, **({"before": args.before_src.resolve()} if args.before_src else {})}
    results: dict[str, list[dict]] = {name: [] for name in sources}
    for repeat in range(args.repeats):
        for name, src in sources.items():
            results[name].append(measure(src, args))
            print(json.dumps({"checkout": name, "repeat": repeat, **results[name][-1]}), flush=True)
    summary = {name: min(r["peak_rss_mb"] for r in rows) for name, rows in results.items()}
    line = {"model": args.model, "policy_mb": results["this"][0]["policy_mb"], "peak_rss_mb_min": summary}
    if "before" in summary:
        line["saved_mb"] = round(summary["before"] - summary["this"], 1)
    print(json.dumps(line))


if __name__ == "__main__":
    main()

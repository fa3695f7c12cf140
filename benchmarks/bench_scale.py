"""The real-size rehearsal's path (scripts/rehearsal.py: examples/rehearsal_0.5b.yaml on three `ray start` nodes:
vLLM in bf16, FSDP2 of 2 ranks, `async` k=1, the `torch_distributed` weight path, a checkpoint each step, an export) at
several model sizes, without the kill. Per size it prints the peak resident memory of the driver, of each rank and of
each replica's processes beside the bytes each should hold (weights, gradients, AdamW shard, KV cache), seconds per
step of generate / train / weight update / checkpoint, weight-update bytes and seconds, the checkpoint's and the
export's bytes and the export's own seconds and peak memory (a separate `asyncflow export` of the last checkpoint).
With `--plan`, each size is then profiled (`asyncflow profile` of the same config, its FSDP2 ranks as local
processes) and `asyncflow plan`'s simulator predicts the run's step time from that profile and the run's own prompt
and response lengths, beside the median `time/step_s` the run measured.

    .venv-vllm/bin/python benchmarks/bench_scale.py --sizes 30m,166m          # 0.5b: ~12 GB free and a long time
    .venv-vllm/bin/python benchmarks/bench_scale.py --sizes 166m \
        --variant weights.stage_on_driver=true --variant weights.stage_on_driver=false   # each size once per variant

Sizes: `30m` (preset:qwen2.5-small, 30.7M parameters), `166m` (qwen2.5-0.5b-2l), `0.5b` (qwen2.5-0.5b). CONFIG
overrides follow the options; each `--variant` (space-separated overrides) runs every size once more with its own
overrides added, one after the other in the same invocation. A guard stops a size when the machine's available
memory falls under `--min-free-gb`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from rehearsal import EXAMPLE, folder_bytes, rehearse, rows  # noqa: E402  (the rehearsal's run and checks)

SIZES = {"30m": "preset:qwen2.5-small", "166m": "preset:qwen2.5-0.5b-2l", "0.5b": "preset:qwen2.5-0.5b"}
MIB = 2**20
# `asyncflow profile` runs the trainer as the run does (FSDP2 ranks, bf16, the token budget) but on this host's
# processes: no Ray nodes, an in-process queue, the built-in engine for generation (a few percent of a step here)
PROFILE_PLACEMENT = ["runtime.kind=inline", "runtime.rollout_resources={}", "runtime.trainer_resources={}",
                     "runtime.weight_sync=shared_memory", "weights.stage_on_driver=true"]


def available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def kill_descendants() -> None:
    """SIGKILL every process descended from this one."""
    parents: dict[int, int] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(line for line in status.read_text().splitlines() if line.startswith("PPid:"))
            parents[int(status.parent.name)] = int(ppid.split()[1])
        except (OSError, StopIteration, ValueError):
            continue
    mine, grew = {os.getpid()}, True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in mine} - mine
        grew = bool(found)
        mine |= found
    for pid in mine - {os.getpid()}:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def theoretical_mib(model: str, world: int, kv_cache_gb: float) -> dict[str, float]:
    """Bytes each role should hold (MiB), from the parameter count: fp32 master weights, gradients and AdamW's two
    moments sharded over `world` ranks; a bf16 vLLM replica's weights plus its KV cache; what one version is in
    bf16 (what the weight path carries)."""
    from asyncflow.models.loading import model_on_meta, resolve_model_path

    params = sum(p.numel() for p in model_on_meta(resolve_model_path(model)).parameters())
    return {"parameters": params, "rank_weights": 4 * params / world / MIB, "rank_grads": 4 * params / world / MIB,
            "rank_adamw": 8 * params / world / MIB, "rank_total": 16 * params / world / MIB,
            "replica_weights_bf16": 2 * params / MIB, "replica_kv_cache": kv_cache_gb * 1024,
            "version_bf16": 2 * params / MIB, "version_fp32": 4 * params / MIB}


def export_once(run_dir: Path, out: Path) -> dict[str, float]:
    """`asyncflow export` of the run's last checkpoint in a process of its own: its seconds and peak memory."""
    # VmHWM of the child itself: `ru_maxrss` would carry the parent's peak across the fork and exec
    code = ("import json, time; from pathlib import Path; from asyncflow.workflow.export import export_run; "
            "hwm = lambda: int(next(l for l in Path('/proc/self/status').read_text().splitlines() "
            "if l.startswith('VmHWM')).split()[1]) / 1024; before = hwm(); t = time.monotonic(); "
            f"export_run({str(run_dir)!r}, {str(out)!r}); "
            "print(json.dumps({'s': time.monotonic() - t, 'peak_mb': hwm(), 'grew_mb': hwm() - before}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"export_s": round(result["s"], 1), "export_peak_mb": round(result["peak_mb"]),
            "export_grew_mb": round(result["grew_mb"]),
            "export_mb": round(folder_bytes(out) / MIB, 1)}


def measure(size: str, overrides: list[str], output: Path, min_free_gb: float) -> dict[str, Any]:
    """One run of the rehearsal at `size` with `overrides`, in `output / size`; its figures."""
    from asyncflow.config import load_config

    model = SIZES[size]
    settings = load_config(str(EXAMPLE), [f"model.path={model}", *overrides])
    theory = theoretical_mib(model, settings.train.world_size, settings.rollout.vllm.kv_cache_gb)
    stop = threading.Event()
    lowest = [available_gb()]

    def guard() -> None:  # below the floor: SIGKILL every process this one started (the run, the nodes)
        while not stop.wait(1.0):
            lowest[0] = min(lowest[0], available_gb())
            if lowest[0] < min_free_gb:
                kill_descendants()
                return

    watcher = threading.Thread(target=guard, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        summary = rehearse(EXAMPLE, [f"model.path={model}", *overrides], output / size, kill_after=0)
    except AssertionError as err:
        if lowest[0] >= min_free_gb:
            raise
        return {"size": size, "model": model, "stopped": f"available memory fell under {min_free_gb} GB: {err}"}
    finally:
        stop.set()
    run_dir = output / size / "run"
    logged = rows(run_dir)
    updates = [r for r in logged if isinstance(r.get("weights/update_bytes"), (int, float))
               and r["weights/update_bytes"] == r["weights/update_bytes"]]  # NaN (null) before a replica took one
    result = {
        "size": size, "model": model, "overrides": overrides, "parameters": theory.pop("parameters"),
        "wall_s": round(time.monotonic() - t0),
        "lowest_available_gb": round(lowest[0], 1), "peak_rss_mb": summary["peak_rss_mb"],
        "process_peak_mb": summary["process_peak_mb"], "theoretical_mb": {k: round(v) for k, v in theory.items()},
        "seconds_per_step": summary["seconds_per_step"],
        "weights_gather_peak_mb": summary["weights_gather_peak_mb"],
        "update_mb": round(max((r["weights/update_bytes"] for r in updates), default=0) / MIB, 1),
        "update_s": round(statistics.median(r["weights/update_s"] for r in updates), 2) if updates else None,
        "checkpoint_mb": summary["checkpoint_mb"],
        **export_once(run_dir, output / size / "export_again"),
    }
    return result


def take_profile(model: str, overrides: list[str], profile: Path, repeats: int) -> float:
    """`asyncflow profile` of `model` under the run's config on this machine, into `profile`; its seconds."""
    cmd = [sys.executable, "-m", "asyncflow.cli", "profile", str(EXAMPLE), f"model.path={model}", *overrides,
           *PROFILE_PLACEMENT, "--threads", "1", "--repeats", str(repeats), "--out", str(profile)]
    print(f"profiling {model} ({repeats} timing(s) per point) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - t0


def predicted_step(profile: Path, model: str, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """The step time `asyncflow plan`'s simulator predicts from `profile` for the run's workload (its mode, batch
    shape, token budget and the prompt and response lengths it logged), against the run's median `time/step_s`."""
    from asyncflow.config import load_config
    from asyncflow.plan.planner import PlanSpec, plan
    from asyncflow.plan.workload import Lengths, Workload, lengths_from_run

    config = load_config(str(EXAMPLE), [f"model.path={model}", *overrides])
    logged = rows(run_dir)
    G, k = config.rollout.group_size, config.workflow.max_staleness
    prompt = statistics.mean(r["prompt_length/mean"] for r in logged if "prompt_length/mean" in r)
    workload = Workload(prompts_per_step=config.rollout.prompts_per_step, group_size=G, prompt=Lengths(mean=prompt),
                        response=lengths_from_run(run_dir))
    spec = PlanSpec(profile=str(profile), devices=2, workload=workload, slots=config.rollout.max_batch_size,
                    micro_batch_groups=max(1, config.train.micro_batch_size // G), staleness=[k],
                    max_tokens_per_micro_batch=config.train.max_tokens_per_micro_batch, steps=12)
    label = {"async": f"async k={k}"}.get(config.workflow.mode, config.workflow.mode)
    predicted = next(p.step_s for p in plan(spec) if p.mode == label)
    measured = statistics.median(r["time/step_s"] for r in logged if "time/step_s" in r)
    return {"predicted_step_s": round(predicted, 2), "measured_step_s": round(measured, 2),
            "plan_error": f"{100 * (predicted / measured - 1):+.0f}%"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="CONFIG overrides (section.key=value)")
    parser.add_argument("--sizes", default="30m,166m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--min-free-gb", type=float, default=3.0)
    parser.add_argument("--variant", action="append", default=[],
                        help="space-separated CONFIG overrides; every size runs once per variant")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--plan", action="store_true", help="profile each size and print asyncflow plan's prediction")
    parser.add_argument("--repeats", type=int, default=1, help="--plan: the profile's timings per point")
    args = parser.parse_args()
    output = args.output or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    sizes = args.sizes.split(",")
    for size in sizes:
        if size not in SIZES:
            raise SystemExit(f"--sizes: unknown size {size!r} (one of {', '.join(SIZES)})")
    variants = [variant.split() for variant in args.variant] or [[]]
    for size in sizes:
        for index, variant in enumerate(variants):
            folder = output if len(variants) == 1 else output / f"variant{index}"
            overrides = [f"train.steps={args.steps}", *args.overrides, *variant]
            result = measure(size, overrides, folder, args.min_free_gb)
            if args.plan and "stopped" not in result:
                profile = folder / size / "profile.yaml"
                result["profile_s"] = round(take_profile(SIZES[size], overrides, profile, args.repeats))
                result.update(predicted_step(profile, SIZES[size], overrides, folder / size / "run"))
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Predicted (asyncflow.plan) vs measured step time of sync, stream and async k=1, side by side in one run.

    PYTHONPATH=src flock /tmp/asyncflow-bench.lock .venv/bin/python benchmarks/bench_plan.py --steps 12 --invocations 3

On a GPU machine without Ray (`scripts/gpu_plan.sh` runs this):

    python3 benchmarks/bench_plan.py --placement inline --workloads main --steps 8 --spec h100 \
        --set model.device=cuda --set model.path=preset:base-llama --set train.precision=bf16

1. `asyncflow profile` in a process of its own measures this machine's costs for the config's model (the tiny
   Llama unless `--set model.path=...`; one thread), once as `sync` runs (in-process queue) and once as
   `stream` / `async` run (`SEPARATED`: the queue's calls through Ray actors on the same two cores). With
   `--placement inline`, once only (in-process queue), and `stream` / `async` run inline too
   (`runtime.kind=inline`: the rollout loop on a thread of the trainer's process, sharing its device; the
   simulator still gives rollout and trainer a device each).
2. For each workload (the main job `examples/arithmetic_grpo.yaml` without its SFT warm-up, at most 8 new
   tokens; and a long-tailed one: 64 new tokens, ~7% stop chance per token), each mode trains `--steps` steps in
   a process of its own with one torch thread: `sync` inline (the stages one after another on one core),
   `stream` / `async` (by default, `--placement ray`) separated as `benchmarks/bench_workflows.py` runs them (a
   Ray rollout replica on one core, the trainer on the other; on threads of one process instead, the GIL made
   async k=1 on the long tail 2x slower than sync in a first invocation, which the simulator does not model).
   `async k=1 (2 replicas)` runs two Ray rollout replicas beside the trainer on the same two cores (rolling weight
   updates: each replica swaps between its own partitions).
3. The simulator predicts each mode's step time from the profile and the workload's length statistics only (the
   measured run's mean response length per step, geometric, capped at max_new_tokens): no measured timing of
   the run enters the prediction. The Ray profile records this host's cores, Ray's idle load and the queue
   actors' CPU per call, so `stream` / `async` are predicted on a shared host
   (`asyncflow.plan.sim.shared_host_stretch`); the last column predicts them with each role on cores of its own,
   as before that model.

Step time: mean wall seconds per step over steps `warmup+1 .. steps-1-k` (async's last k steps, where rollout has
finished, left out), for both. With `--invocations N` all of it is done N times and the last table gives each
step time's mean over the invocations (the ratios are those of the means).

Options: `--set KEY=VALUE` (repeatable) adds a config override to every profile and run (after the others, so
it wins); `--workloads` and `--modes` take a subset (`main`, `long`; `sync`, `stream`, `async`); `--profile-only`
stops after the profiles; `--repeats` is the profile's timings per point. `--spec NAME` prints, after each
profile, its `Costs.from_profile` coefficients beside `Costs.from_spec` of the shipped spec profile NAME (`h100`)
for the profiled model's shape (its `config.json`, at the rollout engine's bytes per parameter), each with the
ratio measured / spec, and a few composite costs at the config's sizes. `--build-model DIR` only writes a
random-init model folder of the Qwen2.5-0.5B shape with the built-in character tokenizer (fp32 safetensors,
~360M parameters: the small vocabulary leaves out most of the real model's embedding) and exits; profile and
train it with `--set model.path=DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import yaml

from asyncflow.config import load_config
from asyncflow.models.loading import resolve_model_path
from asyncflow.plan.costs import Costs, ModelShape, Profile
from asyncflow.plan.sim import SimSpec, simulate
from asyncflow.plan.workload import Lengths, Workload
from asyncflow.workflow.compare import train_run

ROOT = Path(__file__).resolve().parents[1]
STOP_IDS = [36, 37, 38, 39, 40, 41]  # 'A'..'F' of the built-in character tokenizer
COMMON = ["sft.before_rl=false", "eval.every=0", "checkpoint.every=0", "run.progress=false", "export.at_end=false",
          "runtime.call_timeout_s=300", "data.test_size=8"]  # fmt: skip
SEPARATED = ["runtime.kind=ray", "runtime.num_cpus=2", "runtime.rollout_cpus=1", "runtime.trainer_cpus=1"]
INLINE = ["runtime.kind=inline"]
WORKLOADS = {
    "main job (<= 8 tokens)": ["rollout.max_batch_size=128"],
    "long tail (<= 64 tokens)": ["rollout.max_new_tokens=64", f"rollout.stop_token_ids={STOP_IDS}",
                                 "rollout.max_batch_size=128", "train.micro_batch_size=64"],
}
MODES = {"sync": (["workflow.mode=sync"], 0), "stream": (["workflow.mode=stream"], 0),
         "async k=1": (["workflow.mode=async", "workflow.max_staleness=1"], 1),
         "async k=1 (2 replicas)": (["workflow.mode=async", "workflow.max_staleness=1", "rollout.replicas=2",
                                    "runtime.num_cpus=3"], 1)}  # fmt: skip
PROMPT_TOKENS = 7  # "37+58=" and the BOS of the character tokenizer
#: `--build-model`: the Qwen2.5-0.5B shape (architecture, hidden, layers, heads, kv heads, intermediate, max
#: positions), in the layout of `asyncflow.models.presets.PRESETS`
QWEN_05B_SHAPE = ("qwen2", 896, 24, 14, 2, 4864, 4096)


def placement_overrides(placement: str, mode: str) -> list[str]:
    """Where a mode runs: `sync` always inline; `stream` / `async` on Ray (`SEPARATED`) or inline."""
    return SEPARATED if placement == "ray" and mode != "sync" else INLINE


def pick(names: list[str], wanted: str | None, what: str) -> list[str]:
    """The entries of `names` that `wanted` (comma-separated indices or name prefixes) chooses; all for None."""
    if not wanted:
        return names
    chosen = []
    for item in wanted.split(","):
        item = item.strip()
        found = [names[int(item)]] if item.isdigit() and int(item) < len(names) else \
            [n for n in names if n.lower() == item.lower()] or [n for n in names if n.lower().startswith(item.lower())]
        if len(found) != 1:
            raise SystemExit(f"--{what} {item!r}: choose one of {names} (by index or a prefix)")
        chosen += [n for n in found if n not in chosen]
    return chosen


def build_model(out: Path, *, seed: int = 0) -> Path:
    """A random-init Hugging Face folder of `QWEN_05B_SHAPE` with the built-in character tokenizer (so the
    built-in tasks run on it): `build_preset` with that shape as one more preset. Reused when its stamp matches."""
    from asyncflow.models.presets import PRESETS, build_preset

    with mock.patch.dict(PRESETS, {"bench-qwen2-0.5b": QWEN_05B_SHAPE}):
        return build_preset("bench-qwen2-0.5b", out, seed=seed)


#: `Costs` fields in the order of a step (its other seconds follow in their own order)
COEFFICIENTS = ["prefill_token_s", "prefill_row_s", "decode_step_s", "decode_row_s", "decode_row_token_s",
                "train_micro_batch_s", "train_token_s", "train_packed_token_s", "optimizer_step_s", "publish_s",
                "swap_s", "put_prompts_s", "queue_call_s", "reward_row_s"]  # fmt: skip


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def print_spec_table(profile: Profile, config, spec_name: str) -> None:
    """The measured profile's costs beside the spec profile's for the profiled model, and their ratio."""
    path = resolve_model_path(config.model.path, seed=config.run.seed)
    bytes_per_param = 4.0 if config.rollout_dtype() == "float32" else 2.0
    shape = ModelShape.from_hf_config(json.loads((path / "config.json").read_text()), bytes_per_param)
    spec = Profile.load(spec_name)
    measured, estimated = Costs.from_profile(profile), Costs.from_spec(spec.hardware, shape)
    print(f"measured ({profile.notes.split('; weights')[0]}) vs spec {spec.name} ({spec.hardware.name}) for "
          f"{config.model.path}: {shape.params / 1e6:.1f}M parameters, {shape.layers} layers, hidden {shape.hidden}, "
          f"KV width {shape.kv_dim}, {bytes_per_param:g} bytes per parameter")
    print(f"| coefficient (s) | measured | spec {spec.name} | measured / spec |")
    print("|---|---:|---:|---:|")

    def row(label: str, m: float | None, s: float | None) -> None:
        ratio = f"{m / s:.2f}" if m is not None and s else "-"
        print(f"| {label} | {fmt(m)} | {fmt(s)} | {ratio} |")

    seconds = [f.name for f in dataclasses.fields(Costs) if f.name.endswith("_s")]
    for name in COEFFICIENTS + [name for name in seconds if name not in COEFFICIENTS]:
        m, s = getattr(measured, name), getattr(estimated, name)
        if m or s:
            row(name, m, s)
    B, P, T = config.rollout.max_batch_size, PROMPT_TOKENS, config.rollout.max_new_tokens
    rows, tokens = config.train.micro_batch_size, config.train.micro_batch_size * (PROMPT_TOKENS + T)
    composite = {
        f"prefill, {B} rows x {P} tokens": lambda c: c.prefill(B * P, B),
        f"decode step, {B} rows at context {P + T}": lambda c: c.decode_step(B, P + T),
        f"generation, {B} rows x {T} new tokens": lambda c: c.prefill(B * P, B)
        + sum(c.decode_step(B, P + t) for t in range(T)),
        f"train micro-batch, {rows} rows, {tokens} tokens": lambda c: c.train(tokens),
    }
    for label, cost in composite.items():
        row(label, cost(measured), cost(estimated))
    sys.stdout.flush()


def window_step_s(ends: list[float], warmup: int, k: int) -> float:
    last = len(ends) - 1 - k
    return (ends[last] - ends[warmup - 1]) / (last - warmup + 1)


def predict(profile: Profile, rows: list[dict], mode: str, k: int, *, steps: int, warmup: int, group_size: int,
            prompts: int, max_new: int, slots: int, micro_batch: int, replicas: int) -> tuple[float, float]:
    """(predicted step time, and the same without the shared-host stretch: each role on its own cores)."""
    mean = float(np.mean([r["response_length/mean"] for r in rows]))
    workload = Workload(prompts_per_step=prompts, group_size=group_size, prompt=Lengths(mean=PROMPT_TOKENS),
                        response=Lengths.truncated_geometric(mean, max_new))
    P, L = workload.sample(steps)
    costs = Costs.from_profile(profile)
    spec = SimSpec(mode=mode.split()[0], prompt_lengths=P, response_lengths=L, group_size=group_size, costs=costs,
                   max_staleness=max(k, 1), replicas=replicas, slots=slots,
                   micro_batch_groups=micro_batch // group_size, sync_micro_batch_rows=micro_batch)  # fmt: skip
    own_cores = dataclasses.replace(spec, costs=dataclasses.replace(costs, host_cores=0.0))
    return tuple(window_step_s(simulate(s).step_end_s.tolist(), warmup, k) for s in (spec, own_cores))


def invocation(args, tmp: Path) -> dict[tuple[str, str], tuple[float, float]]:
    """Profiles taken, then each workload x mode trained and predicted: {(workload, mode): (predicted, measured)}."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    profiles = {}
    for placement in ["inline"] if args.placement == "inline" else ["inline", "ray"]:
        path = tmp / f"profile_{placement}.yaml"
        overrides = [*(INLINE if placement == "inline" else SEPARATED), *args.set]
        cmd = [sys.executable, "-m", "asyncflow.cli", "profile", args.config, *overrides, "--threads", "1",
               "--repeats", str(args.repeats), "--out", str(path)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        profiles[placement] = Profile.load(path)
        print(f"profile ({placement}):", json.dumps(profiles[placement].model_dump(exclude={"notes", "hardware"})),
              flush=True)
        if args.spec:
            print_spec_table(profiles[placement], load_config(args.config, overrides), args.spec)
    results = {}
    if args.profile_only:
        return results
    for name in pick(list(WORKLOADS), args.workloads, "workloads"):
        for mode in pick(list(MODES), args.modes, "modes"):
            mode_overrides, k = MODES[mode]
            out = tmp / f"{len(results)}_{name[:4]}"
            run_args = [args.config, *COMMON, *WORKLOADS[name], *placement_overrides(args.placement, mode),
                        *mode_overrides, f"train.steps={args.steps}", *args.set]
            rows = train_run(run_args, out, threads=1, timeout_s=1800)
            measured = window_step_s([r["wall_s"] for r in rows], args.warmup, k)
            config = yaml.safe_load((out / "config.yaml").read_text())
            ro, tr = config["rollout"], config["train"]
            profile = profiles["inline" if mode == "sync" or args.placement == "inline" else "ray"]
            predicted, own_cores = predict(profile, rows, mode, k, steps=args.steps, warmup=args.warmup,
                                           group_size=ro["group_size"], prompts=ro["prompts_per_step"],
                                           max_new=ro["max_new_tokens"], slots=ro["max_batch_size"],
                                           micro_batch=tr["micro_batch_size"], replicas=ro["replicas"])  # fmt: skip
            results[name, mode] = (predicted, measured, own_cores)
            print(f"{name} / {mode}: predicted {predicted:.3f} s/step ({own_cores:.3f} without the shared host), "
                  f"measured {measured:.3f}", flush=True)
    return results


def print_table(results: dict[tuple[str, str], tuple[float, float, float]]) -> None:
    """`results`: (predicted, measured, predicted without the shared host) per (workload, mode)."""
    print("| workload | mode | predicted s/step | measured s/step | error | predicted vs sync | measured vs sync "
          "| without the shared host: predicted (error) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (name, mode), (predicted, measured, own_cores) in results.items():
        ps, ms, _ = results.get((name, "sync"), (None, None, None))
        vs_sync = f"{ps / predicted:.2f}x | {ms / measured:.2f}x" if ps else "- | -"
        print(f"| {name} | {mode} | {predicted:.3f} | {measured:.3f} | {100 * (predicted / measured - 1):+.0f}% "
              f"| {vs_sync} | {own_cores:.3f} ({100 * (own_cores / measured - 1):+.0f}%) |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--invocations", type=int, default=1,
                        help="profiles and runs taken this many times, one after another; the last table is the mean "
                             "of each column over them (one invocation's noise here is about +-20%%)")
    parser.add_argument("--config", default=str(ROOT / "examples" / "arithmetic_grpo.yaml"))
    parser.add_argument("--placement", choices=["ray", "inline"], default="ray",
                        help="where stream / async run: ray (SEPARATED, two profiles) or inline (one profile, no Ray)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every profile and run (repeatable), e.g. model.device=cuda")
    parser.add_argument("--workloads", help=f"comma-separated indices or name prefixes of {list(WORKLOADS)}")
    parser.add_argument("--modes", help=f"comma-separated indices or name prefixes of {list(MODES)}")
    parser.add_argument("--repeats", type=int, default=5, help="the profile's timings per point (median kept)")
    parser.add_argument("--spec", help="a shipped spec profile (h100) to compare each measured profile's costs with")
    parser.add_argument("--profile-only", action="store_true", help="profile (and --spec table), train nothing")
    parser.add_argument("--build-model", type=Path, metavar="DIR",
                        help="write a random-init Qwen2.5-0.5B-shaped model folder to DIR and exit")
    args = parser.parse_args()
    if args.build_model:
        print(build_model(args.build_model))
        return
    if any("=" not in item for item in args.set):
        parser.error("--set takes KEY=VALUE")
    invocations = []
    for i in range(args.invocations):
        with tempfile.TemporaryDirectory() as tmp:
            invocations.append(invocation(args, Path(tmp)))
        if args.profile_only:
            continue
        print(f"invocation {i + 1} of {args.invocations}:")
        print_table(invocations[-1])
    if args.invocations > 1 and not args.profile_only:
        print(f"mean over {args.invocations} invocations:")
        print_table({key: tuple(float(np.mean([inv[key][j] for inv in invocations])) for j in range(3))
                     for key in invocations[0]})


if __name__ == "__main__":
    main()

"""On-policy distillation against GRPO alone on the main job: held-out accuracy curves side by side.

Owns nothing the library uses. Reads the `metrics.jsonl` of finished (or stopped) runs and writes one PNG:
held-out accuracy against RL steps for the distilled student(s), GRPO alone from the same SFT model(s), and the
teacher's accuracy with the 90% bar. The runs themselves are `asyncflow train` commands (docs/distillation.md).

Run: .venv/bin/python benchmarks/distill_curves.py --distill RUN [RUN ...] --grpo RUN [RUN ...]
     --teacher-accuracy 0.863 --out docs/distillation.png [--name VARIANT=LABEL ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def accuracy_curve(run: Path, max_step: int | None = None) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = sorted({r["step"]: r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None}.items())
    return [(s, a) for s, a in points if max_step is None or s <= max_step]


def first_step_at(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, a in curve if a >= target), None)


def held_from(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step from which every later evaluation is at or above `target` (None: the last one is
    below): one evaluation crossing the bar by noise does not count."""
    step = None
    for s, a in reversed(curve):
        if a < target:
            break
        step = s
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distill", nargs="+", type=Path, required=True)
    parser.add_argument("--grpo", nargs="+", type=Path, required=True)
    parser.add_argument("--teacher-accuracy", type=float, required=True)
    parser.add_argument("--max-step", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("docs/distillation.png"))
    parser.add_argument("--name", action="append", default=[], help="VARIANT=LABEL: the legend's label of a variant "
                        "(the run folder's name by default; repeatable)")
    args = parser.parse_args()
    names = dict(item.split("=", 1) for item in args.name)
    bar = 0.9 * args.teacher_accuracy
    runs = [("distilled", run, "-") for run in args.distill] + [("GRPO alone", run, "--") for run in args.grpo]
    seeds = sorted({run.parent.name for _, run, _ in runs})  # runs laid out as OUT/seedS/VARIANT: a panel per seed
    figure, axes = plt.subplots(1, len(seeds), figsize=(6 * len(seeds), 4), sharey=True, squeeze=False)
    variants = list(dict.fromkeys(run.name for _, run, _ in runs))  # one colour per variant, in every panel
    summary = {}
    for label, run, style in runs:
        curve = accuracy_curve(run, args.max_step)
        axis = axes[0][seeds.index(run.parent.name)]
        axis.plot([s for s, _ in curve], [100 * a for _, a in curve], style, color=f"C{variants.index(run.name) % 10}",
                  label=f"{label}: {names.get(run.name, run.name)}")
        summary[str(run)] = {"start": curve[0], "last": curve[-1], "best": max(curve, key=lambda p: p[1]),
                             "first_step_at_bar": first_step_at(curve, bar), "held_from": held_from(curve, bar)}
    for seed, axis in zip(seeds, axes[0]):
        axis.axhline(100 * args.teacher_accuracy, color="black", linewidth=1, label="teacher")
        axis.axhline(100 * bar, color="gray", linestyle=":", linewidth=1, label="90% of teacher")
        axis.set(title=seed, xlabel="RL step (32 prompts x 8 samples)")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out accuracy (%)")
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

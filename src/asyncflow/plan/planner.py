"""`asyncflow plan`: predicted step time, throughput and busy fractions of every workflow on a cluster, and the
split of devices between rollout and training.

Owns: `PlanSpec` (model, workload, algorithm settings, cluster: a YAML file or flags), `plan(spec)` (the sweep),
`Prediction` (one row of it), `render` (the table) and `write_outputs` (a simulated timeline of the
recommended setting in the Chrome-trace format of a real run, with its Gantt PNG).

What is swept: `sync` colocated on all devices; `stream`, and `async` for each k in `staleness` with partial
rollouts off and on, separated, for each split of the devices into rollout replicas (multiples of
`rollout_tp`) and trainer devices; each mode keeps its fastest split. Throughput is trained samples per second
over the steps after the first.

Invariants: every prediction comes from `asyncflow.plan.sim.simulate` on the same sampled lengths (one seed),
so the modes differ only in their schedule and placement; a `kind: measured` profile describes one device of
this machine and is used as is (it has no notion of device count: `devices` must then be 2, one per role,
or the colocated sync's 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from asyncflow.plan.costs import Costs, ModelShape, Profile
from asyncflow.plan.sim import Mode, SimSpec, simulate
from asyncflow.plan.workload import Workload


class PlanSpec(BaseModel):
    """What `asyncflow plan` predicts for."""

    model: str = "7B"
    """A Hugging Face `config.json` (or its folder) or a Qwen2.5 size (`7B`, `32B`)."""
    profile: str = "h100"
    """A profile file (`asyncflow profile`) or a shipped one (`h100`, `a100`, `910b`)."""
    devices: int = Field(64, ge=2)
    rollout_tp: int = Field(1, ge=1)
    """Devices per rollout replica (tensor parallel)."""
    workload: Workload = Workload(prompts_per_step=64, group_size=8)
    slots: int = Field(256, ge=1)
    """Sequences one replica decodes at once (the engine's batch)."""
    micro_batch_groups: int = Field(8, ge=1)
    """Groups per trainer read in `stream` / `async`."""
    sync_micro_batch_rows: int = Field(64, ge=1)
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """`train.max_tokens_per_micro_batch`: each trainer read split into micro-batches of at most this many tokens."""
    staleness: list[int] = [1, 2]
    sync_switch_s: float = Field(0.0, ge=0)
    """Colocated `sync`: seconds per step its devices spend switching between inference and training (verl-style
    offload / onload and resharding; 0 = free)."""
    steps: int = Field(20, ge=2)
    splits: int = Field(9, ge=1)
    """How many rollout/trainer splits to try between 10% and 90% of the devices for rollout."""
    seed: int = 0


@dataclass
class Prediction:
    mode: str
    rollout_devices: int
    train_devices: int
    step_s: float
    samples_per_s: float
    rollout_busy: float
    trainer_busy: float
    spec: SimSpec

    @property
    def label(self) -> str:
        return self.mode


def _costs(profile: Profile, model: ModelShape | None, tp: int, train: int, switch_s: float = 0.0) -> Costs:
    from dataclasses import replace

    return replace(Costs.from_profile(profile, model, rollout_devices=tp, train_devices=train), switch_s=switch_s)


def plan(spec: PlanSpec) -> list[Prediction]:
    """One `Prediction` per mode (its best split), sync first."""
    profile = Profile.load(spec.profile)
    model = ModelShape.load(spec.model) if profile.kind == "spec" else None
    P, L = spec.workload.sample(spec.steps, seed=spec.seed)
    G, rows = spec.workload.group_size, spec.workload.rows
    tp = spec.rollout_tp if profile.kind == "spec" else 1

    def run(mode: Mode, k: int, resume: bool, roll: int) -> Prediction:
        train = spec.devices - roll if mode != "sync" else spec.devices
        replicas = max(1, roll // tp) if mode != "sync" else max(1, spec.devices // tp)
        sim = SimSpec(
            mode=mode, prompt_lengths=P, response_lengths=L, group_size=G,
            costs=_costs(profile, model, tp, train, spec.sync_switch_s if mode == "sync" else 0.0),
            max_staleness=max(k, 1), replicas=replicas, sync_replicas=replicas, slots=spec.slots,
            micro_batch_groups=spec.micro_batch_groups, sync_micro_batch_rows=spec.sync_micro_batch_rows,
            max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
            on_weight_update="resume" if resume else "finish",
        )  # fmt: skip
        result = simulate(sim)
        step = result.step_time()
        busy = result.busy()
        label = mode if mode != "async" else f"async k={k}" + (" +partial" if resume else "")
        return Prediction(label, roll if mode != "sync" else spec.devices, train, step, rows / step,
                          busy["rollout"], busy["trainer"], sim)

    out = [run("sync", 0, False, spec.devices)]
    if profile.kind == "measured":
        splits = [1]
    else:
        lo, hi = max(tp, int(spec.devices * 0.1)), int(spec.devices * 0.9)
        step = max(tp, (hi - lo) // max(1, spec.splits - 1) // tp * tp)
        splits = sorted({min(r, spec.devices - 1) for r in range(lo - lo % tp or tp, hi + 1, step)} - {0})
    modes: list[tuple[Mode, int, bool]] = [("stream", 0, False)]
    modes += [("async", k, resume) for k in spec.staleness for resume in (False, True)]
    for mode, k, resume in modes:
        out.append(min((run(mode, k, resume, r) for r in splits), key=lambda p: p.step_s))
    return out


def render(predictions: list[Prediction]) -> str:
    base = predictions[0].step_s
    lines = ["| mode | rollout / train devices | step s | samples/s | vs sync | rollout busy | trainer busy |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for p in predictions:
        lines.append(f"| {p.mode} | {p.rollout_devices} / {p.train_devices} | {p.step_s:.2f} | "
                     f"{p.samples_per_s:.1f} | {base / p.step_s:.2f}x | {p.rollout_busy:.2f} | {p.trainer_busy:.2f} |")
    best = min(predictions, key=lambda p: p.step_s)
    lines.append("")
    lines.append(f"recommended: {best.mode} with {best.rollout_devices} devices for rollout and "
                 f"{best.train_devices} for training ({base / best.step_s:.2f}x the samples/s of sync)")
    return "\n".join(lines)


def write_outputs(prediction: Prediction, out_dir: str | Path, replicas_shown: int = 4) -> list[Path]:
    """The simulated timeline of `prediction` (`timeline.json`, `timeline.png`) in `out_dir`."""
    from dataclasses import replace

    from asyncflow.observe import Timeline

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = simulate(replace(prediction.spec, timeline_replicas=replicas_shown))
    origin = 1_000_000.0  # a positive clock, as wall-clock seconds are in a real trace
    timeline = Timeline([{**e, "start_s": e["start_s"] + origin, "end_s": e["end_s"] + origin} for e in result.events])
    return [timeline.to_chrome_trace(out_dir / "timeline.json"),
            timeline.gantt_png(out_dir / "timeline.png", title=f"simulated: {prediction.mode}")]

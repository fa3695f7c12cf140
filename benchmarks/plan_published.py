"""The published configurations of the two systems asyncflow implements, through `asyncflow plan`: predicted
async-over-sync gains against the published ones (/work/shared/docs/seeds.md, docs/planning.md).

    PYTHONPATH=src .venv/bin/python benchmarks/plan_published.py

Assumptions (the papers do not give all of them; each is written here and in docs/planning.md):
- AsyncFlow (arXiv 2507.01663): Qwen2.5-7B (rollout tensor parallel 1) and 32B (4), Ascend 910B (the shipped
  spec-derived profile), GRPO with 8 samples per prompt, one prompt per device per step (weak scaling), prompts
  of 256 tokens, responses lognormal with mean 3000 tokens, sigma 0.9, cut at 8192 (DeepScaleR's first stage),
  staleness 1; the verl baseline is colocated `sync` that also spends `SWITCH` seconds per step switching its
  devices between inference and training (0 and an assumed 20 s (7B) / 60 s (32B)).
  Ablation: task-separated with no streaming (the trainer waits for the whole batch), + TransferQueue (`stream`:
  complete groups as they finish), + async (`async` k=1).
- Periodic Asynchrony (arXiv 2511.18871): Qwen2.5-7B on 64 910B NPUs, 256 prompts x 8, prompts of 512 tokens,
  responses lognormal with mean 4000, sigma 1.0, cut at 16384; `stream` against colocated `sync`.
"""

from __future__ import annotations

from asyncflow.plan.planner import PlanSpec, plan
from asyncflow.plan.sim import simulate
from asyncflow.plan.workload import Lengths, Workload


def gains(spec: PlanSpec, ablation: bool = False) -> dict[str, float]:
    predictions = plan(spec)
    base = predictions[0].step_s
    out = {p.mode: base / p.step_s for p in predictions}
    if ablation:  # separated, no streaming: the best stream split with the whole batch as one trainer read
        from dataclasses import replace

        stream = next(p for p in predictions if p.mode == "stream")
        groups = spec.workload.prompts_per_step
        batch = simulate(replace(stream.spec, micro_batch_groups=groups)).step_time()
        out["separated, no streaming"] = base / batch
    return out


def main() -> None:
    print("| system | model | NPUs | switch s | separated no streaming | + streaming (stream) | + async k=1 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for model, tp, devices_list, switch in [("7B", 1, [32, 64, 128, 256, 512], 20.0),
                                            ("32B", 4, [128, 256, 512], 60.0)]:
        for devices in devices_list:
            for sw in (0.0, switch):
                spec = PlanSpec(
                    model=model, profile="910b", devices=devices, rollout_tp=tp, staleness=[1], steps=12, splits=7,
                    sync_switch_s=sw, workload=Workload(
                        prompts_per_step=devices, group_size=8, prompt=Lengths(mean=256),
                        response=Lengths(kind="lognormal", mean=3000, sigma=0.9, max=8192)),
                )  # fmt: skip
                g = gains(spec, ablation=True)
                print(f"| AsyncFlow | {model} | {devices} | {sw:.0f} | {g['separated, no streaming']:.2f}x | "
                      f"{g['stream']:.2f}x | {g['async k=1']:.2f}x |", flush=True)
    for sw in (0.0, 20.0):
        spec = PlanSpec(model="7B", profile="910b", devices=64, staleness=[1], steps=12, splits=7, sync_switch_s=sw,
                        workload=Workload(prompts_per_step=256, group_size=8, prompt=Lengths(mean=512),
                                          response=Lengths(kind="lognormal", mean=4000, sigma=1.0, max=16384)))
        g = gains(spec)
        print(f"| Periodic Asynchrony | 7B | 64 | {sw:.0f} | | {g['stream']:.2f}x | {g['async k=1']:.2f}x |")


if __name__ == "__main__":
    main()

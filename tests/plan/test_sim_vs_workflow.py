"""The simulator takes the real workflow's decisions: a real `async` run (inline runtime, tiny model) whose
engines are paced by sleeps (so each role's cost is known and dominates the noise of a shared CPU) against
`asyncflow.plan.sim` given the same costs: the weight version each partition was generated with (hence the
staleness of every trained row), the order rows are generated in, and each role's idle share."""

import time

import numpy as np
import pytest

from asyncflow.api import open_run
from asyncflow.config import build_config
from asyncflow.engines.base import register_inference_engine, register_train_engine
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.observe import Timeline
from asyncflow.plan.costs import Costs
from asyncflow.plan.sim import SimSpec, simulate

STEP_S = 0.1  # seconds per decode step of the paced engine
NEW_TOKENS = 6
PACE = {"train_s": 0.05}  # seconds each paced trainer micro-batch sleeps (set per test)


class PacedEngine(TorchInferenceEngine):
    """The torch engine, holding every partition's completions until `max_new_tokens * STEP_S` after it began."""

    def generate(self, requests, params):
        t0 = time.perf_counter()
        done = list(super().generate(requests, params))
        time.sleep(max(0.0, t0 + params.max_new_tokens * STEP_S - time.perf_counter()))
        yield from done


class PacedTrainer(TorchTrainEngine):
    def backward_micro_batch(self, *args, **kwargs):
        time.sleep(PACE["train_s"])
        return super().backward_micro_batch(*args, **kwargs)


@register_inference_engine("test_paced_torch")
def make_paced_engine(*, model_path=None, **kwargs):
    return PacedEngine.from_pretrained(model_path, **kwargs)


@register_train_engine("test_paced_torch")
def make_paced_trainer(*, world_size=1, model_path=None, dtype=None, timeout_s=None, launcher=None, **options):
    return PacedTrainer(**options)  # a multi-rank engine's options are not the torch engine's


def real_run(tmp_path, k: int, steps: int):
    config = build_config({}, [
        f"run.output_dir={tmp_path}", "run.progress=false", "model.path=preset:tiny-llama",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=8", "eval.every=0",
        "data.test_size=4", "checkpoint.every=0", "runtime.call_timeout_s=60", "runtime.kind=inline",
        f"train.steps={steps}", "workflow.mode=async", f"workflow.max_staleness={k}",
        f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.max_batch_size=16", "rollout.engine=test_paced_torch",
        "train.engine=test_paced_torch", "export.at_end=false",
    ])  # fmt: skip
    with open_run(config) as run:
        history = run.train()
    return [h["staleness/max"] for h in history if "staleness/max" in h], Timeline(run.timeline.events)


def spans(timeline: Timeline, worker: str, name: str) -> list[dict]:
    return sorted((e for e in timeline.events if e["worker"] == worker and e["name"] == name and e["kind"] == "span"),
                  key=lambda e: e["start_s"])


@pytest.mark.slow
@pytest.mark.parametrize("train_s, expected", [(0.05, [0, 1, 1, 1, 1, 1]), (0.5, [0, 1, 2, 2, 2, 2])])
def test_simulator_takes_the_real_async_decisions(tmp_path, train_s, expected):
    PACE["train_s"] = train_s
    steps, k = 6, 2
    real_staleness, timeline = real_run(tmp_path, k, steps)
    generate = spans(timeline, "rollout", "generate")
    micro = spans(timeline, "trainer", "train_micro_batch")
    opt = spans(timeline, "trainer", "optimizer_step")
    publish = spans(timeline, "trainer", "publish_weights")
    origin = generate[0]["start_s"]
    trainer_start = spans(timeline, "trainer", "wait_rows")[0]["start_s"] - origin
    mean = lambda es: float(np.mean([e["end_s"] - e["start_s"] for e in es]))  # noqa: E731
    costs = Costs(decode_step_s=STEP_S, decode_row_s=0.0, decode_row_token_s=0.0, prefill_token_s=0.0,
                  train_micro_batch_s=mean(micro), train_token_s=0.0, optimizer_step_s=mean(opt),
                  publish_s=mean(publish), swap_s=0.0)  # fmt: skip
    rows = 16
    spec = SimSpec(mode="async", prompt_lengths=np.ones((steps, rows), dtype=np.int64),
                   response_lengths=np.full((steps, rows), NEW_TOKENS), group_size=4, costs=costs, max_staleness=k,
                   replicas=1, slots=16, micro_batch_groups=2, timeline_replicas=1, trainer_start_s=trainer_start)
    sim = simulate(spec)
    simulated = sim.staleness[:, 0].tolist()
    assert real_staleness == expected, "the paced run did not land in the regime this test is about"
    assert simulated == real_staleness
    # rows are generated partition by partition, in step order, by both
    assert [e["args"]["step"] for e in generate] == list(range(steps))
    assert [e["args"]["step"] for e in sim.events if e["name"] == "generate"] == list(range(steps))
    # each role's idle share over the run
    real_idle = timeline.idle_fractions(window=(origin, publish[-1]["end_s"]))
    sim_idle = Timeline(sim.events).idle_fractions(window=(0.0, sim.total_s))
    for worker in ("rollout", "trainer"):
        assert abs(real_idle[worker] - sim_idle[worker]) < 0.15, (worker, real_idle, sim_idle)

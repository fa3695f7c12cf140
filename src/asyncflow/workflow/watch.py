"""What a running workflow is doing, read from its queue and timeline: the live series of `/metrics`, the
progress fingerprint the watchdog compares, and the explanation of a stall (which stage waits on which).

Owns: `live_series`, `progress`, `explain_waits` (all read-only: nothing here changes the queue or the run).

Invariants:
- A partition is in flight from the step being trained to the newest one fed (`PipelineWorkflow.cursors`).
- The stages of a row, in order: `rollout` writes `response_ids` (and `reward` in the same write where it scores
  its rows); `reward` writes `reward`; each user stage writes its outputs; `train` consumes the row. A stall names
  the first stage with rows whose inputs are ready and whose output is not, and who waits for it.
"""

from __future__ import annotations

import time

from asyncflow.observe.live import Labels
from asyncflow.workers.loops import partition_name
from asyncflow.workflow.pipeline import PipelineWorkflow

IDLE_WINDOW_S = 60.0  # the idle fractions of `/metrics` are over this last stretch of the run


def _in_flight(workflow: PipelineWorkflow, step: int) -> range:
    return range(step, max(workflow.cursors, default=step) + 1)


def _chain(workflow: PipelineWorkflow) -> list[tuple[str, str]]:
    """(stage, the column it writes), in the order a row goes through them."""
    scoring = [] if workflow.scored_in_rollout else [("reward", "reward")]  # else one write carries both
    return [("rollout", "response_ids"), *scoring, *((stage.name, stage.outputs[0]) for stage in workflow.stages)]


def progress(workflow: PipelineWorkflow, step: int) -> tuple:
    """Changes whenever a row is written or consumed, or a step ends."""
    counters = workflow.queue.metrics()
    moved = sorted((k, v) for k, v in counters.items() if k.startswith(("produced/", "consumed/", "rows_appended")))
    return step, tuple(moved)


def live_series(workflow: PipelineWorkflow, step: int) -> dict[str, dict[Labels, float]]:
    """Queue counters (rows produced per column, consumed per task, seconds waited per waiter), rows ready per
    column of each partition in flight, each worker's idle fraction over the last `IDLE_WINDOW_S`, and the weight
    version each replica swapped in last."""
    counters = workflow.queue.metrics()
    series: dict[str, dict[Labels, float]] = {"queue_rows_produced": {}, "queue_rows_consumed": {},
                                              "queue_wait_s": {}, "queue_rows": {}, "queue_rows_ready": {}}
    for key, value in counters.items():
        kind, _, name = key.partition("/")
        if kind == "produced":
            series["queue_rows_produced"][(("column", name),)] = value
        elif kind == "consumed" and "/" not in name:
            series["queue_rows_consumed"][(("task", name),)] = value
        elif kind == "wait_s":
            series["queue_wait_s"][(("who", name),)] = value
    for s in _in_flight(workflow, step):
        status = workflow.queue.status(partition_name(s))
        if not status.get("exists"):
            continue
        partition = (("partition", partition_name(s)),)
        series["queue_rows"][partition] = status["rows"]
        for column, ready in status["ready"].items():
            series["queue_rows_ready"][partition + (("column", column),)] = ready
    now = time.time()
    series["idle_fraction"] = {(("worker", w),): f for w, f in
                               workflow.timeline.idle_fractions((now - IDLE_WINDOW_S, now)).items()}
    versions: dict[Labels, float] = {}
    for event in workflow.timeline.events:
        if event["name"] == "weight_swap" and "version" in event["args"]:
            versions[(("replica", event["worker"]),)] = event["args"]["version"]
    series["replica_weight_version"] = versions
    return series


def explain_waits(workflow: PipelineWorkflow, step: int) -> str:
    """Which stage holds the run up and who waits for it, partition by partition, e.g. "step_3 (64 rows): the
    reward stage has 52 rows to write `reward` (their `response_ids` are ready); train waits for them"."""
    chain = _chain(workflow)
    parts = []
    for s in _in_flight(workflow, step):
        name = partition_name(s)
        status = workflow.queue.status(name)
        if not status.get("exists"):
            parts.append(f"{name}: not in the queue")
            continue
        rows, ready = status["rows"], status["ready"]
        have = rows
        for i, (stage, column) in enumerate(chain):
            done = ready.get(column, 0)
            if done < have:
                waiter = chain[i + 1][0] if i + 1 < len(chain) else "train"
                parts.append(f"{name} ({rows} rows): the {stage} stage has {have - done} rows to write {column!r} "
                             f"(their inputs are ready); {waiter} waits for them")
                break
            have = done
        else:
            consumed = status["consumed"].get("train", 0)
            parts.append(f"{name} ({rows} rows): every row is ready; train consumed {consumed} of them"
                         + ("" if consumed < rows else " (the step is being trained)"))
    return "; ".join(parts) if parts else f"no partition in flight at step {step}"

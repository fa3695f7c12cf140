"""Deadlines on the weight path: every phase a version goes through has one (`weights.*_timeout_s`).

Owns: `WeightDeadlines` (the seconds of each phase), `WeightDeadlineError` (names the side, the version and the
phase that missed its deadline), `within_deadline` (runs one phase under its deadline) and `phase_hooks`
(callables run at the start of a phase, in the process that runs it: tests inject stalls through them).

Phases: `publish` (the trainer snapshots a version into the transport), `receive` (a replica waits for a
version it needs and takes it), `apply` (the engine takes the version: for vLLM its pause, reload and resume,
whose collective join and broadcasts also keep their own limits, `asyncflow.weights.collective`).

Invariants:
- `within_deadline` returns or raises within its deadline (plus thread start-up): a phase that is stuck is left
  running on its helper thread, and the caller gets `WeightDeadlineError` and ends the run (or, on Ray, the
  replica's loop fails and the run with it); nothing waits on the stuck call again.
- The error is a `WeightSyncTimeout`, so code that handles transport timeouts handles it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from asyncflow.weights.base import WeightSyncTimeout

Phase = Literal["publish", "receive", "apply"]
PHASES: tuple[Phase, ...] = ("publish", "receive", "apply")
T = TypeVar("T")

phase_hooks: dict[str, list[Callable[[str, int], None]]] = {phase: [] for phase in PHASES}
"""phase -> callables `hook(side, version)` run at the start of every phase of that name, inside its deadline."""


@dataclass(frozen=True)
class WeightDeadlines:
    """Seconds each phase of a weight version may take (from `weights.*_timeout_s`)."""

    publish: float
    receive: float
    apply: float
    restart_on_apply: bool = False
    """A replica that missed `apply` ends its process, to be restarted (`weights.on_apply_deadline: restart`)."""


class WeightDeadlineError(WeightSyncTimeout):
    """A phase of the weight path missed its deadline: `side` (who was waiting), `version`, `phase`."""

    def __init__(self, side: str, version: int, phase: str, timeout_s: float, detail: str = ""):
        self.side, self.phase = side, phase
        self.transport, self.version, self.waited_for, self.timeout_s = "weights", version, phase, timeout_s
        RuntimeError.__init__(  # not WeightSyncTimeout's message: this one names side, version and phase first
            self, f"weight update deadline missed: {side}, version {version}, {phase} phase: not done within "
            f"{timeout_s:.3g} s (weights.{phase}_timeout_s){detail}"
        )


def within_deadline(fn: Callable[[], T], *, side: str, version: int, phase: Phase, timeout_s: float) -> T:
    """`fn()` (after the phase's hooks) on a helper thread; its result, its exception, or `WeightDeadlineError`
    once `timeout_s` has passed. A `WeightSyncTimeout` raised by `fn` itself is re-raised named the same way."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            for hook in list(phase_hooks[phase]):
                hook(side, version)
            outcome.append((True, fn()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            outcome.append((False, err))

    thread = threading.Thread(target=run, name=f"weights-{phase}-v{version}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise WeightDeadlineError(side, version, phase, timeout_s)
    ok, value = outcome[0]
    if ok:
        return cast(T, value)
    if isinstance(value, WeightSyncTimeout) and not isinstance(value, WeightDeadlineError):
        raise WeightDeadlineError(side, version, phase, timeout_s, f": {value}") from value
    raise value

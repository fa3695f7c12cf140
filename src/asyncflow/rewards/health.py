"""The reward error-rate limit: a run whose reward keeps failing ends with a clear error.

Owns: `RewardHealth` and `RewardHealthError`.
Invariants:
- A step is *failing* when more than `max_error_fraction` of its samples failed (errors +
  timeouts, as counted by `RewardRunner`). After `max_error_steps` failing steps in a row, `check`
  raises `RewardHealthError` naming the counts, the limits and the config keys; a step that is not
  failing resets the streak. A step with no samples changes nothing.
- `max_error_fraction` or `max_error_steps` of 0 or None disables the limit (`check` never raises).
- Pure bookkeeping: no clock, no I/O, nothing above `rewards/` imported; one instance per run, fed
  once per training step by the run loop. `counter_growth` turns the scorers' cumulative counters into
  per-step counts.
"""

from __future__ import annotations


class RewardHealthError(RuntimeError):
    """The reward failed on most samples for too many steps in a row (see `RewardHealth`)."""


class RewardHealth:
    """Counts consecutive steps on which most reward calls failed; see the module invariants."""

    def __init__(self, max_error_fraction: float | None = 0.5, max_error_steps: int | None = 3):
        if max_error_fraction is not None and not 0 <= max_error_fraction <= 1:
            raise ValueError(f"max_error_fraction must be in [0, 1] or None, got {max_error_fraction!r}")
        if max_error_steps is not None and not (isinstance(max_error_steps, int) and max_error_steps >= 0):
            raise ValueError(f"max_error_steps must be an integer >= 0 or None, got {max_error_steps!r}")
        self.enabled = bool(max_error_fraction) and bool(max_error_steps)
        self.max_error_fraction = max_error_fraction or 0.0  # read only when enabled
        self.max_error_steps = max_error_steps or 0
        self.streak = 0  # consecutive failing steps so far

    def check(self, step: int, *, samples: int, errors: int, timeouts: int, detail: str | None = None) -> None:
        """Record one step's counts; raise `RewardHealthError` at the limit. `detail` (e.g.
        `RewardRunner.last_failure`) is quoted in the error."""
        if not self.enabled or samples <= 0:
            return
        failed = errors + timeouts
        if failed <= self.max_error_fraction * samples:
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= self.max_error_steps:
            last = f"; last failure: {detail}" if detail else ""
            raise RewardHealthError(
                f"the reward failed on more than {self.max_error_fraction:g} of the samples for {self.streak} steps "
                f"in a row (step {step}: {failed} of {samples} failed, {errors} errors and {timeouts} timeouts)"
                f"{last}. Fix the reward function or the data (the first failure of each kind is in the log); "
                "reward.max_error_fraction / reward.max_error_steps set this limit (0 turns it off)"
            )


def counter_growth(now: int, before: int) -> int:
    """How much a cumulative counter grew since it read `before`: `now - before`, or `now` when it went down
    (its worker restarted and counts from 0 again)."""
    return now - before if now >= before else now

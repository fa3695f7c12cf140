"""The reward error-rate limit: a run whose reward keeps failing ends with a clear error.

Owns: `RewardHealth` and `RewardHealthError`.
Invariants:
- A step is *failing* when more than `max_error_fraction` of its samples failed (errors +
  timeouts, as counted by `RewardRunner`). After `max_error_steps` failing steps in a row, `check`
  raises `RewardHealthError` naming the counts, the limits and the config keys; a step that is not
  failing resets the streak. A step with no samples changes nothing.
- `max_error_fraction` or `max_error_steps` of 0 or None disables the limit (`check` never raises).
- Pure bookkeeping: no clock, no I/O, nothing above `rewards/` imported; one instance per run, fed
  once per training step by the run loop. `observe_totals` turns the cumulative counters the run
  logs (`reward/errors`, `reward/timeouts`) into per-step counts.
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
        self.max_error_fraction = max_error_fraction
        self.max_error_steps = max_error_steps
        self.enabled = bool(max_error_fraction) and bool(max_error_steps)
        self.streak = 0  # consecutive failing steps so far
        self._totals = (0, 0)  # (errors, timeouts) last seen by observe_totals

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

    def observe_totals(self, step: int, *, samples: int, errors_total: float, timeouts_total: float,
                       detail: str | None = None) -> None:
        """`check` with counts taken as the growth of cumulative counters since the previous call (the
        first call counts from 0). A counter that goes down (its worker restarted) counts from 0 again."""
        errors_total, timeouts_total = int(errors_total), int(timeouts_total)
        last_errors, last_timeouts = self._totals
        errors = errors_total - last_errors if errors_total >= last_errors else errors_total
        timeouts = timeouts_total - last_timeouts if timeouts_total >= last_timeouts else timeouts_total
        self._totals = (errors_total, timeouts_total)
        self.check(step, samples=samples, errors=errors, timeouts=timeouts, detail=detail)

"""Stopping a command on SIGINT (Ctrl-C) or SIGTERM at its next safe point.

Owns: `StopSignals` (the handlers, installed for the life of a command), `RunStopped` (raised once a
run has stopped cleanly) and `StoppedAtOnce` (the second signal), both carrying the exit code.

Invariants:
- The first SIGINT or SIGTERM only records the signal (`requested`); the step loop looks at it after each
  step, where a checkpoint is consistent, and stops there: a final checkpoint, the outputs written, every
  worker, rank and Ray process the run started shut down, then `RunStopped`.
- A second signal stops at once: `StoppedAtOnce` (a `KeyboardInterrupt`) in the main thread, so the
  `finally` blocks still close workers and ranks; no checkpoint is written (the folder stays resumable
  from the last one).
- Handlers are installed only from the main thread (the only one Python delivers signals to) and the
  previous ones are put back on exit.
- A stopped command exits with 128 + the signal's number: 130 for SIGINT, 143 for SIGTERM.
- `fail(error)` from any thread raises `error` in the main thread at once (the watchdog's `stall_action: stop`): a
  real SIGTERM sent to the main thread interrupts whatever it waits on, and the handler raises `error` instead of
  recording a stop. Without the handlers installed it only interrupts the main thread (`KeyboardInterrupt`).
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The command stopped cleanly on a signal; `exit_code` is 128 + its number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StoppedAtOnce(KeyboardInterrupt):
    """A second SIGINT / SIGTERM: the command stops where it is; `exit_code` is 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name} again: stopped at once, without a final checkpoint "
                         "(continue from the last one with --resume)")
        self.exit_code = 128 + signum


class StopSignals:
    """`with StopSignals() as stop:` ... `if stop.requested: ...`; see the module invariants."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._failure: BaseException | None = None
        self._previous: dict[int, Any] = {}  # signal -> its handler before ours (a callable, SIG_DFL, SIG_IGN, None)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def stopped(self, when: str) -> RunStopped:
        """The `RunStopped` to raise once the signal received (`requested`) has been honoured: "stopped by
        SIGNAL `when`"."""
        if self.signum is None:
            raise RuntimeError("no stop signal was received")
        return RunStopped(self.signum, f"stopped by {self.name} {when}")

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def install(self) -> None:
        """(Re)install the handlers: also after something that sets its own (a Ray driver's `ray.init` does)."""
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def fail(self, error: BaseException) -> None:
        """End the command with `error`, raised in the main thread (see the module invariants)."""
        main = threading.main_thread()
        if signal.getsignal(signal.SIGTERM) != self._handle or main.ident is None:
            log.error("%s", error)
            _thread.interrupt_main()
            return
        self._failure = error
        signal.pthread_kill(main.ident, signal.SIGTERM)

    def _handle(self, signum: int, frame: object) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self.signum is None:
            self.signum = signum
            log.warning("%s: stopping at the next safe point with a checkpoint (send it again to stop at once)",
                        self.name)
            return
        raise StoppedAtOnce(signum)


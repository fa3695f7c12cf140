"""The type checker is a contract: mypy, configured by pyproject's `[tool.mypy]`, finds no error in PACKAGES (strictly
checked where pyproject's overrides say so). Imports of other modules are followed for their types but not reported
(`--follow-imports=silent`).

Its cache is the default `.mypy_cache` at the repository's root: the first run reads torch's and transformers' types
(about 90 s of one core), later runs recheck only what changed (about 7 s of CPU). In a run of the suite that selects
this test, a first mypy starts at the lowest priority as soon as collection ends (conftest's `pytest_collection_finish`
calls `start_in_background`; under xdist in the first worker only) and writes its answer into a folder named after
the run; the test runs last (conftest) and takes that answer, so mypy fills the cache with CPU the other tests leave
idle instead of holding a worker for a minute. Where it has not answered by then (a loaded machine starves a process
at the lowest priority) the test stops it (mypy writes its cache module group by module group: the work done is
kept) and checks again at normal priority, as it does when it runs alone."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What mypy checks: all of src/asyncflow, strictly where pyproject's overrides say so (the core packages).
PACKAGES = ("asyncflow",)
COMMAND = [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--follow-imports=silent",
           *(arg for name in PACKAGES for arg in ("-p", name))]
TIMEOUT_S = 900
# mypy's exit code into `rc` once it has ended (its output is already in `out`); the wrapper's process group is
# mypy's too, so a test in another xdist worker can stop both
WRAPPER = ("import os, subprocess, sys; code = subprocess.run(sys.argv[2:]).returncode; "
           "open(sys.argv[1] + '.tmp', 'w').write(str(code)); os.replace(sys.argv[1] + '.tmp', sys.argv[1])")

_answer_dir: Path | None = None  # where this session's background mypy writes `out` and `rc`


def start_in_background(run_id: str, start: bool = True) -> None:
    """Record where run `run_id`'s answer lies (the same folder in every xdist worker of a run); with `start`, start
    mypy there at the lowest CPU priority (once)."""
    global _answer_dir
    if _answer_dir is not None:
        return
    _answer_dir = Path(tempfile.gettempdir()) / f"asyncflow-typecheck-{run_id}"
    if not start:
        return
    _answer_dir.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, _answer_dir, True)
    with open(_answer_dir / "out", "w") as out:
        process = subprocess.Popen([sys.executable, "-c", WRAPPER, str(_answer_dir / "rc"), *COMMAND], cwd=ROOT,
                                   stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19),
                                   start_new_session=True)
    (_answer_dir / "pgid").write_text(str(process.pid))
    atexit.register(_stop, process.pid)  # a session stopped early leaves no mypy behind (runs before the removal)


def _stop(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def background_answer() -> tuple[int, str] | None:
    """The background mypy's exit code and output if it has answered; None (and it is stopped) if not, or if none
    was started."""
    if _answer_dir is None or not (_answer_dir / "pgid").exists():
        return None
    if not (_answer_dir / "rc").exists():
        _stop(int((_answer_dir / "pgid").read_text()))
        return None
    return int((_answer_dir / "rc").read_text()), (_answer_dir / "out").read_text()[-8000:]


# Over 60 s when it runs alone on a clean clone (~90 s): mypy's first run reads torch's and transformers' types. In a
# run of the suite it runs last, when the background mypy has answered (not `long`: that would start it first).
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_the_type_checker_finds_no_error():
    answer = background_answer()
    if answer is None:
        proc = subprocess.run(COMMAND, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
        answer = proc.returncode, proc.stdout[-6000:] + proc.stderr[-2000:]
    code, output = answer
    assert code == 0, output

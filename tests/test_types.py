"""The type checker is a contract: mypy, configured by pyproject's `[tool.mypy]`, finds no error in PACKAGES (strictly
checked where pyproject's overrides say so). Imports of other modules are followed for their types but not reported
(`--follow-imports=silent`).

Its cache is the default `.mypy_cache` at the repository's root: the first run reads torch's and transformers' types
(about 90 s of one core), later runs recheck only what changed (about 7 s of CPU). In a run of the suite a first
mypy starts at the lowest priority as soon as this module is collected (conftest's `pytest_collection_finish` calls
`start_in_background`): it fills the cache with the CPU the tests before this one leave idle, and takes none from
them. The test uses its answer when it has finished; otherwise it stops it (mypy writes its cache module group by
module group, so the work done is kept) and checks again at normal priority."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What mypy checks: all of src/asyncflow, strictly where pyproject's overrides say so (the core packages).
PACKAGES = ("asyncflow",)
COMMAND = [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--follow-imports=silent",
           *(arg for name in PACKAGES for arg in ("-p", name))]
TIMEOUT_S = 900

_background: subprocess.Popen[str] | None = None


def start_in_background() -> None:
    """Start mypy at the lowest CPU priority (once): `test_the_type_checker_finds_no_error` reads its answer."""
    global _background
    if _background is None:
        _background = subprocess.Popen(COMMAND, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       preexec_fn=lambda: os.nice(19))
        atexit.register(_background.kill)  # a session stopped early leaves no mypy behind


def background_answer() -> tuple[int, str] | None:
    """The background mypy's exit code and output if it has finished; None (and it is stopped) if not."""
    if _background is None:
        return None
    if _background.poll() is None:
        _background.kill()
        _background.communicate(timeout=60)
        return None
    out, err = _background.communicate(timeout=60)
    return _background.returncode, out[-6000:] + err[-2000:]


# Over 60 s when it runs alone on a clean clone (~90 s): mypy's first run reads torch's and transformers' types. In a
# run of the suite the background mypy has filled the cache by then, and the check here takes seconds.
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(TIMEOUT_S)
def test_the_type_checker_finds_no_error():
    answer = background_answer()
    if answer is None:
        proc = subprocess.run(COMMAND, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
        answer = proc.returncode, proc.stdout[-6000:] + proc.stderr[-2000:]
    code, output = answer
    assert code == 0, output

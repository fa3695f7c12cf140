"""The type checker is a contract: mypy, configured by pyproject's `[tool.mypy]`, finds no error in PACKAGES (strictly
checked where pyproject's overrides say so). Imports of other modules are followed for their types but not reported
(`--follow-imports=silent`).

Its cache is the default `.mypy_cache` at the repository's root: the first run reads torch's and transformers' types
(about 2 minutes on a 2-core CPU), later runs recheck only what changed (about 15 s)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What mypy checks: all of src/asyncflow, strictly where pyproject's overrides say so (the core packages).
PACKAGES = ("asyncflow",)


# Over 60 s on a clean clone (~90 s in CI): mypy's first run reads torch's and transformers' types (a warm
# cache rechecks in ~15 s).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_type_checker_finds_no_error():
    targets = [arg for name in PACKAGES for arg in ("-p", name)]
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--follow-imports=silent", *targets],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]

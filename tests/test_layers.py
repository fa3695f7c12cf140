"""The layers of the design are a contract: import-linter checks pyproject's `[tool.importlinter]`
contracts (imports point down the layers; the config is read by workers and above; only the Ray
runtime and the Ray transports import ray)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_imports_keep_the_layer_contracts():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": str(lint.parent)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_no_line_is_longer_than_120_characters():
    long = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("src", "tests", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 120
    ]
    assert not long, f"{len(long)} lines over 120 characters: {long[:20]}"

#!/usr/bin/env bash
# Set up (if needed), lint (ruff, rules in pyproject.toml) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check src tests benchmarks examples scripts
# --durations: the slowest tests of every run are in its log (what to shorten next)
exec .venv/bin/python -m pytest --durations=25 "$@"

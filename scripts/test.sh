#!/usr/bin/env bash
# Set up (if needed), lint (ruff, rules in pyproject.toml) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check src tests benchmarks examples scripts
# Two xdist workers (ASYNCFLOW_TEST_WORKERS=0: one process): the tests of the session's Ray cluster stay on one of
# them (tests/conftest.py), the `long` ones start first. --durations: the slowest tests of every run are in its log.
exec .venv/bin/python -m pytest -n "${ASYNCFLOW_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"

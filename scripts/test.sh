#!/usr/bin/env bash
# Set up (if needed), lint (ruff, rules in pyproject.toml) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check src tests benchmarks examples scripts
# Two xdist workers (ASYNCFLOW_TEST_WORKERS=0: one process): the tests of the session's Ray cluster stay on one of
# them, as do those of a module-scoped fixture (tests/conftest.py); in conftest's order (--no-loadscope-reorder: not
# xdist's, largest group first), so the `long` ones start first. --durations and -rs: the slowest tests, and why
# any was skipped, are in the log.
exec .venv/bin/python -m pytest -n "${ASYNCFLOW_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder \
  --durations=25 -rs "$@"

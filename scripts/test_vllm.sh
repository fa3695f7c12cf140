#!/usr/bin/env bash
# Set up .venv-vllm (if needed) and run the tests that need vLLM (marker `vllm`) with its CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
# The CI-size rehearsal (marker `rehearsal`, ~80 s on an idle machine) is one of them; two workers as in test.sh.
exec .venv-vllm/bin/python -m pytest -m vllm -n "${ASYNCFLOW_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder \
  --durations=10 -rs "$@"

#!/usr/bin/env bash
# Set up .venv-vllm (if needed) and run the tests that need vLLM (marker `vllm`) with its CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
# The CI-size rehearsal (marker `rehearsal`, ~4 min) is left out: `bash scripts/test_vllm.sh -m rehearsal` runs it.
exec .venv-vllm/bin/python -m pytest -m "vllm and not rehearsal" --durations=10 "$@"

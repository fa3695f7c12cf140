#!/usr/bin/env bash
# The GPU check: the `gpu` tests, then benchmarks/gpu_check.py (log-prob agreement between the inference engine and
# the trainer in fp32 and bf16, weight-update time, sync vs async step time, the vLLM path when vllm is importable)
# and benchmarks/bench_precision.py (peak memory and step time with and without bf16 and activation checkpointing),
# all on the first CUDA device. Arguments go to benchmarks/gpu_check.py (e.g. --preset small-llama --steps 6).
# Python: $PYTHON, else .venv/bin/python, else python3 (with asyncflow's dependencies; src/ is put on the path).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA device')"
echo "== gpu tests"
"$PY" -m pytest -m gpu tests/engines/test_cuda.py -q -p no:cacheprovider
echo "== benchmarks/gpu_check.py $*"
"$PY" benchmarks/gpu_check.py "$@"
echo "== benchmarks/bench_precision.py (peak memory of one training step)"
"$PY" benchmarks/bench_precision.py --device cuda --preset base-llama --rows 32 --response-tokens 1024 \
    --micro-batch 32 --repeats 3

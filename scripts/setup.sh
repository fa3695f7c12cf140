#!/usr/bin/env bash
# Create .venv (once) and install asyncflow with its test extras. torch is pinned through
# constraints.txt so a CPU machine never pulls CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import asyncflow, torch, transformers, ray, pytest, hypothesis, importlinter, ruff, wandb, peft, fastapi, uvicorn, openai" 2>/dev/null; then
  .venv/bin/pip install -q -c constraints.txt "torch==2.13.0"
  # the extras whose tests run in the default suite: ray (separated deployment), wandb (~10 s), lora (peft),
  # serve (fastapi/uvicorn)
  .venv/bin/pip install -q -c constraints.txt -e ".[test,ray,wandb,lora,serve]"
fi

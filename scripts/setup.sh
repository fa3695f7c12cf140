#!/usr/bin/env bash
# Create .venv (once) and install asyncflow with its test extras. torch is pinned through
# constraints.txt so a CPU machine never pulls CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import asyncflow, torch, transformers, ray, pytest, hypothesis, importlinter, wandb, peft" 2>/dev/null; then
  .venv/bin/pip install -q -c constraints.txt "torch==2.13.0"
  # wandb (~10 s) and lora (peft) so that their tests run too
  .venv/bin/pip install -q -c constraints.txt -e ".[test,wandb,lora]"
fi

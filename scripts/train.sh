#!/usr/bin/env bash
# Set up (if needed) and run the main job: SFT warm-up, then GRPO on the built-in arithmetic task.
# Extra arguments go to `asyncflow train` (overrides like train.steps=100, --output DIR, --resume).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One torch thread: these tiny models gain little from more, and on a CPU shared with other jobs
# oversubscribed OpenMP threads slow every step down many times over. Pass --threads 2 to change.
exec .venv/bin/asyncflow train examples/arithmetic_grpo.yaml --threads 1 "$@"

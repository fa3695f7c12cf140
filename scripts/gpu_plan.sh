#!/usr/bin/env bash
# The planner on one GPU (no Ray, no vLLM needed): benchmarks/bench_plan.py with the inline runtime on the first CUDA
# device, the trainer in bf16 autocast (float32 master weights, `model.dtype=float32`) and the rollout engine in
# bfloat16 (`rollout.dtype: auto` under `train.precision=bf16`), as runs on a GPU use them.
#   1. base-llama (13.8M params), main job only: `asyncflow profile`, its costs beside the spec profile h100's for
#      the same shape (--spec h100), then sync and async k=1 for 40 steps each, predicted vs measured over steps
#      21-39 (the built-in engine meets new prefill shapes for the first ~20 steps on a GPU: BENCHMARKS.md).
#   2. a random-init model of the Qwen2.5-0.5B shape (~360M params with the character tokenizer), built by the
#      benchmark (--build-model) outside $OUT: its profile and --spec h100 table, then a 20-step sync run.
# Each part runs under its own `timeout`, all of them within BUDGET_S seconds (default 420), so a part that fails or
# hangs loses only its own output. Everything printed also goes to ${OUT:-/tmp/gpu_plan}/*.log. DEVICE=cpu (with a
# small BUDGET_S) tries the script itself on a machine without a GPU.
#   PYTHON=python3 bash scripts/gpu_plan.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_plan}
MODEL_DIR=${MODEL_DIR:-/tmp/gpu_plan_qwen05b}  # ~1.4 GB (fp32): not under $OUT
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEADLINE=$((SECONDS + ${BUDGET_S:-420}))
GPU=(--placement inline --set "model.device=${DEVICE:-cuda}" --set model.dtype=float32 --set train.precision=bf16
     --set rollout.dtype=auto --invocations 1 --repeats 3 --spec h100 --workloads main)

# part NAME SECONDS RESERVE CMD...: CMD under `timeout`, for at most SECONDS and never into the last RESERVE seconds
# of the budget (kept for the parts after it); its output to stdout, $OUT/NAME.log and $OUT/all.log. Never fails.
part() {
  local name=$1 limit=$2 reserve=$3 rc=0 start=$SECONDS
  shift 3
  local left=$((DEADLINE - SECONDS - reserve)) note=""
  if ((limit > left)); then limit=$left; fi
  if ((limit < 20)); then
    echo "== $name: skipped, ${left} s of the budget left" | tee -a "$OUT/all.log"
    return 0
  fi
  echo "== $name (at most ${limit} s): $*" | tee "$OUT/$name.log" | tee -a "$OUT/all.log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log" "$OUT/all.log" || rc=$?
  if ((rc == 124 || rc == 137)); then note=" (timed out)"; fi
  echo "== $name: exit $rc after $((SECONDS - start)) s$note" | tee -a "$OUT/$name.log" "$OUT/all.log"
  return 0
}

: >"$OUT/all.log"
part env 30 300 "$PY" -c "
import platform, torch, transformers, pydantic
print('python', platform.python_version(), 'torch', torch.__version__, 'transformers', transformers.__version__,
      'pydantic', pydantic.VERSION)
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')
"
part base_llama 220 170 "$PY" benchmarks/bench_plan.py "${GPU[@]}" --modes "sync,async k=1" --steps 40 --warmup 20 \
  --set model.path=preset:base-llama
part build_qwen05b 60 130 "$PY" benchmarks/bench_plan.py --build-model "$MODEL_DIR"
part qwen05b 200 0 "$PY" benchmarks/bench_plan.py "${GPU[@]}" --modes sync --steps 20 --warmup 10 \
  --set "model.path=$MODEL_DIR"
echo "== done in $SECONDS s; logs in $OUT" | tee -a "$OUT/all.log"

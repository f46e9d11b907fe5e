#!/usr/bin/env bash
# One device call: the `cuda` tests, then the benchmarks; logs under $OUT, a short table last.
#   bash bench/gpu_run.sh [pytest -k expression] [bench args...]
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
K=${1:-}; shift || true
python3 -m bench.cuda_suite ${K:+-k "$K"} --out "$OUT" 2>&1 | tee "$OUT/pytest_cuda.log" | tail -40
[ "${SKIP_BENCH:-0}" = 1 ] || python3 -m bench.ops --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -120

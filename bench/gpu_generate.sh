#!/usr/bin/env bash
# One device call for generation: the command line's and LLM's `cuda` tests, the command line on the GPU,
# then bench/generate.py; logs under $OUT.
#   bash bench/gpu_generate.sh            (SKIP_BENCH=1 / SKIP_TESTS=1 to run one half)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m cuda tests/test_llm.py tests/test_generate_cli.py -p no:cacheprovider --durations=5 \
    2>&1 | tee "$OUT/pytest_generate_cuda.log" | tail -40 || rc=1
  # the command line on the GPU: the shipped model, streamed text, stats line
  XDG_CACHE_HOME=/tmp/cache python3 -m modeling.generate --prompt "The meaning of life is" --max-tokens 32 \
    2>&1 | tee "$OUT/cli.log" || rc=1
  printf 'The quick brown fox\nHello world\nOnce upon a time\n' > /tmp/prompts.txt
  XDG_CACHE_HOME=/tmp/cache python3 -m modeling.generate --batch-file /tmp/prompts.txt --chat \
    --temperature 0.8 --top-k 50 --top-p 0.9 --seed 0 --max-tokens 16 2>&1 | tee -a "$OUT/cli.log" || rc=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m bench.generate --out "$OUT" 2>&1 | tee "$OUT/bench_generate.log" | tail -20 || rc=1
fi
exit $rc

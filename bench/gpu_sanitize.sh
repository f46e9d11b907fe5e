#!/usr/bin/env bash
# The op tests and one short generate under NVIDIA compute-sanitizer; logs under $OUT, a summary
# table of each run's "ERROR SUMMARY: N errors" printed last.
#
#   bash bench/gpu_sanitize.sh TOOL [SUBSETS] [-k EXPR]
#
#   TOOL     memcheck | racecheck | initcheck | synccheck
#   SUBSETS  comma-separated, run in order (default: all):
#              norm rope linear activation attention conv gdr contract training edge launch   (the `cuda`
#                tests of tests/test_ops_*.py, tests/test_training_ops.py, tests/test_edge_cases.py,
#                tests/test_launch.py: the cached launch path and kernels launched by Inductor)
#              graph           the tests that capture CUDA graphs
#              generate        `python -m modeling.generate` on a tiny random checkpoint, eager decode
#              generate-graph  the same with the CUDA-graph decode
#            groups: ops (the eleven op subsets), all (ops, graph, generate, generate-graph)
#   -k EXPR  a pytest -k expression for the test subsets (racecheck's default: "not fp16 and not fp32")
#
# EACH=1 runs every test of a test subset in its own sanitized process, at most PER_TEST seconds
# each (default 150), PARALLEL of them at once (default 1; racecheck leaves a GPU mostly idle,
# so several at once finish more tests per call): a test that crashes the process or runs long
# costs only itself. The subset's row then counts passed / failed / skipped / crashed / timed-out tests, and
# $OUT/sanitize-TOOL-SUBSET-each.md lists every test with its errors and result.
#
# One call keeps within BUDGET seconds (default 540, under a 10-minute device call): each run gets
# the time left (GNU timeout on its whole process group); a run cut short shows TIMEOUT, and the
# subsets not reached show "not run": pass them to the next call. Several calls may run side by side
# (one per GPU, or several on one): give each its own OUT and TMPDIR.
#
# Allocation: memcheck and initcheck run with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every tensor is
# its own cudaMalloc (memcheck sees a tensor's true bounds; initcheck does not flag reads of memory
# the caching allocator recycles). CUDA-graph capture needs the caching allocator's private pools,
# so `graph` and `generate-graph` always run with caching (memcheck there catches accesses outside
# the allocator's segments only). racecheck and synccheck do not depend on it and run with caching.
set -u -o pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
export QWEN_SANITIZER=1  # tests skip their slow float64 token-by-token references (see tests/helpers.py)
OUT=${OUT:-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-540}
PRINT_LIMIT=${PRINT_LIMIT:-20}
START=$SECONDS

TOOL=${1:-}
case "$TOOL" in memcheck|racecheck|initcheck|synccheck) ;; *)
  sed -n '2,/^set -u/p' "$0" | sed '$d' >&2; exit 2;; esac
shift
SUBSETS=all
if [ $# -gt 0 ] && [ "$1" != "-k" ]; then SUBSETS=$1; shift; fi
KEXPR=""
if [ "${1:-}" = "-k" ]; then KEXPR=${2:-}; shift 2 || true; fi
[ -z "$KEXPR" ] && [ "$TOOL" = racecheck ] && KEXPR="not fp16 and not fp32"

OPS="norm rope linear activation attention conv gdr contract training edge launch"
expanded=""
for s in ${SUBSETS//,/ }; do
  case "$s" in ops) expanded+=" $OPS";; all) expanded+=" $OPS graph generate generate-graph";; *) expanded+=" $s";; esac
done

SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null \
      || ls /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | tail -1)
if [ -z "$SAN" ]; then echo "compute-sanitizer not found (PATH, /usr/local/cuda*/bin)" >&2; exit 2; fi

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
"$SAN" --version | tail -1
echo "tool $TOOL; subsets:$expanded${KEXPR:+; -k \"$KEXPR\"}; budget ${BUDGET}s"

# subset -> "test files|-k expression of its own|1 if it captures CUDA graphs"
spec() {
  case "$1" in
    norm)       echo "tests/test_ops_norm.py||0";;
    rope)       echo "tests/test_ops_rope.py||0";;
    linear)     echo "tests/test_ops_linear.py||0";;
    activation) echo "tests/test_ops_activation.py||0";;
    attention)  echo "tests/test_ops_attention.py tests/test_ops_paged_attention.py|not one_cuda_graph|0";;
    conv)       echo "tests/test_ops_causal_conv1d.py||0";;
    gdr)        echo "tests/test_ops_gated_delta_rule.py tests/test_ops_gated_delta_rule_varlen.py|not replays_in_cuda_graph|0";;
    contract)   echo "tests/test_ops_contract.py||0";;
    training)   echo "tests/test_training_ops.py||0";;
    edge)       echo "tests/test_edge_cases.py||0";;
    launch)     echo "tests/test_launch.py||0";;
    graph)      echo "tests/test_ops_cuda_graph.py tests/test_ops_gated_delta_rule.py|replay|1";;
    generate)   echo "||0";;
    generate-graph) echo "||1";;
    *) return 1;;
  esac
}

# sanitize BASE SECONDS CMD...: run CMD under the sanitizer (log BASE.log, output BASE.out), at most
# SECONDS; sets ERRORS (the summed "ERROR SUMMARY: N errors", racecheck's "RACECHECK SUMMARY ... (N
# errors", or "no summary"), RESULT (pytest's last count line, or the exit status) and TOOK.
sanitize() {
  local base=$1 limit=$2 t0=$SECONDS rc
  shift 2
  env ${env_cache[@]+"${env_cache[@]}"} timeout --signal=TERM --kill-after=20 "$limit" \
    "$SAN" --tool "$TOOL" --target-processes all --print-limit "$PRINT_LIMIT" --log-file "$base.log" "$@" \
    > "$base.out" 2>&1
  rc=$?
  TOOK=$((SECONDS - t0))
  [ "${EACH:-0}" = 1 ] || tail -3 "$base.out" | sed 's/^/   /'
  ERRORS=$(grep -hE "(ERROR|RACECHECK) SUMMARY" "$base.log" 2>/dev/null \
           | sed -E 's/.*ERROR SUMMARY: ([0-9]+).*/\1/; s/.*RACECHECK SUMMARY.*\(([0-9]+) errors?.*/\1/' \
           | awk '{s += $1} END {if (NR) print s; else print "no summary"}')
  RESULT=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s" "$base.out" | tail -1 \
           | sed -E 's/=+//g; s/^ +| +$//g')
  [ -z "$RESULT" ] && RESULT="exit $rc"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then RESULT="TIMEOUT after ${TOOK}s; $RESULT"; fi
}

CKPT=${TMPDIR:-/tmp}/qwen-sanitize-checkpoint
PER_TEST=${PER_TEST:-150}
ROWS=()
for s in $expanded; do
  if ! sp=$(spec "$s"); then ROWS+=("| $s | - | unknown subset | - |"); continue; fi
  IFS='|' read -r files own_k graph <<< "$sp"
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 60 ]; then ROWS+=("| $s | - | not run (budget) | - |"); continue; fi
  k=$own_k
  if [ -n "$KEXPR" ] && [ -n "$files" ]; then k="${k:+($k) and }($KEXPR)"; fi
  env_cache=()
  caching="cached"
  if [ "$graph" = 0 ] && { [ "$TOOL" = memcheck ] || [ "$TOOL" = initcheck ]; }; then
    env_cache=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); caching="uncached"
  fi
  if [ -n "$files" ]; then
    # shellcheck disable=SC2206
    cmd=(python3 -m pytest -q -m cuda -p no:cacheprovider ${files} ${k:+-k "$k"})
  else
    if [ ! -f "$CKPT/.random-checkpoint" ]; then
      python3 -c "from modeling.model.random_checkpoint import build_random_checkpoint as b; b('$CKPT')" || true
    fi
    cmd=(python3 -m modeling.generate --model "$CKPT" --device cuda --prompt "The meaning of life is"
         --max-tokens 16 --temperature 0.8 --top-k 20 --top-p 0.9 --seed 0)
    [ "$graph" = 0 ] && cmd+=(--enforce-eager)
  fi
  if [ "${EACH:-0}" != 1 ] || [ -z "$files" ]; then
    echo "== $s ($caching, ${left}s left): ${cmd[*]}"
    sanitize "$OUT/sanitize-$TOOL-$s" "$((left - 10))" "${cmd[@]}"
    ROWS+=("| $s | $ERRORS | $RESULT | ${TOOK}s, $caching |")
    continue
  fi
  mapfile -t ids < <("${cmd[@]}" --collect-only 2>/dev/null | grep "::")
  echo "== $s ($caching, ${left}s left): ${#ids[@]} tests, each in its own process"
  each="$OUT/sanitize-$TOOL-$s-each.md"
  printf '| test | errors | result |\n|---|---|---|\n' > "$each"
  total=0; passed=0; failed=0; skipped=0; crashed=0; timed_out=0; not_run=0; t_subset=$SECONDS
  rm -f "$each".row.*
  for i in "${!ids[@]}"; do
    id=${ids[$i]}
    while [ "$(jobs -rp | wc -l)" -ge "${PARALLEL:-1}" ]; do wait -n; done
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 30 ]; then echo "| $id | - | not run (budget) |" > "$each.row.$i"; continue; fi
    (sanitize "$OUT/sanitize-$TOOL-$s-$i" "$(( left - 10 < PER_TEST ? left - 10 : PER_TEST ))" \
       python3 -m pytest -q -m cuda -p no:cacheprovider "$id"
     echo "| $id | $ERRORS | $RESULT |" > "$each.row.$i"
     echo "   $id: $ERRORS errors, $RESULT") &
  done
  wait
  for i in "${!ids[@]}"; do
    row=$(cat "$each.row.$i"); rm -f "$each.row.$i"
    echo "$row" >> "$each"
    IFS='|' read -r _ _ errors result _ <<< "$row"
    errors=${errors// /}
    [[ "$errors" =~ ^[0-9]+$ ]] && total=$((total + errors))
    case "$result" in
      *"not run"*) not_run=$((not_run + 1));;
      *TIMEOUT*) timed_out=$((timed_out + 1));;
      *failed*) failed=$((failed + 1));;
      *passed*) passed=$((passed + 1));;
      *skipped*) skipped=$((skipped + 1));;
      *) crashed=$((crashed + 1));;
    esac
  done
  ROWS+=("| $s | $total | each test alone: $passed passed, $failed failed, $skipped skipped, $crashed crashed, $timed_out timed out, $not_run not run ($(basename "$each")) | $((SECONDS - t_subset))s, $caching |")
done

{
  echo
  echo "compute-sanitizer --tool $TOOL${KEXPR:+ (-k \"$KEXPR\")}: ERROR SUMMARY per run"
  echo
  echo "| subset | errors | result | time, allocator |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
} | tee "$OUT/sanitize-$TOOL-summary.md"

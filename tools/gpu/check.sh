#!/usr/bin/env bash
# On the GPU machine, from the repository root with .whl/ carried along: install the wheels into
# a private directory, run the GPU tests file group by file group (most decisive first, each
# under its own time limit), run a bench and print a short table.
#   tools/gpu/check.sh [SHAPE] [WEIGHTS]        (default: qwen3_5-27b q4)
# Environment: OUT (default out/gpu-check) gets every log and bench.json; TESTS=0 skips the
# tests, BENCH=0 the bench; BENCH_ARGS replaces the bench's test flags; *_LIMIT (seconds)
# change a group's time limit.
set -uo pipefail
cd "$(dirname "$0")/../.."
shape=${1:-qwen3_5-27b}
weights=${2:-q4}
out=${OUT:-out/gpu-check}
site=${NINFER_GPU_SITE:-/tmp/ninfer-site}
mkdir -p "$out"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
    || { echo "wheel install failed" >&2; exit 1; }
fi
export PYTHONPATH="$PWD:$PWD/tests:$site${PYTHONPATH:+:$PYTHONPATH}"

{ git rev-parse --short HEAD 2>/dev/null || echo "no git"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } | tee "$out/machine.txt"

failed=0
# name, limit in seconds, files; times seen on an H200 with a cold kernel cache: kernels
# ~130-250 s, moe ~50 s, graphs+engine ~90-110 s, prefill ~60-160 s (fla tunes once per head shape)
group() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider "$@" > "$out/pytest-$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || failed=1
  echo "== pytest $name (rc $rc, $((SECONDS - start)) s): $(tail -n 1 "$out/pytest-$name.log")"
  grep -E '^(FAILED|ERROR)' "$out/pytest-$name.log" | head -n 10
}
if [ "${TESTS:-1}" != 0 ]; then
  group kernels "${KERNELS_LIMIT:-450}" tests/gpu/test_int_gemv_gpu.py tests/gpu/test_gluon_gemv_gpu.py tests/gpu/test_triton_kernels.py tests/gpu/test_attention_prelude_gpu.py tests/gpu/test_fused_projections_gpu.py tests/gpu/test_x_split_gpu.py tests/gpu/test_gdn_in_projection_gpu.py
  group moe "${MOE_LIMIT:-150}" tests/gpu/test_moe_gpu.py tests/gpu/test_moe_router_gpu.py
  group engine "${ENGINE_LIMIT:-240}" tests/gpu/test_graphs_gpu.py tests/gpu/test_engine_gpu.py
  group folds "${FOLDS_LIMIT:-240}" tests/gpu/test_norm_fold_gpu.py
  group prefill "${PREFILL_LIMIT:-240}" tests/gpu/test_triton_prefill_kernels.py tests/gpu/test_prefill_gpu.py
  # tensor and expert parallelism over NCCL: skipped with fewer than two GPUs
  group parallel "${PARALLEL_LIMIT:-300}" tests/gpu/test_parallel_gpu.py
fi

if [ "${BENCH:-1}" != 0 ]; then
  # each row reaches bench.err as it is timed, so a run cut short still shows what it measured
  read -r -a tests <<< "${BENCH_ARGS:--p 4096 -n 64 --concurrency 1,8 -r 2 --profile}"
  start=$SECONDS
  timeout "${BENCH_LIMIT:-400}" python3 -m ninfer bench --shape "$shape" --weights "$weights" \
    "${tests[@]}" -o table --output-file "$out/bench.json" > "$out/bench.txt" 2> "$out/bench.err"
  bench_rc=$?
  [ "$bench_rc" -eq 0 ] || failed=1
  echo "== ninfer bench $shape $weights (rc $bench_rc, $((SECONDS - start)) s)"
  if [ "$bench_rc" -eq 0 ]; then
    grep -v USDT "$out/bench.txt"
  else
    grep -E '^(engine|ninfer|hf) ' "$out/bench.err"
    grep -v USDT "$out/bench.err" | tail -n 5
  fi
fi
exit "$failed"

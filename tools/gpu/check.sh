#!/usr/bin/env bash
# On the GPU machine, from the repository root with .whl/ carried along: install the wheels into
# a private directory, run the GPU tests, run a short bench and print a short table.
#   tools/gpu/check.sh [SHAPE] [WEIGHTS]        (default: qwen3_5-27b q4)
# Writes everything to ${OUT:-out/gpu-check}: pytest log, bench JSON, summary.
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
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"

{ git rev-parse --short HEAD 2>/dev/null || echo "no git"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } | tee "$out/machine.txt"

python3 -m pytest -m gpu -q -p no:cacheprovider tests > "$out/pytest-gpu.log" 2>&1
pytest_rc=$?

python3 -m ninfer bench --shape "$shape" --weights "$weights" \
  -p 512,4096 -n 128 -pg 2048,128 -r 3 --concurrency 1,8 \
  -o table --output-file "$out/bench.json" > "$out/bench.txt" 2> "$out/bench.err"
bench_rc=$?

echo
echo "== pytest -m gpu (rc $pytest_rc): $(tail -n 1 "$out/pytest-gpu.log")"
grep -E '^(FAILED|ERROR)' "$out/pytest-gpu.log" | head -n 20
echo "== ninfer bench $shape $weights (rc $bench_rc)"
if [ "$bench_rc" -eq 0 ]; then cat "$out/bench.txt"; else tail -n 20 "$out/bench.err"; fi
[ "$pytest_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

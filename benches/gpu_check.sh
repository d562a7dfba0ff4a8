#!/usr/bin/env bash
# GPU check for the machine with a GPU (one H200): runs every GPU test, then the kernel
# benchmark and the manager's thread-scaling benchmark, and prints short tables last. Builds nothing: run it in a checkout where
# pagedkv is already installed (the prebuilt abi3 wheel) with torch and cupy-cuda13x.
# Budget: about 5 minutes of tests and benchmark on an H200 (each step has a timeout).
#   bash benches/gpu_check.sh            (from anywhere; writes benches/results/ or $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/pagedkv-cupy-cache}"
RESULTS="${OUT:-benches/results}"
mkdir -p "$RESULTS"
STAMP="$(date -u +%Y%m%d-%H%M)"

echo "=== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
timeout 60 "$PY" -c "import torch, cupy, pagedkv; print('torch', torch.__version__, 'cupy', cupy.__version__, 'cuda', torch.cuda.is_available(), 'pagedkv', pagedkv.__version__)"

echo "=== GPU tests (pytest -m gpu)"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/kernels/test_kernels.py tests/kernels/test_kernels_e2e.py tests/kernels/test_kernels_bounds.py \
    tests/kernels/test_kernels_window.py tests/kernels/test_groups_e2e.py tests/kernels/test_launch_path.py \
    tests/tiers/test_tier_blocks.py 2>&1 | tee "$RESULTS/gpu-tests-$STAMP.log" | tail -25
rc_tests=${PIPESTATUS[0]}

echo "=== benchmark"
timeout 300 "$PY" benches/gpu_bench.py --out "$RESULTS/gpu-bench-$STAMP.md" > "$RESULTS/gpu-bench-$STAMP.log" 2>&1
rc_bench=$?
tail -n 30 "$RESULTS/gpu-bench-$STAMP.log"

echo "=== thread scaling of the block manager (16 cores)"
timeout 120 "$PY" benches/test_bench_threads.py --threads 1 2 4 8 16 \
    --out "$RESULTS/thread_scaling-$STAMP.md" > "$RESULTS/thread_scaling-$STAMP.log" 2>&1
rc_threads=$?

echo
echo "=== summary: tests rc=$rc_tests, benchmark rc=$rc_bench, threads rc=$rc_threads"
[ -f "$RESULTS/thread_scaling-$STAMP.md" ] && cat "$RESULTS/thread_scaling-$STAMP.md"
[ -f "$RESULTS/gpu-bench-$STAMP.md" ] && cat "$RESULTS/gpu-bench-$STAMP.md"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ] && [ "$rc_threads" -eq 0 ]

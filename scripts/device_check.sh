#!/usr/bin/env bash
# On the GPU machine (no package registry there): build, run every test, run compute-sanitizer on
# the CUDA tests' small cases and the benchmarks, writing logs and JSON under $OUT.
# Needs .deps/ from scripts/fetch_device_deps.sh (carried along with the working tree).
# Usage: scripts/device_check.sh [quick]   (quick: build + GPU tests only)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
mode=${1:-full}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
step() { echo "== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

step "configure + build"
cmake -S . -B build-dev -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DMOEFQ_FUZZ=OFF > "$OUT/build.log" 2>&1 &&
  cmake --build build-dev -j"$(nproc)" >> "$OUT/build.log" 2>&1
rc=$?
tail -n 30 "$OUT/build.log"
[ $rc -eq 0 ] || { echo "BUILD FAILED"; exit 1; }

step "tests"
labels="gpu|cpu"
[ "$mode" = quick ] && labels="gpu"
ctest --test-dir build-dev -L "$labels" --output-on-failure -j8 > "$OUT/ctest.log" 2>&1
test_rc=$?
grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest.log" | tail -n 30
# Figures some tests measure and print (ctest shows output only on failure).
build-dev/tests/test_qdq_cuda --gtest_filter='CudaQdq.Nvfp4Approx*' 2>&1 | grep -E "differ|OK|FAILED" | tee "$OUT/measured.txt"

if [ "$mode" != quick ]; then
  step "compute-sanitizer memcheck + racecheck (small cases)"
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 build-dev/tests/test_qdq_cuda \
      --gtest_filter='CudaQdq.Staging*:CudaQdq.Amax*:CudaQdq.Bf16Equals*' > "$OUT/sanitizer_$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/sanitizer_$tool.log" | tail -n 2 | tr '\n' ' ')"
  done

  step "bench qdq"
  build-dev/moefq bench qdq --json "$OUT/bench_qdq.json" 2>&1 | tee "$OUT/bench_qdq.txt"
fi
step "done (tests rc=$test_rc)"
exit $test_rc

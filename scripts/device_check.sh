#!/usr/bin/env bash
# On the GPU machine (no package registry there): build, run every test, run compute-sanitizer on
# the CUDA tests' small cases, and the GPU benchmarks. Logs and JSON go to $OUT/logs/ and are
# packed into $OUT/device_run.tar.gz (the device tool returns at most 8 files); a summary is
# printed and kept in $OUT/summary.txt.
# Needs .deps/ from scripts/fetch_device_deps.sh (carried along with the working tree).
# Usage: scripts/device_check.sh [quick|gpu|full|bench|eval] [benchmark ...]
#   quick: build + GPU tests; gpu: + benchmarks; full: + CPU tests, sanitizers and benchmarks;
#   bench: build + benchmarks; eval: build + GPU tests + the main job's timings (one deepseek-v3
#   layer, 20 layers through bench eval) and two fixed-seed reports (saved under the logs, and
#   with MOEFQ_EVAL_BASELINE=DIR compared with DIR/<name>/report.json of an earlier build: the
#   JSON byte-identical). MOEFQ_SASS=1 also saves the SASS of the GEMM and combine kernels;
#   MOEFQ_NCU=1 adds ncu counters of the combine kernels inside the layer benchmark and alone;
#   MOEFQ_NCU_CUBLAS=1 times cuBLASLt's GEMMs of `bench gemm` under ncu at the locked base clock
#   (real operands, then constant ones: the same work, so a difference outside ncu is the clock);
#   MOEFQ_NCU_LAYER=1 times the layer's kernels one by one under ncu: deepseek-v3 at 128 and 4096
#   tokens per rank, deepseek-v4-flash at 512 (scripts/ncu_layer_table.py: where the time goes).
#   benchmarks: any of qdq combine gemm moe (default all)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
LOG="$OUT/logs"
mkdir -p "$LOG"
mode=${1:-full}
shift || true
benches=${*:-qdq combine gemm moe}
export MOEFQ_SKIP_BROWSER=1  # no chromium there (no package registry); CI runs the browser test
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
exec > >(tee "$OUT/summary.txt") 2>&1
step() { echo "== $* ($(date +%T))"; }
pack() { tar -C "$OUT" -czf "$OUT/device_run.tar.gz" logs; }
trap pack EXIT

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$LOG/gpu.txt"

# The Python tests need pytest: .deps carries Debian's (pure Python) for a python3 without one.
if ! python3 -c "import pytest" > /dev/null 2>&1; then
  export PYTHONPATH="$PWD/.deps/usr/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}"
fi

step "configure + build"
cmake -S . -B build-dev -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DMOEFQ_FUZZ=OFF -DMOEFQ_PYTHON=ON > "$LOG/build.log" 2>&1 &&
  cmake --build build-dev -j"$(nproc)" >> "$LOG/build.log" 2>&1
rc=$?
# The Python extension is built with pybind11 from .deps for whatever python3 is there: if it alone
# fails, say so and build the rest without it, so the GPU tests still run.
if [ $rc -ne 0 ] && grep -qE "python/CMakeFiles/moefq_python.dir.*Error|moefq_python.*Error" "$LOG/build.log"; then
  grep -E "error:" "$LOG/build.log" | head -n 10
  echo "PYTHON PACKAGE BUILD FAILED: building without it (-DMOEFQ_PYTHON=OFF)"
  cp "$LOG/build.log" "$LOG/build_python_failed.log"
  cmake -S . -B build-dev -DMOEFQ_PYTHON=OFF >> "$LOG/build.log" 2>&1 &&
    cmake --build build-dev -j"$(nproc)" >> "$LOG/build.log" 2>&1
  rc=$?
fi
grep -E "error|warning" "$LOG/build.log" | grep -v "^--" | head -n 20
[ $rc -eq 0 ] || { tail -n 40 "$LOG/build.log"; echo "BUILD FAILED"; exit 1; }

if [ "${MOEFQ_SASS:-0}" = 1 ]; then
  for o in grouped_gemm combine_kernels; do
    obj=$(find build-dev -name "$o.cu.o" | head -n 1)
    cuobjdump -sass "$obj" > "$LOG/sass_$o.txt" 2>&1 || echo "cuobjdump failed on $obj"
  done
fi

test_rc=0
if [ "$mode" != bench ]; then
  step "tests"
  labels="gpu|cpu"
  [ "$mode" = quick ] || [ "$mode" = gpu ] || [ "$mode" = eval ] && labels="gpu"
  ctest --test-dir build-dev -L "$labels" --output-on-failure -j4 --timeout 300 > "$LOG/ctest.log" 2>&1
  test_rc=$?
  grep -E "tests passed|tests failed|Failed|\*\*\*|Test +#.*(Failed|Exception)" "$LOG/ctest.log" | tail -n 40
  # Figures some tests measure and print (ctest shows output only on failure).
  build-dev/tests/test_qdq_cuda --gtest_filter='CudaQdq.Nvfp4Approx*' 2>&1 | grep -E "differ|OK|FAILED" | tee "$LOG/measured.txt"
  build-dev/tests/test_cuda_engine --gtest_filter='*Tolerance*' 2>&1 | grep -E "measured|OK|FAILED" | tee -a "$LOG/measured.txt"

  step "python: CUDA tensors, streams, graph capture (python/tests/test_ops_cuda.py)"
  # ctest ran it above (label gpu); this shows each test and any skip reason.
  py=$(sed -n 's/^Python3_EXECUTABLE:[A-Z]*=//p' build-dev/CMakeCache.txt)
  if ls build-dev/python/moefq/_moefq*.so > /dev/null 2>&1; then
    PYTHONPATH="build-dev/python${PYTHONPATH:+:$PYTHONPATH}" MOEFQ_BINARY=build-dev/moefq "${py:-python3}" -m pytest -v -rs -p no:cacheprovider \
      python/tests/test_ops_cuda.py > "$LOG/pytest_cuda.log" 2>&1
    echo "pytest rc=$?"; grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$LOG/pytest_cuda.log" | tail -n 30
  else
    echo "no Python package built: see the 'moefq:' lines of the configure step"; grep -E "^-- moefq: Python" "$LOG/build.log"
  fi
fi

if [ "$mode" = full ]; then
  step "compute-sanitizer memcheck + racecheck (small cases)"
  sanitize() {  # test binary, gtest filter
    for tool in memcheck racecheck; do
      compute-sanitizer --tool $tool --error-exitcode 9 "build-dev/tests/$1" --gtest_filter="$2" > "$LOG/sanitizer_${tool}_$1.log" 2>&1
      echo "$1 $tool rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$LOG/sanitizer_${tool}_$1.log" | tail -n 2 | tr '\n' ' ')"
    done
  }
  sanitize test_qdq_cuda 'CudaQdq.Staging*:CudaQdq.Amax*:CudaQdq.Bf16Equals*'
  sanitize test_cuda_fake_quant 'CudaFakeQuant.Combine*:CudaFakeQuant.GraphCapture*:CudaFakeQuant.Calibrated*'
  sanitize test_combine_cuda 'CombineCuda.PlainCombine*:CombineCuda.CheckNames*:CombineCuda.GraphCapture*'
  sanitize test_grouped_gemm 'GroupedGemm.AllGroupsEmpty*:GroupedGemm.GraphReplay*'
  sanitize test_router_cuda 'CudaRouter.ZeroTokens*:CudaRouter.GraphCapture*'
  sanitize test_cuda_engine 'CudaEngine.StagingDispatch*:CudaEngine.Padding*'
fi

if [ "$mode" = eval ]; then
  step "eval: one deepseek-v3 layer, 8 ranks x 256 tokens, the default sweep"
  timeout 120 /usr/bin/time -f "wall %e s, max RSS %M KB" build-dev/moefq eval --preset deepseek-v3 --ranks 8 --device cuda \
    --out "$LOG/ds_layer" > "$LOG/eval_ds.txt" 2> "$LOG/eval_ds.err"
  echo "rc=$?"; tail -n 3 "$LOG/eval_ds.err"; cat "$LOG/eval_ds.txt"
  step "bench eval: deepseek-v3 layers 0-19"
  timeout 300 build-dev/moefq bench eval --preset deepseek-v3 --layers 0-19 --ranks 8 --tokens 256 \
    --json "$LOG/bench_eval.json" > "$LOG/bench_eval.txt" 2> "$LOG/bench_eval.err"
  echo "rc=$?"; cat "$LOG/bench_eval.txt"
  cp "$LOG/bench_eval.json" "$OUT/" 2>/dev/null
  step "fixed-seed reports (against \$MOEFQ_EVAL_BASELINE when given: an earlier build's)"
  for run in "tiny:" "ds:--preset deepseek-v3 --ranks 8 --tokens 64 --calib-batches 1 --eval-batches 1 --layers 0,3"; do
    name=${run%%:*}; args=${run#*:}
    timeout 200 build-dev/moefq eval $args --device cuda --out "$LOG/reports/$name" > "$LOG/report_$name.txt" 2>&1
    echo "$name rc=$? $(grep -E '^rows:' "$LOG/report_$name.txt" | grep -oE '[0-9.]+ s$')"
    base="${MOEFQ_EVAL_BASELINE:-}/$name/report.json"
    if [ -n "${MOEFQ_EVAL_BASELINE:-}" ] && [ -f "$base" ]; then
      # Every row's figures bit for bit (--tol 0); the run's own timings are not rows.
      python3 scripts/compare_reports.py "$LOG/reports/$name/report.json" "$base" --tol 0 | tail -n 25
    fi
  done
fi

if [ "$mode" != quick ] && [ "$mode" != eval ]; then
  step "benchmarks"
  # The SM clock and power while the benchmarks run (issue-bound kernels slow with the clock).
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 > "$LOG/clocks.csv" 2>&1 &
  clocks_pid=$!
  for name in $benches; do
    args=""
    [ "$name" = qdq ] && args="--rows 4096 32768"
    [ "$name" = moe ] && args="--preset deepseek-v3 --preset deepseek-v4-flash --preset deepseek-v4-pro"
    if build-dev/moefq bench $name --help > /dev/null 2>&1; then
      timeout 300 build-dev/moefq bench $name $args --json "$LOG/bench_$name.json" > "$LOG/bench_$name.txt" 2>&1
      echo "-- bench $name rc=$?"
      cat "$LOG/bench_$name.txt"
    fi
  done
  kill "$clocks_pid" 2>/dev/null
  cp "$LOG"/bench_*.json "$OUT/" 2>/dev/null
fi
if [ "${MOEFQ_NCU:-0}" = 1 ]; then
  # Counters of the combine kernels inside the layer benchmark and alone (clocks left alone).
  step "ncu: combine kernels in the layer and alone"
  metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__cycles_elapsed.avg.per_second,smsp__inst_executed.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,smsp__thread_inst_executed_per_inst_executed.ratio
  ncu_run() {  # log name, command...
    local name=$1
    shift
    ncu --clock-control none -k regex:combine_kernel --kernel-name-base demangled --metrics "$metrics" "$@" > "$LOG/ncu_$name.txt" 2>&1
    echo "-- ncu $name rc=$?"
    grep -E "combine_kernel|gpu__time|sm__cycles|dram__cycles|inst_executed|dram__bytes|hit_rate" "$LOG/ncu_$name.txt" | tail -n 80
  }
  ncu_run layer --launch-skip 0 --launch-count 40 build-dev/moefq bench moe --tokens 4096 --configs none combine-nvfp4 combine-fp8 --calls 1 --reps 1
  ncu_run alone --launch-count 6 build-dev/moefq bench combine --formats nvfp4 fp8 --reps 1
fi
if [ "${MOEFQ_NCU_CUBLAS:-0}" = 1 ]; then
  step "ncu: cuBLASLt at the base clock, real and constant operands"
  ncu --clock-control base -k regex:nvjet --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second \
    build-dev/moefq bench gemm --tokens 4096 --reps 1 > "$LOG/ncu_cublas.txt" 2>&1
  echo "-- ncu cublas rc=$? (launches in order: gate_up real, gate_up constant, down real, down constant)"
  grep -E "gpu__time_duration" "$LOG/ncu_cublas.txt" | awk '{printf "%s %s, ", $NF, $(NF-1)} END {print ""}'
  grep -E "per_second" "$LOG/ncu_cublas.txt" | awk '{print $(NF-1), $NF}' | sort | uniq -c
fi
if [ "${MOEFQ_NCU_LAYER:-0}" = 1 ]; then
  step "ncu: the layer's kernels one by one (the small-token targets' cases, and 4096 tokens)"
  for c in deepseek-v3:128 deepseek-v4-flash:512 deepseek-v3:4096; do
    p=${c%%:*} t=${c##*:}
    timeout 300 ncu --clock-control none --cache-control none --csv --log-file "$LOG/ncu_layer_${p}_$t.csv" \
      --metrics gpu__time_duration.sum build-dev/moefq bench moe --preset "$p" --tokens "$t" --configs none \
      --calls 1 --reps 1 > "$LOG/ncu_layer_${p}_$t.txt" 2>&1
    echo "-- ncu layer, $p, $t tokens: rc=$?"
    python3 scripts/ncu_layer_table.py "$LOG/ncu_layer_${p}_$t.csv"
  done
fi
step "done (tests rc=$test_rc)"
exit $test_rc

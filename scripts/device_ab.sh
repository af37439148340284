#!/usr/bin/env bash
# On the GPU machine: A/B timing of grouped-GEMM variants in one call. The GEMMs' times move by
# several percent from run to run (the clock follows the power the data draws), so variants are
# judged by runs that alternate, not by one run each.
#
# Usage: scripts/device_ab.sh [--rounds N] [--tokens "T ..."] [--moe "PRESET ..." [--layer-only]]
#                             [--tests] [NAME=PATCH[,VAR=VALUE...] ...]
#   The tree as carried is variant "base"; each NAME=PATCH is the tree with PATCH (a diff
#   against it, applied with patch -p1) and the environment variables given. The base is built
#   once in full and each patch incrementally on top of it; --tests runs each patched build's
#   GroupedGemm and CudaEngine tests (bit for bit against the CPU; once per patch, without the
#   variables) before any timing. Then N rounds (default 3) of `moefq bench gemm --tokens T ...`
#   (default 512 4096), the variants' order rotated each round; --moe adds `moefq bench moe
#   --preset PRESET ... --configs none` at the same token counts to each run (the whole layer),
#   --layer-only leaves bench gemm out (for changes outside the GEMMs' kernels). JSON per run
#   under $OUT/ab/, and tables of each variant's median, min and max time (GEMMs: also the median
#   ratio to cuBLASLt and SM clock) per (tokens, GEMM) and per (preset, tokens) at the end (also
#   in $OUT/ab/summary.txt).
# Needs .deps/ from scripts/fetch_device_deps.sh, as scripts/device_check.sh does.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-out}
AB="$OUT/ab"
mkdir -p "$AB"
rounds=3
tokens="512 4096"
tests=0
moe=""
layer_only=0
specs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --tests) tests=1; shift ;;
    --moe) moe=$2; shift 2 ;;
    --layer-only) layer_only=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *=*) specs+=("$1"); shift ;;
    *) echo "device_ab.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$rounds" in '' | *[!0-9]* | 0) echo "device_ab.sh: --rounds must be a positive integer" >&2; exit 2 ;; esac
[ "$layer_only" = 1 ] && [ -z "$moe" ] && { echo "device_ab.sh: --layer-only needs --moe" >&2; exit 2; }
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
src=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

names=(base)
patches=("")
envs=("")
for s in "${specs[@]}"; do
  name=${s%%=*}
  rest=${s#*=}
  patch=${rest%%,*}
  env=""
  [ "$patch" != "$rest" ] && env=${rest#*,}
  case "$name" in '' | base | *[!A-Za-z0-9_-]*) echo "device_ab.sh: bad variant name '$name'" >&2; exit 2 ;; esac
  [ -f "$patch" ] || { echo "device_ab.sh: no patch file '$patch' for variant $name" >&2; exit 2; }
  names+=("$name")
  case "$patch" in /*) patches+=("$patch") ;; *) patches+=("$src/$patch") ;; esac
  envs+=("${env//,/ }")
done
n=${#names[@]}

# One copy of the tree and one build directory: the base is built in full, then each patch is
# applied, built incrementally (only what it touches recompiles), its programs saved, and
# reverted. Variants with the same patch share their programs.
tree="$work/tree"
mkdir -p "$tree"
tar -C "$src" --exclude='./build*' --exclude=./.git -cf - . | tar -C "$tree" -xf -
targets=(moefq)
[ "$tests" = 1 ] && targets+=(test_grouped_gemm test_cuda_engine)
echo "== building ${names[*]} ($(date +%T))"
cmake -S "$tree" -B "$tree/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$src/.deps/usr" \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DMOEFQ_FUZZ=OFF -DMOEFQ_PYTHON=OFF > "$AB/build.log" 2>&1 ||
  { tail -n 20 "$AB/build.log"; echo "CONFIGURE FAILED"; exit 1; }
bins=()  # per variant: the directory of its programs
for i in "${!names[@]}"; do
  key=$(printf '%s' "${patches[$i]}" | md5sum | cut -c1-12)
  bin="$work/bin/$key"
  bins+=("$bin")
  [ -d "$bin" ] && continue
  if [ -n "${patches[$i]}" ] && ! patch -d "$tree" -p1 -s < "${patches[$i]}" >> "$AB/build.log" 2>&1; then
    echo "${names[$i]}: the patch does not apply"; exit 1
  fi
  if ! cmake --build "$tree/build" -j"$(nproc)" --target "${targets[@]}" >> "$AB/build.log" 2>&1; then
    grep -E "error" "$AB/build.log" | head -n 10; echo "${names[$i]}: BUILD FAILED"; exit 1
  fi
  mkdir -p "$bin"
  cp "$tree/build/moefq" "$bin/"
  [ "$tests" = 1 ] && cp "$tree/build/tests/test_grouped_gemm" "$tree/build/tests/test_cuda_engine" "$bin/"
  if [ -n "${patches[$i]}" ] && ! patch -d "$tree" -p1 -R -s < "${patches[$i]}" >> "$AB/build.log" 2>&1; then
    echo "${names[$i]}: the patch does not revert"; exit 1
  fi
  echo "built ${names[$i]} ($(date +%T))"
done

if [ "$tests" = 1 ]; then
  # Once per patch, without the variants' settings (those are timing knobs: a probe that drops
  # the epilogue fails these tests by design).
  echo "== tests of the patched builds ($(date +%T))"
  tested=" "
  for i in $(seq 1 $((n - 1))); do
    case "$tested" in *" ${bins[$i]} "*) continue ;; esac
    tested+="${bins[$i]} "
    for t in test_grouped_gemm test_cuda_engine; do
      timeout 150 "${bins[$i]}/$t" > "$AB/${names[$i]}_$t.log" 2>&1
      rc=$?
      echo "${names[$i]} ($(basename "${patches[$i]}")) $t rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$AB/${names[$i]}_$t.log" | tr '\n' ' ')"
      [ $rc -eq 0 ] || grep -E "^\[  FAILED  \]" "$AB/${names[$i]}_$t.log" | head -n 5
    done
  done
fi

echo "== $rounds rounds of$([ "$layer_only" = 1 ] || echo " bench gemm")${moe:+ bench moe} --tokens $tokens ($(date +%T))"
for r in $(seq 1 "$rounds"); do
  for j in $(seq 0 $((n - 1))); do
    i=$(( (j + r - 1) % n ))
    if [ "$layer_only" = 0 ]; then
      # shellcheck disable=SC2086  # the variant's VAR=VALUE words and the token counts
      env ${envs[$i]} timeout 180 "${bins[$i]}/moefq" bench gemm --tokens $tokens \
        --json "$AB/${names[$i]}_r$r.json" > "$AB/${names[$i]}_r$r.txt" 2>&1
      echo "round $r ${names[$i]} rc=$?"
    fi
    if [ -n "$moe" ]; then
      presets=()
      for p in $moe; do presets+=(--preset "$p"); done
      # shellcheck disable=SC2086  # as above
      env ${envs[$i]} timeout 300 "${bins[$i]}/moefq" bench moe "${presets[@]}" --tokens $tokens --configs none \
        --json "$AB/${names[$i]}_r${r}_moe.json" > "$AB/${names[$i]}_r${r}_moe.txt" 2>&1
      echo "round $r ${names[$i]} bench moe rc=$?"
    fi
  done
done

python3 - "$AB" "${names[@]}" << 'EOF' | tee "$AB/summary.txt"
import json, statistics, sys, glob, os
ab, names = sys.argv[1], sys.argv[2:]
rows = {}
for name in names:
    for f in sorted(glob.glob(os.path.join(ab, name + "_r*.json"))):
        if f.endswith("_moe.json"):
            continue
        for c in json.load(open(f))["cases"]:
            rows.setdefault((c["tokens"], c["gemm"]), {}).setdefault(name, []).append(c)
if rows:
    print("%-6s %-8s %-14s %10s %10s %10s %7s %10s %6s" % ("tokens", "gemm", "variant", "median_us", "min_us",
                                                         "max_us", "ratio", "cublas_us", "MHz"))
for (tokens, gemm), by in sorted(rows.items()):
    for name in names:
        cs = by.get(name, [])
        if not cs:
            continue
        t = [c["time_us"] for c in cs]
        ratio = statistics.median(c["rate_vs_cublaslt"] or 0 for c in cs)
        cub = statistics.median(c["cublaslt_us"] or 0 for c in cs)
        mhz = [c["clock"]["sm_mhz"] for c in cs if c.get("clock")]
        print("%-6d %-8s %-14s %10.1f %10.1f %10.1f %7.3f %10.1f %6s" % (tokens, gemm, name, statistics.median(t), min(t),
              max(t), ratio, cub, "%.0f" % statistics.median(mhz) if mhz else "-"))
layers = {}
for name in names:
    for f in sorted(glob.glob(os.path.join(ab, name + "_r*_moe.json"))):
        for p in json.load(open(f))["presets"]:
            for run in p["runs"]:
                if run["config"] == "none":
                    layers.setdefault((p["preset"], run["tokens"]), {}).setdefault(name, []).append(run["time_us"])
if layers:
    print()
    print("%-18s %-6s %-14s %10s %10s %10s" % ("preset", "tokens", "variant", "median_us", "min_us", "max_us"))
    for (preset, tokens), by in sorted(layers.items()):
        for name in names:
            t = by.get(name, [])
            if t:
                print("%-18s %-6d %-14s %10.1f %10.1f %10.1f" % (preset, tokens, name, statistics.median(t), min(t),
                                                               max(t)))
EOF

#!/usr/bin/env bash
# One device call for the sparse decode work (issue 9): CudaSparse gpu tests (+ compute-sanitizer
# with SANITIZE=1), bench_sparse (attention over selections, Quest on the GPU, hybrid heads vs our
# full attention), SDPA decode at the same shapes in the same run, merged report.
# Usage on the GPU machine from the repo root (binaries from bench/gpu_deps/prebuild_sparse.sh):
#   bash bench/run_gpu_sparse.sh [tests|bench|all]     carry: .prebuilt-sparse (+ .deps-cuda)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what="${1:-all}"
PB=${PREBUILT:-.prebuilt-sparse}
NVCC=$(command -v nvcc); CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $NVCC))}
CUDA_LIB=$CUDA_HOME/lib64
[ -d $CUDA_HOME/targets/x86_64-linux/lib ] && CUDA_LIB=$CUDA_HOME/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CUDA_LIB:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
if ! { [ -x $PB/spade_gpu_tests ] && $PB/spade_gpu_tests --gtest_list_tests >/dev/null 2>&1 && \
       $PB/bench_sparse /dev/null none >/dev/null 2>&1; }; then
  echo "prebuilt binaries missing or not starting: building here"
  export PKG_CONFIG_PATH=$(pwd)/.deps-cuda/lib/pkgconfig
  gcc -O3 -c .deps-cuda/src/cblas_shim.c -o /tmp/cblas_shim.o && ar rcs .deps-cuda/lib/libopenblas.a /tmp/cblas_shim.o
  B=build-gpu-sparse
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DCMAKE_PREFIX_PATH=$(pwd)/.deps-cuda -DBLA_VENDOR=OpenBLAS -DBLA_STATIC=ON >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build $B -j16 --target spade_gpu_tests >"$OUT/build.log" 2>&1 || { grep -E "error" -A3 "$OUT/build.log" | head -60; exit 1; }
  mkdir -p $PB && cp $B/spade_gpu_tests $PB/
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_sparse.cu \
    $B/libspade_cuda.a -lcublasLt -lcublas -o $PB/bench_sparse >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
echo "build/setup: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if [[ "$what" == tests || "$what" == all ]]; then
  timeout ${TEST_TIMEOUT:-240} $PB/spade_gpu_tests --gtest_filter="${GTEST_FILTER:-CudaSparse.*}" 2>&1 | \
    tee "$OUT/gpu_tests_sparse.log" | grep -vE "^\[ +(RUN|OK) " | tail -30
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  F="CudaSparse.PageAndBlockLists:CudaSparse.TopkRowsTiesAndNaN:CudaSparse.TokenListsSharedAndGroups"
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 7 $PB/spade_gpu_tests --gtest_filter=$F \
      >"$OUT/sanitize_sparse_$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_sparse_$tool.log" | tail -1)"
  done
fi
if [[ "$what" == bench || "$what" == all ]]; then
  timeout ${BENCH_TIMEOUT:-240} $PB/bench_sparse "$OUT/sparse.jsonl" ${BENCH_ARGS:-} 2>&1 | tail -80
  if [ "${SDPA:-1}" = 1 ]; then
    PYTHONUNBUFFERED=1 timeout 200 python3 -c "
import sys; sys.path.insert(0, 'python'); import bench_sdpa_decode as m
out = open('$OUT/sdpa.jsonl', 'w')
for L in (32768, 131072):
    for B in (1, 8, 32): m.decode(out, L, B)
" 2>&1 | grep -v Warning | tail -5
  fi
  python3 bench/sparse_report.py "$OUT/sparse.jsonl" "$OUT/sdpa.jsonl" "$OUT/sparse.json" "$DEV" "$COMMIT" \
    "bash bench/run_gpu_sparse.sh $what"
fi

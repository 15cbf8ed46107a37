#!/usr/bin/env bash
# One device call for LycheeCluster on the GPU: the gpu tests of the index kernels against the
# CPU ClusterIndex, then bench_lycheecluster (build at 32K vs dense prefill attention; search +
# lazy update at 64K, batch 1 and 8, vs dense decode attention) -> $OUT/lycheecluster.json.
# Binaries are built here (no GPU needed) and carried:
#   bash bench/run_gpu_lycheecluster.sh prebuild      # -> .prebuilt-lc/{lc_tests,bench_lycheecluster}
#   run(command="bash bench/run_gpu_lycheecluster.sh", carry=[".prebuilt-lc", ".deps-cuda"])
# lc_tests = tests/gpu/test_cuda_lycheecluster.cpp + the CPU reference sources it needs
# (cluster_index, kmeans, topk, the cblas shim of .deps-cuda) + libspade_cuda.a, so the GPU
# image needs only libcublasLt from its toolkit. Env: TESTS=0|1, BENCH=0|1, FILTER, COMMIT.
set -uo pipefail
PRE=${PREBUILT:-.prebuilt-lc}
if [ "${1:-}" = prebuild ]; then
  set -e
  BD=${BUILD_DIR:-build-lc}
  [ -f $BD/build.ninja ] || cmake -S . -B $BD -G Ninja -DCMAKE_BUILD_TYPE=Release
  ninja -C $BD -j${JOBS:-2} spade_cuda
  CUDA_LIB=/usr/local/cuda/lib; [ -d $CUDA_LIB ] || CUDA_LIB=/usr/local/cuda/lib64
  DEPS=${DEPS:-.deps-cuda}
  T=$(mktemp -d); mkdir -p $PRE
  gcc -O3 -c $DEPS/src/cblas_shim.c -I$DEPS/include -o $T/cblas_shim.o
  for f in sparse/cluster_index sparse/kmeans sparse/topk; do
    g++ -std=c++20 -O2 -DNDEBUG -Isrc -I$DEPS/include -c src/$f.cpp -o $T/$(basename $f).o
  done
  g++ -std=c++20 -O2 -DNDEBUG -Isrc -I/usr/local/cuda/include -I$DEPS/include \
    -c tests/gpu/test_cuda_lycheecluster.cpp -o $T/test.o
  g++ -O2 $T/*.o -o $PRE/lc_tests $BD/libspade_cuda.a /usr/lib/x86_64-linux-gnu/libgtest.a \
    /usr/lib/x86_64-linux-gnu/libgtest_main.a $CUDA_LIB/libcublas.so $CUDA_LIB/libcublasLt.so \
    $CUDA_LIB/libculibos.a -L$CUDA_LIB -lcudadevrt -lcudart_static -lrt -lpthread -ldl
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_lycheecluster.cu \
    $BD/libspade_cuda.a -lcublasLt -lcublas -o $PRE/bench_lycheecluster
  strip $PRE/lc_tests $PRE/bench_lycheecluster
  ls -la $PRE
  exit 0
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NVCC=$(command -v nvcc); CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $NVCC))}
CUDA_LIB=$CUDA_HOME/lib64
[ -d $CUDA_HOME/targets/x86_64-linux/lib ] && CUDA_LIB=$CUDA_HOME/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CUDA_LIB:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-120} ./$PRE/lc_tests --gtest_filter="${FILTER:-CudaLycheeCluster.*}" 2>&1 \
    | tee "$OUT/gpu_tests_lycheecluster.log" | tail -60
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-150} ./$PRE/bench_lycheecluster "$OUT/lycheecluster.json" "$(date -u +%F)" \
    "${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" "bash bench/run_gpu_lycheecluster.sh" 2>&1 | tail -20
fi

#!/usr/bin/env bash
# Batched decode step time of full attention and the GPU sparse methods (bench/bench_tpot_batch.cpp).
#   here:   bash bench/run_gpu_tpot_batch.sh prebuild        -> .prebuilt-c/bench_tpot_batch
#   device: bash bench/run_gpu_tpot_batch.sh OUT.json [LENGTHS] [METHODS]   (carry .prebuilt-c)
#           KV_DTYPE=bf16,fp8: each configuration with both KV caches (fp8: full attention only)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = prebuild ]; then
  BD=${BUILD_DIR:-build-cuda2}
  CUDA_LIB=${CUDA_LIB:-/usr/local/cuda/lib}
  [ -d $CUDA_LIB ] || CUDA_LIB=/usr/local/cuda/lib64
  ninja -C $BD -j${JOBS:-2} spade_lib spade_cuda
  gcc -O3 -c .deps-cuda/src/cblas_shim.c -I.deps-cuda/include -o /tmp/cblas_shim.o
  rm -f /tmp/libopenblas_shim.a && ar rcs /tmp/libopenblas_shim.a /tmp/cblas_shim.o
  mkdir -p .prebuilt-c
  g++ -std=c++20 -O2 -Isrc -I$(dirname $CUDA_LIB)/include -DSPADE_HAVE_CUDA=1 bench/bench_tpot_batch.cpp \
    $BD/libspade_lib.a $BD/libspade_cuda.a -L$CUDA_LIB -lcudart_static -lcublasLt -lcublas \
    .deps-cuda/lib/libpcre2-8.a /tmp/libopenblas_shim.a -lrt -lpthread -ldl -o .prebuilt-c/bench_tpot_batch
  exit 0
fi
OUT=${1:?OUT.json}
LENGTHS=${2:-32768:8,65536:4}
METHODS=${3:-"full;quest:budget=1024;tidal:budget=1024;lessismore:budget=1024;lycheecluster:budget=1024"}
NVCC=$(command -v nvcc); CH=$(dirname $(dirname $NVCC)); CL=$CH/lib64
[ -d $CH/targets/x86_64-linux/lib ] && CL=$CH/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CL:${LD_LIBRARY_PATH:-}
.prebuilt-c/bench_tpot_batch "$OUT" --model llama3-8b --lengths "$LENGTHS" --methods "$METHODS" \
  --kv-dtype "${KV_DTYPE:-bf16}" --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"

#!/usr/bin/env bash
# Decode GEMV (src/backend/cuda/gemv.cu) vs cuBLASLt on Llama-3.1-8B projection shapes.
#   here:   bash bench/run_gpu_gemv.sh prebuild          -> .prebuilt-g/bench_gemv
#   device: bash bench/run_gpu_gemv.sh OUT.jsonl          (carry .prebuilt-g)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = prebuild ]; then
  BD=${BUILD_DIR:-build-cuda2}
  ninja -C $BD -j${JOBS:-2} spade_cuda
  mkdir -p .prebuilt-g
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc -Ibench bench/bench_gemv.cu \
    $BD/libspade_cuda.a -lcublasLt -lcublas -o .prebuilt-g/bench_gemv
  exit 0
fi
OUT=${1:?OUT.jsonl}
NVCC=$(command -v nvcc); CH=$(dirname $(dirname $NVCC)); CL=$CH/lib64
[ -d $CH/targets/x86_64-linux/lib ] && CL=$CH/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CL:${LD_LIBRARY_PATH:-}
.prebuilt-g/bench_gemv "$OUT" "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
  "bash bench/run_gpu_gemv.sh OUT.jsonl"

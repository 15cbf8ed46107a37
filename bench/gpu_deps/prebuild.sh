#!/usr/bin/env bash
# Builds the GPU test and bench binaries HERE (no GPU needed) into the ignored .prebuilt/, so a
# device call can skip the build:  run(command="PREBUILT=.prebuilt bash bench/run_gpu.sh all",
#                                      carry=[".prebuilt", ".deps-cuda"])
# Needs .deps-cuda/ (bench/gpu_deps/make_deps.sh) and the build dir configured with the default
# CUDA architectures (90a-real;90-virtual). spade_gpu_tests is relinked against the static pcre2
# of .deps-cuda and a cblas-shim archive, and the CUDA runtime statically, so the device image
# needs only libcublasLt from its CUDA 13 toolkit (run_gpu.sh puts it on LD_LIBRARY_PATH).
set -euo pipefail
cd "$(dirname "$0")/../.."
BD=${BUILD_DIR:-build-cuda2}
[ -f $BD/build.ninja ] || cmake -S . -B $BD -G Ninja -DCMAKE_BUILD_TYPE=Release
ninja -C $BD -j${JOBS:-2} spade_gpu_tests
grep -qs '^/.prebuilt/$' .git/info/exclude || echo /.prebuilt/ >> .git/info/exclude
mkdir -p .prebuilt
CUDA_LIB=${CUDA_LIB:-/usr/local/cuda/lib}
[ -d $CUDA_LIB ] || CUDA_LIB=/usr/local/cuda/lib64
gcc -O3 -c .deps-cuda/src/cblas_shim.c -I.deps-cuda/include -o /tmp/cblas_shim.o
rm -f /tmp/libopenblas_shim.a && ar rcs /tmp/libopenblas_shim.a /tmp/cblas_shim.o
OBJS=$(grep "^build spade_gpu_tests:" $BD/build.ninja | sed 's/^build spade_gpu_tests: [^ ]* //; s/ |.*//')
(cd $BD && g++ -O2 $OBJS -o ../.prebuilt/spade_gpu_tests libspade_lib.a \
  /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a \
  ../.deps-cuda/lib/libpcre2-8.a /tmp/libopenblas_shim.a libspade_cuda.a $CUDA_LIB/libcublas.so \
  $CUDA_LIB/libcublasLt.so $CUDA_LIB/libculibos.a -L$CUDA_LIB -lcudadevrt -lcudart_static -lrt -lpthread -ldl)
nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_attention.cu \
  $BD/libspade_cuda.a -lcublasLt -lcublas -o .prebuilt/bench_attention
nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_blasst.cu \
  $BD/libspade_cuda.a -lcublasLt -lcublas -o .prebuilt/bench_blasst
g++ -std=c++20 -O2 -Isrc -I$(dirname $CUDA_LIB)/include -DSPADE_HAVE_CUDA=1 bench/bench_tpot.cpp \
  $BD/libspade_lib.a $BD/libspade_cuda.a -L$CUDA_LIB -lcudart_static -lcublasLt -lcublas \
  .deps-cuda/lib/libpcre2-8.a /tmp/libopenblas_shim.a -lrt -lpthread -ldl -o .prebuilt/bench_tpot
# The spade CLI too (PREBUILD_CLI=1): same static pcre2 / cblas shim / CUDA runtime, zlib
# from .deps-cuda (run_gpu.sh puts .deps-cuda/lib on LD_LIBRARY_PATH).
if [ "${PREBUILD_CLI:-0}" = 1 ]; then
  ninja -C $BD -j${JOBS:-2} spade
  COBJS=$(grep "^build spade:" $BD/build.ninja | sed 's/^build spade: [^ ]* //; s/ |.*//')
  (cd $BD && g++ -O2 $COBJS -o ../.prebuilt/spade libspade_lib.a ../.deps-cuda/lib/libpcre2-8.a \
    /tmp/libopenblas_shim.a ../.deps-cuda/lib/libz.a libspade_cuda.a $CUDA_LIB/libcublas.so \
    $CUDA_LIB/libcublasLt.so $CUDA_LIB/libculibos.a -L$CUDA_LIB -lcudadevrt -lcudart_static -lrt -lpthread -ldl)
fi
ls -la .prebuilt

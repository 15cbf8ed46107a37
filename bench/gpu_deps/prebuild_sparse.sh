#!/usr/bin/env bash
# Builds the sparse-decode GPU test and bench binaries HERE (no GPU needed) into the ignored
# .prebuilt-sparse/, for: run(command="bash bench/run_gpu_sparse.sh", carry=[".prebuilt-sparse"])
# (add ".deps-cuda" to carry if the device must fall back to building). Same static relink as
# prebuild.sh: spade_gpu_tests against .deps-cuda's static pcre2, a cblas-shim archive and the
# static CUDA runtime, so the device image needs only libcublas/libcublasLt from its toolkit.
set -euo pipefail
cd "$(dirname "$0")/../.."
BD=${BUILD_DIR:-build-cuda-sparse}
PB=.prebuilt-sparse
[ -f $BD/build.ninja ] || cmake -S . -B $BD -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a-real
ninja -C $BD -j${JOBS:-2} spade_gpu_tests
grep -qs "^/$PB/\$" .git/info/exclude || echo "/$PB/" >> .git/info/exclude
mkdir -p $PB
CUDA_LIB=${CUDA_LIB:-/usr/local/cuda/lib}
[ -d $CUDA_LIB ] || CUDA_LIB=/usr/local/cuda/lib64
gcc -O3 -c .deps-cuda/src/cblas_shim.c -I.deps-cuda/include -o /tmp/cblas_shim_sp.o
rm -f /tmp/libopenblas_shim_sp.a && ar rcs /tmp/libopenblas_shim_sp.a /tmp/cblas_shim_sp.o
OBJS=$(grep "^build spade_gpu_tests:" $BD/build.ninja | sed 's/^build spade_gpu_tests: [^ ]* //; s/ |.*//')
(cd $BD && g++ -O2 $OBJS -o ../$PB/spade_gpu_tests libspade_lib.a \
  /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a \
  ../.deps-cuda/lib/libpcre2-8.a /tmp/libopenblas_shim_sp.a libspade_cuda.a $CUDA_LIB/libcublas.so \
  $CUDA_LIB/libcublasLt.so $CUDA_LIB/libculibos.a -L$CUDA_LIB -lcudadevrt -lcudart_static -lrt -lpthread -ldl)
nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_sparse.cu \
  $BD/libspade_cuda.a -lcublasLt -lcublas -o $PB/bench_sparse
ls -la $PB

#!/usr/bin/env bash
# Builds the Twilight device binaries HERE (no GPU needed) into the ignored .prebuilt-tw/:
#   spade_gpu_tests_tw  the CudaTwilight* gpu tests only (statically linked like prebuild.sh's)
#   bench_twilight      bench/bench_twilight.cu
# plus a copy of bench/run_gpu_twilight.sh, so one device call runs everything:
#   run(command="bash .prebuilt-tw/run_gpu_twilight.sh", carry=[".prebuilt-tw", ".deps-cuda"])
# Needs .deps-cuda/ (make_deps.sh). BUILD_DIR (default build-cuda2) is configured if needed;
# only spade_lib, spade_cuda and the test's object are built (-j JOBS, default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
BD=${BUILD_DIR:-build-cuda2}
[ -f $BD/build.ninja ] || cmake -S . -B $BD -G Ninja -DCMAKE_BUILD_TYPE=Release
TO=CMakeFiles/spade_gpu_tests.dir/tests/gpu  # the test objects, relative to $BD
T=$BD/$TO
ninja -C $BD -j${JOBS:-2} spade_lib spade_cuda $TO/test_cuda_twilight.cpp.o $TO/test_cuda_twilight_model.cpp.o
EXCL=$(git rev-parse --git-common-dir)/info/exclude
grep -qs '^/.prebuilt-tw/$' "$EXCL" || echo /.prebuilt-tw/ >> "$EXCL"
mkdir -p .prebuilt-tw
CUDA_LIB=${CUDA_LIB:-/usr/local/cuda/lib}
[ -d $CUDA_LIB ] || CUDA_LIB=/usr/local/cuda/lib64
gcc -O3 -c .deps-cuda/src/cblas_shim.c -I.deps-cuda/include -o /tmp/cblas_shim_tw.o
rm -f /tmp/libopenblas_shim_tw.a && ar rcs /tmp/libopenblas_shim_tw.a /tmp/cblas_shim_tw.o
g++ -O2 $T/test_cuda_twilight.cpp.o $T/test_cuda_twilight_model.cpp.o -o .prebuilt-tw/spade_gpu_tests_tw \
  $BD/libspade_lib.a /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a \
  .deps-cuda/lib/libpcre2-8.a /tmp/libopenblas_shim_tw.a $BD/libspade_cuda.a $CUDA_LIB/libcublas.so \
  $CUDA_LIB/libcublasLt.so $CUDA_LIB/libculibos.a -L$CUDA_LIB -lcudadevrt -lcudart_static -lrt -lpthread -ldl
nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_twilight.cu \
  $BD/libspade_cuda.a -lcublasLt -lcublas -o .prebuilt-tw/bench_twilight
strip .prebuilt-tw/spade_gpu_tests_tw .prebuilt-tw/bench_twilight
cp bench/run_gpu_twilight.sh .prebuilt-tw/
ls -la .prebuilt-tw

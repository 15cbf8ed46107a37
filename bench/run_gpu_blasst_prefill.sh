#!/usr/bin/env bash
# BLASST prefill: gpu tests + bench/bench_blasst_prefill.cu, from binaries built without a GPU.
#   Here (no GPU):  bash bench/run_gpu_blasst_prefill.sh prebuild   -> .prebuilt-pf/
#                   (spade_gpu_tests linked as bench/gpu_deps/prebuild.sh does, + bench_blasst_prefill)
#   Device call:    run(command="COMMIT=<sha> bash bench/run_gpu_blasst_prefill.sh [tests] [bench] [tiletrace]",
#                       carry=[".prebuilt-pf", ".deps-cuda"])
# Results: $OUT/gpu_tests_blasst_prefill.log, $OUT/blasst_prefill.jsonl (copy it to
# bench/results/blasst_prefill_<device>_<date>.json).
set -uo pipefail
cd "$(dirname "$0")/.."
PB=${PREBUILT:-.prebuilt-pf}
what="${*:-tests bench}"
if [[ "$what" == prebuild ]]; then
  set -e
  BD=${BUILD_DIR:-build-pf}
  [ -f $BD/build.ninja ] || cmake -S . -B $BD -G Ninja -DCMAKE_BUILD_TYPE=Release
  ninja -C $BD -j${JOBS:-2} spade_gpu_tests
  mkdir -p $PB
  CUDA_LIB=${CUDA_LIB:-/usr/local/cuda/lib}
  [ -d $CUDA_LIB ] || CUDA_LIB=/usr/local/cuda/lib64
  gcc -O3 -c .deps-cuda/src/cblas_shim.c -I.deps-cuda/include -o /tmp/cblas_shim_pf.o
  rm -f /tmp/libopenblas_shim_pf.a && ar rcs /tmp/libopenblas_shim_pf.a /tmp/cblas_shim_pf.o
  OBJS=$(grep "^build spade_gpu_tests:" $BD/build.ninja | sed 's/^build spade_gpu_tests: [^ ]* //; s/ |.*//')
  (cd $BD && g++ -O2 $OBJS -o ../$PB/spade_gpu_tests libspade_lib.a \
    /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a \
    ../.deps-cuda/lib/libpcre2-8.a /tmp/libopenblas_shim_pf.a libspade_cuda.a $CUDA_LIB/libcublas.so \
    $CUDA_LIB/libcublasLt.so $CUDA_LIB/libculibos.a -L$CUDA_LIB -lcudadevrt -lcudart_static -lrt -lpthread -ldl)
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_blasst_prefill.cu \
    $BD/libspade_cuda.a -lcublasLt -lcublas -o $PB/bench_blasst_prefill
  # The per-tile trace build: attention_prefill.cu with its clock64 stamps, linked before the
  # library (whose own attention_prefill.cu.o is then not pulled in).
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DSPADE_PREFILL_TILE_TRACE \
    -gencode=arch=compute_90a,code=sm_90a -Isrc -c src/backend/cuda/attention_prefill.cu -o $BD/ap_tile_trace.o
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_blasst_prefill.cu \
    $BD/ap_tile_trace.o $BD/libspade_cuda.a -lcublasLt -lcublas -o $PB/bench_blasst_prefill_tt
  ls -la $PB
  exit 0
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NVCC=$(command -v nvcc); CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $NVCC))}
CUDA_LIB=$CUDA_HOME/lib64
[ -d $CUDA_HOME/targets/x86_64-linux/lib ] && CUDA_LIB=$CUDA_HOME/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CUDA_LIB:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [[ "$what" == *tests* ]]; then
  # mbarrier bugs hang rather than fail: everything under timeout.
  F=${GTEST_FILTER:-CudaBlasstPrefill.*:CudaAttention.Prefill*}
  timeout ${TEST_TIMEOUT:-150} ./$PB/spade_gpu_tests --gtest_filter="$F" >"$OUT/gpu_tests_blasst_prefill.log" 2>&1
  echo "tests rc=$?"; grep -vE "^\[ +(RUN|OK) " "$OUT/gpu_tests_blasst_prefill.log" | tail -40
fi
if [[ "$what" == *tiletrace* ]]; then  # cycles per tile of one CTA, dense and skip kernels
  for L in 32768 65536; do for lam in -2 0 -80; do
    timeout 120 ./$PB/bench_blasst_prefill_tt "$OUT/tt.jsonl" "$COMMIT" tiletrace tiletrace:$L:$lam 2>&1 | grep tiletrace
    cat "$OUT/tt.jsonl" >> "$OUT/blasst_prefill_tiletrace.jsonl"
  done; done
  rm -f "$OUT/tt.jsonl"
fi
if [[ "$what" == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-300} ./$PB/bench_blasst_prefill "$OUT/blasst_prefill.jsonl" "$COMMIT" \
    "bash bench/run_gpu_blasst_prefill.sh $what" ${BENCH_WHAT:-all} 2>&1 | tail -60
  echo "bench rc=${PIPESTATUS[0]} device=$DEV"
fi

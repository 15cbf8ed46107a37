#!/usr/bin/env bash
# One device call: build (CUDA arch 90a) + gpu tests + attention benchmarks vs SDPA (+ TPOT).
# Usage on the GPU machine, from the repo root:  bash bench/run_gpu.sh [tests|bench|tpot|all]...
# Needs .deps-cuda/ carried (made by bench/gpu_deps/make_deps.sh: gtest, nlohmann_json, pcre2,
# zlib, Boost headers, a cblas shim): the GPU image has CUDA, CMake and PyTorch but not the project's
# C++ dependencies. SmolLM2 for the greedy test: models/ (two calls, .stage/ parts).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROOT=$(pwd)
B=build-gpu
what="${*:-all}"
export PKG_CONFIG_PATH=$ROOT/.deps-cuda/lib/pkgconfig
export LD_LIBRARY_PATH=$ROOT/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
# The carried .deps-cuda replaces the one there on every call: rebuild the shim archive.
gcc -O3 -c .deps-cuda/src/cblas_shim.c -o /tmp/cblas_shim.o && ar rcs .deps-cuda/lib/libopenblas.a /tmp/cblas_shim.o
[ -d .deps-cuda/include/boost ] || tar xzf .deps-cuda/boost-headers.tar.gz -C .deps-cuda/include
PKGCFG=""
command -v pkg-config >/dev/null || PKGCFG="-DPKG_CONFIG_EXECUTABLE=$ROOT/.deps-cuda/tools/pkg-config"
t0=$(date +%s)
NVCC=$(command -v nvcc); CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $NVCC))}
CUDA_INC=$CUDA_HOME/include; CUDA_LIB=$CUDA_HOME/lib64
[ -d $CUDA_HOME/targets/x86_64-linux/lib ] && CUDA_LIB=$CUDA_HOME/targets/x86_64-linux/lib
built_here=1
[ -n "${PREBUILT:-}" ] && export LD_LIBRARY_PATH=$CUDA_LIB:$LD_LIBRARY_PATH
if [ -n "${PREBUILT:-}" ] && [ -x "$PREBUILT/spade_gpu_tests" ] && \
   "$PREBUILT/spade_gpu_tests" --gtest_list_tests >/dev/null 2>&1 && "$PREBUILT/bench_attention" none >/dev/null 2>&1; then
  mkdir -p $B && cp "$PREBUILT"/spade_gpu_tests "$PREBUILT"/bench_attention $B/ && \
    { [ -x "$PREBUILT/bench_tpot" ] && cp "$PREBUILT/bench_tpot" $B/ || true; }
  built_here=0
  echo "using prebuilt binaries from $PREBUILT"
fi
if [ $built_here = 1 ]; then
  if [ ! -f $B/build.ninja ]; then
    cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
      -DCMAKE_PREFIX_PATH=$ROOT/.deps-cuda -DBLA_VENDOR=OpenBLAS -DBLA_STATIC=ON $PKGCFG \
      >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  fi
  cmake --build $B -j16 --target spade_gpu_tests >"$OUT/build.log" 2>&1 || { grep -E "error|Error" -A3 "$OUT/build.log" | head -60; exit 1; }
  [ "${BUILD_CLI:-0}" = 1 ] && { cmake --build $B -j16 --target spade >>"$OUT/build.log" 2>&1 || echo "(spade CLI did not build; see build.log)"; }
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_attention.cu \
    $B/libspade_cuda.a -lcublasLt -lcublas -o $B/bench_attention >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  g++ -std=c++20 -O2 -Isrc -I$CUDA_INC -DSPADE_HAVE_CUDA=1 bench/bench_tpot.cpp $B/libspade_lib.a \
    $B/libspade_cuda.a -L$CUDA_LIB -lcudart -lcublasLt -lcublas .deps-cuda/lib/libpcre2-8.a \
    .deps-cuda/lib/libopenblas.a .deps-cuda/lib/libz.a -lpthread -o $B/bench_tpot >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; }
fi
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
export COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # bench_tpot records it
# Smoke test of the wgmma prefill first (mbarrier pipelines hang rather than fail): if it does
# not pass in 60 s, everything after runs with the generic prefill kernel.
timeout 60 ./$B/spade_gpu_tests --gtest_filter=CudaAttention.PrefillWgmmaShapes >"$OUT/smoke_prefill.log" 2>&1
rc=$?; echo "wgmma prefill smoke: rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/smoke_prefill.log" | head -2 | tr '\n' ' ')"
[ $rc != 0 ] && { export SPADE_ATTN_PREFILL=0; grep -E "Failure|rel_err|Expected|Which is|kernel" "$OUT/smoke_prefill.log" | head -20; }
if [[ "$what" == *tests* || "$what" == all ]]; then
  timeout ${TEST_TIMEOUT:-200} ./$B/spade_gpu_tests ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "^\[ +(RUN|OK) " | tail -40
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  F="CudaAttention.DecodeSmolLMShapeOddPage:CudaAttention.DecodeGroupOfEightAndOne:CudaAttention.PrefillCausalChunkedMixed"
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 7 ./$B/spade_gpu_tests --gtest_filter=$F \
      >"$OUT/sanitize_$tool.log" 2>&1; echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
  done
fi
if [[ "$what" == *bench* || "$what" == all ]]; then
  timeout 240 ./$B/bench_attention all "$OUT/attn_spade.jsonl" ${DECODE_KERNELS:-} 2>&1 | tail -5
  if [ "${SDPA:-1}" = 1 ]; then
    PYTHONUNBUFFERED=1 timeout 200 python3 python/bench_sdpa_decode.py all --out "$OUT/attn_sdpa.jsonl" 2>&1 | grep -v Warning | tail -12
  fi
  python3 bench/merge_results.py "$OUT/attn_spade.jsonl" "$OUT/attn_sdpa.jsonl" \
    "$OUT/attention.json" "$DEV" "$COMMIT" "bash bench/run_gpu.sh $what"
fi
if [[ "$what" == *tpot* || "$what" == all ]]; then
  [ -x $B/bench_tpot ] && timeout 120 ./$B/bench_tpot "$OUT/tpot.json" 2>&1 | tail -12
fi

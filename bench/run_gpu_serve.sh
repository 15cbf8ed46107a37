#!/usr/bin/env bash
# Served throughput and latency of `spade serve --device cuda` against llama.cpp's llama-server
# on the same GPU, model (SmolLM2-135M-Instruct Q4_1) and client (bench/bench_serve.py), plus
# the engine's own step rate at the same batch sizes (bench_tpot_batch, smollm2-135m shapes),
# per-request methods (a mixed load, mixed_methods_check.py, and synthetic 8B full|quest steps)
# and the GPU tests.
#
#   here:    bash bench/gpu_deps/make_deps.sh; bash ../shared/tools/llamacpp_src.sh .stage/llamacpp-src.tar.gz
#            split -n 3 -d models/SmolLM2-135M-Instruct.Q4_1.gguf .stage/model.part   (carry limits)
#   device (calls back to back, each within the 64 MiB a call carries):
#            A: bash bench/run_gpu_serve.sh build   carry .deps-cuda .stage/llamacpp-src.tar.gz
#               (starts llama-server's build in the background, builds spade, runs every GPU test)
#            B: bash bench/run_gpu_serve.sh stage   carry .stage/model.part00
#            C: bash bench/run_gpu_serve.sh stage   carry .stage/model.part01
#            D: bash bench/run_gpu_serve.sh run     carry .stage/model.part02
#            (E: bash bench/run_gpu_serve.sh peer: llama-server's runs alone, when D ran out of time;
#             serve: the served loads of spade and llama-server without D's tests and engine steps;
#             methods: each method of the mixed load served alone, the mixed loads, engine steps;
#             sanitize: compute-sanitizer over the GPU tests, after A with SANITIZER_BUILD=1)
#            Env: PEER_BUILD=0 skips llama-server's build; SANITIZER_BUILD=1 (A) starts the
#            compute-sanitizer build in the background; RACECHECK=1 (A) racecheck on the main build;
#            FAT_BUILD=1 (A) compiles the CUDA library for every supported GPU in the background
#            (sanitize reports it); EMULATE="86 80" (A) runs the GPU tests as those GPUs too.
# Results: $OUT/serve_*.json, $OUT/engine_steps.json, $OUT/summary.txt (the table printed last).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/stage
ROOT=$(pwd)
B=build-gpu
PEER=/root/peer/llama.cpp
NVCC=$(command -v nvcc); CUDA_HOME=$(dirname $(dirname $NVCC))
CUDA_LIB=$CUDA_HOME/lib64; [ -d $CUDA_HOME/targets/x86_64-linux/lib ] && CUDA_LIB=$CUDA_HOME/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$ROOT/.deps-cuda/lib:$CUDA_LIB:${LD_LIBRARY_PATH:-}
for p in .stage/model.part0*; do [ -f "$p" ] && cp "$p" /root/stage/; done
phase=${1:-run}
# The mixed load: requests spread evenly over nine methods.
MIX="full;streaming:budget=64;quest:budget=64;tidal:budget=64;lessismore:budget=64;lycheedecode:budget=64;lycheecluster:budget=64;twilight:base=quest,budget=128;blasst"
# compute-sanitizer racecheck: small tests of every kernel family (name:gtest filter); the
# tests too slow under racecheck (sampling distributions, drawn chunks, graph replays of every
# method) run under memcheck in the sanitize phase.
RC_FAMILIES=(
  "ops:CudaOps.Embedding:CudaOps.RmsNormWithRowGather:CudaOps.SwiGLU:CudaOps.QkvPostRopeAppend:CudaOps.SamplingGreedyAndFilters:CudaGemvFused.SwigluMatchesSeparateLaunches:CudaGemvFused.QkvPostMatchesSeparateLaunches"
  "attention:CudaAttention.DecodeSmolLMShapeOddPage:CudaAttention.DecodeGroupOfEightAndOne:CudaAttention.PrefillPage32"
  "sparse:CudaSparse.TokenListsPerHead:CudaSparse.QuestSelectAndAttend:CudaSparse.TopkRowsTiesAndNaN:CudaSparse.HybridDenseAndSparseHeads:CudaSparse.QuestTensorCoreScores"
  "lycheecluster:CudaLycheeCluster.BuildExactSeparated:CudaLycheeCluster.InsertMatchesCpu:CudaLycheeCluster.CompactCsr:CudaLycheeCluster.BuildBatchAcrossRequestsAndLayers"
  "twilight:CudaTwilight.PrunerChunk16VsCpu:CudaTwilight.Int4KeysFusedIntoAppend:CudaTwilight.QuestThenPrune"
  "blasst:CudaBlasstDecode.OddPagesMhaAndHeadDim64:CudaBlasstDecode.PeakedScoresSkipMost:CudaSparseBlasst.NeverSkippingEqualsThePlainKernel:CudaBlasstPrefill.OffAndTinyLambdaEqualDense"
  "selectors:CudaTidal.DecodeScoresMatchCpu:CudaLessIsMore.PerHeadScoresMatchCpu:CudaLycheeDecode.HybridKernelScoresAndPatterns:CudaOracle.GroupWeightsMatchCpu"
  "model:CudaModel.RandomLlamaMatchesCpu"
  "prefill:CudaAttention.PrefillWgmmaShapes:CudaAttention.PrefillCausalChunkedMixed:CudaBlasstPrefill.PlantedKeysMatchEmulationGqaChunked"
)

if [ "$phase" = build ]; then
  t0=$(date +%s)
  if [ "${PEER_BUILD:-1}" = 1 ] && [ ! -x $PEER/build-cuda/bin/llama-server ] && [ ! -f /root/peer/building ]; then
    # In the background, detached: it outlives this call while the machine stays warm, and the
    # run phase waits for it.
    mkdir -p /root/peer && tar xzf .stage/llamacpp-src.tar.gz -C /root/peer && touch /root/peer/building
    setsid nohup bash -c "cd $PEER && cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
       -DCMAKE_CUDA_ARCHITECTURES=90a -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
       -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_CUDA_NCCL=OFF >/root/peer/cmake.log 2>&1 && \
       cmake --build build-cuda -j6 --target llama-server >/root/peer/build.log 2>&1; rm -f /root/peer/building" \
       >/dev/null 2>&1 < /dev/null &
  fi
  gcc -O3 -c .deps-cuda/src/cblas_shim.c -o /tmp/cblas_shim.o && ar rcs .deps-cuda/lib/libopenblas.a /tmp/cblas_shim.o
  [ -d .deps-cuda/include/boost ] || tar xzf .deps-cuda/boost-headers.tar.gz -C .deps-cuda/include
  PKGCFG=""; command -v pkg-config >/dev/null || PKGCFG="-DPKG_CONFIG_EXECUTABLE=$ROOT/.deps-cuda/tools/pkg-config"
  export PKG_CONFIG_PATH=$ROOT/.deps-cuda/lib/pkgconfig
  if [ "${PY_ONLY:-0}" = 1 ]; then  # the Python package alone (build-py), in the foreground
    mkdir -p /root/py
    PYB=$(python3 -m pybind11 --cmakedir 2>/dev/null)
    cmake -S . -B build-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DSPADE_PYTHON=ON \
      -DPython3_EXECUTABLE=$(command -v python3) ${PYB:+-Dpybind11_DIR=$PYB} -DCMAKE_PREFIX_PATH=$ROOT/.deps-cuda \
      -DBLA_VENDOR=OpenBLAS -DBLA_STATIC=ON $PKGCFG > /root/py/cmake.log 2>&1 && \
      cmake --build build-py -j16 --target spade_python > /root/py/build.log 2>&1; echo $? > /root/py/rc
    echo "python package build rc=$(cat /root/py/rc) after $(( $(date +%s) - t0 )) s"; exit 0
  fi
  if [ "${SAN_ONLY:-0}" = 1 ]; then  # the compute-sanitizer build alone, in the foreground
    cmake -S . -B build-san -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
      -DSPADE_CUDA_SANITIZER=ON -DSPADE_PYTHON=OFF -DCMAKE_PREFIX_PATH=$ROOT/.deps-cuda -DBLA_VENDOR=OpenBLAS \
      -DBLA_STATIC=ON $PKGCFG > "$OUT/cmake_san.log" 2>&1 && cmake --build build-san -j16 --target spade_gpu_tests \
      > "$OUT/build_san.log" 2>&1; echo "sanitizer build rc=$? after $(( $(date +%s) - t0 )) s"; mkdir -p /root/san; exit 0
  fi
  [ -f $B/build.ninja ] || cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
      -DCMAKE_PREFIX_PATH=$ROOT/.deps-cuda -DBLA_VENDOR=OpenBLAS -DBLA_STATIC=ON $PKGCFG >"$OUT/cmake.log" 2>&1 \
      || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build $B -j${JOBS:-12} --target spade spade_gpu_tests -- -k 0 >"$OUT/build.log" 2>&1 || grep -E "error:" "$OUT/build.log" | head -10
  g++ -std=c++20 -O2 -Isrc -Ibench -I$CUDA_HOME/include -DSPADE_HAVE_CUDA=1 bench/bench_tpot_batch.cpp $B/libspade_lib.a \
    $B/libspade_cuda.a -L$CUDA_LIB -lcudart -lcublasLt -lcublas .deps-cuda/lib/libpcre2-8.a \
    .deps-cuda/lib/libopenblas.a .deps-cuda/lib/libz.a -lpthread -o $B/bench_tpot_batch >>"$OUT/build.log" 2>&1 || tail -20 "$OUT/build.log"
  echo "spade build: $(( $(date +%s) - t0 )) s"
  if [ "${SANITIZER_BUILD:-0}" = 1 ] && [ ! -f /root/san/building ]; then
    # The compute-sanitizer build (-DSPADE_CUDA_SANITIZER=ON: no setmaxnreg, line info), in
    # the background for the sanitize phase: it outlives this call while the machine is warm.
    mkdir -p /root/san && touch /root/san/building
    setsid nohup bash -c "cmake -S . -B build-san -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DSPADE_CUDA_SANITIZER=ON -DSPADE_PYTHON=OFF -DCMAKE_PREFIX_PATH=$ROOT/.deps-cuda -DBLA_VENDOR=OpenBLAS \
        -DBLA_STATIC=ON $PKGCFG >/root/san/cmake.log 2>&1 && cmake --build build-san -j${SAN_JOBS:-10} \
        --target spade_gpu_tests >/root/san/build.log 2>&1; echo \$? > /root/san/rc; rm -f /root/san/building" \
        >/dev/null 2>&1 < /dev/null &
  fi
  ls -la $B/spade $B/spade_gpu_tests $B/bench_tpot_batch 2>&1 | awk '{print $5, $NF}'
  # RACECHECK=1: compute-sanitizer racecheck over small tests of every kernel family, eight
  # processes side by side with the tests (the generic prefill kernel: the sanitizer does not
  # run the wgmma / TMA one); each family's verdict in $OUT/racecheck_*.log.
  CS=$(command -v compute-sanitizer || echo $CUDA_HOME/compute-sanitizer/compute-sanitizer)
  RC_PIDS=()
  if [ "${RACECHECK:-0}" = 1 ] && [ -x "$CS" ]; then
    for fam in "${RC_FAMILIES[@]}"; do
      name=${fam%%:*}; filt=${fam#*:}
      ( SPADE_ATTN_PREFILL=0 timeout ${RC_TIMEOUT:-240} $CS --tool racecheck --racecheck-report hazard \
          --error-exitcode 9 ./$B/spade_gpu_tests --gtest_filter="$filt" > "$OUT/racecheck_$name.log" 2>&1
        echo "racecheck $name rc=$?" >> "$OUT/racecheck_$name.log" ) &
      RC_PIDS+=($!)
    done
  fi
  if [ "${FAT_BUILD:-0}" = 1 ] && [ ! -f /root/fat/building ]; then
    # The CUDA library for every supported GPU (SPADE_CUDA_ARCHS=all), in the background: the
    # sanitize phase reports whether it compiled.
    mkdir -p /root/fat && touch /root/fat/building
    setsid nohup bash -c "cmake -S . -B build-fat -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPADE_CUDA_ARCHS=all \
        -DSPADE_PYTHON=OFF -DCMAKE_PREFIX_PATH=$ROOT/.deps-cuda -DBLA_VENDOR=OpenBLAS -DBLA_STATIC=ON $PKGCFG \
        >/root/fat/cmake.log 2>&1 && cmake --build build-fat -j${FAT_JOBS:-6} --target spade_cuda \
        >/root/fat/build.log 2>&1; echo \$? > /root/fat/rc; rm -f /root/fat/building" >/dev/null 2>&1 < /dev/null &
  fi
  # PY_BUILD=1: the Python package (spade._core with the CUDA ops) in build-py, in the
  # background, against the python3 that holds torch; the python phase tests it.
  if [ "${PY_BUILD:-0}" = 1 ] && [ ! -f /root/py/building ]; then
    mkdir -p /root/py && touch /root/py/building
    PYB=$(python3 -m pybind11 --cmakedir 2>/dev/null)
    setsid nohup bash -c "cmake -S . -B build-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DSPADE_PYTHON=ON -DPython3_EXECUTABLE=$(command -v python3) ${PYB:+-Dpybind11_DIR=$PYB} \
        -DCMAKE_PREFIX_PATH=$ROOT/.deps-cuda -DBLA_VENDOR=OpenBLAS -DBLA_STATIC=ON $PKGCFG >/root/py/cmake.log 2>&1 && \
        cmake --build build-py -j${PY_JOBS:-6} --target spade_python >/root/py/build.log 2>&1; echo \$? > /root/py/rc; \
        rm -f /root/py/building" >/dev/null 2>&1 < /dev/null &
  fi
  # EMULATE="86 80": the GPU tests again, side by side, as a GPU of that compute capability
  # (SPADE_EMULATE_CC: its shared memory per block, no PDL / TMA / wgmma: the generic paths).
  EM_PIDS=()
  for cc in ${EMULATE:-}; do
    ( SPADE_EMULATE_CC=$cc timeout ${TEST_TIMEOUT:-330} ./$B/spade_gpu_tests \
        --gtest_filter="${GTEST_FILTER:--CudaSmolLM2*:CudaMixedMethods.Every*}" > "$OUT/gpu_tests_emulate$cc.log" 2>&1
      echo "emulated sm_$cc gpu tests rc=$?" >> "$OUT/gpu_tests_emulate$cc.log" ) &
    EM_PIDS+=($!)
  done
  # Every GPU test (those that need the model file skip here; the run phase runs them).
  timeout ${TEST_TIMEOUT:-330} ./$B/spade_gpu_tests --gtest_filter="${GTEST_FILTER:--CudaSmolLM2*:CudaMixedMethods.Every*}" \
    > "$OUT/gpu_tests_all.log" 2>&1; echo "gpu tests rc=$? after $(( $(date +%s) - t0 )) s"
  grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests ran|SKIPPED \]" "$OUT/gpu_tests_all.log" | sort | uniq -c | sort -rn | head -40
  [ ${#EM_PIDS[@]} -gt 0 ] && wait "${EM_PIDS[@]}"
  for cc in ${EMULATE:-}; do
    f="$OUT/gpu_tests_emulate$cc.log"
    echo "emulated sm_$cc: $(grep -cE '^\[       OK' $f) ok, $(tail -1 $f)"
    grep -E "^\[  FAILED  \]" $f | sort -u | head -30
  done
  [ ${#RC_PIDS[@]} -gt 0 ] && wait "${RC_PIDS[@]}"  # the racecheck processes (not llama's build)
  for f in "$OUT"/racecheck_*.log; do
    [ -f "$f" ] && echo "$(basename $f): $(grep -cE '^\[       OK' $f) ok, $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' $f | tail -1), $(tail -1 $f)"
  done
  echo "build phase: $(( $(date +%s) - t0 )) s"
  tail -2 /root/peer/build.log 2>/dev/null
  exit 0
fi
[ "$phase" = stage ] && { ls -la /root/stage; exit 0; }

# Decode attention over an FP8 (E4M3) cache beside bf16 (issue 40: bench_attention with
# SPADE_BENCH_KV=bf16,fp8 at 32K / 128K, batch 1 / 8 / 32, Hq 32 / Hkv 8 / D 128), then PyTorch
# SDPA (bf16, enable_gqa) on the same shapes, joined by merge_results.py (after build).
if [ "$phase" = fp8 ]; then
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_attention.cu $B/libspade_cuda.a \
    -lcublasLt -lcublas -o $B/bench_attention > "$OUT/bench_attention_build.log" 2>&1 || tail -20 "$OUT/bench_attention_build.log"
  SH=${FP8_SHAPES:-32768:1,32768:8,32768:32,131072:1,131072:8,131072:32}
  for r in 1 2; do
    SPADE_FP8_DIRECT=0 SPADE_BENCH_KV=bf16,fp8 SPADE_BENCH_SHAPES=$SH timeout 200 ./$B/bench_attention decode "$OUT/attn_fp8_r$r.jsonl" 1 \
      > "$OUT/bench_attention_fp8_r$r.log" 2>&1; echo "bench_attention fp8 run $r rc=$?"
    # A/B: the direct fp8 kernel (codes into registers, SPADE_FP8_DIRECT=1), same shapes, same
    # merged file ("kernel":"<name>/direct" rows beside the widened kernel's). Kernels 1 (auto:
    # 4 or 8 warps, 6-stage rings, 8 warps per SM), 6 and 7 (4 warps, 4 stages, 69 KB: 3 CTAs,
    # 12 warps per SM).
    SPADE_FP8_DIRECT=1 SPADE_BENCH_KV=fp8 SPADE_BENCH_SHAPES=$SH timeout 200 ./$B/bench_attention decode \
      "$OUT/attn_fp8d_r$r.jsonl" 1,6,7 > "$OUT/bench_attention_fp8d_r$r.log" 2>&1; echo "bench_attention fp8 direct run $r rc=$?"
    cat "$OUT/attn_fp8d_r$r.jsonl" >> "$OUT/attn_fp8_r$r.jsonl" 2>/dev/null
  done
  timeout 200 python3 python/bench_sdpa_decode.py decode --out "$OUT/sdpa.jsonl" > "$OUT/sdpa.log" 2>&1; echo "sdpa rc=$?"
  for r in 1 2; do
    python3 bench/merge_results.py "$OUT/attn_fp8_r$r.jsonl" "$OUT/sdpa.jsonl" "$OUT/attention_fp8_r$r.json" \
      "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" "${COMMIT:-unknown}" \
      "SPADE_BENCH_KV=bf16,fp8 SPADE_BENCH_SHAPES=$SH bench_attention decode; python/bench_sdpa_decode.py decode" 2>&1 | tail -20
  done
  (cd "$OUT" && tar czf /tmp/results.tar.gz --exclude=summary.txt . && mv /tmp/results.tar.gz . && \
    find . -type f ! -name summary.txt ! -name results.tar.gz -delete)
  exit 0
fi

# The Python package's GPU tests (after build with PY_BUILD=1 on the same machine): the CUDA
# ops against the CPU ops, spade.hf on the GPU, the kernel API's decode timing against
# bench_attention's (same shapes, same process family).
if [ "$phase" = python ]; then
  for i in $(seq 1 150); do [ -f /root/py/building ] || break; sleep 2; done
  echo "python package build rc=$(cat /root/py/rc 2>/dev/null)"; grep -E "Python package|spade: " /root/py/cmake.log | head -5
  grep -E "error|FAILED" /root/py/build.log | head -10
  cp /root/py/cmake.log /root/py/build.log "$OUT/" 2>/dev/null
  # test_api compares spade.LLM with the CLI: the build phase's binary, else one built in build-py.
  SPADE_BIN=$B/spade
  [ -x $SPADE_BIN ] || { SPADE_BIN=build-py/spade; cmake --build build-py -j16 --target spade > "$OUT/py_spade_build.log" 2>&1 \
    || { echo "spade CLI build for test_api failed"; grep -E "error" "$OUT/py_spade_build.log" | head -5; }; }
  PY_CRASH=0
  for t in test_ops_cuda test_ops test_hf test_api; do
    args=(-v); [ $t = test_api ] && args=(--spade "$SPADE_BIN")
    PYTHONFAULTHANDLER=1 PYTHONPATH=build-py/python timeout ${PY_TIMEOUT:-150} python3 tests/python/$t.py "${args[@]}" > "$OUT/py_$t.log" 2>&1
    rc=$?; echo "python $t rc=$rc"; grep -E "^(FAIL|ERROR)|Ran |OK|FAILED|python api|Fatal Python error" "$OUT/py_$t.log" | head -12
    [ $rc -ge 128 ] && [ $rc != 124 ] && PY_CRASH=1
  done
  # A test killed by a signal (the SIGSEGV at the first spade::Error under torch 2.11): the
  # module's variants side by side, the bindings of its unwinding symbols, gdb's backtrace.
  if [ "${PY_DIAG:-$PY_CRASH}" = 1 ]; then
    OUT=$OUT timeout 400 bash bench/py_crash_diag.sh > "$OUT/py_crash_diag.txt" 2>&1; echo "py_crash_diag rc=$?"
    cat "$OUT/py_crash_diag.txt" | cut -c1-300 | head -90
  fi
  [ "${PY_BENCH:-1}" = 1 ] && nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_attention.cu build-py/libspade_cuda.a \
    -lcublasLt -lcublas -o build-py/bench_attention > "$OUT/bench_attention_build.log" 2>&1 \
    && ./build-py/bench_attention decode /tmp/cxx.jsonl 1 > "$OUT/bench_attention.log" 2>&1
  [ "${PY_BENCH:-1}" = 1 ] && PYTHONPATH=build-py/python timeout 200 python3 tests/python/test_ops_cuda.py --bench --cxx /tmp/cxx.jsonl \
    > "$OUT/py_ops_bench.jsonl" 2>&1; echo "ops bench rc=$?"; tail -12 "$OUT/py_ops_bench.jsonl"
  if [ -d /root/fat ]; then  # FAT_BUILD=1 in the build call
    for i in $(seq 1 120); do [ -f /root/fat/building ] || break; sleep 2; done
    echo "fat CUDA build (SPADE_CUDA_ARCHS=all): rc=$(cat /root/fat/rc 2>/dev/null)"
    grep -E "error" /root/fat/build.log | head -10; tail -2 /root/fat/build.log
    cp /root/fat/build.log "$OUT/fat_build.log" 2>/dev/null
  fi
  (cd "$OUT" && tar czf /tmp/results.tar.gz --exclude=summary.txt . && mv /tmp/results.tar.gz . && \
    find . -type f ! -name summary.txt ! -name results.tar.gz -delete)
  exit 0
fi


# compute-sanitizer over the GPU tests, on the sanitizer build (started by `build` with
# SANITIZER_BUILD=1), which runs every kernel, the wgmma / TMA prefill included: memcheck over
# every test that needs no model file (SAN_SHARDS gtest shards side by side), and racecheck
# over the kernel families (RC_FAMILIES, prefill on). Verdicts in $OUT/sanitize_summary.txt.
if [ "$phase" = sanitize ]; then
  t0=$(date +%s)
  # The TMA loads (cp.async.bulk.tensor on a __grid_constant__ tensor map) die with "illegal
  # instruction" under the tool; the wgmma prefill's cp.async path runs clean. So the TMA load
  # path stays outside the sanitizer (SAN_TMA=1 tries it anyway).
  export SPADE_TMA=${SAN_TMA:-0}
  for i in $(seq 1 300); do [ -f /root/san/building ] || break; sleep 2; done
  echo "sanitizer build rc=$(cat /root/san/rc 2>/dev/null) (waited $(( $(date +%s) - t0 )) s)"
  [ -x build-san/spade_gpu_tests ] || { grep -E "error" /root/san/build.log | head; tail -5 /root/san/build.log; exit 1; }
  CS=$(command -v compute-sanitizer || echo $CUDA_HOME/compute-sanitizer/compute-sanitizer)
  N=${SAN_SHARDS:-10}; PIDS=()
  for i in $(seq 0 $((N - 1))); do
    ( GTEST_TOTAL_SHARDS=$N GTEST_SHARD_INDEX=$i timeout ${SAN_TIMEOUT:-420} $CS --tool memcheck --error-exitcode 9 \
        ./build-san/spade_gpu_tests --gtest_filter="${SAN_FILTER:--CudaSmolLM2*:CudaMixedMethods.Every*}" \
        > "$OUT/memcheck_$i.log" 2>&1; echo "memcheck shard $i rc=$?" >> "$OUT/memcheck_$i.log" ) &
    PIDS+=($!)
  done
  for fam in "${RC_FAMILIES[@]}"; do
    name=${fam%%:*}; filt=${fam#*:}
    ( timeout ${SAN_TIMEOUT:-420} $CS --tool racecheck --racecheck-report hazard --error-exitcode 9 \
        ./build-san/spade_gpu_tests --gtest_filter="$filt" > "$OUT/racecheck_$name.log" 2>&1
      echo "racecheck $name rc=$?" >> "$OUT/racecheck_$name.log" ) &
    PIDS+=($!)
  done
  wait "${PIDS[@]}"
  {
    echo "== compute-sanitizer on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit ${COMMIT:-?}, $(( $(date +%s) - t0 )) s"
    for f in "$OUT"/memcheck_*.log "$OUT"/racecheck_*.log; do
      echo "$(basename $f): $(grep -cE '^\[       OK' $f) ok, $(grep -cE '^\[  FAILED' $f) failed," \
           "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1), $(tail -1 $f)," \
           "unfinished: $(grep -E '^\[ RUN' $f | sed 's/.*RUN *\] //' | sort > /tmp/r; grep -E '^\[ *(OK|FAILED|SKIPPED) *\]' $f | sed 's/^\[[^]]*\] //; s/ (.*//' | sort > /tmp/d; comm -23 /tmp/r /tmp/d | tr '\n' ' ')"
    done
    grep -hE "^========= (Invalid|Race|Error|Program hit|Uninitialized|Leaked)" "$OUT"/memcheck_*.log "$OUT"/racecheck_*.log | sort | uniq -c | head -40
  } | tee "$OUT/sanitize_summary.txt"
  if [ -d /root/fat ]; then
    for i in $(seq 1 120); do [ -f /root/fat/building ] || break; sleep 2; done
    echo "fat CUDA build (SPADE_CUDA_ARCHS=all): rc=$(cat /root/fat/rc 2>/dev/null), $(grep -m1 'CUDA architectures' /root/fat/cmake.log)"
    grep -E "error" /root/fat/build.log | head -10; tail -2 /root/fat/build.log
    cp /root/fat/build.log "$OUT/fat_build.log" 2>/dev/null
  fi
  exit 0
fi

# ---- run
M=/root/stage/s.gguf
cat /root/stage/model.part00 /root/stage/model.part01 /root/stage/model.part02 > $M
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $M" | sha256sum -c - || exit 1
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
S="$OUT/summary.txt"; : > "$S"

serve_runs() {  # $1 label prefix, $2 url, $3 scale (1: spade; llama-server, ~20x slower: fewer
  # requests so that its loads end within their timeouts). Each load runs a warm-up of its
  # own shape first (unmeasured).
  local L=$1 U=$2 S64=${3:-1}
  local n64=512 w64=64 n256=1536 w256=256
  [ "$S64" != 1 ] && { n64=128; w64=16; n256=512; w256=32; }
  timeout 120 python3 bench/bench_serve.py --url $U --num-prompts 16 --concurrency 1 --prompt-words 50 --max-tokens 256 \
    --procs 1 --warmup 2 --label "$L c=1" --out "$OUT/serve_${L}_c1.json" | tee -a "$S"
  timeout 150 python3 bench/bench_serve.py --url $U --num-prompts $n64 --concurrency 64 --prompt-words 50 --max-tokens 256 \
    --procs 8 --warmup $w64 --label "$L c=64" --out "$OUT/serve_${L}_c64.json" | tee -a "$S"
  metrics_snap "$U" "$L c=64"
  timeout 150 python3 bench/bench_serve.py --url $U --num-prompts $n64 --concurrency 64 --prompt-words 50 --max-tokens 256 \
    --procs 8 --no-stream --warmup $w64 --label "$L c=64 no-stream" --out "$OUT/serve_${L}_c64_nostream.json" | tee -a "$S"
  timeout 180 python3 bench/bench_serve.py --url $U --num-prompts $n256 --concurrency 256 --prompt-words 50 --max-tokens 256 \
    --procs 12 --warmup $w256 --label "$L c=256" --out "$OUT/serve_${L}_c256.json" | tee -a "$S"
  metrics_snap "$U" "$L c=256"
}
# The engine's counters (steps, busy / forward / delivery seconds, overlapped steps) after a load.
metrics_snap() {
  { echo "## $2"; curl -s "$1/metrics" | grep -E "^spade_engine_|^spade_generation_tokens_total"; } >> "$OUT/metrics_by_load.txt" 2>/dev/null
}
long_runs() {
  timeout 120 python3 bench/bench_serve.py --url $2 --num-prompts 96 --concurrency 64 --prompt-words 2700 --max-tokens 128 \
    --procs 8 --warmup 16 --label "$1 c=64 long" --out "$OUT/serve_$1_c64_long.json" | tee -a "$S"
}
wait_up() { for i in $(seq 1 240); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }

if [ "$phase" = run ] || [ "$phase" = serve ]; then
# serve: sections 4 and 5 only (the served loads and llama-server), e.g. to re-measure them.
if [ "$phase" = run ]; then
# 1. GPU tests that need the model file.
SPADE_MODEL=$M timeout 200 ./$B/spade_gpu_tests --gtest_filter="${GTEST_FILTER:-CudaSmolLM2*:CudaMixedMethods*:CudaModel.SmolLM2*:CudaScheduler*}" 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran|mixed-methods|smollm2-methods" | tail -30
# 2. The engine's own decode step at the served batch sizes (random weights of SmolLM2's shapes).
timeout 180 ./$B/bench_tpot_batch "$OUT/engine_steps.json" --model smollm2-135m \
  --lengths "${ENGINE_LENGTHS:-320:1,320:64,320:256,3600:64}" --methods full --steps 200 --warm 10 --commit "$COMMIT" 2>&1 | tail -6
# The nine methods of the mixed load, each alone and all in one batch, at the mixed load's shape.
timeout 150 ./$B/bench_tpot_batch "$OUT/engine_steps_mixed.json" --model smollm2-135m --lengths 320:63 \
  --methods "$MIX;${MIX//;/|}" --steps 200 --warm 10 --commit "$COMMIT" 2>&1 | tail -12
# Synthetic 8B at 32K, 16 requests: full, quest, and the two mixed per request in one batch.
timeout 240 ./$B/bench_tpot_batch "$OUT/engine_steps_8b_mixed.json" --model llama3-8b --lengths 32768:16 \
  --methods "full;quest:budget=1024;full|quest:budget=1024" --steps 64 --warm 6 --commit "$COMMIT" 2>&1 | tail -4
# 3. Single stream, CLI.
./$B/spade generate --model $M --device cuda --prompt "Once upon a time" -n 256 --ignore-eos --stats \
  >/dev/null 2>"$OUT/generate_stats.txt"; grep -iE "decode|tok/s" "$OUT/generate_stats.txt" | head -3
fi  # run only


# 4. spade serve --device cuda.
./$B/spade serve --model $M --device cuda --port 18080 --max-batch 256 --max-queue 2048 --max-step-tokens 2048 \
  >"$OUT/spade_serve.log" 2>&1 &
SP=$!
wait_up http://127.0.0.1:18080 || { echo "spade serve did not start"; tail -20 "$OUT/spade_serve.log"; }
serve_runs spade http://127.0.0.1:18080
timeout 120 python3 bench/bench_serve.py --url http://127.0.0.1:18080 --num-prompts 252 --concurrency 63 --prompt-words 50 \
  --max-tokens 256 --procs 8 --warmup 63 --methods "$MIX" --label "spade c=63 mixed" --out "$OUT/serve_spade_c63_mixed.json" | tee -a "$S"
timeout 120 python3 bench/bench_serve.py --url http://127.0.0.1:18080 --num-prompts 252 --concurrency 63 --prompt-words 50 \
  --max-tokens 256 --procs 8 --warmup 63 --label "spade c=63 full" --out "$OUT/serve_spade_c63_full.json" | tee -a "$S"
long_runs spade http://127.0.0.1:18080
curl -s http://127.0.0.1:18080/metrics > "$OUT/spade_metrics.txt"
cat "$OUT/metrics_by_load.txt"
kill -TERM $SP; wait $SP
# Per-request methods: greedy texts of a mixed load vs each method alone (deterministic server).
./$B/spade serve --model $M --device cuda --port 18083 --max-batch 64 --deterministic >"$OUT/spade_serve_det.log" 2>&1 &
SP=$!
wait_up http://127.0.0.1:18083 && timeout 150 python3 bench/mixed_methods_check.py --url http://127.0.0.1:18083 \
  --methods "$MIX" --per-method 6 --max-tokens 128 --label "mixed vs alone, --deterministic" \
  --out "$OUT/mixed_check.json" | tee -a "$S"
kill -TERM $SP; wait $SP

fi  # run

# Each method of the mixed load served alone, then the mixed load, short and long prompts, with
# the engine's counters (graph replays, captures, eager steps) after each load.
if [ "$phase" = methods ]; then
  if [ "${MODEL_TESTS:-0}" = 1 ]; then  # the GPU tests that need the model file first
    SPADE_MODEL=$M timeout ${MODEL_TEST_TIMEOUT:-150} ./$B/spade_gpu_tests \
      --gtest_filter="${GTEST_FILTER:-CudaSmolLM2*:CudaMixedMethods*:CudaModel.SmolLM2*:CudaScheduler*}" 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran|mixed-methods" | tail -20
  fi
  if [ "${NCU:-0}" = 1 ]; then
    # Kernel times of one method's decode steps at the mixed load's shape (ncu, clocks left
    # alone): each kernel's share of the step, to place the per-layer chains of the slow methods.
    # NCU_LENGTHS: the context:batch shapes (";"-separated; 320:7 is one method's share of the
    # mixed batch); the benchmark's random cache fill (fill_random_kernel, thousands of
    # launches) is not profiled.
    IFS=';' read -ra NM <<< "${NCU_METHODS:-full;twilight:base=quest,budget=128;lycheecluster:budget=64}"
    IFS=';' read -ra NL <<< "${NCU_LENGTHS:-320:63}"
    for m in "${NM[@]}"; do
      for len in "${NL[@]}"; do
        timeout 150 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
          --kernel-name-base function -k "regex:^([^f]|f[^i])" ./$B/bench_tpot_batch /tmp/ncu.json \
          --model smollm2-135m --lengths "$len" --methods "$m" --steps 1 --warm 1 > /tmp/ncu_raw.csv 2>/dev/null
        python3 bench/ncu_kernel_shares.py /tmp/ncu_raw.csv --label "$m at $len" | tee -a "$OUT/ncu_kernel_shares.txt"
      done
    done
  fi
  # SPADE_GRAPH_LOG: each CUDA graph capture's launch shape (what changed between graphs).
  SPADE_GRAPH_LOG="$OUT/graph_keys.log" ./$B/spade serve --model $M --device cuda --port 18080 --max-batch 256 \
    --max-queue 2048 --max-step-tokens 2048 >"$OUT/spade_serve.log" 2>&1 &
  SP=$!
  wait_up http://127.0.0.1:18080 || { echo "spade serve did not start"; tail -20 "$OUT/spade_serve.log"; }
  U=http://127.0.0.1:18080
  # The nine methods and their mix at the long load's context (engine steps, no server;
  # ENGINE_STEPS=0 skips them).
  [ "${ENGINE_STEPS:-1}" = 1 ] && timeout 150 ./$B/bench_tpot_batch "$OUT/engine_steps_mixed_long.json" --model smollm2-135m --lengths 3600:63 \
    --methods "$MIX;${MIX//;/|}" --steps 100 --warm 10 --commit "$COMMIT" 2>&1 | tail -12
  IFS=';' read -ra ONE <<< "${ALONE:-$MIX}"  # ALONE: the methods served alone (default: all nine)
  for m in "${ONE[@]}"; do
    timeout 60 python3 bench/bench_serve.py --url $U --num-prompts 126 --concurrency 63 --prompt-words 50 --max-tokens 256 \
      --procs 8 --warmup 63 --methods "$m" --label "spade c=63 $m" --out "$OUT/serve_alone_${m%%:*}.json" | tee -a "$S"
    metrics_snap $U "alone $m"
  done
  # LONG_ALONE: methods served alone on the long load too (default none), with their counters.
  IFS=';' read -ra LONE <<< "${LONG_ALONE:-}"
  for m in "${LONE[@]}"; do
    timeout 60 python3 bench/bench_serve.py --url $U --num-prompts 63 --concurrency 63 --prompt-words 2700 --max-tokens 128 \
      --procs 8 --warmup 0 --methods "$m" --label "spade c=63 long $m" --out "$OUT/serve_long_alone_${m%%:*}.json" | tee -a "$S"
    metrics_snap $U "long alone $m"
  done
  timeout 90 python3 bench/bench_serve.py --url $U --num-prompts 252 --concurrency 63 --prompt-words 50 --max-tokens 256 \
    --procs 8 --warmup 63 --methods "$MIX" --label "spade c=63 mixed" --out "$OUT/serve_mixed_short.json" | tee -a "$S"
  metrics_snap $U "mixed short"
  for lab in mixed full; do
    [ $lab = mixed ] && MM="$MIX" || MM=""
    timeout 120 python3 bench/bench_serve.py --url $U --num-prompts 126 --concurrency 63 --prompt-words 2700 --max-tokens 128 \
      --procs 8 --warmup 63 --methods "$MM" --label "spade c=63 long $lab" --out "$OUT/serve_long_$lab.json" | tee -a "$S"
    metrics_snap $U "long $lab"
  done
  kill -TERM $SP; wait $SP
  # AB_MIN_USES=n: the short and long loads, mixed and full, again on a server that captures a
  # launch shape the n-th time it occurs (SPADE_GRAPH_MIN_USES; 1 = at first sight).
  if [ -n "${AB_MIN_USES:-}" ]; then
    SPADE_GRAPH_MIN_USES=$AB_MIN_USES ./$B/spade serve --model $M --device cuda --port 18080 --max-batch 256 \
      --max-queue 2048 --max-step-tokens 2048 >"$OUT/spade_serve_ab.log" 2>&1 &
    SP=$!
    wait_up $U || { echo "spade serve (A/B) did not start"; tail -20 "$OUT/spade_serve_ab.log"; }
    for lab in mixed full; do
      [ $lab = mixed ] && MM="$MIX" || MM=""
      timeout 90 python3 bench/bench_serve.py --url $U --num-prompts 252 --concurrency 63 --prompt-words 50 --max-tokens 256 \
        --procs 8 --warmup 63 --methods "$MM" --label "spade c=63 $lab min_uses=$AB_MIN_USES" \
        --out "$OUT/serve_ab_short_$lab.json" | tee -a "$S"
      metrics_snap $U "ab short $lab"
      timeout 120 python3 bench/bench_serve.py --url $U --num-prompts 126 --concurrency 63 --prompt-words 2700 --max-tokens 128 \
        --procs 8 --warmup 63 --methods "$MM" --label "spade c=63 long $lab min_uses=$AB_MIN_USES" \
        --out "$OUT/serve_ab_long_$lab.json" | tee -a "$S"
      metrics_snap $U "ab long $lab"
    done
    kill -TERM $SP; wait $SP
  fi
  cat "$OUT/metrics_by_load.txt"
fi

# BLASST calibrated inside each GPU selector's lists (`spade calibrate blasst --device cuda
# --sparse X+blasst`, issue 37): the text is KJV Genesis' first 30,000 bytes as in
# configs/blasst_smollm2_gpu_decode_s50.json (carry it as .stage/kjv_gen30k.txt); one config
# per selector in $OUT (CAL_BASES, CAL_BUDGET).
if [ "$phase" = calibrate ]; then
  IFS=';' read -ra CB <<< "${CAL_BASES:-quest;tidal;lessismore;lycheecluster;lycheedecode;streaming}"
  IFS=';' read -ra CT <<< "${CAL_TARGETS:-0.5}"
  for base in "${CB[@]}"; do
    for tgt in "${CT[@]}"; do
      t1=$(date +%s)
      timeout ${CAL_TIMEOUT:-120} ./$B/spade calibrate blasst --device cuda --model $M --text .stage/kjv_gen30k.txt \
        --phase decode --sparse "$base+blasst:budget=${CAL_BUDGET:-1024}" --target-sparsity $tgt --lengths 2048,4096 \
        --samples 2 --out "$OUT/blasst_smollm2_gpu_${base}${CAL_BUDGET:-1024}.json" > "$OUT/calibrate_${base}_$tgt.log" 2>&1
      echo "calibrate $base+blasst target $tgt rc=$? in $(( $(date +%s) - t1 )) s"
      tail -2 "$OUT/calibrate_${base}_$tgt.log" | cut -c1-600
    done
  done
  grep -H -o '"a": [0-9.e+-]*' $OUT/blasst_smollm2_gpu_*.json 2>/dev/null
fi

# The per-request-method part of run alone (tests that need the model, served loads).
if [ "$phase" = mixed ]; then
  SPADE_MODEL=$M timeout 120 ./$B/spade_gpu_tests --gtest_filter="${GTEST_FILTER:-CudaMixedMethods*}" 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran|mixed-methods|Failure|exception" | tail -30
  # The steady-state step of the nine methods in one batch vs full (no server, no recaptures).
  timeout 120 ./$B/bench_tpot_batch "$OUT/engine_steps_mixed.json" --model smollm2-135m --lengths 320:63 \
    --methods "full;${MIX//;/|}" --steps 200 --warm 10 --commit "$COMMIT" 2>&1 | tail -3
  ./$B/spade serve --model $M --device cuda --port 18080 --max-batch 256 --max-queue 2048 --max-step-tokens 2048 \
    >"$OUT/spade_serve.log" 2>&1 &
  SP=$!
  wait_up http://127.0.0.1:18080 || { echo "spade serve did not start"; tail -20 "$OUT/spade_serve.log"; }
  for c in 64 256; do
    timeout 100 python3 bench/bench_serve.py --url http://127.0.0.1:18080 --num-prompts $((c * 3)) --concurrency $c \
      --prompt-words 50 --max-tokens 256 --procs $((c == 256 ? 12 : 8)) --label "spade c=$c" --out "$OUT/serve_spade_c$c.json" | tee -a "$S"
  done
  timeout 100 python3 bench/bench_serve.py --url http://127.0.0.1:18080 --num-prompts 192 --concurrency 64 --no-stream \
    --prompt-words 50 --max-tokens 256 --procs 8 --label "spade c=64 no-stream" --out "$OUT/serve_spade_c64_nostream.json" | tee -a "$S"
  for lab in mixed full; do
    [ $lab = mixed ] && MM="$MIX" || MM=""
    timeout 100 python3 bench/bench_serve.py --url http://127.0.0.1:18080 --num-prompts 252 --concurrency 63 --prompt-words 50 \
      --max-tokens 256 --procs 8 --methods "$MM" --label "spade c=63 $lab" --out "$OUT/serve_spade_c63_$lab.json" | tee -a "$S"
  done
  curl -s http://127.0.0.1:18080/metrics > "$OUT/spade_metrics.txt"
  kill -TERM $SP; wait $SP
  ./$B/spade serve --model $M --device cuda --port 18083 --max-batch 64 --deterministic >"$OUT/spade_serve_det.log" 2>&1 &
  SP=$!
  wait_up http://127.0.0.1:18083 && timeout 120 python3 bench/mixed_methods_check.py --url http://127.0.0.1:18083 \
    --methods "$MIX" --per-method 6 --max-tokens 128 --label "mixed vs the others full, --deterministic" \
    --out "$OUT/mixed_check.json" | tee -a "$S"
  kill -TERM $SP; wait $SP
fi

# 5. llama-server, same client.
for i in $(seq 1 90); do [ -f /root/peer/building ] || break; sleep 2; done
if [ "$phase" = mixed ] || [ "$phase" = methods ] || [ "$phase" = calibrate ]; then
  :
elif [ -x $PEER/build-cuda/bin/llama-server ]; then
  $PEER/build-cuda/bin/llama-server -m $M -ngl 99 -fa on -np 256 -c $((256 * 640)) --cont-batching \
    --port 18081 >"$OUT/llama_server.log" 2>&1 &
  LP=$!
  wait_up http://127.0.0.1:18081 && serve_runs llama http://127.0.0.1:18081 4
  kill -TERM $LP; wait $LP
  $PEER/build-cuda/bin/llama-server -m $M -ngl 99 -fa on -np 64 -c $((64 * 3900)) --cont-batching \
    --port 18082 >"$OUT/llama_server_long.log" 2>&1 &
  LP=$!
  wait_up http://127.0.0.1:18082 && long_runs llama http://127.0.0.1:18082
  kill -TERM $LP; wait $LP
else
  echo "llama-server not built"; tail -5 /root/peer/build.log
fi
echo "== $DEV, commit $COMMIT"
cat "$S"
# At most 8 files come back: everything but the summary in one archive.
# (written outside $OUT first: tar of a folder that holds its own archive fails on it)
(cd "$OUT" && tar czf /tmp/results.tar.gz --exclude=summary.txt . && mv /tmp/results.tar.gz . && \
  find . -type f ! -name summary.txt ! -name results.tar.gz -delete)

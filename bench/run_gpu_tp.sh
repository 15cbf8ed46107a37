#!/usr/bin/env bash
# Tensor parallelism on 2+ GPUs (issue 39): builds spade and spade_gpu_tests in build-gpu (as
# run_gpu_serve.sh's build phase, without llama.cpp or the whole GPU suite), then runs
#   1. CudaTp.* (tests/gpu/test_cuda_tp.cpp: TP=2 vs TP=1 logits, graphs off / on, the rank
#      protocol with device sampling, SmolLM2 at TP=3 when 3 GPUs and the model are there)
#      and CudaModel.RandomLlamaMatchesCpu (TP=1 unchanged);
#   2. tests/e2e/test_tp_cuda.py (spade generate --device cuda --tp 2 equals --tp 1);
#   3. the TPOT probe: CudaTp.SpeedProbe with SPADE_TP_SPEED=1 (tests/gpu/test_cuda_tp_speed.cpp):
#      synthetic Llama-3.1-8B at 32K / 128K x batch 1 / 8, TP = 1..GPUs, then Llama-3.1-70B at
#      128K x batch 1 / 8 and 32K x 8 (TP where it fits); records in $OUT/tp_speed.jsonl; then
#      every GPU method on 70B at 128K x 1 over all GPUs ($OUT/tp_speed_methods.jsonl).
#   device (kind nvidia-h200-x2):  bash bench/run_gpu_tp.sh   carry .deps-cuda
#   Env: SPEED=0 skips 3; JOBS (default 16) build jobs.
# Results: $OUT/build.log, $OUT/cuda_tp.log, $OUT/e2e_tp_cuda.log, $OUT/speed_tp.log, and a
# summary printed last. NCCL_NVLS_ENABLE=0 (spade sets it too; the machines need it off).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROOT=$(pwd)
B=build-gpu
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); CUDA_HOME=$(dirname $(dirname $NVCC))
CUDA_LIB=$CUDA_HOME/lib64; [ -d $CUDA_HOME/targets/x86_64-linux/lib ] && CUDA_LIB=$CUDA_HOME/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$ROOT/.deps-cuda/lib:$CUDA_LIB:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
nvidia-smi -L | tee "$OUT/gpus.txt"
ls $CUDA_HOME/include/nccl.h $CUDA_HOME/lib*/libnccl* 2>&1 | tee "$OUT/nccl_files.txt"
gcc -O3 -c .deps-cuda/src/cblas_shim.c -o /tmp/cblas_shim.o && ar rcs .deps-cuda/lib/libopenblas.a /tmp/cblas_shim.o
[ -d .deps-cuda/include/boost ] || tar xzf .deps-cuda/boost-headers.tar.gz -C .deps-cuda/include
PKGCFG=""; command -v pkg-config >/dev/null || PKGCFG="-DPKG_CONFIG_EXECUTABLE=$ROOT/.deps-cuda/tools/pkg-config"
export PKG_CONFIG_PATH=$ROOT/.deps-cuda/lib/pkgconfig
[ -f $B/build.ninja ] || cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DCMAKE_PREFIX_PATH=$ROOT/.deps-cuda -DBLA_VENDOR=OpenBLAS -DBLA_STATIC=ON $PKGCFG >"$OUT/cmake.log" 2>&1 \
    || { tail -30 "$OUT/cmake.log"; exit 1; }
grep -i "spade: NCCL" "$OUT/cmake.log" 2>/dev/null; grep -i "^SPADE_NCCL" $B/CMakeCache.txt
cmake --build $B -j${JOBS:-16} --target spade spade_gpu_tests -- -k 0 >"$OUT/build.log" 2>&1 \
  || grep -E "error" "$OUT/build.log" | head -20
[ -x $B/spade_gpu_tests ] || { echo "no spade_gpu_tests"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
timeout 300 ./$B/spade_gpu_tests --gtest_filter='CudaTp.*:CudaModel.RandomLlamaMatchesCpu' \
  >"$OUT/cuda_tp.log" 2>&1; rc1=$?
echo "CudaTp tests rc=$rc1 after $(( $(date +%s) - t0 )) s"
rc2=skipped
[ -x $B/spade ] && { timeout 240 python3 tests/e2e/test_tp_cuda.py --spade $B/spade >"$OUT/e2e_tp_cuda.log" 2>&1; rc2=$?; }
echo "tp_cuda e2e rc=$rc2 after $(( $(date +%s) - t0 )) s"
rc3=skipped
if [ "${SPEED:-1}" = 1 ]; then
  NG=$(nvidia-smi -L | wc -l); RANKS=1; for i in $(seq 2 $NG); do RANKS=$RANKS,$i; done
  SPADE_TP_SPEED=1 SPADE_TP_JSON=$OUT/tp_speed.jsonl SPADE_TP_MODEL=llama3-8b SPADE_TP_RANKS=$RANKS \
    SPADE_TP_SHAPES=${SHAPES_8B:-32768:1,32768:8,130900:1,130900:8} timeout 300 ./$B/spade_gpu_tests \
    --gtest_filter='CudaTp.SpeedProbe' >"$OUT/speed_tp.log" 2>&1; rc3=$?
  SPADE_TP_SPEED=1 SPADE_TP_JSON=$OUT/tp_speed.jsonl SPADE_TP_MODEL=llama3-70b SPADE_TP_RANKS=$RANKS \
    SPADE_TP_SHAPES=${SHAPES_70B:-130900:1,32768:8,130900:8} timeout 300 ./$B/spade_gpu_tests \
    --gtest_filter='CudaTp.SpeedProbe' >>"$OUT/speed_tp.log" 2>&1 || rc3=$?
  # Every GPU method at the 70B 128K x 1 shape on every rank count that fits (their speed-up
  # over full attention there; METHODS_70B="" skips).
  # LycheeDecode on random weights has no trained roles: a synthetic pattern, layer 0 all
  # retrieval (the method requires it: the first token sets come from it), then one retrieval
  # KV head of 8 per layer; Twilight on the GPU takes an explicit base budget.
  LD70=$(python3 -c "print('/'.join(['RRRRRRRR'] + ['RSSSSSSS'] * 79))")
  M70=${METHODS_70B-"full;streaming:budget=4096;quest:budget=4096;tidal:budget=4096;lessismore:budget=4096;lycheedecode:budget=4096,roles=$LD70;lycheecluster:budget=4096;twilight:budget=4096;blasst;oracle-topk:budget=4096"}
  [ -n "$M70" ] && { SPADE_TP_SPEED=1 SPADE_TP_JSON=$OUT/tp_speed_methods.jsonl SPADE_TP_MODEL=llama3-70b \
    SPADE_TP_RANKS=$NG SPADE_TP_SHAPES=130900:1 SPADE_TP_METHODS="$M70" timeout 400 ./$B/spade_gpu_tests \
    --gtest_filter='CudaTp.SpeedProbe' >"$OUT/speed_tp_methods.log" 2>&1 || rc3=$?; }
  echo "speed probe rc=$rc3 after $(( $(date +%s) - t0 )) s"
fi
echo "==== summary"
grep -E "^\[ *(OK|FAILED|SKIPPED) *\]|\[cuda tp\]|Failure|rank [0-9]:|error" "$OUT/cuda_tp.log" | head -40
[ -f "$OUT/e2e_tp_cuda.log" ] && grep -E "^(ok|FAIL|skip|note|info|PASS)|FAILED" "$OUT/e2e_tp_cuda.log" | head -20
[ -f "$OUT/speed_tp.log" ] && grep -E "\[cuda tp\]|FAILED|Failure|error" "$OUT/speed_tp.log" | head -20
[ -f "$OUT/speed_tp_methods.log" ] && grep -E "\[cuda tp\]|FAILED|Failure|error" "$OUT/speed_tp_methods.log" | head -20
echo "rc: tests $rc1, e2e $rc2, speed $rc3"

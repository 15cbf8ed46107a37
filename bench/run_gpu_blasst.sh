#!/usr/bin/env bash
# One device call for BLASST on the GPU: the gpu tests of the skipping kernels (and the dense
# attention tests they must not break), then bench_blasst (decode lambda sweep, the paper's
# shape) -> $OUT/blasst_decode.jsonl. Binaries from bench/gpu_deps/prebuild.sh (.prebuilt/):
#   run(command="bash bench/run_gpu_blasst.sh", carry=[".prebuilt", ".deps-cuda"])
# Env: BENCH_MODE (paper | llama | all, default all), Q_SCALE (default 1), FILTER (gtest filter).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PRE=${PREBUILT:-.prebuilt}
NVCC=$(command -v nvcc); CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $NVCC))}
CUDA_LIB=$CUDA_HOME/lib64
[ -d $CUDA_HOME/targets/x86_64-linux/lib ] && CUDA_LIB=$CUDA_HOME/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CUDA_LIB:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_TIMEOUT:-240} ./$PRE/spade_gpu_tests --gtest_filter="${FILTER:-CudaBlasst*:CudaAttention.*}" \
  2>&1 | tee "$OUT/gpu_tests_blasst.log" | grep -vE "^\[ +(RUN|OK) " | tail -40
timeout ${BENCH_TIMEOUT:-300} ./$PRE/bench_blasst ${BENCH_MODE:-all} "$OUT/blasst_decode.jsonl" ${Q_SCALE:-1} 2>&1 | tail -5
# PyTorch SDPA on the same shapes (dense; contiguous caches), same run.
PYTHONUNBUFFERED=1 timeout 200 python3 python/bench_sdpa_decode.py blasst --out "$OUT/blasst_sdpa.jsonl" 2>&1 | grep -v Warning | tail -3
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
python3 bench/blasst_results.py "$OUT/blasst_decode.jsonl" "$OUT/blasst_sdpa.jsonl" "$OUT/blasst_decode.json" \
  "$DEV" "${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" "bash bench/run_gpu_blasst.sh"

#!/usr/bin/env bash
# One device call for the server on the GPU: builds spade + spade_gpu_tests (bench/run_gpu.sh
# with BUILD_CLI=1), runs the GPU scheduler test, the smoke checks of `spade serve --device
# cuda` (bench/gpu_server_check.py) and the load benchmark (bench/bench_server_load.py).
# Needs .deps-cuda/ carried and the default model at $MODEL (two calls: see bench/README.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-/root/stage/s.gguf}
export BUILD_CLI=1 GTEST_FILTER=${GTEST_FILTER:-CudaScheduler.*:CudaModel.SmolLM2GreedyMatchesCpu}
SPADE_MODEL=$MODEL bash bench/run_gpu.sh tests
export LD_LIBRARY_PATH=$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
B=build-gpu
[ -x $B/spade ] || { echo "spade CLI did not build"; grep -E "error" -A3 "$OUT/build.log" | head -40; exit 1; }
timeout 300 python3 bench/gpu_server_check.py --spade $B/spade --model "$MODEL" 2>&1 | tail -8
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
timeout ${LOAD_TIMEOUT:-300} python3 bench/bench_server_load.py --spade $B/spade --model "$MODEL" \
  --device "$DEV" --clients ${CLIENTS:-32} --requests ${REQUESTS:-300} \
  --server-args "--device cuda --max-batch 32 --max-queue 256" \
  --note "spade serve --device cuda (full attention, bf16, CUDA graphs) on one $DEV; client and server on the same host" \
  --out "$OUT/server_load_gpu.json" 2>&1 | tail -15

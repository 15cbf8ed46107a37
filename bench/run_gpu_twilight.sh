#!/usr/bin/env bash
# One device call for Twilight on the GPU: the CudaTwilight* gpu tests (INT4 keys, pruner vs
# the CPU method, Quest -> prune -> attention, CudaModel --sparse twilight), then bench_twilight -> $OUT/twilight.jsonl and
# the results JSON ($OUT/twilight.json: device, date, commit, command, points). Binaries
# prebuilt here (no GPU needed) by bench/gpu_deps/prebuild_twilight.sh into $PREBUILT
# (default .prebuilt-tw, which also gets a copy of this script):
#   run(command="COMMIT=<short hash> bash .prebuilt-tw/run_gpu_twilight.sh",
#       carry=[".prebuilt-tw", ".deps-cuda"])
# Env: BENCH_MODE (all | quick | none), FILTER (gtest filter), COMMIT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PRE=${PREBUILT:-.prebuilt-tw}
NVCC=$(command -v nvcc); CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $NVCC))}
CUDA_LIB=$CUDA_HOME/lib64
[ -d $CUDA_HOME/targets/x86_64-linux/lib ] && CUDA_LIB=$CUDA_HOME/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CUDA_LIB:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_TIMEOUT:-150} ./$PRE/spade_gpu_tests_tw --gtest_filter="${FILTER:-CudaTwilight*}" \
  2>&1 | tee "$OUT/gpu_tests_twilight.log" | grep -vE "^\[ +(RUN|OK) " | tail -40
[ "${BENCH_MODE:-all}" = none ] && exit 0
timeout ${BENCH_TIMEOUT:-240} ./$PRE/bench_twilight "$OUT/twilight.jsonl" ${BENCH_MODE:-all} 2>&1 | tail -12
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
python3 - "$OUT/twilight.jsonl" "$OUT/twilight.json" "$DEV" "${COMMIT:-unknown}" <<'PY'
import json, sys, datetime
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"device": sys.argv[3], "date": datetime.date.today().isoformat(), "commit": sys.argv[4],
           "command": "bash bench/run_gpu_twilight.sh (bench_twilight all)", "points": rows},
          open(sys.argv[2], "w"), indent=1)
PY

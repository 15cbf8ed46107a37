#!/usr/bin/env bash
# A/B of two builds on the device: bench_tpot_batch (synthetic Llama-3.1-8B, CUDA graphs) from
# $OLD (before the change) and $NEW (after), interleaved old, new, old, new, so drift between
# runs shows as the spread of equal builds. Optionally the gpu tests of the new build first.
#   here:   build both into ignored folders (bench/run_gpu_tpot_batch.sh prebuild, once per
#           build), pack them with the tests binary: tar c .prebuilt-x | xz -T2 -6 > .stage/x.txz
#   device: run(command="PACK=.stage/x.txz OLD=.prebuilt-x/old NEW=.prebuilt-x COMMIT=<hash>
#               FILTER='CudaOps.*' bash bench/run_gpu_build_ab.sh", carry=[".stage", ".deps-cuda"])
# Output under $OUT: gpu_tests.log, tpot_{old,new}_r<k>.json / .log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -n "${PACK:-}" ] && xz -dc "$PACK" | tar x
NVCC=$(command -v nvcc); CH=$(dirname $(dirname $NVCC)); CL=$CH/lib64
[ -d $CH/targets/x86_64-linux/lib ] && CL=$CH/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CL:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
if [ -n "${FILTER:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} ${NEW:?}/spade_gpu_tests --gtest_filter="$FILTER" > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|FAILED  \]" "$OUT/gpu_tests.log" | tail -30
fi
LENGTHS=${LENGTHS:-32768:1,131008:1}
METHODS=${METHODS:-"quest:budget=2048;twilight:budget=8192"}
for r in $(seq ${REPS:-2}); do
  for side in old new; do
    dir=$OLD; [ $side = new ] && dir=$NEW
    timeout ${BENCH_TIMEOUT:-150} $dir/bench_tpot_batch "$OUT/tpot_${side}_r$r.json" --model llama3-8b \
      --lengths "$LENGTHS" --methods "$METHODS" --steps ${STEPS:-48} --warm 8 \
      --commit "${COMMIT:-unknown}-$side" > "$OUT/tpot_${side}_r$r.log" 2>&1
    echo "tpot $side r=$r rc=$?"
  done
done

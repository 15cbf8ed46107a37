#!/usr/bin/env bash
# Programmatic dependent launch (src/backend/cuda/pdl.cuh) A/B on the device: the same
# binaries run with SPADE_PDL=0 (plain stream order) and SPADE_PDL=1 (the default),
# interleaved 0, 1, 0, 1, so drift between runs shows as the spread of equal settings.
#   here:   build the binaries into $PRE (default .prebuilt-pdl): spade_gpu_tests, spade,
#           bench_sparse, bench_twilight, bench_tpot_batch (see the prebuild scripts in
#           bench/gpu_deps/ for the static relink; strip them so the carry stays small)
#   device: run(command="MODE=tests|bench COMMIT=<hash> bash bench/run_gpu_pdl_ab.sh",
#               carry=[".prebuilt-pdl", ".deps-cuda"])
# MODE=tests runs every gpu test with PDL on ($SPADE_MODEL: SmolLM2 for the model tests);
# MODE=bench runs, per setting: bench_tpot_batch (synthetic Llama-3.1-8B, batch 1, 32K and
# ~128K, full / Quest / Twilight / TidalDecode, graphs), bench_sparse at 128K batch 1 and
# bench_twilight quick (32K, batch 1 and 8). Output under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
PRE=${PRE:-.prebuilt-pdl}
mkdir -p "$OUT"
NVCC=$(command -v nvcc); CH=$(dirname $(dirname $NVCC)); CL=$CH/lib64
[ -d $CH/targets/x86_64-linux/lib ] && CL=$CH/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CL:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "${MODE:-bench}" in
tests)
  timeout ${TEST_TIMEOUT:-540} $PRE/spade_gpu_tests ${FILTER:+--gtest_filter=$FILTER} \
    > "$OUT/gpu_tests_pdl.log" 2>&1
  echo "rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|FAILED  \]" "$OUT/gpu_tests_pdl.log" | tail -30
  ;;
bench)
  LENGTHS=${LENGTHS:-32768:1,131008:1}
  METHODS=${METHODS:-"full;quest:budget=2048;twilight:budget=8192;tidal:budget=2048"}
  for r in 1 2; do
    for pdl in 0 1; do
      SPADE_PDL=$pdl timeout 200 $PRE/bench_tpot_batch "$OUT/tpot_pdl${pdl}_r$r.json" \
        --model llama3-8b --lengths "$LENGTHS" --methods "$METHODS" --steps ${STEPS:-48} \
        --warm 8 --commit "${COMMIT:-unknown}" > "$OUT/tpot_pdl${pdl}_r$r.log" 2>&1
      echo "tpot pdl=$pdl r=$r rc=$?"
      SPADE_PDL=$pdl timeout 120 $PRE/bench_sparse "$OUT/sparse_pdl${pdl}_r$r.jsonl" 131072 1 \
        > "$OUT/sparse_pdl${pdl}_r$r.log" 2>&1
      echo "sparse pdl=$pdl r=$r rc=$?"
      SPADE_PDL=$pdl timeout 120 $PRE/bench_twilight "$OUT/twilight_pdl${pdl}_r$r.jsonl" quick \
        > "$OUT/twilight_pdl${pdl}_r$r.log" 2>&1
      echo "twilight pdl=$pdl r=$r rc=$?"
    done
  done
  ;;
esac

#!/usr/bin/env bash
# Which kernel path moves a GPU test's numbers: runs one gtest filter of spade_gpu_tests under
# each environment setting given (one argument each, "" = none; several variables in one
# argument separated by spaces) and prints, per setting, the test's verdict and the lines
# that match PATTERN. For a test that passes on the device and fails as an emulated GPU
# (SPADE_EMULATE_CC), the settings that switch one emulated difference at a time on the real
# GPU (the generic prefill, no TMA, no PDL, ...) say which path it is.
#   bash bench/gpu_isolate_test.sh BIN FILTER PATTERN SETTING...
#   e.g. bash bench/gpu_isolate_test.sh build-gpu/spade_gpu_tests \
#          CudaLycheeClusterModel.MatchesCpuSession 'lycheecluster-model|Failure|rel err' \
#          "" SPADE_EMULATE_CC=86 SPADE_ATTN_PREFILL=0 SPADE_TMA=0 SPADE_PDL=0
set -uo pipefail
BIN=$1; FILTER=$2; PATTERN=$3; shift 3
for setting in "$@"; do
  echo "== ${setting:-(default)}"
  # shellcheck disable=SC2086
  out=$(env $setting timeout ${ISOLATE_TIMEOUT:-120} "$BIN" --gtest_filter="$FILTER" 2>&1); rc=$?
  echo "rc=$rc $(echo "$out" | grep -cE '^\[       OK') ok $(echo "$out" | grep -cE '^\[  FAILED  \] [A-Za-z]' ) failed"
  echo "$out" | grep -E "$PATTERN" | cut -c1-400 | head -${ISOLATE_LINES:-12}
done

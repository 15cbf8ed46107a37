#!/usr/bin/env bash
# End-to-end decode A/B of two builds of the CLI (batch 1, synthetic Llama-3.1-8B), on the
# GPU machine: the base binary and the new one, interleaved twice per method, one
# `spade generate --device cuda --synthetic llama3-8b` each; prints its `[spade]` lines
# (median / mean decode step). Binaries are built here with
# `PREBUILD_CLI=1 bash bench/gpu_deps/prebuild.sh` (.prebuilt/spade, stripped into a
# carried folder).
# Usage (device): BASE=.prebuilt-s/spade NEW=.prebuilt-n/spade \
#   bash bench/ab_tpot_cli.sh LENGTH "method|budget" ...   (empty budget: none)
# e.g. bash bench/ab_tpot_cli.sh 32768 "full|" "quest|2048" "twilight|8192"
set -uo pipefail
BASE=${BASE:-.prebuilt-s/spade}
NEW=${NEW:-.prebuilt-n/spade}
NVCC=$(command -v nvcc); CH=$(dirname $(dirname $NVCC))
export LD_LIBRARY_PATH=$CH/lib64:$CH/targets/x86_64-linux/lib:$(pwd)/.deps-cuda/lib
L=$1; shift
for rep in 1 2; do
  for bin in base new; do
    SPADE=$BASE; [ $bin = new ] && SPADE=$NEW
    for MB in "$@"; do
      M=${MB%|*}; BU=${MB#*|}
      ARGS=(--sparse "$M"); [ -n "$BU" ] && ARGS+=(--budget "$BU")
      echo "### rep=$rep bin=$bin L=$L method=$M budget=$BU"
      timeout 200 "$SPADE" generate --device cuda --synthetic llama3-8b --prompt-len "$L" -n 64 \
        --ignore-eos --stats "${ARGS[@]}" 2>&1 >/dev/null | grep -E "^\[spade\]|rror" | head -6
    done
  done
done

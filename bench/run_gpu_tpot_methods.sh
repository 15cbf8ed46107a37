#!/usr/bin/env bash
# End-to-end TPOT of every GPU sparse method on synthetic Llama-3.1-8B weights (batch 1), one
# `spade generate --device cuda --synthetic llama3-8b` per method and context, through the
# prebuilt CLI. Prints each run's command and its `[spade]` stats lines; the JSON in
# bench/results/ is written from this log (bench/tpot_methods_json.py).
# Usage (device): SPADE=path/to/spade bash bench/run_gpu_tpot_methods.sh LENGTHS BUDGET > log
# env: METHODS (default: every GPU selection method below), N (tokens generated, default 64).
set -uo pipefail
SPADE=${SPADE:-.prebuilt/spade}
LENGTHS=${1:-32768}
BUDGET=${2:-2048}
METHODS=${METHODS:-full tidal lessismore lycheedecode quest lycheecluster}
N=${N:-64}
# LycheeDecode roles for the synthetic model (no trained roles exist for random weights): layer
# 0 all retrieval, one retrieval head in each of layers 1-24 (heads 0..7 in turn), layers
# 25-31 all sparse: 32 of 256 KV heads, the paper's count for Llama-3-8B.
ROLES=$(python3 -c "
print('/'.join('R'*8 if l == 0 else ''.join('R' if (l <= 24 and i == (l-1) % 8) else 'S' for i in range(8)) for l in range(32)))")
for L0 in ${LENGTHS//,/ }; do
  # Llama-3.1-8B's context is 131072 tokens: at "128K" the prompt leaves room for the N tokens.
  L=$(( L0 + N > 131072 ? 131072 - N : L0 ))
  for M in $METHODS; do
    ARGS=(--sparse "$M")
    [ "$M" != full ] && ARGS+=(--budget "$BUDGET")
    [ "$M" = lycheedecode ] && ARGS+=(--sparse-opt "roles=$ROLES")
    CMD=("$SPADE" generate --device cuda --synthetic llama3-8b --prompt-len "$L" -n "$N" --ignore-eos --stats "${ARGS[@]}")
    echo "### method=$M L=$L budget=$BUDGET"
    echo "### command: ${CMD[*]}"
    timeout 150 "${CMD[@]}" 2>&1 >/dev/null | grep -E "^\[spade\]|rror" | head -10
    echo "### rc=${PIPESTATUS[0]}"
  done
done

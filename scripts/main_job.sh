#!/usr/bin/env bash
# `make run`: what spade is for. SmolLM2-135M-Instruct answers a needle-in-a-haystack
# question over a long real text (KJV Genesis, from Debian's bible-kjv-text) close to its
# 8K context, with full attention and with sparse methods that read a few hundred of the
# ~7K cached tokens per head. One dense prefill is shared by all methods (the KV cache is
# forked); each method prints its answer, whether it found the needle, its density, its
# attention recall against full attention and its decode speed.
#
# usage: scripts/main_job.sh [SPADE_BINARY] [MODEL]
# Environment overrides: CONTEXT (prompt tokens, default 6800), BUDGET (tokens per KV head,
# default 1024), METHODS (default "full;quest;tidal;lessismore;streaming;lessismore:budget=256"), THREADS.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
spade=${1:-$root/build/spade}
model=${2:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
context=${CONTEXT:-6800}
budget=${BUDGET:-1024}
methods=${METHODS:-full;quest;tidal;lessismore;streaming;lessismore:budget=256}

command -v bible >/dev/null || { echo "main_job: the 'bible' program (Debian package bible-kjv) is missing; run scripts/install_deps.sh" >&2; exit 1; }
[ -x "$spade" ] || { echo "main_job: $spade not built" >&2; exit 1; }
[ -f "$model" ] || { echo "main_job: $model missing; run scripts/fetch_model.sh" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Genesis, one verse per line, verse references stripped.
bible -f "Gen1:1-Gen50:26" | sed -E 's/^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ //' > "$tmp/haystack.txt"

echo "== spade: needle in a haystack, $(basename "$model"), ~$context prompt tokens, budget $budget tokens/KV head"
start=$(date +%s)
"$spade" needle --model "$model" --haystack-file "$tmp/haystack.txt" \
  --needle "The special magic number is 71432." \
  --question "What is the special magic number mentioned in the text above?" \
  --expect 71432 --depth 0.5 --context-tokens "$context" --budget "$budget" \
  --methods "$methods" -n 16 --recall ${THREADS:+--threads "$THREADS"}
echo "== main job took $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# BLASST on real attention: SmolLM2-135M-Instruct on the GPU, a prompt of KJV Genesis (about
# 3.5K and 7.5K tokens), 64 greedy tokens with full attention and with BLASST at several
# thresholds (decode: lambda = a / L per sequence, or fixed): the decode skip ratio the kernel
# counted, and the generated text vs full attention's (characters until the first difference,
# identical or not). Prefill stays dense here (prefill skipping on the real model:
# bench/run_gpu_blasst_prefill_real.sh).
# Usage on the GPU machine: bash bench/run_gpu_blasst_real.sh SPADE MODEL PROMPT_DIR
set -uo pipefail
OUT=${OUT:-/tmp/out}
SPADE=$1 MODEL=$2 DIR=$3
for f in "$DIR"/*.txt; do
  name=$(basename "$f" .txt)
  for spec in full blasst blasst:a=100 blasst:a=400 blasst:lambda=0.05 blasst:lambda=0.2; do
    method=${spec%%:*}; opt=${spec#*:}; [ "$opt" = "$spec" ] && opt=""
    tag=$(echo "$spec" | tr ':=' '__')
    timeout 120 "$SPADE" generate --device cuda --model "$MODEL" --prompt-file "$f" -n 64 --stats \
      --sparse "$method" ${opt:+--sparse-opt "$opt"} >"$OUT/${name}_$tag.out" 2>"$OUT/${name}_$tag.err"
    echo "== $name $spec rc=$? $(grep -E 'blasst \(GPU\)|generated' "$OUT/${name}_$tag.err" | tr '\n' ' ')"
  done
  python3 - "$OUT" "$name" <<'PY'
import sys, glob, os
out, name = sys.argv[1], sys.argv[2]
ref = open(f"{out}/{name}_full.out").read()
for p in sorted(glob.glob(f"{out}/{name}_*.out")):
    t = open(p).read()
    n = next((i for i, (a, b) in enumerate(zip(ref, t)) if a != b), min(len(ref), len(t)))
    print(f"   {os.path.basename(p):40s} identical={t == ref} chars_until_diff={n}/{len(ref)}")
PY
done

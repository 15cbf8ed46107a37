#!/usr/bin/env bash
# BLASST prefill on real attention: SmolLM2-135M-Instruct on the GPU (head_dim 64: the generic
# mma.sync prefill kernel, skip decisions per warp over 32 packed rows x 64 keys), each prompt
# prefilled in one forward pass (--prefill-chunk 8192), decode exact (decode=0), 32 greedy
# tokens. Per setting: the prefill tiles the kernel counted as skipped, the prefill rate the
# CLI measured (tokens / prefill seconds: every layer, GEMMs included; one process per run, so
# each pays its own warm-up), and the generated text vs full attention's.
# Settings: full; lambda = 1e-30 (the skipping kernel, nothing skipped: its overhead);
# prefill_a = 10 / 100 / 1000 / 5000 (lambda = a / L, L = the prompt length).
# Usage on the GPU machine: bash bench/run_gpu_blasst_prefill_real.sh SPADE MODEL PROMPT_DIR
# -> $OUT/blasst_prefill_real.jsonl (one line per prompt and setting, with the date and $COMMIT).
set -uo pipefail
OUT=${OUT:-/tmp/out}
SPADE=$1 MODEL=$2 DIR=$3
REPS=${REPS:-2}
for f in "$DIR"/*.txt; do
  name=$(basename "$f" .txt)
  for spec in full "blasst:decode=0,prefill=1,lambda=1e-30" blasst:decode=0,prefill=1,prefill_a=10 \
              blasst:decode=0,prefill=1,prefill_a=100 blasst:decode=0,prefill=1,prefill_a=1000 \
              blasst:decode=0,prefill=1,prefill_a=5000; do
    method=${spec%%:*}; opt=${spec#*:}; [ "$opt" = "$spec" ] && opt=""
    tag=$(echo "$spec" | tr ':=,' '___')
    for rep in $(seq 1 "$REPS"); do
      timeout 120 "$SPADE" generate --device cuda --model "$MODEL" --prompt-file "$f" -n 32 --stats \
        --prefill-chunk 8192 --sparse "$method" ${opt:+--sparse-opt "$opt"} \
        >"$OUT/${name}_${tag}.out" 2>"$OUT/${name}_${tag}_$rep.err"
      echo "== $name $spec rep $rep rc=$? $(grep -E 'blasst \(GPU\)|tok/s' "$OUT/${name}_${tag}_$rep.err" | tr '\n' ' ')"
    done
  done
done
python3 - "$OUT" "$REPS" "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" <<'PY'
import datetime, glob, json, os, re, sys
out, reps, commit = sys.argv[1], int(sys.argv[2]), sys.argv[3]
date = datetime.date.today().isoformat()
with open(f"{out}/blasst_prefill_real.jsonl", "w") as fo:
    for ref_path in sorted(glob.glob(f"{out}/*_full.out")):
        name = os.path.basename(ref_path)[:-len("_full.out")]
        ref = open(ref_path).read()
        for p in sorted(glob.glob(f"{out}/{name}_*.out")):
            tag = os.path.basename(p)[len(name) + 1:-4]
            t = open(p).read()
            rates, skipped, prompt = [], None, None
            for r in range(1, reps + 1):
                e = open(p[:-4] + f"_{r}.err").read()
                m = re.search(r"prompt (\d+) tokens, ([0-9.]+) tok/s", e)
                if m:
                    prompt, rate = int(m.group(1)), float(m.group(2))
                    rates.append(rate)
                m = re.search(r"tiles skipped in prefill ([0-9.]+)%", e)
                if m:
                    skipped = float(m.group(1))
            n = next((i for i, (a, b) in enumerate(zip(ref, t)) if a != b), min(len(ref), len(t)))
            row = {"date": date, "commit": commit, "prompt": name, "prompt_tokens": prompt, "setting": tag,
                   "prefill_tiles_skipped_pct": skipped, "prefill_tok_s_runs": rates,
                   "prefill_tok_s_best": max(rates) if rates else None,
                   "identical_to_full": t == ref, "chars_until_first_difference": n,
                   "full_output_chars": len(ref)}
            fo.write(json.dumps(row) + "\n")
            print(row)
PY

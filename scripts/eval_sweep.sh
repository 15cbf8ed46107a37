#!/usr/bin/env bash
# The `spade eval` sweep behind docs/eval.md: tasks, perplexity, agreement and recall of
# every method against full attention on SmolLM2-135M-Instruct, with KJV Genesis-Exodus
# (Debian's bible-kjv-text) as the long real text. Writes docs/results/eval_<kind>.{json,md,png}
# (resumable: rerun to finish an interrupted sweep; delete the JSON to start over).
#
# usage: scripts/eval_sweep.sh [SPADE_BINARY] [MODEL] [KINDS]
#   KINDS: any of "tasks ppl agree recall longgen" (default the first four)
# Environment overrides: METHODS, BUDGETS, LENGTHS, SAMPLES, TASKS, MAX_NEW (cap on answer
#   tokens), AGREE_TASKS, AGREE_LENGTHS, PPL_LENGTHS, PPL_DECODE, RECALL_DECODE,
#   LONGGEN_LENGTHS (generated tokens, default 2048), LONGGEN_SAMPLES (2), LONGGEN_RECALL=1,
#   OUT (default docs/results), THREADS, PREFIX (file name prefix, default eval_),
#   DEVICE (cpu or cuda: `spade eval --device`), TEXT (an existing text file instead of the
#   KJV text made with `bible`, e.g. on a machine without bible-kjv; kept afterwards).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
spade=${1:-$root/build/spade}
model=${2:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
kinds=${3:-tasks ppl agree recall}
# Twilight runs once over the paper's conservative Quest base, budget max(8192, L/4) (section
# 5.1; 8192 up to 32K tokens, so at SmolLM2's 8K context the base is the whole context), not
# at the small budgets (there it could only lose to Quest): its density column is the fraction
# its top-p keeps. budget=8192 rather than auto, so the same spec runs with DEVICE=cuda.
methods=${METHODS:-full;streaming;quest;tidal;lessismore;lycheecluster;twilight:budget=8192;blasst;oracle-topk}
budgets=${BUDGETS:-128,512}
lengths=${LENGTHS:-2048,4096}
samples=${SAMPLES:-2}
tasks=${TASKS:-all}
agree_tasks=${AGREE_TASKS:-niah_single_number,niah_multikey,json_lookup}
out=${OUT:-$root/docs/results}
prefix=${PREFIX:-eval_}

[ -n "${TEXT:-}" ] || command -v bible >/dev/null || { echo "eval_sweep: the 'bible' program (Debian package bible-kjv) is missing; run scripts/install_deps.sh" >&2; exit 1; }
[ -x "$spade" ] || { echo "eval_sweep: $spade not built" >&2; exit 1; }
[ -f "$model" ] || { echo "eval_sweep: $model missing; run scripts/fetch_model.sh" >&2; exit 1; }
# Plots need python3-matplotlib (Debian), installed here rather than in install_deps.sh (CI
# does not need it). Debian's package is for the system python (/usr/bin/python3).
py=""
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null && "$p" -c "import matplotlib" 2>/dev/null; then py=$p; break; fi
done
if [ -z "$py" ]; then
  SUDO=""; [ "$(id -u)" != 0 ] && SUDO=sudo
  if $SUDO apt-get install -y -qq --no-install-recommends python3-matplotlib >/dev/null; then
    py=/usr/bin/python3
  else
    echo "eval_sweep: could not install python3-matplotlib; no plots" >&2
  fi
fi
mkdir -p "$out"
if [ -n "${TEXT:-}" ]; then
  text=$TEXT
else
  text="$out/.${prefix}kjv_gen_exo.txt"
  # Genesis and Exodus, one verse per line, verse references stripped.
  bible -f "Gen1:1-Exo40:38" | sed -E 's/^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ //' > "$text"
fi
common=(--model "$model" --text "$text" --methods "$methods" --budgets "$budgets" ${THREADS:+--threads "$THREADS"}
        ${DEVICE:+--device "$DEVICE"})
for kind in $kinds; do
  start=$(date +%s)
  case $kind in
    tasks)  "$spade" eval tasks "${common[@]}" --lengths "$lengths" --samples "$samples" --tasks "$tasks" ${MAX_NEW:+--max-new "$MAX_NEW"} --out "$out/${prefix}tasks.json" ;;
    agree)  "$spade" eval agree "${common[@]}" --lengths "${AGREE_LENGTHS:-$lengths}" --samples 1 --tasks "$agree_tasks" ${MAX_NEW:+--max-new "$MAX_NEW"} --out "$out/${prefix}agree.json" ;;
    ppl)    "$spade" eval ppl "${common[@]}" --lengths "${PPL_LENGTHS:-$lengths}" --samples "$samples" --decode "${PPL_DECODE:-64}" --out "$out/${prefix}ppl.json" ;;
    longgen) "$spade" eval longgen "${common[@]}" --lengths "${LONGGEN_LENGTHS:-2048}" --samples "${LONGGEN_SAMPLES:-2}" ${LONGGEN_RECALL:+--recall} --out "$out/${prefix}longgen.json" ;;
    recall) "$spade" eval recall "${common[@]}" --lengths "${PPL_LENGTHS:-$lengths}" --samples 1 --decode "${RECALL_DECODE:-16}" --out "$out/${prefix}recall.json" ;;
    *) echo "eval_sweep: unknown kind $kind" >&2; exit 1 ;;
  esac
  echo "== eval $kind took $(( $(date +%s) - start )) s" >&2
  if [ -n "$py" ]; then "$py" "$root/scripts/eval_plot.py" "$out/${prefix}$kind.json"; fi
done
[ -n "${TEXT:-}" ] || rm -f "$text"

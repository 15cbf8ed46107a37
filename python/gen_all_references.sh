#!/usr/bin/env bash
# Regenerates the transformers reference fixtures (tests/fixtures/models/tiny-*,
# stories260k-hf/tokenizer.json, tests/fixtures/reference/*) on a machine with torch +
# transformers (the device machine; see docs/fixtures.md for the exact calls).
#
#   python/gen_all_references.sh PART...
#     small    tiny random models + their references, stories260k tokenizer.json + reference
#     smollm2  SmolLM2-135M-Instruct GGUF references (needs the GGUF at $GGUF)
# Env: OUT (where fixtures_<part>.tar and logs go, default /tmp/out), GGUF (path of
# SmolLM2-135M-Instruct.Q4_1.gguf, default models/...), WHL (wheel dir for the gguf package,
# default .whl, installed into /tmp/site if `import gguf` fails).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
GGUF=${GGUF:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
WHL=${WHL:-.whl}
mkdir -p "$OUT"
rc=0
python3 -c 'import sys, torch, transformers, safetensors, tokenizers, numpy; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "safetensors", safetensors.__version__, "numpy", numpy.__version__)'
for part in "$@"; do
  case "$part" in
    small)
      python3 python/make_tiny_models.py || rc=1
      python3 python/make_reference_logits.py --cases tiny,stories_tok,stories || rc=1
      tar cf "$OUT/fixtures_small.tar" -C tests/fixtures models/tiny-qwen3 models/tiny-qwen2 \
        models/tiny-llama3-rope models/stories260k-hf/tokenizer.json \
        models/stories260k-hf/tokenizer_config.json \
        $(cd tests/fixtures && ls reference/tiny_* reference/stories260k_*) || rc=1
      ;;
    smollm2)
      if ! python3 -c 'import gguf' 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site "$WHL"/gguf-*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      fi
      python3 -c 'import gguf, accelerate; print("gguf", gguf.__file__, "accelerate", accelerate.__version__)' || rc=1
      python3 python/make_reference_logits.py --cases smollm2 --gguf "$GGUF" || rc=1
      tar cf "$OUT/fixtures_smollm2.tar" -C tests/fixtures \
        $(cd tests/fixtures && ls reference/smollm2_*) || rc=1
      ;;
    *) echo "unknown part $part" >&2; rc=2 ;;
  esac
done
exit $rc

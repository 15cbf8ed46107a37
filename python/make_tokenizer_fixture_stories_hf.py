"""Reference ids of the stories260k tokenizer.json (tests/fixtures/models/stories260k-hf:
a 512-token SentencePiece-style BPE whose normalizer uses Replace with regex patterns) for
the committed parity corpus, from the PyPI `tokenizers` package.

Reads tests/fixtures/tokenizer/parity/corpus.bin (written by make_tokenizer_fixtures.py),
writes parity/stories260k-hf.ids and adds "stories260k-hf" to parity/special.json.
Needs: pip install tokenizers (0.23.3 was used). Run from the repository root:
  python3 python/make_tokenizer_fixture_stories_hf.py
"""
import json
import os
import sys

from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(__file__))
from make_tokenizer_fixtures import OUT, ROOT, WITH_BOS, as_text, varint  # noqa: E402


def read_varint(b, i):
    n = shift = 0
    while True:
        x = b[i]
        i += 1
        n |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return n, i


def main():
    data = open(os.path.join(OUT, "corpus.bin"), "rb").read()
    recs, i = [], 0
    while i < len(data):
        n, i = read_varint(data, i)
        recs.append(data[i:i + n])
        i += n
    tok = Tokenizer.from_file(os.path.join(ROOT, "tests/fixtures/models/stories260k-hf/tokenizer.json"))
    total = 0
    with open(os.path.join(OUT, "stories260k-hf.ids"), "wb") as f:
        for r in recs:
            ids = tok.encode(as_text(r), add_special_tokens=False).ids
            f.write(varint(len(ids)) + b"".join(varint(x) for x in ids))
            total += len(ids)
    sp_path = os.path.join(OUT, "special.json")
    special = json.load(open(sp_path, encoding="utf-8"))
    texts = ["<s>Once upon a time</s>", "  two  spaces  ", "a<s>b", "   "]
    special["stories260k-hf"] = {
        "parse_special": [{"text": s, "ids": tok.encode(s, add_special_tokens=False).ids} for s in texts],
        "add_special": [{"text": s, "ids": tok.encode(s, add_special_tokens=True).ids} for s in WITH_BOS],
    }
    with open(sp_path, "w", encoding="utf-8") as f:
        json.dump(special, f, ensure_ascii=False, indent=1)
    print(f"stories260k-hf: {len(recs)} records, {total} tokens", file=sys.stderr)


if __name__ == "__main__":
    main()

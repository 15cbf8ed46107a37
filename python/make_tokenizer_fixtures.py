#!/usr/bin/env python3
"""Writes the tokenizer parity fixtures under tests/fixtures/tokenizer/parity/:

  corpus.bin        ~250 KB of varied text as records (varint length + bytes): English
                    prose, code, JSON, CJK, emoji, whitespace runs, long numbers, combining
                    marks, random code points, and byte strings that are not valid UTF-8
  <model>.ids       the reference ids of every record (varint count + varint ids)
  special.json      strings with special tokens, and BOS/EOS cases, per model

The references come from the PyPI `tokenizers` package (Hugging Face), except stories260k,
whose reference is the PyPI `sentencepiece` library itself. Records that are not valid
UTF-8 are given to the reference as text decoded with errors="replace" (the way spade reads
them). The tokenizers:

  gpt2       ../shared/fixtures/tokenizers/gpt2/{encoder.json,vocab.bpe} as GPT-2's BPE with
             the ByteLevel pre-tokenizer/decoder (what GPT-2's tokenizer.json holds)
  llama3     ../shared/fixtures/tokenizers/llama3/tokenizer.json
  qwen3      ../shared/fixtures/tokenizers/qwen3/tokenizer.json
  llama-spm  ggml-vocab-llama-spm.gguf rebuilt in the layout of Llama-2's tokenizer.json
             (Prepend/Replace normalizer, BPE with byte fallback, merges from the scores by
             transformers' generate_merges); checked here against the file's .inp/.out (ids
             from the original HF tokenizer). transformers 5's own GGUF builder differs
             from the original (" " -> 29871, not 259), so it is not used.
  smollm2    models/SmolLM2-135M-Instruct.Q4_1.gguf vocabulary and merges with SmolLM2's
             pre-tokenizer, Sequence[Digits(individual_digits=True), ByteLevel(
             add_prefix_space=False)] (llama.cpp's "smollm" pre-type; the merges have no
             digit-digit pair, as individual digits imply), control tokens as special
  stories260k  ../shared/fixtures/models/stories260k/tokenizer.model through sentencepiece

Needs (on the machine that regenerates, not in CI): pip install tokenizers transformers
sentencepiece protobuf gguf numpy. Run from the repository root:
  python3 python/make_tokenizer_fixtures.py
"""
import json
import os
import random
import sys
import unicodedata

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SHARED = os.path.join(ROOT, "..", "shared", "fixtures")
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "parity")
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# ---------------------------------------------------------------- corpus
def corpus():
    rng = random.Random(20240611)
    recs = []

    def chunks(text, lo, hi):
        i = 0
        while i < len(text):
            n = rng.randint(lo, hi)
            recs.append(text[i:i + n].encode("utf-8"))
            i += n

    # English prose: license texts Debian ships (plain English).
    for name in ("GPL-3", "Apache-2.0", "LGPL-2.1", "MPL-2.0"):
        with open(f"/usr/share/common-licenses/{name}", encoding="utf-8") as f:
            chunks(f.read(), 400, 3000)
    # Code: Python standard library sources (of the Python that generated the fixtures).
    import argparse, json.decoder, json.encoder, textwrap
    for mod, limit in ((json.decoder, 20000), (json.encoder, 20000), (textwrap, 20000), (argparse, 40000)):
        with open(mod.__file__, encoding="utf-8") as f:
            chunks(f.read()[:limit], 300, 2500)
    # C-like code with tabs and CRLF.
    c_code = ("#include <stdio.h>\r\nint main(int argc, char** argv) {\r\n\tfor (int i = 0; i < argc; ++i)"
              " {\r\n\t\tprintf(\"%d: %s\\n\", i, argv[i]);\r\n\t}\r\n\treturn 0;\r\n}\r\n") * 8
    chunks(c_code, 200, 800)
    # JSON.
    data = [{"id": i, "name": f"item-{i}", "price": round(rng.uniform(0, 1000), 2),
             "tags": rng.sample(["red", "green", "blue", "xl", "sale", "新品", "🔥"], 3),
             "nested": {"a": [1, 2, {"b": None, "c": True}], "ratio": rng.random()}}
            for i in range(60)]
    chunks(json.dumps(data, indent=2, ensure_ascii=False), 500, 2500)
    chunks(json.dumps(data, separators=(",", ":")), 500, 2500)
    # CJK and other scripts (hand-written sentences and random runs).
    sentences = [
        "我想在apple工作1314151天～", "今天天气很好，我们去公园散步吧。", "人工智能正在改变世界。",
        "東京は日本の首都です。ひらがなとカタカナ、そして漢字。", "お疲れ様でした！ラーメンを食べに行こう。",
        "안녕하세요, 만나서 반갑습니다. 한국어 텍스트입니다.", "नमस्ते दुनिया, यह हिंदी पाठ है।",
        "Привет, мир! Это текст на русском языке.", "Γειά σου Κόσμε", "مرحبا بالعالم، هذا نص عربي.",
        "שלום עולם", "ภาษาไทยเป็นภาษาที่สวยงาม", "Tiếng Việt có dấu: Trường Đại học Bách khoa",
        "Äpfel, Öl, Übermut, Straße — naïve café résumé", "ﬁne ﬂow ſtate Ⅻ ① ½ ² ₃",
    ]
    for _ in range(60):
        recs.append(" ".join(rng.choice(sentences) for _ in range(rng.randint(1, 6))).encode())
    ranges = [(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x0400, 0x04FF),
              (0x0900, 0x097F), (0x0E00, 0x0E7F), (0x0600, 0x06FF), (0x20000, 0x2A6DF)]
    for _ in range(40):
        lo, hi = rng.choice(ranges)
        s = "".join(chr(rng.randint(lo, hi)) if rng.random() > 0.1 else rng.choice(" ,.!?\n0123")
                    for _ in range(rng.randint(20, 300)))
        recs.append(s.encode("utf-8", "surrogatepass"))
    # Emoji: ZWJ sequences, skin tones, flags, keycaps, variation selectors.
    emoji = ["🚀", "😶‍🌫️", "✅", "🦙", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🇯🇵", "1️⃣", "❤️", "🏳️‍🌈", "🤖", "🫠"]
    for _ in range(30):
        recs.append("".join(rng.choice(emoji + [" ", "a", "!", "\n"]) for _ in range(rng.randint(5, 80))).encode())
    # Whitespace runs.
    ws = [" ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\t\t", "\u00a0", "\u3000", "\u2028",
          "\u0085", "\u2003", "\x0b", "\x0c"]
    for _ in range(40):
        recs.append("".join(rng.choice(ws + ["word", "x", "(", "'s", "1"]) for _ in range(rng.randint(5, 120))).encode())
    # Long numbers and digit scripts.
    for _ in range(30):
        parts = []
        for _ in range(rng.randint(3, 20)):
            k = rng.random()
            if k < 0.4:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 40))))
            elif k < 0.6:
                parts.append(f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 12)}f}")
            elif k < 0.7:
                parts.append("".join(chr(0x0660 + rng.randint(0, 9)) for _ in range(rng.randint(1, 12))))
            elif k < 0.8:
                parts.append("".join(chr(0xFF10 + rng.randint(0, 9)) for _ in range(rng.randint(1, 12))))
            else:
                parts.append(rng.choice(["1,234,567.89", "3.14159e-10", "0x7fffffff", "10^100", "²³¹¼",
                                         "2024-06-11T12:34:56Z", "+1 (555) 123-4567"]))
        recs.append(rng.choice([" ", "", "\n", ", "]).join(parts).encode())
    # Contractions and apostrophes in every case.
    for _ in range(20):
        words = ["I'm", "you're", "it's", "we've", "they'll", "he'd", "DON'T", "IT'S", "We'Ve", "'sup",
                 "o'clock", "rock'n'roll", "'ſ", "'S", "'LL", "''", "'", "can't", "Y'all"]
        recs.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))).encode())
    # Combining marks (NFC matters for Qwen): decomposed forms, reordering, Hangul jamo.
    for _ in range(25):
        base = rng.choice(["e\u0301", "a\u030a", "A\u030a\u0323", "o\u0308\u0304", "\u1100\u1161\u11a8",
                           "n\u0303", "c\u0327", "\u0915\u093c", "u\u031b\u0303", "\u212b", "\u2126",
                           "q\u0307\u0323", "\u00e9", "x\u0335\u0336"])
        recs.append(("".join(rng.choice([base, " ", "text", "é"]) for _ in range(rng.randint(3, 40)))).encode())
    # Random code points from everywhere (assigned, non-surrogate).
    for _ in range(40):
        s = []
        while len(s) < rng.randint(10, 200):
            cp = rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF), rng.randint(0x3000, 0xFFFD),
                             rng.randint(0x10000, 0x1FFFF), rng.randint(0x0, 0x1F)])
            if 0xD800 <= cp < 0xE000 or unicodedata.category(chr(cp)) == "Cn":
                continue
            s.append(chr(cp))
        recs.append("".join(s).encode())
    # Invalid UTF-8: stray continuation bytes, truncated sequences, overlongs, surrogates.
    bad = [b"\x80", b"\xbf", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
           b"\xff", b"\xfe", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc3", b"\xf8\x88\x80\x80\x80"]
    for _ in range(30):
        r = b"".join(rng.choice(bad + [b"abc", b" ", "é".encode(), "漢字".encode(), b"\n", b"12"])
                     for _ in range(rng.randint(3, 40)))
        recs.append(r)
    # Long runs (exercise the O(n log n) merge path).
    recs.append(b" " * 3000)
    recs.append(b"a" * 2000)
    recs.append(("ab" * 700).encode())
    recs.append(("漢" * 800).encode())
    recs.append(("9" * 1500).encode())
    recs.append(b"\n" * 500 + b"x")
    recs = [r for r in recs if r]
    return recs


def as_text(rec):
    return rec.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- reference tokenizers
def hf_gpt2():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    with open(os.path.join(SHARED, "tokenizers/gpt2/encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(SHARED, "tokenizers/gpt2/vocab.bpe"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(l.split(" ")) for l in lines[1:] if l]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", normalized=False, special=True)])
    return tok


def hf_json(name):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(SHARED, "tokenizers", name, "tokenizer.json"))


def gguf_fields(path, keys):
    from gguf import GGUFReader
    r = GGUFReader(path)
    out = {}
    for k in keys:
        f = r.fields.get(k)
        if f is None:
            continue
        if f.types and f.types[0].name == "ARRAY":
            out[k] = [f.contents(i) for i in range(len(f.data))]
        else:
            out[k] = f.contents()
    return out


def hf_llama_spm():
    # The Llama-2 tokenizer.json layout (legacy LlamaTokenizerFast): Prepend + Replace
    # normalizer, no pre-tokenizer, BPE with byte fallback, merges generated from the
    # scores by transformers' own `generate_merges`.
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers.tokenization_utils_base import generate_merges
    path = os.path.join(SHARED, "tokenizers/gguf-vocab/ggml-vocab-llama-spm.gguf")
    g = gguf_fields(path, ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"])
    toks, scores = g["tokenizer.ggml.tokens"], g["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(toks)}
    merges = generate_merges(vocab, dict(zip(toks, scores)))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    # Check the reconstruction against the ids llama.cpp recorded from the original tokenizer.
    text = open(path + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")[:-1]
    want = open(path + ".out", encoding="utf-8").read().split("\n")
    for s, w in zip(text, want):
        got = tok.encode(s, add_special_tokens=False).ids
        assert got == [int(x) for x in w.split()], (s, got, w)
    return tok


def hf_smollm2():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    g = gguf_fields(SMOLLM2, ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"])
    toks = g["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(toks)}
    merges = [tuple(m.split(" ", 1)) for m in g["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(toks, g["tokenizer.ggml.token_type"]) if ty == 3])
    return tok


class SpmRef:
    def __init__(self):
        import sentencepiece as spm
        self.sp = spm.SentencePieceProcessor(
            model_file=os.path.join(SHARED, "models/stories260k/tokenizer.model"))

    def encode(self, text, add_special_tokens=False):
        ids = self.sp.encode(text)
        return type("E", (), {"ids": ([1] if add_special_tokens else []) + ids})()


# Strings with special tokens (parsed), and add_special cases, per model.
SPECIAL = {
    "llama3": ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
               "text <|eot_id|> more<|reserved_special_token_3|>x", "<|eot_id"],
    "qwen3": ["<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHi",
              "<tool_call>{\"a\": 1}</tool_call><|endoftext|>", "<|im_start"],
    "llama-spm": ["<s>Hello</s> world", "a<s>b", " <s> spaced </s> "],
    "smollm2": ["<|im_start|>system\nYou are SmolLM<|im_end|>\n<|im_start|>user\n123 456<|im_end|>",
                "<|endoftext|>x<repo_name>y"],
    "gpt2": ["Hello<|endoftext|>world"],
}
WITH_BOS = ["Hello world", " leading space", "", "123"]


def write_model(name, tok, recs, special_cases):
    path = os.path.join(OUT, f"{name}.ids")
    n = 0
    with open(path, "wb") as f:
        for r in recs:
            ids = tok.encode(as_text(r), add_special_tokens=False).ids
            f.write(varint(len(ids)) + b"".join(varint(i) for i in ids))
            n += len(ids)
    sp = [{"text": s, "ids": tok.encode(s, add_special_tokens=False).ids} for s in SPECIAL.get(name, [])]
    bos = [{"text": s, "ids": tok.encode(s, add_special_tokens=True).ids} for s in WITH_BOS]
    special_cases[name] = {"parse_special": sp, "add_special": bos}
    print(f"{name}: {n} tokens", file=sys.stderr)


def main():
    os.makedirs(OUT, exist_ok=True)
    recs = corpus()
    with open(os.path.join(OUT, "corpus.bin"), "wb") as f:
        for r in recs:
            f.write(varint(len(r)) + r)
    print(f"corpus: {len(recs)} records, {sum(map(len, recs))} bytes", file=sys.stderr)
    special = {}
    write_model("gpt2", hf_gpt2(), recs, special)
    write_model("llama3", hf_json("llama3"), recs, special)
    write_model("qwen3", hf_json("qwen3"), recs, special)
    write_model("llama-spm", hf_llama_spm(), recs, special)
    if os.path.exists(SMOLLM2):
        write_model("smollm2", hf_smollm2(), recs, special)
    else:
        print("smollm2: skipped (run scripts/fetch_model.sh first)", file=sys.stderr)
    write_model("stories260k", SpmRef(), recs, special)
    with open(os.path.join(OUT, "special.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()

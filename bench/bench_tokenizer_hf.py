#!/usr/bin/env python3
"""Hugging Face `tokenizers` throughput on the same text and chunking as
bench/bench_tokenizer.cpp, single-threaded (RAYON_NUM_THREADS=1, one encode call per
document, so no batch parallelism). Prints one JSON line like the C++ benchmark.

  bench_tokenizer_hf.py KIND PATH TEXT_FILE [CHUNK=4096] [REPEATS=3]
  KIND: json (a directory with tokenizer.json) | gpt2 (encoder.json + vocab.bpe directory)
        | llama-spm | smollm2 (rebuilt from the GGUF as python/make_tokenizer_fixtures.py does)
"""
import json
import os
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"


def load(kind, path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    if kind == "json":
        return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    if kind in ("llama-spm", "smollm2"):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
        import make_tokenizer_fixtures as fx
        return fx.hf_llama_spm() if kind == "llama-spm" else fx.hf_smollm2()
    with open(os.path.join(path, "encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(path, "vocab.bpe"), encoding="utf-8") as f:
        merges = [tuple(l.split(" ")) for l in f.read().split("\n")[1:] if l]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", normalized=False, special=True)])
    return tok


def main():
    kind, path, text_file = sys.argv[1:4]
    chunk = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    t0 = time.perf_counter()
    tok = load(kind, path)
    load_s = time.perf_counter() - t0
    data = open(text_file, "rb").read()
    docs, pos = [], 0
    while pos < len(data):
        end = min(len(data), pos + chunk)
        nl = data.find(b"\n", end)
        end = len(data) if nl < 0 else nl + 1
        docs.append(data[pos:end].decode("utf-8", errors="replace"))
        pos = end
    best, tokens, checksum = 1e30, 0, 0
    for _ in range(repeats):
        s = time.perf_counter()
        encs = [tok.encode(d, add_special_tokens=False) for d in docs]
        best = min(best, time.perf_counter() - s)
    tokens = sum(len(e.ids) for e in encs)
    m = (1 << 64) - 1
    for e in encs:
        for i in e.ids:
            checksum = (checksum * 1000003 + i) & m
    # encode_batch on one thread, for reference (no Python loop per document).
    bbest = 1e30
    for _ in range(repeats):
        s = time.perf_counter()
        tok.encode_batch(docs, add_special_tokens=False)
        bbest = min(bbest, time.perf_counter() - s)
    print(json.dumps({"impl": "hf-tokenizers", "version": __import__("tokenizers").__version__,
                      "tokenizer": path, "bytes": len(data), "docs": len(docs), "tokens": tokens,
                      "seconds": round(best, 4), "tokens_per_s": round(tokens / best),
                      "mb_per_s": round(len(data) / best / 1e6, 2),
                      "batch1_seconds": round(bbest, 4), "batch1_tokens_per_s": round(tokens / bbest),
                      "load_seconds": round(load_s, 3), "checksum": f"{checksum:016x}"}))


if __name__ == "__main__":
    main()

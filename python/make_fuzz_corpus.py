#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora: fuzz/corpus/gguf/ and fuzz/corpus/safetensors/.

A few valid tiny files (each < 4 KB) and a few broken ones, built with the standard
library only. Rerun after changing the formats' readers if new paths need seeds:

    python3 python/make_fuzz_corpus.py
"""
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_kv(key, vtype, payload):
    return gguf_str(key) + struct.pack("<I", vtype) + payload


def gguf(kvs, tensors, version=3, alignment=32):
    """tensors: (name, ne list, ggml type, data bytes)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
    offsets, off = [], 0
    for _, _, _, data in tensors:
        offsets.append(off)
        off = (off + len(data) + alignment - 1) // alignment * alignment
    for (name, ne, t, _), o in zip(tensors, offsets):
        out += gguf_str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", t, o)
    if tensors:
        out += b"\0" * (-len(out) % alignment)
        start = len(out)
        for (_, _, _, data), o in zip(tensors, offsets):
            out += b"\0" * (start + o - len(out)) + data
    return out


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


def llama_kvs(arch="llama"):
    u32 = lambda k, v: gguf_kv(k, 4, struct.pack("<I", v))
    return [
        gguf_kv("general.architecture", 8, gguf_str(arch)),
        u32(arch + ".block_count", 1),
        u32(arch + ".embedding_length", 32),
        u32(arch + ".attention.head_count", 2),
        u32(arch + ".attention.head_count_kv", 1),
        u32(arch + ".feed_forward_length", 64),
        u32(arch + ".context_length", 128),
        gguf_kv(arch + ".rope.freq_base", 6, struct.pack("<f", 10000.0)),
        gguf_kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + gguf_str("a") + gguf_str("b") + gguf_str("c")),
        gguf_kv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + f32(0.0, -1.0, -2.0)),
        u32("tokenizer.ggml.bos_token_id", 1),
    ]


def q8_0_block(d_bits=0x3C00):
    return struct.pack("<H", d_bits) + bytes((i * 7) & 0xFF for i in range(32))


def write(dirname, name, data):
    d = os.path.join(ROOT, "fuzz", "corpus", dirname)
    os.makedirs(d, exist_ok=True)
    assert len(data) < 4096, (name, len(data))
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def main():
    good = gguf(llama_kvs(), [
        ("token_embd.weight", [32, 3], 8, q8_0_block() * 3),
        ("output_norm.weight", [32], 0, f32(*[1.0] * 32)),
        ("blk.0.attn_q.weight", [32, 2], 2, (struct.pack("<H", 0x3800) + bytes(range(16))) * 2),
        ("rope_freqs.weight", [8], 0, f32(*[1.0] * 8)),
    ])
    write("gguf", "valid_llama_v3.gguf", good)
    write("gguf", "valid_qwen3_v2.gguf", gguf(llama_kvs("qwen3"), [
        ("a", [4, 2], 1, struct.pack("<8H", *range(0x3C00, 0x3C08))),
        ("b", [256], 12, bytes(range(144))),
        ("c", [256], 14, bytes(210)),
        ("d", [256], 13, bytes(176)),
        ("e", [4], 30, struct.pack("<4H", 0x3F80, 0x4000, 0xC000, 0x7F80)),
        ("f", [32], 3, bytes(20)),
    ], version=2))
    write("gguf", "valid_align64.gguf", gguf(
        [gguf_kv("general.alignment", 4, struct.pack("<I", 64))],
        [("x", [3], 0, f32(1, 2, 3)), ("y", [32], 6, bytes(22))], alignment=64))
    write("gguf", "vocab_only.gguf", gguf(llama_kvs()[8:], []))
    write("gguf", "broken_truncated.gguf", good[: len(good) // 2])
    write("gguf", "broken_magic.gguf", b"GGUX" + good[4:])
    write("gguf", "broken_string_len.gguf", good[:24] + struct.pack("<Q", 1 << 62) + good[32:])
    write("gguf", "broken_nested_array.gguf", gguf(
        [gguf_kv("n", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7))], []))

    def st(entries, meta=None, pad=True):
        header, data = {}, b""
        if meta:
            header["__metadata__"] = meta
        for name, dtype, shape, raw in entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
            data += raw
        h = json.dumps(header).encode()
        if pad:
            h += b" " * (-len(h) % 8)
        return struct.pack("<Q", len(h)) + h + data

    good_st = st([("w", "F32", [2, 2], f32(1, 2, 3, 4)),
                  ("h", "F16", [3], struct.pack("<3H", 0x3C00, 0x0001, 0x7C00)),
                  ("b", "BF16", [2], struct.pack("<2H", 0x3F80, 0xFF80)),
                  ("i", "I64", [1], struct.pack("<q", 5)),
                  ("s", "F32", [], f32(9))], meta={"format": "pt"})
    write("safetensors", "valid.safetensors", good_st)
    write("safetensors", "valid_empty.safetensors", st([]))
    write("safetensors", "valid_zero_dim.safetensors", st([("z", "F32", [0, 4], b""), ("y", "I8", [3], b"abc")]))
    write("safetensors", "broken_header_len.safetensors", struct.pack("<Q", 1 << 40) + good_st[8:])
    write("safetensors", "broken_json.safetensors", good_st[:40] + b"\x00" + good_st[41:])
    overlap = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    write("safetensors", "broken_overlap.safetensors",
          struct.pack("<Q", len(overlap)) + overlap + bytes(12))
    write("safetensors", "broken_size.safetensors", st([("w", "F32", [3], f32(1, 2))]))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Convert the stories260K TinyStories model (Karpathy's llama2.c) into a Hugging Face
LlamaForCausalLM directory (config.json + model.safetensors fp32 + tokenizer.model), and
optionally into a clean llama2.c checkpoint + tokenizer.bin.

Uses only numpy + safetensors (+ sentencepiece and protobuf to write tokenizer.model).

Inputs (shared/fixtures/models/stories260k/):
  * stories260K.bin -- llama2.c "legacy" layout: 7 x int32 header (dim, hidden_dim, n_layers,
    n_heads, n_kv_heads, vocab_size [<0: untied classifier follows], seq_len), then fp32
    token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final,
    [freq_cis_real, freq_cis_imag: present or not, decided from the file size], [wcls].
    Matrices are nn.Linear weights [out, in]; RoPE rotates adjacent pairs (2i, 2i+1).
  * tinystories_260k_v1.bin -- the same model in clebert/llama2.ts's "v1" layout: u8 version
    (1), i32 length + architecture name ("llama"), 7 x int32 (hidden, intermediate, max seq
    len, vocab, layers, query heads, kv heads), u8 shared-output flag, zero padding to byte
    256; then per vocab entry f32 score, i32 length, utf-8 bytes; then fp32 embedding,
    attention norms, wq, wk, wv, wo (llama2.c row order, [out, in]), ffn norms, gate (w1),
    up (w3), down (w2), final norm, [output].

FINDING (checked here): the stories260K.bin in shared/fixtures does NOT work with llama2.c
semantics: its rms/embedding tensors are right, but its matrices are scrambled (per layer,
wq/wo are stored transposed, wk/wv as w.reshape(256, 8).T, and w1/w2/w3 in yet another
order; each tensor holds exactly the same values as the llama2.ts file, layer by layer).
Run as llama2.c would, it gives mean next-token loss 12.7 nats on a TinyStories sentence and
greedy text "RR lo lo lo...", while tinystories_260k_v1.bin gives 0.31 nats and the expected
"Once upon a time, there was a little girl named Lily. She loved to play outside in the
park...". Also, the tokenizer.model / tokenizer.bin next to it are the 32,000-piece Llama 2
tokenizer, not the model's 512-piece vocabulary (tok512), which is embedded in the llama2.ts
file. So the default source here is tinystories_260k_v1.bin; stories260K.bin is only
compared against it (--check).

RoPE: llama2.c rotates adjacent pairs; HF Llama rotates halves. As in transformers'
convert_llama_weights_to_hf.py, wq / wk rows are permuted per head:
view(n_heads, hs/2, 2, dim).transpose(1, 2).reshape (wk with n_kv_heads).

Tokenizer: a SentencePiece tokenizer.model is rebuilt from the 512 (piece, score) pairs, with
the model-level settings of the Llama 2 tokenizer.model (BPE, byte_fallback, identity
normalization, add_dummy_prefix, whitespace-only pieces allowed), except
remove_extra_whitespaces, left at sentencepiece's default (true) as llama2.c's train_vocab
(tinystories.py) set only normalization_rule_name=identity.

Usage:
  python3 python/convert_llama2c_to_hf.py                 # defaults below
  python3 python/convert_llama2c_to_hf.py --src X.bin --format llama2c --out DIR
Defaults: --src shared/.../tinystories_260k_v1.bin (--format auto), --check
shared/.../stories260K.bin, --out tests/fixtures/models/stories260k-hf,
--llama2c-out tests/fixtures/models/stories260k-llama2c (clean stories260K.bin + tok512.bin).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared", "fixtures", "models", "stories260k"))
DEFAULT_SRC = os.path.join(SHARED, "tinystories_260k_v1.bin")
DEFAULT_CHECK = os.path.join(SHARED, "stories260K.bin")
DEFAULT_TEMPLATE = os.path.join(SHARED, "tokenizer.model")
DEFAULT_OUT = os.path.join(ROOT, "tests", "fixtures", "models", "stories260k-hf")
DEFAULT_L2C_OUT = os.path.join(ROOT, "tests", "fixtures", "models", "stories260k-llama2c")

ORDER = ["tok", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final"]


def permute_rope(w, n_heads, dim_in):
    """llama2.c (interleaved pairs) -> HF (rotate halves) row permutation."""
    rows = w.shape[0]
    hs = rows // n_heads
    return (w.reshape(n_heads, hs // 2, 2, dim_in)
             .transpose(0, 2, 1, 3)
             .reshape(rows, dim_in))


def _shapes(h):
    dim, hid, L, nh, nkv, V = h["dim"], h["hidden_dim"], h["n_layers"], h["n_heads"], h["n_kv_heads"], h["vocab_size"]
    hs = dim // nh
    return {"tok": (V, dim), "rms_att": (L, dim), "wq": (L, nh * hs, dim), "wk": (L, nkv * hs, dim),
            "wv": (L, nkv * hs, dim), "wo": (L, dim, nh * hs), "rms_ffn": (L, dim), "w1": (L, hid, dim),
            "w2": (L, dim, hid), "w3": (L, hid, dim), "rms_final": (dim,), "wcls": (V, dim)}


def read_llama2c(path):
    data = open(path, "rb").read()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", data[:28])
    hdr = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
               vocab_size=abs(vocab), seq_len=seq_len, shared_classifier=vocab > 0)
    shp = _shapes(hdr)
    f = np.frombuffer(data, dtype="<f4", offset=28)
    n_core = sum(int(np.prod(shp[k])) for k in ORDER)
    n_freq = seq_len * (dim // n_heads)  # real + imag, each seq_len * hs/2
    n_cls = 0 if hdr["shared_classifier"] else int(np.prod(shp["wcls"]))
    if f.size == n_core + n_cls:
        hdr["has_freq_cis"] = False
    elif f.size == n_core + n_freq + n_cls:
        hdr["has_freq_cis"] = True
    else:
        raise SystemExit(f"{path}: unexpected size: {f.size} floats, expected {n_core + n_cls} "
                         f"or {n_core + n_freq + n_cls}")
    t, pos = {}, 0
    for k in ORDER:
        n = int(np.prod(shp[k]))
        t[k] = f[pos:pos + n].reshape(shp[k]).copy()
        pos += n
        if k == "rms_final" and hdr["has_freq_cis"]:
            pos += n_freq
    if not hdr["shared_classifier"]:
        t["wcls"] = f[pos:pos + n_cls].reshape(shp["wcls"]).copy()
        pos += n_cls
    assert pos == f.size
    return hdr, t, None


def read_llama2ts(path):
    data = open(path, "rb").read()
    version = data[0]
    if version != 1:
        raise SystemExit(f"{path}: llama2.ts version {version}, expected 1")
    n = struct.unpack_from("<i", data, 1)[0]
    arch = data[5:5 + n].decode()
    off = 5 + n
    hidden, inter, max_seq, vocab, L, nh, nkv = struct.unpack_from("<7i", data, off)
    shared = bool(data[off + 28])
    hdr = dict(dim=hidden, hidden_dim=inter, n_layers=L, n_heads=nh, n_kv_heads=nkv, vocab_size=vocab,
               seq_len=max_seq, shared_classifier=shared, has_freq_cis=False, arch=arch)
    off = 256
    pieces = []
    for _ in range(vocab):
        score, ln = struct.unpack_from("<fi", data, off)
        pieces.append((data[off + 8:off + 8 + ln].decode("utf-8"), score))
        off += 8 + ln
    shp = _shapes(hdr)
    f = np.frombuffer(data, dtype="<f4", offset=off)
    t, pos = {}, 0
    for k in ["tok", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w3", "w2", "rms_final"] + \
            ([] if shared else ["wcls"]):
        n = int(np.prod(shp[k]))
        t[k] = f[pos:pos + n].reshape(shp[k]).copy()
        pos += n
    if pos != f.size:
        raise SystemExit(f"{path}: {f.size - pos} trailing floats")
    return hdr, t, pieces


def read_any(path, fmt="auto"):
    if fmt == "auto":
        with open(path, "rb") as fh:
            head = fh.read(16)
        fmt = "llama2ts" if head[0] == 1 and head[5:10] == b"llama" else "llama2c"
    return (read_llama2ts if fmt == "llama2ts" else read_llama2c)(path) + (fmt,)


def compare(ta, tb):
    """Per tensor: 'identical', 'same values, other order', or 'different'."""
    res = {}
    for k in ta:
        a, b = ta[k], tb.get(k)
        if b is None or a.size != b.size:
            res[k] = "missing/different size"
        elif np.array_equal(a.ravel(), b.ravel()):
            res[k] = "identical"
        elif np.array_equal(np.sort(a.ravel()), np.sort(b.ravel())):
            res[k] = "same values, other order"
        else:
            res[k] = "different"
    return res


def llama2c_forward_loss(hdr, t, ids):
    """Mean next-token loss (nats) of ids under llama2.c semantics (float64 numpy)."""
    dim, nh, nkv, L = hdr["dim"], hdr["n_heads"], hdr["n_kv_heads"], hdr["n_layers"]
    hs = dim // nh
    T = len(ids)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w

    def rope(x, n):
        x = x.reshape(T, n, hs).copy()
        a = np.arange(T)[:, None] * (1.0 / 10000 ** (np.arange(0, hs, 2) / hs))
        c, s = np.cos(a)[:, None, :], np.sin(a)[:, None, :]
        x0, x1 = x[..., 0::2].copy(), x[..., 1::2].copy()
        x[..., 0::2], x[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
        return x.reshape(T, n * hs)

    x = t["tok"][ids].astype(np.float64)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(L):
        xb = rms(x, t["rms_att"][l])
        q, k, v = rope(xb @ t["wq"][l].T, nh), rope(xb @ t["wk"][l].T, nkv), xb @ t["wv"][l].T
        out = np.zeros((T, nh * hs))
        for h in range(nh):
            kh = h // (nh // nkv)
            sc = q[:, h * hs:(h + 1) * hs] @ k[:, kh * hs:(kh + 1) * hs].T / np.sqrt(hs) + mask
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            sc /= sc.sum(-1, keepdims=True)
            out[:, h * hs:(h + 1) * hs] = sc @ v[:, kh * hs:(kh + 1) * hs]
        x = x + out @ t["wo"][l].T
        xb = rms(x, t["rms_ffn"][l])
        h1, h3 = xb @ t["w1"][l].T, xb @ t["w3"][l].T
        x = x + (h1 / (1 + np.exp(-h1)) * h3) @ t["w2"][l].T
    lg = rms(x, t["rms_final"]) @ t.get("wcls", t["tok"]).T
    lp = lg - lg.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    return float(-np.mean([lp[i, ids[i + 1]] for i in range(T - 1)]))


def build_spm_model(pieces, template_path, out_path):
    """Write a SentencePiece ModelProto holding `pieces`, settings from the template model."""
    from sentencepiece import sentencepiece_model_pb2 as spb
    m = spb.ModelProto()
    with open(template_path, "rb") as fh:
        m.ParseFromString(fh.read())
    del m.pieces[:]
    SP = spb.ModelProto.SentencePiece
    for piece, score in pieces:
        p = m.pieces.add()
        p.piece, p.score = piece, score
        if piece == "<unk>":
            p.type = SP.UNKNOWN
        elif piece in ("<s>", "</s>"):
            p.type = SP.CONTROL
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            p.type = SP.BYTE
        else:
            p.type = SP.NORMAL
    ts = m.trainer_spec
    ts.vocab_size = len(pieces)
    ts.model_prefix = "tok%d" % len(pieces)
    del ts.input[:]
    ts.input.append("TinyStories (llama2.c train_vocab)")
    ts.character_coverage = 1.0
    m.normalizer_spec.remove_extra_whitespaces = True
    with open(out_path, "wb") as fh:
        fh.write(m.SerializeToString())


def write_llama2c(path, hdr, t):
    """Clean llama2.c legacy checkpoint (with freq_cis, like llama2.c's legacy_export)."""
    hs = hdr["dim"] // hdr["n_heads"]
    V = hdr["vocab_size"] if hdr["shared_classifier"] else -hdr["vocab_size"]
    with open(path, "wb") as fh:
        fh.write(struct.pack("<7i", hdr["dim"], hdr["hidden_dim"], hdr["n_layers"], hdr["n_heads"],
                             hdr["n_kv_heads"], V, hdr["seq_len"]))
        for k in ORDER:
            fh.write(np.ascontiguousarray(t[k], dtype="<f4").tobytes())
        freqs = 1.0 / (10000.0 ** (np.arange(0, hs, 2)[: hs // 2].astype(np.float32) / hs))
        ang = np.outer(np.arange(hdr["seq_len"], dtype=np.float32), freqs).astype(np.float32)
        fh.write(np.cos(ang).astype("<f4").tobytes())
        fh.write(np.sin(ang).astype("<f4").tobytes())
        if not hdr["shared_classifier"]:
            fh.write(np.ascontiguousarray(t["wcls"], dtype="<f4").tobytes())


def write_tokenizer_bin(path, pieces):
    """llama2.c tokenizer.bin (as llama2.c's tokenizer.py export writes it)."""
    toks = []
    for i, (p, s) in enumerate(pieces):
        if i == 1:
            p = "\n<s>\n"
        elif i == 2:
            p = "\n</s>\n"
        toks.append((p.replace("\u2581", " ").encode("utf-8"), s))
    with open(path, "wb") as fh:
        fh.write(struct.pack("<I", max(len(b) for b, _ in toks)))
        for b, s in toks:
            fh.write(struct.pack("<fI", s, len(b)))
            fh.write(b)


def write_hf(out, hdr, t, pieces=None, template=None):
    dim, n_heads, n_kv = hdr["dim"], hdr["n_heads"], hdr["n_kv_heads"]
    tensors = {"model.embed_tokens.weight": t["tok"], "model.norm.weight": t["rms_final"]}
    for l in range(hdr["n_layers"]):
        p = f"model.layers.{l}."
        tensors[p + "input_layernorm.weight"] = t["rms_att"][l]
        tensors[p + "post_attention_layernorm.weight"] = t["rms_ffn"][l]
        tensors[p + "self_attn.q_proj.weight"] = permute_rope(t["wq"][l], n_heads, dim)
        tensors[p + "self_attn.k_proj.weight"] = permute_rope(t["wk"][l], n_kv, dim)
        tensors[p + "self_attn.v_proj.weight"] = t["wv"][l]
        tensors[p + "self_attn.o_proj.weight"] = t["wo"][l]
        tensors[p + "mlp.gate_proj.weight"] = t["w1"][l]
        tensors[p + "mlp.down_proj.weight"] = t["w2"][l]
        tensors[p + "mlp.up_proj.weight"] = t["w3"][l]
    if not hdr["shared_classifier"]:
        tensors["lm_head.weight"] = t["wcls"]
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": hdr["hidden_dim"],
        "num_hidden_layers": hdr["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": dim // n_heads,
        "vocab_size": hdr["vocab_size"],
        "max_position_embeddings": hdr["seq_len"],
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(hdr["shared_classifier"]),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, fh, indent=2)
        fh.write("\n")
    if pieces is not None and template:
        build_spm_model(pieces, template, os.path.join(out, "tokenizer.model"))
    for f in os.listdir(out):
        os.chmod(os.path.join(out, f), 0o644)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--format", choices=["auto", "llama2c", "llama2ts"], default="auto")
    ap.add_argument("--check", default=DEFAULT_CHECK,
                    help="another checkpoint of the same model to compare tensors with ('' to skip)")
    ap.add_argument("--spm-template", default=DEFAULT_TEMPLATE,
                    help="a SentencePiece model whose settings the rebuilt tokenizer.model takes")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--llama2c-out", default=DEFAULT_L2C_OUT, help="'' to skip")
    a = ap.parse_args()

    hdr, t, pieces, fmt = read_any(a.src, a.format)
    print(f"read {a.src} ({fmt}): {hdr}", file=sys.stderr)

    # Sanity: the canonical TinyStories opening must be cheap to predict.
    ids = None
    if pieces is not None and os.path.exists(a.spm_template):
        import sentencepiece as spm
        import tempfile
        with tempfile.TemporaryDirectory() as td:
            build_spm_model(pieces, a.spm_template, os.path.join(td, "t.model"))
            sp = spm.SentencePieceProcessor(model_file=os.path.join(td, "t.model"))
            ids = [1] + sp.encode("Once upon a time, there was a little girl named Lily. She loved to "
                                  "play outside in the park. One day, she saw a big tree.")
        loss = llama2c_forward_loss(hdr, t, ids)
        print(f"{a.src}: mean next-token loss on a TinyStories sentence: {loss:.3f} nats", file=sys.stderr)
        if loss > 2.0:
            raise SystemExit("source checkpoint does not behave like a trained model; refusing to convert")

    if a.check and os.path.exists(a.check):
        hc, tc, _, fc = read_any(a.check)
        same_hdr = all(hc[k] == hdr[k] for k in ["dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                                                 "vocab_size", "seq_len", "shared_classifier"])
        print(f"check {a.check} ({fc}): header {'matches' if same_hdr else 'DIFFERS'}; tensors: "
              f"{json.dumps(compare(t, tc))}", file=sys.stderr)
        if ids is not None and same_hdr:
            print(f"check {a.check}: mean next-token loss with llama2.c semantics: "
                  f"{llama2c_forward_loss(hc, tc, ids):.3f} nats", file=sys.stderr)

    write_hf(a.out, hdr, t, pieces, a.spm_template if os.path.exists(a.spm_template) else None)
    print(f"wrote {a.out}: {sorted(os.listdir(a.out))}", file=sys.stderr)
    if a.llama2c_out:
        os.makedirs(a.llama2c_out, exist_ok=True)
        write_llama2c(os.path.join(a.llama2c_out, "stories260K.bin"), hdr, t)
        if pieces is not None:
            write_tokenizer_bin(os.path.join(a.llama2c_out, "tok512.bin"), pieces)
        # round trip
        h2, t2, _ = read_llama2c(os.path.join(a.llama2c_out, "stories260K.bin"))
        assert all(np.array_equal(t[k], t2[k]) for k in ORDER)
        print(f"wrote {a.llama2c_out}: {sorted(os.listdir(a.llama2c_out))}", file=sys.stderr)


if __name__ == "__main__":
    main()

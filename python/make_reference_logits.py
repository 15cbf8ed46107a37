#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers (float64, CPU) for the engine's
logit-parity tests.

For each case writes, under tests/fixtures/reference/ (or --out):
  <case>.json             metadata (see docs/fixtures.md)
  <case>.last_logits.f32  raw little-endian float32, [vocab]: logits of the last prompt position
  <case>.pos_logits.f32   raw little-endian float32, [len(positions_checked), vocab]

Cases:
  smollm2_p1..p3     SmolLM2-135M-Instruct Q4_1 GGUF, dequantized by transformers' GGUF loader
  stories260k_p1     tests/fixtures/models/stories260k-hf (converted llama2.c checkpoint)
  tiny_qwen3, tiny_qwen2, tiny_llama3_rope   random-weight models from make_tiny_models.py

Greedy decoding is a plain argmax loop over 32 new tokens that does not stop at EOS (an
engine test can compare all 32); "greedy_eos_index" notes where EOS was first produced.

Usage: python3 python/make_reference_logits.py [--gguf PATH] [--cases a,b,...] [--out DIR]
"""
import argparse
import hashlib
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = os.path.join(ROOT, "tests", "fixtures", "models")
PROMPTS = os.path.join(HERE, "prompts")
GREEDY_N = 32
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

torch.set_grad_enabled(False)


def rel(path):
    return os.path.relpath(os.path.abspath(path), ROOT)


def read_prompt(name):
    with open(os.path.join(PROMPTS, name), encoding="utf-8") as fh:
        return fh.read().strip("\n")


def positions_for(n):
    pos = sorted({0, n // 3, (2 * n) // 3, n - 1})
    return [p for p in pos if 0 <= p < n]


def run_case(case, model, prompt_ids, out_dir, extra, eos_id=None, decode=None):
    """Prefill + greedy, write files, return the json dict."""
    t0 = time.time()
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    logits = out.logits[0].to(torch.float64)  # [T, V]
    vocab = logits.shape[-1]
    positions = positions_for(len(prompt_ids))
    last = logits[-1].numpy()
    pos = logits[positions].numpy()

    # Greedy argmax loop, 32 tokens, no early stop.
    past = out.past_key_values
    nxt = int(torch.argmax(logits[-1]))
    greedy, margins = [], []
    step_logits = logits[-1]
    for i in range(GREEDY_N):
        top2 = torch.topk(step_logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        nxt = int(torch.argmax(step_logits))
        greedy.append(nxt)
        if i == GREEDY_N - 1:
            break
        o = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), past_key_values=past, use_cache=True)
        past = o.past_key_values
        step_logits = o.logits[0, -1].to(torch.float64)

    # Cross-check: a full (no-cache) forward over prompt+greedy reproduces the argmaxes.
    full = model(input_ids=torch.tensor([prompt_ids + greedy[:-1]], dtype=torch.long), use_cache=False)
    full_arg = torch.argmax(full.logits[0, len(prompt_ids) - 1:], dim=-1).tolist()
    nocache_ok = full_arg == greedy
    nocache_maxdiff = float((full.logits[0, len(prompt_ids) - 1].double() - logits[-1]).abs().max())

    last_f32 = last.astype("<f4")
    pos_f32 = pos.astype("<f4")
    last_f32.tofile(os.path.join(out_dir, f"{case}.last_logits.f32"))
    pos_f32.tofile(os.path.join(out_dir, f"{case}.pos_logits.f32"))

    eos_index = None
    if eos_id is not None:
        eos_list = eos_id if isinstance(eos_id, (list, tuple)) else [eos_id]
        for i, t in enumerate(greedy):
            if t in eos_list:
                eos_index = i
                break

    d = {
        "case": case,
        "model": extra.pop("model"),
        "source": f"transformers {transformers.__version__} float64 CPU (torch {torch.__version__})",
        "prompt_ids": [int(x) for x in prompt_ids],
        "prompt_len": len(prompt_ids),
        "vocab_size": int(vocab),
        "last_logits": f"{case}.last_logits.f32",
        "last_logits_argmax": int(np.argmax(last)),
        "positions_checked": positions,
        "logits_at_positions": f"{case}.pos_logits.f32",
        "logits_dtype": "float32 little-endian (computed in float64, rounded)",
        "greedy_ids": greedy,
        "greedy_n": GREEDY_N,
        "greedy_top2_margin": [round(m, 6) for m in margins],
        "greedy_min_margin": round(min(margins), 6),
        "greedy_eos_index": eos_index,
        "max_abs_logit": float(np.abs(last_f32).max()),
        "max_abs_logit_positions": float(np.abs(pos_f32).max()),
        "logit_std_last": float(last.std()),
        "check_nocache_greedy_matches": nocache_ok,
        "check_nocache_last_logits_maxdiff": nocache_maxdiff,
    }
    if decode is not None:
        d["greedy_text"] = decode(greedy)
    d.update(extra)
    with open(os.path.join(out_dir, f"{case}.json"), "w", encoding="utf-8") as fh:
        json.dump(d, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    print(f"[{case}] T={len(prompt_ids)} V={vocab} argmax_last={d['last_logits_argmax']} "
          f"max|logit|={d['max_abs_logit']:.4f} greedy[:10]={greedy[:10]} min_margin={d['greedy_min_margin']:.4g} "
          f"nocache_ok={nocache_ok} ({nocache_maxdiff:.3g}) {time.time() - t0:.1f}s")
    if "greedy_text" in d:
        print(f"[{case}] greedy_text={d['greedy_text']!r}")
    return d


def hf_config_summary(cfg):
    keys = ["model_type", "architectures", "num_hidden_layers", "hidden_size", "intermediate_size",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
            "attention_bias", "mlp_bias"]
    d = {}
    for k in keys:
        v = getattr(cfg, k, None)
        if v is None and k == "head_dim":
            v = cfg.hidden_size // cfg.num_attention_heads
        try:
            json.dumps(v)
        except TypeError:
            v = str(v)
        d[k] = v
    # transformers 5 keeps RoPE settings in rope_parameters (rope_scaling is an alias of it and
    # the rope_theta attribute may be unset): report the effective values.
    rp = getattr(cfg, "rope_parameters", None) or {}
    if d.get("rope_theta") is None and "rope_theta" in rp:
        d["rope_theta"] = rp["rope_theta"]
    d.pop("rope_scaling", None)
    return d


# ---------------------------------------------------------------------------- SmolLM2 (GGUF)

def gguf_metadata(path):
    """The GGUF's own key/values (scalars and short strings; arrays by length), and tensor types."""
    from collections import Counter
    from gguf import GGUFReader
    r = GGUFReader(path)
    d = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "tokenizer.chat_template":
            continue
        try:
            v = f.contents()
        except Exception:  # noqa: BLE001
            continue
        if isinstance(v, list):
            v = f"<array of {len(v)}>" if len(v) > 8 else v
        d[k] = v
    d["tensor_types"] = dict(Counter(t.tensor_type.name for t in r.tensors))
    return d


def smollm2_cases(gguf_path, out_dir):
    gdir, gname = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    h = hashlib.sha256(open(gguf_path, "rb").read()).hexdigest()
    print(f"gguf {gguf_path} sha256 {h} ({'OK' if h == GGUF_SHA256 else 'MISMATCH'})")
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float64)
    model = model.double().eval()
    print(f"smollm2 loaded in {time.time() - t0:.1f}s: {type(model).__name__}, tokenizer {type(tok).__name__}")
    hf_cfg = hf_config_summary(model.config)
    print("smollm2 hf_config:", json.dumps(hf_cfg))
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    tok_info = {
        "class": type(tok).__name__,
        "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
        "len": len(tok),
        "add_bos_token": getattr(tok, "add_bos_token", None),
        "has_chat_template": bool(getattr(tok, "chat_template", None)),
    }
    print("smollm2 tokenizer:", tok_info)
    eos = model.config.eos_token_id
    gmeta = gguf_metadata(gguf_path)
    print("smollm2 gguf metadata:", json.dumps(gmeta))
    common = {
        "gguf_file": "models/" + GGUF_NAME,
        "gguf_sha256": h,
        "gguf_metadata": gmeta,
        "hf_config": hf_cfg,
        "hf_lm_head_tied_in_memory": bool(tied),
        "hf_tokenizer": tok_info,
    }

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    results = []
    # p1: KJV Genesis 1, raw text continuation.
    text = read_prompt("kjv_genesis1.txt")
    ids = tok(text)["input_ids"]
    results.append(("smollm2_p1", text, ids, "raw text (KJV Genesis 1:1-20, python/prompts/kjv_genesis1.txt), tokenizer(text)"))
    # p2: technical paragraph inside the chat template (system-less, one user turn).
    user = read_prompt("technical_kv_cache.txt")
    messages = [{"role": "user", "content": user}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
        if tok_info["has_chat_template"] else user
    ids = tok(text, add_special_tokens=False)["input_ids"]
    results.append(("smollm2_p2", text, ids,
                    "chat template (add_generation_prompt) around python/prompts/technical_kv_cache.txt, "
                    "tokenizer(rendered, add_special_tokens=False)" if tok_info["has_chat_template"]
                    else "NO chat template in GGUF: raw user text"))
    # p3: short story, raw text continuation.
    text = read_prompt("story_lighthouse.txt")
    ids = tok(text)["input_ids"]
    results.append(("smollm2_p3", text, ids, "raw text (original short story), tokenizer(text)"))

    for case, text, ids, how in results:
        rt = tok.decode(ids, skip_special_tokens=False)
        extra = dict(common)
        extra.update({"model": "models/" + GGUF_NAME, "prompt_text": text, "prompt_how": how,
                      "prompt_decode_roundtrip_equal": rt == text})
        run_case(case, model, ids, out_dir, extra, eos_id=eos, decode=decode)


# ---------------------------------------------------------------------------- stories260k

def stories_cases(out_dir):
    import sentencepiece as spm
    d = os.path.join(MODELS, "stories260k-hf")
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).double().eval()
    hf_cfg = hf_config_summary(model.config)
    print("stories260k hf_config:", json.dumps(hf_cfg))

    # Conversion check: greedy from BOS alone.
    ids = torch.tensor([[1]])
    gen = []
    past = None
    for _ in range(40):
        o = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = o.past_key_values
        nxt = int(torch.argmax(o.logits[0, -1]))
        gen.append(nxt)
        ids = torch.tensor([[nxt]])
    bos_text = sp.decode(gen)
    expect = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"
    ok = bos_text.startswith(expect)
    print(f"stories260k greedy from BOS: {bos_text!r} -> {'OK' if ok else 'MISMATCH'}")

    text = "Once upon a time, there was a little dog named Max. Max liked to run in the big green park with his friend Tom. One day,"
    ids = [1] + sp.encode(text)
    extra = {"model": rel(d), "prompt_text": text,
             "prompt_how": "BOS (1) + sentencepiece encode(text) with tokenizer.model",
             "hf_config": hf_cfg,
             "check_bos_greedy_text": bos_text, "check_bos_greedy_ok": ok}
    run_case("stories260k_p1", model, ids, out_dir, extra, eos_id=2, decode=lambda g: sp.decode(g))
    return ok


def stories_tokenizer():
    """tokenizer.json (+ tokenizer_config.json) for stories260k-hf, converted by transformers
    from the SentencePiece tokenizer.model, then patched to reproduce sentencepiece exactly.

    transformers' Llama conversion ignores sentencepiece's remove_extra_whitespaces (true for
    this model): it would emit extra '▁' tokens for runs of spaces. The patch replaces the
    Metaspace pre-tokenizer with a normalizer doing what sentencepiece's normalizer does:
    drop leading spaces, squeeze runs of spaces, drop trailing spaces, prepend '▁' (dummy
    prefix), spaces -> '▁'. Checked against sentencepiece on fixed and random strings.
    tokenizer_config.json names the generic PreTrainedTokenizerFast so that AutoTokenizer uses
    tokenizer.json as written."""
    import random
    import tempfile
    import sentencepiece as spm
    import tokenizers
    from transformers import LlamaTokenizer
    d = os.path.join(MODELS, "stories260k-hf")
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    tok = LlamaTokenizer.from_pretrained(d, add_bos_token=True, add_eos_token=False)
    with tempfile.TemporaryDirectory() as td:
        tok.save_pretrained(td)
        with open(os.path.join(td, "tokenizer.json"), encoding="utf-8") as fh:
            tj = json.load(fh)
        with open(os.path.join(td, "tokenizer_config.json"), encoding="utf-8") as fh:
            tc = json.load(fh)
    tj["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"Regex": "\\A +"}, "content": ""},
        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        {"type": "Replace", "pattern": {"Regex": " +\\z"}, "content": ""},
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ]}
    tj["pre_tokenizer"] = None
    for k in ("is_local", "local_files_only"):
        tc.pop(k, None)
    # With tokenizer_class LlamaTokenizer, transformers 5 rebuilds its own normalizer and
    # pre-tokenizer and ignores the patch; the generic class uses tokenizer.json as it is.
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as fh:
        json.dump(tj, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(tc, fh, indent=2, ensure_ascii=False)
        fh.write("\n")

    tests = ["Once upon a time, there was a little girl named Lily.",
             "Hello world!  Two  spaces, tabs\tand\nnewlines. 123 + 456 = 579.",
             " leading space", "   three", "trailing  ", "Tom said, \"I'm happy!\" The end.",
             "caf\u00e9 na\u00efve \u2014 \u65e5\u672c \U0001F642", "a  b   c", "  \n  x \t  y  ", "\n\nhi", ""]
    rnd = random.Random(0)
    alpha = list("abcdeLily .,!?\n\t  '\"0123\u00e9\u65e5\U0001F642")
    tests += ["".join(rnd.choice(alpha) for _ in range(rnd.randint(0, 30))) for _ in range(2000)]
    tk = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    from transformers import AutoTokenizer
    at = AutoTokenizer.from_pretrained(d)
    bad_tk = [s for s in tests if tk.encode(s).ids != [1] + sp.encode(s)]
    bad_at = [s for s in tests if at(s)["input_ids"] != [1] + sp.encode(s)]
    bad_dec = [s for s in tests[:11] if at.decode(sp.encode(s)) != sp.decode(sp.encode(s))]
    ok = not bad_tk and not bad_at and not bad_dec
    print(f"stories260k tokenizer.json: AutoTokenizer -> {type(at).__name__}; vs sentencepiece on "
          f"{len(tests)} strings: tokenizers mismatches {len(bad_tk)} {bad_tk[:3]!r}, AutoTokenizer "
          f"mismatches {len(bad_at)} {bad_at[:3]!r}, decode mismatches {bad_dec!r}; files {sorted(os.listdir(d))}")
    return ok


# ---------------------------------------------------------------------------- tiny models

TINY = [
    # case, dir, seed, prompt length
    ("tiny_qwen3", "tiny-qwen3", 103, 64),
    ("tiny_qwen2", "tiny-qwen2", 102, 100),
    ("tiny_llama3_rope", "tiny-llama3-rope", 101, 200),
]


def tiny_cases(out_dir):
    for case, name, seed, n in TINY:
        d = os.path.join(MODELS, name)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).double().eval()
        hf_cfg = hf_config_summary(model.config)
        rng = np.random.RandomState(seed)
        ids = rng.randint(3, model.config.vocab_size, size=n).tolist()
        extra = {"model": rel(d), "prompt_how": f"numpy RandomState({seed}).randint(3, vocab, size={n})",
                 "hf_config": hf_cfg}
        run_case(case, model, ids, out_dir, extra, eos_id=model.config.eos_token_id)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.path.join(ROOT, "models", GGUF_NAME))
    ap.add_argument("--cases", default="tiny,stories,smollm2")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "reference"))
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
          f"threads {torch.get_num_threads()}")
    failed = []
    for part in a.cases.split(","):
        t0 = time.time()
        try:
            if part == "tiny":
                tiny_cases(a.out)
            elif part == "stories_tok":
                if not stories_tokenizer():
                    failed.append("stories_tok(mismatch)")
            elif part == "stories":
                if not stories_cases(a.out):
                    failed.append("stories(bos check)")
            elif part == "smollm2":
                smollm2_cases(a.gguf, a.out)
            else:
                raise SystemExit(f"unknown case group {part}")
        except Exception:
            traceback.print_exc()
            failed.append(part)
        print(f"== {part} done in {time.time() - t0:.1f}s")
    print("FAILED:", failed if failed else "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

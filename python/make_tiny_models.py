#!/usr/bin/env python3
"""Tiny random-weight Hugging Face models for the engine's logit-parity tests.

Writes (save_pretrained, safetensors, fp32):
  tests/fixtures/models/tiny-qwen3/        Qwen3ForCausalLM, 3 layers, hidden 64, 4 q heads /
                                           2 kv heads, explicit head_dim 32 (!= 64/4), q/k norms,
                                           tied embeddings
  tests/fixtures/models/tiny-qwen2/        Qwen2ForCausalLM, 2 layers, head_dim 16, q/k/v biases,
                                           untied embeddings
  tests/fixtures/models/tiny-llama3-rope/  LlamaForCausalLM, 2 layers, head_dim 16, llama3 RoPE
                                           scaling (factor 8, low 1, high 4, original max pos 64),
                                           untied embeddings

Weights are drawn from a seeded torch.Generator (not transformers' init, whose std 0.02 makes
every logit ~0): linear weights and embeddings N(0, 0.2^2) (0.15 for the inner projections),
biases N(0, 0.2^2), RMSNorm weights U(0.5, 1.5).

Needs torch + transformers. Usage: python3 python/make_tiny_models.py [OUT_ROOT]
"""
import json
import os
import sys

import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT_ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures", "models")

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                v = torch.rand(p.shape, generator=g, dtype=torch.float64) + 0.5
            elif name.endswith(".bias"):
                v = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
            elif "embed_tokens" in name or "lm_head" in name:
                v = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
            else:
                v = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.15
            p.copy_(v.to(p.dtype))
    return model


def add_legacy_rope_keys(path):
    """transformers 5 writes RoPE settings only as "rope_parameters"; most checkpoints in the
    wild (written by transformers 4.x) carry "rope_theta" and "rope_scaling" instead. Write both
    forms so that a loader that knows either one reads the same values (transformers 5 itself
    reads rope_parameters and gives the same config either way; make_reference_logits.py
    records what it parsed)."""
    with open(path) as fh:
        cfg = json.load(fh)
    rp = cfg.get("rope_parameters")
    if rp:
        cfg["rope_theta"] = rp["rope_theta"]
        if rp.get("rope_type", "default") == "default":
            cfg["rope_scaling"] = None
        else:
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")


def build(name, cls, cfg, seed):
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    randomize(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    out = os.path.join(OUT_ROOT, name)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    add_legacy_rope_keys(os.path.join(out, "config.json"))
    for f in os.listdir(out):
        os.chmod(os.path.join(out, f), 0o644)
    n = sum(p.numel() for p in model.parameters())
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{name}: {n} params, dir {size} bytes, files {sorted(os.listdir(out))}")
    with open(os.path.join(out, "config.json")) as fh:
        print(f"{name} config.json: {json.dumps(json.load(fh), sort_keys=True)}")
    return out


def main():
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    qwen3 = Qwen3Config(
        **COMMON,
        num_hidden_layers=3,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=False,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )
    build("tiny-qwen3", Qwen3ForCausalLM, qwen3, seed=3)

    qwen2 = Qwen2Config(
        **COMMON,
        num_hidden_layers=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    build("tiny-qwen2", Qwen2ForCausalLM, qwen2, seed=2)

    llama3 = LlamaConfig(
        **COMMON,
        num_hidden_layers=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    build("tiny-llama3-rope", LlamaForCausalLM, llama3, seed=1)


if __name__ == "__main__":
    main()

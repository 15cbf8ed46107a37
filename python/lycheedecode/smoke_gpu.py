#!/usr/bin/env python3
"""Times training steps of train_roles.Trainer on a randomly initialized model of
SmolLM2-135M's shape (no weights needed), to size a real run. Also checks that the dense
functional path matches transformers' forward on the device.

Usage: python3 python/lycheedecode/smoke_gpu.py [--lens 1024,4096,7936] [--steps 6]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardkuma import DirectGates, HardKumaGates  # noqa: E402
from model import HybridModel  # noqa: E402
from train_roles import Trainer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="1024,4096,7936")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--target-len", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).to(args.device).eval()
    hm = HybridModel(model)
    ids = torch.randint(0, 49152, (1, 300), device=args.device)
    with torch.no_grad():
        cache = hm.prefill(ids[:, :200])
        mine = hm.targets(ids[:, 200:], cache)
        ref = model(ids).logits[:, 200:].float()
    print(f"dense functional path vs transformers: max |diff| {float((mine - ref).abs().max()):.4f} "
          f"(logit scale {float(ref.abs().max()):.2f}, bf16)", flush=True)
    for cls in (HardKumaGates, DirectGates):
        gates = cls(hm.n_gates).to(args.device)
        tr = Trainer(hm, gates, 9, device=args.device)
        for L in [int(x) for x in args.lens.split(",")]:
            times = []
            for s in range(args.steps):
                seq = torch.randint(0, 49152, (L + args.target_len,)).tolist()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t = time.time()
                tr.step(seq[:L], seq[L:])
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.time() - t)
            mem = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0
            print(f"{cls.kind} prompt {L} target {args.target_len}: step {min(times[1:] or times):.3f}s "
                  f"(first {times[0]:.3f}s), peak mem {mem:.1f} GiB", flush=True)


if __name__ == "__main__":
    main()

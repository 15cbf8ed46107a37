#!/usr/bin/env python3
"""`--device cuda --tp N` (issue 39): rank 0 starts N-1 follower processes, rank r on GPU r,
their all-reduces over NCCL.

The CUDA backend runs head_dim 64 / 128 only, and stories260k has head_dim 8, so the script
first writes a widened copy of it (same tokenizer) that computes the same function: every
head's 8 dims placed at dims 0-3 / 32-35 of 64 (the rotate-half pairs kept), q scaled by
sqrt(64 / 8) (the softmax scale), rope_theta 1e32 = 10000^8 (the same rotation frequencies),
ffn 172 zero-padded to 256. Then:

- generate --device cuda --tp 2 prints the greedy text of --device cuda --tp 1 (and SmolLM2
  at --tp 3 when 3 GPUs are visible and models/SmolLM2-135M-Instruct.Q4_1.gguf is present);
  no rank is left behind;
- every GPU sparse method: generate --device cuda --tp 2 --sparse M prints --tp 1 --sparse M's
  greedy text (each rank runs the method on its KV heads; LessIsMore gathers its merge keys);
- clear errors before any rank starts: more ranks than visible GPUs ("--tp N needs N GPUs,
  M visible"), --recall under --tp.

Skipped (exit 77) when `nvidia-smi -L` lists fewer than 2 GPUs. The sparse methods' part is
untested until a multi-GPU run.
"""
import argparse
import array
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORIES = os.path.join(ROOT, "tests/fixtures/models/stories260k-hf")
SMOLLM = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spade_client import time_scale  # noqa: E402

failures = 0
SCALE = time_scale()
SPADE = None


def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    failures += 0 if cond else 1


def gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def run(*args, timeout=120):
    return subprocess.run([SPADE, *args], capture_output=True, text=True, timeout=timeout * SCALE)


# ---- the widened stories260k fixture

def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        a, b = t["data_offsets"]
        v = array.array("f")
        v.frombytes(data[a:b])
        out[name] = (t["shape"], v)
    return out


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, (shape, v) in tensors.items():
        b = v.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def widen_stories(dst):
    cfg = json.load(open(os.path.join(STORIES, "config.json")))
    H, d, D = cfg["hidden_size"], cfg["head_dim"], 64
    F, F2 = cfg["intermediate_size"], 256
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    half = d // 2
    # old dim i of a head -> new dim: the first half at 0.., the second at D/2.. (rotate-half pairs)
    dmap = [i if i < half else D // 2 + (i - half) for i in range(d)]
    src = read_safetensors(os.path.join(STORIES, "model.safetensors"))
    out = {}
    qscale = math.sqrt(D / d)

    def widen_rows(shape, v, heads, scale=1.0):  # [heads * d, H] -> [heads * D, H]
        w = array.array("f", bytes(4 * heads * D * H))
        for h in range(heads):
            for i in range(d):
                r0, r1 = (h * d + i) * H, (h * D + dmap[i]) * H
                for k in range(H):
                    w[r1 + k] = v[r0 + k] * scale
        return [heads * D, H], w

    def widen_cols(shape, v, heads):  # [H, heads * d] -> [H, heads * D]
        w = array.array("f", bytes(4 * H * heads * D))
        for r in range(H):
            for h in range(heads):
                for i in range(d):
                    w[r * heads * D + h * D + dmap[i]] = v[r * heads * d + h * d + i]
        return [H, heads * D], w

    for name, (shape, v) in src.items():
        if name.endswith("q_proj.weight"):
            out[name] = widen_rows(shape, v, hq, qscale)
        elif name.endswith("k_proj.weight") or name.endswith("v_proj.weight"):
            out[name] = widen_rows(shape, v, hkv)
        elif name.endswith("o_proj.weight"):
            out[name] = widen_cols(shape, v, hq)
        elif name.endswith("gate_proj.weight") or name.endswith("up_proj.weight"):
            w = array.array("f", bytes(4 * F2 * H))
            w[: F * H] = v
            out[name] = ([F2, H], w)
        elif name.endswith("down_proj.weight"):
            w = array.array("f", bytes(4 * H * F2))
            for r in range(H):
                w[r * F2: r * F2 + F] = v[r * F: (r + 1) * F]
            out[name] = ([H, F2], w)
        else:
            out[name] = (shape, v)
    os.makedirs(dst, exist_ok=True)
    write_safetensors(os.path.join(dst, "model.safetensors"), out)
    cfg.update({"head_dim": D, "intermediate_size": F2, "rope_theta": 1e32})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    for f in os.listdir(STORIES):
        if f.startswith("tokenizer") or f == "generation_config.json":
            shutil.copy(os.path.join(STORIES, f), dst)
    return dst


# ---- tests

def greedy(model, prompt, n, tp, *extra):
    return run("generate", "-m", model, "-p", prompt, "-n", str(n), "--device", "cuda",
               "--tp", str(tp), *extra)


def test_generate_equal(model, n_gpus):
    one = greedy(model, "Once upon a time", 40, 1)
    two = greedy(model, "Once upon a time", 40, 2)
    check(one.returncode == 0, f"widened stories260k --device cuda --tp 1 runs ({one.stderr.strip()[-400:]})")
    check(two.returncode == 0, f"widened stories260k --device cuda --tp 2 runs ({two.stderr.strip()[-400:]})")
    check(one.stdout == two.stdout and len(one.stdout) > 20,
          f"--tp 2 prints --tp 1's greedy text: {two.stdout.strip()!r} vs {one.stdout.strip()!r}")
    # The function is stories260k's: the CPU's greedy text (fp32) should match too (bf16 on the
    # GPU may differ at a near-tie: reported, not a failure).
    cpu = run("generate", "-m", STORIES, "-p", "Once upon a time", "-n", "40", "--threads", "1")
    print(("info " if cpu.stdout == one.stdout else "note ") +
          f"stories260k on the CPU {'matches' if cpu.stdout == one.stdout else 'differs from'} "
          f"the widened copy on the GPU: {cpu.stdout.strip()!r}", flush=True)
    if n_gpus >= 3 and os.path.exists(SMOLLM):
        one = greedy(SMOLLM, "The capital of France is", 24, 1, "--ignore-eos")
        three = greedy(SMOLLM, "The capital of France is", 24, 3, "--ignore-eos")
        check(three.returncode == 0 and one.stdout == three.stdout and len(one.stdout) > 20,
              f"SmolLM2 --device cuda --tp 3 prints --tp 1's greedy text: {three.stdout.strip()!r} "
              f"vs {one.stdout.strip()!r} ({three.stderr.strip()[-400:]})")
    else:
        print("skip SmolLM2 --tp 3 (needs 3 GPUs and models/SmolLM2-135M-Instruct.Q4_1.gguf)")


def test_errors(model, n_gpus):
    if n_gpus < 4:  # the widened model's 4 KV heads split over 4 ranks
        r = greedy(model, "x", 2, 4)
        check(r.returncode != 0 and f"--tp 4 needs 4 GPUs, {n_gpus} visible" in r.stderr,
              f"more ranks than GPUs: {r.stderr.strip()!r}")
    # --recall is CPU-only: on GPU ranks the CLI refuses it as such before TP is considered.
    r = greedy(model, "x", 2, 2, "--sparse", "quest", "--recall")
    check(r.returncode != 0 and "--recall is CPU-only" in r.stderr,
          f"--sparse quest --recall --tp 2: {r.stderr.strip()!r}")


# One spec per GPU method for the widened stories260k (5 layers, 4 KV heads, ~60 tokens).
GPU_METHODS = [
    ("streaming", "budget=32,sinks=4"),
    ("quest", "budget=32"),
    ("tidal", "budget=32"),
    ("lessismore", "budget=32"),
    ("oracle-topk", "budget=32"),
    ("oracle-topp", "p=0.9"),
    ("lycheecluster", "budget=32,chunking=fixed"),
    ("lycheedecode", "roles=RRRR/SRSR/RSRS/SSRR/RSSR,budget=32"),
    ("twilight", "base=quest,budget=32"),
    ("blasst", "lambda=0.5"),
]


def test_sparse_methods_equal(model):
    prompt = "Once upon a time, there was a little girl named Lily. She"
    for method, opts in GPU_METHODS:
        flags = ("--sparse", method, "--sparse-opt", opts, "--ignore-eos")
        one = greedy(model, prompt, 48, 1, *flags)
        two = greedy(model, prompt, 48, 2, *flags)
        check(one.returncode == 0 and two.returncode == 0 and one.stdout == two.stdout
              and len(one.stdout) > 20,
              f"--device cuda --tp 2 --sparse {method} prints --tp 1's text: "
              f"{two.stdout.strip()[-40:]!r} vs {one.stdout.strip()[-40:]!r} "
              f"({one.stderr.strip()[-300:]} {two.stderr.strip()[-300:]})")


def main():
    global SPADE
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    SPADE = ap.parse_args().spade
    n = gpus()
    if n < 2:
        print(f"skip: needs 2 GPUs, nvidia-smi -L lists {n}")
        return 77
    tmp = tempfile.mkdtemp(prefix="spade-tp-cuda-")
    try:
        model = widen_stories(os.path.join(tmp, "stories260k-d64"))
        test_generate_equal(model, n)
        test_sparse_methods_equal(model)
        test_errors(model, n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("PASS" if failures == 0 else f"{failures} FAILED", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

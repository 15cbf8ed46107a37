#!/usr/bin/env python3
"""PyTorch SDPA baseline for spade's attention benchmarks (same shapes, same machine, same run).

decode : q [B, Hq, 1, D], K/V [B, Hkv, L, D] bf16 contiguous, enable_gqa=True, every SDPA
         backend that accepts the shapes; caches rotated so the total exceeds L2 (>= 400 MB).
prefill: q/K/V [1, H, L, D], is_causal=True, enable_gqa=True, each backend.
Timing: CUDA events around a batch of calls, 30 batches (15 for prefill), median per call.
Bytes (decode) = K + V + q + out; FLOPs (prefill) = 4*Hq*D*L(L+1)/2. Writes JSON lines.
"""
import argparse, json, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def timed(fn, calls, reps):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per = []
    for _ in range(reps):
        a.record()
        for i in range(calls):
            fn(i)
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / calls)
    per.sort()
    return per[len(per) // 2], per[0]


def decode(out, L, B, HQ=HQ, HKV=HKV):
    kv_bytes = B * L * HKV * D * 2 * 2
    free, _ = torch.cuda.mem_get_info()
    if kv_bytes > free - (6 << 30):
        print(f"decode L={L} B={B}: does not fit, skipped", file=sys.stderr)
        return
    nbuf = max(1, min((400 << 20) // kv_bytes + 1, (free - (6 << 30)) // kv_bytes))
    g = torch.Generator(device="cuda").manual_seed(0)
    ks = [torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(nbuf)]
    vs = [torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(nbuf)]
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    calls = max(nbuf, 8) // nbuf * nbuf
    for name, be in [("default", None)] + list(BACKENDS.items()):
        def fn(i):
            return F.scaled_dot_product_attention(q, ks[i % nbuf], vs[i % nbuf], enable_gqa=True)
        try:
            if be is None:
                for i in range(3 * nbuf): fn(i)
                torch.cuda.synchronize()
                ms, mn = timed(fn, calls, 30)
            else:
                with sdpa_kernel([be]):
                    for i in range(3 * nbuf): fn(i)
                    torch.cuda.synchronize()
                    ms, mn = timed(fn, calls, 30)
        except Exception as e:  # backend refuses these shapes
            print(f"decode L={L} B={B} {name}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            torch.cuda.synchronize()
            continue
        us = ms * 1000
        nbytes = kv_bytes + 2 * B * HQ * D * 2
        rec = dict(kind="decode", impl="sdpa", backend=name, L=L, B=B, Hq=HQ, Hkv=HKV, D=D,
                   buffers=nbuf, us=round(us, 3), us_min=round(mn * 1000, 3), bytes=nbytes,
                   GBps=round(nbytes / us * 1e-3, 1))
        out.write(json.dumps(rec) + "\n"); out.flush()
    del ks, vs
    torch.cuda.empty_cache()


def prefill(out, L):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, HQ, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 4.0 * HQ * D * L * (L + 1) / 2
    for name, be in [("default", None)] + list(BACKENDS.items()):
        def fn(i):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        try:
            ctx = sdpa_kernel([be]) if be is not None else None
            if ctx: ctx.__enter__()
            try:
                for i in range(2): fn(i)
                torch.cuda.synchronize()
                ms, mn = timed(fn, 1, 15)
            finally:
                if ctx: ctx.__exit__(None, None, None)
        except Exception as e:
            print(f"prefill L={L} {name}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            torch.cuda.synchronize()
            continue
        rec = dict(kind="prefill", impl="sdpa", backend=name, L=L, B=1, Hq=HQ, Hkv=HKV, D=D,
                   causal=True, ms=round(ms, 4), flops=flops, TFLOPs=round(flops / ms * 1e-9, 1))
        out.write(json.dumps(rec) + "\n"); out.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["decode", "prefill", "all", "blasst"])
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    out = sys.stdout if a.out == "-" else open(a.out, "w")
    print("torch", torch.__version__, torch.cuda.get_device_name(), file=sys.stderr)
    if a.mode in ("decode", "all"):
        for L in (8192, 32768, 131072):
            for B in (1, 8, 32):
                decode(out, L, B)
    if a.mode == "blasst":  # bench/bench_blasst.cu's decode shapes (BLASST table 4; Llama-3-8B)
        for L in (32768, 65536):
            decode(out, L, 64, HQ=32, HKV=4)
        for B in (1, 8):
            decode(out, 32768, B)
    if a.mode in ("prefill", "all"):
        for L in (8192, 32768):
            prefill(out, L)


if __name__ == "__main__":
    main()

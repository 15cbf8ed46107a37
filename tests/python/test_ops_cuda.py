#!/usr/bin/env python3
"""GPU tests of spade's kernel API (python/spade/ops.py): the CUDA ops against the CPU ops.

  - decode_attention / DecodeAttention (bf16) against the CPU op on the same bf16 data: the
    GPU kernel rounds its softmax weights to bf16 for P.V, so agreement is to bf16 accuracy
    (atol = rtol = 2e-2); run() captured in a CUDA graph replays the planned batch with new
    queries; run() with out= allocates nothing from torch;
  - sparse_attention / SparseAttention over per-head token lists, shared lists and 16-token
    page lists against the CPU op (same tolerance);
  - quest_meta bit for bit, quest_select, topk_select / tidal_select and lessismore_select
    list for list (the same selections: the kernels sum in the CPU's order); twilight_prune
    within 1% of the CPU's kept tokens (its estimates agree to ~2e-5 relative); the GPU
    LycheeCluster index's lists against the CPU ClusterIndex's (keys without k-means
    near-ties);
  - spade.hf on a tiny bf16 Llama: method full within bf16 tolerance of eager attention;
    every method of the hook decodes (finite logits, density below 1; a budget past the
    context gives full's logits);
  - --bench: decode_attention's run() timed with CUDA events at bench/bench_attention.cu's
    shapes (Llama-3-8B: Hq 32, Hkv 8, D 128, page 16, shuffled pages, caches rotated past
    L2, 30 batches of calls, the median per call; "us": the calls captured in a CUDA graph,
    "us_eager": launched from Python), one JSON line per shape; with
    --cxx FILE (bench_attention's JSON lines) each line also gets the C++ time of the same
    shape (kernel auto) and the ratio.

Skipped (exit 77 as a script) without a CUDA device, torch with CUDA, or a spade build with
the CUDA backend. Run: PYTHONPATH=build/python python3 tests/python/test_ops_cuda.py [-v]
and PYTHONPATH=build/python python3 tests/python/test_ops_cuda.py --bench [--cxx FILE].
"""
import json
import os
import statistics
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WHY = ""
try:
    import torch
    import spade.ops as ops
    ENABLED = torch.cuda.is_available() and ops.have_cuda()
    if not torch.cuda.is_available():
        WHY = "no CUDA device for torch"
    elif not ops.have_cuda():
        WHY = "this spade build has no CUDA backend"
except ImportError as e:
    ENABLED, WHY = False, f"torch or the spade package unavailable ({e})"

if ENABLED:
    from test_ops import make_batch  # the CPU tests' paged batches

DEV = "cuda"


def graph_ctx(g, stream):
    """torch.cuda.graph capturing in thread-local mode (as the engine's own graphs) where this
    torch has the option."""
    try:
        return torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local")
    except TypeError:
        return torch.cuda.graph(g, stream=stream)


def close(test, got, want, rtol=2e-2, atol=2e-2):
    err = (got.float().cpu() - want.float().cpu()).abs()
    bound = atol + rtol * want.float().cpu().abs()
    test.assertLessEqual(float((err - bound).max()), 0.0, f"max error {float(err.max()):.3g}")


def to_dev(*ts):
    return [t.to(DEV) for t in ts]


@unittest.skipUnless(ENABLED, WHY)
class CudaDecodeTest(unittest.TestCase):
    def batch(self, lens, Hq=32, Hkv=8, D=128, P=16, seed=0):
        k, v, ip, ix, ln = make_batch(lens, Hkv, P, D, torch.bfloat16, seed=seed)
        q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(seed + 1))
        return q.bfloat16(), k, v, ip, ix, ln

    def test_decode_matches_cpu(self):
        for lens, Hq, Hkv, D in (([1, 100, 1000, 5000], 32, 8, 128), ([17, 300], 8, 8, 64),
                                 ([2048], 32, 4, 128)):
            q, k, v, ip, ix, ln = self.batch(lens, Hq, Hkv, D)
            want = ops.decode_attention(q, k, v, ip, ix, ln)
            qd, kd, vd = to_dev(q, k, v)
            got = ops.decode_attention(qd, kd, vd, *to_dev(ip, ix, ln))  # device index tensors
            self.assertEqual(got.device.type, "cuda")
            close(self, got, want)
            got2 = ops.decode_attention(qd, kd, vd, ip, ix, ln)  # host index tensors
            close(self, got2, want)

    def test_plan_run_graph_and_no_allocation(self):
        q, k, v, ip, ix, ln = self.batch([700, 33, 4096])
        qd, kd, vd = to_dev(q, k, v)
        w = ops.DecodeAttention(8, 32, 8, 128, 16, device=DEV)
        self.assertGreater(w.arena_bytes, 0)
        w.plan(ip, ix, ln)
        out = torch.empty_like(qd)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        w.run(qd, kd, vd, out=out)
        torch.cuda.synchronize()
        self.assertEqual(torch.cuda.memory_allocated(), before)
        close(self, out, ops.decode_attention(q, k, v, ip, ix, ln))
        # CUDA graph: capture run(out=), replay with new queries in the captured buffer.
        static_q = qd.clone()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            w.run(static_q, kd, vd, out=out)  # warm-up on the capture stream
            with graph_ctx(g, s):
                w.run(static_q, kd, vd, out=out)
        torch.cuda.current_stream().wait_stream(s)
        q2 = torch.randn(q.shape, generator=torch.Generator().manual_seed(42)).bfloat16()
        static_q.copy_(q2.to(DEV))
        g.replay()
        torch.cuda.synchronize()
        close(self, out, ops.decode_attention(q2, k, v, ip, ix, ln))

    def test_sparse_matches_cpu(self):
        lens = [40, 900, 3000]
        q, k, v, ip, ix, ln = self.batch(lens)
        Hkv = 8
        gen = torch.Generator().manual_seed(3)
        # per-head token lists, shared token lists, 16-token page lists
        for kind in ("head", "shared", "page"):
            flat = []
            for b, L in enumerate(lens):
                for h in range(Hkv if kind != "shared" else 1):
                    n_units = L if kind != "page" else (L + 15) // 16
                    n = int(torch.randint(1, n_units + 1, (1,), generator=gen))
                    flat.append(torch.randperm(n_units, generator=gen)[:n])
            off = torch.tensor([0] + [int(x) for x in torch.tensor([len(x) for x in flat]).cumsum(0)],
                               dtype=torch.int32)
            idx = torch.cat(flat).to(torch.int32)
            gran = "page" if kind == "page" else "token"
            want = ops.sparse_attention(q, k, v, ip, ix, ln, off, idx, granularity=gran)
            qd, kd, vd, offd, idxd = to_dev(q, k, v, off, idx)
            got = ops.sparse_attention(qd, kd, vd, ip, ix, ln, offd, idxd, granularity=gran)
            close(self, got, want)
            w = ops.SparseAttention(4, 32, 8, 128, 16, device=DEV)
            w.plan(ip, ix, ln, max_entries=(off[1:] - off[:-1]).tolist(), granularity=gran,
                   shared=kind == "shared")
            out = torch.empty_like(qd)
            w.run(qd, kd, vd, offd, idxd, out=out)
            close(self, out, want)


@unittest.skipUnless(ENABLED, WHY)
class CudaSelectorTest(unittest.TestCase):
    def test_quest(self):
        lens = [5000, 16, 700, 1000]
        k, v, ip, ix, ln = make_batch(lens, 8, 16, 128, torch.bfloat16, seed=6)
        q = torch.randn(len(lens), 32, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
        meta = ops.quest_meta(k, ip, ix, ln)
        kd, qd = to_dev(k, q)
        meta_d = ops.quest_meta(kd, *to_dev(ip, ix, ln))
        self.assertTrue(torch.equal(meta_d.cpu(), meta))
        for kp in (1, 4, 64):
            off, idx = ops.quest_select(q, meta, ip, ix, ln, kp)
            off_d, idx_d = ops.quest_select(qd, meta_d, *to_dev(ip, ix, ln), kp)
            self.assertEqual(off_d.cpu().tolist(), off.tolist(), kp)
            n = int(off[-1])
            self.assertEqual(idx_d.cpu()[:n].tolist(), idx[:n].tolist(), kp)

    def test_twilight(self):
        # CPU and GPU estimate the logits to ~2e-5 relative, so a token at the very edge of a
        # threshold may differ: at most 1% of the kept tokens of the batch.
        lens = [3000, 700]
        k, v, ip, ix, ln = make_batch(lens, 8, 16, 128, torch.bfloat16, seed=7)
        q = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
        gen = torch.Generator().manual_seed(3)
        for gran in ("token", "page"):
            flat = []
            for L in lens:
                units = L if gran == "token" else (L + 15) // 16
                for _ in range(8):
                    flat.append(torch.randperm(units, generator=gen)[:max(1, units // 3)])
            off = torch.tensor([0] + [int(x) for x in torch.tensor([len(x) for x in flat]).cumsum(0)],
                               dtype=torch.int32)
            idx = torch.cat(flat).to(torch.int32)
            a_off, a = ops.twilight_prune(q, k, ip, ix, ln, off, idx, granularity=gran)
            b_off, b = ops.twilight_prune(*to_dev(q, k, ip, ix, ln, off, idx), granularity=gran)
            b_off, b = b_off.cpu(), b.cpu()
            diff = total = 0
            for i in range(len(flat)):
                sa = set(a[int(a_off[i]):int(a_off[i + 1])].tolist())
                sb = set(b[int(b_off[i]):int(b_off[i + 1])].tolist())
                diff += len(sa ^ sb)
                total += len(sa)
            self.assertLessEqual(diff, max(1, total // 100), (gran, diff, total))

    def test_lycheecluster(self):
        # Keys where chunks 2i and 2i+1 share a direction (no k-means near-ties, as the C++
        # test CudaLycheeCluster.SearchMatchesCpu): the GPU index's lists equal the CPU
        # ClusterIndex's chunks framed by the sink and the un-indexed tail.
        g = torch.Generator().manual_seed(13)
        Hkv, D, P, sink, L, Hq = 2, 128, 16, 16, 4000, 8
        G = Hq // Hkv
        st = [sink]
        while st[-1] < L - 70:
            st.append(min(L - 70, st[-1] + int(torch.randint(8, 17, (1,), generator=g))))
        if len(st) % 2 == 0:
            st.pop()
        starts = torch.tensor(st, dtype=torch.int32)
        keys = torch.randn(Hkv, L, D, generator=g)
        for h in range(Hkv):
            for c in range(len(st) - 1):
                if c % 2 == 0:
                    d = torch.randn(D, generator=g)
                    d = 6.0 * d / d.norm()
                n = st[c + 1] - st[c]
                scale = 0.8 + 0.4 * torch.rand(n, 1, generator=g)
                keys[h, st[c]:st[c + 1]] = scale * (d + 0.15 * torch.randn(n, D, generator=g))
        keys = keys.bfloat16()
        n_pages = (L + P - 1) // P
        perm = torch.randperm(n_pages + 5, generator=g)[:n_pages].to(torch.int32)
        cache = torch.zeros(n_pages + 5, Hkv, P, D, dtype=torch.bfloat16)
        padded = torch.zeros(Hkv, n_pages * P, D, dtype=torch.bfloat16)
        padded[:, :L] = keys
        cache[perm.long()] = padded.view(Hkv, n_pages, P, D).permute(1, 0, 2, 3)
        ix = ops.CudaClusterIndex(2, Hkv, D, P, max_chunks=1024)
        self.assertGreater(ix.arena_bytes, 0)
        ix.build(1, cache.to(DEV), perm, starts)
        cpu = [ops.ClusterIndex().build(keys[h], starts) for h in range(Hkv)]
        for budget in (128, 1024):
            for rep in range(3):
                q = (0.3 + torch.randn(1, Hq, D, generator=g)).bfloat16()
                off, idx = ix.search(q.to(DEV), torch.tensor([1], dtype=torch.int32),
                                     torch.tensor([L], dtype=torch.int32), budget, sink=sink)
                off, idx = off.cpu(), idx.cpu()
                for h in range(Hkv):
                    want = (list(range(sink)) +
                            cpu[h].search(q[0, h * G:(h + 1) * G], budget, starts).tolist() +
                            list(range(st[-1], L)))
                    got = idx[int(off[h]):int(off[h + 1])].tolist()
                    self.assertEqual(got, want, (budget, rep, h))

    def test_topk_tidal_lessismore(self):
        gen = torch.Generator().manual_seed(5)
        B, Hq, Hkv = 3, 32, 8
        for ld in (3000, 50000):  # 50000: past the top-k's shared-memory cache
            scores = torch.randn(B, Hq, ld, generator=gen)
            lens = torch.tensor([ld, ld // 3, 7], dtype=torch.int32)
            sd, ld_ = to_dev(scores, lens)
            for k in (1, 64, 2048):
                a = ops.tidal_select(scores, lens, k, num_kv_heads=Hkv)
                b = ops.tidal_select(sd, ld_, k, num_kv_heads=Hkv)
                self.assertEqual(b[0].cpu().tolist(), a[0].tolist())
                n = int(a[0][-1])
                self.assertEqual(b[1].cpu()[:n].tolist(), a[1][:n].tolist())
            for budget in (64, 2048):
                a = ops.lessismore_select(scores, lens, budget)
                b = ops.lessismore_select(sd, ld_, budget)
                self.assertEqual(b[0].cpu().tolist(), a[0].tolist())
                n = int(a[0][-1])
                self.assertEqual(b[1].cpu()[:n].tolist(), a[1][:n].tolist())


@unittest.skipUnless(ENABLED, WHY)
class CudaHfTest(unittest.TestCase):
    """spade.hf on a tiny random bf16 Llama (D = 64) on the GPU: method full against
    transformers' eager attention within bf16 tolerance; quest runs."""

    def test_full_and_quest(self):
        try:
            import spade.hf
            from test_hf import step_logits, tiny_llama
        except ImportError as e:
            self.skipTest(f"transformers unavailable ({e})")
        model = tiny_llama(hidden=512, heads=8, kv_heads=2, layers=3).to(DEV, torch.bfloat16)
        prompt = torch.randint(0, 96, (2, 300), generator=torch.Generator().manual_seed(1)).to(DEV)
        want, _ = step_logits(model, prompt, 8)
        spade.hf.apply(model, method="full")
        got, _ = step_logits(model, prompt, 8)
        spade.hf.remove(model)
        scale = float(want.float().abs().max())
        self.assertLess(float((got.float() - want.float()).abs().max()), 0.05 * scale)
        spade.hf.apply(model, method="quest", budget=128, dense_layers=1)
        q, _ = step_logits(model, prompt, 8)
        spade.hf.remove(model)
        self.assertTrue(bool(torch.isfinite(q.float()).all()))

    def test_every_method(self):
        """Each method of the hook decodes on the GPU (its CUDA selectors and sparse_attention):
        finite logits, fewer rows read than full, one tokens_per_head row per decode step, and
        a budget past the context reads every row (the dense path: full's logits, to the last
        bits that DecodeAttention's split schedule may vary).
        The selections against spade's C++ path are test_hf.py's (CPU)."""
        try:
            import spade.hf
            from test_hf import TINY_TEXT, step_logits, tiny_llama
        except ImportError as e:
            self.skipTest(f"transformers unavailable ({e})")
        model = tiny_llama(hidden=512, heads=8, kv_heads=2, layers=4).to(DEV, torch.bfloat16)
        prompt = torch.randint(0, 96, (2, 300), generator=torch.Generator().manual_seed(1)).to(DEV)
        spade.hf.apply(model, method="full")
        full, _ = step_logits(model, prompt, 6)
        for spec in ("streaming:budget=128", "quest:budget=128,dense_layers=1",
                     "tidal:budget=128", "lessismore:budget=128",
                     "lycheecluster:chunking=fixed,budget=128,sink=4,buffer=32",
                     "lycheecluster:budget=128,sink=4,buffer=32",
                     "oracle-topk:budget=128",
                     "oracle-topp:p=0.8", "twilight:budget=128,dense_layers=1",
                     "twilight:base=tidal,budget=128"):
            with self.subTest(spec=spec):
                spade.hf.apply(model, spec, token_text=TINY_TEXT)
                got, _ = step_logits(model, prompt, 6)
                st = spade.hf.stats(model)
                self.assertTrue(bool(torch.isfinite(got.float()).all()))
                self.assertLess(st["density"], 0.95)
                self.assertEqual(len(st["tokens_per_head"]), 6)
                self.assertEqual(len(st["tokens_per_head"][0]), 2)
        for spec in ("streaming:budget=4096", "tidal:budget=4096", "oracle-topk:budget=4096"):
            with self.subTest(spec=spec):
                spade.hf.apply(model, spec)
                wide, _ = step_logits(model, prompt, 6)
                self.assertEqual(spade.hf.stats(model)["density"], 1.0)
                # full's path; DecodeAttention's split schedule may vary the last bits
                scale = float(full.float().abs().max())
                self.assertLess(float((wide.float() - full.float()).abs().max()), 0.02 * scale)
        spade.hf.remove(model)


def bench(cxx_file=None):
    """decode_attention run() at bench_attention's decode shapes; JSON lines on stdout."""
    Hq, Hkv, D, P = 32, 8, 128, 16
    cxx = {}
    if cxx_file:
        for line in open(cxx_file):
            if line.strip():
                r = json.loads(line)
                if r.get("kind") == "decode" and r.get("kernel") == "auto":
                    cxx[(r["L"], r["B"])] = r["us"]
    shapes = os.environ.get("SPADE_BENCH_SHAPES")
    want = None if not shapes else {tuple(int(x) for x in s.split(":")) for s in shapes.split(",")}
    for L in (8192, 32768, 131072):
        for B in (1, 8, 32):
            if want is not None and (L, B) not in want:
                continue
            pages_per_seq = (L + P - 1) // P
            n_pages = B * pages_per_seq
            cache_bytes = n_pages * Hkv * P * D * 2 * 2
            free, _ = torch.cuda.mem_get_info()
            budget = max(0, free - (6 << 30))
            if cache_bytes > budget:
                print(f"decode L={L} B={B}: does not fit, skipped", file=sys.stderr)
                continue
            nbuf = max(1, min((400 << 20) // cache_bytes + 1, budget // cache_bytes))
            gen = torch.Generator(device=DEV).manual_seed(100)
            ks = [torch.randn(n_pages, Hkv, P, D, device=DEV, generator=gen).bfloat16()
                  for _ in range(nbuf)]
            vs = [torch.randn(n_pages, Hkv, P, D, device=DEV, generator=gen).bfloat16()
                  for _ in range(nbuf)]
            q = torch.randn(B, Hq, D, device=DEV, generator=gen).bfloat16()
            out = torch.empty_like(q)
            perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(1)).to(torch.int32)
            ip = torch.arange(0, n_pages + 1, pages_per_seq, dtype=torch.int32)
            ln = torch.full((B,), L, dtype=torch.int32)
            w = ops.DecodeAttention(B, Hq, Hkv, D, P, device=DEV, max_pages=n_pages)
            w.plan(ip, perm, ln)
            for i in range(3 * nbuf):
                w.run(q, ks[i % nbuf], vs[i % nbuf], out=out)
            torch.cuda.synchronize()
            calls = max(nbuf, 8) // nbuf * nbuf
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def timed(launch):
                per = []
                for _ in range(30):
                    a.record()
                    launch()
                    b.record()
                    b.synchronize()
                    per.append(a.elapsed_time(b) * 1000.0 / calls)
                return per

            def eager():
                for i in range(calls):
                    w.run(q, ks[i % nbuf], vs[i % nbuf], out=out)

            per_eager = timed(eager)
            # The same calls captured in a CUDA graph: the kernels' time without Python's
            # per-call overhead (run() checks its arguments; a decode loop captures it).
            g = torch.cuda.CUDAGraph()
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                eager()
                with graph_ctx(g, st):
                    eager()
            torch.cuda.current_stream().wait_stream(st)
            torch.cuda.synchronize()
            per = timed(g.replay)
            us = statistics.median(per)
            nbytes = B * L * Hkv * D * 2 * 2 + 2.0 * B * Hq * D * 2
            rec = {"kind": "decode", "impl": "spade.ops", "L": L, "B": B, "Hq": Hq, "Hkv": Hkv,
                   "D": D, "page": P, "page_order": "shuffled", "buffers": nbuf,
                   "us": round(us, 3), "us_min": round(min(per), 3),
                   "us_eager": round(statistics.median(per_eager), 3),
                   "GBps": round(nbytes / us * 1e-3, 1)}
            if (L, B) in cxx:
                rec["cxx_us"] = cxx[(L, B)]
                rec["ratio"] = round(us / cxx[(L, B)], 4)
            print(json.dumps(rec), flush=True)
            ks = vs = w = g = None  # free the caches before the next shape
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if not ENABLED:
        print(f"skipped: {WHY}")
        sys.exit(77)
    if "--bench" in sys.argv:
        i = sys.argv.index("--cxx") if "--cxx" in sys.argv else -1
        bench(sys.argv[i + 1] if i >= 0 else None)
        sys.exit(0)
    unittest.main()

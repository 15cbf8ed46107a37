#!/usr/bin/env python3
"""CPU tests of spade's kernel API (python/spade/ops.py, docs/python.md "Kernel API"):
  - decode_attention against a naive torch reference: fp32 (relative error ~1e-5) and bf16
    (the reference in fp32 from the same bf16 inputs, rounded once: within one bf16 ulp),
    GQA, ragged lengths, permuted and unused pages, scale; the DecodeAttention plan/run object;
  - sparse_attention over per-head, shared and page lists against the reference restricted to
    the list (duplicates count twice); a full list is decode_attention bit for bit;
  - quest_meta / quest_select, topk_select / tidal_select and lessismore_select against naive
    implementations, ties included (integer-valued data make every sum exact, so ties are
    real: the lower position / page wins; NaN ranks last); twilight_prune on peaked attention
    (exactly the hot tokens), its kept mass on random data, page lists = their tokens; the
    LycheeCluster index (ClusterIndex: a planted chunk found, whole chunks within budget,
    insert);
  - shape / dtype / device / index errors name the argument.
Runs with `python3 -m pytest tests/python/test_ops.py` or as a script (ctest python_ops, via
scripts/python_test.sh with PYTHONPATH=<build>/python); without torch or the built package
every test is skipped and the script exits 77 (ctest's SKIP_RETURN_CODE).
"""
import math
import sys
import unittest

try:
    import torch
    HAVE_TORCH, WHY = True, ""
except ImportError as e:
    HAVE_TORCH, WHY = False, f"torch unavailable ({e})"
try:
    import spade
    import spade.ops as ops
    HAVE_SPADE = True
except ImportError as e:
    HAVE_SPADE = False
    WHY = WHY or f"spade package not built ({e})"

ENABLED = HAVE_TORCH and HAVE_SPADE


def make_batch(lens, Hkv, P, D, dtype=torch.float32 if HAVE_TORCH else None, extra_pages=3,
               seed=0, ints=False):
    """A paged cache holding len(lens) requests in shuffled pages, plus unused pages."""
    g = torch.Generator().manual_seed(seed)
    npg = [(n + P - 1) // P for n in lens]
    total = sum(npg)
    N = total + extra_pages
    perm = torch.randperm(N, generator=g)[:total].to(torch.int32)
    indptr = torch.tensor([0] + [sum(npg[:i + 1]) for i in range(len(npg))], dtype=torch.int32)
    if ints:
        k = torch.randint(-4, 5, (N, Hkv, P, D), generator=g).float()
        v = torch.randint(-4, 5, (N, Hkv, P, D), generator=g).float()
    else:
        k = torch.randn(N, Hkv, P, D, generator=g)
        v = torch.randn(N, Hkv, P, D, generator=g)
    return (k.to(dtype), v.to(dtype), indptr, perm, torch.tensor(lens, dtype=torch.int32))


def rows_of(cache, indptr, indices, b, L):
    """[Hkv, L, D] fp32 rows of request b."""
    P = cache.shape[2]
    n = (L + P - 1) // P
    pages = indices[int(indptr[b]):int(indptr[b]) + n].long()
    c = cache[pages].float()
    return c.permute(1, 0, 2, 3).reshape(cache.shape[1], n * P, cache.shape[3])[:, :L]


def ref_attention(q, k, v, indptr, indices, lens, scale=None, positions=None):
    """Naive fp32 (float64 softmax) attention; positions(b, h) -> list of rows, or all."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        kb, vb = rows_of(k, indptr, indices, b, L), rows_of(v, indptr, indices, b, L)
        for h in range(Hkv):
            rows = torch.arange(L) if positions is None else torch.tensor(positions(b, h),
                                                                         dtype=torch.long)
            kr, vr = kb[h, rows].double(), vb[h, rows].double()
            for g in range(G):
                s = (kr @ q[b, h * G + g].double()) * scale
                out[b, h * G + g] = torch.softmax(s, 0) @ vr
    return out


def close(test, got, want, rtol, atol):
    err = (got.double() - want.double()).abs()
    bound = atol + rtol * want.double().abs()
    worst = float((err - bound).max())
    test.assertLessEqual(worst, 0.0, f"max error {float(err.max()):.3g} past rtol {rtol} / atol {atol}")


def naive_topk(score, lo, hi, k):
    """The k best of positions [lo, hi) by score: higher first, ties lower position, NaN last."""
    pos = list(range(lo, hi))
    pos.sort(key=lambda p: (1, 0, p) if math.isnan(score[p]) else (0, -score[p], p))
    return pos[:k]


@unittest.skipUnless(ENABLED, WHY)
class DecodeAttentionTest(unittest.TestCase):
    def check(self, lens, Hq, Hkv, P, D, dtype, rtol, atol, scale=None, seed=0):
        k, v, ip, ix, ln = make_batch(lens, Hkv, P, D, dtype, seed=seed)
        q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        got = ops.decode_attention(q, k, v, ip, ix, ln, scale=scale)
        self.assertEqual(got.dtype, dtype)
        self.assertEqual(tuple(got.shape), (len(lens), Hq, D))
        close(self, got, ref_attention(q, k, v, ip, ix, ln, scale), rtol, atol)
        return q, k, v, ip, ix, ln, got

    def test_fp32_gqa_ragged(self):
        for Hq, Hkv in ((4, 4), (8, 2), (6, 1)):
            self.check([1, 7, 16, 33, 50], Hq, Hkv, 16, 32, torch.float32, 1e-5, 1e-6)
        self.check([3, 9, 12], 8, 2, 4, 64, torch.float32, 1e-5, 1e-6, scale=0.3)

    def test_bf16_within_one_rounding(self):
        # The reference from the same bf16 inputs in fp32/fp64, vs spade's fp32 result rounded
        # to bf16 once: within one bf16 ulp (2^-8 relative) of the exact value.
        self.check([5, 40, 17], 8, 2, 16, 64, torch.bfloat16, 2.0 ** -8, 1e-6)

    def test_page_permutation_is_invisible(self):
        q, k, v, ip, ix, ln, got = self.check([20, 35], 4, 2, 8, 16, torch.float32, 1e-5, 1e-6)
        # The same rows in other physical pages: bit-identical output.
        perm = torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(5))
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        k2, v2 = k[perm].contiguous(), v[perm].contiguous()
        ix2 = inv[ix.long()].to(torch.int32)
        self.assertTrue(torch.equal(ops.decode_attention(q, k2, v2, ip, ix2, ln), got))

    def test_plan_run_object(self):
        k, v, ip, ix, ln = make_batch([9, 30, 4], 2, 8, 32)
        q = torch.randn(3, 8, 32)
        w = ops.DecodeAttention(4, 8, 2, 32, 8)
        with self.assertRaisesRegex(spade.Error, "before plan"):
            w.run(q, k, v)
        w.plan(ip, ix, ln)
        out = torch.empty_like(q)
        self.assertIs(w.run(q, k, v, out=out), out)
        self.assertTrue(torch.equal(out, ops.decode_attention(q, k, v, ip, ix, ln)))
        self.assertEqual(w.arena_bytes, 0)
        with self.assertRaisesRegex(spade.Error, r"q must have shape \(3, 8, 32\)"):
            w.run(q[:2].contiguous(), k, v)
        with self.assertRaisesRegex(spade.Error, "max_batch"):
            ops.DecodeAttention(2, 8, 2, 32, 8).plan(ip, ix, ln)
        with self.assertRaisesRegex(spade.Error, "num_qo_heads"):
            ops.DecodeAttention(2, 6, 4, 32, 8)
        with self.assertRaisesRegex(spade.Error, "past k_cache"):
            w.run(q, k[:2].contiguous(), v[:2].contiguous())

    def test_errors_name_the_argument(self):
        k, v, ip, ix, ln = make_batch([9, 12], 2, 4, 16)
        q = torch.randn(2, 4, 16)
        with self.assertRaisesRegex(TypeError, "q must be a torch.Tensor"):
            ops.decode_attention(q.numpy(), k, v, ip, ix, ln)
        with self.assertRaisesRegex(TypeError, "k_cache must be float32"):
            ops.decode_attention(q, k.double(), v, ip, ix, ln)
        with self.assertRaisesRegex(TypeError, "q must be float32 or bfloat16"):
            ops.decode_attention(q.half(), k, v, ip, ix, ln)
        with self.assertRaisesRegex(TypeError, "kv_indices must be int32"):
            ops.decode_attention(q, k, v, ip, ix.long(), ln)
        with self.assertRaisesRegex(spade.Error, "v_cache must have 4 dimensions"):
            ops.decode_attention(q, k, v[0], ip, ix, ln)
        with self.assertRaisesRegex(spade.Error, "head dim"):
            ops.decode_attention(torch.randn(2, 4, 8), k, v, ip, ix, ln)
        with self.assertRaisesRegex(spade.Error, "not a multiple"):
            ops.decode_attention(torch.randn(2, 3, 16), k, v, ip, ix, ln)
        with self.assertRaisesRegex(spade.Error, "kv_lens must have 2 entries"):
            ops.decode_attention(q, k, v, ip, ix, ln[:1].clone())
        with self.assertRaisesRegex(spade.Error, "contiguous"):
            ops.decode_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, ip, ix, ln)
        with self.assertRaisesRegex(spade.Error, r"request 1 holds 40 tokens but has 3 pages"):
            ops.decode_attention(q, k, v, ip, ix, torch.tensor([9, 40], dtype=torch.int32))
        with self.assertRaisesRegex(spade.Error, r"kv_indptr\[-1\] = .* is past kv_indices"):
            ops.decode_attention(q, k, v, ip, ix[:-1].clone(), ln)
        bad = ix.clone()
        bad[1] = k.shape[0]
        with self.assertRaisesRegex(spade.Error, r"kv_indices\[1\] = .* outside the cache"):
            ops.decode_attention(q, k, v, ip, bad, ln)
        with self.assertRaisesRegex(spade.Error, r"kv_lens\[0\] = 0"):
            ops.decode_attention(q, k, v, ip, ix, torch.tensor([0, 9], dtype=torch.int32))
        with self.assertRaisesRegex(spade.Error, "out must have shape"):
            ops.decode_attention(q, k, v, ip, ix, ln, out=torch.empty(2, 4, 8))
        with self.assertRaisesRegex(spade.Error, "not meta"):
            ops.decode_attention(q.to("meta"), k, v, ip, ix, ln)
        if not ops.have_cuda():
            self.assertFalse(spade._core.ops_have_cuda())


@unittest.skipUnless(ENABLED, WHY)
class SparseAttentionTest(unittest.TestCase):
    def setUp(self):
        self.lens = [13, 40, 7]
        self.Hq, self.Hkv, self.P, self.D = 8, 2, 8, 32
        self.k, self.v, self.ip, self.ix, self.ln = make_batch(self.lens, self.Hkv, self.P, self.D)
        self.q = torch.randn(3, self.Hq, self.D, generator=torch.Generator().manual_seed(9))

    def lists(self, per_head):
        g = torch.Generator().manual_seed(3)
        rows = {}
        for b, L in enumerate(self.lens):
            for h in range(self.Hkv if per_head else 1):
                n = int(torch.randint(1, L + 1, (1,), generator=g))
                rows[b, h] = torch.randperm(L, generator=g)[:n].tolist()  # any order
        if not per_head:
            rows = {(b, h): rows[b, 0] for b in range(3) for h in range(self.Hkv)}
        flat = [rows[b, h] for b in range(3) for h in (range(self.Hkv) if per_head else [0])]
        off = torch.tensor([0] + [sum(len(x) for x in flat[:i + 1]) for i in range(len(flat))],
                           dtype=torch.int32)
        idx = torch.tensor([p for x in flat for p in x], dtype=torch.int32)
        return off, idx, rows

    def test_token_lists_per_head_and_shared(self):
        for per_head in (True, False):
            off, idx, rows = self.lists(per_head)
            got = ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, off, idx)
            want = ref_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln,
                                 positions=lambda b, h: rows[b, h])
            close(self, got, want, 1e-5, 1e-6)

    def test_duplicates_count_twice(self):
        off = torch.tensor([0, 3, 5, 6, 8, 9, 10], dtype=torch.int32)
        idx = torch.tensor([2, 2, 5, 0, 1, 39, 39, 3, 6, 6], dtype=torch.int32)
        rows = {(0, 0): [2, 2, 5], (0, 1): [0, 1], (1, 0): [39], (1, 1): [39, 3], (2, 0): [6],
                (2, 1): [6]}
        got = ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, off, idx)
        close(self, got, ref_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln,
                                       positions=lambda b, h: rows[b, h]), 1e-5, 1e-6)

    def test_full_lists_equal_decode_attention(self):
        off = torch.tensor([0] + [sum(self.lens[:b + 1]) for b in range(3)], dtype=torch.int32)
        idx = torch.cat([torch.arange(L) for L in self.lens]).to(torch.int32)
        got = ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, off, idx)
        self.assertTrue(torch.equal(got, ops.decode_attention(self.q, self.k, self.v, self.ip,
                                                              self.ix, self.ln)))

    def test_page_lists_equal_token_lists(self):
        # Page u names tokens [u * P, (u + 1) * P) clipped to the length.
        pages = {(0, 0): [1], (0, 1): [0, 1], (1, 0): [4, 0], (1, 1): [2], (2, 0): [0],
                 (2, 1): [0]}
        toks = {key: [t for u in us for t in range(u * self.P, min((u + 1) * self.P,
                                                                     self.lens[key[0]]))]
                for key, us in pages.items()}

        def csr(d):
            flat = [d[b, h] for b in range(3) for h in range(self.Hkv)]
            off = [0]
            for x in flat:
                off.append(off[-1] + len(x))
            return (torch.tensor(off, dtype=torch.int32),
                    torch.tensor([p for x in flat for p in x], dtype=torch.int32))

        a = ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, *csr(pages),
                                 granularity="page")
        b = ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, *csr(toks))
        self.assertTrue(torch.equal(a, b))

    def test_plan_run_object_and_errors(self):
        off, idx, _ = self.lists(True)
        w = ops.SparseAttention(4, self.Hq, self.Hkv, self.D, self.P)
        w.plan(self.ip, self.ix, self.ln, max_entries=40)
        want = ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, off, idx)
        self.assertTrue(torch.equal(w.run(self.q, self.k, self.v, off, idx), want))
        w.plan(self.ip, self.ix, self.ln, max_entries=1)
        with self.assertRaisesRegex(spade.Error, "more than its planned bound"):
            w.run(self.q, self.k, self.v, off, idx)
        with self.assertRaisesRegex(spade.Error, "sel_indptr has 5 entries"):
            ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln,
                                 off[:5].clone(), idx)
        bad = idx.clone()
        bad[0] = 13  # request 0 holds 13 tokens
        with self.assertRaisesRegex(spade.Error, r"sel_indices\[0\] = 13 is outside request 0"):
            ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, off, bad)
        empty = off.clone()
        empty[1] = 0
        with self.assertRaisesRegex(spade.Error, "selection list 0 .* is empty"):
            ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, empty, idx)
        with self.assertRaisesRegex(spade.Error, "granularity"):
            ops.sparse_attention(self.q, self.k, self.v, self.ip, self.ix, self.ln, off, idx,
                                 granularity="block")


@unittest.skipUnless(ENABLED, WHY)
class SelectorTest(unittest.TestCase):
    def test_quest_meta_and_select(self):
        lens, Hq, Hkv, P, D = [70, 16, 33, 5, 100], 8, 2, 16, 16
        for dtype in (torch.float32, torch.bfloat16):
            k, v, ip, ix, ln = make_batch(lens, Hkv, P, D, dtype, ints=True, seed=4)
            q = torch.randint(-3, 4, (len(lens), Hq, D),
                              generator=torch.Generator().manual_seed(2)).float().to(dtype)
            meta = ops.quest_meta(k, ip, ix, ln)
            self.assertEqual(tuple(meta.shape), (k.shape[0], Hkv, 2, D))
            for kp in (1, 2, 3, 9):
                off, idx = ops.quest_select(q, meta, ip, ix, ln, kp, page_size=P)
                self.assertEqual(idx.numel(), len(lens) * Hkv * kp)
                want_off, want_idx = [0], []
                for b, L in enumerate(lens):
                    rows = rows_of(k, ip, ix, b, L)  # [Hkv, L, D]
                    n = (L + P - 1) // P
                    for h in range(Hkv):
                        # meta of the request's pages: min / max of their filled rows
                        for i in range(n):
                            pg = int(ix[int(ip[b]) + i])
                            blk = rows[h, i * P:min((i + 1) * P, L)]
                            self.assertTrue(torch.equal(meta[pg, h, 0].float(), blk.min(0).values))
                            self.assertTrue(torch.equal(meta[pg, h, 1].float(), blk.max(0).values))
                        if n <= kp:
                            sel = list(range(n))
                        else:
                            G = Hq // Hkv
                            qg = q[b, h * G:(h + 1) * G].float()
                            score = []
                            for i in range(n - 1):
                                blk = rows[h, i * P:(i + 1) * P]
                                mn, mx = blk.min(0).values, blk.max(0).values
                                score.append(float(torch.maximum(qg * mx, qg * mn).sum(1).max()))
                            sel = sorted(naive_topk(score, 0, n - 1, kp - 1)) + [n - 1]
                        want_idx += sel
                        want_off.append(len(want_idx))
                self.assertEqual(off.tolist(), want_off, (dtype, kp))
                self.assertEqual(idx[:want_off[-1]].tolist(), want_idx, (dtype, kp))
                self.assertTrue(bool((idx[want_off[-1]:] == -1).all()))
                # The lists feed sparse_attention as pages.
                o = ops.sparse_attention(q, k, v, ip, ix, ln, off, idx, granularity="page")
                self.assertEqual(tuple(o.shape), tuple(q.shape))

    def test_quest_update_meta_empty_page(self):
        k = torch.randn(3, 2, 4, 8)
        meta = torch.zeros(3, 2, 2, 8)
        ops.quest_update_meta(k, meta, torch.tensor([2, 0], dtype=torch.int32),
                              torch.tensor([0, 3], dtype=torch.int32))
        self.assertTrue(bool((meta[2, :, 0] == math.inf).all() and (meta[2, :, 1] == -math.inf).all()))
        self.assertTrue(torch.equal(meta[0, :, 1], k[0, :, :3].max(1).values))
        self.assertTrue(bool((meta[1] == 0).all()))
        with self.assertRaisesRegex(spade.Error, "n_valid"):
            ops.quest_update_meta(k, meta, torch.tensor([0], dtype=torch.int32),
                                  torch.tensor([5], dtype=torch.int32))

    def test_topk_and_tidal_with_ties_and_nan(self):
        g = torch.Generator().manual_seed(7)
        B, Hq, Hkv, ld = 3, 6, 2, 50
        scores = torch.randint(-3, 4, (B, Hq, ld), generator=g).float()  # many ties
        scores[0, 0, 5] = float("nan")
        lens = torch.tensor([50, 9, 31], dtype=torch.int32)
        for k in (1, 4, 9, 60):
            off, idx = ops.topk_select(scores, lens, k)
            want = [0]
            for b in range(B):
                for h in range(Hq):
                    s = scores[b, h].tolist()
                    sel = sorted(naive_topk(s, 0, int(lens[b]), k))
                    self.assertEqual(idx[want[-1]:want[-1] + len(sel)].tolist(), sel, (b, h, k))
                    want.append(want[-1] + len(sel))
            self.assertEqual(off.tolist(), want)
        # tidal: the group mean (head order, then * 1/G) ranks the tokens of each KV head.
        off, idx = ops.tidal_select(scores, lens, 5, num_kv_heads=Hkv)
        mean = ops.group_mean(scores, Hkv)
        G = Hq // Hkv
        self.assertTrue(torch.allclose(mean, scores.view(B, Hkv, G, ld).sum(2) * (1.0 / G),
                                       rtol=0, atol=0, equal_nan=True))
        o2, i2 = ops.topk_select(mean, lens, 5)
        self.assertTrue(torch.equal(off, o2) and torch.equal(idx, i2))

    def test_lessismore(self):
        g = torch.Generator().manual_seed(8)
        B, Hq, ld = 3, 4, 64
        scores = torch.randint(-5, 6, (B, Hq, ld), generator=g).float()
        lens = torch.tensor([64, 20, 41], dtype=torch.int32)
        budget, sinks = 24, 2
        n_recent = 6  # round(24 * 0.25)
        off, idx = ops.lessismore_select(scores, lens, budget, recent_ratio=0.25, sinks=sinks)
        want = [0]
        for b in range(B):
            L = int(lens[b])
            if L <= budget:
                sel = list(range(L))
            else:
                hi, n_uni = L - n_recent, budget - n_recent - sinks
                tops = [naive_topk(scores[b, h].tolist(), sinks, hi, n_uni) for h in range(Hq)]
                merged = []
                for r in range(len(tops[0])):
                    for h in range(Hq):
                        if len(merged) < n_uni and tops[h][r] not in merged:
                            merged.append(tops[h][r])
                sel = list(range(sinks)) + sorted(merged) + list(range(hi, L))
            self.assertEqual(idx[want[-1]:want[-1] + len(sel)].tolist(), sel, b)
            want.append(want[-1] + len(sel))
        self.assertEqual(off.tolist(), want)
        with self.assertRaisesRegex(spade.Error, "must exceed"):
            ops.lessismore_select(scores, lens, 8, recent_ratio=0.5, sinks=4)

    def test_twilight_prune(self):
        # Peaked attention: each (request, KV head) has 3 hot tokens in its list whose keys lie
        # along the group's query, so their estimated mass is ~1 and p = 0.95 keeps exactly
        # them (in list order); page lists give the same as their tokens.
        B, Hq, Hkv, P, D = 2, 4, 2, 8, 32
        lens = [40, 29]
        k, v, ip, ix, ln = make_batch(lens, Hkv, P, D, seed=11)
        k *= 0.05
        g = torch.Generator().manual_seed(12)
        q = torch.zeros(B, Hq, D)
        lists, hot = {}, {}
        for b, L in enumerate(lens):
            for h in range(Hkv):
                dirn = torch.randn(D, generator=g)
                dirn /= dirn.norm()
                q[b, 2 * h:2 * h + 2] = 8.0 * dirn
                lst = torch.randperm(L, generator=g)[:12].tolist()
                lists[b, h], hot[b, h] = lst, lst[2:5]
                for t in hot[b, h]:
                    page = int(ix[int(ip[b]) + t // P])
                    k[page, h, t % P] = 8.0 * dirn
        flat = [lists[b, h] for b in range(B) for h in range(Hkv)]
        off = torch.tensor([0] + [12 * (i + 1) for i in range(len(flat))], dtype=torch.int32)
        idx = torch.tensor([t for x in flat for t in x], dtype=torch.int32)
        kept_off, kept = ops.twilight_prune(q, k, ip, ix, ln, off, idx, p=0.95)
        for i, (b, h) in enumerate((b, h) for b in range(B) for h in range(Hkv)):
            got = kept[int(kept_off[i]):int(kept_off[i + 1])].tolist()
            self.assertEqual(got, hot[b, h], (b, h))
        # Random data: the kept tokens hold >= p - 0.05 of the exact attention mass of every
        # query head over its list, and a lower p keeps fewer tokens.
        q = torch.randn(B, Hq, D, generator=g)
        k2, _, _, _, _ = make_batch(lens, Hkv, P, D, seed=13)
        o_hi, k_hi = ops.twilight_prune(q, k2, ip, ix, ln, off, idx, p=0.95, scale=1.0)
        o_lo, k_lo = ops.twilight_prune(q, k2, ip, ix, ln, off, idx, p=0.5, scale=1.0)
        self.assertLess(int(o_lo[-1]), int(o_hi[-1]))
        for i, (b, h) in enumerate((b, h) for b in range(B) for h in range(Hkv)):
            rows = rows_of(k2, ip, ix, b, lens[b])[h]
            keep = set(k_hi[int(o_hi[i]):int(o_hi[i + 1])].tolist())
            for gq in (2 * h, 2 * h + 1):
                w = torch.softmax(rows[lists[b, h]].double() @ q[b, gq].double(), 0)
                mass = sum(float(w[j]) for j, t in enumerate(lists[b, h]) if t in keep)
                self.assertGreaterEqual(mass, 0.90, (b, h, gq))
        # Page lists: the same as the tokens they name.
        pages = torch.tensor([0, 2, 1, 3, 0, 1, 2, 3], dtype=torch.int32)
        poff = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32)
        a = ops.twilight_prune(q, k2, ip, ix, ln, poff, pages, granularity="page")
        toks = [[t for u in pages[2 * i:2 * i + 2].tolist()
                 for t in range(u * P, min((u + 1) * P, lens[i // Hkv]))] for i in range(4)]
        toff = torch.tensor([0] + [sum(len(x) for x in toks[:i + 1]) for i in range(4)],
                            dtype=torch.int32)
        b_ = ops.twilight_prune(q, k2, ip, ix, ln, toff,
                                torch.tensor([t for x in toks for t in x], dtype=torch.int32))
        self.assertTrue(torch.equal(a[0], b_[0]))
        self.assertEqual(a[1][:int(a[0][-1])].tolist(), b_[1][:int(b_[0][-1])].tolist())
        with self.assertRaisesRegex(spade.Error, "sel_indptr must have 5 entries"):
            ops.twilight_prune(q, k2, ip, ix, ln, off[:3].clone(), idx)

    def test_cluster_index(self):
        # A planted chunk (keys along the query) is the one chunk a budget of one chunk takes;
        # results are whole chunks within the budget, ascending; a budget past the context
        # takes every chunk; insert() adds the next chunk.
        g = torch.Generator().manual_seed(21)
        L, D, C = 200, 32, 8
        keys = torch.randn(L, D, generator=g)
        d = torch.randn(D, generator=g)
        d /= d.norm()
        keys[40:48] = 20 * d + 0.1 * torch.randn(8, D, generator=g)  # beats loose bounds
        st = torch.arange(0, L + 1, C, dtype=torch.int32)
        ix = ops.ClusterIndex().build(keys.bfloat16(), st)
        self.assertEqual(ix.n_chunks, 25)
        self.assertTrue(1 <= ix.n_coarse <= ix.n_fine <= 25)
        q = (3 * d).repeat(4, 1)
        # (A fine cluster's chunks are taken in position order: with ~2 chunks per cluster the
        # planted chunk comes with its cluster mates; with one chunk per cluster, alone.)
        self.assertTrue(set(range(40, 48)) <= set(ix.search(q, 32, st).tolist()))
        one = ops.ClusterIndex(chunks_per_fine=1.0).build(keys, st)
        self.assertEqual(one.search(q, 8, st).tolist(), list(range(40, 48)))
        for budget in (8, 30, 77):
            pos = ix.search(q, budget, st).tolist()
            self.assertLessEqual(len(pos), budget)
            self.assertEqual(pos, sorted(set(pos)))
            chunks = {p // C for p in pos}
            self.assertEqual(len(pos), C * len(chunks))  # whole chunks
        self.assertEqual(ix.search(q, 10_000, st).tolist(), list(range(L)))
        keys2 = torch.cat([keys, 6 * d + 0.1 * torch.randn(5, D, generator=g)])
        st2 = torch.cat([st, torch.tensor([205], dtype=torch.int32)])
        ix.insert(keys2, st2)
        self.assertEqual(ix.n_chunks, 26)
        self.assertEqual(ix.search(q, 10_000, st2).tolist(), list(range(205)))
        with self.assertRaisesRegex(spade.Error, "before build"):
            ops.ClusterIndex().search(q, 8, st)
        with self.assertRaisesRegex(spade.Error, "increase strictly"):
            ops.ClusterIndex().build(keys, torch.tensor([0, 8, 8, 16], dtype=torch.int32))
        with self.assertRaisesRegex(spade.Error, "past the keys"):
            ops.ClusterIndex().build(keys, torch.tensor([0, 300], dtype=torch.int32))
        with self.assertRaisesRegex(spade.Error, "must have 28 entries"):
            ix.insert(keys2, st2)
        with self.assertRaisesRegex(spade.Error, "head dim"):
            ix.search(torch.randn(2, 16), 8, st2)

    def test_decode_scores(self):
        k, v, ip, ix, ln = make_batch([9, 20], 2, 4, 16)
        q = torch.randn(2, 8, 16)
        s = ops.decode_scores(q, k, ip, ix, ln, ld=24)
        self.assertEqual(tuple(s.shape), (2, 8, 24))
        rows = rows_of(k, ip, ix, 1, 20)
        want = (q[1, 5] @ rows[1].T) / 4.0  # head 5 reads KV head 1; scale 1/sqrt(16)
        close(self, s[1, 5, :20], want, 1e-6, 1e-6)
        self.assertTrue(bool((s[0, :, 9:] == -math.inf).all()))

    def test_selector_errors(self):
        with self.assertRaisesRegex(TypeError, "scores must be float32"):
            ops.topk_select(torch.zeros(1, 1, 4, dtype=torch.float64),
                            torch.tensor([4], dtype=torch.int32), 2)
        with self.assertRaisesRegex(spade.Error, "kv_lens must have 1 entries"):
            ops.topk_select(torch.zeros(1, 1, 4), torch.tensor([4, 4], dtype=torch.int32), 2)
        with self.assertRaisesRegex(spade.Error, r"row 0 has 5 entries, outside \[0, 4\]"):
            ops.topk_select(torch.zeros(1, 1, 4), torch.tensor([5], dtype=torch.int32), 2)
        with self.assertRaisesRegex(spade.Error, "k must be a positive int"):
            ops.topk_select(torch.zeros(1, 1, 4), torch.tensor([4], dtype=torch.int32), 0)


@unittest.skipUnless(ENABLED and getattr(ops, "TORCH_LIBRARY", False) if ENABLED else False,
                     "torch.library.custom_op needs torch >= 2.4")
class TorchLibraryTest(unittest.TestCase):
    def test_custom_ops(self):
        k, v, ip, ix, ln = make_batch([9, 12], 2, 4, 16)
        q = torch.randn(2, 4, 16)
        got = torch.ops.spade.decode_attention(q, k, v, ip, ix, ln, 0.25)
        self.assertTrue(torch.equal(got, ops.decode_attention(q, k, v, ip, ix, ln, scale=0.25)))
        with torch._subclasses.fake_tensor.FakeTensorMode():
            fq = torch.empty(2, 4, 16)
            fk = torch.empty(k.shape)
            i32 = dict(dtype=torch.int32)
            out = torch.ops.spade.decode_attention(fq, fk, fk, torch.empty(3, **i32),
                                                   torch.empty(ix.numel(), **i32),
                                                   torch.empty(2, **i32), 0.25)
            self.assertEqual(tuple(out.shape), (2, 4, 16))
        # torch.compile traces through the fake kernel (the eager backend: no compiler needed).
        fn = torch.compile(lambda *a: torch.ops.spade.decode_attention(*a, 0.25) * 2.0,
                           backend="eager", fullgraph=True)
        self.assertTrue(torch.equal(fn(q, k, v, ip, ix, ln), got * 2.0))
        off = torch.tensor([0, 2, 4, 5, 7], dtype=torch.int32)
        idx = torch.tensor([0, 8, 1, 2, 3, 4, 11], dtype=torch.int32)
        sp = torch.ops.spade.sparse_attention(q, k, v, ip, ix, ln, off, idx, 1, 0.25)
        self.assertTrue(torch.equal(sp, ops.sparse_attention(q, k, v, ip, ix, ln, off, idx,
                                                             scale=0.25)))


if __name__ == "__main__":
    if not ENABLED:
        print(f"skipped: {WHY}")
        sys.exit(77)
    unittest.main()

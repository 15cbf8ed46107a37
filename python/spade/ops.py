"""spade.ops: spade's attention kernels and sparse selectors as functions on torch tensors.

FlashInfer's paged layout. A layer's KV cache is two tensors k_cache, v_cache
[num_pages, Hkv, page_size, D] (the layout of spade's GPU cache); request b of a batch owns
the pages kv_indices[kv_indptr[b]:kv_indptr[b+1]] (int32) in token order and holds
kv_lens[b] tokens (int32, >= 1): token t is row t % page_size of page
kv_indices[kv_indptr[b] + t // page_size].

Selection lists (what a selector returns and sparse_attention reads) are CSR int32 pairs
(sel_indptr, sel_indices): list i holds sel_indices[sel_indptr[i]:sel_indptr[i+1]].
sel_indptr has B * Hkv + 1 entries (one list per (request b, KV head h), list b * Hkv + h) or
B + 1 (one list per request, shared by its KV heads). Entries are token positions in
[0, kv_lens[b]) (granularity "token") or page numbers of the request (granularity "page":
entry u names tokens [u * page_size, (u + 1) * page_size) clipped to kv_lens[b]). A selector
returns sel_indices at its capacity; entries past sel_indptr[-1] are unused (-1).

CPU tensors: float32 or bfloat16 (computed in fp32; spade's CPU reference code, every index
checked). CUDA tensors (a build with the CUDA backend): bfloat16, spade's kernels on
torch.cuda.current_stream(). docs/python.md has the reference and an example.

torch is imported lazily: `import spade` works without it.
"""
import math
from typing import Optional, Sequence, Union

from . import _core

Error = _core.Error

__all__ = ["decode_attention", "sparse_attention", "DecodeAttention", "SparseAttention",
           "quest_meta", "quest_update_meta", "quest_select", "topk_select", "tidal_select",
           "twilight_prune", "ClusterIndex", "CudaClusterIndex",
           "lessismore_select", "group_mean", "decode_scores", "have_cuda", "Error"]

_F32, _BF16 = 0, 1


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        raise ImportError(f"spade.ops needs PyTorch ({e})") from e
    return torch


def have_cuda() -> bool:
    """Whether this spade build has the CUDA backend (CUDA tensors are accepted)."""
    return bool(_core.ops_have_cuda())


# ---------------------------------------------------------------------------------------------
# Argument checks: TypeError for a non-tensor or a wrong dtype, spade.Error (a ValueError) for
# shapes, devices and layouts; every message names the argument.

def _tensor(name, t, dtypes=None, ndim=None, device=None):
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {want}, not {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise Error(f"{name} must have {ndim} dimensions, not {t.dim()} (shape {tuple(t.shape)})")
    if device is not None and t.device != device:
        raise Error(f"{name} is on {t.device}, expected {device} (the device of q)")
    if not t.is_contiguous():
        raise Error(f"{name} must be contiguous (call .contiguous())")
    return t


def _index(name, t, n=None, device=None):
    """An int32 1-D index tensor (host or `device`); n: required length."""
    torch = _torch()
    _tensor(name, t, (torch.int32,), 1)
    if device is not None and t.device.type != "cpu" and t.device != device:
        raise Error(f"{name} is on {t.device}, expected the CPU or {device}")
    if n is not None and t.numel() != n:
        raise Error(f"{name} must have {n} entries, not {t.numel()}")
    return t


def _float_dtypes(device):
    torch = _torch()
    return (torch.bfloat16,) if device.type == "cuda" else (torch.float32, torch.bfloat16)


def _code(dtype):
    torch = _torch()
    return _F32 if dtype == torch.float32 else _BF16


def _check_cuda(device):
    if device.type == "cuda":
        if not have_cuda():
            raise Error("this spade build has no CUDA backend (built without nvcc): use CPU tensors")
    elif device.type != "cpu":
        raise Error(f"spade.ops runs on the CPU or CUDA, not {device.type}")


def _stream(device) -> int:
    torch = _torch()
    return int(torch.cuda.current_stream(device).cuda_stream)


def _dev_index(device) -> int:
    torch = _torch()
    return device.index if device.index is not None else torch.cuda.current_device()


def _check_qkv(q, k_cache, v_cache, q_name="q"):
    """Checks q [B, Hq, D] and the caches; returns (B, Hq, D, num_pages, Hkv, P)."""
    dev = _tensor(q_name, q).device
    _check_cuda(dev)
    _tensor(q_name, q, _float_dtypes(dev), 3)
    B, Hq, D = q.shape
    _tensor("k_cache", k_cache, (q.dtype,), 4, dev)
    _tensor("v_cache", v_cache, (q.dtype,), 4, dev)
    if k_cache.shape != v_cache.shape:
        raise Error(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    npages, Hkv, P, Dk = k_cache.shape
    if Dk != D:
        raise Error(f"k_cache's head dim {Dk} differs from {q_name}'s {D}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise Error(f"{q_name}'s {Hq} heads are not a multiple of k_cache's {Hkv} KV heads")
    if B < 1:
        raise Error(f"{q_name} holds no request (shape {tuple(q.shape)})")
    return B, Hq, D, npages, Hkv, P


def _check_idx(device, B, kv_indptr, kv_indices, kv_lens):
    idx_dev = device if device.type == "cuda" else None
    _index("kv_indptr", kv_indptr, B + 1, idx_dev)
    _index("kv_indices", kv_indices, None, idx_dev)
    _index("kv_lens", kv_lens, B, idx_dev)
    if device.type == "cpu":
        for n, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_lens", kv_lens)):
            if t.device.type != "cpu":
                raise Error(f"{n} is on {t.device}; q is on the CPU")
    if kv_indptr.device.type == "cpu" and int(kv_indptr[-1]) > kv_indices.numel():
        raise Error(f"kv_indptr[-1] = {int(kv_indptr[-1])} is past kv_indices' "
                    f"{kv_indices.numel()} entries")


def _paged(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens):
    r = _check_qkv(q, k_cache, v_cache)
    _check_idx(q.device, r[0], kv_indptr, kv_indices, kv_lens)
    return r


def _host(t):
    return t if t.device.type == "cpu" else t.cpu()


def _on(t, device):
    return t if t.device == device else t.to(device)


def _scale(scale, D):
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def _out(name, out, like):
    if out is None:
        return _torch().empty_like(like)
    _tensor(name, out, (like.dtype,), like.dim(), like.device)
    if out.shape != like.shape:
        raise Error(f"{name} must have shape {tuple(like.shape)}, not {tuple(out.shape)}")
    return out


def _gran(granularity, P):
    if granularity == "token":
        return 1
    if granularity == "page":
        return P
    if isinstance(granularity, int) and not isinstance(granularity, bool) and granularity >= 1:
        return granularity
    raise Error(f"granularity must be 'token', 'page' or a positive int, not {granularity!r}")


def _lists_per_req(sel_indptr, B, Hkv):
    n = sel_indptr.numel()
    if n == B * Hkv + 1:
        return Hkv
    if n == B + 1:
        return 1
    raise Error(f"sel_indptr has {n} entries: expected {B * Hkv + 1} (one list per request and "
                f"KV head) or {B + 1} (one list per request)")


# ---------------------------------------------------------------------------------------------
# Attention


def decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens,
                     scale: Optional[float] = None, out=None):
    """out[B, Hq, D] = softmax(q . k * scale) . v of each request's query over all its tokens.

    q [B, Hq, D]; k_cache, v_cache [num_pages, Hkv, page_size, D] (same dtype and device as
    q); query head i reads KV head i // (Hq // Hkv) (GQA). scale: default 1/sqrt(D). out:
    optional [B, Hq, D] to write. On CUDA this plans on every call (the index tensors go to
    the host: a sync) with a workspace cached per shape; a decode loop or a CUDA graph wants
    DecodeAttention (plan once per step, run per layer).
    """
    B, Hq, D, npages, Hkv, P = _paged(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens)
    out = _out("out", out, q)
    if q.device.type == "cpu":
        _core.ops_cpu_attention(_code(q.dtype), q.data_ptr(), Hq, k_cache.data_ptr(),
                                v_cache.data_ptr(), npages, Hkv, P, D, kv_indptr.data_ptr(),
                                kv_indices.data_ptr(), kv_lens.data_ptr(), B, 0, 0, 0, 1,
                                _scale(scale, D), out.data_ptr())
        return out
    ip, ix, ln = _host(kv_indptr), _host(kv_indices), _host(kv_lens)
    w = _cached(DecodeAttention, q.device, B, int(ix.numel()), Hq, Hkv, D, P)
    w._plan_host(ip, ix, ln, B)
    return w.run(q, k_cache, v_cache, out=out, scale=scale)


def sparse_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, sel_indptr,
                     sel_indices, granularity: Union[str, int] = "token",
                     scale: Optional[float] = None, out=None):
    """Decode attention of each request over the rows its selection lists name.

    Lists (module docstring): sel_indptr [B * Hkv + 1] (per KV head) or [B + 1] (shared);
    sel_indices int32 token positions ("token"), request page numbers ("page"), or units of
    n tokens (an int n). The G query heads of a KV head read its list's rows; any order, a
    duplicate counts twice, no list may be empty. CPU: every entry is checked (spade.Error).
    CUDA: granularity token or units of 16 / 64 tokens; the lists are read on the device
    (unchecked: an entry past its request's length is undefined behaviour) and their
    lengths copied to the host to plan (a sync; SparseAttention plans once for many layers).
    """
    B, Hq, D, npages, Hkv, P = _paged(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens)
    idx_dev = q.device if q.device.type == "cuda" else None
    _index("sel_indptr", sel_indptr, None, idx_dev)
    _index("sel_indices", sel_indices, None, idx_dev)
    lpr = _lists_per_req(sel_indptr, B, Hkv)
    gran = _gran(granularity, P)
    out = _out("out", out, q)
    if q.device.type == "cpu":
        for n, t in (("sel_indptr", sel_indptr), ("sel_indices", sel_indices)):
            if t.device.type != "cpu":
                raise Error(f"{n} is on {t.device}; q is on the CPU")
        if int(sel_indptr[-1]) > sel_indices.numel():
            raise Error(f"sel_indptr[-1] = {int(sel_indptr[-1])} is past sel_indices' "
                        f"{sel_indices.numel()} entries")
        _core.ops_cpu_attention(_code(q.dtype), q.data_ptr(), Hq, k_cache.data_ptr(),
                                v_cache.data_ptr(), npages, Hkv, P, D, kv_indptr.data_ptr(),
                                kv_indices.data_ptr(), kv_lens.data_ptr(), B,
                                sel_indptr.data_ptr(), sel_indices.data_ptr(), lpr, gran,
                                _scale(scale, D), out.data_ptr())
        return out
    ip, ix, ln = _host(kv_indptr), _host(kv_indices), _host(kv_lens)
    off = _host(sel_indptr).tolist()
    max_entries = [max(1, off[i + 1] - off[i]) for i in range(len(off) - 1)]
    w = _cached(SparseAttention, q.device, B, int(ix.numel()), Hq, Hkv, D, P)
    w._plan_host(ip, ix, ln, B, gran, lpr, max_entries)
    return w.run(q, k_cache, v_cache, _on(sel_indptr, q.device), _on(sel_indices, q.device),
                 out=out, scale=scale)


# Workspaces of the functional CUDA calls: one per (class, device, shape), grown as needed;
# the stream of the last call (a call on another stream first waits for the device, since
# the cached workspace's page tables are shared).
_CACHE = {}


def _cached(cls, device, B, pages, Hq, Hkv, D, P):
    torch = _torch()
    key = (cls.__name__, str(device), Hq, Hkv, D, P)
    w, stream = _CACHE.get(key, (None, None))
    if w is None or w.max_batch < B or w.max_pages < pages:
        mb = max(B, 2 * w.max_batch if w else 8)
        mp = max(pages, 2 * w.max_pages if w else 4096)
        if w is not None:
            torch.cuda.synchronize(device)
        w = cls(mb, Hq, Hkv, D, P, device=device, max_pages=mp)
    cur = _stream(device)
    if stream is not None and stream != cur:
        torch.cuda.synchronize(device)
    _CACHE[key] = (w, cur)
    return w


class _Planned:
    """The parts DecodeAttention and SparseAttention share."""

    def __init__(self, max_batch, num_qo_heads, num_kv_heads, head_dim, page_size, device,
                 max_pages):
        torch = _torch()
        self.device = torch.device(device)
        _check_cuda(self.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        for n, v in (("max_batch", max_batch), ("num_qo_heads", num_qo_heads),
                     ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                     ("page_size", page_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise Error(f"{n} must be a positive int, not {v!r}")
        if num_qo_heads % num_kv_heads:
            raise Error(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
                        f"({num_kv_heads})")
        self.max_batch, self.Hq, self.Hkv = max_batch, num_qo_heads, num_kv_heads
        self.D, self.P = head_dim, page_size
        self.max_pages = int(max_pages) if max_pages else max_batch * 8192
        self._plan = None  # (kv_indptr, kv_indices, kv_lens) on the host, B, last page id

    def _plan_args(self, kv_indptr, kv_indices, kv_lens):
        _index("kv_indptr", kv_indptr)
        _index("kv_indices", kv_indices)
        _index("kv_lens", kv_lens)
        B = kv_lens.numel()
        if not 1 <= B <= self.max_batch:
            raise Error(f"kv_lens has {B} requests, outside [1, max_batch = {self.max_batch}]")
        if kv_indptr.numel() != B + 1:
            raise Error(f"kv_indptr must have {B + 1} entries, not {kv_indptr.numel()}")
        ip, ix = _host(kv_indptr).clone(), _host(kv_indices).clone()
        if int(ip[-1]) > ix.numel():
            raise Error(f"kv_indptr[-1] = {int(ip[-1])} is past kv_indices' {ix.numel()} entries")
        return ip, ix, _host(kv_lens).clone(), B

    def _set_plan(self, ip, ix, ln, B):
        self._plan = (ip, ix, ln, B, int(ix.max()) if ix.numel() else -1)

    def _run_args(self, q, k_cache, v_cache, out):
        if self._plan is None:
            raise Error("run() before plan()")
        _check_qkv(q, k_cache, v_cache)
        if q.device != self.device:
            raise Error(f"q is on {q.device}; this object works on {self.device}")
        B, last = self._plan[3], self._plan[4]
        if tuple(q.shape) != (B, self.Hq, self.D):
            raise Error(f"q must have shape {(B, self.Hq, self.D)} (the planned batch), not "
                        f"{tuple(q.shape)}")
        if tuple(k_cache.shape[1:]) != (self.Hkv, self.P, self.D):
            raise Error(f"k_cache's shape {tuple(k_cache.shape)} is not "
                        f"[pages, {self.Hkv}, {self.P}, {self.D}]")
        if last >= k_cache.shape[0]:
            raise Error(f"the planned kv_indices name page {last}, past k_cache's "
                        f"{k_cache.shape[0]} pages")
        return _out("out", out, q)


class DecodeAttention(_Planned):
    """Plan/run decode attention (FlashInfer's BatchDecodeWithPagedKVCacheWrapper shape).

        w = spade.ops.DecodeAttention(max_batch, num_qo_heads, num_kv_heads, head_dim,
                                      page_size, device="cuda")
        w.plan(kv_indptr, kv_indices, kv_lens)                 # host int32, once per step
        for layer in range(n_layers):
            w.run(q[layer], k_cache[layer], v_cache[layer], out=o[layer])   # per layer

    CUDA: the constructor takes the workspace (split partials, page tables, counters) from a
    device arena of its own, one cudaMalloc of `arena_bytes`, sized for max_batch requests
    reading max_pages pages in all (default max_batch * 8192); plan() uploads the batch's
    page tables on the current stream and waits for them; run() only launches kernels on the
    current stream and allocates nothing when `out` is given, so it can be captured in a CUDA
    graph (replays read the planned batch). Runs of one object must not overlap (one stream).
    CPU: plan() keeps copies of the index tensors; run() is decode_attention.
    """

    def __init__(self, max_batch: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, device="cpu", max_pages: Optional[int] = None):
        super().__init__(max_batch, num_qo_heads, num_kv_heads, head_dim, page_size, device,
                         max_pages)
        self._cuda = None
        if self.device.type == "cuda":
            self._cuda = _core.CudaDecode(_dev_index(self.device), max_batch, self.max_pages,
                                          self.Hq, self.Hkv, self.D, self.P)

    @property
    def arena_bytes(self) -> int:
        """Device bytes of the workspace (0 on the CPU)."""
        return int(self._cuda.arena_bytes()) if self._cuda is not None else 0

    def plan(self, kv_indptr, kv_indices, kv_lens):
        """The batch of the next run()s: int32 tensors kv_indptr [B + 1], kv_indices,
        kv_lens [B], preferably on the host (device ones are copied to it: a sync)."""
        self._plan_host(*self._plan_args(kv_indptr, kv_indices, kv_lens))

    def _plan_host(self, ip, ix, ln, B):
        if self._cuda is not None:
            self._cuda.plan(2**62, self.Hkv, self.P, self.D, ip.data_ptr(), ix.data_ptr(),
                            ln.data_ptr(), B, _stream(self.device))
        self._set_plan(ip, ix, ln, B)

    def run(self, q, k_cache, v_cache, out=None, scale: Optional[float] = None):
        """out[B, Hq, D] for q [B, Hq, D] over the planned batch (k/v: a layer's cache)."""
        out = self._run_args(q, k_cache, v_cache, out)
        ip, ix, ln = self._plan[:3]
        if self._cuda is None:
            return decode_attention(q, k_cache, v_cache, ip, ix, ln, scale=scale, out=out)
        self._cuda.run(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                       _scale(scale, self.D), _stream(self.device))
        return out


class SparseAttention(_Planned):
    """Plan/run sparse_attention: plan(kv_indptr, kv_indices, kv_lens, max_entries,
    granularity="token", shared=False) once per step, run(q, k_cache, v_cache, sel_indptr,
    sel_indices, out=None) per layer (the lists may change between runs within the planned
    bounds). max_entries: an int bound for every list or one bound per list (B * Hkv lists,
    or B with shared=True); CUDA plans its split-K work from them and reads the real lengths
    from sel_indptr (a list longer than its bound is undefined behaviour there; the CPU
    checks). CUDA: as DecodeAttention (own arena, run() allocates nothing with `out`, CUDA-
    graph safe); granularity token or units of 16 / 64 tokens.
    """

    def __init__(self, max_batch: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, device="cpu", max_pages: Optional[int] = None):
        super().__init__(max_batch, num_qo_heads, num_kv_heads, head_dim, page_size, device,
                         max_pages)
        self._cuda = None
        if self.device.type == "cuda":
            self._cuda = _core.CudaSparse(_dev_index(self.device), max_batch, self.max_pages,
                                          self.Hq, self.Hkv, self.D, self.P)

    def plan(self, kv_indptr, kv_indices, kv_lens, max_entries: Union[int, Sequence[int]],
             granularity: Union[str, int] = "token", shared: bool = False):
        ip, ix, ln, B = self._plan_args(kv_indptr, kv_indices, kv_lens)
        lpr = 1 if shared else self.Hkv
        n = B * lpr
        if isinstance(max_entries, int):
            bounds = [max_entries] * n
        else:
            torch = _torch()
            bounds = (max_entries.tolist() if isinstance(max_entries, torch.Tensor)
                      else [int(x) for x in max_entries])
        if len(bounds) != n or min(bounds) < 1:
            raise Error(f"max_entries must be a positive int or {n} positive bounds (one per "
                        f"list), got {len(bounds)} with minimum {min(bounds) if bounds else None}")
        self._plan_host(ip, ix, ln, B, _gran(granularity, self.P), lpr, bounds)

    def _plan_host(self, ip, ix, ln, B, gran, lpr, bounds):
        if self._cuda is not None:
            self._cuda.plan(2**62, self.Hkv, self.P, self.D, ip.data_ptr(), ix.data_ptr(),
                            ln.data_ptr(), B, gran, lpr, list(bounds), _stream(self.device))
        self._set_plan(ip, ix, ln, B)
        self._lists = (gran, lpr, list(bounds))

    def run(self, q, k_cache, v_cache, sel_indptr, sel_indices, out=None,
            scale: Optional[float] = None):
        out = self._run_args(q, k_cache, v_cache, out)
        gran, lpr, bounds = self._lists
        B = self._plan[3]
        dev = self.device if self.device.type == "cuda" else None
        _index("sel_indptr", sel_indptr, B * lpr + 1, dev)
        _index("sel_indices", sel_indices, None, dev)
        ip, ix, ln = self._plan[:3]
        if self._cuda is None:
            n = (sel_indptr[1:] - sel_indptr[:-1]).tolist()
            for i, (c, m) in enumerate(zip(n, bounds)):
                if c > m:
                    raise Error(f"selection list {i} has {c} entries, more than its planned "
                                f"bound {m}")
            return sparse_attention(q, k_cache, v_cache, ip, ix, ln, sel_indptr, sel_indices,
                                    granularity=gran, scale=scale, out=out)
        if sel_indptr.device != self.device or sel_indices.device != self.device:
            raise Error(f"sel_indptr and sel_indices must be on {self.device}")
        self._cuda.run(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                       sel_indptr.data_ptr(), sel_indices.data_ptr(), out.data_ptr(),
                       _scale(scale, self.D), _stream(self.device))
        return out


# ---------------------------------------------------------------------------------------------
# Selectors. Each returns (sel_indptr, sel_indices) on the device of its input, sel_indices at
# its capacity with entries past sel_indptr[-1] unused (-1), ready for sparse_attention.


def _lens_host_max(kv_lens):
    return int(kv_lens.max()) if kv_lens.numel() else 0


def quest_update_meta(k_cache, meta, page_ids, n_valid):
    """Quest's per-page key bounds, in place: meta[page, h, 0] = the element-wise min and
    meta[page, h, 1] the max of the first n_valid[i] rows of page page_ids[i] (KV head h);
    an empty page gets +inf / -inf. meta [num_pages, Hkv, 2, D], k_cache's dtype and device
    (bf16 min / max of bf16 keys are exact); page_ids, n_valid int32 [n] on that device (CPU:
    the host)."""
    dev = _tensor("k_cache", k_cache).device
    _check_cuda(dev)
    _tensor("k_cache", k_cache, _float_dtypes(dev), 4)
    npages, Hkv, P, D = k_cache.shape
    _tensor("meta", meta, (k_cache.dtype,), 4, dev)
    if tuple(meta.shape) != (npages, Hkv, 2, D):
        raise Error(f"meta must have shape {(npages, Hkv, 2, D)}, not {tuple(meta.shape)}")
    _index("page_ids", page_ids, None)
    _index("n_valid", n_valid, page_ids.numel())
    for n, t in (("page_ids", page_ids), ("n_valid", n_valid)):
        if t.device != dev:
            raise Error(f"{n} is on {t.device}, expected {dev} (the device of k_cache)")
    if dev.type == "cpu":
        _core.ops_cpu_quest_meta(_code(k_cache.dtype), k_cache.data_ptr(), npages, Hkv, P, D,
                                 page_ids.data_ptr(), n_valid.data_ptr(), page_ids.numel(),
                                 meta.data_ptr())
    else:
        _core.ops_cuda_quest_meta(_dev_index(dev), k_cache.data_ptr(), Hkv, P, D,
                                  page_ids.data_ptr(), n_valid.data_ptr(), page_ids.numel(),
                                  meta.data_ptr(), _stream(dev))
    return meta


def _batch_pages(P, kv_indptr, kv_indices, kv_lens):
    """Host int32 (page_ids, n_valid) of every page a batch holds (the last: its filled rows)."""
    torch = _torch()
    ip, ix, ln = _host(kv_indptr).tolist(), _host(kv_indices), _host(kv_lens).tolist()
    ids, nv = [], []
    for b in range(len(ln)):
        n = (ln[b] + P - 1) // P
        if ln[b] < 1 or ip[b] + n > ip[b + 1]:
            raise Error(f"request {b}: kv_lens[{b}] = {ln[b]} needs {n} pages, kv_indptr gives "
                        f"{ip[b + 1] - ip[b]}")
        ids.append(ix[ip[b]:ip[b] + n])
        nv += [P] * (n - 1) + [ln[b] - (n - 1) * P]
    page_ids = torch.cat(ids).to(torch.int32) if ids else torch.zeros(0, dtype=torch.int32)
    return page_ids, torch.tensor(nv, dtype=torch.int32)


def quest_meta(k_cache, kv_indptr, kv_indices, kv_lens, meta=None):
    """quest_update_meta over every page a batch holds (its last page: the filled rows).
    meta: an existing [num_pages, Hkv, 2, D] tensor to update, else a new one (zeros for
    pages outside the batch)."""
    torch = _torch()
    dev = _tensor("k_cache", k_cache).device
    _check_cuda(dev)
    _tensor("k_cache", k_cache, _float_dtypes(dev), 4)
    npages, Hkv, P, D = k_cache.shape
    B = kv_lens.numel() if isinstance(kv_lens, torch.Tensor) else 0
    _check_idx(dev, B, kv_indptr, kv_indices, kv_lens)
    page_ids, n_valid = _batch_pages(P, kv_indptr, kv_indices, kv_lens)
    if meta is None:
        meta = torch.zeros(npages, Hkv, 2, D, dtype=k_cache.dtype, device=dev)
    return quest_update_meta(k_cache, meta, _on(page_ids, dev), _on(n_valid, dev))


def quest_select(q, meta, kv_indptr, kv_indices, kv_lens, k_pages: int, page_size: int = 16,
                 max_pages: Optional[int] = None):
    """Quest's page selection (spade's `quest` method at its KV page size, group=max).

    Per request b and KV head h: page i < n - 1 (n = ceil(kv_lens[b] / page_size)) scores
    max over h's query heads g of sum_d max(q_g[d] * kmax[d], q_g[d] * kmin[d]) (fp32, d in
    order); the k_pages - 1 best pages (ties: the lower page; NaN last), ascending, then the
    last page; a request of n <= k_pages pages gets all of them. Returns page lists
    (sel_indptr [B * Hkv + 1], sel_indices [B * Hkv * k_pages]) for
    sparse_attention(..., granularity="page"). q [B, Hq, D] and meta (quest_meta) of one
    dtype; page_size: the cache's. CUDA: page_size 16, D 64 or 128, Hq / Hkv <= 16; max_pages: the longest request's
    pages (default: read from kv_lens, a sync when it is on the device).
    """
    torch = _torch()
    dev = _tensor("q", q).device
    _check_cuda(dev)
    _tensor("q", q, _float_dtypes(dev), 3)
    B, Hq, D = q.shape
    _tensor("meta", meta, (q.dtype,), 4, dev)
    npages, Hkv, two, Dm = meta.shape
    if two != 2 or Dm != D:
        raise Error(f"meta must have shape [pages, Hkv, 2, {D}], not {tuple(meta.shape)}")
    if Hq % Hkv:
        raise Error(f"q's {Hq} heads are not a multiple of meta's {Hkv} KV heads")
    if not isinstance(k_pages, int) or k_pages < 1:
        raise Error(f"k_pages must be a positive int, not {k_pages!r}")
    _check_idx(dev, B, kv_indptr, kv_indices, kv_lens)
    P = int(page_size)
    if P < 1:
        raise Error(f"page_size must be positive, not {page_size!r}")
    sel_indptr = torch.zeros(B * Hkv + 1, dtype=torch.int32, device=dev)
    sel_indices = torch.full((B * Hkv * k_pages,), -1, dtype=torch.int32, device=dev)
    if dev.type == "cpu":
        _core.ops_cpu_quest_select(_code(q.dtype), q.data_ptr(), Hq, meta.data_ptr(), npages,
                                   Hkv, P, D, kv_indptr.data_ptr(), kv_indices.data_ptr(),
                                   kv_lens.data_ptr(), B, k_pages, sel_indptr.data_ptr(),
                                   sel_indices.data_ptr())
        return sel_indptr, sel_indices
    if max_pages is None:
        max_pages = max(1, (_lens_host_max(kv_lens) + P - 1) // P)
    scores = torch.empty(B * Hkv * max_pages, dtype=torch.float32, device=dev)
    ip, ix, ln = _on(kv_indptr, dev), _on(kv_indices, dev), _on(kv_lens, dev)
    _core.ops_cuda_quest_select(_dev_index(dev), q.data_ptr(), Hq, meta.data_ptr(), npages, Hkv,
                                P, D, ip.data_ptr(), ix.data_ptr(), ln.data_ptr(), B,
                                int(max_pages), k_pages, scores.data_ptr(),
                                sel_indptr.data_ptr(), sel_indices.data_ptr(), _stream(dev))
    return sel_indptr, sel_indices


def topk_select(scores, kv_lens, k: int):
    """Token top-k per row: scores [B, H, ld] fp32 rank the first kv_lens[b] positions of row
    (b, h); each row keeps its k best (higher score; ties: the lower position; NaN last),
    ascending, all of them when kv_lens[b] <= k. Returns token lists (sel_indptr [B * H + 1],
    sel_indices [B * H * k]); with H = Hkv they are sparse_attention's per-head lists.
    kv_lens[b] <= ld (checked on the CPU)."""
    torch = _torch()
    _tensor("scores", scores)
    dev = scores.device
    _check_cuda(dev)
    _tensor("scores", scores, (torch.float32,), 3)
    B, H, ld = scores.shape
    _index("kv_lens", kv_lens, B, dev if dev.type == "cuda" else None)
    if not isinstance(k, int) or k < 1:
        raise Error(f"k must be a positive int, not {k!r}")
    sel_indptr = torch.zeros(B * H + 1, dtype=torch.int32, device=dev)
    sel_indices = torch.full((B * H * k,), -1, dtype=torch.int32, device=dev)
    if dev.type == "cpu":
        if kv_lens.device.type != "cpu":
            raise Error(f"kv_lens is on {kv_lens.device}; scores are on the CPU")
        n = kv_lens.repeat_interleave(H).contiguous()
        _core.ops_cpu_topk_rows(scores.data_ptr(), ld, n.data_ptr(), B * H, k,
                                sel_indptr.data_ptr(), sel_indices.data_ptr())
        return sel_indptr, sel_indices
    ln = _on(kv_lens, dev)
    row_n = torch.empty(B * H, dtype=torch.int32, device=dev)
    strided = torch.empty(B * H * k, dtype=torch.int32, device=dev)
    _core.ops_cuda_topk_rows(_dev_index(dev), scores.data_ptr(), ld, ln.data_ptr(), B, H, k,
                             row_n.data_ptr(), strided.data_ptr(), sel_indptr.data_ptr(),
                             sel_indices.data_ptr(), _stream(dev))
    return sel_indptr, sel_indices


def twilight_prune(q, k_cache, kv_indptr, kv_indices, kv_lens, sel_indptr, sel_indices,
                   granularity: Union[str, int] = "token", p: float = 0.95, eps: float = 1e-6,
                   scale: Optional[float] = None):
    """Twilight's top-p pruning of per-(request, KV head) lists (spade's `twilight` method,
    keys=int4, head_combine=union): every listed token's q . k * scale is estimated from an
    INT4 copy of its key (per-row fp16 scale and zero point), each query head softmaxes over
    its list and keeps the smallest set whose estimated mass reaches p (Algorithm 1's
    bisection on the weight, tolerance eps), and the KV head keeps the union of its query
    heads' sets, in list order. Returns token lists (kept_indptr [B * Hkv + 1], kept_indices
    at capacity) for sparse_attention. The INT4 keys are made on each call from k_cache (the
    engine keeps them beside the cache). CPU and CUDA estimate the logits to ~2e-5 relative
    of each other, so a token at the very edge of a threshold may differ. CUDA: D 64 / 128,
    Hq / Hkv <= 32, token lists or 16-token pages; the list lengths are read on the host."""
    torch = _torch()
    B, Hq, D, npages, Hkv, P = _paged(q, k_cache, k_cache, kv_indptr, kv_indices, kv_lens)
    dev = q.device
    _index("sel_indptr", sel_indptr, B * Hkv + 1, dev if dev.type == "cuda" else None)
    _index("sel_indices", sel_indices, None, dev if dev.type == "cuda" else None)
    gran = _gran(granularity, P)
    if not 0 < p <= 1 or eps <= 0:
        raise Error(f"twilight_prune: p must be in (0, 1] and eps > 0 (got p={p}, eps={eps})")
    off = _host(sel_indptr)
    kept_indptr = torch.zeros(B * Hkv + 1, dtype=torch.int32, device=dev)
    if dev.type == "cpu":
        for n, t in (("sel_indptr", sel_indptr), ("sel_indices", sel_indices)):
            if t.device.type != "cpu":
                raise Error(f"{n} is on {t.device}; q is on the CPU")
        if int(off[-1]) > sel_indices.numel():
            raise Error(f"sel_indptr[-1] = {int(off[-1])} is past sel_indices' "
                        f"{sel_indices.numel()} entries")
        kept_indices = torch.full((max(1, int(off[-1]) * gran),), -1, dtype=torch.int32)
        _core.ops_cpu_twilight_prune(_code(q.dtype), q.data_ptr(), Hq, k_cache.data_ptr(), npages,
                                     Hkv, P, D, kv_indptr.data_ptr(), kv_indices.data_ptr(),
                                     kv_lens.data_ptr(), B, sel_indptr.data_ptr(),
                                     sel_indices.data_ptr(), gran, float(p), float(eps),
                                     _scale(scale, D), kept_indptr.data_ptr(),
                                     kept_indices.data_ptr())
        return kept_indptr, kept_indices
    max_slots = max(1, int((off[1:] - off[:-1]).max()) * gran)
    page_ids, n_valid = _batch_pages(P, kv_indptr, kv_indices, kv_lens)
    codes = torch.zeros(npages, Hkv, P, D // 2, dtype=torch.uint8, device=dev)
    sz = torch.zeros(npages, Hkv, P, dtype=torch.int32, device=dev)
    kept_indices = torch.full((B * Hkv * max_slots,), -1, dtype=torch.int32, device=dev)
    ip, ix, ln = _on(kv_indptr, dev), _on(kv_indices, dev), _on(kv_lens, dev)
    sel_indptr, sel_indices = _on(sel_indptr, dev), _on(sel_indices, dev)
    pid, nv = page_ids.to(dev), n_valid.to(dev)
    _core.ops_cuda_twilight_prune(_dev_index(dev), q.data_ptr(), Hq, k_cache.data_ptr(), npages,
                                  Hkv, P, D, ip.data_ptr(), ix.data_ptr(), ln.data_ptr(), B,
                                  pid.data_ptr(), nv.data_ptr(), pid.numel(), codes.data_ptr(),
                                  sz.data_ptr(), sel_indptr.data_ptr(), sel_indices.data_ptr(),
                                  gran, max_slots, float(p), float(eps), _scale(scale, D),
                                  kept_indptr.data_ptr(), kept_indices.data_ptr(), _stream(dev))
    return kept_indptr, kept_indices


class ClusterIndex:
    """LycheeCluster's hierarchical index of one (layer, KV head), on the CPU (spade's
    sparse::ClusterIndex, docs/lycheecluster.md): chunk keys (normalized mean of each chunk's
    keys), a fine level of spherical k-means clusters of about chunks_per_fine chunks, a
    coarse level over the fine centroids (coarse_units, 0: min(max_coarse, ceil(sqrt(fine)))),
    every node with a center and a covering radius so that q . c + |q| r bounds q . k of its
    members.

        ix = spade.ops.ClusterIndex()
        ix.build(keys, chunk_starts)          # keys [L, D]; chunk c = [starts[c], starts[c+1])
        ix.insert(keys, chunk_starts)         # the next chunk (starts one entry longer)
        pos = ix.search(q, budget, chunk_starts)   # q [G, D]: positions of the chosen chunks

    keys / q: float32 or bfloat16 CPU tensors (read as fp32). search ranks coarse units by the
    bound aggregated over the G query heads (group "max" or "sum"), keeps the top coarse_topk
    (0: the fewest holding coarse_cover * budget tokens), ranks their fine clusters and takes
    their chunks in order while they fit the budget; returns int32 positions, ascending.
    CudaClusterIndex is the GPU index (the engine's LcIndexGpu).
    """

    def __init__(self, chunks_per_fine: float = 2.0, max_coarse: int = 64, coarse_units: int = 0,
                 kmeans_iterations: int = 10, pooling: str = "mean", space: str = "token",
                 f16_centers: bool = True):
        if pooling not in ("mean", "max"):
            raise Error(f"pooling must be 'mean' or 'max', not {pooling!r}")
        if space not in ("token", "chunk"):
            raise Error(f"space must be 'token' or 'chunk', not {space!r}")
        self._opts = (float(chunks_per_fine), int(max_coarse), int(coarse_units),
                      int(kmeans_iterations), pooling, space, bool(f16_centers))
        self._ix = _core.ClusterIndexOp()
        self.D = None

    @staticmethod
    def _keys(name, t, D=None):
        torch = _torch()
        _tensor(name, t, (torch.float32, torch.bfloat16), 2)
        if t.device.type != "cpu":
            raise Error(f"{name} must be on the CPU (ClusterIndex is CPU only), not {t.device}")
        if D is not None and t.shape[1] != D:
            raise Error(f"{name} has head dim {t.shape[1]}, the index {D}")
        return t.float().contiguous()

    @staticmethod
    def _starts(t):
        _index("chunk_starts", t)
        if t.device.type != "cpu":
            raise Error(f"chunk_starts must be on the CPU, not {t.device}")
        return t

    def build(self, keys, chunk_starts):
        k = self._keys("keys", keys)
        st = self._starts(chunk_starts)
        self._ix.build(k.data_ptr(), k.shape[0], k.shape[1], st.data_ptr(), st.numel() - 1,
                       *self._opts)
        self.D = k.shape[1]
        return self

    def insert(self, keys, chunk_starts):
        k = self._keys("keys", keys, self.D)
        st = self._starts(chunk_starts)
        self._ix.insert(k.data_ptr(), k.shape[0], k.shape[1], st.data_ptr(), st.numel())
        return self

    def search(self, q, budget: int, chunk_starts, coarse_topk: int = 0,
               coarse_cover: float = 4.0, group: str = "max", rank: str = "bound"):
        torch = _torch()
        if group not in ("max", "sum"):
            raise Error(f"group must be 'max' or 'sum', not {group!r}")
        if rank not in ("bound", "center"):
            raise Error(f"rank must be 'bound' or 'center', not {rank!r}")
        qf = self._keys("q", q, self.D)
        st = self._starts(chunk_starts)
        pos = self._ix.search(qf.data_ptr(), qf.shape[0], qf.shape[1], int(budget),
                              int(coarse_topk), float(coarse_cover), group, rank, st.data_ptr(),
                              st.numel())
        return torch.tensor(pos, dtype=torch.int32)

    @property
    def n_chunks(self) -> int:
        return self._ix.n_chunks()

    @property
    def n_fine(self) -> int:
        return self._ix.n_fine()

    @property
    def n_coarse(self) -> int:
        return self._ix.n_coarse()

    @property
    def bytes(self) -> int:
        return self._ix.bytes()


class CudaClusterIndex:
    """LycheeCluster's index on the GPU (the engine's LcIndexGpu: token bound space, fp16
    centers, mean pooling; docs/cuda_lycheecluster.md), for `slots` (request, layer) pairs of
    num_kv_heads heads each, in a device arena of its own (`arena_bytes`).

        ix = spade.ops.CudaClusterIndex(slots, num_kv_heads, head_dim, page_size)
        ix.build(slot, k_cache, pages, chunk_starts)      # pages: the request's page ids
        ix.insert(slot, k_cache, pages, n_old, new_ends)   # lazy update with new chunks
        sel_indptr, sel_indices = ix.search(q, slots, kv_lens, budget, sink=16)

    k_cache: the layer's [num_pages, Hkv, page_size, D] bf16 CUDA cache; pages: int32 page ids
    of the request in token order (host or device); chunk_starts / new_ends: host int32
    absolute positions (chunk c = [starts[c], starts[c+1]), starts[0] >= the sink). search:
    q [B, Hq, D] bf16, slots / kv_lens int32 [B]; per (request, KV head) the token list
    sink [0, sink) + the chosen chunks (ascending) + the un-indexed tail [starts[-1], kv_len)
    (sparse_attention's per-head lists). The CPU ClusterIndex (f16_centers, space "token",
    pooling "mean") builds the same index from the same bf16 keys where k-means has no
    near-ties, and its search chooses the same chunks.
    """

    def __init__(self, slots: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device="cuda", max_chunks: int = 8192, chunks_per_fine: float = 2.0,
                 max_coarse: int = 64, kmeans_iterations: int = 10):
        torch = _torch()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise Error("CudaClusterIndex works on CUDA tensors (ClusterIndex is the CPU index)")
        _check_cuda(self.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.slots, self.Hkv, self.D, self.P = slots, num_kv_heads, head_dim, page_size
        self._ix = _core.CudaClusterIndex(self.device.index, slots, num_kv_heads, head_dim,
                                          page_size, max_chunks, float(chunks_per_fine),
                                          max_coarse, kmeans_iterations)

    @property
    def arena_bytes(self) -> int:
        return int(self._ix.arena_bytes())

    def _cache(self, k_cache):
        torch = _torch()
        _tensor("k_cache", k_cache, (torch.bfloat16,), 4, self.device)
        if tuple(k_cache.shape[1:]) != (self.Hkv, self.P, self.D):
            raise Error(f"k_cache's shape {tuple(k_cache.shape)} is not "
                        f"[pages, {self.Hkv}, {self.P}, {self.D}]")

    def _host_positions(self, name, t):
        _index(name, t)
        if t.device.type != "cpu":
            raise Error(f"{name} must be a host tensor")
        return t

    def reset(self, slot: int):
        self._ix.reset(int(slot), _stream(self.device))

    def build(self, slot: int, k_cache, pages, chunk_starts):
        self._cache(k_cache)
        _index("pages", pages)
        st = self._host_positions("chunk_starts", chunk_starts)
        pg = _on(pages, self.device)
        self._ix.build(int(slot), k_cache.data_ptr(), pg.data_ptr(), st.data_ptr(),
                       st.numel() - 1, _stream(self.device))
        return self

    def insert(self, slot: int, k_cache, pages, n_old: int, new_ends):
        self._cache(k_cache)
        _index("pages", pages)
        ne = self._host_positions("new_ends", new_ends)
        pg = _on(pages, self.device)
        self._ix.insert(int(slot), k_cache.data_ptr(), pg.data_ptr(), int(n_old), ne.data_ptr(),
                        ne.numel(), _stream(self.device))
        return self

    def search(self, q, slots, kv_lens, budget: int, sink: int = 16, coarse_topk: int = 0,
               coarse_cover: float = 4.0, cap: Optional[int] = None):
        torch = _torch()
        _tensor("q", q, (torch.bfloat16,), 3, self.device)
        B, Hq, D = q.shape
        if D != self.D or Hq % self.Hkv:
            raise Error(f"q [B, Hq, D] must have D = {self.D} and Hq a multiple of {self.Hkv}")
        _index("slots", slots, B)
        _index("kv_lens", kv_lens, B)
        if cap is None:  # a list holds distinct positions below its length
            cap = int(kv_lens.max()) + 64
        sl, ln = _on(slots, self.device), _on(kv_lens, self.device)
        dev = self.device
        lists = torch.empty(B * self.Hkv * cap, dtype=torch.int32, device=dev)
        counts = torch.empty(B * self.Hkv, dtype=torch.int32, device=dev)
        sel_indptr = torch.zeros(B * self.Hkv + 1, dtype=torch.int32, device=dev)
        sel_indices = torch.full((B * self.Hkv * cap,), -1, dtype=torch.int32, device=dev)
        self._ix.search(q.data_ptr(), sl.data_ptr(), ln.data_ptr(), B, Hq, int(budget),
                        int(coarse_topk), float(coarse_cover), int(sink), int(cap),
                        lists.data_ptr(), counts.data_ptr(), sel_indptr.data_ptr(),
                        sel_indices.data_ptr(), _stream(dev))
        return sel_indptr, sel_indices


def group_mean(scores, num_kv_heads: int):
    """[B, Hq, ld] per-query-head scores -> [B, Hkv, ld] means over each KV head's G query
    heads, summed in head order then scaled by 1/G (the order of spade's CPU TidalDecode)."""
    B, Hq, ld = scores.shape
    if num_kv_heads < 1 or Hq % num_kv_heads:
        raise Error(f"scores' {Hq} heads are not a multiple of num_kv_heads = {num_kv_heads}")
    G = Hq // num_kv_heads
    v = scores.view(B, num_kv_heads, G, ld)
    acc = v[:, :, 0].clone()
    for g in range(1, G):
        acc += v[:, :, g]
    if G > 1:
        acc *= 1.0 / G  # fp32 of 1/G, as the C++ 1.f / float(G)
    return acc.contiguous()


def tidal_select(scores, kv_lens, budget: int, num_kv_heads: Optional[int] = None):
    """TidalDecode's token selection: per (request, KV head) the top-`budget` positions by the
    group-mean score (group_mean of the per-query-head scores [B, Hq, ld], or scores already
    [B, Hkv, ld] when num_kv_heads is None or equals their head count); topk_select's order."""
    _tensor("scores", scores, None, 3)
    if num_kv_heads is not None and num_kv_heads != scores.shape[1]:
        scores = group_mean(scores, num_kv_heads)
    return topk_select(scores, kv_lens, budget)


def lessismore_select(scores, kv_lens, budget: int, recent_ratio: float = 0.25, sinks: int = 4,
                      n_recent: Optional[int] = None):
    """LessIsMore's shared token list per request (spade's `lessismore` method) from the
    per-query-head scores [B, Hq, ld] fp32: a request of L <= budget tokens gets all of
    [0, L); else the sinks [0, sinks), the budget - n_recent - sinks tokens of the merge of
    the heads' top lists over [sinks, L - n_recent) ranked by (rank within head, head)
    without duplicates, and the last n_recent = round(budget * recent_ratio) positions.
    Returns (sel_indptr [B + 1], sel_indices [B * budget]), ascending within each list (one
    list per request: sparse_attention's shared form). CUDA: budget - n_recent - sinks <=
    8192."""
    torch = _torch()
    _tensor("scores", scores)
    dev = scores.device
    _check_cuda(dev)
    _tensor("scores", scores, (torch.float32,), 3)
    B, Hq, ld = scores.shape
    _index("kv_lens", kv_lens, B, dev if dev.type == "cuda" else None)
    if n_recent is None:
        n_recent = int(math.floor(budget * float(recent_ratio) + 0.5))
    if budget - n_recent - sinks < 1 or n_recent < 0 or sinks < 0:
        raise Error(f"lessismore_select: budget ({budget}) must exceed n_recent ({n_recent}) + "
                    f"sinks ({sinks})")
    sel_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    sel_indices = torch.full((B * budget,), -1, dtype=torch.int32, device=dev)
    if dev.type == "cpu":
        if kv_lens.device.type != "cpu":
            raise Error(f"kv_lens is on {kv_lens.device}; scores are on the CPU")
        _core.ops_cpu_lessismore_select(scores.data_ptr(), ld, kv_lens.data_ptr(), B, Hq, budget,
                                        n_recent, sinks, sel_indptr.data_ptr(),
                                        sel_indices.data_ptr())
        return sel_indptr, sel_indices
    n_uni = budget - n_recent - sinks
    scratch = torch.empty(_core.ops_cuda_lessismore_scratch_bytes(B, Hq, ld, n_uni),
                          dtype=torch.uint8, device=dev)
    ln = _on(kv_lens, dev)
    _core.ops_cuda_lessismore_select(_dev_index(dev), scores.data_ptr(), ld, ln.data_ptr(), B,
                                     Hq, budget, n_recent, sinks, scratch.data_ptr(),
                                     sel_indptr.data_ptr(), sel_indices.data_ptr(), _stream(dev))
    return sel_indptr, sel_indices


def decode_scores(q, k_cache, kv_indptr, kv_indices, kv_lens, scale: Optional[float] = None,
                  ld: Optional[int] = None):
    """Every query head's scores q . k * scale over its request's cached tokens, fp32
    [B, Hq, ld] (ld: default the longest kv_lens; -inf past a request's length): the input of
    tidal_select / lessismore_select. Plain torch (a gather per request), on q's device; the
    engine's GPU methods take these scores from the attention kernel instead (fp32 products
    of the same bf16 values, summed in another order)."""
    torch = _torch()
    B, Hq, D, npages, Hkv, P = _paged(q, k_cache, k_cache, kv_indptr, kv_indices, kv_lens)
    G = Hq // Hkv
    ip, ix, ln = _host(kv_indptr).tolist(), _host(kv_indices), _host(kv_lens).tolist()
    L = max(ln) if ld is None else int(ld)
    if max(ln) > L:
        raise Error(f"ld = {L} is shorter than the longest request ({max(ln)} tokens)")
    out = torch.full((B, Hq, L), float("-inf"), dtype=torch.float32, device=q.device)
    s = _scale(scale, D)
    for b in range(B):
        n = (ln[b] + P - 1) // P
        pages = _on(ix[ip[b]:ip[b] + n].long(), q.device)
        k = k_cache[pages].float().permute(1, 0, 2, 3).reshape(Hkv, n * P, D)[:, :ln[b]]
        qb = q[b].float().view(Hkv, G, D)
        out[b, :, :ln[b]] = torch.matmul(qb, k.transpose(1, 2)).reshape(Hq, ln[b]) * s
    return out


# ---------------------------------------------------------------------------------------------
# torch.library: spade::decode_attention and spade::sparse_attention as custom ops with fake
# (meta) kernels, so torch.compile traces through them (torch >= 2.4, torch.library.custom_op;
# older torch: the plain functions above only).

def _register_torch_library():
    try:
        import torch
    except ImportError:
        return False
    if not hasattr(getattr(torch, "library", None), "custom_op"):
        return False
    Tensor = torch.Tensor

    def _decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_indptr: Tensor,
                kv_indices: Tensor, kv_lens: Tensor, scale: float) -> Tensor:
        return decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, scale)

    def _sparse(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_indptr: Tensor,
                kv_indices: Tensor, kv_lens: Tensor, sel_indptr: Tensor, sel_indices: Tensor,
                granularity: int, scale: float) -> Tensor:
        return sparse_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, sel_indptr,
                                sel_indices, granularity, scale)

    try:
        d = torch.library.custom_op("spade::decode_attention", mutates_args=())(_decode)
        s = torch.library.custom_op("spade::sparse_attention", mutates_args=())(_sparse)
    except Exception:  # already registered in this process (a reload of the module)
        return hasattr(getattr(torch.ops, "spade", None), "decode_attention")

    @d.register_fake
    def _(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, scale):
        return torch.empty_like(q)

    @s.register_fake
    def _(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, sel_indptr, sel_indices,
          granularity, scale):
        return torch.empty_like(q)

    return True


TORCH_LIBRARY = _register_torch_library()

"""spade.hf: a Hugging Face transformers model decoding with spade's kernels (spade.ops).

    import spade.hf
    model = AutoModelForCausalLM.from_pretrained(...)
    spade.hf.apply(model, method="quest", budget=1024)   # or method="full"
    model.generate(...)                                   # decode steps run spade's ops
    spade.hf.remove(model)                                # back to transformers' attention

What it does: every attention layer keeps a paged copy of its keys and values
([pages, Hkv, page_size, D], the spade.ops layout) that grows with the sequence. A decode
step (one new token per sequence) appends the token's K/V and attends with
spade.ops.decode_attention (method "full") or with Quest's page selection
(quest_update_meta on the touched page, quest_select, sparse_attention over the pages; the
first `dense_layers` layers attend fully; a sequence of at most budget tokens gets all its
pages). Prefill (several new tokens) runs transformers' eager math over the model's own
cache, and fills the paged copy. On CUDA one DecodeAttention / SparseAttention plan per
decode step serves every layer (their page tables are the same).

Hooks, by transformers version: where transformers has an attention-function registry
(ALL_ATTENTION_FUNCTIONS, 4.48+), apply() registers "spade" there and sets the model's
config._attn_implementation; before that (4.46, the CI pin) it replaces the forward of each
layer's self_attn (Llama-style modules: q/k/v/o_proj, rotary position_embeddings; Llama,
Mistral, Qwen2) with one that calls the same function.

Limits (docs/python.md): sequences of a batch must have equal lengths (no padding) during
decode; the model's own cache (DynamicCache) still holds its K/V beside the paged copy;
dtypes: float32 / bfloat16 on the CPU, bfloat16 on CUDA (the kernels' dtype).
"""
import math
import sys
import types
from typing import Optional

from . import ops
from ._core import Error

__all__ = ["apply", "remove", "stats", "METHODS"]

METHODS = ("full", "quest")


class _Config:
    def __init__(self, method, budget, page_size, dense_layers):
        if method not in METHODS:
            raise Error(f"spade.hf: unknown method {method!r} (one of {', '.join(METHODS)})")
        if method == "quest":
            if budget is None or budget < page_size:
                raise Error(f"spade.hf: quest needs budget >= page_size ({page_size} tokens), "
                            f"got {budget}")
        if page_size < 1:
            raise Error(f"spade.hf: page_size must be positive, got {page_size}")
        self.method, self.budget, self.P, self.dense_layers = method, budget, page_size, dense_layers
        self.stats = {"decode_steps": 0, "rows_read": 0, "rows_total": 0}


class _PagedKV:
    """One layer's paged K/V for a batch of B equal-length sequences: page i of sequence b is
    page id i * B + b (pages interleave, so a step's new pages are adjacent)."""

    def __init__(self, B, Hkv, D, P, dtype, device, quest):
        import torch
        self.torch = torch
        self.B, self.Hkv, self.D, self.P = B, Hkv, D, P
        self.length = 0
        self.cap = 0
        self.k = self.v = self.meta = None
        self.dtype, self.device, self.quest = dtype, device, quest
        self._grow(max(4, B))

    def _grow(self, pages):
        torch = self.torch
        cap = max(pages, 2 * self.cap)
        shape = (cap, self.Hkv, self.P, self.D)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        meta = (torch.zeros(cap, self.Hkv, 2, self.D, dtype=self.dtype, device=self.device)
                if self.quest else None)
        if self.cap:
            k[:self.cap] = self.k
            v[:self.cap] = self.v
            if meta is not None:
                meta[:self.cap] = self.meta
        self.k, self.v, self.meta, self.cap = k, v, meta, cap

    def append(self, key, value):
        """key, value [B, Hkv, T, D]: the next T positions of every sequence."""
        torch = self.torch
        B, T, P = self.B, key.shape[2], self.P
        L0, L1 = self.length, self.length + key.shape[2]
        n_pages = (L1 + P - 1) // P
        if n_pages * B > self.cap:
            self._grow(n_pages * B)
        pos = torch.arange(L0, L1, device=self.device)
        pid = (pos // P)[None, :] * B + torch.arange(B, device=self.device)[:, None]  # [B, T]
        slot = (pos % P)[None, :].expand(B, T)
        self.k[pid, :, slot, :] = key.permute(0, 2, 1, 3).to(self.dtype)
        self.v[pid, :, slot, :] = value.permute(0, 2, 1, 3).to(self.dtype)
        self.length = L1
        if self.quest:  # min / max of the pages this append touched
            first = L0 // P
            ids = (torch.arange(first, n_pages)[:, None] * B + torch.arange(B)[None, :]).flatten()
            nv = torch.tensor([min(P, L1 - i * P) for i in range(first, n_pages)],
                              dtype=torch.int32).repeat_interleave(B)
            ops.quest_update_meta(self.k, self.meta, ids.to(torch.int32).to(self.device),
                                  nv.to(self.device))

    def tables(self):
        """kv_indptr, kv_indices, kv_lens (int32, host) of the batch."""
        torch = self.torch
        B, n = self.B, (self.length + self.P - 1) // self.P
        ip = torch.arange(0, (B + 1) * n, n, dtype=torch.int32)
        ix = (torch.arange(n)[None, :] * B + torch.arange(B)[:, None]).flatten().to(torch.int32)
        ln = torch.full((B,), self.length, dtype=torch.int32)
        return ip, ix, ln


class _State:
    def __init__(self, cfg):
        self.cfg = cfg
        self.kv = {}  # layer index -> _PagedKV
        # CUDA: one plan per decode step for every layer (their page tables are the same).
        self.plan_key = None
        self.dec = self.sp = None
        self.tables_dev = None

    def cuda_plans(self, kv, Hq):
        """DecodeAttention (and, for quest, SparseAttention) planned for this step's batch."""
        cfg, dev = self.cfg, kv.device
        key = (kv.B, kv.length, Hq, kv.Hkv, kv.D, str(dev))
        if self.plan_key == key:
            return
        ip, ix, ln = kv.tables()
        pages = ix.numel()
        grow = lambda w: (w is None or w.max_batch < kv.B or w.max_pages < pages  # noqa: E731
                          or (w.Hq, w.Hkv, w.D, w.P) != (Hq, kv.Hkv, kv.D, kv.P))
        if grow(self.dec):
            self.dec = ops.DecodeAttention(max(8, kv.B), Hq, kv.Hkv, kv.D, kv.P, device=dev,
                                           max_pages=max(4096, 2 * pages))
        self.dec.plan(ip, ix, ln)
        if cfg.method == "quest":
            if grow(self.sp):
                self.sp = ops.SparseAttention(max(8, kv.B), Hq, kv.Hkv, kv.D, kv.P, device=dev,
                                              max_pages=max(4096, 2 * pages))
            self.sp.plan(ip, ix, ln, max_entries=cfg.budget // cfg.P, granularity="page")
        self.tables_dev = (ip.to(dev), ix.to(dev), ln.to(dev))
        self.plan_key = key


def _eager(query, key, value, mask, scale):
    """transformers' eager attention: query [B, Hq, T, D], key/value [B, Hkv, S, D]."""
    import torch
    G = query.shape[1] // key.shape[1]
    if G > 1:
        key = key.repeat_interleave(G, dim=1)
        value = value.repeat_interleave(G, dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * scale
    if mask is not None:
        m = mask[:, :, :, :key.shape[-2]]
        if m.dtype == torch.bool:  # True = attend (transformers' boolean masks)
            w = w.masked_fill(~m, float("-inf"))
        else:  # additive
            w = w + m
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, value)


def _torch_bool():
    import torch
    return torch.bool


def _attend(state, layer, query, key, value, mask, scale):
    """The attention of one layer. query [B, Hq, T, D]; key, value [B, Hkv, S, D] (the whole
    cache after this step's append); returns [B, Hq, T, D]."""
    cfg = state.cfg
    B, Hq, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    kv = state.kv.get(layer)
    if kv is None or kv.B != B or kv.length + T != S or kv.dtype != key.dtype:
        # A new sequence (or one this store has not followed): rebuild from the model's cache.
        kv = _PagedKV(B, Hkv, D, cfg.P, key.dtype, key.device, cfg.method == "quest")
        state.kv[layer] = kv
        if S > T:
            kv.append(key[:, :, :S - T], value[:, :, :S - T])
    kv.append(key[:, :, S - T:], value[:, :, S - T:])
    if T > 1:
        return _eager(query, key, value, mask, scale)
    if mask is not None and bool((~mask[..., :S] if mask.dtype == _torch_bool() else
                                  mask[..., :S] < 0).any()):
        raise Error("spade.hf: padded batches do not decode yet (every sequence of a batch "
                    "must have the same length); use one prompt per batch")
    q = query[:, :, 0, :].contiguous()
    cuda = q.device.type == "cuda"
    if cuda:  # planned once per step; the device copies of the tables for the selectors
        state.cuda_plans(kv, Hq)
        ip, ix, ln = state.tables_dev
    else:
        ip, ix, ln = kv.tables()
    cfg.stats["decode_steps"] += 1
    cfg.stats["rows_total"] += B * Hkv * S
    n_pages = (S + cfg.P - 1) // cfg.P
    if cfg.method == "quest" and layer >= cfg.dense_layers:
        k_pages = cfg.budget // cfg.P  # n_pages <= k_pages: quest_select takes every page
        off, idx = ops.quest_select(q, kv.meta, ip, ix, ln, k_pages, page_size=cfg.P,
                                    max_pages=n_pages)
        if cuda:
            out = state.sp.run(q, kv.k, kv.v, off, idx, scale=scale)
        else:
            out = ops.sparse_attention(q, kv.k, kv.v, ip, ix, ln, off, idx, granularity="page",
                                       scale=scale)
        cfg.stats["rows_read"] += B * Hkv * (S if n_pages <= k_pages else
                                             (k_pages - 1) * cfg.P + S - (n_pages - 1) * cfg.P)
    else:
        if cuda:
            out = state.dec.run(q, kv.k, kv.v, scale=scale)
        else:
            out = ops.decode_attention(q, kv.k, kv.v, ip, ix, ln, scale=scale)
        cfg.stats["rows_read"] += B * Hkv * S
    return out[:, :, None, :]


def _attention_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """transformers' attention-function interface (4.48+): returns ([B, T, Hq, D], None)."""
    state = getattr(module, "_spade_state", None)
    if state is None:
        raise Error("spade.hf: this module was not prepared by spade.hf.apply")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = _attend(state, module.layer_idx, query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


def _forward_llama(self, hidden_states, attention_mask=None, position_ids=None,
                   past_key_value=None, output_attentions=False, use_cache=False,
                   cache_position=None, position_embeddings=None, **kwargs):
    """A Llama-style self_attn forward (transformers < 4.48) with spade's attention."""
    mod = sys.modules[type(self).__module__]
    bsz, q_len, _ = hidden_states.size()
    Hq, Hkv, D = self.num_heads, self.num_key_value_heads, self.head_dim
    q = self.q_proj(hidden_states).view(bsz, q_len, Hq, D).transpose(1, 2)
    k = self.k_proj(hidden_states).view(bsz, q_len, Hkv, D).transpose(1, 2)
    v = self.v_proj(hidden_states).view(bsz, q_len, Hkv, D).transpose(1, 2)
    if position_embeddings is None:
        cos, sin = self.rotary_emb(v, position_ids)
    else:
        cos, sin = position_embeddings
    q, k = mod.apply_rotary_pos_emb(q, k, cos, sin)
    if past_key_value is not None:
        k, v = past_key_value.update(k, v, self.layer_idx,
                                     {"sin": sin, "cos": cos, "cache_position": cache_position})
    out = _attend(self._spade_state, self.layer_idx, q, k, v, attention_mask,
                  1.0 / math.sqrt(D))
    out = out.transpose(1, 2).contiguous().view(bsz, q_len, -1)
    return self.o_proj(out), None, past_key_value


def _attention_modules(model):
    mods = []
    for m in model.modules():
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx")):
            mods.append(m)
    if not mods:
        raise Error("spade.hf: no Llama-style attention modules (q_proj, k_proj, v_proj, o_proj, "
                    "layer_idx) in this model")
    return mods


def _registry():
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    return ALL_ATTENTION_FUNCTIONS


def _register(reg, fn):
    """reg["spade"] = fn, class-wide where the registry is an AttentionInterface (4.50+)."""
    register = getattr(type(reg), "register", None)
    if callable(register):
        register("spade", fn)
    else:
        reg["spade"] = fn


def apply(model, method: str = "full", budget: Optional[int] = None, page_size: int = 16,
          dense_layers: int = 2):
    """Makes `model` (a transformers causal LM) decode with spade's kernels.

    method: "full" (spade.ops.decode_attention) or "quest" (Quest's page selection with
    `budget` tokens per KV head: budget // page_size pages, the last page included; layers
    below dense_layers attend fully, as spade's quest method). page_size: tokens per page of
    the paged copy (16: spade's GPU page, and Quest's page on CUDA). Returns the model; call
    spade.hf.stats(model) for the decode steps' rows read, spade.hf.remove(model) to undo."""
    if getattr(model, "_spade_hf", None) is not None:
        remove(model)
    state = _State(_Config(method, budget, page_size, dense_layers))
    mods = _attention_modules(model)
    reg = _registry()
    saved = {"impl": getattr(model.config, "_attn_implementation", None), "forwards": []}
    for m in mods:
        m._spade_state = state
    if reg is not None:
        _register(reg, _attention_function)
        try:  # transformers with a mask registry (4.53+): spade takes eager's mask
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks
            _register(masks, masks["eager"])
        except (ImportError, KeyError, TypeError):
            pass
        for cfg in {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in mods]
                    if c is not None}.values():
            cfg._attn_implementation = "spade"
    else:
        for m in mods:
            saved["forwards"].append((m, m.__dict__.get("forward")))
            m.forward = types.MethodType(_forward_llama, m)
    model._spade_hf = (state, saved)
    return model


def remove(model):
    """Undoes apply(): transformers' own attention again."""
    st = getattr(model, "_spade_hf", None)
    if st is None:
        return model
    state, saved = st
    for m in _attention_modules(model):
        if hasattr(m, "_spade_state"):
            del m._spade_state
    for m, fwd in saved["forwards"]:
        if fwd is None:
            del m.forward
        else:
            m.forward = fwd
    if _registry() is not None:
        for c in [model.config] + [getattr(m, "config", None) for m in _attention_modules(model)]:
            if c is not None:
                c._attn_implementation = saved["impl"]
    model._spade_hf = None
    return model


def stats(model):
    """{"decode_steps", "rows_read", "rows_total", "density"} of the layers' decode steps since
    apply() (rows: cached K/V rows per KV head)."""
    st = getattr(model, "_spade_hf", None)
    if st is None:
        raise Error("spade.hf.stats: spade.hf.apply was not called on this model")
    s = dict(st[0].cfg.stats)
    s["density"] = s["rows_read"] / s["rows_total"] if s["rows_total"] else None
    return s

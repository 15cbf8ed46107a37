"""A Llama-family model (transformers LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM
weights) run with LycheeDecode's hybrid heads for head-role training (section 3.2, eq. 5).

The teacher encodes the prompt densely into a KV cache (prefill). Conditioned on that cache,
the target chunk (T tokens) runs either densely (teacher) or as the student: per layer l > 0
and KV head h with gate value z[l-1, h]

    A~ = z * A_full + (1 - z) * A_sparse,   A_sparse = softmax over the inherited token set S_h

for each of the head's G query heads. Token sets (per KV head and target row) come from the
group-averaged query (mean of the G query heads) of a retrieval head: its top-k tokens among
the causally visible ones, k = ceil(ratio * visible) (or a fixed budget). Layer 0 is all
retrieval heads. A head hands a fresh set to the same head index of the next layer when it
acts as a retrieval head in this sample (z > 0.5, `refresh="gate"`, as at inference, where
a sparse head passes its set on unchanged), or always (`refresh="always"`, the literal
reading of "the full attention map is also used to select S^(l+1)").

Masking dense scores is fine here: this is a training-time simulation in PyTorch, not an
inference kernel.
"""
import math

import torch
import torch.nn.functional as F


def _rotary(model):
    from importlib import import_module

    mod = import_module(type(model).__module__)
    return mod.apply_rotary_pos_emb


def _causal_attention(q, k, v):
    """Dense causal GQA attention [B, Hq, P, D] x [B, Hkv, P, D]: SDPA where this torch has
    it with GQA (2.5+), else a plain softmax (CI's Debian torch 1.13)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    except (AttributeError, TypeError):
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        P = q.shape[2]
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        causal = torch.ones(P, P, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


class HybridModel:
    def __init__(self, hf_model):
        self.hf = hf_model
        self.m = hf_model.model
        self.lm_head = hf_model.lm_head
        cfg = hf_model.config
        self.n_layers = cfg.num_hidden_layers
        self.Hq = cfg.num_attention_heads
        self.Hkv = cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.Hq
        self.G = self.Hq // self.Hkv
        self.scale = 1.0 / math.sqrt(self.D)
        self.apply_rope = _rotary(hf_model)
        for p in hf_model.parameters():
            p.requires_grad_(False)

    @property
    def n_gates(self):
        return (self.n_layers - 1) * self.Hkv

    def _qkv(self, layer, h, pos):
        a = layer.self_attn
        B, T, _ = h.shape
        q = a.q_proj(h).view(B, T, self.Hq, self.D).transpose(1, 2)
        k = a.k_proj(h).view(B, T, self.Hkv, self.D).transpose(1, 2)
        v = a.v_proj(h).view(B, T, self.Hkv, self.D).transpose(1, 2)
        cos, sin = self.m.rotary_emb(h, pos)
        q, k = self.apply_rope(q, k, cos, sin)
        return q, k, v

    @torch.no_grad()
    def prefill(self, ids):
        """Dense causal pass over the prompt ids [B, P]: per layer (K, V) [B, Hkv, P, D]."""
        B, P = ids.shape
        pos = torch.arange(P, device=ids.device)[None].expand(B, P)
        x = self.m.embed_tokens(ids)
        cache = []
        for layer in self.m.layers:
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer, h, pos)
            cache.append((k, v))
            o = _causal_attention(q, k, v)
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(B, P, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return cache

    def budget(self, pos, ratio, fixed):
        """Tokens kept per target row: fixed budget or ceil(ratio * visible), at least 1."""
        visible = pos + 1
        if fixed and fixed > 0:
            k = torch.clamp(torch.full_like(visible, int(fixed)), max=visible)
        else:
            k = torch.ceil(visible.double() * ratio).long()
        return k.clamp(min=1).minimum(visible)

    @staticmethod
    def select(qbar, K, visible, k_row):
        """Top-k sets of the group-averaged query: qbar [B, Hkv, T, D], K [B, Hkv, N, D],
        visible [T, N] bool, k_row [T] -> mask [B, Hkv, T, N] (ties: lower position)."""
        s = torch.einsum("bhtd,bhnd->bhtn", qbar, K)
        s = s.masked_fill(~visible, float("-inf"))
        kmax = int(k_row.max())
        # stable descending order: sort by score, ties by position (torch.sort is stable)
        idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :kmax]
        keep = torch.arange(kmax, device=s.device)[None, None, None, :] < k_row[None, None, :, None]
        m = torch.zeros_like(s, dtype=torch.bool)
        m.scatter_(-1, idx, keep.expand_as(idx))
        return m

    def targets(self, ids, cache, z=None, ratio=0.3, budget=0, refresh="gate", trace=None):
        """Logits [B, T, V] (float32) of the target chunk ids [B, T] placed after `cache`.
        z=None: dense teacher; else gate values [n_layers - 1, Hkv] (layers 1..)."""
        B, T = ids.shape
        P = cache[0][0].shape[2]
        N = P + T
        dev = ids.device
        pos = torch.arange(P, P + T, device=dev)
        visible = torch.arange(N, device=dev)[None, :] <= pos[:, None]  # [T, N]
        k_row = self.budget(pos, ratio, budget)
        x = self.m.embed_tokens(ids)
        sets = None  # [B, Hkv, T, N] inherited token sets
        for l, layer in enumerate(self.m.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer, h, pos[None].expand(B, T))
            K = torch.cat([cache[l][0], k], dim=2).float()
            V = torch.cat([cache[l][1], v], dim=2).float()
            qf = q.float().view(B, self.Hkv, self.G, T, self.D)
            s = torch.einsum("bhgtd,bhnd->bhgtn", qf, K) * self.scale
            s = s.masked_fill(~visible, float("-inf"))
            a_full = torch.softmax(s, dim=-1)
            if z is None or l == 0:
                att = a_full
            else:
                a_sp = torch.softmax(s.masked_fill(~sets[:, :, None], float("-inf")), dim=-1)
                zl = z[l - 1].view(1, self.Hkv, 1, 1, 1).float()
                att = zl * a_full + (1.0 - zl) * a_sp
            o = torch.einsum("bhgtn,bhnd->bhgtd", att, V).reshape(B, self.Hq, T, self.D)
            o = o.transpose(1, 2).reshape(B, T, self.Hq * self.D).to(x.dtype)
            x = x + layer.self_attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if z is not None and l + 1 < self.n_layers:
                with torch.no_grad():
                    fresh = self.select(qf.mean(dim=2), K, visible, k_row)
                    if sets is None:
                        sets = fresh
                    else:
                        if refresh == "always":
                            r = torch.ones(self.Hkv, dtype=torch.bool, device=dev)
                        else:
                            r = z[l - 1].detach() > 0.5
                        sets = torch.where(r.view(1, self.Hkv, 1, 1), fresh, sets)
                    if trace is not None:
                        trace.append(sets.clone())
        x = self.m.norm(x)
        return self.lm_head(x).float()

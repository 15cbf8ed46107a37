"""spade.hf: a Hugging Face transformers model decoding with spade's kernels and sparse methods
(spade.ops).

    import spade.hf
    model = AutoModelForCausalLM.from_pretrained(...)
    spade.hf.apply(model, "tidal:budget=256")              # spade's method spec, as --sparse
    spade.hf.apply(model, method="quest", budget=1024)     # or the method and its options
    model.generate(...)                                    # decode steps run spade's ops
    spade.hf.remove(model)                                 # back to transformers' attention

What it does: every attention layer keeps a paged copy of its keys and values
([pages, Hkv, page_size, D], the spade.ops layout) that grows with the sequence. A decode
step (one new token per sequence) appends the token's K/V, asks the method for the layer's
selection and attends with spade.ops.decode_attention (a dense layer) or
spade.ops.sparse_attention over the selected tokens. The methods are spade's C++ ones
(src/sparse/methods/*.cpp), option for option, built from spade.ops' selectors:

    full          every token
    streaming     sinks [0, sinks) + the last budget - sinks tokens, one set for every head
    quest         quest_update_meta / quest_select: budget // page_size pages per KV head
    tidal         selection layers attend fully and tidal_select the top-budget tokens per
                  KV head (group-mean score); later layers reuse that set in the same step
    lessismore    as tidal, one cross-head set from lessismore_select (sinks, merged
                  per-head top lists, the recency window)
    lycheecluster spade's chunks (structure-aware from each token's text: token_text=, or
                  fixed), a ClusterIndex (CPU) per (layer, request, KV head) over the closed
                  chunks, built at the first sparse step, updated every `buffer` tokens;
                  sinks + the searched chunks + the tokens not yet indexed
    oracle-topk   the top-budget tokens per KV head by the group's summed true weights
    oracle-topp   per query head the smallest true top set reaching mass p (union or mean)
    twilight      a base method's selection pruned by twilight_prune (INT4 key estimate,
                  top-p per query head, union); base=quest and budget=auto by default

Defaults and option names are spade's (`spade generate --help`); tidal and lessismore take
their dense / selection layers from the per-model table of src/sparse/model_defaults.cpp.
lycheedecode and blasst are not hooked (apply() says why). A new sequence (a prefill from an
empty cache) starts the method's state afresh. Prefill (several new tokens) runs
transformers' eager math over the model's own cache, and fills the paged copy; prefill is
dense for every method in spade too. On CUDA one DecodeAttention plan per decode step serves
the dense layers (and quest's SparseAttention plan its sparse ones); the other methods' lists
go through spade.ops.sparse_attention (a plan per call), LycheeCluster's index is the CPU one
(the keys go to the host at each build and update).

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

__all__ = ["apply", "remove", "stats", "parse_spec", "token_bytes", "layer_defaults", "METHODS"]

METHODS = ("full", "streaming", "quest", "tidal", "lessismore", "lycheecluster", "oracle-topk",
           "oracle-topp", "twilight")
# spade methods the hook does not run, and why.
_NOT_HOOKED = {
    "lycheedecode": "its head roles come from trained tables that only the engine reads",
    "blasst": "it skips key tiles inside the attention kernel, which spade.ops does not expose",
}
_MAX_TOKENS = 2147483647  # sparse/options.h kMaxTokenCount
_MAX_TILE = 65536         # kMaxTile


# ---------------------------------------------------------------------------------------------
# Method specs and options: the names, defaults and valid ranges of src/sparse/methods/*.cpp
# (their *_options()), checked as sparse::MethodOptions checks them.

class _Opt:
    def __init__(self, kind, default, lo=-math.inf, hi=math.inf, lo_open=False, bound=None,
                 choices=()):
        self.kind, self.default, self.lo, self.hi = kind, default, lo, hi
        self.lo_open, self.bound, self.choices = lo_open, bound, tuple(choices)

    def valid_text(self, n_layers):
        if self.kind == "str":
            return "one of " + ", ".join(self.choices)
        hi = self.hi
        if self.bound == "layers":
            hi = min(hi, n_layers)
        elif self.bound == "index":
            hi = min(hi, n_layers - 1)
        txt = lambda x: str(int(x)) if x == int(x) else repr(x)  # noqa: E731
        s = f"{'(' if self.lo_open else '['}{txt(self.lo)}, {txt(hi)}]"
        if self.bound:
            s += f" (the model has {n_layers} layers)"
        return s


def _budget(default="2048"):
    return _Opt("int", default, 1, _MAX_TOKENS)


def _dense_count(default):
    return _Opt("int", default, 0, _MAX_TOKENS, bound="layers")


def _scheduled():
    return {"dense_layers": _dense_count("auto"),
            "selection_layers": _Opt("intlist", "auto", 0, _MAX_TOKENS, bound="index")}


_SPECS = {
    "full": {},
    "streaming": {"budget": _budget(), "sinks": _Opt("int", "4", 0, _MAX_TOKENS - 1),
                  "dense_layers": _dense_count("0")},
    "quest": {"budget": _budget(), "page_size": _Opt("int", "16", 1, _MAX_TILE),
              "dense_layers": _dense_count("2"),
              "group": _Opt("str", "max", choices=("max", "sum"))},
    "tidal": dict(budget=_budget(), **_scheduled(), correction=_Opt("int", "0", 0, 1),
                  correction_every=_Opt("int", "32", 1, _MAX_TILE)),
    "lessismore": dict(budget=_budget(), recent_ratio=_Opt("float", "0.25", 0, 1),
                       sinks=_Opt("int", "4", 0, _MAX_TOKENS), **_scheduled()),
    "oracle-topk": {"budget": _budget(), "dense_layers": _dense_count("0")},
    "oracle-topp": {"p": _Opt("float", "0.95", 0, 1, lo_open=True),
                    "group": _Opt("str", "union", choices=("union", "mean")),
                    "dense_layers": _dense_count("0")},
    "lycheecluster": {
        "budget": _budget("1024"),
        "budget_mode": _Opt("str", "clusters", choices=("clusters", "total")),
        "sink": _Opt("int", "16", 0, _MAX_TOKENS), "buffer": _Opt("int", "128", 1, _MAX_TOKENS),
        "dense_layers": _dense_count("2"),
        "chunking": _Opt("str", "structure", choices=("structure", "fixed")),
        "min_chunk": _Opt("int", "8", 1, _MAX_TILE), "max_chunk": _Opt("int", "16", 1, _MAX_TILE),
        "fixed_chunk": _Opt("int", "16", 1, _MAX_TILE),
        "tie": _Opt("str", "last", choices=("last", "first")),
        "pooling": _Opt("str", "mean", choices=("mean", "max")),
        "bound": _Opt("str", "token", choices=("token", "chunk")),
        "chunks_per_fine": _Opt("float", "2", 1, _MAX_TILE),
        "max_coarse": _Opt("int", "64", 1, _MAX_TILE),
        "coarse_units": _Opt("int", "0", 0, _MAX_TILE),
        "kmeans_iters": _Opt("int", "10", 0, 1000),
        "seeding": _Opt("str", "stride", choices=("stride", "kmeans++")),
        "seed": _Opt("int", "24301", -2**63, 2**63 - 1),
        "center_dtype": _Opt("str", "f16", choices=("f16", "f32")),
        "coarse_topk": _Opt("int", "0", 0, _MAX_TILE),
        "coarse_cover": _Opt("float", "4", 0, _MAX_TOKENS, lo_open=True),
        "group": _Opt("str", "max", choices=("max", "sum")),
        "rank": _Opt("str", "bound", choices=("bound", "center")),
        "stability": _Opt("int", "0", 0, 1), "stability_window": _Opt("int", "32", 1, _MAX_TOKENS)},
    "twilight": {"base": _Opt("str", "quest"), "budget": _budget("auto"),
                 "p": _Opt("float", "0.95", 0, 1, lo_open=True),
                 "eps": _Opt("float", "1e-6", 0, 1, lo_open=True),
                 "head_combine": _Opt("str", "union", choices=("union", "mean")),
                 "keys": _Opt("str", "int4", choices=("int4", "exact")),
                 "dense_layers": _dense_count("2")},
}


def _text(v):
    """A Python option value as spade's option text (JSON's conversions: bools 1 / 0, lists
    comma-joined)."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (list, tuple)):
        return ",".join(str(int(x)) for x in v) if v else "none"
    return str(v).strip()


def _parse_int(s, what):
    try:
        if "_" in s:  # Python's int() takes 1_000, spade's options do not
            raise ValueError
        return int(s.strip(), 10)
    except ValueError:
        raise Error(f"{what} expects an integer, got '{s}'") from None


def _parse_float(s, what):
    try:
        x = float(s.strip())
    except ValueError:
        raise Error(f"{what} expects a number, got '{s}'") from None
    if not math.isfinite(x):
        raise Error(f"{what} expects a finite number, got '{s}'")
    return x


def _parse_list(s, what):
    t = s.strip()
    if t in ("", "none"):
        return []
    if t.endswith(","):
        raise Error(f"{what} has an empty element in '{s}'")
    return [_parse_int(x, what) for x in t.split(",")]


def parse_spec(spec: str):
    """spade's method spec "name" or "name:k=v,k=v" (SparseConfig::parse_spec) -> (name,
    {key: text}); a fragment without '=' continues the previous value ("selection_layers=2,4")."""
    s = str(spec).strip()
    name, _, rest = s.partition(":")
    name = name.strip()
    if not name:
        raise Error(f"empty sparse method spec '{spec}'")
    opts, last = {}, None
    for item in rest.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            if last is None:
                raise Error(f"sparse option '{item}' is not key=value")
            opts[last] += "," + item
            continue
        k, _, v = item.partition("=")
        last = k.strip()
        if not last:
            raise Error(f"sparse option '{item}' has no key")
        opts[last] = v.strip()
    return name, opts


class _Options:
    """sparse::MethodOptions: every given key known, every value (given or default, "auto"
    where it is the default aside) parsed and in range."""

    def __init__(self, method, given, n_layers):
        self.method, self.specs, self.given, self.n_layers = method, _SPECS[method], given, n_layers
        for k in given:
            if k not in self.specs:
                raise Error(f"sparse method '{method}' has no option '{k}'; valid options: "
                            f"{', '.join(self.specs) or 'none'}")
        for k, s in self.specs.items():
            v = self.str(k)
            if v != "auto" or s.default != "auto":
                self._check(k, s, v)

    def _check(self, k, s, v):
        what = f"{self.method} option '{k}'"
        mh = {"layers": self.n_layers, "index": self.n_layers - 1}.get(s.bound, math.inf)
        ok = lambda x: ((x > s.lo if s.lo_open else x >= s.lo) and x <= s.hi  # noqa: E731
                        and x <= mh)
        if s.kind == "int":
            x = _parse_int(v, what)
            if not ok(x):
                raise Error(f"{what} = {x} outside {s.valid_text(self.n_layers)}")
        elif s.kind == "float":
            x = _parse_float(v, what)
            if not ok(x):
                raise Error(f"{what} = {v} outside {s.valid_text(self.n_layers)}")
        elif s.kind == "intlist":
            for x in _parse_list(v, what):
                if not ok(x):
                    raise Error(f"{what} element {x} outside {s.valid_text(self.n_layers)}")
        elif s.choices and v not in s.choices:
            raise Error(f"{what} = '{v}' is not {s.valid_text(self.n_layers)}")

    def str(self, k):
        return self.given.get(k, self.specs[k].default)

    def is_auto(self, k):
        return self.str(k) == "auto"

    def int(self, k):
        return _parse_int(self.str(k), f"{self.method} option '{k}'")

    def float(self, k):
        return _parse_float(self.str(k), f"{self.method} option '{k}'")

    def list(self, k):
        return _parse_list(self.str(k), f"{self.method} option '{k}'")


def _unsupported(method, option, value, supported, why="spade.ops has no such selector"):
    raise Error(f"spade.hf: {method} {option}={value} is not supported by the Hugging Face "
                f"hook ({why}); supported: {supported}")


# ---------------------------------------------------------------------------------------------
# Layer schedule of tidal / lessismore (sparse/layer_schedule.cpp, sparse/model_defaults.cpp).

# (arch, layers, hidden or 0, KV heads or 0, re-selection layer): model_defaults.cpp's table.
_LAYER_TABLE = (("llama", 32, 4096, 32, 7), ("llama", 32, 4096, 8, 13), ("qwen3", 36, 4096, 0, 12),
                ("qwen3", 36, 2560, 0, 20), ("qwen3", 40, 5120, 0, 12), ("llama", 30, 576, 3, 14))


def _arch(config):
    """spade's Arch of a transformers config (io/hf_config.cpp: by architecture)."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    for name, a in (("Mistral", "mistral"), ("Qwen3", "qwen3"), ("Qwen2", "qwen2"),
                    ("Llama", "llama")):
        if arch.startswith(name):
            return a
    return getattr(config, "model_type", "llama")


def layer_defaults(arch, n_layers, hidden, n_kv_heads):
    """(dense_layers, selection_layers) of spade's per-model table (layer_defaults())."""
    for a, n, h, kv, re in _LAYER_TABLE:
        if a == arch and n == n_layers and (not h or h == hidden) and (not kv or kv == n_kv_heads):
            return 2, [2, re]
    re = int(math.floor(13.0 * n_layers / 32.0 + 0.5))  # std::lround of a positive value
    if n_layers <= 2:
        return 0, [0]
    if re <= 2 or re >= n_layers:
        return 2, [2]
    return 2, [2, re]


class _Schedule:
    DENSE, SELECT, REUSE = 0, 1, 2

    def __init__(self, o, model):
        dense, sel = layer_defaults(model.arch, model.n_layers, model.hidden, model.Hkv)
        self.dense = dense if o.is_auto("dense_layers") else o.int("dense_layers")
        self.selection = sorted(set(sel if o.is_auto("selection_layers")
                                    else o.list("selection_layers")))
        m, n = o.method, model.n_layers
        if not 0 <= self.dense <= n:
            raise Error(f"{m}: dense_layers={self.dense} outside [0, {n}]")
        for layer in self.selection:
            if not 0 <= layer < n:
                raise Error(f"{m}: selection layer {layer} outside [0, {n})")
        for layer in range(n):
            if self.role(layer) != self.REUSE:
                continue
            if not any(x < layer and self.role(x) == self.SELECT for x in self.selection):
                raise Error(f"{m}: layer {layer} would reuse a token set but no selection layer "
                            f"at or above dense_layers={self.dense} comes before it (a selection "
                            f"layer below dense_layers is dense and never selects)")
            break

    def role(self, layer):
        if layer < self.dense:
            return self.DENSE
        return self.SELECT if layer in self.selection else self.REUSE

    def describe(self):
        d = f"dense 0-{self.dense - 1}" if self.dense else "dense none"
        return f"{d}, select {','.join(map(str, self.selection)) or 'none'}"


# ---------------------------------------------------------------------------------------------
# Selections. A method's select(c) returns DENSE (attend every token), SCORES (attend every
# token and hand the layer's scores to on_scores: a selection layer) or a _Lists.

DENSE, SCORES = "dense", "scores"


class _Lists:
    """Selection lists for sparse_attention: (off, idx) on the step's device, granularity
    "token" or "page", lpr lists per request (1: shared by the KV heads, or Hkv); counts:
    tokens read per (request, KV head), a host tensor [B, Hkv], or an int for all of them
    (used on CUDA only), or None (counted from the lists)."""

    def __init__(self, off, idx, gran, lpr, counts=None, planned=False):
        self.off, self.idx, self.gran, self.lpr = off, idx, gran, lpr
        self.counts, self.planned = counts, planned


class _Ctx:
    """One decode layer: the queries, the paged copy and its tables, the step."""

    def __init__(self, layer, step, q, kv, tables, tables_dev, scale):
        import torch
        self.torch = torch
        self.layer, self.step, self.q, self.kv = layer, step, q, kv
        self.B, self.Hq, self.D = q.shape
        self.Hkv, self.P, self.L = kv.Hkv, kv.P, kv.length
        self.G = self.Hq // self.Hkv
        self.ip, self.ix, self.ln = tables          # host int32
        self.dip, self.dix, self.dln = tables_dev   # on q's device
        self.scale, self.dev = scale, q.device
        self._scores = None

    def scores(self):
        """[B, Hq, L] fp32 scaled q . k of every cached token (the scores a selection layer's
        full attention hands its method in spade)."""
        if self._scores is None:
            self._scores = ops.decode_scores(self.q, self.kv.k, self.dip, self.dix, self.dln,
                                             scale=self.scale)
        return self._scores

    def lists(self, rows, lpr):
        """_Lists from host position tensors, one per list (B * lpr of them)."""
        torch = self.torch
        n = torch.tensor([0] + [int(r.numel()) for r in rows], dtype=torch.int64).cumsum(0)
        idx = torch.cat(rows).to(torch.int32) if rows else torch.zeros(0, dtype=torch.int32)
        counts = (n[1:] - n[:-1]).view(self.B, lpr).expand(self.B, self.Hkv)
        return _Lists(n.to(torch.int32).to(self.dev), idx.to(self.dev), "token", lpr,
                      counts.contiguous())


class _Method:
    """A method's interface; by itself, full attention."""
    name = "full"
    needs_meta = False

    def describe(self):
        """spade's describe() line of the method and its effective options."""
        return "full"

    def reset(self):
        """A new sequence (batch): forget per-sequence state."""

    def feed(self, ids, start):
        """The token ids [B, T] of a forward pass at positions [start, start + T) (methods
        that read token text)."""

    def select(self, c):
        return DENSE

    def on_scores(self, c):
        pass


class _Streaming(_Method):
    name = "streaming"

    def __init__(self, o):
        self.budget, self.sinks, self.dense = o.int("budget"), o.int("sinks"), o.int("dense_layers")
        if not (self.sinks >= 0 and self.budget > self.sinks):
            raise Error(f"streaming: budget ({self.budget}) must exceed sinks ({self.sinks})")

    def describe(self):
        return f"streaming budget={self.budget} sinks={self.sinks} dense_layers={self.dense}"

    def select(self, c):
        if c.layer < self.dense or self.budget >= c.L:
            return DENSE
        torch = c.torch
        recent = torch.arange(c.L - (self.budget - self.sinks), c.L)
        row = torch.cat([torch.arange(self.sinks), recent])
        return c.lists([row] * c.B, 1)


class _Quest(_Method):
    name = "quest"
    needs_meta = True

    def __init__(self, o):
        self.budget, self.page = o.int("budget"), o.int("page_size")
        self.dense = o.int("dense_layers")
        if o.str("group") != "max":
            _unsupported("quest", "group", o.str("group"), "group=max (spade.ops.quest_select)")
        if self.budget < self.page:
            raise Error(f"quest: budget ({self.budget}) must be at least one page ({self.page} "
                        f"tokens)")

    def describe(self):
        return (f"quest budget={self.budget} page_size={self.page} pages={self.budget // self.page}"
                f" dense_layers={self.dense} group=max")

    def select(self, c):
        n_pages = (c.L + c.P - 1) // c.P
        k_pages = self.budget // c.P
        if c.layer < self.dense or k_pages >= n_pages:
            return DENSE
        off, idx = ops.quest_select(c.q, c.kv.meta, c.dip, c.dix, c.dln, k_pages, page_size=c.P,
                                    max_pages=n_pages)
        return _Lists(off, idx, "page", c.Hkv, (k_pages - 1) * c.P + c.L - (n_pages - 1) * c.P,
                      planned=True)


class _OracleTopK(_Method):
    name = "oracle-topk"

    def __init__(self, o):
        self.budget, self.dense = o.int("budget"), o.int("dense_layers")

    def describe(self):
        return f"oracle-topk budget={self.budget} dense_layers={self.dense}"

    def select(self, c):
        if c.layer < self.dense or self.budget >= c.L:
            return DENSE
        w = c.torch.softmax(c.scores(), dim=-1).view(c.B, c.Hkv, c.G, c.L)
        acc = w[:, :, 0].clone()  # the group's summed true weights, in head order
        for g in range(1, c.G):
            acc += w[:, :, g]
        off, idx = ops.topk_select(acc.contiguous(), c.dln, self.budget)
        return _Lists(off, idx, "token", c.Hkv)


class _OracleTopP(_Method):
    name = "oracle-topp"

    def __init__(self, o):
        self.p, self.union = o.float("p"), o.str("group") == "union"
        self.dense = o.int("dense_layers")

    def describe(self):
        return (f"oracle-topp p={self.p:g} group={'union' if self.union else 'mean'} "
                f"dense_layers={self.dense}")

    def select(self, c):
        if c.layer < self.dense:
            return DENSE
        torch = c.torch
        w = torch.softmax(c.scores(), dim=-1)  # [B, Hq, L]
        if self.union:
            rows, target = w, self.p
        else:
            v = w.view(c.B, c.Hkv, c.G, c.L)
            rows = v[:, :, 0].clone()
            for g in range(1, c.G):
                rows += v[:, :, g]
            target = self.p * c.G
        # The smallest best-first prefix (ties: the lower position) whose mass, summed in
        # double in that order, reaches the target (oracle.cpp's take()).
        srt, order = torch.sort(rows, dim=-1, descending=True, stable=True)
        mass = srt.double().cumsum(-1)
        keep = ((mass < target).sum(-1, keepdim=True) + 1).clamp(max=c.L)
        rank = torch.arange(c.L, device=rows.device).expand_as(order)
        mark = torch.zeros_like(rows, dtype=torch.bool).scatter_(-1, order, rank < keep)
        if self.union:
            mark = mark.view(c.B, c.Hkv, c.G, c.L).any(2)
        mark = mark.reshape(c.B * c.Hkv, c.L).cpu()
        return c.lists([r.nonzero().flatten() for r in mark], c.Hkv)


class _Scheduled(_Method):
    """tidal / lessismore: dense layers, selection layers (full attention, then the set from
    their scores), reuse layers (the step's set)."""

    def __init__(self, o, model):
        self.budget = o.int("budget")
        self.sched = _Schedule(o, model)
        self.set, self.set_step = None, -1

    def select(self, c):
        role = self.sched.role(c.layer)
        if role == _Schedule.DENSE:
            return DENSE
        if role == _Schedule.SELECT:
            if self.budget >= c.L:
                self.set, self.set_step = DENSE, c.step
                return DENSE
            return SCORES
        if self.set_step != c.step:
            raise Error(f"{self.name}: layer {c.layer} has no token set from this step")
        return self.set

    def on_scores(self, c):
        self.set, self.set_step = self.choose(c), c.step


class _Tidal(_Scheduled):
    name = "tidal"

    def __init__(self, o, model):
        super().__init__(o, model)
        if o.int("correction"):
            _unsupported("tidal", "correction", o.str("correction"), "correction=0",
                         why="cache correction re-runs decoded tokens densely inside spade's "
                         "decode loop")

    def describe(self):
        return f"tidal budget={self.budget} ({self.sched.describe()})"

    def choose(self, c):
        off, idx = ops.tidal_select(c.scores(), c.dln, self.budget, num_kv_heads=c.Hkv)
        return _Lists(off, idx, "token", c.Hkv)


class _LessIsMore(_Scheduled):
    name = "lessismore"

    def __init__(self, o, model):
        super().__init__(o, model)
        self.ratio, self.sinks = o.float("recent_ratio"), o.int("sinks")
        self.n_recent = int(math.floor(self.budget * self.ratio + 0.5))  # std::llround
        if not (self.budget > 0 and self.budget - self.n_recent >= self.sinks):
            raise Error(f"lessismore: budget {self.budget} leaves {self.budget - self.n_recent} "
                        f"tokens after the recency window, fewer than the {self.sinks} sinks")

    def describe(self):
        return (f"lessismore budget={self.budget} recent_ratio={self.ratio:g} ({self.n_recent} "
                f"recent) sinks={self.sinks} ({self.sched.describe()})")

    def choose(self, c):
        if self.budget - self.n_recent - self.sinks < 1:  # no merged tokens: sinks + recent
            torch = c.torch
            row = torch.cat([torch.arange(self.sinks), torch.arange(c.L - self.n_recent, c.L)])
            return c.lists([row] * c.B, 1)
        off, idx = ops.lessismore_select(c.scores(), c.dln, self.budget, sinks=self.sinks,
                                         n_recent=self.n_recent)
        return _Lists(off, idx, "token", 1)


class _Twilight(_Method):
    """A base method's selection pruned by spade.ops.twilight_prune (keys=int4,
    head_combine=union); dense_layers and the base's selection layers are not pruned."""
    name = "twilight"

    def __init__(self, o, base_name, base_given, model):
        self.p, self.eps, self.dense = o.float("p"), o.float("eps"), o.int("dense_layers")
        for k, want in (("head_combine", "union"), ("keys", "int4")):
            if o.str(k) != want:
                _unsupported("twilight", k, o.str(k), "head_combine=union, keys=int4 "
                             "(spade.ops.twilight_prune)")
        self.base_name, self.base_given, self.model = base_name, dict(base_given), model
        self.auto = o.is_auto("budget") and "budget" in _SPECS[base_name]
        if self.auto:
            self.base_given["budget"] = "8192"
        self.base = _make(base_name, self.base_given, model)
        self.needs_meta = self.base.needs_meta
        self.by_budget = {}

    def describe(self):
        auto = " budget=auto(max(8192, L/4))" if self.auto else ""
        return (f"twilight p={self.p:g} eps={self.eps:g} head_combine=union keys=int4 dense_layers="
                f"{self.dense}{auto} over [{self.base.describe()}]")

    def base_for(self, L):
        """budget=auto: the base at budget max(8192, ceil(L/4 / 1024) * 1024)."""
        want = (L // 4 + 1023) // 1024 * 1024
        if not self.auto or want <= 8192:
            return self.base
        if want not in self.by_budget:
            m = _make(self.base_name, dict(self.base_given, budget=str(want)), self.model)
            if hasattr(m, "share"):
                m.share(self.base)
            self.by_budget[want] = m
        return self.by_budget[want]

    def on_scores(self, c):
        self.base_for(c.L).on_scores(c)

    def reset(self):
        for m in [self.base] + list(self.by_budget.values()):
            m.reset()

    def feed(self, ids, start):
        for m in [self.base] + list(self.by_budget.values()):
            m.feed(ids, start)

    def select(self, c):
        sel = self.base_for(c.L).select(c)
        if sel is SCORES or c.layer < self.dense:
            return sel
        torch = c.torch
        if sel is DENSE:  # every page of every (request, KV head), in order
            n = (c.L + c.P - 1) // c.P
            off = torch.arange(0, (c.B * c.Hkv + 1) * n, n, dtype=torch.int32)
            idx = torch.arange(n, dtype=torch.int32).repeat(c.B * c.Hkv)
            off, idx, gran = off.to(c.dev), idx.to(c.dev), "page"
        elif sel.lpr == 1:  # a shared list: one copy per KV head
            o = sel.off.cpu().tolist()
            ix = sel.idx.cpu()
            rows = [ix[o[b]:o[b + 1]] for b in range(c.B) for _ in range(c.Hkv)]
            lst = c.lists(rows, c.Hkv)
            off, idx, gran = lst.off, lst.idx, sel.gran
        else:
            off, idx, gran = sel.off, sel.idx, sel.gran
        kept_off, kept_idx = ops.twilight_prune(c.q, c.kv.k, c.dip, c.dix, c.dln, off, idx,
                                                granularity=gran, p=self.p, eps=self.eps,
                                                scale=c.scale)
        return _Lists(kept_off, kept_idx, "token", c.Hkv)


_WS = b" \t\n\r\v\f"
_CJK_SENTENCE = tuple(x.encode() for x in "\u3002\uff1f\uff01")       # 。？！
_CJK_PHRASE = tuple(x.encode() for x in "\uff0c\uff1b\uff1a\u3001")   # ，；：、


def _cut_level(text, n, i):
    """sparse/chunker.cpp cut_level(): the delimiter level of the cut before token i of the
    first n tokens of `text` (bytes per position; missing ones read as b""): 0 the end, 1
    structural, 2 sentence, 3 phrase, 4 whitespace, 5 none."""
    if i >= n:
        return 0
    if i <= 0:
        return 5
    at = lambda j: text[j] if 0 <= j < min(n, len(text)) else b""  # noqa: E731
    w_nonempty, newlines, tail, in_w = False, 0, [], True  # tail: P's last bytes, last first
    j = i - 1
    while j >= 0 and j >= i - 64 and len(tail) < 4:
        t = at(j)
        for k in range(len(t) - 1, -1, -1):
            if len(tail) >= 4:
                break
            c = t[k]
            if in_w and c in _WS:
                w_nonempty = True
                newlines += c == 10
                continue
            in_w = False
            tail.append(c)
        j -= 1
    p = bytes(reversed(tail))
    r0, r_end = 0, True
    for j in range(i, min(n, i + 64)):
        t = at(j)
        if t:
            r0, r_end = t[0], False
            break
    r_ws = not r_end and r0 in _WS
    last = p[-1] if p else 0
    prev = p[-2] if len(p) >= 2 else 0
    if newlines >= 2 or p.endswith((b"```", b"---", b"***")):
        return 1
    if p and (last in b"}]" or (last in b",;" and prev in b"}]")
              or (last == ord(">") and prev not in b"-=")):
        return 1
    if p and last in b".?!" and (w_nonempty or r_ws or r_end):
        return 2
    if p.endswith(_CJK_SENTENCE) or newlines == 1:
        return 2
    if p and last in b",;:":
        return 3
    if p.endswith(_CJK_PHRASE):
        return 3
    return 4 if (w_nonempty or r_ws) else 5


def _bytes_to_unicode():
    """GPT-2's byte <-> printable character table (byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer):
    """The bytes each token id decodes to, by spade's rules (Tokenizer::token_bytes, for a
    tokenizer.json: added tokens their text, byte-level BPE pieces through GPT-2's byte table,
    <0xXX> pieces of a byte-fallback model their byte, else "\u2581" as a space), from a
    transformers fast tokenizer (its tokenizer.json). LycheeCluster's structure-aware chunks
    read them (apply(..., token_text=tokenizer) calls this)."""
    import json
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise Error("spade.hf.token_bytes needs a transformers fast tokenizer (its "
                    "tokenizer.json); or give token_text as a list of bytes per token id")
    j = json.loads(backend.to_str())
    model = j.get("model") or {}

    def has_byte_level(x):
        if isinstance(x, dict):
            return x.get("type") == "ByteLevel" or any(has_byte_level(v) for v in x.values())
        return isinstance(x, list) and any(has_byte_level(v) for v in x)

    byte_level = (has_byte_level(j.get("pre_tokenizer")) or
                  (j.get("decoder") or {}).get("type") == "ByteLevel")
    vocab = model.get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {v[0]: i for i, v in enumerate(vocab)}
    n = max([i for i in vocab.values()] + [a["id"] for a in j.get("added_tokens") or []]) + 1
    pieces = [""] * n
    for piece, i in vocab.items():
        pieces[i] = piece
    added = set()
    for a in j.get("added_tokens") or []:
        if not pieces[a["id"]]:
            pieces[a["id"]] = a["content"]
        added.add(a["id"])
    table = _bytes_to_unicode() if byte_level else None
    fallback = bool(model.get("byte_fallback"))
    out = []
    for i, p in enumerate(pieces):
        if i in added:
            out.append(p.encode())
        elif byte_level:
            try:
                out.append(bytes(table[ch] for ch in p))
            except KeyError:
                out.append(p.encode())
        elif (fallback and len(p) == 6 and p.startswith("<0x") and p[5] == ">"
              and all(ch in "0123456789abcdefABCDEF" for ch in p[3:5])):
            out.append(bytes([int(p[3:5], 16)]))
        else:
            out.append(p.replace("\u2581", " ").encode())
    return out


class _LycheeCluster(_Method):
    """LycheeCluster (src/sparse/methods/lycheecluster.cpp): chunks after the sinks close as
    the sequence grows (fixed_chunk tokens, or structure-aware from each token's text:
    token_text); per (layer >= dense_layers, request, KV head) a spade.ops.ClusterIndex (CPU)
    is built over the closed chunks at the first sparse step and takes the chunks closed
    since once `buffer` tokens wait behind it; a head reads the sinks, the chunks its index
    search picks and every token not yet indexed."""
    name = "lycheecluster"

    def __init__(self, o, token_text=None):
        self.structure = o.str("chunking") == "structure"
        if self.structure and token_text is None:
            _unsupported("lycheecluster", "chunking", "structure without token_text",
                         "chunking=fixed, or chunking=structure with apply(..., token_text="
                         "tokenizer)", why="structure-aware chunks read each token's text")
        if o.str("seeding") != "stride":
            _unsupported("lycheecluster", "seeding", o.str("seeding"),
                         "seeding=stride (spade.ops.ClusterIndex)")
        self.o, self.token_text = o, token_text
        self.budget, self.total = o.int("budget"), o.str("budget_mode") == "total"
        self.sink, self.buffer, self.dense = o.int("sink"), o.int("buffer"), o.int("dense_layers")
        self.min_chunk, self.max_chunk = o.int("min_chunk"), o.int("max_chunk")
        if not 1 <= self.min_chunk <= self.max_chunk:
            raise Error(f"chunker: need 1 <= min_chunk ({self.min_chunk}) <= max_chunk "
                        f"({self.max_chunk})")
        self.fixed, self.tie_last = o.int("fixed_chunk"), o.str("tie") == "last"
        self.index_opts = dict(chunks_per_fine=o.float("chunks_per_fine"),
                               max_coarse=o.int("max_coarse"), coarse_units=o.int("coarse_units"),
                               kmeans_iterations=o.int("kmeans_iters"), pooling=o.str("pooling"),
                               space=o.str("bound"), f16_centers=o.str("center_dtype") == "f16")
        self.search_opts = dict(coarse_topk=o.int("coarse_topk"),
                                coarse_cover=o.float("coarse_cover"), group=o.str("group"),
                                rank=o.str("rank"))
        self.text = {}         # request -> bytes per position
        self.starts = {}       # request -> StreamingChunks' starts
        self.chunked_for = {}  # request -> L of its last extend
        self.have = {}         # (layer, request) -> chunks indexed
        self.index = {}        # (layer, request, KV head) -> ops.ClusterIndex

    def share(self, other):
        """Use the per-sequence state of `other` (twilight's budget=auto bases of one request
        share it, as spade's request state)."""
        for k in ("text", "starts", "chunked_for", "have", "index"):
            setattr(self, k, getattr(other, k))

    def reset(self):
        for d in (self.text, self.starts, self.chunked_for, self.have, self.index):
            d.clear()

    def feed(self, ids, start):
        """The token ids [B, T] of a forward pass at positions [start, start + T): their text
        (positions without text read as b"", as in spade)."""
        if not self.structure:
            return
        for b, row in enumerate(ids.tolist()):
            t = self.text.setdefault(b, [])
            del t[start:]
            t.extend([b""] * (start - len(t)))
            t.extend(self.token_text(i) for i in row)

    def describe(self):
        o = self.o
        ct = o.int("coarse_topk")
        cu = o.int("coarse_units")
        return (f"lycheecluster budget={self.budget} budget_mode={o.str('budget_mode')} "
                f"sink={self.sink} buffer={self.buffer} dense_layers={self.dense} "
                f"chunking={o.str('chunking')} "
                f"min_chunk={self.min_chunk} max_chunk={self.max_chunk} fixed_chunk={self.fixed} "
                f"tie={o.str('tie')} pooling={o.str('pooling')} bound={o.str('bound')} "
                f"chunks_per_fine={o.float('chunks_per_fine'):g} max_coarse={o.int('max_coarse')} "
                f"coarse_units={cu if cu else 'auto'} kmeans_iters={o.int('kmeans_iters')} "
                f"seeding=stride center_dtype={o.str('center_dtype')} "
                f"coarse_topk={ct if ct else 'auto'} coarse_cover={o.float('coarse_cover'):g} "
                f"group={o.str('group')} rank={o.str('rank')} stability={o.int('stability')}")

    def chunk(self, text, s, end):
        """chunk_tokens(final = false) over [s, end) of the first `end` tokens: the starts of
        the chunks it closes, and where the open tail begins."""
        starts = []
        if not self.structure:
            while s < end and end - s >= self.fixed:
                starts.append(s)
                s += self.fixed
            return starts, s
        while s < end and end - s > self.max_chunk:
            best_level, best_n = 5, self.max_chunk
            for n in range(self.min_chunk, self.max_chunk + 1):
                lv = _cut_level(text, end, s + n)
                if lv == 5:
                    continue
                if lv < best_level or (lv == best_level and self.tie_last):
                    best_level, best_n = lv, n
            starts.append(s)
            s += best_n
        return starts, s

    def extend(self, b, L):
        """StreamingChunks::extend: close the chunks that tokens [0, L) allow."""
        if self.chunked_for.get(b) == L:
            return
        self.chunked_for[b] = L
        st = self.starts.setdefault(b, [])
        s = st.pop() if st else self.sink
        if s < L:
            new, s = self.chunk(self.text.get(b, []), s, L)
            st += new
        st.append(s)

    def keys(self, c, b, h, n):
        """Keys [n, D] fp32 on the CPU of positions [0, n) of request b, KV head h."""
        pages = (c.torch.arange((n + c.P - 1) // c.P) * c.B + b).to(c.dev)
        return c.kv.k[pages, h].reshape(-1, c.D)[:n].float().cpu().contiguous()

    def sync(self, c, b):
        have = self.have.get((c.layer, b), 0)
        st = self.starts.get(b, [])
        indexed_end = st[have] if have > 0 else self.sink
        if have > 0 and c.L - indexed_end < self.buffer:
            return
        self.extend(b, c.L - 1)  # the current token is never indexed in its own step
        st = self.starts[b]
        avail = len(st) - 1
        if avail <= have:
            return
        starts = c.torch.tensor(st[:avail + 1], dtype=c.torch.int32)
        for h in range(c.Hkv):
            k = self.keys(c, b, h, st[avail])
            if have == 0:
                self.index[c.layer, b, h] = ops.ClusterIndex(**self.index_opts).build(k, starts)
            else:
                for ch in range(have, avail):
                    self.index[c.layer, b, h].insert(k, starts[:ch + 2].contiguous())
        self.have[c.layer, b] = avail

    def select(self, c):
        torch, L = c.torch, c.L
        fits = L <= self.budget if self.total else L <= self.sink + self.budget
        if c.layer < self.dense or fits:
            return DENSE
        q = c.q.float().cpu()
        sink = min(self.sink, L)
        rows = []
        for b in range(c.B):
            self.sync(c, b)
            have = self.have.get((c.layer, b), 0)
            st = self.starts.get(b, [])
            recent = st[have] if have > 0 else sink
            budget = max(0, self.budget - sink - (L - recent)) if self.total else self.budget
            starts = torch.tensor(st[:have + 1], dtype=torch.int32)
            for h in range(c.Hkv):
                parts = [torch.arange(sink)]
                if have > 0:
                    qh = q[b, h * c.G:(h + 1) * c.G].contiguous()
                    parts.append(self.index[c.layer, b, h].search(qh, budget, starts,
                                                                  **self.search_opts).long())
                parts.append(torch.arange(max(recent, sink), L))
                rows.append(torch.cat(parts))
        return c.lists(rows, c.Hkv)


class _Model:
    """What a method needs of the model: arch, layers, hidden size, KV heads."""

    def __init__(self, config, n_layers, token_text=None):
        self.arch, self.n_layers, self.token_text = _arch(config), n_layers, token_text
        self.hidden = getattr(config, "hidden_size", 0)
        self.Hkv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads


_CLASSES = {"full": None, "streaming": _Streaming, "quest": _Quest, "tidal": _Tidal,
            "lessismore": _LessIsMore, "lycheecluster": _LycheeCluster,
            "oracle-topk": _OracleTopK, "oracle-topp": _OracleTopP}


def _check_name(name):
    if name in _NOT_HOOKED:
        raise Error(f"spade.hf: method '{name}' is not supported by the Hugging Face hook "
                    f"({_NOT_HOOKED[name]}); supported: {', '.join(METHODS)}")
    if name not in _SPECS:
        raise Error(f"spade.hf: unknown method '{name}' (one of {', '.join(METHODS)})")


def _make(name, given, model):
    """The method `name` (or a stack "base+twilight") with its given options (text)."""
    if "+" in name:
        stages = [s.strip() for s in name.split("+")]
        if any(not s for s in stages):
            raise Error(f"empty stage in sparse method stack '{name}'")
        for s in stages:
            _check_name(s)
        if stages[-1] != "twilight":
            raise Error(f"sparse stack '{name}': '{stages[-1]}' cannot stack on a base (the hook "
                        f"stacks twilight only: 'base+twilight')")
        if "base" in given:
            raise Error(f"sparse stack '{name}' and option base={given['base']} both name a base")
        return _make("twilight", dict(given, base="+".join(stages[:-1])), model)
    _check_name(name)
    if name == "twilight":
        own = _SPECS["twilight"]
        base = given.get("base", own["base"].default).strip()
        if "+" in base:
            raise Error(f"spade.hf: twilight's base must be one method, not the stack '{base}'")
        _check_name(base)
        if base == "twilight":
            raise Error("twilight: the base cannot be twilight")
        theirs = _SPECS[base]
        for k in given:
            if k != "base" and k not in own and k not in theirs:
                raise Error(f"twilight: option '{k}' belongs neither to twilight nor to its base "
                            f"'{base}'")
        o = _Options("twilight", {k: v for k, v in given.items() if k in own}, model.n_layers)
        return _Twilight(o, base, {k: v for k, v in given.items() if k in theirs}, model)
    o = _Options(name, given, model.n_layers)
    cls = _CLASSES[name]
    if cls is None:
        return _Method()
    if cls is _LycheeCluster:
        return cls(o, model.token_text)
    return cls(o, model) if cls in (_Tidal, _LessIsMore) else cls(o)


class _Config:
    def __init__(self, method, page_size, n_layers):
        self.method, self.name = method, method.name
        self.P, self.n_layers, self.Hkv = page_size, n_layers, None
        self.stats = {"decode_steps": 0, "rows_read": 0, "rows_total": 0}
        self.step_rows = []  # per decode step, per request: tokens read over (layer, KV head)


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
        self.step = -1  # decode steps seen (a step starts at layer 0)
        self.pending_ids = []  # input ids of forwards whose layer 0 has not run yet
        # One set of tables (and on CUDA plans) per decode step for every layer (their page
        # tables are the same).
        self.plan_key = None
        self.dec = self.sp = None
        self.tables = self.tables_dev = None

    def plan(self, kv, Hq):
        """The step's tables (host and device) and, on CUDA, the DecodeAttention (and for quest
        the SparseAttention) plans for this step's batch."""
        cfg, dev = self.cfg, kv.device
        key = (kv.B, kv.length, Hq, kv.Hkv, kv.D, str(dev))
        if self.plan_key == key:
            return
        ip, ix, ln = kv.tables()
        self.tables = (ip, ix, ln)
        self.tables_dev = (ip.to(dev), ix.to(dev), ln.to(dev))
        self.plan_key = key
        if dev.type != "cuda":
            return
        pages = ix.numel()
        grow = lambda w: (w is None or w.max_batch < kv.B or w.max_pages < pages  # noqa: E731
                          or (w.Hq, w.Hkv, w.D, w.P) != (Hq, kv.Hkv, kv.D, kv.P))
        if grow(self.dec):
            self.dec = ops.DecodeAttention(max(8, kv.B), Hq, kv.Hkv, kv.D, kv.P, device=dev,
                                           max_pages=max(4096, 2 * pages))
        self.dec.plan(ip, ix, ln)
        if cfg.name == "quest":
            if grow(self.sp):
                self.sp = ops.SparseAttention(max(8, kv.B), Hq, kv.Hkv, kv.D, kv.P, device=dev,
                                              max_pages=max(4096, 2 * pages))
            self.sp.plan(ip, ix, ln, max_entries=cfg.method.budget // cfg.P, granularity="page")


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


def _counts(sel, c):
    """Tokens read per (request, KV head) of a selection: a host tensor [B, Hkv], counted from
    the lists (on CUDA quest's planned lists give their count without a sync)."""
    torch = c.torch
    if sel is DENSE or sel is SCORES:
        return torch.full((c.B, c.Hkv), c.L, dtype=torch.int64)
    if isinstance(sel.counts, int) and c.dev.type == "cuda":  # no sync for quest's plan
        return torch.full((c.B, c.Hkv), sel.counts, dtype=torch.int64)
    if sel.counts is not None and not isinstance(sel.counts, int):
        return sel.counts.to(torch.int64)
    off = sel.off.cpu().to(torch.int64)
    if sel.gran == "token":
        n = off[1:] - off[:-1]
    else:  # pages: each names up to P tokens, the last page of the sequence fewer
        idx = sel.idx[:int(off[-1])].cpu().to(torch.int64)
        rows = (c.L - idx * c.P).clamp(max=c.P)
        n = torch.stack([rows[off[i]:off[i + 1]].sum() for i in range(off.numel() - 1)])
    return n.view(c.B, sel.lpr).expand(c.B, c.Hkv)


def _attend(state, layer, query, key, value, mask, scale):
    """The attention of one layer. query [B, Hq, T, D]; key, value [B, Hkv, S, D] (the whole
    cache after this step's append); returns [B, Hq, T, D]."""
    cfg = state.cfg
    B, Hq, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    kv = state.kv.get(layer)
    if kv is None or kv.B != B or kv.length + T != S or kv.dtype != key.dtype:
        # A new sequence (or one this store has not followed): rebuild from the model's cache.
        kv = _PagedKV(B, Hkv, D, cfg.P, key.dtype, key.device, cfg.method.needs_meta)
        state.kv[layer] = kv
        if layer == 0:
            cfg.method.reset()
        if S > T:
            kv.append(key[:, :, :S - T], value[:, :, :S - T])
    if layer == 0 and state.pending_ids:  # the token ids of this forward (embedding hook)
        ids = state.pending_ids[-1]
        if ids.shape == (B, T):
            cfg.method.feed(ids, S - T)
        state.pending_ids.clear()
    kv.append(key[:, :, S - T:], value[:, :, S - T:])
    if T > 1:
        return _eager(query, key, value, mask, scale)
    if mask is not None and bool((~mask[..., :S] if mask.dtype == _torch_bool() else
                                  mask[..., :S] < 0).any()):
        raise Error("spade.hf: padded batches do not decode yet (every sequence of a batch "
                    "must have the same length); use one prompt per batch")
    q = query[:, :, 0, :].contiguous()
    cuda = q.device.type == "cuda"
    state.plan(kv, Hq)
    if layer == 0:  # a new decode step
        state.step += 1
        cfg.step_rows.append([0] * B)
    c = _Ctx(layer, state.step, q, kv, state.tables, state.tables_dev, scale)
    sel = cfg.method.select(c)
    if sel is DENSE or sel is SCORES:
        if cuda:
            out = state.dec.run(q, kv.k, kv.v, scale=scale)
        else:
            out = ops.decode_attention(q, kv.k, kv.v, c.ip, c.ix, c.ln, scale=scale)
        if sel is SCORES:
            cfg.method.on_scores(c)
    elif cuda and sel.planned and state.sp is not None:
        out = state.sp.run(q, kv.k, kv.v, sel.off, sel.idx, scale=scale)
    else:
        ip, ix, ln = (c.dip, c.dix, c.dln) if cuda else (c.ip, c.ix, c.ln)
        out = ops.sparse_attention(q, kv.k, kv.v, ip, ix, ln, sel.off, sel.idx,
                                   granularity=sel.gran, scale=scale)
    n = _counts(sel, c)
    cfg.Hkv = Hkv
    cfg.stats["decode_steps"] += 1
    cfg.stats["rows_total"] += B * Hkv * S
    cfg.stats["rows_read"] += int(n.sum())
    if cfg.step_rows:
        row = cfg.step_rows[-1]
        for b, x in enumerate(n.sum(1).tolist()):
            row[b] += x
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


def _uses_quest(name, given):
    stages = [s.strip() for s in name.split("+")]
    if stages[-1] == "twilight" and len(stages) == 1:
        stages = [given.get("base", _SPECS["twilight"]["base"].default).strip()]
    return "quest" in stages


def _text_fn(token_text):
    """token_text (a tokenizer, a list of bytes / str per id, or a callable id -> bytes) as a
    function id -> bytes (b"" for an id a list does not hold)."""
    if token_text is None:
        return None
    if hasattr(token_text, "backend_tokenizer") or hasattr(token_text, "convert_ids_to_tokens"):
        token_text = token_bytes(token_text)
    as_bytes = lambda t: t.encode() if isinstance(t, str) else bytes(t)  # noqa: E731
    if callable(token_text):
        return lambda i: as_bytes(token_text(i))
    table = [as_bytes(t) for t in token_text]
    return lambda i: table[i] if 0 <= i < len(table) else b""


def apply(model, method: str = "full", budget: Optional[int] = None,
          page_size: Optional[int] = None, dense_layers: Optional[int] = None,
          token_text=None, **options):
    """Makes `model` (a transformers causal LM) decode with spade's kernels and a sparse method.

    method: one of METHODS, or spade's method spec as `spade generate --sparse` takes it
    ("tidal:budget=256,selection_layers=2,4", "quest+twilight:budget=64"). budget,
    dense_layers and **options (any other option of the method, e.g. sinks=8,
    selection_layers=[2, 4], p=0.9) override the spec's; option names, defaults and ranges are
    spade's (src/sparse/methods). page_size: tokens per page of the paged copy (default 16:
    spade's GPU page), and Quest's page_size option where the method runs quest.
    token_text: each token's text for LycheeCluster's structure-aware chunks (chunking=
    structure, its default): a transformers fast tokenizer (read by spade.hf.token_bytes with
    spade's rules), a list of bytes per token id, or a callable id -> bytes; the input ids
    reach the method through a hook on the model's input embeddings. A bad name or value, or
    a method / option value the hook does not run, raises spade.Error. Returns the
    model; spade.hf.stats(model) gives the decode steps' rows read, spade.hf.remove(model)
    undoes this."""
    if getattr(model, "_spade_hf", None) is not None:
        remove(model)
    if not isinstance(method, str):
        raise Error(f"spade.hf: method must be a string, not {type(method).__name__}")
    name, given = parse_spec(method)
    for k, v in [("budget", budget), ("dense_layers", dense_layers)] + list(options.items()):
        if v is not None:
            given[k] = _text(v)
    quest = _uses_quest(name, given)
    if page_size is not None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise Error(f"spade.hf: page_size must be a positive int, got {page_size!r}")
        if quest:
            given["page_size"] = str(page_size)
    mods = _attention_modules(model)
    n_layers = getattr(model.config, "num_hidden_layers", None) or len(mods)
    m = _make(name, given, _Model(model.config, n_layers, _text_fn(token_text)))
    if quest:
        page_size = (m if m.name == "quest" else m.base).page
    state = _State(_Config(m, page_size or 16, n_layers))
    reg = _registry()
    saved = {"impl": getattr(model.config, "_attn_implementation", None), "forwards": []}
    for mod in mods:
        mod._spade_state = state
    if token_text is not None:  # the ids of every forward, for the method's token text
        def ids_hook(module, args):
            if args and hasattr(args[0], "is_floating_point") and not args[0].is_floating_point():
                state.pending_ids.append(args[0].detach().cpu())
        saved["ids_hook"] = model.get_input_embeddings().register_forward_pre_hook(ids_hook)
    if reg is not None:
        _register(reg, _attention_function)
        try:  # transformers with a mask registry (4.53+): spade takes eager's mask
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks
            _register(masks, masks["eager"])
        except (ImportError, KeyError, TypeError):
            pass
        for cfg in {id(c): c for c in [model.config] + [getattr(x, "config", None) for x in mods]
                    if c is not None}.values():
            cfg._attn_implementation = "spade"
    else:
        for mod in mods:
            saved["forwards"].append((mod, mod.__dict__.get("forward")))
            mod.forward = types.MethodType(_forward_llama, mod)
    model._spade_hf = (state, saved)
    return model


def remove(model):
    """Undoes apply(): transformers' own attention again."""
    st = getattr(model, "_spade_hf", None)
    if st is None:
        return model
    state, saved = st
    if "ids_hook" in saved:
        saved["ids_hook"].remove()
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
    """The decode steps since apply(): "method" (the method and its effective options, as
    spade's describe()), "decode_steps" (layer calls), "rows_read" / "rows_total" (cached K/V
    rows per KV head read / held), "density", and "tokens_per_head": per decode step, per
    sequence, the tokens read per (layer, KV head), averaged (spade generate --stats-jsonl's
    tokens_per_head)."""
    st = getattr(model, "_spade_hf", None)
    if st is None:
        raise Error("spade.hf.stats: spade.hf.apply was not called on this model")
    cfg = st[0].cfg
    s = dict(cfg.stats)
    s["method"] = cfg.method.describe()
    s["density"] = s["rows_read"] / s["rows_total"] if s["rows_total"] else None
    per = cfg.n_layers * (cfg.Hkv or 1)
    s["tokens_per_head"] = [[x / per for x in row] for row in cfg.step_rows]
    return s

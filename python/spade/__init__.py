"""spade: sparse-attention decoding for long-context LLMs, as a Python library.

    import spade
    llm = spade.LLM("models/SmolLM2-135M-Instruct.Q4_1.gguf")          # device="cuda" on a GPU
    outs = llm.generate(["Once upon a time"], spade.SamplingParams(max_tokens=32),
                        sparse="quest:budget=256")                      # or one spec per prompt
    print(outs[0].text, outs[0].token_ids)

The engine is spade's C++ one (src/api/llm.h): the same scheduler, runner and methods as
`spade serve`, prompts batched together, each with its own sampling parameters and sparse
method. spade.ops holds the kernels as functions on torch tensors (paged decode and sparse
attention, the selectors). docs/python.md has the details. torch is needed by spade.ops
only (imported when it is first used).
"""
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

from . import _core

Error = _core.Error

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Error"]


def __getattr__(name):  # spade.ops (and spade.hf) load on first use: they import torch
    if name in ("ops", "hf"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class SamplingParams:
    """Per-prompt sampling, vLLM's names. temperature 0 (the default) is greedy."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # k: each token's logprob and the top k

    def _to_core(self, sparse: Optional[str]) -> "_core.GenerateParams":
        g = _core.GenerateParams()
        g.max_tokens = int(self.max_tokens)
        g.temperature = float(self.temperature)
        g.top_k = int(self.top_k)
        g.top_p = float(self.top_p)
        g.min_p = float(self.min_p)
        g.repetition_penalty = float(self.repetition_penalty)
        if self.seed < 0:
            raise Error("seed must be >= 0")
        g.seed = int(self.seed)
        if isinstance(self.stop, str):
            raise Error("stop must be a list of strings, not a string")
        g.stop = list(self.stop)
        g.stop_token_ids = [int(t) for t in self.stop_token_ids]
        g.ignore_eos = bool(self.ignore_eos)
        g.logprobs = -1 if self.logprobs is None else int(self.logprobs)
        if self.logprobs is not None and self.logprobs < 0:
            raise Error("logprobs must be None or >= 0")
        g.sparse = sparse or ""
        return g


@dataclass
class RequestOutput:
    """One completion: ids, text (continuing the prompt's), why it ended, logprobs, density."""
    prompt_token_ids: List[int]
    token_ids: List[int]
    text: str
    finish_reason: str
    logprobs: Optional[List[float]] = None
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    density: Optional[float] = None  # attention density over its decode steps
    sparse: str = "full"


class LLM:
    """A model loaded once; generate() runs a list of prompts together.

    model: a GGUF file or a Hugging Face model directory. device: "cpu" or "cuda".
    threads: CPU threads (0: every core). max_context: longest prompt + completion (0: the
    model's). max_batch: sequences per step. cpu_weights: "auto" | "native" | "f32".
    kv_dtype: the KV cache's elements, "bf16" (default) | "f16" | "f32" (the reference) |
    "fp8" (E4M3 with power-of-two scales per layer and KV head; CUDA: "bf16" | "fp8").
    kv_scale: fp8 only, "auto" (from the first forward step) or a number (rounded up to a
    power of two), as --kv-scale. kv_pages: KV pages (0: sized like `spade serve`); kv_mem: or
    the pages that many GiB of K and V hold (fp8: twice bf16's), as --kv-mem.
    tokenizer: another tokenizer path. deterministic: batch-invariant GPU decoding.
    """

    def __init__(self, model: str, device: str = "cpu", *, threads: int = 0, max_context: int = 0,
                 max_batch: int = 16, max_step_tokens: int = 512, page_size: int = 16,
                 kv_pages: int = 0, kv_mem: float = 0.0, cpu_weights: str = "auto",
                 tokenizer: Optional[str] = None,
                 deterministic: bool = False, kv_dtype: str = "bf16", kv_scale="auto"):
        o = _core.LLMOptions()
        o.device = device
        o.threads = threads
        o.max_context = max_context
        o.max_batch = max_batch
        o.max_step_tokens = max_step_tokens
        o.page_size = page_size
        o.kv_pages = kv_pages
        o.kv_mem = float(kv_mem)
        o.cpu_weights = cpu_weights
        o.kv_dtype = kv_dtype
        o.kv_scale = str(kv_scale)
        o.tokenizer = tokenizer or ""
        o.deterministic = deterministic
        self._llm = _core.LLM(str(model), o)

    @property
    def device(self) -> str:
        return self._llm.device()

    @property
    def max_context(self) -> int:
        return self._llm.max_context()

    @property
    def vocab_size(self) -> int:
        return self._llm.vocab_size()

    def encode(self, text: str, add_special: bool = True) -> List[int]:
        return self._llm.encode(text, add_special)

    def decode(self, ids: Sequence[int]) -> str:
        return self._llm.decode(list(ids))

    def generate(self, prompts: Union[str, Sequence[str], Sequence[Sequence[int]]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 sparse: Union[None, str, Sequence[Optional[str]]] = None) -> List[RequestOutput]:
        """Completions of `prompts` (texts, or token-id lists), one per prompt, in order.

        sampling_params and sparse: one for all prompts or one per prompt. sparse takes the
        CLI's spec, e.g. "quest:budget=256" or "quest+twilight:budget=2048"; None: full.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        n = len(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * n if isinstance(params, SamplingParams) else list(params)
        specs = [sparse] * n if sparse is None or isinstance(sparse, str) else list(sparse)
        if len(params) != n or len(specs) != n:
            raise Error(f"give one sampling_params / sparse for all {n} prompts or one per prompt "
                        f"(got {len(params)} / {len(specs)})")
        core = [p._to_core(s) for p, s in zip(params, specs)]
        if all(isinstance(p, str) for p in prompts):
            outs = self._llm.generate(prompts, core)
        elif all(not isinstance(p, str) for p in prompts):
            outs = self._llm.generate_ids([[int(t) for t in p] for p in prompts], core)
        else:
            raise Error("prompts must be all texts or all token-id lists")
        res = []
        for o, p, s in zip(outs, params, specs):
            want_lp = p.logprobs is not None
            res.append(RequestOutput(
                prompt_token_ids=list(o.prompt_token_ids), token_ids=list(o.token_ids), text=o.text,
                finish_reason=o.finish_reason,
                logprobs=list(o.logprobs) if want_lp else None,
                top_logprobs=[list(t) for t in o.top_logprobs] if want_lp else None,
                density=o.density if o.density >= 0 else None, sparse=s or "full"))
        return res

    def chat(self, messages: Sequence[dict], sampling_params: Optional[SamplingParams] = None,
             sparse: Optional[str] = None) -> RequestOutput:
        """One reply to a conversation [{"role": ..., "content": ...}, ...], rendered with the
        model's chat template (its own special tokens, as `spade chat` does)."""
        text = self._llm.apply_chat_template([(m["role"], m["content"]) for m in messages])
        ids = self._llm.encode(text, False)
        return self.generate([ids], sampling_params, sparse)[0]

#!/usr/bin/env python3
"""The Python package (python/spade) against `spade generate` on the stories260k fixture:

- greedy completions of spade.LLM equal `spade generate`'s tokens (read from --stats-jsonl),
  with full attention and with a sparse method, alone and in one batch of prompts that each
  name their own method and sampling parameters;
- token-id prompts, logprobs (greedy: the best of the top k is the token), stop strings and
  stop ids, seeds, density below 1 for a sparse method;
- bad input raises spade.Error (a ValueError) that says what is wrong; the LLM keeps working.
Exits 77 (skipped) when the package was not built (no pybind11).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "models", "stories260k-hf")


def cli_tokens(spade_bin, prompt, n, sparse=None, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "steps.jsonl")
        cmd = [spade_bin, "generate", "-m", MODEL, "-p", prompt, "-n", str(n), "--ignore-eos",
               "--stats-jsonl", js] + list(extra)
        if sparse:
            cmd += ["--sparse", sparse]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return [json.loads(line)["id"] for line in open(js) if line.strip()]


def expect_error(fn, words):
    import spade
    try:
        fn()
    except spade.Error as e:
        assert isinstance(e, ValueError)
        for w in words:
            assert w in str(e), (w, str(e))
        return
    raise AssertionError(f"no error for {words}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    spade_bin = ap.parse_args().spade
    try:
        import spade
    except ImportError as e:
        print(f"spade package not built: {e}")
        return 77
    llm = spade.LLM(MODEL)
    assert llm.device == "cpu" and llm.vocab_size == 512 and llm.max_context == 512
    prompts = ["Once upon a time", "The little dog was", "Lily and Tom went to the park"]
    greedy = spade.SamplingParams(max_tokens=40, ignore_eos=True)
    # Each alone against the CLI, full and a sparse method.
    for p in prompts:
        out = llm.generate(p, greedy)[0]
        assert out.token_ids == cli_tokens(spade_bin, p, 40), p
        assert out.finish_reason == "length" and out.prompt_token_ids == llm.encode(p)
    sp = "streaming:budget=16"
    want_sparse = cli_tokens(spade_bin, prompts[2], 40, sp)
    assert llm.generate(prompts[2], greedy, sparse=sp)[0].token_ids == want_sparse
    # One batch: per-prompt methods and lengths.
    short = spade.SamplingParams(max_tokens=9, ignore_eos=True)
    outs = llm.generate(prompts, [greedy, short, greedy], sparse=[None, None, sp])
    assert outs[0].token_ids == cli_tokens(spade_bin, prompts[0], 40)
    assert outs[1].token_ids == cli_tokens(spade_bin, prompts[1], 40)[:9]
    assert outs[2].token_ids == want_sparse
    assert outs[2].sparse == sp and outs[0].sparse == "full"
    assert outs[0].density == 1.0 and 0 < outs[2].density < 1, (outs[0].density, outs[2].density)
    # Token-id prompts give the same as their text.
    ids = llm.encode(prompts[0])
    assert llm.generate([ids], greedy)[0].token_ids == outs[0].token_ids
    # Logprobs.
    lp = llm.generate(prompts[0], spade.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))[0]
    assert len(lp.logprobs) == 6 and len(lp.top_logprobs) == 6
    for t, l, top in zip(lp.token_ids, lp.logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[0][0] == t and abs(top[0][1] - l) < 1e-6 and l <= 0
    assert outs[0].logprobs is None
    # Stops: an id and a string.
    stop_id = outs[0].token_ids[4]
    s = llm.generate(prompts[0], spade.SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert s.finish_reason == "stop" and len(s.token_ids) <= 5
    word = outs[0].text.split()[3]
    s = llm.generate(prompts[0], spade.SamplingParams(max_tokens=40, ignore_eos=True, stop=[word]))[0]
    assert s.finish_reason == "stop" and word not in s.text, (word, s.text)
    # Seeds repeat; the default temperature is greedy.
    t1 = spade.SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=11)
    assert llm.generate(prompts[0], t1)[0].token_ids == llm.generate(prompts[0], t1)[0].token_ids
    assert llm.generate(prompts[0], spade.SamplingParams(max_tokens=40, ignore_eos=True, seed=5))[0].token_ids \
        == outs[0].token_ids
    # An FP8 KV cache (E4M3, a fixed scale, and auto) gives the CLI's tokens with the same options.
    for scale in (0.25, "auto"):
        llm8 = spade.LLM(MODEL, kv_dtype="fp8", kv_scale=scale)
        want8 = cli_tokens(spade_bin, prompts[1], 24, extra=["--kv-dtype", "fp8", "--kv-scale", str(scale)])
        assert llm8.generate(prompts[1], spade.SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids == want8, scale
    # --kv-mem as kv_mem: the pages that many GiB of K and V hold (fp8: twice bf16's); the
    # tokens are those of a pool sized by pages.
    llm_mem = spade.LLM(MODEL, kv_dtype="fp8", kv_scale=0.25, kv_mem=0.05)
    assert llm_mem.generate(prompts[1], spade.SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids \
        == cli_tokens(spade_bin, prompts[1], 24, extra=["--kv-dtype", "fp8", "--kv-scale", "0.25"])
    expect_error(lambda: spade.LLM(MODEL, kv_mem=-1), ["kv-mem", "positive"])
    expect_error(lambda: spade.LLM(MODEL, kv_mem=1e-9), ["kv-mem", "holds no KV page"])
    expect_error(lambda: spade.LLM(MODEL, kv_mem=0.5, kv_pages=8), ["kv_pages", "kv_mem"])
    # Errors.
    expect_error(lambda: spade.LLM(MODEL, kv_dtype="fp8", kv_scale="x"), ["kv_scale"])
    expect_error(lambda: spade.LLM(MODEL, kv_scale=0.5), ["kv_scale", "fp8"])
    expect_error(lambda: llm.generate(prompts[:2], greedy, sparse=["full", "quest:budget=-1"]), ["prompt 1", "budget"])
    expect_error(lambda: llm.generate("x", greedy, sparse="nosuchmethod"), ["nosuchmethod"])
    expect_error(lambda: llm.generate(prompts, [greedy, greedy]), ["one per prompt"])
    expect_error(lambda: llm.generate([[1, 100000]], greedy), ["outside the vocabulary"])
    expect_error(lambda: llm.generate("x", spade.SamplingParams(top_p=0)), ["top_p"])
    expect_error(lambda: llm.generate("x", spade.SamplingParams(stop="a")), ["list of strings"])
    expect_error(lambda: llm.generate(["x", [1, 2]], greedy), ["all texts"])
    expect_error(lambda: llm.chat([{"role": "user", "content": "hi"}]), ["chat template"])
    expect_error(lambda: spade.LLM(MODEL, device="tpu"), ["device"])
    expect_error(lambda: spade.LLM(os.path.join(MODEL, "missing")), ["missing"])
    assert llm.generate("x", short)[0].token_ids  # still works
    print("python api: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

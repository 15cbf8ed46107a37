#!/usr/bin/env python3
"""`spade eval agree --ref-kv-dtype T` end to end on SmolLM2 (a few seconds; skipped without
the model): each method's reference is the same method over a KV cache of type T.

- in a bf16 sweep with --ref-kv-dtype f32, every record's reference output is the output the
  same method gives in a plain f32 sweep, and its own output the one of a plain bf16 sweep
  (the reference is the method over the other cache, not full attention);
- the records and the results' meta say what the reference is;
- the sweep's own type as the reference, or an unknown type, is a clear error.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    spade = ap.parse_args().spade
    if not os.path.exists(MODEL):
        print("skipped: %s is missing (make model)" % MODEL)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        words = ("once upon a time there was a little girl named lily she liked to play with her "
                 "ball in the park one day she saw a big dog the dog was happy and they played").split()
        rng = random.Random(3)
        text = os.path.join(tmp, "text.txt")
        with open(text, "w") as f:
            f.write(" ".join(rng.choice(words) for _ in range(2000)))

        def agree(name, *extra):
            out = os.path.join(tmp, name + ".json")
            cmd = [spade, "eval", "agree", "--model", MODEL, "--text", text, "--methods",
                   "full;quest:budget=64", "--lengths", "300", "--samples", "2", "--tasks",
                   "niah_single_number", "--max-new", "24", "--threads", "2", "--out", out, *extra]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            return p, (json.load(open(out)) if p.returncode == 0 else None)

        p, ref = agree("ref", "--kv-dtype", "bf16", "--ref-kv-dtype", "f32")
        assert p.returncode == 0, p.stderr
        _, f32 = agree("f32", "--kv-dtype", "f32")
        _, bf16 = agree("bf16", "--kv-dtype", "bf16")
        assert ref["meta"]["reference"] == "each method over a f32 KV cache", ref["meta"]
        assert ref["meta"]["reference_kv_dtype"] == "f32", ref["meta"]
        # The Markdown report names the reference in its headings, not full attention.
        md = open(os.path.join(tmp, "ref.md")).read()
        assert "## Output identical to the f32 reference's" in md and "KL(method@f32 || method)" in md, md[:1500]
        assert "## Output identical to full attention's" in open(os.path.join(tmp, "f32.md")).read()
        out_f32 = {(r["method"], r["sample"]): r["output"] for r in f32["results"]}
        out_bf16 = {(r["method"], r["sample"]): r["output"] for r in bf16["results"]}
        recs = ref["results"]
        assert len(recs) == 4, len(recs)
        for r in recs:
            k = (r["method"], r["sample"])
            assert r["reference"] == r["method"] + " kv f32", r["reference"]
            assert r["full_output"] == out_f32[k], (k, r["full_output"], out_f32[k])
            assert r["output"] == out_bf16[k], (k, r["output"], out_bf16[k])
            assert 0 <= r["first_divergence"] <= r["full_tokens"] and r["kl_mean"] >= 0
        for r in f32["results"]:
            assert r["reference"] == "full", r["reference"]
        for extra, words in ((["--ref-kv-dtype", "f32"], "is the sweep's own --kv-dtype"),
                             (["--ref-kv-dtype", "f12"], "--ref-kv-dtype: unknown KV cache type")):
            p, _ = agree("bad", *extra)
            assert p.returncode != 0 and words in p.stderr, (extra, p.stderr)
    print("eval agree --ref-kv-dtype: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

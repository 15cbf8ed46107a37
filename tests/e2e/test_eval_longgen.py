#!/usr/bin/env python3
"""`spade eval longgen` end to end on the stories260k fixture (a few seconds): a short prompt
and 160 generated tokens per sample, full attention as the reference.

- full attention against itself: no divergence over all 160 tokens, KL 0, top-1 1, its
  perplexity equal to the reference's, density and recall 1;
- streaming and quest at budget 32 (the context reaches 176): each record has its fields in
  range (divergence <= 160, KL >= 0 with the per-window means averaging to it, top-1 in
  [0, 1], density < 1, sparse-layer recall in (0, 1]); streaming's density is the exact
  window fraction the method reads;
- blasst counts only its kept tiles: density < 1 while its KL stays small;
- the Markdown report has its sections; a resumed run adds nothing; prompt + generated tokens
  past the model's context is a clear error;
- --follow-text: teacher forced along the text after the prompt ("reference": "text"): full
  attention against itself has KL 0, top-1 1 and the text's perplexity as its own, which is
  higher than that of its greedy tokens; cache correction after every token reports its
  corrections.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "models", "stories260k-hf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    spade = ap.parse_args().spade
    with tempfile.TemporaryDirectory() as tmp:
        words = ("once upon a time there was a little girl named lily she liked to play with her "
                 "ball in the park one day she saw a big dog the dog was happy and they played").split()
        rng = random.Random(3)
        text = os.path.join(tmp, "text.txt")
        with open(text, "w") as f:
            f.write(" ".join(rng.choice(words) for _ in range(2000)))
        out = os.path.join(tmp, "lg.json")
        cmd = [spade, "eval", "longgen", "--model", MODEL, "--text", text, "--methods",
               "full;streaming:budget=32;quest:budget=32;blasst:lambda=0.5,tile=8", "--lengths", "160",
               "--samples", "2", "--prompt-tokens", "16", "--window", "40", "--recall", "--out", out]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr
        recs = json.load(open(out))["results"]
        assert len(recs) == 8, len(recs)
        for r in recs:
            assert r["length"] == 160 and r["prompt_tokens"] == 16
            assert 0 <= r["first_divergence"] <= 160
            assert r["kl_mean"] >= 0 and 0 <= r["top1_agreement"] <= 1
            w = r["kl_windows"]
            assert len(w) == 4, w  # 159 teacher-forced steps in windows of 40
            kl_from_windows = (sum(w[:3]) * 40 + w[3] * 39) / 159
            assert abs(kl_from_windows - r["kl_mean"]) < 1e-9 * (1 + r["kl_mean"]), (w, r["kl_mean"])
            assert r["ppl"] >= 1 and r["ppl_full"] >= 1
            assert 0 < r["sparse_recall"] <= 1 + 1e-6
            if r["method"] == "full":
                assert r["first_divergence"] == 160 and r["same_output"] == 1
                assert r["kl_mean"] == 0 and r["top1_agreement"] == 1
                assert abs(r["ppl"] - r["ppl_full"]) < 1e-9 * r["ppl"]
                assert r["density"] == 1 and abs(r["sparse_recall"] - 1) < 1e-6
            else:
                assert r["density"] < 1, r
                assert r["ppl"] >= r["ppl_full"] * 0.98, r  # scoring full's own greedy tokens
            if r["method"].startswith("streaming"):
                # Each of the 159 steps reads min(L, 32) of L = 17..175 tokens in every layer.
                want = sum(min(L, 32) / L for L in range(17, 176)) / 159
                assert abs(r["density"] - want) < 1e-6, (r["density"], want)
            if r["method"].startswith("blasst"):
                assert r["kl_mean"] < 0.05, r
        md = open(out[:-5] + ".md").read()
        for sec in ("# spade eval longgen", "## Tokens until first divergence", "## Mean per-step KL",
                    "## Top-1 agreement", "## Perplexity of the reference tokens", "## Density",
                    "## Recall (sparse layers)"):
            assert sec in md, sec
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert again.returncode == 0, again.stderr
        assert len(json.load(open(out))["results"]) == 8
        bad = subprocess.run(cmd[:-2] + ["--out", os.path.join(tmp, "x.json"), "--lengths", "600"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "exceed the context" in bad.stderr, bad.stderr
        # --follow-text
        fol = os.path.join(tmp, "follow.json")
        tidal = "tidal:budget=16,dense_layers=1,selection_layers=1"
        cmdf = [spade, "eval", "longgen", "--model", MODEL, "--text", text, "--methods",
                f"full;{tidal};{tidal},correction=1,correction_every=1", "--lengths", "160",
                "--samples", "2", "--prompt-tokens", "16", "--window", "40", "--follow-text",
                "--out", fol]
        p = subprocess.run(cmdf, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr
        doc = json.load(open(fol))
        assert doc["meta"]["reference"] == "text", doc["meta"]
        fr = doc["results"]
        assert len(fr) == 6, len(fr)
        greedy_ppl = {r["sample"]: r["ppl_full"] for r in recs}
        for r in fr:
            assert r["reference"] == "text" and r["key"].startswith("longgen|follow|160|"), r["key"]
            assert len(r["kl_windows"]) == 4 and r["kl_mean"] >= 0
            assert r["ppl_full"] > greedy_ppl[r["sample"]], (r["ppl_full"], greedy_ppl)
            if r["method"] == "full":
                assert r["first_divergence"] == 160 and r["kl_mean"] == 0 and r["top1_agreement"] == 1
                assert abs(r["ppl"] - r["ppl_full"]) < 1e-9 * r["ppl"]
            else:
                assert r["density"] < 1 and r["kl_mean"] > 0, r
                assert r["corrections"] == (159 if "correction=1" in r["method"] else 0), r
    print("eval longgen e2e: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

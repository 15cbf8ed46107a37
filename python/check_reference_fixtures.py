#!/usr/bin/env python3
"""Consistency check of tests/fixtures/reference/*.json and their .f32 files (numpy only).

Checks per case: the referenced files exist and have vocab_size x len(positions) floats, the
last row of the positions file equals last_logits when the last prompt position is checked,
argmax(last_logits) == greedy_ids[0], max_abs_logit matches, the model path exists (the GGUF
is only reported when absent: it is fetched by scripts/fetch_model.sh, not committed).

Usage: python3 python/check_reference_fixtures.py [REFERENCE_DIR]   (exit 1 on a problem)
"""
import glob
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ref = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures", "reference")
    problems, n = [], 0
    for jp in sorted(glob.glob(os.path.join(ref, "*.json"))):
        n += 1
        j = json.load(open(jp, encoding="utf-8"))
        case, V = j["case"], j["vocab_size"]
        last = np.fromfile(os.path.join(ref, j["last_logits"]), dtype="<f4")
        pos = np.fromfile(os.path.join(ref, j["logits_at_positions"]), dtype="<f4")
        P = len(j["positions_checked"])
        if last.size != V:
            problems.append(f"{case}: last_logits has {last.size} floats, want {V}")
            continue
        if pos.size != V * P:
            problems.append(f"{case}: pos_logits has {pos.size} floats, want {V * P}")
            continue
        pos = pos.reshape(P, V)
        if j["positions_checked"][-1] == j["prompt_len"] - 1 and not np.array_equal(pos[-1], last):
            problems.append(f"{case}: last row of pos_logits != last_logits")
        if int(np.argmax(last)) != j["greedy_ids"][0]:
            problems.append(f"{case}: argmax(last_logits) {int(np.argmax(last))} != greedy_ids[0] {j['greedy_ids'][0]}")
        if abs(float(np.abs(last).max()) - j["max_abs_logit"]) > 1e-6 * max(1.0, j["max_abs_logit"]):
            problems.append(f"{case}: max_abs_logit mismatch")
        if len(j["greedy_ids"]) != j["greedy_n"] or len(j["prompt_ids"]) != j["prompt_len"]:
            problems.append(f"{case}: length fields disagree")
        if max(j["prompt_ids"] + j["greedy_ids"]) >= V:
            problems.append(f"{case}: token id out of vocab")
        mp = os.path.join(ROOT, j["model"])
        note = "" if os.path.exists(mp) else " (model file absent here)"
        if not os.path.exists(mp) and not j["model"].endswith(".gguf"):
            problems.append(f"{case}: model {j['model']} missing")
        print(f"{case}: T={j['prompt_len']} V={V} positions={j['positions_checked']} "
              f"max|logit|={j['max_abs_logit']:.3f} min greedy margin={j['greedy_min_margin']:.4g}{note}")
    for p in problems:
        print("PROBLEM:", p)
    print(f"{n} cases, {len(problems)} problems")
    return 1 if problems or n == 0 else 0


if __name__ == "__main__":
    sys.exit(main())

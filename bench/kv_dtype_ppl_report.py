#!/usr/bin/env python3
"""Perplexity (or RULER-style task scores) of one model with two KV cache types, per method:
merges the two `spade eval ppl` (or `spade eval tasks`) result files into one results file and
prints the markdown table docs/results.md keeps.

    python3 bench/kv_dtype_ppl_report.py --ref bf16.json --test fp8.json --out merged.json \
        --what "SmolLM2 ... issue 40 quality bar"

Perplexity per (method, length) is exp(mean nll) over the samples of that length; "all" is
exp(mean nll) over every sample. The ratio column is test / ref - 1 over "all".
Tasks: per method, the mean exact-match score of each type over the samples both files hold,
how many samples' scores differ, and the net change counted in samples (one sample's noise is
1 of them).
"""
import argparse
import collections
import json
import math
import sys


def load(path):
    with open(path) as f:
        d = json.load(f)
    if not isinstance(d.get("results"), list):
        sys.exit("%s: not a `spade eval ppl` results file" % path)
    return d


def table(d):
    per = collections.OrderedDict()
    for r in d["results"]:
        m = r["method"]
        per.setdefault(m, collections.defaultdict(list))
        per[m][r["length"]].append(r["nll_mean"])
        per[m]["all"].append(r["nll_mean"])
    return {m: {k: math.exp(sum(v) / len(v)) for k, v in by.items()} for m, by in per.items()}


def tasks_table(ref, test, rt, tt):
    a = {r["key"]: r for r in ref["results"]}
    b = {r["key"]: r for r in test["results"]}
    per = collections.OrderedDict()
    for k, r in a.items():
        if k not in b:
            continue
        p = per.setdefault(r["method"], [0, 0.0, 0.0, 0, 0.0])
        p[0] += 1
        p[1] += r["score"]
        p[2] += b[k]["score"]
        p[3] += r["score"] != b[k]["score"]
        p[4] += b[k]["score"] - r["score"]
    print("| method | samples | %s mean score | %s mean score | samples whose score differs | net change (samples) |" % (rt, tt))
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for m, p in per.items():
        print("| %s | %d | %.3f | %.3f | %d | %+.2f |" % (m, p[0], p[1] / p[0], p[2] / p[0], p[3], p[4]))
        rows.append({"method": m, "samples": p[0], rt: p[1] / p[0], tt: p[2] / p[0],
                     "differ": p[3], "net_samples": p[4]})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, help="eval ppl JSON of the reference KV type")
    ap.add_argument("--test", required=True, help="eval ppl JSON of the KV type measured")
    ap.add_argument("--out", help="merged results file to write")
    ap.add_argument("--what", default="", help="one line: what the file measures")
    a = ap.parse_args()
    ref, test = load(a.ref), load(a.test)
    rt, tt = ref["meta"].get("kv_dtype", "ref"), test["meta"].get("kv_dtype", "test")
    if ref.get("kind") == "tasks":
        rows = tasks_table(ref, test, rt, tt)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"what": a.what, "summary": rows, "runs": {rt: ref, tt: test}}, f, indent=1)
                f.write("\n")
        return
    R, T = table(ref), table(test)
    lengths = sorted({r["length"] for r in ref["results"]})
    cols = " / ".join(str(x) for x in lengths) + " / all"
    print("| method | %s (%s) | %s | %s vs %s |" % (rt, cols, tt, tt, rt))
    print("| --- | --- | --- | --- |")
    rows = []
    for m in R:
        if m not in T:
            continue
        fmt = lambda t: " / ".join("%.2f" % t[m][k] for k in lengths + ["all"])
        ratio = T[m]["all"] / R[m]["all"] - 1
        rows.append({"method": m, rt: R[m]["all"], tt: T[m]["all"], "ratio": ratio})
        print("| %s | %s | %s | %+.2f%% |" % (m, fmt(R), fmt(T), 100 * ratio))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"what": a.what, "summary": rows, "runs": {rt: ref, tt: test}}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Merges the files of `bench/run_gpu_serve.sh` runs (one folder each: results.tar.gz unpacked
or not, summary.txt) into one results JSON with the ratios the serving bars are about.

  python3 bench/serve_results.py OUT.json --run DIR [--run DIR ...] [--note TEXT]

Every input keeps its own fields (commit, date, command); "bars" holds the derived ratios,
each with the two numbers it divides, so a reader can check them against the inputs:
  served_vs_engine_cN  served tok/s at N clients / (N / the engine's median step at batch N)
  vs_llama_cN          served tok/s / llama-server's tok/s under the same load
  c1_tpot_vs_generate  served TPOT p50 at one client / `spade generate` median decode step
  mixed_vs_full        the nine-method load's tok/s / the all-full load's tok/s
  mixed_vs_full_short / _long  the same from the methods phase (short / ~3.5K-token prompts)
"""
import argparse
import datetime
import glob
import json
import os
import re
import sys
import tarfile


def load_dir(d):
    """Every JSON / text file of a run folder (results.tar.gz members included), by name."""
    files = {}
    for tgz in glob.glob(os.path.join(d, "*.tar.gz")):
        with tarfile.open(tgz) as t:
            for m in t.getmembers():
                if m.isfile():
                    files[os.path.basename(m.name)] = t.extractfile(m).read().decode("utf-8", "replace")
    for p in glob.glob(os.path.join(d, "*")):
        if os.path.isfile(p) and not p.endswith(".tar.gz"):
            with open(p, encoding="utf-8", errors="replace") as f:
                files[os.path.basename(p)] = f.read()
    return files


def parse_metrics(text):
    """metrics_by_load.txt: '## label' blocks of 'name value' lines -> {label: {name: value}}."""
    out, cur = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            cur = out.setdefault(line[3:].strip(), {})
        elif cur is not None and line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                cur[k] = float(v)
            except ValueError:
                pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--run", action="append", required=True, help="a folder of one run_gpu_serve.sh call")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    res = {"what": "spade serve --device cuda vs llama-server (same GPU, GGUF, client) and the engine's own step",
           "note": a.note, "date": datetime.date.today().isoformat(), "serve": {}, "llama_server": {},
           "engine_steps": [], "metrics_by_load": {}, "inputs": []}
    for d in a.run:
        files = load_dir(d)
        res["inputs"].append({"dir": os.path.basename(os.path.normpath(d)), "files": sorted(files)})
        for name, text in files.items():
            if name.startswith("serve_") and name.endswith(".json"):
                j = json.loads(text)
                key = name[len("serve_"):-len(".json")]
                (res["llama_server"] if key.startswith("llama") else res["serve"])[key] = j
            elif name.startswith("engine_steps") and name.endswith(".json"):
                j = json.loads(text)
                j["file"] = name
                res["engine_steps"].append(j)
            elif name == "mixed_check.json":
                res["mixed_check"] = json.loads(text)
            elif name == "metrics_by_load.txt":
                res["metrics_by_load"].update(parse_metrics(text))
            elif name == "generate_stats.txt":
                res["generate_stats"] = text.strip().splitlines()
            elif name == "gpu_tests.log" or name == "gpu_tests_all.log":
                res.setdefault("gpu_tests", {})[name] = [l for l in text.splitlines()
                                                         if re.match(r"^\[  (PASSED|FAILED|SKIPPED) ", l)
                                                         or "tests ran" in l]
    bars = {}

    def step_ms(ctx, batch, method="full"):
        for f in res["engine_steps"]:
            for r in f.get("results", []):
                if r.get("method") == method and r.get("context") == ctx and r.get("batch") == batch:
                    return r["median_step_ms"], f.get("commit")
        return None, None

    def tput(d, key):
        return (d.get(key) or {}).get("output_token_throughput")

    for n in (64, 256):
        s = tput(res["serve"], "spade_c%d" % n)
        ms, commit = step_ms(320, n)
        if s and ms:
            eng = n / (ms / 1e3)
            bars["served_vs_engine_c%d" % n] = {"served_tok_s": s, "engine_tok_s": eng, "engine_step_ms": ms,
                                                "ratio": s / eng, "bar": 0.7}
        ll = tput(res["llama_server"], "llama_c%d" % n)
        if s and ll:
            bars["vs_llama_c%d" % n] = {"spade_tok_s": s, "llama_tok_s": ll, "ratio": s / ll, "bar": 3.0}
    s, ll = tput(res["serve"], "spade_c64_long"), tput(res["llama_server"], "llama_c64_long")
    if s and ll:
        bars["vs_llama_c64_long"] = {"spade_tok_s": s, "llama_tok_s": ll, "ratio": s / ll, "bar": 2.0}
    c1 = (res["serve"].get("spade_c1") or {}).get("tpot_ms") or {}
    gen = None
    for line in res.get("generate_stats", []):
        m = re.search(r"decode steps: \d+, median ([0-9.]+) ms", line)
        if m:
            gen = float(m.group(1))
    if c1.get("p50") and gen:
        bars["c1_tpot_vs_generate"] = {"served_tpot_p50_ms": c1["p50"], "generate_median_step_ms": gen,
                                       "ratio": c1["p50"] / gen, "bar": 1.15}
    mix, full = tput(res["serve"], "spade_c63_mixed"), tput(res["serve"], "spade_c63_full")
    if mix and full:
        bars["mixed_vs_full"] = {"mixed_tok_s": mix, "full_tok_s": full, "ratio": mix / full, "bar": 0.8}
    # The methods phase: the mixed load and the all-full one on the same server, short and long
    # prompts.
    for key, m, f in (("mixed_vs_full_short", "mixed_short", "alone_full"),
                      ("mixed_vs_full_long", "long_mixed", "long_full")):
        mix, full = tput(res["serve"], m), tput(res["serve"], f)
        if mix and full:
            bars[key] = {"mixed_tok_s": mix, "full_tok_s": full, "ratio": mix / full, "bar": 0.8}
    if "mixed_check" in res:
        mc = res["mixed_check"]
        bars["mixed_deterministic_equal"] = {"equal": mc.get("equal"), "requests": mc.get("requests"),
                                             "bar": "all"}
    res["bars"] = bars
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for k, v in bars.items():
        print("%-28s %s" % (k, {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()}))


if __name__ == "__main__":
    sys.exit(main())

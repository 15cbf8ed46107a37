#!/usr/bin/env python3
"""Turns the log of bench/run_gpu_tpot_methods.sh into bench/results JSON.

Usage: python3 bench/tpot_methods_json.py LOG OUT.json --commit C [--note TEXT]
Each run's ms/token comes from its `[spade] synthetic ... | generated N tokens, X ms/token`
line; the speed-up of every method is against `full` at the same length in the same log.
"""
import argparse
import datetime
import json
import re

ap = argparse.ArgumentParser()
ap.add_argument("log")
ap.add_argument("out")
ap.add_argument("--commit", required=True)
ap.add_argument("--note", default="")
args = ap.parse_args()

runs, cur, device = [], None, None
for line in open(args.log):
    m = re.match(r"### method=(\S+) L=(\d+) budget=(\d+)", line)
    if m:
        cur = {"method": m.group(1), "L": int(m.group(2)),
               "budget": None if m.group(1) == "full" else int(m.group(3))}
        runs.append(cur)
        continue
    if cur is None:
        continue
    if line.startswith("### command: "):
        cur["command"] = line[len("### command: "):].strip()
    elif line.startswith("### rc="):
        cur["rc"] = int(line.strip().split("=")[1])
    elif "[spade] attention (GPU):" in line:
        cur["attention"] = line.split("(GPU):", 1)[1].strip()
    elif "[spade] decode steps:" in line:
        m = re.search(r"decode steps: (\d+), median ([\d.]+) ms,(?: mean ([\d.]+) ms,)? first ([\d.]+) ms, "
                      r"max ([\d.]+) ms, sum of the steps over 2x the median ([\d.]+) ms", line)
        if m:
            cur["steps"] = int(m.group(1))
            cur["median_step_ms"] = float(m.group(2))
            if m.group(3):
                cur["mean_step_ms"] = float(m.group(3))
            cur["first_step_ms"] = float(m.group(4))
            cur["max_step_ms"] = float(m.group(5))
            cur["slow_steps_ms"] = float(m.group(6))
    else:
        m = re.search(r"synthetic \S+ on (.*?) \| prompt (\d+) tokens, ([\d.]+) tok/s \| generated (\d+) "
                      r"tokens, ([\d.]+) ms/token", line)
        if m:
            device = m.group(1)
            cur["prefill_tok_s"] = float(m.group(3))
            cur["generated"] = int(m.group(4))
            cur["ms_per_token"] = float(m.group(5))
full = {r["L"]: r["ms_per_token"] for r in runs if r["method"] == "full" and "ms_per_token" in r}
full_med = {r["L"]: r["median_step_ms"] for r in runs if r["method"] == "full" and "median_step_ms" in r}
for r in runs:
    if "ms_per_token" in r and r["L"] in full:
        r["speedup_vs_full"] = round(full[r["L"]] / r["ms_per_token"], 3)
    if "median_step_ms" in r and r["L"] in full_med:
        r["median_speedup_vs_full"] = round(full_med[r["L"]] / r["median_step_ms"], 3)
out = {
    "device": device,
    "date": datetime.date.today().isoformat(),
    "commit": args.commit,
    "command": "SPADE=.prebuilt-b/spade [METHODS=...] [N=...] bash bench/run_gpu_tpot_methods.sh LENGTHS BUDGET",
    "what": "end-to-end decode time per token (ms: host wall time of the decode loop over the "
            "generated tokens after the first, graph captures and LycheeCluster's index build at the "
            "first decode step included; median_step_ms: the median decode step, the steady state) of `spade generate --device cuda --synthetic llama3-8b` (random weights, "
            "Llama-3.1-8B shapes), batch 1, random prompt of L tokens, N generated tokens "
            "(`generated`); "
            "baseline: full attention in the same run",
    "note": args.note,
    "results": runs,
}
json.dump(out, open(args.out, "w"), indent=1)
print(json.dumps([{k: r.get(k) for k in ("method", "L", "ms_per_token", "speedup_vs_full")} for r in runs]))

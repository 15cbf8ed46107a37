#!/usr/bin/env python3
"""Merges bench_sparse's JSON lines with SDPA's decode lines of the same run into one results
file (bench/results format: device, date, commit, command, rows) and prints a table.
Per row: speed-up over our full attention (method "full", same L and B) and over the best
SDPA backend (full attention on contiguous caches, same L and B), time over the byte floor.
Usage: sparse_report.py sparse.jsonl sdpa.jsonl dest.json device commit command"""
import datetime
import json
import sys


def load(path):
    out = []
    try:
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def main():
    sp_path, sdpa_path, dest, device, commit, command = sys.argv[1:7]
    ours, theirs = load(sp_path), load(sdpa_path)
    hbm = next((r for r in ours if r.get("kind") == "hbm"), None)
    rows = [r for r in ours if r.get("kind") == "sparse"]
    full = {(r["L"], r["B"]): r["us"] for r in rows if r["method"] == "full"}
    for r in rows:
        key = (r["L"], r["B"])
        if key in full and r["method"] != "full":
            r["speedup_vs_full"] = round(full[key] / r["us"], 3)
        c = [s for s in theirs if s.get("kind") == "decode" and (s["L"], s["B"]) == key]
        if c:
            best = min(c, key=lambda s: s["us"])
            r["sdpa_best_backend"] = best["backend"]
            r["sdpa_best_us"] = best["us"]
            r["speedup_vs_sdpa_best"] = round(best["us"] / r["us"], 3)
    res = dict(device=device, date=datetime.date.today().isoformat(), commit=commit,
               command=command, hbm_copy=hbm, rows=rows)
    with open(dest, "w") as f:
        json.dump(res, f, indent=1)
    print(f"HBM copy (read+write): {hbm['GBps'] if hbm else '?'} GB/s")
    print("| method | L | B | budget | us | GB/s | x floor | vs full | vs SDPA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['L'] // 1024}K | {r['B']} | {r['budget']} | {r['us']:.1f} | "
              f"{r['GBps']:.0f} | {r['x_floor']:.2f} | {r.get('speedup_vs_full', '-')} | "
              f"{r.get('speedup_vs_sdpa_best', '-')} |")


if __name__ == "__main__":
    main()

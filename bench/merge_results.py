#!/usr/bin/env python3
"""Merges spade's and SDPA's attention JSON lines into one results file with the
comparison (ours vs the best SDPA backend and vs SDPA's default) and prints a table."""
import json, sys, datetime, subprocess


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
    spade_path, sdpa_path, dest, device, commit, command = sys.argv[1:7]
    ours, theirs = load(spade_path), load(sdpa_path)
    rows = []
    for r in ours:
        key = (r["kind"], r["L"], r["B"])
        cands = [s for s in theirs if (s["kind"], s["L"], s["B"]) == key]
        row = dict(r)
        if r["kind"] == "decode":
            if cands:
                best = min(cands, key=lambda s: s["us"])
                dflt = next((s for s in cands if s["backend"] == "default"), None)
                row["sdpa_best_backend"] = best["backend"]
                row["sdpa_best_us"] = best["us"]
                row["sdpa_best_GBps"] = best["GBps"]
                row["speedup_vs_sdpa_best"] = round(best["us"] / r["us"], 3)
                if dflt:
                    row["sdpa_default_us"] = dflt["us"]
                    row["speedup_vs_sdpa_default"] = round(dflt["us"] / r["us"], 3)
        else:
            if cands:
                best = max(cands, key=lambda s: s["TFLOPs"])
                row["sdpa_best_backend"] = best["backend"]
                row["sdpa_best_TFLOPs"] = best["TFLOPs"]
                row["ratio_vs_sdpa_best"] = round(r["TFLOPs"] / best["TFLOPs"], 3)
        rows.append(row)
    doc = dict(device=device, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), commit=commit,
               command=command, results=rows, sdpa_raw=theirs)
    json.dump(doc, open(dest, "w"), indent=1)
    print(f"device: {device}  commit: {commit}")
    print(f"{'kind':8}{'kernel':>10}{'L':>8}{'B':>4}{'spade':>12}{'GB/s|TF':>10}{'sdpa best':>12}{'GB/s|TF':>10}{'backend':>11}{'ratio':>8}")
    for r in rows:
        kern = r.get("kernel", "-") + ("/fp8" if r.get("kv") == "fp8" else "")  # fp8 KV cache rows
        if r["kind"] == "decode":
            print(f"{'decode':8}{kern:>10}{r['L']:>8}{r['B']:>4}{r['us']:>10.1f}us{r['GBps']:>10.0f}"
                  f"{r.get('sdpa_best_us', float('nan')):>10.1f}us{r.get('sdpa_best_GBps', float('nan')):>10.0f}"
                  f"{r.get('sdpa_best_backend', '-'):>11}{r.get('speedup_vs_sdpa_best', float('nan')):>8.2f}")
        else:
            print(f"{'prefill':8}{kern:>10}{r['L']:>8}{r['B']:>4}{r['ms']:>10.2f}ms{r['TFLOPs']:>10.0f}"
                  f"{'':>12}{r.get('sdpa_best_TFLOPs', float('nan')):>10.0f}"
                  f"{r.get('sdpa_best_backend', '-'):>11}{r.get('ratio_vs_sdpa_best', float('nan')):>8.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Merges bench_blasst's JSON lines with SDPA's (same shapes, same run) into one results file
(device, date, commit, command) and prints the table: per point sparsity, time, speed-up over
our dense kernel and over the best SDPA backend, and the byte-floor speed-up."""
import datetime, json, sys


def load(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []


def main():
    ours_path, sdpa_path, dest, device, commit, command = sys.argv[1:7]
    ours, sdpa = load(ours_path), load(sdpa_path)
    rows = []
    for r in ours:
        row = dict(r)
        c = [s for s in sdpa if (s["L"], s["B"], s["Hq"], s["Hkv"]) == (r["L"], r["B"], r["Hq"], r["Hkv"])]
        if c:
            best = min(c, key=lambda s: s["us"])
            row.update(sdpa_best_backend=best["backend"], sdpa_best_us=best["us"],
                       speedup_vs_sdpa_best=round(best["us"] / r["us"], 3))
        rows.append(row)
        print("L=%-6d B=%-3d Hkv=%d %-8s splits=%-2d lambda=%-6g sparsity=%.3f  %8.1f us  dense %8.1f us"
              "  x%.3f (floor x%.3f)  SDPA %s" % (r["L"], r["B"], r["Hkv"], r["kernel"], r["splits"],
              r["lambda"], r["sparsity"], r["us"], r["dense_us"], r["speedup"], r["byte_floor_speedup"],
              ("%.1f us (%s) x%.3f" % (row["sdpa_best_us"], row["sdpa_best_backend"], row["speedup_vs_sdpa_best"]))
              if c else "-"))
    json.dump(dict(device=device, date=datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"),
                   commit=commit, command=command, results=rows, sdpa=sdpa), open(dest, "w"), indent=1)


if __name__ == "__main__":
    main()

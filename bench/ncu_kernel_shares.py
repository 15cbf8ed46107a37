#!/usr/bin/env python3
"""Kernel time by kernel name from an `ncu --csv --metrics gpu__time_duration.sum` run.

    python3 bench/ncu_kernel_shares.py raw.csv [--label TEXT] [--top 25]

Prints, per kernel name (template arguments and parameters dropped), the launches, the summed
duration in microseconds and its share of all profiled kernel time, largest first. ncu times
each kernel alone (serialized, no overlap, no launch gaps), so the shares place the device work
of a step, not its latency.
"""
import argparse
import csv
import io
import re
import sys
from collections import defaultdict

UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
           "second": 1e6, "s": 1e6}


def base_name(name):
    name = re.sub(r"\(.*$", "", name)  # parameters
    depth, out = 0, []
    for ch in name:  # template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out).strip()
    return name.split("::")[-1] or "?"


def read_rows(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"ID"')  # ncu prints its own log lines before the table
    if start < 0:
        return []
    return list(csv.DictReader(io.StringIO(text[start:])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--label", default="")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    rows = read_rows(a.csv)
    tot = defaultdict(float)
    cnt = defaultdict(int)
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            v = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        unit = UNIT_US.get(r.get("Metric Unit", "").strip())
        if unit is None:
            print(f"unknown unit {r.get('Metric Unit')!r}", file=sys.stderr)
            return 1
        k = base_name(r.get("Kernel Name", "?"))
        tot[k] += v * unit
        cnt[k] += 1
    all_us = sum(tot.values())
    print(f"## {a.label}: {sum(cnt.values())} kernels, {all_us:.1f} us")
    if not all_us:
        return 0
    for k, us in sorted(tot.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{cnt[k]:6d} {us:10.1f} us {100 * us / all_us:5.1f}%  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

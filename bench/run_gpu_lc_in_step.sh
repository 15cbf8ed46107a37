#!/usr/bin/env bash
# LycheeCluster's search cost inside the real decode step (64K context, batch 1, synthetic
# Llama-3.1-8B): the plain run's median decode step, then the same run under Nsight Compute for
# the per-launch durations of the search / compaction / lazy-update kernels -> OUT.json.
#   here:   strip -o .prebuilt-s/spade .prebuilt/spade   (PREBUILD_CLI=1 bash bench/gpu_deps/prebuild.sh)
#   device: bash bench/run_gpu_lc_in_step.sh OUT.json     (carry .prebuilt-s, .deps-cuda)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT.json}
SPADE=${SPADE:-.prebuilt-s/spade}
NVCC=$(command -v nvcc); CH=$(dirname $(dirname $NVCC)); CL=$CH/lib64
[ -d $CH/targets/x86_64-linux/lib ] && CL=$CH/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CL:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
CTX=${CTX:-65536}; STEPS=${STEPS:-40}
ARGS="generate --device cuda --synthetic llama3-8b --prompt-len $CTX -n $STEPS --ignore-eos --stats --sparse lycheecluster --budget 1024"
T=$(mktemp -d)
timeout 300 $SPADE $ARGS > $T/plain.out 2> $T/plain.err || { tail -5 $T/plain.err; exit 1; }
timeout 500 ncu --kernel-name regex:"lc_search|lc_compact|lc_insert" --metrics gpu__time_duration.sum \
  --cache-control none --clock-control none --csv --log-file $T/ncu.csv $SPADE $ARGS > $T/ncu.out 2> $T/ncu.err \
  || { tail -5 $T/ncu.err; exit 1; }
[ -n "${KEEP:-}" ] && cp $T/* "$KEEP"/
python3 - "$T" "$OUT" "$CTX" "$STEPS" "spade $ARGS" "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" <<'PY'
import csv, json, re, statistics, subprocess, sys
t, out, ctx, steps, cmd, commit = sys.argv[1:7]
err = open(f"{t}/plain.err").read()
m = re.search(r"decode steps: \d+, median ([0-9.]+) ms", err)
step = float(m.group(1))
rows = [r for r in csv.reader(l for l in open(f"{t}/ncu.csv") if not l.startswith("=="))]
h = rows[0]
k = {}
for r in rows[1:]:
    d = dict(zip(h, r))
    if d.get("Metric Name") != "gpu__time_duration.sum": continue
    name = re.sub(r"\(.*", "", d["Kernel Name"]).split("::")[-1].strip()
    unit = d.get("Metric Unit", "ns")
    v = float(d["Metric Value"].replace(",", ""))
    us = v / 1000 if unit == "ns" else v if unit == "us" else v * 1000
    k.setdefault(name, []).append(us)
dev = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
res = {"device": dev, "commit": commit, "command": cmd + " (plain for the step time; again under ncu --kernel-name regex:\"lc_search|lc_compact|lc_insert\" --metrics gpu__time_duration.sum --cache-control none --clock-control none)",
       "decode_step_median_ms": step, "steps": int(steps), "context": int(ctx), "kernels": {}}
per_step = 0.0
for name, v in k.items():
    tot = sum(v) / 1000 / int(steps)
    res["kernels"][name] = {"launches": len(v), "median_us": round(statistics.median(v), 2), "per_step_ms": round(tot, 4)}
    per_step += tot
res["lc_kernels_per_step_ms"] = round(per_step, 4)
res["fraction_of_step"] = round(per_step / step, 4)
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res, indent=1))
PY

#!/usr/bin/env bash
# LycheeCluster's search cost inside the real decode step (64K context, batch 1, synthetic
# Llama-3.1-8B): the plain run's median decode step, then the same run under Nsight Compute for
# the per-launch durations of the search / compaction kernels, then a longer run (UPD_STEPS,
# default 200: at least one lazy-update flush per layer) under Nsight Compute for the lazy-update
# kernel alone: search + update per step = search per step + flush / 128 tokens -> OUT.json.
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
UPD_STEPS=${UPD_STEPS:-200}
UARGS="generate --device cuda --synthetic llama3-8b --prompt-len $CTX -n $UPD_STEPS --ignore-eos --stats --sparse lycheecluster --budget 1024"
timeout 300 $SPADE $UARGS > $T/uplain.out 2> $T/uplain.err || { tail -5 $T/uplain.err; exit 1; }
timeout 500 ncu --kernel-name regex:"lc_insert" --metrics gpu__time_duration.sum \
  --cache-control none --clock-control none --csv --log-file $T/ncu_upd.csv $SPADE $UARGS > $T/ncu_upd.out 2> $T/ncu_upd.err \
  || { tail -5 $T/ncu_upd.err; exit 1; }
[ -n "${KEEP:-}" ] && cp $T/* "$KEEP"/
python3 - "$T" "$OUT" "$CTX" "$STEPS" "spade $ARGS" "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" "$UPD_STEPS" <<'PY'
import csv, json, re, statistics, subprocess, sys
t, out, ctx, steps, cmd, commit, upd_steps = sys.argv[1:8]
def step_times(path):
    m = re.search(r"decode steps: \d+, median ([0-9.]+) ms, mean ([0-9.]+) ms", open(path).read())
    return float(m.group(1)), float(m.group(2))
step, step_mean = step_times(f"{t}/plain.err")
ustep, ustep_mean = step_times(f"{t}/uplain.err")
def kernels(path):
    rows = [r for r in csv.reader(l for l in open(path) if not l.startswith("=="))]
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
    return k
k = kernels(f"{t}/ncu.csv")
ku = kernels(f"{t}/ncu_upd.csv").get("lc_insert_kernel", [])
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
# Lazy update: one flush = one lc_insert launch per sparse layer (<= 32 chunks per request);
# the layer count is the search's launches per step. A flush every 128 decode tokens.
layers = len(k.get("lc_search_kernel", [])) // int(steps)
flushes = len(ku) / layers if layers else 0
flush_ms = sum(ku) / 1000 / flushes if flushes else 0.0
res["update"] = {"steps": int(upd_steps), "command": cmd.replace(f"-n {steps} ", f"-n {upd_steps} ") + " (under ncu --kernel-name regex:lc_insert)",
                 "insert_launches": len(ku), "insert_median_us": round(statistics.median(ku), 2) if ku else None,
                 "flushes": flushes, "flush_ms_all_layers": round(flush_ms, 4),
                 "per_step_ms_amortized": round(flush_ms / 128, 4),
                 "plain_run_step_median_ms": ustep, "plain_run_step_mean_ms": ustep_mean}
res["decode_step_mean_ms"] = step_mean
res["search_plus_update_per_step_ms"] = round(per_step + flush_ms / 128, 4)
res["search_plus_update_fraction_of_step"] = round((per_step + flush_ms / 128) / step, 4)
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res, indent=1))
PY

#!/usr/bin/env bash
# Decode attention with drawn chunks (the DYN variants, attention_decode.cu) against the static
# schedule, on the device. SPADE_DETERMINISTIC=1 makes auto pick the static kernels (the
# schedule before DYN); 0 lets it pick DYN. Each A/B runs interleaved in two orders.
#   here:   $PRE (default .prebuilt-dyn) holds gzipped spade_gpu_tests, bench_attention and
#           bench_tpot (bench/run_gpu_blasst_prefill.sh prebuild for the tests; nvcc / g++ as
#           in bench/run_gpu.sh for the benches)
#   device: run(command="MODE=... COMMIT=<sha> bash bench/run_gpu_decode_dyn_ab.sh",
#               carry=[".prebuilt-dyn", ".deps-cuda"])
# MODE=variants: bench_attention decode over kernels $KERNELS (default 1,2,4,3,5: auto,
#   v3_w4s3, v3d_w4s3, v3_w8s3, v3d_w8s3; before the v4 variants left src/: 1,2,6,3,7) twice in
#   opposite orders (decode_r{1,2}.jsonl); MODE=auto: auto with SPADE_DETERMINISTIC=1 / 0, pages
#   shuffled (twice) and in id order (once) (decode_{det,dyn}_*.jsonl); both then PyTorch SDPA
#   once (sdpa.jsonl) and a table. MODE=tests: the whole gpu suite but SmolLM2's tests
#   (gpu_tests_decode_dyn.log). MODE=steal: forced split counts beyond one wave with DYN
#   (decode_fs*_r*.jsonl) against static auto; MODE=sweep: DYN split counts per shape
#   (decode_sweep_r*.jsonl). MODE=tpot: bench_tpot (synthetic Llama-3.1-8B, batch 1, 32K and
#   128K) with SPADE_DETERMINISTIC=1, 0, 1, 0 (tpot_{det,dyn}_r{1,2}.json). MODE=blasst:
#   bench_blasst paper (blasst_decode.jsonl). MODE=tpot_batch: bench_tpot_batch, full attention,
#   $LENGTHS (default 32768:8,130900:1), SPADE_DETERMINISTIC=1, 0, 1, 0 (tpotb_*.json). (MODE=sparse, drawn chunks in SparseAttention:
#   the script and the kernel at commit a1ed911; measured slower and reverted.)
set -uo pipefail
OUT=${OUT:-/tmp/out}
PRE=${PRE:-.prebuilt-dyn}
mkdir -p "$OUT" /tmp/pre
for f in $PRE/*.gz; do gunzip -c "$f" > /tmp/pre/$(basename "$f" .gz); chmod +x /tmp/pre/$(basename "$f" .gz); done
NVCC=$(command -v nvcc); CH=$(dirname $(dirname $NVCC)); CL=$CH/lib64
[ -d $CH/targets/x86_64-linux/lib ] && CL=$CH/targets/x86_64-linux/lib
export LD_LIBRARY_PATH=$CL:$(pwd)/.deps-cuda/lib:${LD_LIBRARY_PATH:-}
mkdir -p /work && ln -sfn "$(pwd)" /work/main 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
BA=/tmp/pre/bench_attention
for mode in ${MODE:-variants}; do case $mode in
tests)
  timeout 400 /tmp/pre/spade_gpu_tests --gtest_filter="${FILTER:--CudaSmolLM2Methods.*:CudaModel.SmolLM2*}" \
    > "$OUT/gpu_tests_decode_dyn.log" 2>&1
  echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]" "$OUT/gpu_tests_decode_dyn.log" | tail -12
  ;;
blasst)
  # BLASST decode sweep (paper shape) with the static schedule planned for it, and our default
  # dense decode (DYN where auto picks it) in each line as dense_default_us.
  timeout 200 /tmp/pre/bench_blasst paper "$OUT/blasst_decode.jsonl" 2>&1 | tail -1
  python3 -c "
import json
for l in open('$OUT/blasst_decode.jsonl'):
    r = json.loads(l)
    print(r['L'], r['kernel'], r['splits'], r['lambda'], 'sparsity %.3f' % r['sparsity'], 'us %.1f' % r['us'],
          'dense %.1f' % r['dense_us'], 'x %.3f' % r['speedup'], '| default', r['dense_default_kernel'],
          '%.1f' % r['dense_default_us'], 'x %.3f' % r['speedup_vs_default'])"
  ;;
tpot_batch)
  # Decode steps of synthetic Llama-3.1-8B with full attention through bench_tpot_batch at
  # $LENGTHS (default 32K batch 8, 128K batch 1), SPADE_DETERMINISTIC=1, 0, 1, 0.
  for r in 1 2; do for d in 1 0; do
    n=$([ $d = 1 ] && echo det || echo dyn)
    SPADE_DETERMINISTIC=$d timeout 200 /tmp/pre/bench_tpot_batch "$OUT/tpotb_${n}_r$r.json" --model llama3-8b \
      --lengths "${LENGTHS:-32768:8,130900:1}" --methods full --commit "${COMMIT:-unknown}" > /dev/null 2>&1
    echo "tpot_batch $n r$r rc=$? $(python3 -c "
import json; d = json.load(open('$OUT/tpotb_${n}_r$r.json'))
rs = d['results'] if isinstance(d, dict) and 'results' in d else d
print(' '.join('%s:%s %.3f ms (floor %.3f)' % (r['context'], r['batch'], r['median_step_ms'], r['dense_floor_ms']) for r in rs))" 2>&1 | tail -1)"
  done; done
  ;;
tpot)
  for r in 1 2; do for d in 1 0; do
    n=$([ $d = 1 ] && echo det || echo dyn)
    SPADE_DETERMINISTIC=$d timeout 150 /tmp/pre/bench_tpot "$OUT/tpot_${n}_r$r.json" > "$OUT/tpot_${n}_r$r.log" 2>&1
    echo "tpot $n r$r rc=$? $(grep -o '"L":[0-9]*[^}]*"tpot_ms":[0-9.]*' "$OUT/tpot_${n}_r$r.json" | sed 's/,"[a-z_]*":[^,]*//g' | tr '\n' ' ')"
  done; done
  ;;
steal)
  # Splits beyond one wave with drawn chunks: the second wave's CTAs take over the first's
  # tails. Static auto (SPADE_DETERMINISTIC=1) vs forced split counts, twice.
  for r in 1 2; do
    SPADE_BENCH_SHAPES=8192:32,32768:32,131072:32,32768:8,131072:8,131072:1 SPADE_DETERMINISTIC=1 \
      timeout 100 $BA decode "$OUT/decode_det_r$r.jsonl" 1 2>&1 | tail -1
    for fs in 1 2; do
      SPADE_BENCH_SHAPES=8192:32,32768:32,131072:32 SPADE_BENCH_FORCE_SPLIT=$fs \
        timeout 100 $BA decode "$OUT/decode_fs${fs}_r$r.jsonl" 6,2 2>&1 | tail -1
    done
    SPADE_BENCH_SHAPES=32768:8,131072:8 SPADE_BENCH_FORCE_SPLIT=8 \
      timeout 100 $BA decode "$OUT/decode_fs8_r$r.jsonl" 6 2>&1 | tail -1
    SPADE_BENCH_SHAPES=131072:1 SPADE_BENCH_FORCE_SPLIT=32 \
      timeout 100 $BA decode "$OUT/decode_fs32_r$r.jsonl" 7,6 2>&1 | tail -1
  done
  ;;&
sweep)
  # Split counts of DYN around one, two and three waves (SWEEP="L:B:kernel:splits ...").
  for r in 1 2; do
    for c in ${SWEEP:-32768:32:6:2 32768:32:6:3 32768:32:6:4 131072:32:6:2 131072:32:6:3 32768:8:6:8 32768:8:6:12 32768:8:6:16 131072:8:6:8 131072:8:6:12 131072:8:6:16 131072:1:6:64 131072:1:6:96 131072:1:7:32 131072:1:7:48}; do
      IFS=: read L B K NS <<< "$c"
      SPADE_BENCH_SHAPES=$L:$B SPADE_BENCH_FORCE_SPLIT=$NS timeout 60 $BA decode "$OUT/sw.jsonl" $K > /dev/null 2>&1
      cat "$OUT/sw.jsonl" >> "$OUT/decode_sweep_r$r.jsonl"
    done
  done
  rm -f "$OUT/sw.jsonl"
  ;;&
variants|auto|steal|sweep)
  if [ $mode = steal ] || [ $mode = sweep ]; then :
  elif [ $mode = variants ]; then
    K1=${KERNELS:-1,2,4,3,5}
    K2=$(echo "$K1" | tr ',' '\n' | tac | paste -sd,)
    timeout 200 $BA decode "$OUT/decode_r1.jsonl" "$K1" 2>&1 | tail -1
    timeout 200 $BA decode "$OUT/decode_r2.jsonl" "$K2" 2>&1 | tail -1
  else
    for r in 1 2; do for d in 1 0; do
      [ $r = 2 ] && d=$((1 - d))
      n=$([ $d = 1 ] && echo det || echo dyn)
      SPADE_DETERMINISTIC=$d timeout 120 $BA decode "$OUT/decode_${n}_r$r.jsonl" 1 2>&1 | tail -1
    done; done
    for d in 1 0; do
      n=$([ $d = 1 ] && echo det || echo dyn)
      SPADE_BENCH_PAGE_ORDER=sequential SPADE_DETERMINISTIC=$d timeout 120 $BA decode \
        "$OUT/decode_${n}_seq.jsonl" 1 2>&1 | tail -1
    done
  fi
  PYTHONUNBUFFERED=1 timeout 150 python3 python/bench_sdpa_decode.py decode --out "$OUT/sdpa.jsonl" 2>&1 | grep -v Warning | tail -1
  python3 - "$OUT" <<'PY'
import json, sys, collections, glob, os
o = sys.argv[1]
sd = collections.defaultdict(list)
for l in open(f"{o}/sdpa.jsonl"):
    if l.startswith("{"):
        r = json.loads(l); sd[(r["L"], r["B"])].append(r["us"])
t = collections.defaultdict(list)
for f in sorted(glob.glob(f"{o}/decode_*.jsonl")):
    tag = os.path.basename(f)[7:-6].split("_r")[0]
    for l in open(f):
        if l.startswith("{"):
            r = json.loads(l)
            t[(r["L"], r["B"], tag, r["kernel"], r["variant"], r["page_order"][:3], r["splits"])].append(r["us"])
for k in sorted(t):
    s = min(sd.get(k[:2], [float("nan")]))
    print(k, " ".join(f"{u:.1f}" for u in t[k]), f"sdpa {s:.1f}", f"x {s / min(t[k]):.3f}")
PY
  ;;
esac; done

#!/usr/bin/env bash
# HBM read bandwidth of the paged KV layout's access patterns (bench/bench_dram_pattern.cu), and
# ncu's view of PyTorch SDPA's decode kernels at one shape (their launch shapes and DRAM bytes).
#   here:   bash bench/run_gpu_dram_pattern.sh prebuild     -> .prebuilt-d/
#   device: bash bench/run_gpu_dram_pattern.sh OUT_DIR       (carry .prebuilt-d)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = prebuild ]; then
  mkdir -p .prebuilt-d
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc bench/bench_dram_pattern.cu \
    -o .prebuilt-d/bench_dram_pattern
  exit 0
fi
OUT=${1:?OUT_DIR}
mkdir -p "$OUT"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
timeout 300 .prebuilt-d/bench_dram_pattern "$OUT/dram_pattern.json" "$COMMIT" \
  "bash bench/run_gpu_dram_pattern.sh OUT_DIR"
M=launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic
M=$M,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,dram__bytes_read.sum
M=$M,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
for be in cudnn flash; do
  timeout 120 ncu --profile-from-start off --metrics $M --csv \
    python3 python/sdpa_decode_once.py 32768 32 $be > "$OUT/ncu_sdpa_$be.csv" 2>&1 || true
done

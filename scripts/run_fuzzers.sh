#!/usr/bin/env bash
# Runs every fuzz_* binary in BUILD_DIR for SECONDS each, starting from fuzz/corpus/<name>.
# A crash fails the run and leaves the reproducer in fuzz/artifacts/.
set -euo pipefail
build=$1
secs=${2:-20}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/fuzz/artifacts"
n=0
for bin in "$build"/fuzz_*; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  corpus="$root/fuzz/corpus/${name#fuzz_}"
  work=$(mktemp -d)
  [ -d "$corpus" ] && cp -r "$corpus"/. "$work"/ 2>/dev/null || true
  echo "fuzz: $name for ${secs}s" >&2
  "$bin" -max_total_time="$secs" -rss_limit_mb=4096 -print_final_stats=0 \
    -artifact_prefix="$root/fuzz/artifacts/${name}-" "$work" >"$work.log" 2>&1 || {
      tail -50 "$work.log" >&2
      echo "fuzz: $name FAILED" >&2
      exit 1
    }
  grep -E "^#[0-9]+.*DONE|Done [0-9]+ runs" "$work.log" | tail -1 >&2 || true
  rm -rf "$work" "$work.log"
  n=$((n + 1))
done
echo "fuzz: $n targets passed" >&2

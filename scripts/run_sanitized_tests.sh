#!/usr/bin/env bash
# The CPU test suite (`ctest -LE gpu`: the unit tests, the CLI runs and the server end-to-end
# tests in tests/e2e) against the ASan + UBSan build (`make test-sanitize`; CMake option
# SPADE_SANITIZE). Every sanitizer report of every process -- test binaries, `spade serve`
# started by the e2e tests, CLI runs -- goes to a log file under BUILD/sanitizer-logs, and
# any report fails the run, whatever the exit status of the process that wrote it (a CLI run
# expected to fail, or a server whose exit status a test does not read, would hide it).
#
#   scripts/run_sanitized_tests.sh BUILD_DIR [JOBS] [extra ctest args...]
#
# SPADE_SANITIZED=1 tells the tests they run instrumented: tests/e2e scale their time limits
# (spade_client.time_scale) and give the servers whose RSS they bound a small ASan quarantine
# (spade_client.sanitizer_env).
set -euo pipefail
build=$(cd "$1" && pwd)
jobs=${2:-$(nproc)}
shift $(( $# >= 2 ? 2 : $# ))
logs="$build/sanitizer-logs"
rm -rf "$logs"
mkdir -p "$logs"
export SPADE_SANITIZED=1
# halt_on_error + -fno-sanitize-recover: the first finding ends the process with 86.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:exitcode=86:log_path=$logs/report:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=86:log_path=$logs/report"
export LSAN_OPTIONS="exitcode=86"
# Symbolized stacks in the reports (clang's llvm-symbolizer, also when not on PATH).
if [ -z "${ASAN_SYMBOLIZER_PATH:-}" ] && ! command -v llvm-symbolizer >/dev/null; then
  for s in /usr/lib/llvm-*/bin/llvm-symbolizer; do
    [ -x "$s" ] && export ASAN_SYMBOLIZER_PATH=$s
  done
fi
t0=$(date +%s)
rc=0
(cd "$build" && ctest --output-on-failure -LE gpu -j "$jobs" "$@") || rc=$?
reports=$(find "$logs" -type f | sort)
if [ -n "$reports" ]; then
  for f in $reports; do
    echo "==== sanitizer report $f" >&2
    head -c 20000 "$f" >&2
  done
  echo "sanitize: $(echo "$reports" | wc -l) sanitizer report(s) (above); FAILED" >&2
  exit 1
fi
if [ "$rc" != 0 ]; then
  echo "sanitize: ctest failed (rc $rc) under ASan + UBSan" >&2
  exit "$rc"
fi
echo "sanitize: ctest -LE gpu clean under ASan + UBSan + LSan in $(( $(date +%s) - t0 )) s" >&2

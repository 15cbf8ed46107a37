#!/usr/bin/env bash
# Why spade._core crashes (SIGSEGV) at the first spade::Error thrown through a pybind11 binding
# when torch is loaded (H200 machine: system python3.12, PyPI torch 2.11, GCC 13.3, CUDA 13;
# never seen on the CPU CI machine). Rebuilds the extension's two binding files / its link in
# variants beside the module of build-py (bench/run_gpu_serve.sh, PY_ONLY=1) and runs, for each,
# three small programs that each should print "ok": A = spade.LLM('/nonexistent') without
# torch, B = the same after `import torch`, C = spade.ops.decode_attention with a bad kv_lens
# after `import torch` (the throw test_ops dies at). Then which library the module's unwinding
# symbols bind to (LD_DEBUG) and gdb's backtrace of the first crash.
#
#   device: run(command="PEER_BUILD=0 PY_ONLY=1 bash bench/run_gpu_serve.sh build; bash bench/py_crash_diag.sh",
#               carry=[".deps-cuda"])          (the build alone takes a few minutes, -j16)
#   here:   BUILD=/tmp/py312-build PY=/tmp/torch211/bin/python bash bench/py_crash_diag.sh
#
# Variants: base (build-py's module as built), xlibs (relinked with -Wl,--exclude-libs,ALL: the
# static libraries' symbols stay inside the module), static_rt (also -static-libstdc++
# -static-libgcc), isolated (-DPYBIND11_COMPILER_TYPE="_spade": pybind11 internals of its own),
# torch_pyb (the pybind11 headers torch ships: torch's internals shared), deps_pyb (.deps-cuda's
# pybind11 2.10), keep_gil (-DSPADE_PY_KEEP_GIL: no gil_scoped_release), sys_cxx (the binding
# files by /usr/bin/g++ when CMake's compiler is another one), mini (a 10-line pybind11 module
# that throws a registered std::runtime_error subclass: is spade's code needed at all?).
# Output: one line per variant (A B C verdicts), then the evidence; logs in $OUT/py_diag/.
set -uo pipefail
ROOT=$(pwd)
BUILD=${BUILD:-build-py}
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}
D=$OUT/py_diag
W=${DIAG_WORK:-/tmp/py_diag}
mkdir -p "$D"; [ "${DIAG_REUSE:-0}" = 1 ] || rm -rf "$W"; mkdir -p "$W"  # DIAG_REUSE=1: keep built variants
BUILD=$(cd "$BUILD" 2>/dev/null && pwd) || { echo "no $BUILD: build it first (PY_ONLY=1 bash bench/run_gpu_serve.sh build)"; exit 1; }
SO=$(ls "$BUILD"/python/spade/_core*.so 2>/dev/null | head -1)
[ -n "$SO" ] || { echo "no spade._core in $BUILD/python/spade"; exit 1; }
SONAME=$(basename "$SO")

# ---- the environment ------------------------------------------------------------------------
{
  echo "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  echo "torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.__file__)' 2>&1 | tail -1)"
  TI=$($PY -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null)
  echo "torch's pybind11: $(grep -hE 'define PYBIND11_VERSION_(MAJOR|MINOR|MICRO)' $TI/pybind11/detail/common.h 2>/dev/null | awk '{printf "%s.", $3}') internals v$(grep -hE '^#\s*define PYBIND11_INTERNALS_VERSION' $TI/pybind11/detail/internals.h 2>/dev/null | awk '{print $NF}' | tr '\n' ' ')"
  echo "pip pybind11: $($PY -m pybind11 --version 2>&1 | tail -1)"
  echo "$BUILD: pybind11_DIR=$(grep -E '^pybind11_DIR' $BUILD/CMakeCache.txt | cut -d= -f2); $(grep -E 'spade: Python package' /root/py/cmake.log 2>/dev/null | head -1)"
  echo "CXX: $(grep -E '^CMAKE_CXX_COMPILER:' $BUILD/CMakeCache.txt | cut -d= -f2) $($(grep -E '^CMAKE_CXX_COMPILER:' $BUILD/CMakeCache.txt | cut -d= -f2) -dumpfullversion 2>/dev/null)"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} LD_PRELOAD=${LD_PRELOAD:-}; glibc $(ldd --version 2>&1 | head -1 | awk '{print $NF}'); kernel $(uname -r); $(grep -h x86_Thread /proc/self/status 2>/dev/null | tr -s '\t ' ' ')"
  echo "ldd $SONAME:"; ldd "$SO" | grep -E 'stdc\+\+|gcc_s|libm\.|cuda|cublas|python|not found' | sed 's/^/  /'
  echo "ld.so.cache: $(ldconfig -p 2>/dev/null | grep -E 'libstdc\+\+\.so\.6 |libgcc_s\.so\.1 ' | tr -s ' ' | tr '\n' ';')"
  echo "loaded after import torch, spade: $(PYTHONPATH=$BUILD/python $PY -c 'import torch, spade
print(" ".join(sorted({l.split()[-1] for l in open("/proc/self/maps") if any(k in l for k in ("libstdc++", "libgcc_s", "libunwind", "libgomp"))})))' 2>&1 | tail -1)"
  echo "exported symbols of $SONAME: $(nm -D --defined-only "$SO" | wc -l) ($(nm -D --defined-only "$SO" | grep -cE ' (cblas_|sgemm|deflate|inflate|crc32|pcre2_)') from the static libraries)"
} > "$D/env.txt" 2>&1
cat "$D/env.txt"

# ---- the variants ---------------------------------------------------------------------------
CMDS=$(cd "$BUILD" && ninja -t commands spade_python)
CC_CORE=$(grep -E -- "-c [^ ]*python/spade/_core\.cpp" <<< "$CMDS" | tail -1)
CC_OPS=$(grep -E -- "-c [^ ]*python/spade/_ops\.cpp" <<< "$CMDS" | tail -1)
LINK=$(grep -E -- "-o python/spade/_core[^ ]*\.so" <<< "$CMDS" | tail -1 | sed 's/^: && //; s/ && :$//')
CXX=$(awk '{print $1}' <<< "$CC_CORE")
TORCH_INC=$($PY -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null)
mkdir -p "$W/inc_torch" "$W/inc_deps"
[ -d "$TORCH_INC/pybind11" ] && ln -sfn "$TORCH_INC/pybind11" "$W/inc_torch/pybind11"
[ -d "$ROOT/.deps-cuda/include/pybind11" ] && ln -sfn "$ROOT/.deps-cuda/include/pybind11" "$W/inc_deps/pybind11"

# variant NAME COMPILE_PREFIX_FLAGS LINK_FLAGS [CXX]: the module in $W/NAME/spade (+ the .py files)
variant() {
  local name=$1 cflags=$2 lflags=$3 cxx=${4:-$CXX} v=$W/$1 objs=""
  [ "${DIAG_REUSE:-0}" = 1 ] && [ -f "$v/spade/$SONAME" ] && return 0
  mkdir -p "$v/spade" && cp "$ROOT"/python/spade/*.py "$v/spade/"
  if [ -n "$cflags" ] || [ "$cxx" != "$CXX" ]; then
    local c
    for c in "$CC_CORE" "$CC_OPS"; do
      local src=$(grep -oE '[^ ]*python/spade/_(core|ops)\.cpp$' <<< "$c") o=$v/$(basename "${src%.cpp}").o
      # the flags go first (an -isystem first wins); CMake's output / depfile options dropped
      c=$(sed -E "s# -o [^ ]+# -o $o#; s# -MD##; s# -MT [^ ]+##; s# -MF [^ ]+##" <<< "$c")
      (cd "$BUILD" && eval "$cxx $cflags ${c#* }") || return 1
      objs="$objs $o"
    done
  fi
  local l=$LINK
  if [ -n "$objs" ]; then  # the new objects replace CMake's
    l=$(sed -E "s# [^ ]*_core\.cpp\.o# #; s# [^ ]*_ops\.cpp\.o#$objs#" <<< "$l")
    [ "$cxx" != "$CXX" ] && l="$cxx ${l#* }"
  fi
  l=$(sed -E "s# -o python/spade/[^ ]+# -o $v/spade/$SONAME#" <<< "$l")
  (cd "$BUILD" && eval "$l $lflags")
}

mkdir -p "$W/base" && cp -r "$BUILD/python/spade" "$W/base/"
cat > "$W/mini.cpp" <<'EOF'
#include <pybind11/pybind11.h>
#include <stdexcept>
namespace py = pybind11;
struct MiniError : std::runtime_error { using std::runtime_error::runtime_error; };
PYBIND11_MODULE(mini, m) {
  py::register_exception<MiniError>(m, "Error", PyExc_ValueError);
  m.def("boom", [] { throw MiniError("mini boom"); }, py::call_guard<py::gil_scoped_release>());
}
EOF
t0=$(date +%s)
PIDS=()
( variant xlibs "" "-Wl,--exclude-libs,ALL" > "$W/build_xlibs.log" 2>&1 ) & PIDS+=($!)
( variant static_rt "" "-static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL" > "$W/build_static_rt.log" 2>&1 ) & PIDS+=($!)
( variant isolated "-DPYBIND11_COMPILER_TYPE=\\\"_spade\\\"" "" > "$W/build_isolated.log" 2>&1 ) & PIDS+=($!)
[ -e "$W/inc_torch/pybind11" ] && { ( variant torch_pyb "-I$W/inc_torch" "" > "$W/build_torch_pyb.log" 2>&1 ) & PIDS+=($!); }
[ -e "$W/inc_deps/pybind11" ] && { ( variant deps_pyb "-I$W/inc_deps" "" > "$W/build_deps_pyb.log" 2>&1 ) & PIDS+=($!); }
( variant keep_gil "-DSPADE_PY_KEEP_GIL" "" > "$W/build_keep_gil.log" 2>&1 ) & PIDS+=($!)
if [ -x /usr/bin/g++ ] && [ "$(readlink -f /usr/bin/g++)" != "$(readlink -f "$(command -v "$CXX")")" ]; then
  ( variant sys_cxx "-DSPADE_SYS_CXX" "" /usr/bin/g++ > "$W/build_sys_cxx.log" 2>&1 ) & PIDS+=($!)
fi
PYINC=$(grep -oE -- "-isystem [^ ]*python3[^ ]*" <<< "$CC_CORE" | head -1)
PYBINC=$(grep -oE -- "-isystem [^ ]*" <<< "$CC_CORE" | grep -v python3 | tr '\n' ' ')
[ "${DIAG_REUSE:-0}" = 1 ] && [ -f "$W/mini/mini${SONAME#_core}" ] || ( mkdir -p "$W/mini" && $CXX -O2 -std=c++20 -fPIC -fvisibility=hidden -shared $PYINC $PYBINC \
    $($PY -m pybind11 --includes 2>/dev/null) "$W/mini.cpp" -o "$W/mini/mini${SONAME#_core}" > "$W/build_mini.log" 2>&1 ) & PIDS+=($!)
wait "${PIDS[@]}"
echo "variants built in $(( $(date +%s) - t0 )) s"
for f in "$W"/build_*.log; do grep -qE "error|Error" "$f" && { echo "$(basename "$f"):"; grep -E "error" "$f" | head -3; }; done

# ---- the programs ---------------------------------------------------------------------------
cat > "$W/t.py" <<'EOF'
import sys
which = sys.argv[1]
if which in "BC":
    import torch
import spade
if which in "AB":
    try:
        spade.LLM("/nonexistent.gguf")
    except spade.Error as e:
        print("ok", type(e).__name__, str(e)[:60])
else:
    import spade.ops as ops
    k = torch.zeros(4, 1, 4, 8); q = torch.zeros(1, 2, 8)
    ip = torch.tensor([0, 1], dtype=torch.int32); ix = torch.tensor([0], dtype=torch.int32)
    try:
        ops.decode_attention(q, k, k, ip, ix, torch.tensor([40], dtype=torch.int32))
    except spade.Error as e:
        print("ok", type(e).__name__, str(e)[:60])
EOF
cat > "$W/m.py" <<'EOF'
import sys
if sys.argv[1] == "B":
    import torch
import mini
try:
    mini.boom()
except mini.Error as e:
    print("ok", e)
EOF
verdict() {  # log rc -> ok / SEGV / ABRT / rc=N
  if grep -q "^ok" "$1"; then echo ok
  elif [ "$2" = 139 ] || grep -q "Segmentation fault" "$1"; then echo SEGV
  elif [ "$2" = 134 ] || grep -q "Aborted" "$1"; then echo ABRT
  else echo "rc=$2"; fi
}
run_one() {  # variant test
  local v=$1 t=$2 log=$D/$1_$2.log
  if [ "$v" = mini ]; then
    PYTHONPATH=$W/mini timeout 60 $PY -X faulthandler "$W/m.py" "$t" > "$log" 2>&1
  else
    PYTHONPATH=$W/$v timeout 60 $PY -X faulthandler "$W/t.py" "$t" > "$log" 2>&1
  fi
  echo $? > "$log.rc"
}
VARS=()
for v in base xlibs static_rt isolated torch_pyb deps_pyb keep_gil sys_cxx; do
  [ -f "$W/$v/spade/$SONAME" ] && VARS+=($v)
done
[ -f "$W/mini/mini${SONAME#_core}" ] && VARS+=(mini)
t0=$(date +%s)
N=0
for v in "${VARS[@]}"; do
  for t in A B C; do
    [ "$v" = mini ] && [ "$t" = C ] && continue
    run_one "$v" "$t" &
    N=$((N + 1)); [ $((N % ${DIAG_PAR:-8})) = 0 ] && wait
  done
done
wait
echo "programs run in $(( $(date +%s) - t0 )) s"
printf "%-10s %-6s %-6s %-6s\n" variant A B C
FIRST=""
for v in "${VARS[@]}"; do
  line=$(printf "%-10s" "$v")
  for t in A B C; do
    if [ -f "$D/${v}_$t.log" ]; then
      r=$(verdict "$D/${v}_$t.log" "$(cat "$D/${v}_$t.log.rc")")
      [ "$r" != ok ] && [ -z "$FIRST" ] && FIRST="$v $t"
    else r=-; fi
    line="$line $(printf "%-6s" "$r")"
  done
  echo "$line"
done
for v in base; do for t in A B C; do
  grep -q "^ok" "$D/${v}_$t.log" || { echo "--- $v $t:"; grep -vE "^\s*$" "$D/${v}_$t.log" | head -12; }
done; done

# ---- which library the module's exception symbols bind to -----------------------------------
PYTHONPATH=$W/base LD_DEBUG=bindings LD_DEBUG_OUTPUT=$W/ldbind timeout 60 $PY "$W/t.py" C > /dev/null 2>&1
echo "bindings of $SONAME's exception / unwind symbols (LD_DEBUG=bindings, program C):"
cat "$W"/ldbind.* 2>/dev/null | grep -E "binding file [^ ]*/spade/_core" | \
  grep -E "\`(_Unwind_[A-Za-z]*|__cxa_(throw|allocate_exception|begin_catch|end_catch|rethrow)|__gxx_personality_v0|_ZSt17rethrow_exception[A-Za-z_0-9]*|_ZTISt13runtime_error|_ZTIN5spade5ErrorE|PyEval_SaveThread|PyEval_RestoreThread)'" | \
  sed -E "s/.* to ([^ ]+) .*\`([^']+)'.*/\\2 -> \\1/" | sort -u | head -20
echo "symbols $SONAME takes from another library than libstdc++ / libgcc_s / libc / libm / python:"
cat "$W"/ldbind.* 2>/dev/null | grep -E "binding file [^ ]*/spade/_core" | \
  grep -vE " to (/[^ ]*/)?(libstdc\+\+|libgcc_s|libc\.|libm\.|ld-linux|libpthread|libdl)|to [^ ]*_core|to [^ ]*python" | \
  sed -E 's/^ *[0-9]+:\s*binding file [^ ]+ (\[[0-9]+\] )?to //; s/\[[0-9]+\]//g' | awk '{print $1}' | sort | uniq -c | sort -rn | head -10

# ---- gdb at the first crash (DIAG_GDB="variant program" picks one) ---------------------------
FIRST=${DIAG_GDB:-$FIRST}
if [ -n "$FIRST" ]; then
  set -- $FIRST
  echo "gdb: variant $1, program $2"
  if command -v gdb > /dev/null; then
    if [ "$1" = mini ]; then P=$W/mini; S=$W/m.py; else P=$W/$1; S=$W/t.py; fi
    PYTHONPATH=$P timeout 120 gdb -q -batch -ex "set pagination off" -ex "handle SIGSEGV stop" \
      -ex run -ex "bt 30" -ex "info registers rip" -ex "x/6i \$pc" -ex "info sharedlibrary" \
      --args $PY "$S" "$2" > "$D/gdb.log" 2>&1
    grep -E "^#|SIGSEGV|SIGABRT|=>|exited" "$D/gdb.log" | head -40
    grep -E "stdc\+\+|gcc_s|_core|libtorch_python|libc\.so|unwind" "$D/gdb.log" | grep -E "^0x" | awk '{print $NF}' | head -12
  else
    echo "no gdb (apt-get install gdb works only with network); faulthandler's stacks are in $D/${1}_$2.log"
  fi
fi

#!/usr/bin/env bash
# Builds .deps-cuda/ (git-ignored via .git/info/exclude) from this machine's Debian packages:
# the project's C++ dependencies that the GPU image lacks, small enough to carry to the
# device (7 MB): gtest, nlohmann_json, CLI11 (headers), pcre2, zlib, the Boost headers the HTTP
# server uses (Beast + Asio and what they include, cut out by bcp: 21 MB, carried as a 2 MB
# tarball that bench/run_gpu.sh unpacks), and a cblas shim (OpenBLAS itself is 35 MB; the shim
# only serves the CPU reference in the gpu tests). Needs Debian's libboost-dev, libboost-tools-dev
# (bcp), libcli11-dev and pybind11-dev.
# Then:  run(command="bash bench/run_gpu.sh all", carry=[".deps-cuda"])
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qs '^/.deps-cuda/$' .git/info/exclude || echo /.deps-cuda/ >> .git/info/exclude
D=.deps-cuda; S=bench/gpu_deps; L=/usr/lib/x86_64-linux-gnu
rm -rf $D && mkdir -p $D/include $D/lib/pkgconfig $D/share/cmake $D/src $D/tools
cp -r /usr/include/gtest /usr/include/nlohmann /usr/include/CLI /usr/include/pcre2.h /usr/include/zlib.h /usr/include/zconf.h $D/include/
cp $S/cblas.h $D/include/ && cp $S/cblas_shim.c $D/src/ && cp $S/pkg-config $D/tools/
cp $L/libgtest.a $L/libgtest_main.a $L/libpcre2-8.a $L/libz.a $D/lib/
command -v bcp >/dev/null || { echo "make_deps: bcp missing (apt-get install libboost-tools-dev)"; exit 1; }
B=$(mktemp -d)
bcp --boost=/usr/include boost/beast/http.hpp boost/beast/core.hpp boost/asio.hpp "$B" >/dev/null
tar czf $D/boost-headers.tar.gz -C "$B" boost
rm -rf "$B"
cp -r /usr/share/cmake/nlohmann_json $D/share/cmake/
# pybind11 (headers + CMake config; its prefix is the config's ../../..): the Python package
# builds on the device where Python's headers are there (issue 41's device tests).
cp -r /usr/include/pybind11 $D/include/ && mkdir -p $D/lib/cmake && cp -r /usr/lib/cmake/pybind11 $D/lib/cmake/
sed -e 's|^prefix=.*|prefix=${pcfiledir}/../..|' -e 's|^libdir=.*|libdir=${prefix}/lib|' \
    -e 's|^includedir=.*|includedir=${prefix}/include|' $L/pkgconfig/libpcre2-8.pc > $D/lib/pkgconfig/libpcre2-8.pc
du -sh $D

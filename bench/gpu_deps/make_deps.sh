#!/usr/bin/env bash
# Builds .deps-cuda/ (git-ignored via .git/info/exclude) from this machine's Debian packages:
# the project's C++ dependencies that the GPU image lacks, small enough to carry to the
# device (5 MB): gtest, nlohmann_json, pcre2, cpp-httplib (+ brotli), and a cblas shim
# (OpenBLAS itself is 35 MB; the shim only serves the CPU reference in the gpu tests).
# Then:  run(command="bash bench/run_gpu.sh all", carry=[".deps-cuda"])
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qs '^/.deps-cuda/$' .git/info/exclude || echo /.deps-cuda/ >> .git/info/exclude
D=.deps-cuda; S=bench/gpu_deps; L=/usr/lib/x86_64-linux-gnu
rm -rf $D && mkdir -p $D/include $D/lib/pkgconfig $D/share/cmake $D/src $D/tools
cp -r /usr/include/gtest /usr/include/nlohmann /usr/include/pcre2.h /usr/include/httplib.h $D/include/
cp $S/cblas.h $D/include/ && cp $S/cblas_shim.c $D/src/ && cp $S/pkg-config $D/tools/
cp $L/libgtest.a $L/libgtest_main.a $L/libpcre2-8.a $D/lib/
cp $(readlink -f $L/libcpp-httplib.so) $D/lib/libcpp-httplib.so
cp $D/lib/libcpp-httplib.so $D/lib/libcpp-httplib.so.0.11
for l in brotlidec brotlienc brotlicommon; do cp $(readlink -f $L/lib$l.so.1) $D/lib/lib$l.so.1; done
cp -r /usr/share/cmake/nlohmann_json $D/share/cmake/
sed -e 's|^prefix=.*|prefix=${pcfiledir}/../..|' -e 's|^libdir=.*|libdir=${prefix}/lib|' \
    -e 's|^includedir=.*|includedir=${prefix}/include|' $L/pkgconfig/libpcre2-8.pc > $D/lib/pkgconfig/libpcre2-8.pc
cp $S/cpp-httplib.pc $D/lib/pkgconfig/
du -sh $D

// Shared harness of the KV cache element-type tests (test_kv_dtype.cpp, test_kv_fp8.cpp): the
// pool layout, the SIMD levels this CPU has, `spade generate` runs, and a sparse method run on
// twin caches (prefill, then decode steps, every layer) whose outputs must agree.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/qgemv.h"
#include "kv/kv_dtype.h"
#include "kv/kv_pool.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#include "test_util.h"

namespace spade::test {

// Pages of `page` tokens of type t (fp8: --kv-scale `scale`, 0 = auto) for model c.
inline KVLayout kv_layout(const ModelConfig& c, int page, KvDtype t, float scale = 0.f) {
  KVLayout l{c.n_layers, c.n_kv_heads, c.head_dim, page};
  l.dtype = t;
  l.kv_scale = scale;
  return l;
}

// The SIMD levels this CPU has: scalar, then AVX2 and AVX-512 where present.
inline std::vector<cpu::SimdLevel> simd_levels() {
  std::vector<cpu::SimdLevel> levels = {cpu::SimdLevel::Scalar};
  if (int(cpu::detected_simd_level()) >= int(cpu::SimdLevel::Avx2)) levels.push_back(cpu::SimdLevel::Avx2);
  if (cpu::detected_simd_level() == cpu::SimdLevel::Avx512) levels.push_back(cpu::SimdLevel::Avx512);
  return levels;
}

// The `spade` binary beside this test binary ("" when /proc/self/exe cannot be read).
inline std::string spade_binary() {
  char self[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return "";
  std::string dir(self, size_t(len));
  return dir.substr(0, dir.rfind('/')) + "/spade";
}

// `spade generate` of six tokens on the stories260k fixture with the options `extra`: its
// output (stdout and stderr), *rc its exit status ("" and *rc untouched when it cannot start).
inline std::string run_generate(const std::string& spade, const std::string& extra, int* rc) {
  const std::string model = source_dir() + "/tests/fixtures/models/stories260k-hf";
  const std::string cmd = spade + " generate --model " + model +
                          " --prompt 'Once upon a time' -n 6 -t 1 " + extra + " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
  *rc = pclose(p);
  return out;
}

// The methods the twin-cache tests run: the single methods, then `composites`, then BLASST.
inline std::vector<std::string> twin_method_specs(const std::vector<std::string>& composites) {
  std::vector<std::string> specs = {
      "full",
      "streaming:budget=48",
      "quest:budget=64",
      "tidal:budget=48,dense_layers=1,selection_layers=1,3",
      "lessismore:budget=64,dense_layers=1,selection_layers=1,3",
      "oracle-topk:budget=40",
      "oracle-topp:p=0.5",
      "lycheecluster:budget=64,chunking=fixed",
      "lycheedecode:roles=RR/SS/RS/SS,budget=48",
      "twilight",
  };
  specs.insert(specs.end(), composites.begin(), composites.end());
  specs.push_back("blasst:lambda=0.9,tile=8,prefill_tile=8,q_block=16");
  return specs;
}

// One method (`spec`) in two sessions over twin caches of 32 pages of 16: a of type ta, b f32;
// both hold L0 reserved rows of "word " text.
struct TwinCaches {
  KVPool a, b;
  std::shared_ptr<const sparse::SparseMethod> method;
  sparse::SparseSession sa, sb;
  PageTable pa, pb;
  TwinCaches(const ModelConfig& c, const std::string& spec, KvDtype ta, int64_t L0)
      : a(kv_layout(c, 16, ta), 32),
        b(kv_layout(c, 16, KvDtype::F32), 32),
        method(sparse::make_method(sparse::SparseConfig::parse_spec(spec), c)),
        sa(method, c, a, {true, true}),
        sb(method, c, b, {true, true}) {
    a.reserve(pa, L0);
    b.reserve(pb, L0);
    for (int64_t p = 0; p < L0; ++p)
      for (auto* s : {&sa, &sb}) s->append_token_text("word ");
  }
};

// Runs t's method over both caches: for each of n_layers layers a prefill of L0 rows (before it
// scales(l) if given, then write(l, p) for every row), then `steps` decode steps, each writing
// row p of every layer. queries(l, p, n) gives the query pointers for a and b of n tokens at
// p. Every output (prefill: all L0 * hq_d; decode: hq_d) must satisfy same(out_a, out_b, n).
inline void run_twin_caches(
    TwinCaches& t, int n_layers, int64_t L0, int64_t steps, int64_t hq_d,
    const std::function<void(int l, int64_t p)>& write,
    const std::function<std::pair<const float*, const float*>(int l, int64_t p, int64_t n)>& queries,
    const std::function<bool(const std::vector<float>&, const std::vector<float>&, int64_t)>& same,
    const std::function<void(int l)>& scales = nullptr) {
  std::vector<float> oa(size_t(L0 * hq_d)), ob(oa.size());
  for (int l = 0; l < n_layers; ++l) {
    if (scales) scales(l);
    for (int64_t p = 0; p < L0; ++p) write(l, p);
    const auto [qa, qb] = queries(l, 0, L0);
    t.sa.attend(l, t.pa, qa, 0, L0, oa.data());
    t.sb.attend(l, t.pb, qb, 0, L0, ob.data());
    ASSERT_TRUE(same(oa, ob, int64_t(oa.size()))) << "prefill, layer " << l;
  }
  t.pa.length = t.pb.length = L0;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t p = L0 + s;
    t.a.reserve(t.pa, p + 1);
    t.b.reserve(t.pb, p + 1);
    for (auto* ss : {&t.sa, &t.sb}) ss->append_token_text("word ");
    for (int l = 0; l < n_layers; ++l) {
      write(l, p);
      const auto [qa, qb] = queries(l, p, 1);
      t.sa.attend(l, t.pa, qa, p, 1, oa.data());
      t.sb.attend(l, t.pb, qb, p, 1, ob.data());
      ASSERT_TRUE(same(oa, ob, hq_d)) << "decode step " << s << ", layer " << l;
    }
    t.pa.length = t.pb.length = p + 1;
  }
}

}  // namespace spade::test

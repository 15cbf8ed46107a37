// FP8 (E4M3) KV cache on the GPU (issue 40) against the CPU reference (kv/kv_pool.h, fp8 pool):
// - the KV append (qkv_post with QkvPostArgs::kv_scale) stores the CPU pool's codes bit for bit
//   (fp8_e4m3_from_f32(x / scale)), specials included, and the calibration pass gives the CPU's
//   auto scale rule on the same values;
// - attention over an fp8 cache (AttentionWorkspace::run_fp8: the v3 decode kernel reading the
//   codes, every other step widening the step's pages into a bf16 scratch) equals
//   cpu::attention_dense over the same fp8 pool within the bf16 attention tolerance;
// - a tiny random model with an fp8 cache on the GPU vs CpuModel over an fp8 pool with the same
//   scales (fixed, and the CPU's auto scales handed to the GPU), and the auto scales both
//   devices pick from the same prompt;
// - every GPU method but plain full attention is refused over an fp8 cache, by name.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "../test_util.h"
#include "backend/cpu/attention.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/ops.h"
#include "core/half.h"
#include "engine/runner.h"
#include "gpu_model_util.h"
#include "gpu_util.h"
#include "kv/fp8_e4m3.h"
#include "kv/key_rotation.h"
#include "model/cpu_model.h"
#include "model/cuda_model.h"
#include "sparse/gpu/method.h"
#include "sparse/gpu/registry.h"

namespace spade::test {
namespace {

using cuda::bf16;

float pow2(int e) { return std::ldexp(1.f, e); }

// ---- The append.

// qkv rows with a few specials: exact ties between codes, values past 448 x scale (saturation),
// the subnormal range, +-0, +-inf and NaN.
std::vector<float> special_qkv(int T, int NQKV, std::mt19937& rng, float mag) {
  std::vector<float> x = randn(size_t(T) * NQKV, rng, mag);
  const float specials[] = {0.f, -0.f, INFINITY, -INFINITY, NAN, 1e30f, -1e30f,
                            1.0625f * mag, 1.1875f * mag, 3e-3f * mag, 1e-6f * mag, 5e-40f};
  for (size_t i = 0; i < x.size(); i += 7) x[i] = specials[(i / 7) % (sizeof(specials) / 4)];
  return x;
}

// T tokens, each in its own page (K rows at position 0: RoPE is the identity there, so the
// GPU's K values are exactly the inputs plus bias); V rows at any position.
// rotate: the key rotation of fp8 caches (QkvPostArgs::rotate_qk, kv/key_rotation.h): K rows
// and q rows are rotated after RoPE, and equal the CPU's rotate_key_row of the same values.
void check_append(int Hq, int Hkv, int D, int P, bool bias, uint32_t seed, bool rotate = false) {
  SCOPED_TRACE(testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " P=" << P
                                  << " bias=" << bias << " rotate=" << rotate);
  std::mt19937 rng(seed);
  const int T = 6, NQKV = (Hq + 2 * Hkv) * D;
  const int n_pages = T + 2;
  std::vector<float> qkv = special_qkv(T, NQKV, rng, 3.f);
  std::vector<float> b = bias ? randn(size_t(NQKV), rng, 0.5f) : std::vector<float>();
  std::vector<float> inv(size_t(D / 2));
  for (int i = 0; i < D / 2; ++i) inv[size_t(i)] = std::pow(10000.f, -2.f * float(i) / float(D));
  // Per head scales: K heads 2^-3.., V heads 2^-1.. (powers of two, some saturate 1e30).
  std::vector<float> sc(size_t(2 * Hkv));
  for (int h = 0; h < Hkv; ++h) sc[size_t(h)] = pow2(-3 + h), sc[size_t(Hkv + h)] = pow2(-1 - h);
  for (int k_pos_zero : {1, 0}) {
    SCOPED_TRACE(k_pos_zero ? "positions 0 (K and V)" : "positions P-1.. (V only)");
    std::vector<int32_t> pos(static_cast<size_t>(T)), page(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) {
      pos[size_t(t)] = k_pos_zero ? 0 : (P - 1) + t * 37;  // slot pos % P of page[t]
      page[size_t(t)] = n_pages - 1 - t;                  // distinct pages
    }
    const size_t cache_n = size_t(n_pages) * Hkv * P * D;
    DevBuf<float> dqkv(qkv), dinv(inv), dsc(sc);
    DevBuf<float> dbias(bias ? b : std::vector<float>(1, 0.f));
    DevBuf<int32_t> dpos(pos), dpage(page);
    DevBuf<bf16> dq(size_t(T) * Hq * D);
    DevBuf<uint8_t> dk(cache_n), dv(cache_n);
    SPADE_CUDA(cudaMemset(dk.p, 0x55, cache_n));
    SPADE_CUDA(cudaMemset(dv.p, 0x55, cache_n));
    cuda::QkvPostArgs a;
    a.qkv = dqkv.p;
    a.bias = bias ? dbias.p : nullptr;
    a.inv_freq = dinv.p;
    a.pos = dpos.p;
    a.page = dpage.p;
    a.q_out = dq.p;
    a.k_cache = reinterpret_cast<bf16*>(dk.p);
    a.v_cache = reinterpret_cast<bf16*>(dv.p);
    a.kv_scale = dsc.p;
    a.rotate_qk = rotate;
    a.T = T, a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.P = P;
    cuda::qkv_post(a, 0);
    // Calibration pass over the same rows: the maxima and the auto scales.
    DevBuf<unsigned int> damax(size_t(2 * Hkv));
    DevBuf<float> dauto(size_t(2 * Hkv));
    SPADE_CUDA(cudaMemset(damax.p, 0, 8 * size_t(Hkv)));
    cuda::QkvPostArgs c = a;
    c.kv_scale = nullptr;
    c.kv_amax = damax.p;
    cuda::qkv_post(c, 0);
    cuda::fp8_scales_from_amax(damax.p, dauto.p, 2 * Hkv, 0);
    const std::vector<uint8_t> gk = dk.download(), gv = dv.download();
    const std::vector<float> gauto = dauto.download();
    int64_t checked = 0;
    if (rotate && k_pos_zero) {  // q rows at position 0 (RoPE: x itself), rotated, as bf16
      const std::vector<bf16> gq = dq.download();
      std::vector<float> row(static_cast<size_t>(D));
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < Hq; ++h) {
          const int half = D / 2;
          auto in = [&](int d) {
            return qkv[size_t(t) * NQKV + size_t(h) * D + d] + (bias ? b[size_t(h) * D + d] : 0.f);
          };
          for (int d = 0; d < D; ++d) {
            const float lo = in(d % half), hi = in(d % half + half);
            row[size_t(d)] = d < half ? std::fma(lo, 1.f, -(0.f * hi)) : std::fma(lo, 0.f, 1.f * hi);
          }
          rotate_key_row(row.data(), D);
          for (int d = 0; d < D; ++d) {
            if (!std::isfinite(row[size_t(d)])) continue;
            const float got = __bfloat162float(gq[(size_t(t) * Hq + size_t(h)) * D + size_t(d)]);
            ASSERT_EQ(got, bf16_to_f32(f32_to_bf16(row[size_t(d)]))) << "q head " << h << " token " << t << " d " << d;
            ++checked;
          }
        }
    }
    for (int kv = k_pos_zero ? 0 : 1; kv < 2; ++kv) {
      for (int h = 0; h < Hkv; ++h) {
        const float s = sc[size_t(kv * Hkv + h)];
        float amax = 0.f;
        for (int t = 0; t < T; ++t) {
          const int head = Hq + kv * Hkv + h;
          const size_t row = (size_t(page[size_t(t)]) * Hkv + h) * P + size_t(pos[size_t(t)] % P);
          // The kernel's values: bias added (+ 0.f without one: -0 becomes +0), and K rotated
          // at position 0 with its FMAs (cos 1, sin 0: x itself, but an inf / NaN partner in
          // the other half makes NaN), as qkv_post_pair computes them.
          auto in = [&](int d) {
            return qkv[size_t(t) * NQKV + size_t(head) * D + d] + (bias ? b[size_t(head) * D + d] : 0.f);
          };
          std::vector<float> krow(static_cast<size_t>(D));
          for (int d = 0; d < D; ++d) {
            const int half = D / 2;
            float x = in(d);
            if (kv == 0) {
              const float lo = in(d % half), hi = in(d % half + half);
              x = d < half ? std::fma(lo, 1.f, -(0.f * hi)) : std::fma(lo, 0.f, 1.f * hi);
            }
            krow[size_t(d)] = x;
          }
          if (kv == 0 && rotate) rotate_key_row(krow.data(), D);
          for (int d = 0; d < D; ++d) {
            const float x = krow[size_t(d)];
            if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
            const uint8_t want = fp8_e4m3_from_f32(x / s);
            const uint8_t got = (kv ? gv : gk)[row * D + size_t(d)];
            ASSERT_EQ(int(got), int(want)) << (kv ? "V" : "K") << " head " << h << " token " << t
                                           << " d " << d << " x " << x << " scale " << s;
            ++checked;
          }
        }
        EXPECT_EQ(gauto[size_t(kv * Hkv + h)], fp8_e4m3_scale_for_amax(amax))
            << (kv ? "V" : "K") << " head " << h << " amax " << amax;
      }
    }
    EXPECT_GT(checked, 0);
  }
}

TEST(CudaKvFp8, AppendStoresTheCpuCodes) {
  SKIP_WITHOUT_GPU();
  check_append(9, 3, 64, 16, false, 1);
  check_append(32, 8, 128, 16, true, 2);
  check_append(8, 2, 128, 7, true, 3);
  check_append(9, 3, 64, 16, false, 4, true);
  check_append(32, 8, 128, 16, true, 5, true);
}

// ---- Attention.

struct Seq {
  int kv_len, q_len;
};

// An fp8 pool (one layer) written row by row through KVPool::write (the CPU's quantization),
// per-head scales set, pages shuffled; the GPU reads the pool's bytes and scales.
void attention_case(int Hq, int Hkv, int D, int P, const std::vector<Seq>& seqs, int force_split,
                    uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " P=" << P
                                  << " split=" << force_split);
  std::mt19937 rng(seed);
  int64_t pages_needed = 0, total_q = 0;
  for (auto& s : seqs) pages_needed += (s.kv_len + P - 1) / P, total_q += s.q_len;
  KVLayout lay{1, Hkv, D, P};
  lay.page_minmax = false;
  lay.dtype = KvDtype::FP8;
  KVPool kv(lay, pages_needed + 5);
  std::vector<float> ks(static_cast<size_t>(Hkv)), vs(static_cast<size_t>(Hkv));
  for (int h = 0; h < Hkv; ++h) ks[size_t(h)] = pow2(-4 + (h % 4)), vs[size_t(h)] = pow2(-5 + (h % 3));
  kv.set_scales(0, ks.data(), vs.data());
  std::vector<PageTable> pts(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) kv.reserve(pts[i], seqs[i].kv_len);
  std::vector<int32_t> all;
  for (auto& pt : pts) all.insert(all.end(), pt.pages.begin(), pt.pages.end());
  std::shuffle(all.begin(), all.end(), rng);
  size_t o = 0;
  for (auto& pt : pts)
    for (auto& p : pt.pages) p = all[o++];
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::vector<float> k = randn(size_t(Hkv) * D, rng, 0.5f), v(k.size());
    for (int64_t t = 0; t < seqs[i].kv_len; ++t) {
      for (auto& x : k) x = std::normal_distribution<float>(0.f, 0.5f)(rng);
      for (auto& x : v) x = std::normal_distribution<float>(0.f, 0.1f)(rng);
      kv.write(0, pts[i], t, k.data(), v.data());
    }
    pts[i].length = seqs[i].kv_len;
  }
  auto q = round_bf16(randn(size_t(total_q) * Hq * D, rng, 1.f));
  const float scale = 1.f / std::sqrt(float(D));
  std::vector<float> ref(q.size());
  cpu::AttentionScratch scratch;
  int64_t r = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t p0 = seqs[i].kv_len - seqs[i].q_len;
    cpu::attention_dense(kv, 0, pts[i], q.data() + r * Hq * D, p0, seqs[i].q_len, Hq, scale,
                         ref.data() + r * Hq * D, scratch);
    r += seqs[i].q_len;
  }
  const size_t cache_n = size_t(kv.n_pages()) * size_t(lay.page_elems());
  const auto* kb = static_cast<const uint8_t*>(kv.k_page_data(0, 0));
  const auto* vb = static_cast<const uint8_t*>(kv.v_page_data(0, 0));
  DevBuf<uint8_t> dk(std::vector<uint8_t>(kb, kb + cache_n)), dv(std::vector<uint8_t>(vb, vb + cache_n));
  DevBuf<float> dks(ks), dvs(vs);
  DevBuf<bf16> dkw(cache_n), dvw(cache_n), dq(to_bf16(q)), dout(q.size());
  // Zeroed as CudaModel's scratch (a page widening missed would read zeros: wrong outputs).
  SPADE_CUDA(cudaMemset(dkw.p, 0, cache_n * 2));
  SPADE_CUDA(cudaMemset(dvw.p, 0, cache_n * 2));
  cuda::DeviceArena arena(256u << 20);
  cuda::AttnLimits lim;
  lim.max_batch = 64;
  lim.max_q_tokens = 4096;
  lim.max_pages = 1 << 16;
  cuda::AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  std::vector<cuda::AttnSeq> batch;
  bool all_decode = true;
  for (size_t i = 0; i < seqs.size(); ++i) {
    batch.push_back({pts[i].pages.data(), int(pts[i].pages.size()), seqs[i].kv_len, seqs[i].q_len});
    all_decode = all_decode && seqs[i].q_len == 1;
  }
  cuda::KvFp8 f8;
  f8.k = dk.p, f8.v = dv.p, f8.k_scale = dks.p, f8.v_scale = dvs.p;
  f8.k_wide = dkw.p, f8.v_wide = dvw.p;
  const int n_kernels = all_decode ? cuda::AttentionWorkspace::decode_kernel_count() : 3;
  for (int kern = 0; kern < n_kernels; ++kern) {
    if (all_decode && !cuda::AttentionWorkspace::decode_kernel_fits(kern, D)) continue;
    if (all_decode) ws.set_decode_kernel(kern);
    else ws.set_prefill_kernel(kern);
    for (bool det : {false, true}) {  // DYN variants draw chunks; deterministic: static twins
      ws.set_deterministic(det);
      ws.plan(batch, 0, force_split);
      SCOPED_TRACE(testing::Message()
                   << (all_decode ? cuda::AttentionWorkspace::decode_kernel_name(kern) : "prefill")
                   << " kernel " << kern << " variant " << ws.decode_variant() << " splits="
                   << ws.n_split() << " direct=" << ws.fp8_direct() << " deterministic=" << det);
      for (int rep = 0; rep < 2; ++rep) {
        dout.poison();
        ws.run_fp8(dq.p, f8, dout.p, scale, 0);
        auto got = from_bf16(dout.download());
        EXPECT_LT(rel_err(got, ref), kTolAttn) << "rep=" << rep;
        r = 0;
        for (size_t i = 0; i < seqs.size(); ++i) {
          const size_t n = size_t(seqs[i].q_len) * Hq * D;
          EXPECT_LT(rel_err(got.data() + r * Hq * D, ref.data() + r * Hq * D, n), kTolAttn)
              << "sequence " << i << " kv=" << seqs[i].kv_len << " q=" << seqs[i].q_len;
          r += seqs[i].q_len;
        }
      }
    }
  }
}

TEST(CudaKvFp8, DecodeLlamaShape) {
  SKIP_WITHOUT_GPU();
  std::vector<Seq> s = {{1, 1}, {15, 1}, {16, 1}, {17, 1}, {100, 1}, {1000, 1}, {4097, 1}};
  for (int split : {0, 1, 5}) attention_case(32, 8, 128, 16, s, split, 31);
}

TEST(CudaKvFp8, DecodeSmolLM2ShapeOddPages) {
  SKIP_WITHOUT_GPU();
  std::vector<Seq> s = {{3, 1}, {64, 1}, {65, 1}, {777, 1}};
  attention_case(9, 3, 64, 16, s, 0, 32);
  attention_case(9, 3, 64, 7, s, 3, 33);   // chunks straddle pages (per-row page ids)
  attention_case(32, 8, 128, 5, {{333, 1}, {49, 1}}, 0, 34);
}

TEST(CudaKvFp8, DecodeLongContext) {
  SKIP_WITHOUT_GPU();
  attention_case(32, 8, 128, 16, {{40000, 1}, {33, 1}}, 0, 35);
}

// Prefill chunks and mixed steps: the step's pages widened into the bf16 scratch.
TEST(CudaKvFp8, PrefillChunksOverFp8) {
  SKIP_WITHOUT_GPU();
  std::vector<Seq> s = {{37, 37}, {300, 100}, {1000, 1}, {129, 64}, {16, 16}, {700, 333}};
  attention_case(32, 8, 128, 16, s, 0, 41);
  attention_case(9, 3, 64, 16, s, 0, 42);
  attention_case(12, 4, 64, 5, {{250, 250}, {97, 3}}, 0, 43);
}

// ---- The model.

ModelConfig fp8_config(Arch arch, int D) {
  ModelConfig c = tiny_config(arch, D);
  if (D == 128) {
    c.rope_theta = 500000.f;
    c.rope_scaling.llama3 = true;
    c.rope_scaling.factor = 8.f;
  }
  return c;
}

// Prefill in two chunks (all logits) beside a second prompt, then batched decode steps, on the
// CPU over an fp8 pool and on the GPU with an fp8 cache of the same scales: kv_scale > 0 fixed,
// 0: the CPU's auto scales (from its first step) handed to the GPU before its first step.
//
// The bound, measured in the same run on the same prompts and steps (worst step of each):
//   e_fp8  = GPU fp8 vs CPU fp8 (what this test checks),
//   e_base = GPU bf16 KV vs CPU f32 KV (the devices' own difference: bf16 activations and GEMM
//            inputs on the GPU; bounded here by the bf16 model tests' 3e-2),
//   e_q    = CPU fp8 vs CPU f32 (what quantizing K / V to E4M3 does to the logits),
//   rule:  e_fp8 <= e_base + e_q.
// Why: the two devices' fp32 K / V differ by about a bf16 rounding (2^-9 relative), and an
// element that lies that close to the midpoint of two E4M3 codes rounds to neighbouring codes on
// the two devices: one code step apart, 1/16 to 1/8 of the element (a difference bf16 KV never
// sees: this is why bf16's 3e-2 cannot hold). The fraction f of elements that flip is about
// |dx| / step ~ 2^-9 / 2^-4, a few percent; a flip moves its element by one step, so the flips'
// perturbation has an rms of sqrt(f) step, below the quantization's own step / sqrt(12) (which
// every element gets) while f < 1/12. Errors of the logits scale with the rms of the K / V
// perturbation through the same model, so the flips cost at most e_q and the rest is e_base.
// The fp8 reading path itself (identical codes on both devices) is checked tightly by the
// attention tests above (the CPU pool's codes read by the GPU, kTolAttn).
// CPU runs of these configurations: e_q 0.10-0.20 (Llama, Qwen2), 0.03 (Qwen3); e_fp8 measured
// on an H200: 0.083-0.098 (Llama, Qwen2), 0.019 (Qwen3).
constexpr double kTolBf16ModelLogits = 3e-2;

void compare_fp8_model(const ModelConfig& c, float kv_scale, bool graphs) {
  SCOPED_TRACE(testing::Message() << arch_name(c.arch) << " D=" << c.head_dim << " kv_scale="
                                  << kv_scale << " graphs=" << graphs);
  ModelWeights w = random_model(c, 77);
  round_weights_bf16(w);
  KVLayout lay{c.n_layers, c.n_kv_heads, c.head_dim, 16};
  lay.dtype = KvDtype::FP8;
  lay.kv_scale = kv_scale;
  KVPool kv(lay, 64);
  KVLayout lay32 = lay;
  lay32.dtype = KvDtype::F32;
  KVPool kv32(lay32, 64);
  CpuModel cpu(w, kv), cpu32(w, kv32);
  CudaModelOptions opt;
  opt.max_tokens = 1024;
  opt.max_batch = 4;
  opt.max_step_tokens = 256;
  opt.max_logit_rows = 256;
  opt.cuda_graphs = graphs;
  opt.graph_min_uses = 1;
  CudaModelOptions opt_bf16 = opt;
  opt.kv_dtype = KvDtype::FP8;
  opt.kv_scale = kv_scale;
  CudaModel gpu(w, opt), gpu_bf16(w, opt_bf16);
  EXPECT_TRUE(gpu.kv_fp8());
  EXPECT_FALSE(gpu_bf16.kv_fp8());
  EXPECT_EQ(gpu.kv_scales_set(), kv_scale > 0);
  std::mt19937 rng(3);
  std::vector<int32_t> a(53), b(17);
  for (auto& t : a) t = int32_t(rng() % uint32_t(c.vocab));
  for (auto& t : b) t = int32_t(rng() % uint32_t(c.vocab));
  PageTable pc[2], pg[2], p32[2], pgb[2];
  std::vector<int64_t> rc, rg, r32, rgb;
  double worst_fp8 = 0, worst_base = 0, worst_q = 0;
  // The same inputs on all four: `tables` picks each model's page tables.
  using Batch = std::vector<std::tuple<int, const int32_t*, int, bool>>;  // seq, tokens, n, all
  auto inputs = [](PageTable* pts, const Batch& bt) {
    std::vector<SeqInput> in;
    for (auto& [i, tok, n, all] : bt) in.push_back({&pts[i], tok, n, all});
    return in;
  };
  auto step = [&](const Batch& bt, const char* what) {
    const std::vector<float> lc = cpu.forward(inputs(pc, bt), rc);
    const std::vector<float> l32 = cpu32.forward(inputs(p32, bt), r32);
    if (!gpu.kv_scales_set()) gpu.set_kv_scales(kv.k_scales(), kv.v_scales());
    const std::vector<float> lg = gpu.forward(inputs(pg, bt), rg);
    const std::vector<float> lgb = gpu_bf16.forward(inputs(pgb, bt), rgb);
    ASSERT_EQ(lc.size(), lg.size());
    ASSERT_EQ(l32.size(), lg.size());
    ASSERT_EQ(lgb.size(), lg.size());
    const double e_fp8 = rel_err(lg, lc), e_base = rel_err(lgb, l32), e_q = rel_err(lc, l32);
    EXPECT_LT(e_base, kTolBf16ModelLogits) << what;
    worst_fp8 = std::max(worst_fp8, e_fp8);
    worst_base = std::max(worst_base, e_base);
    worst_q = std::max(worst_q, e_q);
  };
  step({{0, a.data(), 30, true}, {1, b.data(), 17, false}}, "prefill chunk 1");
  step({{0, a.data() + 30, 23, true}}, "prefill chunk 2");
  for (int s = 0; s < 12; ++s) {
    int32_t ta = int32_t(rng() % uint32_t(c.vocab)), tb = int32_t(rng() % uint32_t(c.vocab));
    step({{0, &ta, 1, false}, {1, &tb, 1, false}}, "decode");
  }
  EXPECT_LE(worst_fp8, worst_base + worst_q)
      << "GPU fp8 vs CPU fp8 " << worst_fp8 << ", GPU bf16 vs CPU f32 " << worst_base
      << ", CPU fp8 vs CPU f32 " << worst_q;
  EXPECT_GT(worst_q, 0.0);  // the fp8 pool does quantize
  std::vector<float> gk, gv;
  gpu.kv_scales(gk, gv);
  EXPECT_EQ(gk, kv.k_scales());
  EXPECT_EQ(gv, kv.v_scales());
  std::printf("[ fp8-model ] %s D=%d kv_scale=%g graphs=%d: worst logits rel err GPU fp8 vs CPU "
              "fp8 %.3g <= GPU bf16 vs CPU f32 %.3g + CPU fp8 vs CPU f32 %.3g\n",
              arch_name(c.arch), c.head_dim, double(kv_scale), int(graphs), worst_fp8, worst_base,
              worst_q);
  if (graphs) {
    EXPECT_GE(gpu.graphs_captured(), 1);
  }
}

TEST(CudaKvFp8, RandomModelMatchesCpuFp8) {
  SKIP_WITHOUT_GPU();
  compare_fp8_model(fp8_config(Arch::Llama, 64), 0.f, false);
  compare_fp8_model(fp8_config(Arch::Llama, 64), 0.f, true);
  compare_fp8_model(fp8_config(Arch::Llama, 128), 0.f, true);
  compare_fp8_model(fp8_config(Arch::Llama, 128), 0.0625f, true);
  compare_fp8_model(fp8_config(Arch::Qwen2, 64), 0.f, true);
  compare_fp8_model(fp8_config(Arch::Qwen3, 128), 0.f, true);
}

// `--kv-scale auto` on both devices from the same prompt: each picks its scales from its own
// fp32 K / V values with the same rule; they agree unless a head's largest |value| sits within
// the devices' rounding differences (bf16 GEMM inputs on the GPU) of a 224 x 2^k boundary, and
// then differ by exactly a factor of two (counted and printed; at most 2 of the 36 allowed).
TEST(CudaKvFp8, AutoScalesMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (auto [arch, D] : {std::pair{Arch::Llama, 64}, std::pair{Arch::Llama, 128},
                         std::pair{Arch::Qwen3, 128}}) {
    const ModelConfig c = fp8_config(arch, D);
    SCOPED_TRACE(testing::Message() << arch_name(c.arch) << " D=" << D);
    ModelWeights w = random_model(c, 78);
    round_weights_bf16(w);
    KVLayout lay{c.n_layers, c.n_kv_heads, c.head_dim, 16};
    lay.dtype = KvDtype::FP8;
    KVPool kv(lay, 64);
    CpuModel cpu(w, kv);
    CudaModelOptions opt;
    opt.max_tokens = 1024;
    opt.max_batch = 2;
    opt.max_step_tokens = 128;
    opt.kv_dtype = KvDtype::FP8;
    CudaModel gpu(w, opt);
    std::mt19937 rng(9);
    std::vector<int32_t> a(61);
    for (auto& t : a) t = int32_t(rng() % uint32_t(c.vocab));
    PageTable pc, pg;
    std::vector<int64_t> rc, rg;
    cpu.forward({{&pc, a.data(), 61, false}}, rc);
    gpu.forward({{&pg, a.data(), 61, false}}, rg);
    EXPECT_TRUE(gpu.kv_scales_set());
    std::vector<float> gk, gv;
    gpu.kv_scales(gk, gv);
    ASSERT_EQ(gk.size(), kv.k_scales().size());
    int differ = 0;
    auto cmp = [&](float g, float c_) {
      EXPECT_GT(g, 0.f);
      if (g == c_) return;
      ++differ;
      EXPECT_TRUE(g == 2 * c_ || c_ == 2 * g) << "GPU scale " << g << ", CPU " << c_;
    };
    for (size_t i = 0; i < gk.size(); ++i) cmp(gk[i], kv.k_scales()[i]), cmp(gv[i], kv.v_scales()[i]);
    EXPECT_LE(differ, 2);
    std::printf("[ fp8-auto ] %s D=%d: %d of %zu scales differ between GPU and CPU\n",
                arch_name(c.arch), D, differ, 2 * gk.size());
    // reset_kv_scales: refused while pages are in use, then the next step sets them again.
    EXPECT_THROW(gpu.reset_kv_scales(), Error);
    gpu.release(pg);
    gpu.reset_kv_scales();
    EXPECT_FALSE(gpu.kv_scales_set());
    gpu.forward({{&pg, a.data(), 61, false}}, rg);
    std::vector<float> gk2, gv2;
    gpu.kv_scales(gk2, gv2);
    EXPECT_EQ(gk2, gk);
    EXPECT_EQ(gv2, gv);
  }
}

// fp8 halves the pool's bytes: the same kv_pages take half the KV memory (plus one layer of
// bf16 scratch), so the same memory holds twice the tokens.
TEST(CudaKvFp8, PoolTakesHalfTheBytes) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config(Arch::Llama, 128);
  CudaModelOptions ob;
  ob.kv_pages = 4096;
  ob.max_batch = 2;
  ob.max_step_tokens = 64;
  CudaModelOptions o8 = ob;
  o8.kv_dtype = KvDtype::FP8;
  o8.kv_scale = 1.f;
  CudaModel mb(c, ob, 1), m8(c, o8, 1);
  const double layer = double(ob.kv_pages) * 16 * c.n_kv_heads * c.head_dim;  // elements
  const double saved = double(mb.arena_bytes()) - double(m8.arena_bytes());
  // bf16 2 x 2 bytes per element and layer; fp8 2 x 1, plus 2 x 2 bytes of one layer's scratch.
  const double want = layer * (c.n_layers * 2.0 - 4.0);
  EXPECT_NEAR(saved, want, 64.0 * 1024) << "arena bf16 " << mb.arena_bytes() << " fp8 " << m8.arena_bytes();
  EXPECT_EQ(m8.total_pages(), mb.total_pages());
}

// Decode steps over random fp8 codes (fill_kv_random) run and replay graphs; the benchmark path.
TEST(CudaKvFp8, FillRandomDecodes) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config(Arch::Llama, 128);
  CudaModelOptions o;
  o.max_tokens = 8192;
  o.max_batch = 2;
  o.max_step_tokens = 64;
  o.kv_dtype = KvDtype::FP8;
  o.graph_min_uses = 1;
  CudaModel m(c, o, 5);
  PageTable pt[2];
  m.fill_kv_random(pt[0], 3000, 11);
  m.fill_kv_random(pt[1], 1000, 12);
  EXPECT_TRUE(m.kv_scales_set());
  std::vector<int64_t> rows;
  for (int s = 0; s < 4; ++s) {
    int32_t t0 = 5 + s, t1 = 9 + s;
    const auto& l = m.forward({{&pt[0], &t0, 1, false}, {&pt[1], &t1, 1, false}}, rows);
    for (float x : l) ASSERT_TRUE(std::isfinite(x));
  }
  EXPECT_GE(m.graphs_captured(), 1);
}

// ---- Methods that do not read fp8 yet.

TEST(CudaKvFp8, UnportedMethodsAreRefusedByName) {
  const ModelConfig c = fp8_config(Arch::Llama, 64);
  int refused = 0;
  for (const GpuMethodRow& row : gpu_methods()) {
    CudaSparse sp;
    try {
      sp = cuda_sparse_config(sparse::SparseConfig::parse_spec(row.name), c, 16);
    } catch (const Error&) {
      continue;  // needs options this default spec lacks
    }
    if (std::string(row.name) == "full") {
      EXPECT_NO_THROW(check_gpu_kv_dtype(true, sp));
      continue;
    }
    SCOPED_TRACE(row.name);
    expect_error([&] { check_gpu_kv_dtype(true, sp); }, row.name);
    expect_error([&] { check_gpu_kv_dtype(true, sp); }, "fp8");
    EXPECT_NO_THROW(check_gpu_kv_dtype(false, sp));
    ++refused;
  }
  EXPECT_GE(refused, 5);
  for (const char* spec : {"full+twilight", "full+blasst"}) {
    CudaSparse sp;
    try {
      sp = cuda_sparse_config(sparse::SparseConfig::parse_spec(spec), c, 16);
    } catch (const Error&) {
      continue;
    }
    SCOPED_TRACE(spec);
    expect_error([&] { check_gpu_kv_dtype(true, sp); }, "fp8");
  }
}

TEST(CudaKvFp8, ModelRefusesUnportedMethods) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = fp8_config(Arch::Llama, 64);
  ModelWeights w = random_model(c, 5);
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_batch = 2;
  o.max_step_tokens = 64;
  o.kv_dtype = KvDtype::FP8;
  {  // the model's own method
    CudaModelOptions oq = o;
    oq.sparse = cuda_sparse_config(sparse::SparseConfig::parse_spec("quest"), c, 16);
    expect_error([&] { CudaModel m(w, oq); }, "quest");
  }
  // An unported method whose default spec configures on this model.
  std::string unported;
  CudaSparse usp;
  for (const char* name : {"streaming", "tidal", "quest", "lessismore"}) {
    try {
      usp = cuda_sparse_config(sparse::SparseConfig::parse_spec(name), c, 16);
      unported = name;
      break;
    } catch (const Error&) {
    }
  }
  ASSERT_FALSE(unported.empty());
  CudaModel m(w, o);  // full: accepted
  // Per-request methods: refused when added, by name.
  expect_error([&] { m.add_method(unported, usp); }, unported.c_str());
  EXPECT_NO_THROW(m.add_method("full", cuda_sparse_config(sparse::SparseConfig::parse_spec("full"), c, 16)));
  // The runner: --device cuda --kv-dtype fp8 builds; a request's unported method is refused.
  RunnerOptions ro;
  ro.device = "cuda";
  ro.kv_pages = 64;
  ro.max_batch = 2;
  ro.max_step_tokens = 64;
  ro.kv_dtype = KvDtype::FP8;
  Runner r = make_runner(w, ro);
  ASSERT_TRUE(r.check_method);
  expect_error([&] { r.check_method(sparse::SparseConfig::parse_spec(unported)); }, unported.c_str());
  EXPECT_NO_THROW(r.check_method(sparse::SparseConfig::parse_spec("full")));
  ro.sparse = sparse::SparseConfig::parse_spec(unported);
  expect_error([&] { make_runner(w, ro); }, unported.c_str());
}

}  // namespace
}  // namespace spade::test

// BLASST tile skipping in the v3 CUDA decode kernel vs the CPU reference cpu::blasst_rows.
//
// The kernel decides per warp and 16-token chunk from the warp's own running max (split-KV:
// every split starts afresh), seeded with the row maxima of the sequence's first and last
// chunk. The reference replays exactly that partition on the CPU: for each (sequence, KV
// head, split, warp) it runs cpu::blasst_rows over the warp's chunks in the warp's order
// (tile = 16, init_max = the seed), then merges the warps' outputs by their log-sum-exp.
// Decisions must then be identical, so the test asserts the per-KV-head tile and skip counts
// exactly and the outputs within kTolAttn. The scores are computed on both sides from the
// same bf16-rounded q and K (fp32 on the CPU, fp32-accumulated mma on the GPU), so a tile
// whose gap (max over rows of tile max - running max) lies within ~1e-5 of ln(lambda) could
// go either way: each lambda is placed in the widest hole of the sorted gaps near a target
// skip ratio (the gaps do not depend on lambda: a skipped tile never moves the running max).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/attention.h"
#include "backend/cpu/attention_blasst.h"
#include "backend/cuda/attention.h"
#include "gpu_util.h"

namespace spade::test {
namespace {

using cuda::bf16;
constexpr int kChunk = 16;  // tokens per warp chunk of the v3 kernel (its BLASST tile)

struct Case {
  int Hq, Hkv, D, P;
  std::vector<int> lens;  // kv_len per sequence (decode: q_len 1)
  float q_scale = 1.f;
  // Run the kernel in lambda = a / L mode (BlasstSkip::per_length) with ln a = ln lambda +
  // ln L: the same thresholds when every sequence has the same length L.
  bool per_length = false;
};

struct Fixture {
  Case c;
  KVLayout lay;
  KVPool kv;
  std::vector<PageTable> pts;
  std::vector<float> kh, vh, q;
  float scale;
  Fixture(const Case& cs, uint32_t seed)
      : c(cs), lay{1, cs.Hkv, cs.D, cs.P}, kv(lay, pages_for(cs) + 5), scale(1.f / std::sqrt(float(cs.D))) {
    std::mt19937 rng(seed);
    pts.resize(c.lens.size());
    for (size_t i = 0; i < c.lens.size(); ++i) kv.reserve(pts[i], c.lens[i]);
    std::vector<int32_t> all;
    for (auto& pt : pts) all.insert(all.end(), pt.pages.begin(), pt.pages.end());
    std::shuffle(all.begin(), all.end(), rng);
    size_t o = 0;
    for (auto& pt : pts)
      for (auto& p : pt.pages) p = all[o++];
    for (size_t i = 0; i < c.lens.size(); ++i) pts[i].length = c.lens[i];
    const size_t n = size_t(kv.n_pages()) * lay.page_floats();
    kh = round_bf16(randn(n, rng));
    vh = round_bf16(randn(n, rng));
    std::copy(kh.begin(), kh.end(), kv.k_page(0, 0));
    std::copy(vh.begin(), vh.end(), kv.v_page(0, 0));
    q = round_bf16(randn(c.lens.size() * size_t(c.Hq) * c.D, rng, c.q_scale));
  }
  static int64_t pages_for(const Case& cs) {
    int64_t n = 0;
    for (int L : cs.lens) n += (L + cs.P - 1) / cs.P;
    return n;
  }
};

// The partition of one (sequence, KV head): per (split, warp), the warp's chunk ids in order.
std::vector<std::vector<int>> warp_chunks(int L, int nsplit, int W) {
  const int n_ch = (L + kChunk - 1) / kChunk, per = (n_ch + nsplit - 1) / nsplit;
  std::vector<std::vector<int>> out;
  for (int sp = 0; sp < nsplit; ++sp) {
    const int cb = sp * per, ce = std::min(n_ch, cb + per);
    for (int w = 0; w < W; ++w) {
      std::vector<int> ch;
      for (int c = cb + w; c < ce; c += W) ch.push_back(c);
      if (!ch.empty()) out.push_back(std::move(ch));
    }
  }
  return out;
}

struct Reference {
  std::vector<float> out;                       // [B, Hq, D]
  std::vector<int64_t> tiles, skipped;          // per KV head
  std::vector<float> gaps;                      // every tile's gap (ln units)
};

// Replays the kernel's partition with cpu::blasst_rows (tile = 16 columns).
Reference reference(const Fixture& f, int nsplit, int W, float log_lambda) {
  const Case& c = f.c;
  const int G = c.Hq / c.Hkv, D = c.D;
  Reference r;
  r.out.assign(f.q.size(), 0.f);
  r.tiles.assign(c.Hkv, 0);
  r.skipped.assign(c.Hkv, 0);
  cpu::BlasstScratch sc;
  std::vector<uint8_t> flags;
  std::vector<float> gaps;
  cpu::BlasstTrace trace{&flags, &gaps};
  for (size_t b = 0; b < c.lens.size(); ++b) {
    const int L = c.lens[b];
    for (int h = 0; h < c.Hkv; ++h) {
      const float* qh = f.q.data() + (b * c.Hq + size_t(h) * G) * D;
      auto score = [&](int g, int j) {
        const float* k = f.kv.k_row(0, f.pts[b], j, h);
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot += qh[size_t(g) * D + d] * k[d];
        return dot * f.scale;
      };
      // The kernel seeds every warp's running max with the first and last chunk's row maxima.
      const int n_ch = (L + kChunk - 1) / kChunk;
      std::vector<float> seed(G, -INFINITY);
      for (int ch : {0, n_ch - 1})
        for (int j = ch * kChunk; j < std::min(L, (ch + 1) * kChunk); ++j)
          for (int g = 0; g < G; ++g) seed[g] = std::max(seed[g], score(g, j));
      std::vector<float> lse_max(G, -INFINITY);
      std::vector<std::vector<float>> outs;
      std::vector<std::vector<float>> lses;
      for (const auto& chunks : warp_chunks(L, nsplit, W)) {
        std::vector<int> cols;
        for (int ch : chunks)
          for (int j = ch * kChunk; j < std::min(L, (ch + 1) * kChunk); ++j) cols.push_back(j);
        const int64_t n = int64_t(cols.size());
        std::vector<float> S(size_t(G) * n), V(size_t(n) * D), O(size_t(G) * D);
        for (int64_t i = 0; i < n; ++i) {
          std::copy_n(f.kv.v_row(0, f.pts[b], cols[i], h), D, V.data() + i * D);
          for (int g = 0; g < G; ++g) S[size_t(g) * n + i] = score(g, cols[i]);
        }
        const std::vector<float> S0 = S;
        flags.clear();
        gaps.clear();
        cpu::BlasstParams p{log_lambda, kChunk, cpu::TileOrder::Sequential, seed.data()};
        cpu::VRowsFn vr = [&](int64_t s0, int64_t) { return V.data() + s0 * D; };
        const cpu::TileCounts tc =
            cpu::blasst_rows(S.data(), n, G, n, nullptr, D, p, vr, O.data(), D, sc, &trace);
        r.tiles[h] += tc.tiles;
        r.skipped[h] += tc.skipped;
        r.gaps.insert(r.gaps.end(), gaps.begin(), gaps.end());
        // Log-sum-exp of the kept tiles' scores per row (the warp's softmax denominator).
        std::vector<float> lse(G);
        for (int g = 0; g < G; ++g) {
          double mx = -INFINITY;
          for (size_t t = 0; t < flags.size(); ++t)
            if (!flags[t])
              for (int64_t i = int64_t(t) * kChunk; i < std::min<int64_t>(n, (t + 1) * kChunk); ++i)
                mx = std::max<double>(mx, S0[size_t(g) * n + i]);
          double sum = 0;
          for (size_t t = 0; t < flags.size(); ++t)
            if (!flags[t])
              for (int64_t i = int64_t(t) * kChunk; i < std::min<int64_t>(n, (t + 1) * kChunk); ++i)
                sum += std::exp(double(S0[size_t(g) * n + i]) - mx);
          lse[g] = float(mx + std::log(sum));
          lse_max[g] = std::max(lse_max[g], lse[g]);
        }
        outs.push_back(std::move(O));
        lses.push_back(std::move(lse));
      }
      for (int g = 0; g < G; ++g) {
        double den = 0;
        for (size_t w = 0; w < outs.size(); ++w) den += std::exp(double(lses[w][g] - lse_max[g]));
        float* dst = r.out.data() + (b * c.Hq + size_t(h) * G + g) * D;
        for (size_t w = 0; w < outs.size(); ++w) {
          const float wt = float(std::exp(double(lses[w][g] - lse_max[g])) / den);
          for (int d = 0; d < D; ++d) dst[d] += wt * outs[w][size_t(g) * D + d];
        }
      }
    }
  }
  return r;
}

// ln(lambda) in the widest hole between consecutive sorted negative gaps around quantile
// `target` of them (searched within +-10% of them). Tiles with gap 0 (a warp's first chunk,
// chunks that raise its running max) are never skipped by any lambda <= 1.
float robust_log_lambda(std::vector<float> gaps, double target) {
  gaps.erase(std::remove_if(gaps.begin(), gaps.end(), [](float g) { return !(g < -1e-3f); }),
             gaps.end());
  std::sort(gaps.begin(), gaps.end());
  const size_t n = gaps.size();
  if (n < 20) {
    ADD_FAILURE() << "only " << n << " tiles could be skipped";
    return -INFINITY;
  }
  const size_t c = std::min(n - 1, size_t(target * double(n)));
  const size_t lo = std::max<size_t>(1, c > n / 10 ? c - n / 10 : 1), hi = std::min(n - 1, c + n / 10);
  float best = -INFINITY, width = -1.f;
  for (size_t i = lo; i <= hi; ++i) {
    const float w = gaps[i] - gaps[i - 1];
    if (w > width) width = w, best = 0.5f * (gaps[i] + gaps[i - 1]);
  }
  if (!(width > 1e-3f)) {  // both sides >= 5e-4 from lambda: 50x the scores' fp32 error
    ADD_FAILURE() << "no clear threshold near quantile " << target << " (widest hole " << width << ")";
    return -INFINITY;
  }
  return best;
}

void run_case(const Case& c, int kernel, int force_split, const std::vector<double>& targets,
              uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
                                  << " P=" << c.P << " kernel=" << kernel << " split=" << force_split);
  Fixture f(c, seed);
  cuda::DeviceArena arena(256u << 20);
  cuda::AttnLimits lim;
  lim.max_batch = 16;
  lim.max_q_tokens = 256;
  lim.max_pages = 1 << 16;
  cuda::AttentionWorkspace ws(arena, lim, c.Hq, c.Hkv, c.D, c.P);
  DevBuf<bf16> dk(to_bf16(f.kh)), dv(to_bf16(f.vh)), dq(to_bf16(f.q)), dout(f.q.size());
  DevBuf<unsigned long long> counts(size_t(2 * c.Hkv));
  std::vector<cuda::AttnSeq> batch;
  for (size_t i = 0; i < c.lens.size(); ++i)
    batch.push_back({f.pts[i].pages.data(), int(f.pts[i].pages.size()), c.lens[i], 1});
  ws.set_decode_kernel(kernel);
  ws.plan(batch, 0, force_split);
  const int W = ws.decode_warps(), ns = ws.n_split();
  ASSERT_GT(W, 0);
  SCOPED_TRACE(testing::Message() << "warps=" << W << " splits=" << ns);
  const Reference probe = reference(f, ns, W, -INFINITY);
  // Dense reference: lambda -> 0 must give full attention (and skip nothing).
  std::vector<float> dense(f.q.size());
  {
    cpu::AttentionScratch scr;
    for (size_t b = 0; b < c.lens.size(); ++b)
      cpu::attention_dense(f.kv, 0, f.pts[b], f.q.data() + b * c.Hq * c.D, c.lens[b] - 1, 1, c.Hq,
                           f.scale, dense.data() + b * c.Hq * c.D, scr);
  }
  EXPECT_LT(rel_err(probe.out, dense), 1e-5) << "the warp-partition replay itself";
  std::vector<float> lambdas = {-80.f};
  for (double t : targets)
    if (const float ll = robust_log_lambda(probe.gaps, t); ll > -INFINITY) lambdas.push_back(ll);
  for (float ll : lambdas) {
    SCOPED_TRACE(testing::Message() << "ln lambda=" << ll);
    const Reference ref = ll == -80.f ? probe : reference(f, ns, W, ll);
    for (int rep = 0; rep < 2; ++rep) {
      SPADE_CUDA(cudaMemset(counts.p, 0, sizeof(unsigned long long) * counts.n));
      dout.poison();
      cuda::BlasstSkip skip{ll, counts.p};
      if (c.per_length) skip = {ll + std::log(float(c.lens[0])), counts.p, true};
      ws.run(dq.p, dk.p, dv.p, dout.p, f.scale, 0, skip);
      const auto got = from_bf16(dout.download());
      const auto cnt = counts.download();
      int64_t tiles = 0, skipped = 0;
      for (int h = 0; h < c.Hkv; ++h) {
        EXPECT_EQ(int64_t(cnt[2 * h]), ref.tiles[h]) << "tiles of KV head " << h;
        EXPECT_EQ(int64_t(cnt[2 * h + 1]), ref.skipped[h]) << "skipped tiles of KV head " << h;
        tiles += ref.tiles[h], skipped += ref.skipped[h];
      }
      EXPECT_LT(rel_err(got, ref.out), kTolAttn) << "rep " << rep;
      for (size_t b = 0; b < c.lens.size(); ++b) {
        const size_t n = size_t(c.Hq) * c.D;
        EXPECT_LT(rel_err(got.data() + b * n, ref.out.data() + b * n, n), kTolAttn)
            << "sequence " << b << " (kv " << c.lens[b] << ")";
      }
      if (ll == -80.f) {
        EXPECT_EQ(skipped, 0);
        EXPECT_LT(rel_err(got, dense), kTolAttn);
      }
      if (rep == 0)
        std::printf("  [blasst decode] Hq=%d Hkv=%d P=%d kernel=%d W=%d splits=%d ln_lambda=%.3f: "
                    "%lld/%lld tiles skipped (%.1f%%)\n",
                    c.Hq, c.Hkv, c.P, kernel, W, ns, ll, (long long)skipped, (long long)tiles,
                    100.0 * double(skipped) / double(std::max<int64_t>(tiles, 1)));
    }
  }
}

TEST(CudaBlasstDecode, LlamaShapeEveryVariantAndSplits) {
  SKIP_WITHOUT_GPU();
  const Case c{32, 8, 128, 16, {1, 17, 300, 1000, 4097, 9000}};
  for (int kern = 1; kern < cuda::AttentionWorkspace::decode_kernel_count(); ++kern)
    if (cuda::AttentionWorkspace::decode_kernel_fits(kern, 128))
      run_case(c, kern, 0, {0.3, 0.8}, 11);
  // Forced splits: every split has its own running maxima (the 4-warp 3-stage ring, or the
  // 2-stage one where 101 KB of shared memory per block is too much).
  run_case(c, cuda::AttentionWorkspace::decode_kernel_fits(2, 128) ? 2 : 6, 7, {0.5}, 12);
}

TEST(CudaBlasstDecode, OddPagesMhaAndHeadDim64) {
  SKIP_WITHOUT_GPU();
  run_case({4, 4, 128, 7, {33, 2000, 5001}}, 1, 2, {0.5}, 21);    // chunks straddle pages
  run_case({8, 2, 64, 16, {40, 3000}}, 1, 3, {0.7}, 22);          // D = 64
  run_case({16, 1, 128, 32, {18, 6000}}, 1, 1, {0.4, 0.9}, 23);  // G = 16: rows 8..15 vote
}

TEST(CudaBlasstDecode, PeakedScoresSkipMost) {
  SKIP_WITHOUT_GPU();
  // q x 4: a few keys dominate, so most tiles fall far below the running max.
  run_case({32, 8, 128, 16, {8192, 12000}, 4.f},
           cuda::AttentionWorkspace::decode_kernel_fits(2, 128) ? 2 : 6, 1, {0.9}, 31);
}

TEST(CudaBlasstDecode, LambdaOverLength) {
  SKIP_WITHOUT_GPU();
  Case c{32, 8, 128, 16, {3000, 3000, 3000}};
  c.per_length = true;
  run_case(c, 1, 0, {0.5}, 51);
}

TEST(CudaBlasstDecode, RejectsKernelsWithoutSkipping) {
  SKIP_WITHOUT_GPU();
  Fixture f({32, 8, 128, 16, {100}}, 41);
  cuda::DeviceArena arena(64u << 20);
  cuda::AttnLimits lim;
  lim.max_batch = 4;
  lim.max_q_tokens = 64;
  lim.max_pages = 1024;
  cuda::AttentionWorkspace ws(arena, lim, 32, 8, 128, 16);
  DevBuf<bf16> dk(to_bf16(f.kh)), dv(to_bf16(f.vh)), dq(to_bf16(f.q)), dout(f.q.size());
  std::vector<cuda::AttnSeq> batch = {{f.pts[0].pages.data(), int(f.pts[0].pages.size()), 100, 1}};
  if (cuda::AttentionWorkspace::decode_kernel_fits(0, 128)) {  // v2 (not on sm_86 / 89)
    ws.set_decode_kernel(0);
    ws.plan(batch, 0);
    EXPECT_THROW(ws.run(dq.p, dk.p, dv.p, dout.p, f.scale, 0, cuda::BlasstSkip{-1.f}), Error);
  } else {
    EXPECT_THROW(ws.set_decode_kernel(0), Error);
  }
  ws.set_decode_kernel(1);
  ws.plan(batch, 0);
  EXPECT_THROW(ws.run(dq.p, dk.p, dv.p, dout.p, f.scale, 0, cuda::BlasstSkip{0.5f}), Error);
}

}  // namespace
}  // namespace spade::test

// BLASST tile skipping in the prefill kernels (the wgmma kernel, attention_prefill.cu, and the
// generic mma.sync kernel, attention.cu, which runs head_dim 64: SKIP instantiations) vs a CPU
// emulation: cpu::blasst_rows run on exactly the kernel's decision blocks, i.e. per sequence, KV
// head and work item of 128 packed rows (row p -> token p / G, head kvh*G + p % G), each
// consumer warpgroup's 64 rows (generic kernel: each warp's 32 rows; those < q_len * G), key
// tiles of 128 (generic: 64 at D = 64, 32 at D = 128) visited 0, 1, 2, ...,
// per-row causal limits kv_len - q_len + token + 1, scores scale * q.k in fp32 from the same
// bf16-rounded q/k the GPU reads. The GPU's per-KV-head counters (tiles seen, skipped) must equal
// the emulation's sums exactly, and outputs agree within kTolAttn (bf16 P in P.V, bf16 output).
// Exact agreement of the skip decisions needs inputs whose decisions are far from the threshold:
// "planted" keys (score = level, a multiple of 20 nats, on a direction the random keys do not
// have) above random scores of std ~0.3 (|s| < 2), with ln(lambda) = -10: every tile's gap is
// either >= -3.5 (kept) or <= -18 (skipped), so fp32 summation order cannot flip a decision.
// Also: ln(lambda) = -inf (dense kernel, counters untouched) and -80 (SKIP kernel, nothing
// skipped, output bit-identical to dense), GQA G = 4 / 8 with cached prefixes, page sizes
// 16 / 32 / 5, both ring depths, head_dim 64 and 128 on the generic kernel, and the benchmark's
// "tile levels" data near the threshold.
#include <algorithm>
#include <numeric>

#include "backend/cpu/attention.h"
#include "backend/cpu/attention_blasst.h"
#include "backend/cuda/attention.h"
#include "gpu_util.h"

namespace spade::test {
namespace {

using cuda::bf16;

struct Seq {
  int kv_len, q_len;
};

// Host copy of one batch: paged cache (bf16-rounded floats), q [T, Hq, D].
struct Batch {
  int Hq, Hkv, D, P;
  std::vector<Seq> seqs;
  KVLayout lay;
  KVPool kv;
  std::vector<PageTable> pts;
  std::vector<float> kh, vh, q;
  int64_t total_q = 0;
  Batch(int hq, int hkv, int d, int p, std::vector<Seq> s, int64_t pages)
      : Hq(hq), Hkv(hkv), D(d), P(p), seqs(std::move(s)), lay{1, hkv, d, p}, kv(lay, pages) {}
};

// mode 2 ("tile levels", the benchmark's data): q = (8, N(0,1) ...), k = (c / (8 * scale),
// N(0,1) ...) with one level c ~ U[0, 16) per (sequence, KV head, 128-key tile): decisions spread
// over the threshold range (not planted far from it).
// mode 0: random q (std q_std), k, v ~ N(0, 1). mode 1: planted keys (see the file comment):
// q = (8, noise 0.3 ...), random keys k = (0, N(0,1) ...), planted key j = (beta_j, 0, ...)
// with score 8 * beta_j * scale = level_j. Planted: every ~`gap` positions, levels cycle through
// an up-and-down pattern so later tiles hold both new maxima (kept) and stale lower ones
// (skipped). v ~ N(0, 1) everywhere.
std::unique_ptr<Batch> make_batch(int Hq, int Hkv, int P, const std::vector<Seq>& seqs,
                                  uint32_t seed, int mode, float q_std = 1.f, int D = 128) {
  std::mt19937 rng(seed);
  int64_t pages = 0;
  for (auto& s : seqs) pages += (s.kv_len + P - 1) / P;
  auto b = std::make_unique<Batch>(Hq, Hkv, D, P, seqs, pages + 3);
  b->pts.resize(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) b->kv.reserve(b->pts[i], seqs[i].kv_len);
  std::vector<int32_t> all;
  for (auto& pt : b->pts) all.insert(all.end(), pt.pages.begin(), pt.pages.end());
  std::shuffle(all.begin(), all.end(), rng);
  size_t o = 0;
  for (auto& pt : b->pts)
    for (auto& p : pt.pages) p = all[o++];
  for (size_t i = 0; i < seqs.size(); ++i) b->pts[i].length = seqs[i].kv_len;
  const size_t cache_n = size_t(b->kv.n_pages()) * b->lay.page_floats();
  b->kh = round_bf16(randn(cache_n, rng, 1.f));
  b->vh = round_bf16(randn(cache_n, rng, 1.f));
  for (auto& s : seqs) b->total_q += s.q_len;
  b->q = round_bf16(randn(size_t(b->total_q) * Hq * D, rng, mode == 1 ? 0.3f : q_std));
  if (mode == 1) {
    const float scale = 1.f / std::sqrt(float(D));
    for (size_t r = 0; r < b->q.size(); r += D) b->q[r] = 8.f;
    const int levels[] = {20, 60, 40, 100, 80, 140, 120, 180, 160, 220};
    for (size_t i = 0; i < seqs.size(); ++i) {
      const auto& pt = b->pts[i];
      auto k_at = [&](int64_t pos, int h) {
        const int64_t off = (int64_t(pt.pages[pos / P]) * Hkv + h) * P * D + (pos % P) * D;
        return b->kh.data() + off;
      };
      for (int64_t pos = 0; pos < seqs[i].kv_len; ++pos)
        for (int h = 0; h < Hkv; ++h) k_at(pos, h)[0] = 0.f;
      // Planted positions: 150 + 230 * i (+ a per-head shift), level from the cycle.
      for (int h = 0; h < Hkv; ++h) {
        int n = 0;
        for (int64_t pos = 150 + 37 * h; pos < seqs[i].kv_len; pos += 230, ++n) {
          float* k = k_at(pos, h);
          std::fill(k, k + D, 0.f);
          k[0] = round_bf16(float(levels[n % 10] + 240 * (n / 10)) / (8.f * scale));
        }
      }
    }
  }
  if (mode == 2) {
    const float scale = 1.f / std::sqrt(float(D));
    for (size_t r = 0; r < b->q.size(); r += D) b->q[r] = 8.f;
    std::uniform_real_distribution<float> U(0.f, 16.f);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const auto& pt = b->pts[i];
      for (int h = 0; h < Hkv; ++h)
        for (int64_t t0 = 0; t0 < seqs[i].kv_len; t0 += 128) {
          const float c = round_bf16(U(rng) / (8.f * scale));
          for (int64_t pos = t0; pos < std::min<int64_t>(t0 + 128, seqs[i].kv_len); ++pos)
            b->kh[(int64_t(pt.pages[pos / P]) * Hkv + h) * P * D + (pos % P) * D] = c;
        }
    }
  }
  std::copy(b->kh.begin(), b->kh.end(), b->kv.k_page(0, 0));
  std::copy(b->vh.begin(), b->vh.end(), b->kv.v_page(0, 0));
  return b;
}

struct Emulated {
  std::vector<float> out;                  // [T, Hq, D]
  std::vector<cpu::TileCounts> per_head;   // [Hkv]
};

// A prefill kernel and its decision blocks: kern = AttentionWorkspace::set_prefill_kernel's
// value (0: generic, 1 / 2: wgmma with 2 / 3 stages), rows per block, keys per tile.
struct Shape {
  int kern, rows, tile;
};
// The kernels that run this head dim here (the wgmma ones need sm_90a).
std::vector<Shape> shapes_for(int D, bool wgmma) {
  std::vector<Shape> v;
  if (D == 128 && wgmma) v.push_back({1, 64, 128}), v.push_back({2, 64, 128});
  v.push_back({0, 32, D == 128 ? 32 : 64});
  return v;
}

// The kernel's decision blocks through cpu::blasst_rows (see the file comment).
Emulated emulate(const Batch& b, float log_lambda, int block_rows = 64, int tile = 128) {
  const int D = b.D, G = b.Hq / b.Hkv;
  const float scale = 1.f / std::sqrt(float(D));
  Emulated e;
  e.out.assign(b.q.size(), 0.f);
  e.per_head.assign(b.Hkv, {});
  cpu::BlasstScratch sc;
  std::vector<float> K, V, S, O;
  std::vector<int64_t> lim;
  int64_t q0 = 0;
  for (const auto& s : b.seqs) {
    const int64_t L = s.kv_len, Tq = s.q_len, n_rows = Tq * G;
    const auto& pt = b.pts[&s - b.seqs.data()];
    K.resize(size_t(L) * D);
    V.resize(size_t(L) * D);
    for (int h = 0; h < b.Hkv; ++h) {
      cpu::gather_kv_prefix(b.kv, 0, pt, h, L, K.data(), V.data());
      for (int64_t r0 = 0; r0 < n_rows; r0 += block_rows) {  // blocks tile the 128-row items
        const int64_t M = std::min<int64_t>(block_rows, n_rows - r0);
        lim.resize(size_t(M));
        for (int64_t r = 0; r < M; ++r) lim[r] = L - Tq + (r0 + r) / G + 1;
        const int64_t n = lim[M - 1];
        S.assign(size_t(M * n), 0.f);
        O.assign(size_t(M * D), 0.f);
        for (int64_t r = 0; r < M; ++r) {
          const int64_t p = r0 + r;
          const float* qr = b.q.data() + ((q0 + p / G) * b.Hq + h * G + p % G) * D;
          for (int64_t j = 0; j < n; ++j) {
            const float* kr = K.data() + j * D;
            float acc[8] = {};
            for (int d = 0; d < D; d += 8)
              for (int u = 0; u < 8; ++u) acc[u] += qr[d + u] * kr[d + u];
            S[r * n + j] = scale * (((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                                    ((acc[4] + acc[5]) + (acc[6] + acc[7])));
          }
        }
        cpu::BlasstParams prm{log_lambda, tile, cpu::TileOrder::Sequential};
        cpu::VRowsFn v_rows = [&](int64_t st, int64_t) -> const float* { return V.data() + st * D; };
        e.per_head[h] += cpu::blasst_rows(S.data(), n, M, n, lim.data(), D, prm, v_rows, O.data(), D, sc);
        for (int64_t r = 0; r < M; ++r) {
          const int64_t p = r0 + r;
          std::copy(O.begin() + r * D, O.begin() + (r + 1) * D,
                    e.out.begin() + ((q0 + p / G) * b.Hq + h * G + p % G) * D);
        }
      }
    }
    q0 += Tq;
  }
  return e;
}

std::vector<float> dense_ref(const Batch& b) {
  std::vector<float> ref(b.q.size());
  cpu::AttentionScratch scratch;
  int64_t r = 0;
  const float scale = 1.f / std::sqrt(float(b.D));
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    cpu::attention_dense(b.kv, 0, b.pts[i], b.q.data() + r * b.Hq * b.D, b.seqs[i].kv_len - b.seqs[i].q_len,
                         b.seqs[i].q_len, b.Hq, scale, ref.data() + r * b.Hq * b.D, scratch);
    r += b.seqs[i].q_len;
  }
  return ref;
}

struct Gpu {
  cuda::DeviceArena arena{256u << 20};
  std::unique_ptr<cuda::AttentionWorkspace> ws;
  std::unique_ptr<DevBuf<bf16>> dk, dv, dq, dout;
  DevBuf<unsigned long long> counts;
  std::vector<cuda::AttnSeq> batch;
  const Batch& b;
  explicit Gpu(const Batch& bb) : counts(size_t(2 * bb.Hkv)), b(bb) {
    cuda::AttnLimits lim;
    lim.max_batch = 64;
    lim.max_q_tokens = 8192;
    lim.max_pages = 1 << 16;
    ws = std::make_unique<cuda::AttentionWorkspace>(arena, lim, b.Hq, b.Hkv, b.D, b.P);
    dk = std::make_unique<DevBuf<bf16>>(to_bf16(b.kh));
    dv = std::make_unique<DevBuf<bf16>>(to_bf16(b.vh));
    dq = std::make_unique<DevBuf<bf16>>(to_bf16(b.q));
    dout = std::make_unique<DevBuf<bf16>>(b.q.size());
    for (size_t i = 0; i < b.seqs.size(); ++i)
      batch.push_back({b.pts[i].pages.data(), int(b.pts[i].pages.size()), b.seqs[i].kv_len, b.seqs[i].q_len});
  }
  // Runs prefill kernel `kern` (0: generic, 1: wgmma 2-stage, 2: 3-stage); returns the output,
  // fills cnt.
  std::vector<float> run(int kern, const cuda::BlasstSkip& skip, std::vector<unsigned long long>* cnt) {
    ws->set_prefill_kernel(kern);
    ws->plan(batch, 0);
    SPADE_CUDA(cudaMemset(counts.p, 0, sizeof(unsigned long long) * counts.n));
    dout->poison();
    cuda::BlasstSkip sk = skip;
    sk.counts = counts.p;
    ws->run(dq->p, dk->p, dv->p, dout->p, 1.f / std::sqrt(float(b.D)), 0, sk);
    auto got = from_bf16(dout->download());
    if (cnt) *cnt = counts.download();
    return got;
  }
};

void expect_close_per_seq(const Batch& b, const std::vector<float>& got, const std::vector<float>& ref,
                          double tol, const char* what) {
  EXPECT_LT(rel_err(got, ref), tol) << what;
  int64_t r = 0;
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    const size_t n = size_t(b.seqs[i].q_len) * b.Hq * b.D;
    EXPECT_LT(rel_err(got.data() + r * b.Hq * b.D, ref.data() + r * b.Hq * b.D, n), tol)
        << what << ": sequence " << i << " kv=" << b.seqs[i].kv_len << " q=" << b.seqs[i].q_len;
    r += b.seqs[i].q_len;
  }
}

// Skip run vs the emulation of each kernel's blocks: exact counters per KV head, outputs
// within kTolAttn.
void check_skip(const Batch& b, float log_lambda, double min_sparsity, double max_sparsity) {
  SCOPED_TRACE(testing::Message() << "Hq=" << b.Hq << " Hkv=" << b.Hkv << " D=" << b.D << " P=" << b.P
                                  << " ln_lambda=" << log_lambda);
  Gpu g(b);
  g.ws->set_prefill_kernel(1);
  for (const Shape& sh : shapes_for(b.D, g.ws->prefill_wgmma_active())) {
    SCOPED_TRACE(testing::Message() << "prefill kernel " << sh.kern << " (" << sh.rows << " rows x "
                                    << sh.tile << " keys)");
    const Emulated e = emulate(b, log_lambda, sh.rows, sh.tile);
    int64_t tiles = 0, skipped = 0;
    for (auto& c : e.per_head) tiles += c.tiles, skipped += c.skipped;
    const double sp = tiles ? double(skipped) / double(tiles) : 0.0;
    std::printf("  kernel %d, emulated: %lld tiles, %lld skipped (%.1f%%)\n", sh.kern, (long long)tiles,
                (long long)skipped, 100 * sp);
    // The inputs must exercise both paths as intended.
    EXPECT_GE(sp, min_sparsity);
    EXPECT_LE(sp, max_sparsity);
    for (int rep = 0; rep < 2; ++rep) {
      std::vector<unsigned long long> cnt;
      auto got = g.run(sh.kern, {log_lambda, nullptr}, &cnt);
      for (int h = 0; h < b.Hkv; ++h) {
        EXPECT_EQ(cnt[2 * h], uint64_t(e.per_head[h].tiles)) << "tiles, KV head " << h;
        EXPECT_EQ(cnt[2 * h + 1], uint64_t(e.per_head[h].skipped)) << "skipped, KV head " << h;
      }
      expect_close_per_seq(b, got, e.out, kTolAttn, "skip vs emulation");
    }
  }
}

// (a) ln(lambda) = -inf runs the dense kernel (counters untouched, output vs CPU dense);
// ln(lambda) = -80 runs the SKIP instantiation, skips nothing, counts every visible tile and
// gives the dense kernel's output bit for bit (same arithmetic on every kept tile).
void check_off_and_tiny(const Batch& b) {
  SCOPED_TRACE(testing::Message() << "Hq=" << b.Hq << " Hkv=" << b.Hkv << " D=" << b.D << " P=" << b.P);
  const auto ref = dense_ref(b);
  Gpu g(b);
  g.ws->set_prefill_kernel(1);
  for (const Shape& sh : shapes_for(b.D, g.ws->prefill_wgmma_active())) {
    SCOPED_TRACE(testing::Message() << "prefill kernel " << sh.kern);
    const Emulated e = emulate(b, -80.f, sh.rows, sh.tile);
    std::vector<unsigned long long> c0, c1;
    auto dense = g.run(sh.kern, {}, &c0);
    for (auto c : c0) EXPECT_EQ(c, 0ull) << "dense kernel touched the counters";
    expect_close_per_seq(b, dense, ref, kTolAttn, "dense vs CPU");
    auto tiny = g.run(sh.kern, {-80.f, nullptr}, &c1);
    for (int h = 0; h < b.Hkv; ++h) {
      EXPECT_EQ(e.per_head[h].skipped, 0);
      EXPECT_EQ(c1[2 * h], uint64_t(e.per_head[h].tiles)) << "tiles, KV head " << h;
      EXPECT_EQ(c1[2 * h + 1], 0ull) << "skipped, KV head " << h;
    }
    EXPECT_EQ(0, std::memcmp(tiny.data(), dense.data(), sizeof(float) * dense.size()))
        << "ln lambda = -80 output differs from the dense kernel's";
    expect_close_per_seq(b, tiny, ref, kTolAttn, "tiny lambda vs CPU");
  }
}

TEST(CudaBlasstPrefill, OffAndTinyLambdaEqualDense) {
  SKIP_WITHOUT_GPU();
  auto b = make_batch(4, 4, 16, {{700, 700}, {129, 129}, {1000, 300}, {5, 5}}, 101, 0);
  check_off_and_tiny(*b);
  auto g = make_batch(32, 8, 16, {{600, 200}, {77, 77}}, 102, 0);  // G = 4
  check_off_and_tiny(*g);
  auto s = make_batch(9, 3, 16, {{700, 700}, {300, 41}, {5, 5}}, 103, 0, 1.f, 64);  // SmolLM2's G = 3, D = 64
  check_off_and_tiny(*s);
}

// (b) G = 1 (Hq = Hkv): fresh prompts of odd lengths, page 16 (fast loads) and 5 (per-row).
TEST(CudaBlasstPrefill, PlantedKeysMatchEmulationMHA) {
  SKIP_WITHOUT_GPU();
  auto b = make_batch(2, 2, 16, {{1500, 1500}, {700, 700}, {129, 129}, {64, 64}}, 201, 1);
  check_skip(*b, -10.f, 0.2, 0.95);
  auto c = make_batch(3, 3, 5, {{900, 900}, {333, 333}}, 202, 1);
  check_skip(*c, -10.f, 0.2, 0.95);
}

// (c) GQA G = 4 and 8 with cached prefixes (chunked prefill) and a decode row in the batch.
TEST(CudaBlasstPrefill, PlantedKeysMatchEmulationGqaChunked) {
  SKIP_WITHOUT_GPU();
  auto b = make_batch(8, 2, 16, {{1200, 400}, {900, 900}, {333, 1}, {260, 17}}, 301, 1);
  check_skip(*b, -10.f, 0.2, 0.95);
  auto c = make_batch(16, 2, 32, {{1000, 300}, {600, 600}}, 302, 1);  // G = 8, page 32
  check_skip(*c, -10.f, 0.2, 0.95);
}

// (d) head_dim 64 (the generic kernel; SmolLM2's shape G = 3), MHA and GQA with a cached
// prefix and a decode row; page 16 and 5.
TEST(CudaBlasstPrefill, PlantedKeysMatchEmulationHeadDim64) {
  SKIP_WITHOUT_GPU();
  auto b = make_batch(9, 3, 16, {{1500, 1500}, {900, 300}, {333, 1}, {64, 64}}, 501, 1, 1.f, 64);
  check_skip(*b, -10.f, 0.2, 0.95);
  auto c = make_batch(2, 2, 5, {{900, 900}, {333, 333}}, 502, 1, 1.f, 64);
  check_skip(*c, -10.f, 0.2, 0.95);
}

// Tile levels (mode 2), ln lambda = -4: decisions are not planted away from the threshold, so
// a tile whose gap lies within fp32 rounding of it may flip; the skip count must agree with the
// emulation within 2% of the tiles (in practice exactly), and the outputs within kTolAttn.
TEST(CudaBlasstPrefill, TileLevelsNearEmulation) {
  SKIP_WITHOUT_GPU();
  auto b = make_batch(8, 2, 16, {{1536, 1536}, {700, 300}}, 401, 2);
  const Emulated e0 = emulate(*b, -80.f);
  Gpu g(*b);
  if (!g.ws->prefill_wgmma_active()) GTEST_SKIP() << "wgmma prefill not available on this device";
  std::vector<unsigned long long> cnt;
  auto got = g.run(1, {-4.f, nullptr}, &cnt);
  const Emulated e = emulate(*b, -4.f);
  for (int h = 0; h < b->Hkv; ++h) {
    EXPECT_EQ(cnt[2 * h], uint64_t(e0.per_head[h].tiles));
    EXPECT_GT(cnt[2 * h + 1], 0ull);
    // Decisions near the threshold may flip with fp32 rounding: within 2% of the tiles.
    EXPECT_NEAR(double(cnt[2 * h + 1]), double(e.per_head[h].skipped), 0.02 * double(e0.per_head[h].tiles));
  }
  expect_close_per_seq(*b, got, e.out, kTolAttn, "skip vs emulation");
  std::printf("  tile levels, ln lambda -4: GPU skipped %llu + %llu of %llu + %llu tiles\n",
              cnt[1], cnt[3], cnt[0], cnt[2]);
}

}  // namespace
}  // namespace spade::test

// CUDA paged attention (decode split-KV and chunked causal prefill) vs the CPU reference
// cpu::attention_dense over the same pages: odd lengths, page boundaries, mixed batches,
// shuffled page ids, forced split counts. K/V/Q are bf16-rounded on both sides. Every case
// runs each decode kernel (v2, auto, every v3 variant) or each prefill kernel (wgmma 2- and
// 3-stage, mma.sync) on the same inputs, twice (the split counters must be back at 0).
#include <algorithm>
#include <numeric>
#include <string>

#include "backend/cpu/attention.h"
#include "backend/cuda/attention.h"
#include "gpu_util.h"

namespace spade::test {
namespace {

using cuda::bf16;

struct Seq {
  int kv_len, q_len;
};

void run_case(int Hq, int Hkv, int D, int P, const std::vector<Seq>& seqs, int force_split,
              uint32_t seed, float q_scale = 1.f) {
  SCOPED_TRACE(testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " P=" << P
                                  << " split=" << force_split << " q_scale=" << q_scale);
  std::mt19937 rng(seed);
  int64_t pages_needed = 0, total_q = 0;
  for (auto& s : seqs) pages_needed += (s.kv_len + P - 1) / P, total_q += s.q_len;
  KVLayout lay{1, Hkv, D, P};
  KVPool kv(lay, pages_needed + 5);
  std::vector<PageTable> pts(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) kv.reserve(pts[i], seqs[i].kv_len);
  // Shuffle page ownership across sequences (a real pool is fragmented).
  std::vector<int32_t> all;
  for (auto& pt : pts) all.insert(all.end(), pt.pages.begin(), pt.pages.end());
  std::shuffle(all.begin(), all.end(), rng);
  size_t o = 0;
  for (auto& pt : pts)
    for (auto& p : pt.pages) p = all[o++];
  for (size_t i = 0; i < seqs.size(); ++i) pts[i].length = seqs[i].kv_len;
  // Random bf16-valued cache (whole pool, so stale garbage is also finite).
  const size_t cache_n = size_t(kv.n_pages()) * lay.page_floats();
  auto kh = round_bf16(randn(cache_n, rng, 1.0f)), vh = round_bf16(randn(cache_n, rng));
  std::copy(kh.begin(), kh.end(), kv.k_page(0, 0));
  std::copy(vh.begin(), vh.end(), kv.v_page(0, 0));
  auto q = round_bf16(randn(size_t(total_q) * Hq * D, rng, q_scale));
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
  cuda::DeviceArena arena(256u << 20);
  cuda::AttnLimits lim;
  lim.max_batch = 64;
  lim.max_q_tokens = 4096;
  lim.max_pages = 1 << 16;
  cuda::AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  DevBuf<bf16> dk(to_bf16(kh)), dv(to_bf16(vh)), dq(to_bf16(q)), dout(q.size());
  std::vector<cuda::AttnSeq> batch;
  bool all_decode = true;
  for (size_t i = 0; i < seqs.size(); ++i) {
    batch.push_back({pts[i].pages.data(), int(pts[i].pages.size()), seqs[i].kv_len, seqs[i].q_len});
    all_decode = all_decode && seqs[i].q_len == 1;
  }
  const int n_kernels = all_decode ? cuda::AttentionWorkspace::decode_kernel_count() : 3;
  for (int kern = 0; kern < n_kernels; ++kern) {
    if (all_decode && !cuda::AttentionWorkspace::decode_kernel_fits(kern, D)) continue;  // sm_86 / 89
    if (all_decode) ws.set_decode_kernel(kern);
    else ws.set_prefill_kernel(kern);
    ws.plan(batch, 0, force_split);
    const char* name = all_decode ? cuda::AttentionWorkspace::decode_kernel_name(kern)
                                  : (kern >= 1 && ws.prefill_wgmma_active()
                                         ? (kern == 2 ? "prefill wgmma 3-stage" : "prefill wgmma 2-stage")
                                         : "prefill mma.sync");
    SCOPED_TRACE(testing::Message() << "kernel " << name << " variant " << ws.decode_variant()
                                    << " splits=" << ws.n_split());
    for (int rep = 0; rep < 2; ++rep) {
      dout.poison();
      ws.run(dq.p, dk.p, dv.p, dout.p, scale, 0);
      auto got = from_bf16(dout.download());
      EXPECT_LT(rel_err(got, ref), kTolAttn) << "decode=" << ws.decode() << " rep=" << rep;
      // Per-sequence check too (a wrong short sequence hides in the norm of a long one).
      r = 0;
      for (size_t i = 0; i < seqs.size(); ++i) {
        const size_t n = size_t(seqs[i].q_len) * Hq * D;
        EXPECT_LT(rel_err(got.data() + r * Hq * D, ref.data() + r * Hq * D, n), kTolAttn)
            << "sequence " << i << " kv=" << seqs[i].kv_len << " q=" << seqs[i].q_len << " rep=" << rep;
        r += seqs[i].q_len;
      }
    }
  }
}

TEST(CudaAttention, DecodeMixedLengthsLlamaShape) {
  SKIP_WITHOUT_GPU();
  std::vector<Seq> s = {{1, 1}, {15, 1}, {16, 1}, {17, 1}, {100, 1}, {1000, 1}, {4097, 1}};
  for (int split : {0, 1, 5}) run_case(32, 8, 128, 16, s, split, 11);
}

TEST(CudaAttention, DecodeSmolLMShapeOddPage) {
  SKIP_WITHOUT_GPU();
  std::vector<Seq> s = {{3, 1}, {64, 1}, {65, 1}, {777, 1}};
  run_case(9, 3, 64, 16, s, 0, 12);
  run_case(9, 3, 64, 7, s, 3, 13);
}

TEST(CudaAttention, DecodeLongContext) {
  SKIP_WITHOUT_GPU();
  run_case(32, 8, 128, 16, {{40000, 1}, {33, 1}}, 0, 14);
}

TEST(CudaAttention, DecodeGroupOfEightAndOne) {
  SKIP_WITHOUT_GPU();
  run_case(64, 8, 128, 16, {{500, 1}, {2049, 1}}, 0, 15);  // G = 8
  run_case(8, 8, 64, 16, {{500, 1}, {31, 1}}, 0, 16);      // MHA, G = 1
}

TEST(CudaAttention, PrefillCausalChunkedMixed) {
  SKIP_WITHOUT_GPU();
  // Fresh prompts, chunks after a cached prefix, and a decode row in the same batch.
  std::vector<Seq> s = {{37, 37}, {300, 100}, {1000, 1}, {129, 64}, {16, 16}, {700, 333}};
  run_case(32, 8, 128, 16, s, 0, 21);
  run_case(9, 3, 64, 16, s, 0, 22);
  run_case(12, 4, 64, 5, {{250, 250}, {97, 3}}, 0, 23);
}

TEST(CudaAttention, PrefillLong) {
  SKIP_WITHOUT_GPU();
  run_case(32, 8, 128, 16, {{3000, 2048}}, 0, 24);
}

// Pages of 32 rows: the wgmma kernels' TMA boxes (16 rows) start mid-page; keys ending inside
// a tile (the partial last V tile goes by zero-filling cp.async) and a cached prefix.
TEST(CudaAttention, PrefillPage32) {
  SKIP_WITHOUT_GPU();
  run_case(32, 8, 128, 32, {{700, 333}, {300, 300}, {129, 64}, {1000, 1}}, 0, 26);
}

// v3 decode: page size 32 (a 16-token chunk starts mid-page), G = 16 (rows 8..15 live), many
// forced splits with empty ones (short sequences next to a long one), MHA with odd page.
TEST(CudaAttention, DecodeV3PagesGroupsSplits) {
  SKIP_WITHOUT_GPU();
  run_case(32, 8, 128, 32, {{1, 1}, {31, 1}, {32, 1}, {33, 1}, {3001, 1}}, 0, 31);
  run_case(64, 4, 128, 16, {{17, 1}, {1500, 1}, {257, 1}}, 0, 32);   // G = 16
  run_case(32, 8, 128, 16, {{5000, 1}, {2, 1}, {16, 1}, {100, 1}}, 64, 33);
  run_case(32, 8, 128, 16, {{20000, 1}}, 0, 34);
  run_case(16, 16, 128, 7, {{300, 1}, {45, 1}}, 0, 35);                // G = 1, P = 7
  run_case(32, 8, 64, 16, {{2000, 1}, {1, 1}}, 0, 36);                 // D = 64
  // Peaked softmax (logits of std ~8): the running max moves often (lazy rescale path).
  run_case(32, 8, 128, 16, {{4000, 1}, {300, 1}}, 0, 37, 8.f);
}

// Drawn chunks (the DYN variants): auto's choice at batch 8 (two waves of splits; every kernel
// vs the CPU), DYN kernels with forced split counts of two and three waves (late CTAs find
// their pair's counter drained) and a peaked softmax.
TEST(CudaAttention, DecodeDrawnChunks) {
  SKIP_WITHOUT_GPU();
  std::vector<Seq> eight(8, Seq{17000, 1});
  eight[3].kv_len = 16385;  // the longest sets the plan; shorter ones end early
  run_case(32, 8, 128, 16, eight, 0, 51);
  run_case(32, 8, 128, 16, {{9000, 1}, {5000, 1}, {3000, 1}, {17, 1}}, 40, 52);
  run_case(32, 8, 128, 16, {{12000, 1}, {700, 1}}, 64, 53, 8.f);
}

// Auto's rule for drawn chunks (attention.cu): batch 1 at 70K on the 8-warp twin (one wave),
// batch 8 at 17K on the 4-warp twin with twice the one-wave splits, never with few chunks per
// warp, in deterministic mode or when planned for BLASST.
TEST(CudaAttention, AutoDrawsChunksOnlyWherePlanned) {
  SKIP_WITHOUT_GPU();
  const int Hq = 32, Hkv = 8, D = 128, P = 16;
  cuda::DeviceArena arena(64u << 20);
  cuda::AttnLimits lim;
  lim.max_batch = 8;
  lim.max_q_tokens = 8;
  lim.max_pages = 1 << 16;
  cuda::AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  ws.set_deterministic(false);  // whatever SPADE_DETERMINISTIC says
  std::vector<int32_t> pages(size_t(lim.max_pages));
  std::iota(pages.begin(), pages.end(), 0);
  auto plan = [&](int B, int L) {
    std::vector<cuda::AttnSeq> batch;
    for (int b = 0; b < B; ++b) batch.push_back({pages.data() + b * ((L + P - 1) / P), (L + P - 1) / P, L, 1});
    ws.plan(batch, 0);
  };
  // Hopper's auto rule (8-warp CTAs need 197 KB of shared memory; sm_86 / 89 run others).
  if (!cuda::AttentionWorkspace::decode_kernel_fits(3, D)) GTEST_SKIP() << "no 8-warp decode here";
  const int slots4 = cuda::sm_count() * 2;  // 4-warp CTAs per SM: 2 (101 KB of shared memory)
  plan(1, 70000);
  EXPECT_EQ(std::string(cuda::AttentionWorkspace::decode_kernel_name(ws.decode_variant() + 1)), "v3d_w8s3");
  EXPECT_TRUE(ws.draws_chunks());
  plan(8, 17000);
  EXPECT_EQ(std::string(cuda::AttentionWorkspace::decode_kernel_name(ws.decode_variant() + 1)), "v3d_w4s3");
  const int ns_drawn = ws.n_split();
  ws.set_deterministic(true);  // the static variant and a split count fixed for every batch
  for (int B : {1, 8}) {
    plan(B, 17000);
    EXPECT_EQ(std::string(cuda::AttentionWorkspace::decode_kernel_name(ws.decode_variant() + 1)), "v3_w4s3");
    EXPECT_FALSE(ws.draws_chunks());
    EXPECT_EQ(ws.n_split(), cuda::AttentionWorkspace::kInvariantSplit);
  }
  ws.set_deterministic(false);
  ws.set_blasst_decode(true);  // BLASST plans the static schedule: the drawn one's split / 2
  plan(8, 17000);
  EXPECT_FALSE(ws.draws_chunks());
  const int ns_static = ws.n_split();
  if (ns_static < 8 && 8 * Hkv <= slots4) {
    EXPECT_EQ(ns_drawn, 2 * ns_static);
  }
  ws.set_blasst_decode(false);
  plan(1, 8192);  // 512 chunks: too few per warp
  EXPECT_FALSE(ws.draws_chunks());
}

// The decode schedule is chosen for schedule_kv(max_kv) (the length rounded up to 1/8 of its
// power of two): a batch growing a token per step keeps its variant and split count (its launch
// shape: one CUDA graph) across each bucket.
TEST(CudaAttention, ScheduleKeepsItsShapeWhileSequencesGrow) {
  using cuda::AttentionWorkspace;
  EXPECT_EQ(AttentionWorkspace::schedule_kv(1), 64);
  EXPECT_EQ(AttentionWorkspace::schedule_kv(64), 64);
  EXPECT_EQ(AttentionWorkspace::schedule_kv(65), 128);
  EXPECT_EQ(AttentionWorkspace::schedule_kv(300), 320);    // 256 / 8 = 32 -> steps of 64
  EXPECT_EQ(AttentionWorkspace::schedule_kv(3600), 3840);  // 2048 / 8 = 256
  EXPECT_EQ(AttentionWorkspace::schedule_kv(4096), 4096);
  EXPECT_EQ(AttentionWorkspace::schedule_kv(4097), 4608);
  EXPECT_EQ(AttentionWorkspace::schedule_kv(131072), 131072);
  EXPECT_EQ(AttentionWorkspace::schedule_kv(100000), 106496);  // 65536 / 8 = 8192
  for (int L = 1; L < 300000; L = L * 5 / 4 + 1) {
    const int s = AttentionWorkspace::schedule_kv(L);
    EXPECT_GE(s, L);
    EXPECT_LE(s, std::max(64, L + L / 8 + 64)) << L;
  }
  SKIP_WITHOUT_GPU();
  const int Hq = 9, Hkv = 3, D = 64, P = 16;
  cuda::DeviceArena arena(64u << 20);
  cuda::AttnLimits lim;
  lim.max_batch = 8;
  lim.max_q_tokens = 8;
  lim.max_pages = 1 << 14;
  AttentionWorkspace ws(arena, lim, Hq, Hkv, D, P);
  std::vector<int32_t> pages(size_t(lim.max_pages));
  std::iota(pages.begin(), pages.end(), 0);
  auto plan = [&](int B, int L) {
    std::vector<cuda::AttnSeq> batch;
    for (int b = 0; b < B; ++b) batch.push_back({pages.data() + b * 512, (L + P - 1) / P, L - b, 1});
    ws.plan(batch, 0);
    return std::make_pair(ws.n_split(), ws.decode_variant());
  };
  for (int B : {1, 7}) {
    // 3,585 .. 3,840 share the bucket 3,840: one schedule for 256 steps.
    const auto first = plan(B, 3585);
    for (int L = 3586; L <= 3840; ++L) ASSERT_EQ(plan(B, L), first) << "B " << B << ", L " << L;
    EXPECT_EQ(first.first, ws.choose_split(B, 3840));
  }
}

// wgmma prefill: tiles of 128 keys cross pages and the diagonal; page sizes 16 (fast path),
// 32, 5 (per-row page lookups); G = 1, 4, 8, 16; cached prefixes; a decode row in the batch.
TEST(CudaAttention, PrefillWgmmaShapes) {
  SKIP_WITHOUT_GPU();
  run_case(32, 8, 128, 16, {{129, 129}, {257, 100}, {1, 1}, {700, 700}}, 0, 41);
  run_case(32, 8, 128, 32, {{383, 383}, {1000, 31}}, 0, 42);
  run_case(32, 8, 128, 5, {{300, 300}, {77, 10}}, 0, 43);
  run_case(8, 8, 128, 16, {{450, 450}}, 0, 44);    // G = 1
  run_case(64, 8, 128, 16, {{200, 200}}, 0, 45);   // G = 8
  run_case(64, 4, 128, 16, {{130, 130}}, 0, 46);   // G = 16
  run_case(32, 8, 128, 16, {{600, 600}}, 0, 47, 8.f);  // peaked softmax
}

}  // namespace
}  // namespace spade::test

// BLASST inside a selection (issue 10): SparseAttention's SKIP instances (SelSkip) against the
// plain kernel and the CPU reference.
//  - A threshold that never skips runs the SKIP pipeline (K rows ahead, V rows after the vote,
//    P V one chunk behind) and must give bit-identical outputs to the plain kernel, with every
//    chunk counted and none skipped: Token and Chunk16 lists, planned and forced splits.
//  - Planted chunks: per (request, KV head), every other group of four 16-entry chunks of its
//    list holds keys pointing away from the group's queries (scores ~25 below the rest), so
//    with lambda = e^-10 exactly those chunks are skipped when one CTA serves a list (each
//    warp's first chunk is a normal one); the output equals the CPU's exact attention over the
//    whole list (the skipped weights are ~e^-25) within kTolAttn, with a fixed lambda and with
//    lambda = a / (selected tokens).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/cpu/attention.h"
#include "backend/cuda/sparse_attention.h"
#include "gpu_model_util.h"
#include "gpu_util.h"
#include "sparse/selection.h"

namespace spade::test {
namespace {

using cuda::bf16;
using cuda::SelGran;

struct Case {
  int Hq = 32, Hkv = 8, D = 128;
  std::vector<int> lens = {3000, 2200};
  SelGran gran = SelGran::Token;
  int entries = 640;  // per list (Token: tokens; Chunk16: pages)
};

// Per (request, head) list: `n` sorted random entries of the request's range.
std::vector<std::vector<int32_t>> make_lists(const Case& c, std::mt19937& rng) {
  std::vector<std::vector<int32_t>> lists;
  const int w = c.gran == SelGran::Token ? 1 : 16;
  for (int L : c.lens)
    for (int h = 0; h < c.Hkv; ++h) {
      const int range = (L + w - 1) / w;
      std::vector<int32_t> all(static_cast<size_t>(range));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(size_t(std::min(c.entries, range)));
      std::sort(all.begin(), all.end());
      lists.push_back(all);
    }
  return lists;
}

// Tokens of chunk index ch of a list (16 entries: Token entries or one page each).
std::vector<int32_t> chunk_tokens(const Case& c, const std::vector<int32_t>& list, int ch, int L) {
  std::vector<int32_t> t;
  if (c.gran == SelGran::Token) {
    for (int i = ch * 16; i < std::min<int>(int(list.size()), ch * 16 + 16); ++i) t.push_back(list[size_t(i)]);
  } else {
    const int u = list[size_t(ch)];
    for (int x = u * 16; x < std::min(L, u * 16 + 16); ++x) t.push_back(x);
  }
  return t;
}

struct SkipRun {
  std::vector<float> out;
  uint64_t tiles = 0, skipped = 0;
};

// Runs the sparse kernel over `lists` (plain when skip is inactive).
SkipRun run_gpu(const Case& c, RandomPagedCache& cache, const std::vector<std::vector<int32_t>>& lists,
            const cuda::SelSkip& skip_in, int force_split) {
  const int B = int(c.lens.size()), P = 16;
  std::vector<int32_t> off{0}, idx;
  std::vector<int> max_entries;
  for (const auto& l : lists) {
    idx.insert(idx.end(), l.begin(), l.end());
    off.push_back(int32_t(idx.size()));
    max_entries.push_back(int(l.size()));
  }
  std::vector<cuda::SparseSeq> seqs;
  for (int b = 0; b < B; ++b)
    seqs.push_back({cache.pts[size_t(b)].pages.data(), int(cache.pts[size_t(b)].pages.size()), c.lens[size_t(b)]});
  cuda::DeviceArena arena(64u << 20);
  cuda::SparseAttention sa(arena, 8, cache.kv.n_pages(), c.Hq, c.Hkv, c.D, P);
  DevBuf<bf16> dk(to_bf16(cache.kh)), dv(to_bf16(cache.vh)), dq(to_bf16(cache.q)), dout(cache.q.size());
  DevBuf<int32_t> doff(off), didx(idx);
  DevBuf<unsigned long long> cnt(std::vector<unsigned long long>(size_t(c.Hkv) * 2, 0));
  cuda::SelSkip skip = skip_in;
  if (skip.active()) skip.counts = cnt.p;
  sa.plan(seqs, c.gran, c.Hkv, max_entries, nullptr, 0, force_split);
  dout.poison();
  sa.run(dq.p, dk.p, dv.p, doff.p, didx.p, dout.p, 1.f / std::sqrt(float(c.D)), 0, 0, nullptr, 0, skip);
  SkipRun r;
  r.out = from_bf16(dout.download());
  const auto h = cnt.download();
  for (int i = 0; i < c.Hkv; ++i) r.tiles += h[size_t(2 * i)], r.skipped += h[size_t(2 * i + 1)];
  return r;
}

// The CPU's exact attention over every list.
std::vector<float> run_cpu(const Case& c, RandomPagedCache& cache, const std::vector<std::vector<int32_t>>& lists) {
  const int B = int(c.lens.size());
  std::vector<float> ref(cache.q.size());
  cpu::AttentionScratch scratch;
  for (int b = 0; b < B; ++b) {
    sparse::Selection sel;
    sel.begin_per_head(c.Hkv, c.lens[size_t(b)]);
    for (int h = 0; h < c.Hkv; ++h) {
      const auto& l = lists[size_t(b * c.Hkv + h)];
      std::vector<int32_t> pos;
      const int n = c.gran == SelGran::Token ? int(l.size()) : int(l.size());
      for (int ch = 0; ch * (c.gran == SelGran::Token ? 16 : 1) < n; ++ch)
        for (int32_t t : chunk_tokens(c, l, ch, c.lens[size_t(b)])) pos.push_back(t);
      std::sort(pos.begin(), pos.end());
      for (int32_t t : pos) sel.push(t);
      sel.close_head();
    }
    cpu::attention_selected(cache.kv, 0, cache.pts[size_t(b)], cache.q.data() + size_t(b) * c.Hq * c.D,
                            c.Hq, 1.f / std::sqrt(float(c.D)), sel,
                            ref.data() + size_t(b) * c.Hq * c.D, scratch);
  }
  return ref;
}

uint64_t total_chunks(const Case& c, const std::vector<std::vector<int32_t>>& lists) {
  uint64_t n = 0;
  for (const auto& l : lists) n += c.gran == SelGran::Token ? (l.size() + 15) / 16 : l.size();
  return n;
}

TEST(CudaSparseBlasst, NeverSkippingEqualsThePlainKernel) {
  SKIP_WITHOUT_GPU();
  for (SelGran g : {SelGran::Token, SelGran::Chunk16})
    for (int D : {64, 128}) {
      Case c;
      c.gran = g;
      c.D = D;
      c.entries = g == SelGran::Token ? 700 : 45;
      SCOPED_TRACE(testing::Message() << "gran " << int(g) << " D " << D);
      std::mt19937 rng(21);
      RandomPagedCache cache(c.Hq, c.Hkv, c.D, 16, c.lens, rng);
      const auto lists = make_lists(c, rng);
      cuda::SelSkip never;
      never.log_lambda = -1000.f;  // active: the SKIP pipeline runs, nothing falls below
      for (int fs : {0, 1, 3}) {
        const SkipRun plain = run_gpu(c, cache, lists, {}, fs);
        const SkipRun sk = run_gpu(c, cache, lists, never, fs);
        ASSERT_EQ(plain.out.size(), sk.out.size());
        EXPECT_EQ(std::memcmp(plain.out.data(), sk.out.data(), plain.out.size() * sizeof(float)), 0)
            << "force_split " << fs << ": rel err " << rel_err(sk.out, plain.out);
        EXPECT_EQ(sk.tiles, total_chunks(c, lists)) << "force_split " << fs;
        EXPECT_EQ(sk.skipped, 0u);
      }
    }
}

TEST(CudaSparseBlasst, PlantedChunksAreSkippedAndTheOutputStaysExact) {
  SKIP_WITHOUT_GPU();
  for (SelGran g : {SelGran::Token, SelGran::Chunk16}) {
    Case c;
    c.gran = g;
    c.entries = g == SelGran::Token ? 640 : 40;  // 40 chunks per list either way
    SCOPED_TRACE(testing::Message() << "gran " << int(g));
    std::mt19937 rng(33);
    RandomPagedCache cache(c.Hq, c.Hkv, c.D, 16, c.lens, rng);
    const auto lists = make_lists(c, rng);
    const int G = c.Hq / c.Hkv, D = c.D;
    // Planted: chunks 4..7, 12..15, ... of every list get keys -6 sqrt(D) * unit(sum of the
    // group's queries): every query row scores ~25 (natural units) below a random key.
    uint64_t planted = 0;
    for (int b = 0; b < int(c.lens.size()); ++b)
      for (int h = 0; h < c.Hkv; ++h) {
        std::vector<float> qs(size_t(D), 0.f);
        for (int gg = 0; gg < G; ++gg)
          for (int d = 0; d < D; ++d) qs[size_t(d)] += cache.q[(size_t(b) * c.Hq + h * G + gg) * D + d];
        float nrm = 0;
        for (float x : qs) nrm += x * x;
        nrm = std::sqrt(nrm);
        const auto& l = lists[size_t(b * c.Hkv + h)];
        const int n_ch = c.gran == SelGran::Token ? int((l.size() + 15) / 16) : int(l.size());
        for (int ch = 0; ch < n_ch; ++ch) {
          if ((ch / 4) % 2 == 0) continue;
          ++planted;
          for (int32_t t : chunk_tokens(c, l, ch, c.lens[size_t(b)])) {
            const PageTable& pt = cache.pts[size_t(b)];
            float* k = cache.kv.k_page(0, pt.pages[size_t(t / 16)]) + (size_t(h) * 16 + size_t(t % 16)) * D;
            for (int d = 0; d < D; ++d) k[d] = round_bf16(-6.f * std::sqrt(float(D)) * qs[size_t(d)] / nrm);
          }
        }
      }
    const size_t n = size_t(cache.kv.n_pages()) * cache.lay.page_floats();
    cache.kh.assign(cache.kv.k_page(0, 0), cache.kv.k_page(0, 0) + n);
    const std::vector<float> ref = run_cpu(c, cache, lists);
    cuda::SelSkip fixed;
    fixed.log_lambda = -10.f;
    cuda::SelSkip per_len;  // lambda = a / 640 selected tokens = e^-10
    per_len.log_lambda = -10.f + std::log(640.f);
    per_len.per_length = true;
    for (const auto& [name, sk] : {std::pair<const char*, cuda::SelSkip>{"fixed", fixed}, {"a/L", per_len}}) {
      // One CTA per list: each warp streams chunks w, w + 4, ...: its first chunk is normal,
      // then planted and normal alternate, so exactly the planted chunks fall below.
      const SkipRun one = run_gpu(c, cache, lists, sk, 1);
      EXPECT_LT(rel_err(one.out, ref), kTolAttn) << name;
      EXPECT_EQ(one.tiles, total_chunks(c, lists)) << name;
      EXPECT_EQ(one.skipped, planted) << name;
      // Planned splits: a warp may start on a planted chunk (kept), never skips a normal one.
      const SkipRun planned = run_gpu(c, cache, lists, sk, 0);
      EXPECT_LT(rel_err(planned.out, ref), kTolAttn) << name;
      EXPECT_LE(planned.skipped, planted) << name;
      EXPECT_GT(planned.skipped, planted / 2) << name;
      std::printf("[ sparse-blasst ] gran %d %s: %llu of %llu chunks skipped (planted %llu; planned "
                  "splits %llu), rel err %.3g\n", int(g), name, (unsigned long long)one.skipped,
                  (unsigned long long)one.tiles, (unsigned long long)planted,
                  (unsigned long long)planned.skipped, rel_err(one.out, ref));
    }
  }
}

}  // namespace
}  // namespace spade::test

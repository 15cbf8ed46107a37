// CUDA sparse decode (issue 9) vs the CPU reference:
//  - SparseAttention over Token / Chunk16 / Block64 selections, per-head and shared lists,
//    hybrid dense+sparse heads, forced and planned splits, G = 4 / 8 / 16, D = 64 / 128:
//    outputs vs cpu::attention_selected on the same bf16-rounded cache (rel err < kTolAttn).
//  - Quest on the GPU: page min/max metadata (exact), page scores + top-k selections vs
//    sparse::QuestMethod::select on a KVPool filled by KVPool::write (identical positions),
//    then attention over the GPU's selection vs attention_selected over the CPU's.
//  - topk_rows with heavy ties and NaN vs sparse::top_k_range (identical sets).
// Fresh random inputs per case; outputs poisoned (NaN) before each launch.
#include <algorithm>
#include <cstring>
#include <functional>
#include <iterator>
#include <numeric>

#include "backend/cpu/attention.h"
#include "backend/cuda/sparse_attention.h"
#include "gpu_util.h"
#include "sparse/method.h"
#include "sparse/methods/quest.h"
#include "sparse/topk.h"

namespace spade::test {
namespace {

using cuda::bf16;
using cuda::SelGran;

struct Pool {
  KVLayout lay;
  std::unique_ptr<KVPool> kv;
  std::vector<PageTable> pts;
  std::vector<float> kh, vh;  // whole pool, bf16-rounded
};

// A pool with the given sequence lengths, page ids shuffled across sequences, random bf16 K/V
// written through KVPool::write (so the Quest metadata is the pool's own).
Pool make_pool(int Hkv, int D, int P, const std::vector<int>& lens, std::mt19937& rng) {
  Pool p;
  p.lay = KVLayout{1, Hkv, D, P};
  p.lay.page_minmax = true;
  int64_t pages = 0;
  for (int L : lens) pages += (L + P - 1) / P;
  p.kv = std::make_unique<KVPool>(p.lay, pages + 3);
  p.pts.resize(lens.size());
  for (size_t i = 0; i < lens.size(); ++i) p.kv->reserve(p.pts[i], lens[i]);
  std::vector<int32_t> all;
  for (auto& pt : p.pts) all.insert(all.end(), pt.pages.begin(), pt.pages.end());
  std::shuffle(all.begin(), all.end(), rng);
  size_t o = 0;
  for (auto& pt : p.pts)
    for (auto& pg : pt.pages) pg = all[o++];
  // Whole pool random first (stale slots finite), then every token written through write().
  const size_t n = size_t(p.kv->n_pages()) * p.lay.page_floats();
  auto k0 = round_bf16(randn(n, rng)), v0 = round_bf16(randn(n, rng));
  std::copy(k0.begin(), k0.end(), p.kv->k_page(0, 0));
  std::copy(v0.begin(), v0.end(), p.kv->v_page(0, 0));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> kr(size_t(Hkv) * D), vr(size_t(Hkv) * D);
  for (size_t i = 0; i < lens.size(); ++i) {
    for (int t = 0; t < lens[i]; ++t) {
      // A per-position offset makes pages differ in their bounds (a realistic spread).
      for (auto& x : kr) x = round_bf16(nd(rng) + 0.3f * std::sin(0.01f * t));
      for (auto& x : vr) x = round_bf16(nd(rng));
      p.kv->write(0, p.pts[i], t, kr.data(), vr.data());
    }
    p.pts[i].length = lens[i];
  }
  p.kh.assign(p.kv->k_page(0, 0), p.kv->k_page(0, 0) + n);
  p.vh.assign(p.kv->v_page(0, 0), p.kv->v_page(0, 0) + n);
  return p;
}

std::vector<cuda::SparseSeq> seqs_of(const Pool& p) {
  std::vector<cuda::SparseSeq> b;
  for (auto& pt : p.pts) b.push_back({pt.pages.data(), int(pt.pages.size()), int(pt.length)});
  return b;
}

// Token positions an entry list names (sorted, clipped to L).
std::vector<int32_t> expand(SelGran g, const std::vector<int32_t>& ent, int L) {
  std::vector<int32_t> pos;
  const int w = g == SelGran::Token ? 1 : g == SelGran::Chunk16 ? 16 : 64;
  for (int e : ent)
    for (int t = e * w; t < std::min(L, e * w + w); ++t) pos.push_back(t);
  std::sort(pos.begin(), pos.end());
  return pos;
}

// Random sorted unique entries: n of [0, range).
std::vector<int32_t> pick(int n, int range, std::mt19937& rng) {
  std::vector<int32_t> all(static_cast<size_t>(range));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(size_t(std::min(n, range)));
  std::sort(all.begin(), all.end());
  return all;
}

struct AttnCase {
  int Hq = 32, Hkv = 8, D = 128;
  std::vector<int> lens;
  SelGran gran = SelGran::Token;
  bool shared = false;
  std::vector<uint8_t> dense;  // hybrid: per KV head
  std::vector<int> splits = {0, 1, 5};
  int max_frac_den = 4;  // list sizes drawn in [0, range / max_frac_den] (+ small ones)
  int min_split_used = 0;  // the planner's own split counts (force 0) must reach this
};

void run_attn_case(const AttnCase& c, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
                                  << " gran=" << int(c.gran) << " shared=" << c.shared
                                  << " hybrid=" << !c.dense.empty() << " seed=" << seed);
  std::mt19937 rng(seed);
  const int P = 16, G = c.Hq / c.Hkv, B = int(c.lens.size());
  Pool pool = make_pool(c.Hkv, c.D, P, c.lens, rng);
  const int lpr = c.shared ? 1 : c.Hkv;
  const int w = c.gran == SelGran::Token ? 1 : c.gran == SelGran::Chunk16 ? 16 : 64;
  // Lists: sizes from tiny (0, 1, 15, 17 entries) to a quarter of the range.
  std::vector<std::vector<int32_t>> lists(size_t(B) * lpr);
  std::vector<int> max_entries(lists.size());
  std::vector<int32_t> off{0}, idx;
  for (int b = 0; b < B; ++b)
    for (int l = 0; l < lpr; ++l) {
      const int range = (c.lens[b] + w - 1) / w;
      const int choices[] = {0, 1, 15, 17, -1, -1, -1, -1};
      int n = choices[rng() % 8];
      if (n < 0) n = 1 + int(rng() % uint32_t(std::max(1, range / c.max_frac_den)));
      auto& li = lists[size_t(b) * lpr + l];
      li = pick(n, range, rng);
      if (c.gran == SelGran::Token) std::shuffle(li.begin(), li.end(), rng);  // any order
      idx.insert(idx.end(), li.begin(), li.end());
      off.push_back(int32_t(idx.size()));
      max_entries[size_t(b) * lpr + l] = int(li.size());
    }
  auto q = round_bf16(randn(size_t(B) * c.Hq * c.D, rng));
  const float scale = 1.f / std::sqrt(float(c.D));
  std::vector<float> ref(q.size());
  cpu::AttentionScratch scratch;
  std::vector<std::pair<int, int>> empty;  // (request, KV head) with no rows
  for (int b = 0; b < B; ++b) {
    sparse::Selection sel;
    sel.begin_per_head(c.Hkv, c.lens[b]);
    for (int h = 0; h < c.Hkv; ++h) {
      std::vector<int32_t> pos;
      if (!c.dense.empty() && c.dense[h]) {
        pos.resize(size_t(c.lens[b]));
        std::iota(pos.begin(), pos.end(), 0);
      } else {
        pos = expand(c.gran, lists[size_t(b) * lpr + (c.shared ? 0 : h)], c.lens[b]);
      }
      // attention_selected refuses an empty head; the GPU defines it as 0 (no rows, no mass):
      // the CPU gets a stand-in row and those output rows are zeroed below.
      if (pos.empty()) {
        pos.push_back(0);
        empty.push_back({b, h});
      }
      for (int x : pos) sel.push(x);
      sel.close_head();
    }
    cpu::attention_selected(*pool.kv, 0, pool.pts[b], q.data() + size_t(b) * c.Hq * c.D, c.Hq,
                            scale, sel, ref.data() + size_t(b) * c.Hq * c.D, scratch);
  }
  for (auto [b, h] : empty)
    std::fill_n(ref.data() + (size_t(b) * c.Hq + size_t(h) * G) * c.D, size_t(G) * c.D, 0.f);
  cuda::DeviceArena arena(64u << 20);
  int64_t tot_pages = 0;
  for (auto& pt : pool.pts) tot_pages += int64_t(pt.pages.size());
  cuda::SparseAttention sa(arena, 16, tot_pages, c.Hq, c.Hkv, c.D, P);
  DevBuf<bf16> dk(to_bf16(pool.kh)), dv(to_bf16(pool.vh)), dq(to_bf16(q)), dout(q.size());
  DevBuf<int32_t> doff(off), didx(idx.empty() ? std::vector<int32_t>{0} : idx);
  // The same lists at a fixed stride with their lengths (run's sel_cnt; LycheeCluster's layout):
  // the gaps hold token 0, so reading past a list's length would change the output.
  const int n_lists = int(off.size()) - 1;
  int stride = 1;
  for (int i = 0; i < n_lists; ++i) stride = std::max(stride, off[size_t(i) + 1] - off[size_t(i)] + 3);
  std::vector<int32_t> s_off(static_cast<size_t>(n_lists)), s_cnt(static_cast<size_t>(n_lists)),
      s_idx(static_cast<size_t>(n_lists) * size_t(stride), 0);
  for (int i = 0; i < n_lists; ++i) {
    s_off[size_t(i)] = i * stride;
    s_cnt[size_t(i)] = off[size_t(i) + 1] - off[size_t(i)];
    std::copy(idx.begin() + off[size_t(i)], idx.begin() + off[size_t(i) + 1], s_idx.begin() + i * stride);
  }
  DevBuf<int32_t> dsoff(s_off), dscnt(s_cnt), dsidx(s_idx);
  DevBuf<bf16> dout2(q.size());
  for (int fs : c.splits) {
    for (int rep = 0; rep < 2; ++rep) {  // twice: the split counters must be back at 0
      SCOPED_TRACE(testing::Message() << "force_split=" << fs << " rep=" << rep);
      sa.plan(seqs_of(pool), c.gran, lpr, max_entries, c.dense.empty() ? nullptr : &c.dense, 0, fs);
      dout.poison();
      sa.run(dq.p, dk.p, dv.p, doff.p, didx.p, dout.p, scale, 0);
      auto got = from_bf16(dout.download());
      const double e = rel_err(got, ref);
      EXPECT_LT(e, kTolAttn) << "items=" << sa.n_items() << " max_split=" << sa.max_split_used();
      if (fs == 0) {
        EXPECT_GE(sa.max_split_used(), c.min_split_used);
      }
      if (rep == 0) {
        dout2.poison();
        sa.run(dq.p, dk.p, dv.p, dsoff.p, dsidx.p, dout2.p, scale, 0, 0, nullptr, 0, {}, dscnt.p);
        const auto a = dout.download(), b = dout2.download();
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)))
            << "strided lists (sel_cnt) differ from the same lists in CSR";
      }
    }
  }
}

TEST(CudaSparse, TokenListsPerHead) {
  SKIP_WITHOUT_GPU();
  AttnCase c;
  c.lens = {1000, 5003, 17, 777};
  run_attn_case(c, 11);
  c.splits = {0, 64};
  c.lens = {40000};
  run_attn_case(c, 12);
}

TEST(CudaSparse, TokenListsSharedAndGroups) {
  SKIP_WITHOUT_GPU();
  AttnCase c;
  c.lens = {2100, 333, 4097};
  c.shared = true;  // LessIsMore: one list for every KV head
  run_attn_case(c, 21);
  c.shared = false;
  c.Hq = 32, c.Hkv = 4;  // G = 8
  run_attn_case(c, 22);
  c.Hq = 32, c.Hkv = 2;  // G = 16
  run_attn_case(c, 23);
  c.Hq = 9, c.Hkv = 3, c.D = 64;  // SmolLM2-like G = 3, D = 64
  run_attn_case(c, 24);
}

TEST(CudaSparse, PageAndBlockLists) {
  SKIP_WITHOUT_GPU();
  AttnCase c;
  c.lens = {1000, 5003, 16, 777, 64 * 7 + 5};
  c.gran = SelGran::Chunk16;
  run_attn_case(c, 31);
  c.gran = SelGran::Block64;
  run_attn_case(c, 32);
  c.shared = true;
  run_attn_case(c, 33);
}

TEST(CudaSparse, HybridDenseAndSparseHeads) {
  SKIP_WITHOUT_GPU();
  AttnCase c;
  c.lens = {3000, 12345, 50};
  c.dense = {1, 0, 0, 1, 0, 0, 0, 0};
  c.gran = SelGran::Token;
  run_attn_case(c, 41);
  c.gran = SelGran::Chunk16;
  c.dense = {0, 0, 0, 0, 0, 0, 1, 1};
  run_attn_case(c, 42);
  c.dense = {1, 1, 1, 1, 1, 1, 1, 1};  // all dense: full attention through the same kernel
  run_attn_case(c, 43);
  // Batch 1, two dense heads over 60000 tokens beside six short lists: the planner gives each
  // dense head ~126 splits (its items as long as the sparse heads'), past the 64 that capped
  // them when split partials were indexed [split][B * Hq] (partials now per work item).
  AttnCase h;
  h.lens = {60000};
  h.dense = {1, 1, 0, 0, 0, 0, 0, 0};
  h.max_frac_den = 200;
  h.splits = {0, 300};
  h.min_split_used = 65;
  run_attn_case(h, 44);
}

// SparseAttention::arena_bytes is what CudaModel sizes its pool with: an arena of exactly that
// many bytes must hold the object (metadata for the launch-bounded work items, split partials).
TEST(CudaSparse, ArenaBytesCoverTheObject) {
  SKIP_WITHOUT_GPU();
  for (int mb : {1, 8, 64})
    for (int D : {64, 128})
      for (int patterns : {1, 3}) {
        SCOPED_TRACE(testing::Message() << "max_batch=" << mb << " D=" << D << " patterns=" << patterns);
        const size_t need = cuda::SparseAttention::arena_bytes(mb, 5000, 32, 8, D, 256, patterns);
        cuda::DeviceArena arena(need);
        EXPECT_NO_THROW(cuda::SparseAttention(arena, mb, 5000, 32, 8, D, 16, 256, patterns));
        EXPECT_LE(arena.used(), need);
      }
}

// fast = 1: tensor-core scores (QuestArgs::fast): scores within fp32 rounding of the CPU's,
// selections equal to the CPU's except at near-ties (every page in the symmetric difference
// scores within 1e-4 x the row's largest |score| of the CPU's k-th best).
void run_quest_case(int Hq, int Hkv, int D, const std::vector<int>& lens, int budget, uint32_t seed,
                    int fast = 0) {
  SCOPED_TRACE(testing::Message() << "quest Hq=" << Hq << " Hkv=" << Hkv << " D=" << D
                                  << " budget=" << budget << " seed=" << seed << " fast=" << fast);
  std::mt19937 rng(seed);
  const int P = 16, B = int(lens.size());
  Pool pool = make_pool(Hkv, D, P, lens, rng);
  auto q = round_bf16(randn(size_t(B) * Hq * D, rng));
  const float scale = 1.f / std::sqrt(float(D));
  // CPU: Quest selection (no dense layers) and attention over it.
  sparse::QuestMethod quest(budget, 16, 0, sparse::QuestMethod::Group::Max);
  std::vector<sparse::Selection> sels(static_cast<size_t>(B));
  std::vector<float> ref(q.size());
  cpu::AttentionScratch scratch;
  for (int b = 0; b < B; ++b) {
    sparse::StepContext ctx;
    ctx.Hq = Hq, ctx.Hkv = Hkv, ctx.D = D, ctx.G = Hq / Hkv, ctx.scale = scale, ctx.n_layers = 1;
    ctx.kv = pool.kv.get();
    ctx.begin_layer(0, pool.pts[b], q.data() + size_t(b) * Hq * D, lens[b]);
    quest.select(ctx, sels[size_t(b)]);
    cpu::attention_selected(*pool.kv, 0, pool.pts[b], q.data() + size_t(b) * Hq * D, Hq, scale,
                            sels[size_t(b)], ref.data() + size_t(b) * Hq * D, scratch);
  }
  // GPU: metadata for every page, scores, top-k.
  const int64_t n_pool_pages = pool.kv->n_pages();
  std::vector<int32_t> pids, nvalid;
  int max_pages = 0;
  for (int b = 0; b < B; ++b) {
    const auto& pt = pool.pts[b];
    max_pages = std::max(max_pages, int(pt.pages.size()));
    for (size_t i = 0; i < pt.pages.size(); ++i) {
      pids.push_back(pt.pages[i]);
      nvalid.push_back(int32_t(std::min<int64_t>(P, lens[b] - int64_t(i) * P)));
    }
  }
  DevBuf<bf16> dk(to_bf16(pool.kh)), dv(to_bf16(pool.vh)), dq(to_bf16(q)), dout(q.size());
  DevBuf<bf16> dmeta(size_t(n_pool_pages) * Hkv * 2 * D);
  dmeta.poison();
  DevBuf<int32_t> dpids(pids), dnv(nvalid);
  cuda::quest_update_meta(dk.p, dmeta.p, dpids.p, dnv.p, int(pids.size()), Hkv, P, D, 0);
  {  // metadata == the pool's fp32 min/max (exact: bf16 values)
    auto meta = from_bf16(dmeta.download());
    int64_t bad = 0;
    for (int32_t pg : pids)
      for (int h = 0; h < Hkv; ++h) {
        const float* mn = pool.kv->page_kmin(0, pg, h);
        const float* mx = pool.kv->page_kmax(0, pg, h);
        const float* g = meta.data() + (int64_t(pg) * Hkv + h) * 2 * D;
        for (int d = 0; d < D; ++d) bad += (g[d] != mn[d]) + (g[D + d] != mx[d]);
      }
    EXPECT_EQ(bad, 0) << "metadata elements differing from KVPool's page_kmin/kmax";
  }
  const int k_pages = budget / 16;
  cuda::DeviceArena arena(64u << 20);
  int64_t tot_pages = 0;
  for (auto& pt : pool.pts) tot_pages += int64_t(pt.pages.size());
  cuda::SparseAttention sa(arena, 16, tot_pages, Hq, Hkv, D, P);
  // Lists (b, h): the GPU writes n = min(k_pages, pages) entries at stride k_pages; the CSR
  // given to the attention is that output compacted on the host (a model step would read
  // it through a fixed-stride offset array: sel_off[l] = l * k_pages when all are full).
  std::vector<int> max_entries(size_t(B) * Hkv);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h) max_entries[size_t(b) * Hkv + h] = std::min(k_pages, (lens[b] + 15) / 16);
  std::vector<int32_t> offs(size_t(B) * Hkv + 1, 0);
  DevBuf<float> dscores(size_t(B) * Hkv * max_pages);
  DevBuf<int32_t> dsel(size_t(B) * Hkv * k_pages);
  dsel.poison();
  sa.plan(seqs_of(pool), SelGran::Chunk16, Hkv, max_entries, nullptr, 0);
  // Quest's page table / lengths (the planner's device copy is private).
  std::vector<int32_t> pt_all, po, kl;
  for (int b = 0; b < B; ++b) {
    po.push_back(int32_t(pt_all.size()));
    kl.push_back(lens[b]);
    pt_all.insert(pt_all.end(), pool.pts[b].pages.begin(), pool.pts[b].pages.end());
  }
  DevBuf<int32_t> dpt(pt_all), dpo(po), dkl(kl);
  cuda::QuestArgs qa{dq.p, dmeta.p, dpt.p, dpo.p, dkl.p, dscores.p, dsel.p, B, Hq, Hkv, D, max_pages, k_pages};
  qa.fast = fast;
  cuda::quest_select(qa, 0);
  {
    // CSR written by the top-k itself (QuestArgs::csr_off, CudaModel's path) equals the strided
    // output compacted by quest_compact_lists, offsets and entries.
    const size_t rows = size_t(B) * Hkv;
    DevBuf<int32_t> roff(rows + 1), ridx(rows * k_pages), coff(rows + 1), cidx(rows * k_pages);
    coff.poison();
    cidx.poison();
    cuda::quest_compact_lists(dsel.p, dkl.p, B, Hkv, k_pages, roff.p, ridx.p, 0);
    cuda::QuestArgs qc = qa;
    qc.sel_idx = cidx.p, qc.csr_off = coff.p;
    cuda::quest_select(qc, 0);
    const auto ro = roff.download(), co = coff.download();
    EXPECT_EQ(co, ro) << "CSR offsets";
    const auto ri = ridx.download(), ci = cidx.download();
    EXPECT_TRUE(std::equal(ri.begin(), ri.begin() + ro.back(), ci.begin())) << "CSR entries";
  }
  // CPU-order page bounds (group max), as QuestMethod computes them: [b][h][page].
  auto cpu_scores = [&](int b, int h) {
    const int np = (lens[b] + 15) / 16, G = Hq / Hkv;
    std::vector<float> sc(size_t(std::max(0, np - 1)));
    for (int i = 0; i + 1 < np; ++i) {
      const int32_t pg = pool.pts[b].pages[size_t(i)];
      float m = -INFINITY;
      for (int g = 0; g < G; ++g)
        m = std::max(m, sparse::quest_page_bound(q.data() + (size_t(b) * Hq + h * G + g) * D,
                                                 pool.kv->page_kmin(0, pg, h), pool.kv->page_kmax(0, pg, h), D));
      sc[size_t(i)] = m;
    }
    return sc;
  };
  if (fast) {  // scores vs the CPU's to fp32 rounding
    auto gs = dscores.download();
    double worst = 0;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv; ++h) {
        auto sc = cpu_scores(b, h);
        double mx = 1e-30;
        for (float x : sc) mx = std::max(mx, double(std::fabs(x)));
        for (size_t i = 0; i < sc.size(); ++i)
          worst = std::max(worst, std::fabs(double(gs[(size_t(b) * Hkv + h) * max_pages + i]) - sc[i]) / mx);
      }
    EXPECT_LT(worst, 1e-5) << "tensor-core scores vs CPU (relative to the row's max |score|)";
  }
  auto gsel = dsel.download();
  std::vector<int32_t> csr_idx;
  int64_t mismatched_heads = 0, near_ties = 0;
  for (int b = 0; b < B; ++b) {
    const auto& s = sels[size_t(b)];
    for (int h = 0; h < Hkv; ++h) {
      const int n = max_entries[size_t(b) * Hkv + h];
      std::vector<int32_t> ent(gsel.begin() + int64_t(b * Hkv + h) * k_pages,
                               gsel.begin() + int64_t(b * Hkv + h) * k_pages + n);
      EXPECT_TRUE(std::is_sorted(ent.begin(), ent.end()));
      csr_idx.insert(csr_idx.end(), ent.begin(), ent.end());
      offs[size_t(b) * Hkv + h + 1] = int32_t(csr_idx.size());
      auto got = expand(SelGran::Chunk16, ent, lens[b]);
      std::vector<int32_t> want;
      if (s.dense()) {
        want.resize(size_t(lens[b]));
        std::iota(want.begin(), want.end(), 0);
      } else {
        want.assign(s.head(h), s.head(h) + s.count(h));
      }
      if (got != want) {
        bool near_tie = false;
        if (fast && !s.dense()) {  // every differing page must sit at the boundary
          auto sc = cpu_scores(b, h);
          std::vector<float> sorted(sc);
          std::sort(sorted.begin(), sorted.end(), std::greater<float>());
          const float T = sorted[size_t(std::min<int64_t>(int64_t(sorted.size()), k_pages - 1) - 1)];
          double mx = 1e-30;
          for (float x : sc) mx = std::max(mx, double(std::fabs(x)));
          std::vector<int32_t> diff;
          std::set_symmetric_difference(got.begin(), got.end(), want.begin(), want.end(), std::back_inserter(diff));
          near_tie = true;
          for (int32_t pos : diff) {
            const size_t pg = size_t(pos / 16);
            if (pg >= sc.size() || std::fabs(double(sc[pg]) - T) > 1e-4 * mx) near_tie = false;
          }
          if (near_tie) ++near_ties;
        }
        if (!near_tie) ++mismatched_heads;
      }
    }
  }
  EXPECT_EQ(mismatched_heads, 0) << "of " << B * Hkv << " (request, head) selections differ";
  if (near_ties) std::printf("quest fast: %lld of %d selections differ only at near-ties\n", (long long)near_ties, B * Hkv);
  // Attention over the GPU's selection vs the CPU's attention over its own selection.
  DevBuf<int32_t> doff(offs), didx(csr_idx);
  dout.poison();
  sa.run(dq.p, dk.p, dv.p, doff.p, didx.p, dout.p, scale, 0);
  auto got = from_bf16(dout.download());
  EXPECT_LT(rel_err(got, ref), kTolAttn);
  // When every list is full (n == k_pages), the GPU's fixed-stride output is already a CSR:
  // the whole step (metadata update of the last pages, scores, top-k, attention) runs with
  // no host involvement, captured in a CUDA graph; its output must equal the direct run's.
  bool all_full = true;
  for (int n : max_entries) all_full = all_full && n == k_pages;
  if (all_full) {
    std::vector<int32_t> soff(size_t(B) * Hkv + 1);
    for (size_t l = 0; l < soff.size(); ++l) soff[l] = int32_t(l) * k_pages;
    std::vector<int32_t> lp, lv;
    for (int b = 0; b < B; ++b) {
      lp.push_back(pool.pts[b].pages.back());
      lv.push_back(int32_t(lens[b] - (int64_t(pool.pts[b].pages.size()) - 1) * P));
    }
    DevBuf<int32_t> dsoff(soff), dlp(lp), dlv(lv);
    cudaStream_t st;
    SPADE_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    SPADE_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    cuda::quest_update_meta(dk.p, dmeta.p, dlp.p, dlv.p, B, Hkv, P, D, st);
    cuda::quest_select(qa, st);
    sa.run(dq.p, dk.p, dv.p, dsoff.p, dsel.p, dout.p, scale, st);
    SPADE_CUDA(cudaStreamEndCapture(st, &graph));
    SPADE_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; ++rep) {
      dsel.poison();
      dout.poison();
      SPADE_CUDA(cudaGraphLaunch(exec, st));
      SPADE_CUDA(cudaStreamSynchronize(st));
      EXPECT_EQ(dsel.download(), gsel) << "graph replay " << rep << ": selection differs";
      auto g2 = from_bf16(dout.download());
      EXPECT_EQ(std::memcmp(g2.data(), got.data(), 4 * got.size()), 0)
          << "graph replay " << rep << ": output differs from the direct run";
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
  }
}

TEST(CudaSparse, QuestSelectAndAttend) {
  SKIP_WITHOUT_GPU();
  run_quest_case(32, 8, 128, {4000, 20000, 100, 2049}, 1024, 51);
  run_quest_case(32, 8, 128, {70000}, 4096, 52);
  run_quest_case(32, 4, 128, {9000, 3000}, 512, 53);  // G = 8
  run_quest_case(9, 3, 64, {5000, 700}, 256, 54);     // G = 3, D = 64
}

TEST(CudaSparse, QuestTensorCoreScores) {
  SKIP_WITHOUT_GPU();
  run_quest_case(32, 8, 128, {4000, 20000, 100, 2049}, 1024, 71, 1);
  run_quest_case(32, 8, 128, {70000}, 4096, 72, 1);
  run_quest_case(32, 4, 128, {9000, 3000}, 512, 73, 1);  // G = 8
  run_quest_case(32, 2, 128, {9000}, 512, 75, 1);        // G = 16
  run_quest_case(9, 3, 64, {5000, 700}, 256, 74, 1);     // G = 3, D = 64
}

TEST(CudaSparse, TopkRowsTiesAndNaN) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(61);
  const int rows = 6;
  const int ns[rows] = {10000, 4096, 37, 1, 300000, 5000};
  const int k = 1000;
  int64_t ld = 300000;
  std::vector<float> sc(size_t(rows) * ld);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < ns[r]; ++i) {
      float x = float(int(rng() % 20)) - 10.f;  // heavy ties
      if (r == 5) x = std::normal_distribution<float>(0.f, 1.f)(rng);
      if (rng() % 97 == 0) x = NAN;
      if (rng() % 89 == 0) x = -0.f;
      if (rng() % 83 == 0) x = -INFINITY;
      sc[size_t(r) * ld + i] = x;
    }
  DevBuf<float> dsc(sc);
  DevBuf<int32_t> dn(std::vector<int32_t>(ns, ns + rows)), dout(size_t(rows) * k);
  dout.poison();
  cuda::topk_rows(dsc.p, ld, dn.p, rows, k, dout.p, 0);
  auto got = dout.download();
  std::vector<int32_t> tmp;
  for (int r = 0; r < rows; ++r) {
    const int64_t kk = sparse::top_k_range(sc.data() + size_t(r) * ld, 0, ns[r], k, tmp);
    std::vector<int32_t> want(tmp.begin(), tmp.begin() + kk);
    std::sort(want.begin(), want.end());
    std::vector<int32_t> g(got.begin() + int64_t(r) * k, got.begin() + int64_t(r) * k + kk);
    EXPECT_EQ(g, want) << "row " << r << " n=" << ns[r];
  }
}

// Short rows (<= 256 entries: the rank-counting path of topk_row) and rows just past it
// (the radix passes), k from 1 to n - 1, heavy ties, NaN, -0 and -inf: the CPU's sets.
TEST(CudaSparse, TopkShortRowsTiesAndNaN) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(62);
  const std::vector<int> ns = {2, 5, 31, 32, 33, 100, 255, 256, 257, 300};
  for (int k : {1, 4, 7, 64, 255}) {
    SCOPED_TRACE(testing::Message() << "k=" << k);
    const int64_t ld = 300;
    const int rows = int(ns.size());
    std::vector<float> sc(size_t(rows) * ld, 0.f);
    std::vector<int32_t> n(ns.begin(), ns.end());
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < ns[size_t(r)]; ++i) {
        float x = float(int(rng() % 9)) - 4.f;
        if (r % 3 == 2) x = std::normal_distribution<float>(0.f, 1.f)(rng);
        if (rng() % 29 == 0) x = NAN;
        if (rng() % 23 == 0) x = -0.f;
        if (rng() % 19 == 0) x = -INFINITY;
        sc[size_t(r) * ld + i] = x;
      }
    DevBuf<float> dsc(sc);
    DevBuf<int32_t> dn(n), dout(size_t(rows) * k);
    dout.poison();
    cuda::topk_rows(dsc.p, ld, dn.p, rows, k, dout.p, 0);
    auto got = dout.download();
    std::vector<int32_t> tmp;
    for (int r = 0; r < rows; ++r) {
      const int64_t kk = sparse::top_k_range(sc.data() + size_t(r) * ld, 0, ns[size_t(r)], k, tmp);
      std::vector<int32_t> want(tmp.begin(), tmp.begin() + kk);
      std::sort(want.begin(), want.end());
      std::vector<int32_t> g(got.begin() + int64_t(r) * k, got.begin() + int64_t(r) * k + kk);
      EXPECT_EQ(g, want) << "row " << r << " n=" << ns[size_t(r)];
    }
  }
}

// Written for the fixed 8-bit digit passes the top-k had before (commit a9210d4 made them
// range-adaptive): rows whose k-th key's bin was taken whole after pass 1 (top byte: k
// positive keys among negatives), pass 2 (second byte: 250.x among 150.x) and pass 3 (third
// byte: 250.5 + j ulp among 250 + j ulp), beside a row that needed all four passes; positions
// shuffled. Both the shared-memory-cached rows (ld <= 40960) and the uncached ones. The sets
// must still be the CPU's.
TEST(CudaSparse, TopkRowsBoundaryBinTakenWhole) {
  SKIP_WITHOUT_GPU();
  for (int64_t ld : {int64_t(6000), int64_t(70000)}) {
    SCOPED_TRACE(testing::Message() << "ld=" << ld);
    std::mt19937 rng{uint32_t(ld)};
    const int rows = 4, k = 200, n = int(ld);
    std::vector<float> sc(size_t(rows) * size_t(ld));
    for (int r = 0; r < rows; ++r) {
      float* x = sc.data() + size_t(r) * size_t(ld);
      for (int i = 0; i < n; ++i) {
        const bool top = i < k;
        const int j = top ? i : i - k;
        switch (r) {
          case 0: x[i] = top ? 1.f + 1e-3f * float(j) : -1.f - 1e-5f * float(j); break;
          case 1: x[i] = top ? 250.f + 1e-3f * float(j) : 150.f + 1e-5f * float(j % 1000); break;
          case 2: {
            float v = top ? 250.5f : 250.f;
            for (int u = 0; u < j % 200; ++u) v = std::nextafter(v, 1e9f);
            x[i] = v;
            break;
          }
          default: x[i] = std::normal_distribution<float>(0.f, 1.f)(rng);
        }
      }
      std::shuffle(x, x + n, rng);
    }
    DevBuf<float> dsc(sc);
    DevBuf<int32_t> dn(std::vector<int32_t>(size_t(rows), n)), dout(size_t(rows) * k);
    dout.poison();
    cuda::topk_rows(dsc.p, ld, dn.p, rows, k, dout.p, 0);
    auto got = dout.download();
    std::vector<int32_t> tmp;
    for (int r = 0; r < rows; ++r) {
      const int64_t kk = sparse::top_k_range(sc.data() + size_t(r) * size_t(ld), 0, n, k, tmp);
      ASSERT_EQ(kk, k);
      std::vector<int32_t> want(tmp.begin(), tmp.begin() + kk);
      std::sort(want.begin(), want.end());
      std::vector<int32_t> g(got.begin() + int64_t(r) * k, got.begin() + int64_t(r + 1) * k);
      EXPECT_EQ(g, want) << "row " << r;
    }
  }
}

// The top-k's passes adapt to the keys' range: rows whose range is all one value, a narrow
// cluster between two extreme outliers (the first pass puts the cluster in one bin), the
// whole float line (infinities, NaN, signed zeros, subnormals), ties straddling the k-th
// key, k = 1 and k = n - 1; cached (6000) and uncached (70000) rows. Identical sets to the
// CPU's top_k_range.
TEST(CudaSparse, TopkRowsAdaptiveRanges) {
  SKIP_WITHOUT_GPU();
  for (int64_t ld : {int64_t(6000), int64_t(70000)}) {
    SCOPED_TRACE(testing::Message() << "ld=" << ld);
    std::mt19937 rng{uint32_t(ld) + 7};
    const int n = int(ld);
    struct Row { std::vector<float> x; int k; };
    std::vector<Row> rows;
    auto add = [&](int k, auto&& gen) {
      Row r{std::vector<float>(size_t(n)), k};
      for (int i = 0; i < n; ++i) r.x[size_t(i)] = gen(i);
      std::shuffle(r.x.begin(), r.x.end(), rng);
      rows.push_back(std::move(r));
    };
    std::normal_distribution<float> nd(0.f, 1.f);
    add(300, [](int) { return 2.5f; });  // one value
    add(300, [&](int i) {                // cluster between outliers
      if (i == 0) return 3e38f;
      if (i == 1) return -3e38f;
      return 10.f + 1e-4f * nd(rng);
    });
    add(500, [&](int i) {  // the whole float line
      switch (i % 9) {
        case 0: return INFINITY;
        case 1: return -INFINITY;
        case 2: return std::nanf("");
        case 3: return -0.f;
        case 4: return 0.f;
        case 5: return 1e-40f * float(i % 7);
        default: return std::ldexp(nd(rng), int(i % 200) - 100);
      }
    });
    add(1000, [&](int i) { return float(i % 50) * 0.25f; });  // ties straddle the k-th key
    add(1, [&](int) { return nd(rng); });
    add(n - 1, [&](int i) { return float(i % 3); });
    const int R = int(rows.size());
    std::vector<float> sc(size_t(R) * size_t(ld));
    for (int r = 0; r < R; ++r) std::copy(rows[r].x.begin(), rows[r].x.end(), sc.begin() + size_t(r) * size_t(ld));
    DevBuf<float> dsc(sc);
    for (int r = 0; r < R; ++r) {
      const int k = rows[r].k;
      DevBuf<int32_t> dn(std::vector<int32_t>(1, n));
      DevBuf<int32_t> dout{size_t(k)};
      dout.poison();
      cuda::topk_rows(dsc.p + size_t(r) * size_t(ld), ld, dn.p, 1, k, dout.p, 0);
      auto got = dout.download();
      std::vector<int32_t> tmp;
      const int64_t kk = sparse::top_k_range(rows[r].x.data(), 0, n, k, tmp);
      ASSERT_EQ(kk, k);
      std::vector<int32_t> want(tmp.begin(), tmp.begin() + kk);
      std::sort(want.begin(), want.end());
      EXPECT_EQ(got, want) << "row " << r << " k " << k;
    }
  }
}

}  // namespace
}  // namespace spade::test

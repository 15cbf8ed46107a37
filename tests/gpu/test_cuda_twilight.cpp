// Twilight on the GPU vs the CPU reference (sparse/methods/twilight.h, kv/int4_keys.h):
//  - INT4 keys written by the fused KV append (qkv_post with k_int4) and by
//    int4_quantize_pages: codes and fp16 scale/zero bit-identical to int4_quantize_row of
//    the cached bf16 key rows (random, constant, large, tiny rows; with and without k-norm).
//  - The pruner (estimate + top-p + compaction) over Chunk16 and Token base lists vs
//    TwilightMethod::prune (base=full, dense_layers=0, INT4 keys) on the same selection:
//      * estimated logits vs the CPU's int4_dot ones: |diff| <= 2e-5 * scale * (|zero| sum|q|
//        + s * sum_d |q_d| code_d) (fp32 accumulation-order rounding; products are exact);
//      * kept sets identical per (request, KV head), except near-ties at the p boundary. A
//        position kept by one side only is a near-tie when, for some query head g of its
//        group, on the CPU's weights w (of g): |w_i - t_g| <= eps + 1e-5 * max(w) (the
//        threshold itself) or |sum_{w > w_i} w - p| <= 1e-5 (the mass just above it is p to
//        rounding, so a bisection decision can flip). Any other difference fails.
//      * both top-p CTA shapes (1024 x 8 weights for grids of at most one CTA per SM, else
//        512 x 16) and the shared / global-memory ones (lists over 8192 slots);
//      * top-p thresholds of the tree search bit-identical to the step-per-pass bisection's
//        (TwilightPruner::set_topp_bisection_only) on the same logits; eps 1e-3 .. 1e-10;
//      * attention over the GPU's kept CSR lists (SparseAttention, Token) vs
//        cpu::attention_selected over the same positions (rel err < kTolAttn).
//  - Quest (GPU) -> compact -> pruner -> attention, whole step: kept sets vs the CPU pruner
//    over the GPU Quest selection (same rule).
// Kept-count statistics are printed.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <string>

#include "backend/cpu/attention.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/twilight.h"
#include "gpu_util.h"
#include "kv/int4_keys.h"
#include "kv/kv_pool.h"
#include "sparse/method.h"
#include "sparse/methods/twilight.h"
#include "sparse/registry.h"

namespace spade::test {
namespace {

using cuda::bf16;
using cuda::SelGran;

// ---------------------------------------------------------------- INT4 keys

void check_int4_rows(const std::vector<float>& kcache, const std::vector<uint8_t>& codes,
                     const std::vector<uint32_t>& sz, const std::vector<int64_t>& rows, int D,
                     const char* what) {
  std::vector<uint8_t> c(size_t(D / 2));
  int64_t bad_codes = 0, bad_params = 0;
  for (int64_t row : rows) {
    uint16_t s, z;
    int4_quantize_row(kcache.data() + row * D, D, c.data(), &s, &z);
    if (std::memcmp(c.data(), codes.data() + row * (D / 2), size_t(D / 2)) != 0) ++bad_codes;
    if (sz[size_t(row)] != (uint32_t(s) | (uint32_t(z) << 16))) ++bad_params;
  }
  EXPECT_EQ(bad_codes, 0) << what << ": rows with codes differing from int4_quantize_row (of "
                          << rows.size() << ")";
  EXPECT_EQ(bad_params, 0) << what << ": rows with scale/zero differing";
}

void run_fused_append(int Hq, int Hkv, int D, bool knorm, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D
                                  << " knorm=" << knorm);
  std::mt19937 rng(seed);
  const int P = 16, T = 45, n_pages = 8, nh = Hq + 2 * Hkv;
  auto qkv = randn(size_t(T) * nh * D, rng);
  std::vector<int32_t> pos(T), page(T);
  std::vector<int32_t> perm(n_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int t = 0; t < T; ++t) {
    pos[size_t(t)] = t;
    page[size_t(t)] = perm[size_t(t / P)];
    // Row shapes: token 0 (position 0: RoPE is the identity) constant, token 1 large, token 2
    // tiny, token 3 all-negative, the rest random.
    float* k = qkv.data() + (size_t(t) * nh + Hq) * D;
    for (int h = 0; h < Hkv; ++h)
      for (int d = 0; d < D; ++d) {
        float& x = k[h * D + d];
        if (t == 0) x = 0.37f + h;
        else if (t == 1) x *= 300.f;
        else if (t == 2) x *= 1e-3f;
        else if (t == 3) x = -std::fabs(x) - 2.f;
      }
  }
  std::vector<float> inv_freq(static_cast<size_t>(D / 2)), kn(static_cast<size_t>(D));
  for (int i = 0; i < D / 2; ++i) inv_freq[size_t(i)] = std::pow(10000.f, -2.f * i / D);
  for (auto& x : kn) x = 0.5f + float(rng() % 1000) / 1000.f;
  const size_t cache = size_t(n_pages) * Hkv * P * D;
  DevBuf<float> dqkv(qkv), dif(inv_freq), dkn(kn);
  DevBuf<int32_t> dpos(pos), dpage(page);
  DevBuf<bf16> dq(size_t(T) * Hq * D), dk(cache), dv(cache);
  DevBuf<uint8_t> dcodes(cache / 2);
  DevBuf<uint32_t> dsz(cache / D);
  dk.poison();
  dcodes.poison();
  dsz.poison();
  cuda::QkvPostArgs a;
  a.qkv = dqkv.p;
  a.k_norm = knorm ? dkn.p : nullptr;
  a.inv_freq = dif.p;
  a.pos = dpos.p;
  a.page = dpage.p;
  a.q_out = dq.p;
  a.k_cache = dk.p;
  a.v_cache = dv.p;
  a.k_int4 = dcodes.p;
  a.k_int4_sz = dsz.p;
  a.T = T, a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.P = P;
  cuda::qkv_post(a, 0);
  auto kc = from_bf16(dk.download());
  std::vector<int64_t> rows;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < Hkv; ++h) rows.push_back((int64_t(page[size_t(t)]) * Hkv + h) * P + t % P);
  check_int4_rows(kc, dcodes.download(), dsz.download(), rows, D, "qkv_post");
  // The constant row: scale is the smallest fp16 that covers the rounding of zero.
  uint16_t s, z;
  std::vector<uint8_t> c(size_t(D / 2));
  int4_quantize_row(kc.data() + rows[0] * D, D, c.data(), &s, &z);
  EXPECT_LE(f16_to_f32(z), kc[size_t(rows[0] * D)]);
}

TEST(CudaTwilight, Int4KeysFusedIntoAppend) {
  SKIP_WITHOUT_GPU();
  run_fused_append(32, 8, 128, false, 1);
  run_fused_append(32, 8, 128, true, 2);
  run_fused_append(8, 2, 64, true, 3);
  run_fused_append(12, 4, 256, false, 4);
}

TEST(CudaTwilight, Int4KeysOfCachedPages) {
  SKIP_WITHOUT_GPU();
  for (int D : {64, 128}) {
    std::mt19937 rng(10 + D);
    const int Hkv = 4, P = 16, pages = 300;
    auto k = round_bf16(randn(size_t(pages) * Hkv * P * D, rng, 2.f, 0.5f));
    for (int d = 0; d < D; ++d) k[size_t(5 * D + d)] = round_bf16(-1.25f);  // a constant row
    std::vector<int32_t> ids, nv;
    for (int i = 0; i < pages; i += 2) ids.push_back(i), nv.push_back(i % 7 == 0 ? 5 : P);
    DevBuf<bf16> dk(to_bf16(k));
    DevBuf<int32_t> dids(ids), dnv(nv);
    DevBuf<uint8_t> dcodes(k.size() / 2);
    DevBuf<uint32_t> dsz(k.size() / D);
    dcodes.poison();
    dsz.poison();
    cuda::int4_quantize_pages(dk.p, dcodes.p, dsz.p, dids.p, dnv.p, int(ids.size()), Hkv, P, D, 0);
    std::vector<int64_t> rows;
    for (size_t i = 0; i < ids.size(); ++i)
      for (int h = 0; h < Hkv; ++h)
        for (int r = 0; r < nv[i]; ++r) rows.push_back((int64_t(ids[i]) * Hkv + h) * P + r);
    auto codes = dcodes.download();
    auto sz = dsz.download();
    check_int4_rows(k, codes, sz, rows, D, "int4_quantize_pages");
    // Rows not listed stay untouched (poison).
    EXPECT_EQ(sz[size_t((int64_t(1) * Hkv) * P)], 0xffffffffu);
  }
}

// ---------------------------------------------------------------- pruner vs CPU

struct Pool {
  std::unique_ptr<KVPool> kv;
  std::vector<PageTable> pts;
  std::vector<float> kh, vh;
};

// bf16-rounded random K/V; `planted` keys per (request, head) are pulled toward the group's
// queries (peaked attention, as in tests/test_twilight.cpp), so top-p keeps few tokens.
Pool make_pool(int Hq, int Hkv, int D, int P, const std::vector<int>& lens,
               const std::vector<float>& q, int planted, std::mt19937& rng) {
  Pool p;
  KVLayout lay{1, Hkv, D, P};
  lay.page_minmax = true;
  int64_t pages = 0;
  for (int L : lens) pages += (L + P - 1) / P;
  p.kv = std::make_unique<KVPool>(lay, pages + 2);
  p.pts.resize(lens.size());
  for (size_t i = 0; i < lens.size(); ++i) p.kv->reserve(p.pts[i], lens[i]);
  std::vector<int32_t> all;
  for (auto& pt : p.pts) all.insert(all.end(), pt.pages.begin(), pt.pages.end());
  std::shuffle(all.begin(), all.end(), rng);
  size_t o = 0;
  for (auto& pt : p.pts)
    for (auto& pg : pt.pages) pg = all[o++];
  const size_t n = size_t(p.kv->n_pages()) * lay.page_floats();
  auto k0 = round_bf16(randn(n, rng)), v0 = round_bf16(randn(n, rng));
  std::copy(k0.begin(), k0.end(), p.kv->k_page(0, 0));
  std::copy(v0.begin(), v0.end(), p.kv->v_page(0, 0));
  std::normal_distribution<float> nd(0.f, 1.f);
  const int G = Hq / Hkv;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int L = lens[i];
    std::vector<float> K(size_t(L) * Hkv * D), V(K.size());
    for (auto& x : K) x = nd(rng);
    for (auto& x : V) x = nd(rng);
    for (int h = 0; h < Hkv; ++h)
      for (int j = 0; j < planted; ++j) {
        const int t = int(rng() % uint32_t(L));
        const float* qg = q.data() + (i * Hq + size_t(h * G + j % G)) * D;
        for (int d = 0; d < D; ++d) K[(size_t(t) * Hkv + h) * D + d] = 0.7f * qg[d] + 0.3f * K[(size_t(t) * Hkv + h) * D + d];
      }
    for (auto& x : K) x = round_bf16(x);
    for (auto& x : V) x = round_bf16(x);
    for (int t = 0; t < L; ++t)
      p.kv->write(0, p.pts[i], t, K.data() + size_t(t) * Hkv * D, V.data() + size_t(t) * Hkv * D);
    p.pts[i].length = L;
  }
  p.kh.assign(p.kv->k_page(0, 0), p.kv->k_page(0, 0) + n);
  p.vh.assign(p.kv->v_page(0, 0), p.kv->v_page(0, 0) + n);
  return p;
}

std::string shortest(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.17g", x);
  return b;
}

struct PruneCase {
  int Hq = 32, Hkv = 8, D = 128;
  std::vector<int> lens;
  SelGran gran = SelGran::Chunk16;
  int base_entries = 256;  // per list (Chunk16: pages; Token: positions)
  int planted = 24;
  float q_scale = 1.f;
  double p = 0.95;
  double eps = 1e-6;
  bool quest = false;  // base lists from quest_select on the GPU instead of random
};

struct Agreement {
  int64_t lists = 0, equal = 0, near_tie_lists = 0, bad_lists = 0;
  double base_sum = 0, kept_gpu = 0, kept_cpu = 0;
};

void run_prune_case(const PruneCase& c, uint32_t seed, Agreement& ag) {
  SCOPED_TRACE(testing::Message() << "Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
                                  << " gran=" << int(c.gran) << " p=" << c.p
                                  << " quest=" << c.quest << " seed=" << seed);
  std::mt19937 rng(seed);
  const int P = 16, G = c.Hq / c.Hkv, B = int(c.lens.size()), D = c.D, Hkv = c.Hkv;
  auto q = round_bf16(randn(size_t(B) * c.Hq * D, rng, c.q_scale));
  Pool pool = make_pool(c.Hq, Hkv, D, P, c.lens, q, c.planted, rng);
  const float scale = 1.f / std::sqrt(float(D));
  // Device inputs.
  int64_t tot_pages = 0;
  for (auto& pt : pool.pts) tot_pages += int64_t(pt.pages.size());
  std::vector<int32_t> pt_all, po, kl;
  for (int b = 0; b < B; ++b) {
    po.push_back(int32_t(pt_all.size()));
    kl.push_back(c.lens[size_t(b)]);
    pt_all.insert(pt_all.end(), pool.pts[size_t(b)].pages.begin(), pool.pts[size_t(b)].pages.end());
  }
  const int64_t pool_pages = pool.kv->n_pages();
  DevBuf<bf16> dk(to_bf16(pool.kh)), dv(to_bf16(pool.vh)), dq(to_bf16(q)), dout(q.size());
  DevBuf<int32_t> dpt(pt_all), dpo(po), dkl(kl);
  DevBuf<uint8_t> dcodes(pool.kh.size() / 2);
  DevBuf<uint32_t> dsz(pool.kh.size() / D);
  {
    std::vector<int32_t> ids(static_cast<size_t>(pool_pages)), nv(ids.size(), P);
    std::iota(ids.begin(), ids.end(), 0);
    DevBuf<int32_t> dids(ids), dnv(nv);
    cuda::int4_quantize_pages(dk.p, dcodes.p, dsz.p, dids.p, dnv.p, int(ids.size()), Hkv, P, D, 0);
  }
  // Base lists (entries per (b, h)), as CSR.
  std::vector<std::vector<int32_t>> ent(size_t(B) * Hkv);
  int max_slots = 16;
  cuda::DeviceArena arena(256u << 20);
  std::vector<int32_t> boff{0}, bidx;
  int max_pages = 0;
  for (auto& pt : pool.pts) max_pages = std::max(max_pages, int(pt.pages.size()));
  if (c.quest) {
    // Quest on the GPU (page metadata from the pool's bf16 keys), compacted to CSR.
    const int k_pages = c.base_entries;
    DevBuf<bf16> dmeta(size_t(pool_pages) * Hkv * 2 * D);
    {
      std::vector<int32_t> ids(static_cast<size_t>(pool_pages)), nv(ids.size(), P);
      std::iota(ids.begin(), ids.end(), 0);
      DevBuf<int32_t> dids(ids), dnv(nv);
      cuda::quest_update_meta(dk.p, dmeta.p, dids.p, dnv.p, int(ids.size()), Hkv, P, D, 0);
    }
    DevBuf<float> dscores(size_t(B) * Hkv * max_pages);
    DevBuf<int32_t> dstr(size_t(B) * Hkv * k_pages), doff(size_t(B) * Hkv + 1), didx(size_t(B) * Hkv * k_pages);
    cuda::QuestArgs qa{dq.p, dmeta.p, dpt.p, dpo.p, dkl.p, dscores.p, dstr.p, B, c.Hq, Hkv, D, max_pages, k_pages};
    cuda::quest_select(qa, 0);
    cuda::quest_compact_lists(dstr.p, dkl.p, B, Hkv, k_pages, doff.p, didx.p, 0);
    boff = doff.download();
    bidx = didx.download();
    bidx.resize(size_t(boff.back()));
    for (size_t l = 0; l < ent.size(); ++l) ent[l].assign(bidx.begin() + boff[l], bidx.begin() + boff[l + 1]);
  } else {
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv; ++h) {
        const int L = c.lens[size_t(b)];
        const int range = c.gran == SelGran::Chunk16 ? (L + 15) / 16 : L;
        std::vector<int32_t> all(static_cast<size_t>(range));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        const int nsel = std::min(range, h == 1 ? 1 : c.base_entries);  // head 1: a single entry
        all.resize(size_t(nsel));
        if (c.gran == SelGran::Chunk16) {
          std::sort(all.begin(), all.end());
          if (all.back() != range - 1 && nsel > 1) all.back() = range - 1;  // the partial last page
          std::sort(all.begin(), all.end());
          all.erase(std::unique(all.begin(), all.end()), all.end());
        }
        ent[size_t(b) * Hkv + h] = all;
      }
    for (auto& e : ent) {
      bidx.insert(bidx.end(), e.begin(), e.end());
      boff.push_back(int32_t(bidx.size()));
    }
  }
  for (auto& e : ent)
    max_slots = std::max(max_slots, int(e.size()) * (c.gran == SelGran::Chunk16 ? 16 : 1));
  DevBuf<int32_t> dboff(boff), dbidx(bidx.empty() ? std::vector<int32_t>{0} : bidx);
  cuda::TwilightPruner pr(arena, B, c.Hq, Hkv, D, P, max_slots, c.p, c.eps);
  cuda::TwilightStep st;
  st.q = dq.p, st.codes = dcodes.p, st.sz = dsz.p;
  st.page_table = dpt.p, st.page_off = dpo.p, st.kv_len = dkl.p;
  st.base_off = dboff.p, st.base_idx = dbidx.p, st.gran = c.gran, st.B = B, st.scale = scale;
  const size_t n_lists = size_t(B) * Hkv;
  // The step-per-pass bisection first (the reference search): the tree search must find
  // the same thresholds, hence the same kept lists.
  pr.set_topp_bisection_only(true);
  pr.run(st, 0);
  std::vector<float> thr_bisect(n_lists * G);
  SPADE_CUDA(cudaMemcpy(thr_bisect.data(), pr.thresholds(), 4 * thr_bisect.size(), cudaMemcpyDeviceToHost));
  pr.set_topp_bisection_only(false);
  pr.run(st, 0);
  pr.compact(st, 0);  // CSR copies of the strided lists, read below
  SPADE_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> koff(n_lists + 1), kcnt(n_lists);
  SPADE_CUDA(cudaMemcpy(koff.data(), pr.kept_off(), 4 * koff.size(), cudaMemcpyDeviceToHost));
  SPADE_CUDA(cudaMemcpy(kcnt.data(), pr.kept_count(), 4 * kcnt.size(), cudaMemcpyDeviceToHost));
  std::vector<float> gthr(n_lists * G);
  SPADE_CUDA(cudaMemcpy(gthr.data(), pr.thresholds(), 4 * gthr.size(), cudaMemcpyDeviceToHost));
  int64_t thr_differ = 0;
  for (size_t i = 0; i < gthr.size(); ++i) thr_differ += std::memcmp(&gthr[i], &thr_bisect[i], 4) != 0;
  EXPECT_EQ(thr_differ, 0) << "tree search vs step-per-pass bisection thresholds";
  std::vector<int32_t> kidx(size_t(std::max(1, koff.back())));
  SPADE_CUDA(cudaMemcpy(kidx.data(), pr.kept_idx(), 4 * kidx.size(), cudaMemcpyDeviceToHost));
  const size_t ms = size_t(pr.max_slots());
  std::vector<float> glog(n_lists * G * ms);
  SPADE_CUDA(cudaMemcpy(glog.data(), pr.logits(), 4 * glog.size(), cudaMemcpyDeviceToHost));

  // CPU reference: TwilightMethod over base=full, fed the same selection.
  ModelConfig cfg;
  cfg.n_layers = 1, cfg.n_heads = c.Hq, cfg.n_kv_heads = Hkv, cfg.head_dim = D;
  cfg.hidden = c.Hq * D, cfg.ffn = 4, cfg.vocab = 8, cfg.max_context = 1 << 20;
  auto m = sparse::make_method(
      sparse::SparseConfig::parse_spec("twilight:base=full,dense_layers=0,p=" + std::to_string(c.p) +
                                       ",eps=" + shortest(c.eps)),
      cfg);
  double worst_logit = 0;
  std::vector<float> ref(q.size()), got_ref(q.size());
  cpu::AttentionScratch scratch;
  std::vector<std::pair<int, int>> empty;
  for (int b = 0; b < B; ++b) {
    const int L = c.lens[size_t(b)];
    auto stt = m->new_state();
    sparse::StepContext ctx;
    ctx.n_layers = 1, ctx.Hq = c.Hq, ctx.Hkv = Hkv, ctx.D = D, ctx.G = G, ctx.scale = scale;
    ctx.kv = pool.kv.get();
    ctx.state = stt.get();
    const float* qb = q.data() + size_t(b) * c.Hq * D;
    ctx.begin_layer(0, pool.pts[size_t(b)], qb, L);
    sparse::Selection sel;
    sel.begin_per_head(Hkv, L);
    std::vector<std::vector<int32_t>> base_pos(static_cast<size_t>(Hkv));
    for (int h = 0; h < Hkv; ++h) {
      for (int e : ent[size_t(b) * Hkv + h]) {
        if (c.gran == SelGran::Chunk16) {
          for (int t = 16 * e; t < std::min(L, 16 * e + 16); ++t) base_pos[size_t(h)].push_back(t);
        } else {
          base_pos[size_t(h)].push_back(e);
        }
      }
      for (int x : base_pos[size_t(h)]) sel.push(x);
      sel.close_head();
    }
    m->on_append(ctx);
    m->prune(ctx, sel);
    const auto* tws = sparse::twilight_state(stt.get());
    ASSERT_NE(tws, nullptr);
    sparse::Selection gsel;  // the GPU's kept lists, for the attention check
    gsel.begin_per_head(Hkv, L);
    for (int h = 0; h < Hkv; ++h) {
      const size_t l = size_t(b) * Hkv + h;
      ++ag.lists;
      std::vector<int32_t> cpu_kept(sel.head(h), sel.head(h) + sel.count(h));
      std::vector<int32_t> gpu_kept(kidx.begin() + koff[l], kidx.begin() + koff[l + 1]);
      EXPECT_EQ(kcnt[l], koff[l + 1] - koff[l]);
      ag.base_sum += double(base_pos[size_t(h)].size());
      ag.kept_cpu += double(cpu_kept.size());
      ag.kept_gpu += double(gpu_kept.size());
      for (int x : gpu_kept) gsel.push(x);
      if (gpu_kept.empty()) {
        gsel.push(0);
        empty.push_back({b, h});
      }
      gsel.close_head();
      // CPU weights (the pruner's own arithmetic) for the logit check and the near-tie rule.
      const auto& bp = base_pos[size_t(h)];
      const int64_t n = int64_t(bp.size());
      std::vector<std::vector<float>> w(static_cast<size_t>(G), std::vector<float>(static_cast<size_t>(n)));
      std::vector<float> thr(static_cast<size_t>(G));
      std::map<int32_t, int64_t> slot_of;
      for (int64_t i = 0; i < n; ++i) slot_of[bp[size_t(i)]] = i;
      for (int g = 0; g < G; ++g) {
        const float* qg = qb + size_t(h * G + g) * D;
        float qs = 0, qa = 0;
        for (int d = 0; d < D; ++d) qs += qg[d], qa += std::fabs(qg[d]);
        auto& r = w[size_t(g)];
        for (int64_t i = 0; i < n; ++i) {
          const int32_t pos = bp[size_t(i)];
          const uint8_t* code = tws->keys.codes(0, pos, h);
          const float sc = tws->keys.scale(0, pos, h), z = tws->keys.zero(0, pos, h);
          r[size_t(i)] = scale * int4_dot(qg, qs, code, sc, z, D);
          // GPU logit of the same token: its slot in the list.
          int64_t slot = i;
          if (c.gran == SelGran::Chunk16) {
            const auto& el = ent[l];
            const int64_t j = std::lower_bound(el.begin(), el.end(), pos / 16) - el.begin();
            slot = 16 * j + pos % 16;
          }
          float bound = std::fabs(z) * qa;
          for (int d = 0; d < D; ++d)
            bound += sc * std::fabs(qg[d]) * float((code[d / 2] >> (4 * (d & 1))) & 15);
          const float gl = glog[(l * G + size_t(g)) * ms + size_t(slot)];
          const double e = std::fabs(double(gl) - double(r[size_t(i)])) / (scale * bound + 1e-30);
          worst_logit = std::max(worst_logit, e);
        }
        sparse::softmax_weights(r.data(), n);
        thr[size_t(g)] = sparse::topp_binary_search(r.data(), n, c.p, c.eps).threshold;
      }
      if (c.gran == SelGran::Token) {  // CPU output order = selection order; GPU's too
        std::sort(cpu_kept.begin(), cpu_kept.end());
        std::sort(gpu_kept.begin(), gpu_kept.end());
      }
      if (cpu_kept == gpu_kept) {
        ++ag.equal;
        continue;
      }
      std::vector<int32_t> diff;
      std::vector<int32_t> a = cpu_kept, bb = gpu_kept;
      std::sort(a.begin(), a.end());
      std::sort(bb.begin(), bb.end());
      std::set_symmetric_difference(a.begin(), a.end(), bb.begin(), bb.end(), std::back_inserter(diff));
      bool all_near = true;
      for (int32_t pos : diff) {
        auto it = slot_of.find(pos);
        if (it == slot_of.end()) {  // not even in the base selection
          all_near = false;
          continue;
        }
        const int64_t i = it->second;
        bool near = false;
        for (int g = 0; g < G && !near; ++g) {
          const auto& r = w[size_t(g)];
          const float wi = r[size_t(i)];
          float wmax = 0;
          double above = 0;
          for (float x : r) {
            wmax = std::max(wmax, x);
            if (x > wi) above += x;
          }
          near = std::fabs(double(wi) - thr[size_t(g)]) <= c.eps + 1e-5 * wmax ||
                 std::fabs(above - c.p) <= 1e-5;
        }
        all_near = all_near && near;
      }
      if (all_near) ++ag.near_tie_lists;
      else ++ag.bad_lists;
      if (!all_near && ag.bad_lists <= 3)
        for (int g = 0; g < G; ++g)
          std::printf("  list b=%d h=%d g=%d: threshold cpu %.9g gpu %.9g\n", b, h, g, thr[size_t(g)],
                      gthr[l * G + size_t(g)]);
      EXPECT_TRUE(all_near) << "b=" << b << " h=" << h << ": cpu kept " << cpu_kept.size()
                            << ", gpu kept " << gpu_kept.size() << ", " << diff.size()
                            << " differ, not at the p boundary";
    }
    cpu::attention_selected(*pool.kv, 0, pool.pts[size_t(b)], qb, c.Hq, scale, gsel,
                            got_ref.data() + size_t(b) * c.Hq * D, scratch);
  }
  EXPECT_LT(worst_logit, 2e-5) << "estimated logits vs the CPU's int4_dot (relative to the bound)";
  for (auto [b, h] : empty)
    std::fill_n(got_ref.data() + (size_t(b) * c.Hq + size_t(h) * G) * D, size_t(G) * D, 0.f);
  // Attention over the GPU's kept lists (Token CSR) vs the CPU over the same positions.
  cuda::SparseAttention sa(arena, B, tot_pages, c.Hq, Hkv, D, P);
  std::vector<cuda::SparseSeq> seqs;
  for (auto& pt : pool.pts) seqs.push_back({pt.pages.data(), int(pt.pages.size()), int(pt.length)});
  std::vector<int> kept_hint(n_lists, 512);  // upper bounds only set the split counts
  sa.plan(seqs, SelGran::Token, Hkv, kept_hint, nullptr, 0);
  dout.poison();
  // The strided lists with their counts, as CudaModel reads them (the kept sets above are
  // their CSR copies).
  sa.run(dq.p, dk.p, dv.p, pr.kept_strided_off(), pr.kept_strided_idx(), dout.p, scale, 0, 0,
         nullptr, 0, {}, pr.kept_count());
  auto got = from_bf16(dout.download());
  EXPECT_LT(rel_err(got, got_ref), kTolAttn);
}

void report(const char* name, const Agreement& ag) {
  std::printf("%s: %lld lists, %lld equal, %lld near-tie only, %lld bad; mean base %.1f, kept "
              "gpu %.1f cpu %.1f\n",
              name, (long long)ag.lists, (long long)ag.equal, (long long)ag.near_tie_lists,
              (long long)ag.bad_lists, ag.base_sum / double(ag.lists),
              ag.kept_gpu / double(ag.lists), ag.kept_cpu / double(ag.lists));
}

TEST(CudaTwilight, PrunerChunk16VsCpu) {
  SKIP_WITHOUT_GPU();
  Agreement ag;
  PruneCase c;
  c.lens = {3000, 9001, 700};
  c.base_entries = 128;
  run_prune_case(c, 21, ag);
  c.q_scale = 2.f;  // sharper: fewer kept
  c.p = 0.9;
  run_prune_case(c, 22, ag);
  c.q_scale = 0.3f;  // flat: most kept
  c.p = 0.95;
  run_prune_case(c, 23, ag);
  PruneCase c2;  // G = 8, D = 64
  c2.Hq = 32, c2.Hkv = 4, c2.D = 64;
  c2.lens = {5000, 2500};
  c2.base_entries = 100;
  run_prune_case(c2, 24, ag);
  PruneCase c3;  // G = 16 (two head tiles), a long base list
  c3.Hq = 32, c3.Hkv = 2;
  c3.lens = {20000};
  c3.base_entries = 200;
  c3.q_scale = 1.5f;
  run_prune_case(c3, 25, ag);
  PruneCase c4;  // 5 x 32 = 160 top-p CTAs, over the SM count: 512-thread CTAs (the rest: 1024)
  c4.lens = {1200, 3000, 700, 2222, 4096};
  c4.base_entries = 96;
  run_prune_case(c4, 26, ag);
  c4.q_scale = 0.3f;
  run_prune_case(c4, 27, ag);
  report("twilight chunk16", ag);
}

TEST(CudaTwilight, PrunerTokenListsVsCpu) {
  SKIP_WITHOUT_GPU();
  Agreement ag;
  PruneCase c;
  c.gran = SelGran::Token;
  c.lens = {4000, 1500, 777};
  c.base_entries = 1000;
  run_prune_case(c, 31, ag);
  c.Hq = 12, c.Hkv = 4, c.D = 64;  // G = 3
  c.p = 0.8;
  run_prune_case(c, 32, ag);
  PruneCase c2;  // 55000 base tokens: top-p weights in global memory (over the smem cap)
  c2.gran = SelGran::Token;
  c2.lens = {62000, 61000};
  c2.base_entries = 55000;
  c2.q_scale = 1.5f;
  run_prune_case(c2, 33, ag);
  c2.lens = {14000};  // 12000 base tokens: top-p weights in shared memory
  c2.base_entries = 12000;
  run_prune_case(c2, 34, ag);
  report("twilight token", ag);
}

// Lists of <= 512 slots take the warp-per-head top-p (twilight_topp_warp.cu): its
// thresholds must equal the step-per-pass bisection's bit for bit (run_prune_case) and its
// kept sets the CPU's, at 128 / 256 / 512 slots, G = 3, 4, 8 and 16, both granularities, eps
// shallow and deep.
TEST(CudaTwilight, PrunerShortListsVsCpu) {
  SKIP_WITHOUT_GPU();
  Agreement ag;
  PruneCase c;  // G = 4, Chunk16: 8 pages = 128 slots
  c.lens = {300, 1000, 129, 64};
  c.base_entries = 8;
  run_prune_case(c, 61, ag);
  c.q_scale = 0.3f;
  run_prune_case(c, 62, ag);
  c.Hq = 9, c.Hkv = 3, c.D = 64;  // SmolLM2's heads (G = 3), 32 pages = 512 slots
  c.base_entries = 32;
  c.lens = {2000, 513, 700};
  c.q_scale = 1.5f;
  run_prune_case(c, 63, ag);
  PruneCase t;  // Token lists
  t.gran = SelGran::Token;
  t.Hq = 32, t.Hkv = 4;  // G = 8
  t.lens = {900, 250, 3000};
  t.base_entries = 200;
  run_prune_case(t, 64, ag);
  t.base_entries = 500;
  t.eps = 1e-10;  // past the tree's exact depth
  run_prune_case(t, 65, ag);
  t.Hq = 32, t.Hkv = 2;  // G = 16
  t.base_entries = 100;
  t.eps = 1e-3;
  run_prune_case(t, 66, ag);
  report("twilight short lists", ag);
}

// eps sets how deep Algorithm 1 goes: 1e-3 ends within the first tree pass (many searches
// stop on the undecided span), 1e-10 goes past the tree's exact depth (29 steps) into the
// step-per-pass loop.
TEST(CudaTwilight, PrunerEpsDepths) {
  SKIP_WITHOUT_GPU();
  Agreement ag;
  PruneCase c;
  c.gran = SelGran::Token;
  c.lens = {6000, 2500};
  c.base_entries = 2000;
  for (double eps : {1e-3, 1e-10}) {
    c.eps = eps;
    c.q_scale = 1.f;
    run_prune_case(c, 51, ag);
    c.q_scale = 0.3f;  // flat
    run_prune_case(c, 52, ag);
  }
  report("twilight eps", ag);
}

TEST(CudaTwilight, QuestThenPrune) {
  SKIP_WITHOUT_GPU();
  Agreement ag;
  PruneCase c;
  c.quest = true;
  c.lens = {8000, 33000, 1000};
  c.base_entries = 256;  // 4096 tokens
  c.q_scale = 1.5f;
  run_prune_case(c, 41, ag);
  report("twilight over gpu quest", ag);
}

}  // namespace
}  // namespace spade::test

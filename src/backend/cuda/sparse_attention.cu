// Decode attention over selections (issue 9); API and selection formats in sparse_attention.h.
//
// Layout read: q bf16 [B, Hq, D]; K/V bf16 pages [page][Hkv][P][D] (HND, like KVPool and the
// dense decode kernel); page table int32 per request; selection CSR sel_off / sel_idx int32.
// Layout written: out bf16 [B, Hq, D]; with splits, partials fp32 [item][G][D] and
// log2-sum-exp [item][G] (item = the CTA's index in the launch; a (request, KV head)'s splits
// are consecutive items), combined by the LAST CTA of each (request, KV head) to arrive
// (arrival counter per (request, KV head), reset by that CTA): one launch.
//
// Work: a CTA = work item {request, KV head (+ dense flag), split, nsplit} with W = 4 warps.
// A list is cut into chunks of 16 rows (one mma k-step of P.V): Token lists -> 16 positions
// per chunk, each row gathered through the page table on its own (a 256-byte K row and V row
// at D = 128); Chunk16 / Block64 / dense heads -> one 16-token run of one page per chunk (needs
// P % 16 == 0). Warp w of a CTA streams chunks w, w+4, ... of its split through a private
// 3-stage cp.async ring (16-byte copies, rows swizzled for ldmatrix; invalid rows zero-filled),
// exactly like the dense v3 kernel (attention_decode.cu); the row addresses of a chunk are
// resolved two chunks ahead (list entry) and one chunk ahead (page id), so neither dependent
// load sits in front of a copy. Token mode: lane l < 16 resolves row l, rows reach the copying
// lanes by __shfl_sync. Compute per chunk: mma.sync m16n8k16 (bf16 -> fp32) with the G <= 16
// query heads of the KV head as rows: S = Q K^T, online softmax in log2 units (lazy rescale),
// O += P V; the 4 warps merge through shared memory.
// Bytes (the floor the benchmark divides by HBM bandwidth): per (request, KV head) 2*n*D*2
// bytes of K+V for n selected rows (+ 4n index bytes in token mode, 4 per entry otherwise),
// q + out 2*Hq*D*2 per request, partials 2 * splits * G * (D + 1) * 4 per (request, KV head).
// Shared memory: 4 KB Q + 4 warps x 3 stages x 8 KB (D = 128) + 1 KB alignment = 101 KB
// (2 CTAs per SM).
// BLASST inside the selection (SelSkip, the SKIP instances): after Q K^T of a chunk, the warp
// votes; a chunk whose every query row's max is below the running max of the kept chunks by
// more than -ln lambda skips exp, the row sum, P V and its V rows (only K is read for it):
// bytes per skipped row 2*D (K) instead of 4*D.
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/per_device.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
namespace {
using namespace attn_detail;

struct SpArgs {
  const bf16* q;
  bf16* out;
  const bf16* k;
  const bf16* v;
  const int32_t* page_table;
  const int32_t* page_off;
  const int32_t* kv_len;
  const int32_t* sel_off;
  const int32_t* sel_idx;
  const int32_t* sel_cnt;  // optional: list i = sel_cnt[i] entries at sel_off[i] (strided lists)
  const int4* items;
  float* part_o;
  float* part_lse;
  int* counters;
  int Hq, Hkv, G, P, lists_per_req, gran;  // gran: SelGran as int
  float scale_log2;
  // Dense heads only (optional): group-mean scores scores_out[(seq * Hkv + kvh) * ld + j] =
  // mean over the G query heads of q.k_j * scale, from the products the softmax uses.
  float* scores_out;
  int64_t scores_ld;
  // BLASST (SKIP instances): threshold log2(lambda) (fixed), or log2(a) - log2(length) per
  // (request, head) with length = the selection's tokens (skip_len_selected) or kv_len, capped
  // at 0; counters [Hkv][2] (chunks seen, chunks skipped), optional.
  float skip_log2;
  int skip_per_length, skip_len_selected;
  unsigned long long* skip_counts;
  // Diagnostics (optional): per-CTA globaltimer stamps (SparseAttention::set_trace).
  unsigned long long* trace;
};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

constexpr int kTK = 16;  // rows per chunk

template <int D, int W, int S>
struct SpCfg {
  static constexpr int kThreads = W * 32;
  static constexpr int CH = D / 8;     // 16-byte chunks per row
  static constexpr int RPI = 32 / CH;  // rows per warp-wide copy instruction
  static constexpr int kTile = kTK * D;
  static constexpr int kStage = 2 * kTile;
  static constexpr size_t kQ = 4096;
  static constexpr size_t kRing = size_t(W) * S * kStage * sizeof(bf16);
  static constexpr size_t kMerge = size_t(W) * 16 * (D + 2) * sizeof(float);
  static constexpr size_t kSmem = 1024 + ((kQ + kRing) > kMerge ? (kQ + kRing) : kMerge);
};

// TOKEN: Token lists (per-row gather); else Chunk16 / Block64 / dense (16-token runs).
// SKIP: BLASST inside the selection (chunks far below the running max are skipped, their V
// rows not loaded); no dense-head score emission then.
template <int D, int W, int S, bool TOKEN, bool SKIP>
__global__ void __launch_bounds__(W * 32) sparse_decode_kernel(const SpArgs a) {
  const unsigned long long t_entry = a.trace ? global_ns() : 0;
  pdl_begin();  // pdl.cuh: first, before any global access
  const unsigned long long t_wait = a.trace ? global_ns() : 0;
  using C = SpCfg<D, W, S>;
  constexpr int CH = C::CH, RPI = C::RPI, NT = C::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_dyn[];
  __shared__ int s_last;
  unsigned char* smem_raw = smem_dyn + ((1024 - (smem_u32(smem_dyn) & 1023)) & 1023);
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* ring = reinterpret_cast<bf16*>(smem_raw + C::kQ);

  const int4 item = a.items[blockIdx.x];
  const int seq = item.x, kvh = item.y & 0xffff, split = item.z, nsplit = item.w;
  const bool dense = (item.y >> 16) & 1;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = a.G, P = a.P;
  const int L = a.kv_len[seq];
  const int* pt = a.page_table + a.page_off[seq];
  const int list = seq * a.lists_per_req + (a.lists_per_req == 1 ? 0 : kvh);
  const int e0 = a.sel_off[list];
  const int n_ent = dense ? 0 : a.sel_cnt ? a.sel_cnt[list] : a.sel_off[list + 1] - e0;
  const int* sel = a.sel_idx + e0;
  // Chunks of this (request, head), then this CTA's share of them.
  int n_ch;
  if (dense) n_ch = (L + kTK - 1) / kTK;
  else if (TOKEN) n_ch = (n_ent + kTK - 1) / kTK;  // (gran == Token)
  else n_ch = a.gran == int(SelGran::Block64) ? n_ent * 4 : n_ent;
  const int per = (n_ch + nsplit - 1) / nsplit;
  const int cb = split * per;
  const int n_cta = max(0, min(n_ch, cb + per) - cb);
  const int n_my = n_cta > warp ? (n_cta - warp + W - 1) / W : 0;

  const int p_shift = (P & (P - 1)) == 0 ? __ffs(P) - 1 : -1;
  auto pdiv = [&](int j) { return p_shift >= 0 ? j >> p_shift : j / P; };
  auto pmod = [&](int j) { return p_shift >= 0 ? j & (P - 1) : j % P; };
  const int cc = lane % CH, rl = lane / CH;
  auto chunk_of = [&](int kk) { return cb + warp + kk * W; };

  const bool tok_mode = TOKEN && !dense;  // CTA-uniform
  // Stage A (two chunks ahead): the chunk's first token (page modes, all lanes) or the token
  // of row lane & 15 (token mode); -1 = no row. Also the number of valid rows.
  struct Ent {
    int tok, lim;
  };
  auto stage_a = [&](int kk) -> Ent {
    const int c = chunk_of(kk);
    if (tok_mode) {
      const int r = lane & 15;
      const int j = c * kTK + r;
      return {j < n_ent ? __ldg(sel + j) : -1, min(kTK, n_ent - c * kTK)};
    }
    int u;
    if (dense) u = c;
    else if (a.gran == int(SelGran::Block64)) u = __ldg(sel + (c >> 2)) * 4 + (c & 3);
    else u = __ldg(sel + c);
    const int t0 = u * kTK;
    return {t0 < L ? t0 : -1, min(kTK, L - t0)};
  };
  // Stage B (one chunk ahead): row id (page * Hkv + kvh) * P + slot of that token.
  auto stage_b = [&](int tok) -> int {
    return tok < 0 ? -1 : (__ldg(pt + pdiv(tok)) * a.Hkv + kvh) * P + pmod(tok);
  };
  // Copies one chunk into ring stage st: token mode, row r from lane r's rid (shuffled);
  // page modes, rows rid + r for r < lim. Invalid rows are zero-filled (V = 0: no 0 * NaN).
  // which: 1 = K rows, 2 = V rows, 3 = both.
  auto issue = [&](int st, int rid, int lim, int which) {
    bf16* dK = ring + (warp * S + st) * C::kStage;
    bf16* dV = dK + C::kTile;
#pragma unroll
    for (int i = 0; i < kTK / RPI; ++i) {
      const int r = rl + i * RPI;
      int rr;
      if (tok_mode) rr = __shfl_sync(0xffffffffu, rid, r);
      else rr = (rid >= 0 && r < lim) ? rid + r : -1;
      const bool valid = rr >= 0;
      const int64_t off = valid ? int64_t(rr) * D + cc * 8 : 0;
      if (which & 1) cp_async16(dK + swz<D>(r, cc * 8), a.k + off, valid);
      if (which & 2) cp_async16(dV + swz<D>(r, cc * 8), a.v + off, valid);
    }
  };

  // Q rows (the G heads of this KV head; rows >= G zero) in the first commit group.
  for (int idx = tid; idx < 16 * CH; idx += NT) {
    const int r = idx / CH, c = idx % CH;
    const bool valid = r < G;
    const bf16* src = a.q + (int64_t(seq) * a.Hq + kvh * G + r) * D + c * 8;
    cp_async16(sQ + swz<D>(r, c * 8), valid ? src : a.q, valid);
  }
  // Ring prologue: chunks 0 .. S-2, with their entries resolved in place. SKIP (BLASST): K
  // rows only, each chunk a commit-group pair ([empty], [K]) like the main loop's ([V], [K]).
  int lq[S];    // valid rows of chunks kk, kk + 1, ... (a register queue, shifted each step)
  int ridq[S];  // SKIP: their resolved row ids (the V rows are issued once a chunk is kept)
#pragma unroll
  for (int s = 0; s < S; ++s) lq[s] = 0, ridq[s] = -1;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if constexpr (SKIP) cp_async_commit();
    if (s < n_my) {
      const Ent e = stage_a(s);
      lq[s] = e.lim;
      ridq[s] = stage_b(e.tok);
      issue(s, ridq[s], e.lim, SKIP ? 1 : 3);
    }
    cp_async_commit();
  }
  // Pipeline registers: chunk S-1 resolved (rid), chunk S entry loaded (tok).
  int rid_next = -1, lim_next = 0, tok_ahead = -1, lim_ahead = 0;
  if (S - 1 < n_my) {
    const Ent e = stage_a(S - 1);
    lim_next = e.lim;
    rid_next = stage_b(e.tok);
  }
  if (S < n_my) {
    const Ent e = stage_a(S);
    tok_ahead = e.tok;
    lim_ahead = e.lim;
  }
  // Advances the address pipeline once chunk kn is issued: resolves chunk kn + 1 (page id) and
  // loads chunk kn + 2's entry.
  auto advance = [&](int kn) {
    if (kn + 1 < n_my) {
      rid_next = stage_b(tok_ahead);
      lim_next = lim_ahead;
    }
    if (kn + 2 < n_my) {
      const Ent e = stage_a(kn + 2);
      tok_ahead = e.tok;
      lim_ahead = e.lim;
    }
  };
  const unsigned long long t_issued = a.trace ? global_ns() : 0;
  if constexpr (SKIP) cp_async_wait<2 * S - 3>();  // Q (group 0) has landed
  else cp_async_wait<S - 2>();
  __syncthreads();

  uint32_t qa[D / 16][4];
  {
    const int mi = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int r = (lane & 7) + ((mi & 1) ? 8 : 0);
      const int col = kk * 16 + ((mi & 2) ? 8 : 0);
      ldsm_x4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], sQ + swz<D>(r, col));
    }
  }
  const bool hi_rows = G > 8;
  float o[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nd][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = a.scale_log2;
  const int mi = lane >> 3;

  // S = Q K^T of the chunk in bK: raw products, even k-steps in s, odd in s2.
  auto qk = [&](const unsigned char* bK, float (&s)[kTK / 8][4], float (&s2)[kTK / 8][4]) {
#pragma unroll
    for (int nb = 0; nb < kTK / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = 0.f, s2[nb][e] = 0.f;
#pragma unroll
    for (int k16 = 0; k16 < D / 16; ++k16) {
      const int r = (lane & 7) + ((mi & 2) ? 8 : 0);
      const int col = k16 * 16 + ((mi & 1) ? 8 : 0);
      uint32_t b0, b1, b2, b3;
      ldsm_x4(b0, b1, b2, b3, bK + swz<D>(r, col) * 2);
      if (k16 & 1) {
        mma16816(s2[0], qa[k16], b0, b1);
        mma16816(s2[1], qa[k16], b2, b3);
      } else {
        mma16816(s[0], qa[k16], b0, b1);
        mma16816(s[1], qa[k16], b2, b3);
      }
    }
  };
  // s <- (s + s2) in log2 units, columns >= lim masked; mx[i] = row maxima (rows lane/4 + 8i).
  auto scale_mask = [&](float (&s)[kTK / 8][4], const float (&s2)[kTK / 8][4], int lim,
                        float (&mx)[2]) { scale_mask_chunk<kTK>(s, s2, lim, sl2, hi_rows, mx); };
  // Online softmax of a scaled chunk (lazy rescale: the reference max moves only when a row
  // max exceeds it by 8), s <- p, then P packed to bf16 A fragments.
  auto softmax_pack = [&](float (&s)[kTK / 8][4], const float (&mx)[2], uint32_t (&pa)[4]) {
    online_softmax_chunk<D, kTK>(s, mx, m, l, o, hi_rows);
    pa[0] = pack_bf16(s[0][0], s[0][1]);
    pa[1] = pack_bf16(s[0][2], s[0][3]);
    pa[2] = pack_bf16(s[1][0], s[1][1]);
    pa[3] = pack_bf16(s[1][2], s[1][3]);
  };
  // O += P V of the chunk whose V rows are in bV.
  auto pv = [&](const uint32_t (&pa)[4], const unsigned char* bV) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      const int r = (lane & 7) + ((mi & 1) ? 8 : 0);
      const int col = dp * 16 + ((mi & 2) ? 8 : 0);
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(b0, b1, b2, b3, bV + swz<D>(r, col) * 2);
      mma16816(o[2 * dp], pa, b0, b1);
      mma16816(o[2 * dp + 1], pa, b2, b3);
    }
  };
  auto stage_ptr = [&](int st) {
    return reinterpret_cast<const unsigned char*>(ring + (warp * S + st) * C::kStage);
  };

  if constexpr (!SKIP) {
  int st_issue = S - 1, st_use = 0;
  for (int kk = 0; kk < n_my; ++kk) {
    __syncwarp();
    const int kn = kk + S - 1;
    if (kn < n_my) issue(st_issue, rid_next, lim_next, 3);
    lq[S - 1] = lim_next;
    cp_async_commit();
    advance(kn);
    const int lim = lq[0];
    cp_async_wait<S - 1>();
    __syncwarp();
    const unsigned char* bK = stage_ptr(st_use);
    float s[kTK / 8][4], s2[kTK / 8][4];
    qk(bK, s, s2);
    if (dense && a.scores_out) {  // CTA-uniform; a dense head's chunk c is tokens [16c, 16c + 16)
      store_group_mean_scores<kTK>(s, s2, sl2 * 0.6931471805599453f / float(G),
                                   a.scores_out + (int64_t(seq) * a.Hkv + kvh) * a.scores_ld,
                                   chunk_of(kk) * kTK, L);
    }
    float mx[2];
    scale_mask(s, s2, lim, mx);
    uint32_t pa[4];
    softmax_pack(s, mx, pa);
    pv(pa, bK + C::kTile * sizeof(bf16));
    st_issue = st_issue + 1 == S ? 0 : st_issue + 1;
    st_use = st_use + 1 == S ? 0 : st_use + 1;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) lq[s] = lq[s + 1];
  }
  } else {
    // BLASST (SKIP): a chunk is skipped when no query row of the group has a score within
    // thr (log2 lambda) of the running maximum of the kept chunks: no exp, no P V, and its V
    // rows are never loaded. P V runs one chunk behind (P of chunk kk waits in registers while
    // V_kk lands). Commit groups per iteration: [V_kk or empty] then [K_{kk+S-1}]; so K_kk is
    // complete when <= 2S-4 groups are pending and V_{kk-1} when <= 3 are (after iteration
    // kk's two commits). K_{kk+S-1} goes to stage (kk-1) % S, whose V half still holds
    // V_{kk-1}: the halves are disjoint. No seed: each warp's first chunk is always kept.
    const int sel_tok = dense ? L : TOKEN ? n_ent
                        : min(L, n_ent * (a.gran == int(SelGran::Block64) ? 64 : 16));
    const float thr = a.skip_per_length
                          ? fminf(0.f, a.skip_log2 - log2f(float(max(1, a.skip_len_selected ? sel_tok : L))))
                          : a.skip_log2;
    float mt[2] = {-INFINITY, -INFINITY};
    uint32_t pend[4];
    bool have_pend = false;
    int st_use = 0, st_prev = S - 1;
    unsigned tiles = 0, skipped = 0;
    for (int kk = 0; kk < n_my; ++kk) {
      __syncwarp();  // every lane is done with iteration kk-1's shared-memory reads
      cp_async_wait<2 * S - 4>();
      __syncwarp();  // K_kk visible to the warp
      const unsigned char* bK = stage_ptr(st_use);
      float s[kTK / 8][4], s2[kTK / 8][4], mx[2];
      qk(bK, s, s2);
      scale_mask(s, s2, lq[0], mx);
      bool keep_row = false;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (i == 1 && !hi_rows) break;
        if ((lane >> 2) + 8 * i < G && !(mx[i] - fmaxf(mt[i], mx[i]) < thr)) keep_row = true;
      }
      const bool keep = __any_sync(0xffffffffu, keep_row);
      ++tiles;
      if (keep) {
        issue(st_use, ridq[0], lq[0], 2);
        mt[0] = fmaxf(mt[0], mx[0]);
        mt[1] = fmaxf(mt[1], mx[1]);
      } else {
        ++skipped;
      }
      cp_async_commit();  // [V_kk] (empty when skipped)
      const int kn = kk + S - 1;
      if (kn < n_my) issue(st_prev, rid_next, lim_next, 1);
      lq[S - 1] = lim_next;
      ridq[S - 1] = rid_next;
      cp_async_commit();  // [K_{kk+S-1}]
      advance(kn);
      if (have_pend) {  // O += P_{kk-1} V_{kk-1}, before chunk kk may rescale O
        cp_async_wait<3>();
        __syncwarp();
        pv(pend, stage_ptr(st_prev) + C::kTile * sizeof(bf16));
      }
      have_pend = keep;
      if (keep) softmax_pack(s, mx, pend);
      st_prev = st_use;
      st_use = st_use + 1 == S ? 0 : st_use + 1;
#pragma unroll
      for (int s = 0; s < S - 1; ++s) lq[s] = lq[s + 1], ridq[s] = ridq[s + 1];
    }
    if (have_pend) {
      cp_async_wait<0>();
      __syncwarp();
      pv(pend, stage_ptr(st_prev) + C::kTile * sizeof(bf16));
    }
    if (a.skip_counts && lane == 0) {
      atomicAdd(a.skip_counts + 2 * kvh, (unsigned long long)tiles);
      atomicAdd(a.skip_counts + 2 * kvh + 1, (unsigned long long)skipped);
    }
  }
  cp_async_wait<0>();
  const unsigned long long t_loop = a.trace ? global_ns() : 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }

  // Merge the W warps (rows < G) through shared memory, then the split combine by the last CTA
  // of this (request, KV head) to finish.
  const int64_t row_base = int64_t(seq) * a.Hq + kvh * G;
  // Split partials are indexed by work item, [item][G][D] (item = this CTA in the launch; the
  // splits of a (request, KV head) are consecutive items), so the buffer holds one slot per
  // item of a launch rather than max_split x (B * Hq) rows.
  const bool split_mode = nsplit > 1;
  merge_warps_store<D, W>(o, m, l, smem_raw, G, split_mode ? 0 : row_base,
                          split_mode ? int(blockIdx.x) : 0, nsplit, G, a.out, a.part_o, a.part_lse);
  // Diagnostics: warp 0's stamps (entry, past the PDL wait, prologue issued, its chunk loop
  // done, warps merged, end) + the SM id; the end is rewritten by the CTA that combines.
  auto stamp = [&](unsigned long long t_end, bool combined) {
    if (!a.trace || tid != 0) return;
    unsigned long long* tr = a.trace + 8 * size_t(blockIdx.x);
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    tr[0] = t_entry, tr[1] = t_wait, tr[2] = t_issued, tr[3] = t_loop;
    tr[5] = t_end, tr[6] = smid | (unsigned long long)(combined) << 32, tr[7] = n_cta;
  };
  const unsigned long long t_merged = a.trace ? global_ns() : 0;
  if (a.trace && tid == 0) a.trace[8 * size_t(blockIdx.x) + 4] = t_merged;
  if (nsplit == 1) {
    stamp(t_merged, false);
    return;
  }
  int* counter = a.counters + seq * a.Hkv + kvh;
  if (!last_split_cta(counter, nsplit, s_last)) {
    stamp(t_merged, false);
    return;
  }
  combine_splits<D, NT>(a.part_o, a.part_lse, G, int64_t(int(blockIdx.x) - split) * G, nsplit, G,
                        a.out, smem_raw, counter, row_base);
  if (a.trace) {  // launch-uniform
    __syncthreads();
    stamp(global_ns(), true);
  }
}

constexpr int kW = 4, kS = 3;
// D = 128 with a 3-stage ring takes 101 KB of shared memory, 2 KB past what sm_86 / 89 give a
// block: there the ring has 2 stages (69 KB). Every other GPU (and D = 64) runs 3.
bool two_stage(int D) { return D == 128 && SpCfg<128, kW, kS>::kSmem > smem_optin_bytes(); }

// Raises the instance's dynamic shared-memory limit (once). Must run before an occupancy
// query too: without it the query answers for the default 48 KB limit (0 CTAs/SM), and a plan
// made before the first launch cut its work into other splits than every later plan (a
// different summation order: not bit-identical).
template <int D, int S, bool TOKEN, bool SKIP>
void prepare_one() {
  static PerDeviceOnce done;  // per device: tensor-parallel ranks as threads (per_device.h)
  if (done.pending()) {
    set_max_dynamic_smem(sparse_decode_kernel<D, kW, S, TOKEN, SKIP>, SpCfg<D, kW, S>::kSmem);
    done.mark();
  }
}

template <int D, int S, bool TOKEN, bool SKIP>
void launch_one(const SpArgs& a, int n_items, cudaStream_t s) {
  using C = SpCfg<D, kW, S>;
  prepare_one<D, S, TOKEN, SKIP>();
  launch_pdl(sparse_decode_kernel<D, kW, S, TOKEN, SKIP>, n_items, C::kThreads, C::kSmem, s, a);
  SPADE_CUDA_LAUNCH();
}

template <int D, int S>
void launch_ds(const SpArgs& a, bool tok, bool skip, int n, cudaStream_t s) {
  if (skip) tok ? launch_one<D, S, true, true>(a, n, s) : launch_one<D, S, false, true>(a, n, s);
  else tok ? launch_one<D, S, true, false>(a, n, s) : launch_one<D, S, false, false>(a, n, s);
}

template <int D>
void launch_d(const SpArgs& a, bool tok, bool skip, int n, cudaStream_t s) {
  if constexpr (D == 128) {
    if (two_stage(D)) return launch_ds<D, 2>(a, tok, skip, n, s);
  }
  launch_ds<D, kS>(a, tok, skip, n, s);
}

// CTAs of the sparse kernel (token instance) per SM, and the work items one launch may hold:
// the planner's items fit the CTA slots of the waves that hold one item per list (so at most
// max(lists, slots) rounded up to whole waves); forced split counts (benchmarks) up to 32 per
// list.
int sparse_ctas_per_sm(int D) {
  int n = 0;
  if (two_stage(D)) {
    prepare_one<128, 2, true, false>();
    SPADE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, sparse_decode_kernel<128, kW, 2, true, false>,
                                                             kW * 32, SpCfg<128, kW, 2>::kSmem));
  } else if (D == 128) {
    prepare_one<128, kS, true, false>();
    SPADE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, sparse_decode_kernel<128, kW, kS, true, false>,
                                                             kW * 32, SpCfg<128, kW, kS>::kSmem));
  } else {
    prepare_one<64, kS, true, false>();
    SPADE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, sparse_decode_kernel<64, kW, kS, true, false>,
                                                             kW * 32, SpCfg<64, kW, kS>::kSmem));
  }
  return std::max(n, 1);
}
int64_t launch_items_bound(int64_t lists, int max_split, int D) {
  const int64_t slots = int64_t(sm_count()) * sparse_ctas_per_sm(D);
  return std::min<int64_t>(lists * max_split, std::max((lists + slots - 1) / slots * slots, lists * 32));
}
int64_t align4(int64_t n) { return (n + 3) / 4 * 4; }

}  // namespace

size_t SparseAttention::arena_bytes(int max_batch, int64_t max_pages, int Hq, int Hkv, int D,
                                    int max_split, int max_patterns) {
  const int64_t lists = int64_t(max_batch) * Hkv, G = Hq / Hkv;
  const int64_t items = launch_items_bound(lists, max_split, D);
  const int64_t meta = align4(max_pages) + 2 * align4(max_batch) + 4 * items * max_patterns;
  return size_t(meta + lists + items * G * (D + 1)) * 4 + 4 * 256;  // + alignment of 4 arrays
}

SparseAttention::SparseAttention(DeviceArena& arena, int max_batch, int64_t max_pages, int Hq,
                                 int Hkv, int D, int P, int max_split, int max_patterns)
    : Hq_(Hq), Hkv_(Hkv), D_(D), P_(P), max_batch_(max_batch), max_split_(max_split),
      max_patterns_(max_patterns), max_pages_(max_pages) {
  SPADE_CHECK(max_patterns >= 1, "sparse attention: max_patterns must be >= 1");
  SPADE_CHECK(D == 64 || D == 128, "sparse attention: head dim ", D, " (64 or 128 supported)");
  SPADE_CHECK(Hq % Hkv == 0 && Hq / Hkv <= 16, "sparse attention: G = Hq / Hkv must be <= 16");
  SPADE_CHECK(max_split >= 1 && max_split <= 1024, "sparse attention: max_split");
  ctas_per_sm_ = sparse_ctas_per_sm(D);
  // Work items per launch (pattern) and split partial slots (one per item of a launch).
  part_items_ = launch_items_bound(int64_t(max_batch) * Hkv, max_split, D);
  const int64_t max_items = part_items_ * max_patterns;
  // Fixed offsets (the arrays' device addresses do not move between plans, so a captured
  // CUDA graph stays valid): page table | page offsets | lengths | work items.
  off_pt_ = 0;
  off_po_ = align4(max_pages);
  off_len_ = off_po_ + align4(max_batch);
  off_items_ = off_len_ + align4(max_batch);
  meta_cap_ = size_t(off_items_ + 4 * max_items);
  meta_dev_ = arena.alloc_n<int32_t>(meta_cap_, "sparse attention metadata");
  SPADE_CUDA(cudaMallocHost(&meta_host_, meta_cap_ * sizeof(int32_t)));
  counters_ = arena.alloc_n<int>(size_t(max_batch) * Hkv, "sparse attention split counters");
  SPADE_CUDA(cudaMemset(counters_, 0, sizeof(int) * size_t(max_batch) * Hkv));
  const size_t G = size_t(Hq / Hkv);
  part_o_ = arena.alloc_n<float>(size_t(part_items_) * G * D, "sparse attention split partials");
  part_lse_ = arena.alloc_n<float>(size_t(part_items_) * G, "sparse attention split lse");
}


void SparseAttention::plan(const std::vector<SparseSeq>& batch, SelGran gran, int lists_per_req,
                           const std::vector<int>& max_entries,
                           const std::vector<uint8_t>* dense_heads, cudaStream_t s,
                           int force_split) {
  one_pattern_.resize(1);
  if (dense_heads) one_pattern_[0] = *dense_heads;
  else one_pattern_[0].assign(size_t(Hkv_), 0);
  plan_patterns(batch, gran, lists_per_req, max_entries, one_pattern_, s, force_split);
}

void SparseAttention::plan_patterns(const std::vector<SparseSeq>& batch, SelGran gran,
                                    int lists_per_req, const std::vector<int>& max_entries,
                                    const std::vector<std::vector<uint8_t>>& patterns,
                                    cudaStream_t s, int force_split) {
  const int B = int(batch.size());
  SPADE_CHECK(!patterns.empty() && int(patterns.size()) <= max_patterns_, "sparse attention: ",
              patterns.size(), " dense-head patterns, outside [1, ", max_patterns_, "]");
  SPADE_CHECK(B >= 1 && B <= max_batch_, "sparse attention: batch ", B, " outside [1, ", max_batch_, "]");
  SPADE_CHECK(lists_per_req == 1 || lists_per_req == Hkv_, "sparse attention: lists_per_req must be 1 or Hkv");
  SPADE_CHECK(int(max_entries.size()) == B * lists_per_req, "sparse attention: max_entries size");
  SPADE_CHECK(gran == SelGran::Token || P_ % 16 == 0,
              "sparse attention: page/block selections need P % 16 == 0");
  bool any_dense = false;
  for (const auto& pat : patterns) {
    SPADE_CHECK(int(pat.size()) == Hkv_, "sparse attention: dense_heads size");
    for (uint8_t d : pat) any_dense |= d != 0;
  }
  SPADE_CHECK(!any_dense || P_ % 16 == 0, "sparse attention: dense heads need P % 16 == 0");
  B_ = B;
  lists_per_req_ = lists_per_req;
  gran_ = gran;
  int64_t tot_pages = 0;
  for (auto& q : batch) tot_pages += q.n_pages;
  SPADE_CHECK(tot_pages <= max_pages_, "sparse attention: ", tot_pages, " pages > max ", max_pages_);
  int64_t o = 0;
  for (int b = 0; b < B; ++b) {
    meta_host_[off_po_ + b] = int32_t(o);
    meta_host_[off_len_ + b] = batch[b].kv_len;
    for (int i = 0; i < batch[b].n_pages; ++i) meta_host_[off_pt_ + o + i] = batch[b].pages[i];
    o += batch[b].n_pages;
  }
  const int64_t slots = int64_t(sm_count()) * ctas_per_sm();
  int n_items = 0;
  max_split_used_ = 0;
  pattern_first_.clear();
  pattern_count_.clear();
  for (const auto& pat : patterns) {
    // Chunk counts per (request, head): the work the planner balances.
    nch_.assign(size_t(B) * Hkv_, 0);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv_; ++h) {
        int c;
        // Dense heads: planned as if the context were rounded up to 1024 tokens (the kernel
        // reads the real length), so the work items, and a CUDA graph keyed by their count,
        // change only every 1024 decoded tokens.
        if (pat[size_t(h)]) c = ((batch[b].kv_len + 15) / 16 + 63) / 64 * 64;
        else {
          const int e = max_entries[size_t(b) * lists_per_req + (lists_per_req == 1 ? 0 : h)];
          c = gran == SelGran::Token ? (e + 15) / 16 : gran == SelGran::Block64 ? 4 * e : e;
        }
        nch_[size_t(b) * Hkv_ + h] = c;
      }
    // Equal work items: the smallest chunks-per-item t >= 8 whose items fit in W waves of CTA
    // slots, W = the fewest waves that can hold one item per (request, head). Each head gets
    // ceil(chunks / t) splits, so dense heads get proportionally more and a mix of dense and
    // sparse heads ends together (LycheeDecode appendix C), and no wave runs a few stragglers.
    const int64_t n_lists = int64_t(B) * Hkv_;
    const int64_t cap = ((n_lists + slots - 1) / slots) * slots;
    auto items_for = [&](int64_t t) {
      int64_t n = 0;
      for (int c : nch_) n += std::min<int64_t>(max_split_, std::max<int64_t>(1, (c + t - 1) / t));
      return n;
    };
    int64_t lo = 8, hi = std::max<int64_t>(8, *std::max_element(nch_.begin(), nch_.end()));
    if (items_for(lo) > cap) {
      while (lo < hi) {  // smallest t in (lo, hi] with items_for(t) <= cap
        const int64_t mid = (lo + hi) / 2;
        if (items_for(mid) <= cap) hi = mid;
        else lo = mid + 1;
      }
    }
    const int64_t target = lo;
    pattern_first_.push_back(n_items);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv_; ++h) {
        const int c = nch_[size_t(b) * Hkv_ + h];
        const int64_t per = deterministic_ ? kInvariantChunks : target;
        int ns = force_split > 0 ? force_split : int(std::max<int64_t>(1, (c + per - 1) / per));
        ns = std::min(ns, max_split_);
        max_split_used_ = std::max(max_split_used_, ns);
        const bool dn = pat[size_t(h)] != 0;
        for (int sp = 0; sp < ns; ++sp) {
          SPADE_CHECK(off_items_ + 4 * (n_items + 1) <= int64_t(meta_cap_), "sparse attention: too many items");
          int32_t* it = meta_host_ + off_items_ + 4 * n_items;
          it[0] = b;
          it[1] = h | (dn ? 1 << 16 : 0);
          it[2] = sp;
          it[3] = ns;
          ++n_items;
        }
      }
    pattern_count_.push_back(n_items - pattern_first_.back());
    SPADE_CHECK(pattern_count_.back() <= part_items_, "sparse attention: ", pattern_count_.back(),
                " work items > the ", part_items_, " split partial slots (force_split too large",
                deterministic_ ? ", or a deterministic batch too large for its fixed splits" : "", ")");
  }
  n_items_ = pattern_count_[0];
  SPADE_CUDA(cudaMemcpyAsync(meta_dev_, meta_host_, sizeof(int32_t) * size_t(tot_pages),
                             cudaMemcpyHostToDevice, s));
  SPADE_CUDA(cudaMemcpyAsync(meta_dev_ + off_po_, meta_host_ + off_po_,
                             sizeof(int32_t) * size_t(off_items_ - off_po_ + 4 * n_items),
                             cudaMemcpyHostToDevice, s));
}

void SparseAttention::run(const bf16* q, const bf16* k_cache, const bf16* v_cache,
                          const int32_t* sel_off, const int32_t* sel_idx, bf16* out, float scale,
                          cudaStream_t s, int pattern, float* dense_scores,
                          int64_t scores_ld, const SelSkip& skip, const int32_t* sel_cnt) const {
  SPADE_CHECK(pattern >= 0 && pattern < int(pattern_first_.size()), "sparse attention: pattern ",
              pattern, " was not planned");
  SPADE_CHECK(!dense_scores || scores_ld > 0, "sparse attention: scores need a row stride");
  SPADE_CHECK(!(skip.active() && dense_scores), "sparse attention: BLASST skipping and dense-head "
              "score emission do not run together");
  // A fixed threshold is ln(lambda) <= 0; with per_length it is ln(a), any value (the kernel
  // caps ln(a) - ln(length) at 0).
  SPADE_CHECK(skip.log_lambda <= 0.f || !skip.active() || skip.per_length,
              "sparse attention: ln lambda ", skip.log_lambda, " must be <= 0");
  SpArgs a{};
  a.scores_out = dense_scores;
  a.scores_ld = scores_ld;
  a.q = q;
  a.out = out;
  a.k = k_cache;
  a.v = v_cache;
  a.page_table = meta_dev_ + off_pt_;
  a.page_off = meta_dev_ + off_po_;
  a.kv_len = meta_dev_ + off_len_;
  a.sel_off = sel_off;
  a.sel_idx = sel_idx;
  a.sel_cnt = sel_cnt;
  a.items = reinterpret_cast<const int4*>(meta_dev_ + off_items_) + pattern_first_[size_t(pattern)];
  a.part_o = part_o_;
  a.part_lse = part_lse_;
  a.counters = counters_;
  a.Hq = Hq_;
  a.Hkv = Hkv_;
  a.G = Hq_ / Hkv_;
  a.P = P_;
  a.lists_per_req = lists_per_req_;
  a.gran = int(gran_);
  a.scale_log2 = scale * 1.4426950408889634f;
  a.skip_log2 = skip.log_lambda * 1.4426950408889634f;
  a.skip_per_length = skip.per_length ? 1 : 0;
  a.skip_len_selected = skip.length_selected ? 1 : 0;
  a.skip_counts = skip.counts;
  a.trace = trace_;
  const bool tok = gran_ == SelGran::Token;
  const int n = pattern_count_[size_t(pattern)];
  if (D_ == 128) launch_d<128>(a, tok, skip.active(), n, s);
  else launch_d<64>(a, tok, skip.active(), n, s);
}

}  // namespace spade::cuda

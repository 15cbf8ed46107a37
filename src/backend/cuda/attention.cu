// Paged full attention: the workspace (planning; the decode kernel and split choice are in
// attention_schedule.cu) and the generic mma.sync kernel (see attention.h for the API). The fast paths live beside it: attention_decode.cu
// (v3/v4 decode, the default) and attention_prefill.cu (wgmma prefill, D = 128 on Hopper); the
// generic kernel below is the v2 decode (kept for comparison: set_decode_kernel(0)) and the
// prefill for D = 64 or devices without sm_90a code.
//
// Layout read: q bf16 [T, Hq, D]; K/V bf16 pages [page][Hkv][P][D] (one page of one head is
// P*D*2 contiguous bytes: 4 KB at P=16, D=128); page table int32 per sequence.
// Layout written: out bf16 [T, Hq, D]; for split decode (v2), partials fp32 [split][T*Hq][D]
// and log2-sum-exp [split][T*Hq], combined by a second kernel.
//
// Work: a CTA = (work item, KV head). An item is (sequence, first packed row, split). Rows
// of the tile are packed (token, group head) pairs: row p -> token p / G, head kvh*G + p % G,
// so the group's query heads share every K/V tile read from HBM.
//   decode : 1 warp-row of 16 rows (G <= 16 heads of one token), 4 warps split each 64-token
//            tile 4 ways (independent online softmax per warp, merged in shared memory at
//            the end), 3-stage cp.async pipeline (96 KB smem at D=128, 2 CTAs / SM);
//            split-KV count chosen so (batch x Hkv x splits) fills one wave of CTAs.
//   prefill: 4 warps x 32 rows (two m16 tiles per warp reuse each K/V fragment), 64-token
//            tiles, 2 stages; causal mask only on the diagonal tiles. BLASST (SKIP instance):
//            each warp votes per tile after S and the mask; a skipped tile costs S only (its
//            K/V rows are loaded for the CTA anyway: 4 B x BN x D per tile, shared by 4 warps).
// Napkin math (Llama-3-8B shapes Hq=32, Hkv=8, D=128): decode at 32K reads
// 32768*8*128*2*2 = 134 MB of K/V per sequence and layer -> 45 us at 3.0 TB/s; FLOPs are
// 4*32*32768*128 = 0.54 GFLOP, nothing for the tensor cores (16-row tiles pad G=4 to 16).
// Prefill 8K causal: 4*8192^2/2*128*32 = 550 GFLOP -> ~1.4 ms at 400 TFLOP/s.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend/cuda/attention.h"
#include "core/tuning.h"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
namespace {
using namespace attn_detail;

template <int D, int WM, int WN, int MT, int BN, int STAGES>
struct Cfg {
  static constexpr int kThreads = WM * WN * 32;
  static constexpr int BM = 16 * MT * WM;  // rows per CTA
  static constexpr int SN = BN / WN;       // tokens per warp per tile
  static constexpr int kTileElems = BN * D;
  static constexpr size_t kSmem =
      size_t(BM * D + 2 * STAGES * kTileElems) * sizeof(bf16) + 2 * (BN + 1) * sizeof(int);
  static constexpr size_t kMergeSmem = size_t(WM * WN * 16 * MT * (D + 2)) * sizeof(float);
  static constexpr size_t kSmemTotal = kSmem > kMergeSmem ? kSmem : kMergeSmem;
  static_assert(SN % 16 == 0, "warp token slice must be a multiple of 16");
};

template <int D, int WM, int WN, int MT, int BN, int STAGES, bool SKIP = false>
__global__ void __launch_bounds__(WM* WN * 32)
    attn_kernel(const AttnArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  using C = Cfg<D, WM, WN, MT, BN, STAGES>;
  constexpr int BM = C::BM, SN = C::SN, NT = C::kThreads, CH = D / 8;
  static_assert(!SKIP || WN == 1, "BLASST skipping: one warp per row group (the prefill shape)");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + BM * D;
  bf16* sV = sK + STAGES * C::kTileElems;
  int* sPg = reinterpret_cast<int*>(sV + STAGES * C::kTileElems);  // [2][BN + 1] page ids

  const int4 item = a.items[blockIdx.x];
  const int seq = item.x, row0 = item.y, split = item.z;
  const int kvh = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp / WN, wn = warp % WN;
  const int G = a.G;

  const int q0 = a.q_off[seq], Tq = a.q_off[seq + 1] - q0;
  const int L = a.kv_len[seq];
  const int* pt = a.page_table + a.page_off[seq];
  const int n_rows = Tq * G;
  // Keys the CTA may need: up to the last valid row's position.
  const int t_last = min((row0 + BM - 1) / G, Tq - 1);
  const int t_first = row0 / G;
  const int n_keys = L - Tq + t_last + 1;
  const int min_limit = L - Tq + t_first + 1;  // keys visible to every row of the CTA
  const int n_tiles_all = (n_keys + BN - 1) / BN;
  const int per = (n_tiles_all + a.nsplit - 1) / a.nsplit;
  const int tile_begin = split * per;
  const int tile_end = min(n_tiles_all, tile_begin + per);
  const int n_tiles = max(0, tile_end - tile_begin);
  // BLASST threshold (log2 units): fixed, or lambda = a / L with L = this chunk's end (p0 + T).
  const float thr = a.skip_per_length ? fminf(0.f, a.skip_log2 - log2f(float(L))) : a.skip_log2;
  uint32_t n_skip = 0;  // SKIP: tiles this warp skipped

  const int64_t head_stride = int64_t(a.P) * D;         // one head of one page
  const int64_t page_stride = int64_t(a.Hkv) * head_stride;

  // Q tile: BM packed rows -> sQ (zero rows beyond the sequence).
  for (int idx = tid; idx < BM * CH; idx += NT) {
    const int r = idx / CH, c = idx % CH;
    const int p = row0 + r;
    const bool valid = p < n_rows;
    const int t = valid ? p / G : 0, g = valid ? p % G : 0;
    const bf16* src = a.q + (int64_t(q0 + t) * a.Hq + kvh * G + g) * D + c * 8;
    cp_async16(sQ + swz<D>(r, c * 8), valid ? src : a.q, valid);
  }
  // Page ids: a tile's ids are read from global memory one iteration before the tile's
  // loads are issued (held in a register across the compute), then parked in a 2-slot
  // shared ring, so no cp.async waits on a dependent page-table load.
  const int P = a.P;
  const int p_shift = (P & (P - 1)) == 0 ? __ffs(P) - 1 : -1;
  auto pdiv = [&](int j) { return p_shift >= 0 ? j >> p_shift : j / P; };
  auto pmod = [&](int j) { return p_shift >= 0 ? j & (P - 1) : j % P; };
  auto tile_pages = [&](int tile, int& first) {
    const int kv0 = tile * BN;
    first = pdiv(kv0);
    return pdiv(min(kv0 + BN, n_keys) - 1) - first + 1;
  };
  auto load_tile = [&](int tile, int stage, const int* ids) {  // ids: null -> global table
    const int kv0 = tile * BN;
    const int first = pdiv(kv0);
    bf16* dk = sK + stage * C::kTileElems;
    bf16* dv = sV + stage * C::kTileElems;
    for (int idx = tid; idx < BN * CH; idx += NT) {
      const int r = idx / CH, c = idx % CH;
      const int j = kv0 + r;
      const bool valid = j < n_keys;
      int64_t off = 0;
      if (valid) {
        const int pg = ids ? ids[pdiv(j) - first] : pt[pdiv(j)];
        off = pg * page_stride + kvh * head_stride + int64_t(pmod(j)) * D + c * 8;
      }
      cp_async16(dk + swz<D>(r, c * 8), a.k + off, valid);
      cp_async16(dv + swz<D>(r, c * 8), a.v + off, valid);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) load_tile(tile_begin + s, s, nullptr);
    cp_async_commit();
  }
  if (STAGES - 1 < n_tiles) {
    int first;
    const int np = tile_pages(tile_begin + STAGES - 1, first);
    for (int i = tid; i < np; i += NT) sPg[((STAGES - 1) & 1) * (BN + 1) + i] = pt[first + i];
  }
  __syncthreads();

  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) m[mt][i] = -INFINITY, l[mt][i] = 0.f;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nd][e] = 0.f;
  }
  const int g8 = lane >> 2, t4 = lane & 3;
  // Per-thread row limits (keys visible), for the 2 rows of each m16 tile it holds.
  int lim[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = (wm * MT + mt) * 16 + g8 + 8 * i;
      const int t = min((row0 + r) / G, Tq - 1);
      lim[mt][i] = L - Tq + t + 1;
    }

  for (int it = 0; it < n_tiles; ++it) {
    const int pre = it + STAGES - 1;
    if (pre < n_tiles) load_tile(tile_begin + pre, pre % STAGES, sPg + (pre & 1) * (BN + 1));
    cp_async_commit();
    // Prefetch the page ids of tile it + STAGES (parked in the ring after the compute).
    const int nxt = it + STAGES;
    int pf_first = 0, pf_np = 0, pf_id = 0;
    if (nxt < n_tiles) {
      pf_np = tile_pages(tile_begin + nxt, pf_first);
      if (tid < pf_np) pf_id = pt[pf_first + tid];
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const int stage = it % STAGES;
    const bf16* tK = sK + stage * C::kTileElems;
    const bf16* tV = sV + stage * C::kTileElems;
    const int kv0 = (tile_begin + it) * BN;
    const int tb = wn * SN;  // this warp's token slice within the tile

    float s[MT][SN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < SN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nb][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int mi = lane >> 3;
        const int r = (wm * MT + mt) * 16 + (lane & 7) + ((mi & 1) ? 8 : 0);
        const int col = kk * 16 + ((mi & 2) ? 8 : 0);
        ldsm_x4(qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], sQ + swz<D>(r, col));
      }
#pragma unroll
      for (int np = 0; np < SN / 16; ++np) {
        const int mi = lane >> 3;
        const int r = tb + np * 16 + (lane & 7) + ((mi & 2) ? 8 : 0);
        const int col = kk * 16 + ((mi & 1) ? 8 : 0);
        uint32_t b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, tK + swz<D>(r, col));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(s[mt][2 * np], qa[mt], b0, b1);
          mma16816(s[mt][2 * np + 1], qa[mt], b2, b3);
        }
      }
    }
    // Mask (only tiles that reach past the keys every row may see) and the rows' tile maxima.
    const bool need_mask = kv0 + tb + SN > min_limit;
    float tmx[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < SN / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[mt][nb][2 * i + e] * a.scale_log2;
            if (need_mask) {
              const int j = kv0 + tb + nb * 8 + 2 * t4 + e;
              if (j >= lim[mt][i]) x = -INFINITY;
            }
            s[mt][nb][2 * i + e] = x;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        tmx[mt][i] = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      }
    }
    // BLASST (prefill): the warp skips the tile when every one of its rows has tile max -
    // max(running max, tile max) < log2(lambda); rows past the item and rows that see no key
    // of the tile do not object. A skipped tile leaves m, l and O alone: no exp, row sum,
    // rescale or P V (its K and V rows were loaded for the whole CTA all the same).
    bool skip = false;
    if constexpr (SKIP) {
      bool v = true;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = (wm * MT + mt) * 16 + g8 + 8 * i;
          const float mx = tmx[mt][i];
          v = v && (row0 + r >= n_rows || mx == -INFINITY || mx - fmaxf(m[mt][i], mx) < thr);
        }
      skip = __all_sync(0xffffffffu, v);
      n_skip += skip;
    }
    if (!skip) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float m_new = fmaxf(m[mt][i], tmx[mt][i]);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          const float alpha = exp2f(m[mt][i] - m_use);
          float rs = 0.f;
#pragma unroll
          for (int nb = 0; nb < SN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = exp2f(s[mt][nb][2 * i + e] - m_use);
              s[mt][nb][2 * i + e] = p;
              rs += p;
            }
          l[mt][i] = l[mt][i] * alpha + rs;
          m[mt][i] = m_new;
#pragma unroll
          for (int nd = 0; nd < D / 8; ++nd) {
            o[mt][nd][2 * i] *= alpha;
            o[mt][nd][2 * i + 1] *= alpha;
          }
        }
      }
      // O += P V over this warp's token slice.
#pragma unroll
      for (int k2 = 0; k2 < SN / 16; ++k2) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = pack_bf16(s[mt][2 * k2][0], s[mt][2 * k2][1]);
          pa[mt][1] = pack_bf16(s[mt][2 * k2][2], s[mt][2 * k2][3]);
          pa[mt][2] = pack_bf16(s[mt][2 * k2 + 1][0], s[mt][2 * k2 + 1][1]);
          pa[mt][3] = pack_bf16(s[mt][2 * k2 + 1][2], s[mt][2 * k2 + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          const int mi = lane >> 3;
          const int r = tb + k2 * 16 + (lane & 7) + ((mi & 1) ? 8 : 0);
          const int col = dp * 16 + ((mi & 2) ? 8 : 0);
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(b0, b1, b2, b3, tV + swz<D>(r, col));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma16816(o[mt][2 * dp], pa[mt], b0, b1);
            mma16816(o[mt][2 * dp + 1], pa[mt], b2, b3);
          }
        }
      }
    }  // !skip
    if (tid < pf_np) sPg[(nxt & 1) * (BN + 1) + tid] = pf_id;
    __syncthreads();
  }
  cp_async_wait<0>();
  if constexpr (SKIP) {
    if (a.skip_counts && lane == 0) {
      // Tiles the warp's rows see: t * BN < the causal limit of its last valid row. Those past
      // it (the diagonal end of the item) had every vote "skip": not counted.
      const int first = row0 + wm * MT * 16, last = min(first + MT * 16 - 1, n_rows - 1);
      const int keys = first < n_rows ? L - Tq + last / G + 1 : 0;
      const int seen = (keys + BN - 1) / BN;
      atomicAdd(a.skip_counts + 2 * kvh, (unsigned long long)seen);
      atomicAdd(a.skip_counts + 2 * kvh + 1, (unsigned long long)(n_skip - (n_tiles - seen)));
    }
  }

  // Row sums across the quad.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[mt][i] += __shfl_xor_sync(0xffffffffu, l[mt][i], 1);
      l[mt][i] += __shfl_xor_sync(0xffffffffu, l[mt][i], 2);
    }

  auto emit = [&](int r, int d, float val_over_l, float lse2, bool write_lse) {
    // r: CTA row, d: column; val already normalized.
    const int p = row0 + r;
    if (p >= n_rows) return;
    const int t = p / G, g = p % G;
    const int64_t gr = int64_t(q0 + t) * a.Hq + kvh * G + g;
    if (a.nsplit == 1) {
      a.out[gr * D + d] = __float2bfloat16(val_over_l);
    } else {
      a.part_o[(int64_t(split) * a.total_rows + gr) * D + d] = val_over_l;
      if (write_lse) a.part_lse[int64_t(split) * a.total_rows + gr] = lse2;
    }
  };

  if constexpr (WN == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = (wm * MT + mt) * 16 + g8 + 8 * i;
        const float inv = l[mt][i] > 0.f ? 1.f / l[mt][i] : 0.f;
        const float lse2 = l[mt][i] > 0.f ? m[mt][i] + log2f(l[mt][i]) : -INFINITY;
        const int p = row0 + r;
        if (p >= n_rows) continue;
        const int t = p / G, g = p % G;
        const int64_t gr = int64_t(q0 + t) * a.Hq + kvh * G + g;
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
          const int d = nd * 8 + 2 * t4;
          const float v0 = o[mt][nd][2 * i] * inv, v1 = o[mt][nd][2 * i + 1] * inv;
          if (a.nsplit == 1) {
            *reinterpret_cast<__nv_bfloat162*>(a.out + gr * D + d) = __floats2bfloat162_rn(v0, v1);
          } else {
            float* dst = a.part_o + (int64_t(split) * a.total_rows + gr) * D + d;
            dst[0] = v0;
            dst[1] = v1;
          }
        }
        if (a.nsplit > 1 && t4 == 0) a.part_lse[int64_t(split) * a.total_rows + gr] = lse2;
      }
  } else {
    // Merge the WN warps of each row group through shared memory (tiles are no longer read).
    constexpr int RW = 16 * MT;  // rows per warp
    float* sm = reinterpret_cast<float*>(smem_raw);
    float* sO = sm;                            // [warps][RW][D]
    float* sM = sO + WM * WN * RW * D;         // [warps][RW]
    float* sL = sM + WM * WN * RW;             // [warps][RW]
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int rr = mt * 16 + g8 + 8 * i;
        float* dst = sO + (warp * RW + rr) * D;
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
          dst[nd * 8 + 2 * t4] = o[mt][nd][2 * i];
          dst[nd * 8 + 2 * t4 + 1] = o[mt][nd][2 * i + 1];
        }
        if (t4 == 0) {
          sM[warp * RW + rr] = m[mt][i];
          sL[warp * RW + rr] = l[mt][i];
        }
      }
    __syncthreads();
    for (int idx = tid; idx < WM * RW * D; idx += NT) {
      const int d = idx % D, rw = idx / D;  // rw: row within the CTA
      const int wmi = rw / RW, rr = rw % RW;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < WN; ++w) mx = fmaxf(mx, sM[(wmi * WN + w) * RW + rr]);
      const float mu = mx == -INFINITY ? 0.f : mx;
      float num = 0.f, den = 0.f;
#pragma unroll
      for (int w = 0; w < WN; ++w) {
        const int wi = wmi * WN + w;
        const float sc = exp2f(sM[wi * RW + rr] - mu);
        num += sc * sO[(wi * RW + rr) * D + d];
        den += sc * sL[wi * RW + rr];
      }
      const float val = den > 0.f ? num / den : 0.f;
      const float lse2 = den > 0.f ? mu + log2f(den) : -INFINITY;
      emit(rw, d, val, lse2, d == 0);
    }
  }
}

// out[gr, :] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)
template <int D>
__global__ void combine_kernel(const float* part_o, const float* part_lse, bf16* out,
                               int nsplit, int64_t total_rows) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int64_t gr = blockIdx.x;
  float mx = -INFINITY;
  for (int s = 0; s < nsplit; ++s) mx = fmaxf(mx, part_lse[s * total_rows + gr]);
  const float mu = mx == -INFINITY ? 0.f : mx;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int s = 0; s < nsplit; ++s) {
      const float w = exp2f(part_lse[s * total_rows + gr] - mu);
      num += w * part_o[(s * total_rows + gr) * D + d];
      den += w;
    }
    out[gr * D + d] = __float2bfloat16(den > 0.f ? num / den : 0.f);
  }
}

// Kernel configurations: decode and prefill for D = 64 and 128.
template <int D> using DecodeCfg = Cfg<D, 1, 4, 1, 64, 3>;
// D=128 prefill uses 32-token tiles: with 64 the score registers push ptxas into spills.
template <int D> using PrefillCfg = Cfg<D, 4, 1, 2, (D == 128 ? 32 : 64), (D == 128 ? 3 : 2)>;
template <int D>
constexpr auto decode_v2_kernel = attn_kernel<D, 1, 4, 1, 64, 3>;
template <int D>
constexpr auto prefill_v2_kernel = attn_kernel<D, 4, 1, 2, (D == 128 ? 32 : 64), (D == 128 ? 3 : 2)>;
// BLASST tile skipping (per warp: 32 rows x BN keys).
template <int D>
constexpr auto prefill_v2_skip_kernel = attn_kernel<D, 4, 1, 2, (D == 128 ? 32 : 64), (D == 128 ? 3 : 2), true>;

template <typename K>
void set_smem(K kernel, size_t bytes) {
  set_max_dynamic_smem(kernel, int(bytes));
}

template <int D>
int decode_occupancy() {
  // (D = 128 needs 100 KB: not on sm_86 / 89, where only the v3 variants run; a v2 launch
  // there is refused in run().)
  if (DecodeCfg<D>::kSmemTotal > smem_optin_bytes()) return 1;
  set_smem(decode_v2_kernel<D>, DecodeCfg<D>::kSmemTotal);
  int n = 0;
  SPADE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n, decode_v2_kernel<D>, DecodeCfg<D>::kThreads, DecodeCfg<D>::kSmemTotal));
  return std::max(1, n);
}

int env_decode_kernel() {
  const int v = tuning().attn_decode;
  if (v < 0) return 1;
  SPADE_CHECK(v < 2 + decode_v3_count(), "SPADE_ATTN_DECODE must be in [0, ", 1 + decode_v3_count(),
              "], got ", v);
  return v;
}

}  // namespace

// Tensor maps of the K/V caches for the wgmma prefill's TMA loads, keyed by base pointer (one per
// layer and cache; encoded once, on the host).
struct AttentionWorkspace::TensorMaps {
  std::vector<std::pair<const void*, CUtensorMap>> maps;
  const CUtensorMap* get(const void* base, int D) {
    for (auto& m : maps)
      if (m.first == base) return &m.second;
    CUtensorMap t;
    if (!encode_kv_tensor_map(&t, base, D)) return nullptr;
    maps.emplace_back(base, t);
    return &maps.back().second;
  }
};

int AttentionWorkspace::variant_occupancy(int variant) const {
  if (variant == 0) return std::max(1, D_ == 64 ? decode_occupancy<64>() : decode_occupancy<128>());
  if (occ_cache_.size() < size_t(decode_v3_count() + 1)) occ_cache_.assign(decode_v3_count() + 1, 0);
  if (occ_cache_[variant] == 0) occ_cache_[variant] = std::max(1, decode_v3_occupancy(D_, variant));
  return occ_cache_[variant];
}

void AttentionWorkspace::set_prefill_kernel(int v) {
  SPADE_CHECK(v >= 0 && v <= 2, "attention: no prefill kernel ", v);
  prefill_kernel_ = v;
}
bool AttentionWorkspace::prefill_wgmma_active() const {
  return prefill_kernel_ >= 1 && prefill_wgmma_ok(D_);
}

bool AttentionWorkspace::decode_kernel_fits(int v, int D) {
  const size_t need = v == 1   ? 0
                      : v == 0 ? (D == 64 ? DecodeCfg<64>::kSmemTotal : DecodeCfg<128>::kSmemTotal)
                               : decode_v3_smem(D, v - 1);
  return need <= smem_optin_bytes();
}

void AttentionWorkspace::set_decode_kernel(int v) {
  SPADE_CHECK(v >= 0 && v < decode_kernel_count(), "attention: no decode kernel ", v);
  SPADE_CHECK(decode_kernel_fits(v, D_), "attention: decode kernel ", decode_kernel_name(v),
              " needs more shared memory per block than this GPU's ", smem_optin_bytes() >> 10,
              " KB at head_dim ", D_, " (auto picks one that fits)");
  decode_kernel_ = v;
}

size_t AttentionWorkspace::arena_bytes(const AttnLimits& lim, int Hq, int Hkv, int D) {
  // The constructor's allocations below, each rounded up to the arena's 256 bytes.
  const int64_t max_items = std::max<int64_t>(
      int64_t(lim.max_batch) * lim.max_split,
      lim.max_q_tokens * (Hq / std::max(1, Hkv)) / 16 + lim.max_batch);
  const size_t meta = align_up(size_t(lim.max_pages), 4) + 2 * align_up(size_t(lim.max_batch), 4) +
                      align_up(size_t(lim.max_batch + 1), 4) + size_t(4 * max_items);
  const size_t split_rows = size_t(lim.max_batch) * size_t(Hq);
  return align_up(meta * 4, 256) + align_up(size_t(lim.max_split) * split_rows * size_t(D) * 4, 256) +
         align_up(size_t(lim.max_split) * split_rows * 4, 256) +
         align_up(size_t(lim.max_batch) * size_t(Hkv) * 4, 256) +
         align_up(size_t(lim.max_batch) * size_t(Hkv) * kTicketStride * 4, 256);
}

AttentionWorkspace::AttentionWorkspace(DeviceArena& arena, const AttnLimits& lim, int Hq,
                                       int Hkv, int D, int P)
    : Hq_(Hq), Hkv_(Hkv), D_(D), P_(P), lim_(lim) {
  SPADE_CHECK(D == 64 || D == 128, "CUDA attention: head_dim ", D,
              " is not supported (64 and 128 are)");
  SPADE_CHECK(Hkv > 0 && Hq % Hkv == 0, "CUDA attention: ", Hq, " query heads are not a multiple of ",
              Hkv, " KV heads");
  SPADE_CHECK(Hq / Hkv <= 16, "CUDA attention: GQA group ", Hq / Hkv, " > 16 is not supported");
  // Work items: decode uses B * max_split; prefill uses sum over seqs of ceil(q*G/BM) <=
  // max_q_tokens*G/BM + B.
  const int64_t max_items = std::max<int64_t>(
      int64_t(lim.max_batch) * lim.max_split,
      lim.max_q_tokens * (Hq / Hkv) / 16 + lim.max_batch);
  off_page_table_ = 0;
  off_page_off_ = align_up(size_t(lim.max_pages), 4);
  off_kv_len_ = off_page_off_ + align_up(size_t(lim.max_batch), 4);
  off_q_off_ = off_kv_len_ + align_up(size_t(lim.max_batch), 4);
  off_items_ = off_q_off_ + align_up(size_t(lim.max_batch + 1), 4);
  meta_cap_ = size_t(off_items_ + 4 * max_items);
  meta_dev_ = arena.alloc_n<int32_t>(meta_cap_, "attention metadata");
  SPADE_CUDA(cudaMallocHost(&meta_host_, meta_cap_ * sizeof(int32_t)));
  const int64_t rows = lim.max_q_tokens * Hq;
  // Split partials exist only for decode steps (q_len == 1): rows <= max_batch * Hq.
  const int64_t split_rows = int64_t(lim.max_batch) * Hq;
  (void)rows;
  part_o_ = arena.alloc_n<float>(size_t(lim.max_split) * split_rows * D, "attention split partials");
  part_lse_ = arena.alloc_n<float>(size_t(lim.max_split) * split_rows, "attention split lse");
  counters_ = arena.alloc_n<int>(size_t(lim.max_batch) * Hkv, "attention split counters");
  SPADE_CUDA(cudaMemset(counters_, 0, sizeof(int) * size_t(lim.max_batch) * Hkv));
  // The DYN variants' chunk tickets, one L2 line each (kTicketStride).
  const size_t n_tickets = size_t(lim.max_batch) * Hkv * kTicketStride;
  tickets_ = arena.alloc_n<int>(n_tickets, "attention chunk tickets");
  SPADE_CUDA(cudaMemset(tickets_, 0, sizeof(int) * n_tickets));
  tmaps_ = std::make_unique<TensorMaps>();
  {  // TMA loads need Hopper or newer, pages of whole 16-row boxes and a driver that
     // encodes tensor maps
    CUtensorMap probe;
    tma_ok_ = cc_major() >= 9 && tuning().tma && P % 16 == 0 &&
              encode_kv_tensor_map(&probe, meta_dev_, D);
  }
  variant_occupancy(0);  // sets the v2 decode kernel's shared-memory limit
  set_decode_kernel(env_decode_kernel());
  if (tuning().deterministic) deterministic_ = true;
  if (tuning().attn_prefill >= 0) set_prefill_kernel(tuning().attn_prefill);
  if (D == 64) {
    set_smem(prefill_v2_kernel<64>, PrefillCfg<64>::kSmemTotal);
    set_smem(prefill_v2_skip_kernel<64>, PrefillCfg<64>::kSmemTotal);
  } else {
    set_smem(prefill_v2_kernel<128>, PrefillCfg<128>::kSmemTotal);
    set_smem(prefill_v2_skip_kernel<128>, PrefillCfg<128>::kSmemTotal);
  }
}

AttentionWorkspace::~AttentionWorkspace() {
  if (meta_host_) cudaFreeHost(meta_host_);
}

void AttentionWorkspace::plan(const std::vector<AttnSeq>& batch, cudaStream_t s,
                              int force_split, bool wait) {
  const int B = int(batch.size());
  SPADE_CHECK(B > 0 && B <= lim_.max_batch, "attention plan: batch of ", B, " (limit ",
              lim_.max_batch, ")");
  const int G = Hq_ / Hkv_;
  int64_t pages = 0;
  int total_q = 0, max_kv = 0;
  bool decode = true;
  for (const AttnSeq& q : batch) {
    SPADE_CHECK(q.q_len > 0 && q.q_len <= q.kv_len && int64_t(q.kv_len) <= int64_t(q.n_pages) * P_,
                "attention plan: bad sequence (q_len ", q.q_len, ", kv_len ", q.kv_len, ", pages ",
                q.n_pages, ")");
    pages += q.n_pages;
    total_q += q.q_len;
    max_kv = std::max(max_kv, q.kv_len);
    decode = decode && q.q_len == 1;
  }
  SPADE_CHECK(pages <= lim_.max_pages && total_q <= lim_.max_q_tokens,
              "attention plan: batch exceeds the workspace (", pages, " pages, ", total_q,
              " query tokens)");
  int32_t* h = meta_host_;
  int64_t po = 0;
  int qo = 0;
  for (int b = 0; b < B; ++b) {
    std::memcpy(h + off_page_table_ + po, batch[b].pages, sizeof(int32_t) * batch[b].n_pages);
    h[off_page_off_ + b] = int32_t(po);
    h[off_kv_len_ + b] = batch[b].kv_len;
    h[off_q_off_ + b] = qo;
    po += batch[b].n_pages;
    qo += batch[b].q_len;
  }
  h[off_q_off_ + B] = qo;
  int ns = 1;
  // Deterministic: a fixed split count (each sequence's splits cut its own length), so that a
  // sequence's bits do not depend on the rest of the batch.
  if (decode)
    ns = force_split > 0      ? std::min(force_split, lim_.max_split)
         : deterministic_ ? std::min(kInvariantSplit, lim_.max_split)
                          : choose_split(B, schedule_kv(max_kv));
  int n = 0;
  int32_t* it = h + off_items_;
  if (decode && G <= 16) {
    for (int sp = 0; sp < ns; ++sp)
      for (int b = 0; b < B; ++b) {
        it[4 * n] = b; it[4 * n + 1] = 0; it[4 * n + 2] = sp; it[4 * n + 3] = 0;
        ++n;
      }
  } else {
    ns = 1;
    const int BM = (D_ == 64 ? PrefillCfg<64>::BM : PrefillCfg<128>::BM);
    // Heaviest tiles (last rows: most keys) first for a shorter tail.
    for (int b = 0; b < B; ++b) {
      const int rows = batch[b].q_len * G;
      for (int r = ((rows - 1) / BM) * BM; r >= 0; r -= BM) {
        it[4 * n] = b; it[4 * n + 1] = r; it[4 * n + 2] = 0; it[4 * n + 3] = 0;
        ++n;
      }
    }
    decode = false;
  }
  SPADE_CHECK(off_items_ + 4 * n <= int64_t(meta_cap_), "attention plan: too many work items");
  SPADE_CHECK(!decode || n <= 65535, "attention plan: ", n,
              " decode work items (batch x splits) exceed the grid's y limit of 65535");
  SPADE_CUDA(cudaMemcpyAsync(meta_dev_, h, sizeof(int32_t) * size_t(off_items_ + 4 * n),
                             cudaMemcpyHostToDevice, s));
  // The pinned staging buffer is reused by the next plan(): make sure this copy is done.
  if (wait) SPADE_CUDA(cudaStreamSynchronize(s));
  B_ = B;
  // Deterministic with the auto kernel: one static variant whatever the batch (the warps of a
  // CTA, hence each split's summation order, are fixed).
  variant_ = !decode                                   ? 0
             : deterministic_ && decode_kernel_ == 1 ? (fp8_variant() > 0 ? fp8_variant() : fitting_variant(1))
                                                     : resolve_variant(B, schedule_kv(max_kv));
  n_items_ = n;
  n_split_ = ns;
  total_q_ = total_q;
  decode_ = decode;
}

void AttentionWorkspace::run(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out,
                             float scale, cudaStream_t s, const BlasstSkip& skip,
                             const DecodeScores* scores) const {
  run_impl(q, k_cache, v_cache, out, scale, s, skip, scores, nullptr, nullptr);
}

void AttentionWorkspace::run_impl(const bf16* q, const bf16* k_cache, const bf16* v_cache,
                                  bf16* out, float scale, cudaStream_t s, const BlasstSkip& skip,
                                  const DecodeScores* scores, const float* k_scale,
                                  const float* v_scale) const {
  SPADE_CHECK(!k_scale || (decode_ && variant_ > 0 && !skip.active() && !scores),
              "attention: an fp8 cache is read directly only by the v3 decode kernel, without "
              "BLASST or scores (run_fp8 widens it for the other steps)");
  AttnArgs a;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.q = q;
  a.out = out;
  a.k = k_cache;
  a.v = v_cache;
  a.page_table = meta_dev_ + off_page_table_;
  a.page_off = meta_dev_ + off_page_off_;
  a.kv_len = meta_dev_ + off_kv_len_;
  a.q_off = meta_dev_ + off_q_off_;
  a.items = reinterpret_cast<const int4*>(meta_dev_ + off_items_);
  a.part_o = part_o_;
  a.part_lse = part_lse_;
  a.counters = counters_;
  // No tickets: the DYN variants run their static twins (same split count).
  a.tickets = may_draw() ? tickets_ : nullptr;
  a.Hq = Hq_;
  a.Hkv = Hkv_;
  a.G = Hq_ / Hkv_;
  a.P = P_;
  a.nsplit = n_split_;
  a.total_rows = int64_t(total_q_) * Hq_;
  a.scale_log2 = scale * 1.4426950408889634f;
  if (skip.active()) {
    SPADE_CHECK(skip.per_length || !(skip.log_lambda > 0.f),
                "BLASST: lambda must be <= 1 (ln lambda = ", skip.log_lambda, ")");
    SPADE_CHECK(!decode_ || variant_ > 0,
                "BLASST skipping runs in the v3 decode kernel and the prefill kernels; this "
                "decode step uses the v2 kernel (head_dim ", D_, ")");
    a.skip_log2 = skip.log_lambda * 1.4426950408889634f;
    a.skip_per_length = skip.per_length;
    a.skip_counts = skip.counts;
  }
  if (scores) {
    SPADE_CHECK(decode_ && variant_ > 0 && !skip.active() && scores->out && scores->ld > 0,
                "attention scores: decode steps with the v3 kernel only, not with BLASST");
    a.scores_out = scores->out;
    a.scores_ld = scores->ld;
    a.scores_per_head = scores->per_head;
  }
  dim3 grid(n_items_, Hkv_);
  if (decode_ && variant_ > 0) {
    launch_decode_v3(D_, variant_, a, dim3(Hkv_, n_items_), s);
  } else if (decode_) {
    // (set_decode_kernel refused v2 where its shared memory does not fit.)
    if (D_ == 64)
      launch_pdl(decode_v2_kernel<64>, grid, DecodeCfg<64>::kThreads, DecodeCfg<64>::kSmemTotal, s, a);
    else
      launch_pdl(decode_v2_kernel<128>, grid, DecodeCfg<128>::kThreads, DecodeCfg<128>::kSmemTotal, s, a);
    SPADE_CUDA_LAUNCH();
    if (n_split_ > 1) {
      if (D_ == 64)
        launch_pdl(combine_kernel<64>, unsigned(a.total_rows), 64, 0, s, part_o_, part_lse_, out, n_split_, a.total_rows);
      else
        launch_pdl(combine_kernel<128>, unsigned(a.total_rows), 128, 0, s, part_o_, part_lse_, out, n_split_, a.total_rows);
      SPADE_CUDA_LAUNCH();
    }
  } else if (prefill_kernel_ >= 1 && prefill_wgmma_ok(D_)) {
    a.trace = trace_;
    const bool tma = tma_ok_;
    launch_prefill_wgmma(a, grid, s, prefill_kernel_ == 2 ? 3 : 2, tma ? tmaps_->get(k_cache, D_) : nullptr,
                         tma ? tmaps_->get(v_cache, D_) : nullptr);
  } else {
    const bool sk = skip.active();
    if (D_ == 64)
      (sk ? prefill_v2_skip_kernel<64> : prefill_v2_kernel<64>)<<<grid, PrefillCfg<64>::kThreads,
                                                                   PrefillCfg<64>::kSmemTotal, s>>>(a);
    else
      (sk ? prefill_v2_skip_kernel<128> : prefill_v2_kernel<128>)<<<grid, PrefillCfg<128>::kThreads,
                                                                     PrefillCfg<128>::kSmemTotal, s>>>(a);
    SPADE_CUDA_LAUNCH();
  }
}

}  // namespace spade::cuda

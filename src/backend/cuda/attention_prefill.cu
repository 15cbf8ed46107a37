// Paged causal prefill attention for D = 128 on Hopper: wgmma (sm_90a) + warp specialization
// (see attention.h for the API; the generic mma.sync kernel in attention.cu is the fallback
// for D = 64, for devices other than compute capability 9.0, and the v2 reference).
//
// Layout read: q bf16 [T, Hq, D]; K/V bf16 pages [page][Hkv][P][D]; page table int32.
// Layout written: out bf16 [T, Hq, D].
// Work: a CTA = (work item, KV head); an item is 128 packed rows (token, group head) of one
// sequence: row p -> token p / G, head kvh*G + p % G, so every K/V tile read serves the whole
// GQA group. 384 threads: warps 0-7 are two consumer warpgroups (64 rows each, 224 registers
// after setmaxnreg), warps 8-11 the producer warpgroup (56 registers). The producer streams
// 128-token K and V tiles through a shared ring of ST = 2 or 3 stages, signalling per-stage
// "full" mbarriers; consumers release a stage on its "empty" mbarrier. With tensor maps of
// the caches (P % 16 == 0; the default, KTMA) one thread of warp 8 loads K and one of warp 9
// (SKIP: warp 10) V by TMA, 16 boxes of {64 columns, 16 rows} per tile with expect_tx, and a
// partial last V tile by zero-filling cp.async; otherwise all four warps copy with 16-byte
// cp.async (zero-filled past the keys, cp.async.mbarrier.arrive.noinc).
// Shared tiles are [2 halves of 64 columns][128 rows][128 B], 128-byte swizzled (chunk c of
// row r at c ^ (r & 7)): the canonical wgmma layout (K-major for Q and K, N-major for V).
// Per tile and consumer warpgroup: S = Q K^T (8 x wgmma m64n128k16, both operands in shared
// memory), online softmax in registers (log2 units, mask only on tiles that cross the
// diagonal), O += P V (8 x wgmma with P from registers); on the 3-stage ring (the default)
// P V runs one tile behind, after the next tile's S (see the dense loops). The two warpgroups
// take turns issuing S (named barriers 1/2, FA3-style ping-pong) so one's softmax overlaps the
// other's matrix work.
// Shared memory: Q 32 KB + ST x (K 32 KB + V 32 KB) = 160 KB (ST = 2) or 224 KB (ST = 3), +1 KB
// alignment: 1 CTA/SM.
// BLASST (SKIP = true, chosen when a.skip_log2 > -inf; attention.h BlasstSkip; always ST = 3):
// after S = Q K^T and the causal mask, each of the 64 rows of a consumer warpgroup votes "skip"
// when its tile max x (log2 units) satisfies x - max(m, x) < skip_log2 (m = the row's running
// max, which here is the exact running max: a skipped tile leaves it, l and O untouched), or
// when the row sees no key of the tile, or lies past the item's rows (padding). The 128 votes
// are combined by one `bar.red.and.pred` on a warpgroup-local named barrier (id 3 + wg, 128
// threads; the ping-pong barriers 1/2 are untouched). A skipped tile costs S = Q K^T, the mask
// and the max: no exp, row sum, O rescale, P packing or P V wgmma, and its V rows are not read
// unless the other warpgroup keeps the tile. At high sparsity the K + V stream, not the tensor
// cores, sets the pace (H100, 64K: loading no V at all took 1.45x off the time at 73%, skipping
// only the math 1.17x), so:
//   - the producer splits: warps 8-9 stream K tiles ST ahead as in the dense kernel; warps
//     10-11 load a tile's V only after both warpgroups published their votes (need flags in
//     shared memory + a per-stage "decided" mbarrier, 256 arrivals) and only if one keeps it,
//     then arrive on the stage's K-slot barrier too (so "decided" never runs a phase ahead);
//     with tensor maps of the caches (P % 16 == 0, the default) one thread of warp 8 loads K
//     and one of warp 10 loads V by TMA instead (no proxy fence for the consumers, no cp.async
//     issue on their SM sub-partitions; H100 76.5%, against the cp.async dense kernel: 1.37x
//     -> 1.55x with K by TMA, 1.59x with V; 1.49x against the dense kernel with TMA loads);
//   - a consumer runs P V one kept tile behind: tile t issues S(t), votes, then issues P V of
//     the last kept tile (its V was requested a whole S + softmax earlier); a kept tile waits
//     for it before its exponentials, a skipped one not at all (the next S wait does). A stage's K slot
//     is released once S(t) is done (and the V loaders read the vote), its V slot after P V of
//     a kept tile, at once for a skipped one: K loads run ST tiles ahead of S, not of P V.
// One counter register (skipped tiles); at the end the warpgroup's first thread adds the tiles
// its rows see (t * BN < the causal limit of its last valid row) and the skipped ones among
// them to skip_counts[kvh][0/1] (tiles no row sees are skipped by the vote and counted in
// neither). Extra shared memory: 3 x ST mbarriers + 2 x ST flags.
// Napkin math (Llama-3-8B shapes, 8K causal): 4*8192^2/2*128*32 = 550 GFLOP -> 0.9 ms at
// 600 TFLOP/s; the bf16 tensor roof measured here is ~790 TFLOP/s.
#include <cmath>
#include <cstdlib>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/per_device.h"
#include "core/tuning.h"
#include "backend/cuda/wgmma_sm90.cuh"

namespace spade::cuda::attn_detail {
namespace {

constexpr int kPfBM = 128, kPfBN = 128, kPfD = 128;
constexpr int kPfThreads = 384;
constexpr uint32_t kHalf = 128 * 128;        // bytes of one 64-column half of a tile
constexpr uint32_t kTileBytes = 2 * kHalf;   // 32 KB
template <int ST>  // K/V ring stages
constexpr size_t pf_smem() { return 1024 + (1 + 2 * ST) * size_t(kTileBytes) + 8 * (1 + 5 * ST) + 8 * ST; }

static_assert(kPfBM == 2 * 64 && kPfBN == 128, "two 64-row consumer warpgroups, 128-key tiles");

#ifdef SPADE_WGMMA
__device__ __forceinline__ uint32_t tile_off(int r, int c) {  // row r, 16-byte chunk c (0..15)
  return (c >> 3) * kHalf + r * 128 + ((((c & 7) ^ (r & 7))) << 4);
}
// Diagnostic build only (-DSPADE_PREFILL_TILE_TRACE, bench_blasst_prefill's tiletrace mode):
// thread 0 of each consumer warpgroup of the CTA (gridDim.x / 2, 0) writes clock64 stamps of
// every tile t < kTileTraceMax to a.trace + (wg * kTileTraceMax + t) * 8: loop top, K landed,
// S issued (after the turn), S done, decided (SKIP: the vote; dense: softmax done), end,
// then the skip flag and (SKIP) the row maxima done. Production builds compile none of it.
#ifdef SPADE_PREFILL_TILE_TRACE
constexpr int kTileTraceMax = 1024;
#define SPADE_TILE_STAMP(k)                                                                    \
  do {                                                                                         \
    if (tt_on) {                                                                               \
      long long c_;                                                                            \
      asm volatile("mov.u64 %0, %%clock64;" : "=l"(c_));                                       \
      if (t < kTileTraceMax) a.trace[(size_t(wg) * kTileTraceMax + t) * 8 + (k)] = (unsigned long long)c_; \
    }                                                                                          \
  } while (0)
#else
#define SPADE_TILE_STAMP(k) \
  do {                      \
  } while (0)
#endif
// Register reallocation between the warpgroups. A compute-sanitizer build
// (-DSPADE_CUDA_SANITIZER=ON) compiles it out: the tool's instrumentation cannot honour
// setmaxnreg (the first launch dies with "illegal instruction"), so there every warp keeps
// the launch bound's 168 registers and the consumers may spill; the logic is unchanged.
#ifdef SPADE_NO_SETMAXNREG
#define SPADE_SETMAXNREG(insn) \
  do {                         \
  } while (0)
#else
#define SPADE_SETMAXNREG(insn) asm volatile(insn ::: "memory")
#endif
#endif  // SPADE_WGMMA

template <int ST, bool SKIP, bool KTMA>
__global__ void __launch_bounds__(kPfThreads, 1)
    prefill_wgmma_kernel(const AttnArgs a, const __grid_constant__ CUtensorMap tmk,
                         const __grid_constant__ CUtensorMap tmv) {
#ifdef SPADE_WGMMA
  constexpr int D = kPfD, BN = kPfBN;
  unsigned long long t_start = 0;
  if (a.trace && threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_start));
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_s = smem_u32(smem_raw);
  const uint32_t base_s = (raw_s + 1023u) & ~1023u;
  unsigned char* base = smem_raw + (base_s - raw_s);
  // [Q][K0][V0][K1][V1]...[barriers]
  const uint32_t sQ = base_s;
  auto sK = [&](int s) { return base_s + kTileBytes * (1 + 2 * s); };
  auto sV = [&](int s) { return base_s + kTileBytes * (2 + 2 * s); };
  const uint32_t bar0 = base_s + (1 + 2 * ST) * kTileBytes;
  const uint32_t bar_q = bar0;
  auto bar_fk = [&](int s) { return bar0 + 8 * (1 + s); };
  auto bar_fv = [&](int s) { return bar0 + 8 * (1 + ST + s); };
  auto bar_em = [&](int s) { return bar0 + 8 * (1 + 2 * ST + s); };
  auto bar_dec = [&](int s) { return bar0 + 8 * (1 + 3 * ST + s); };  // SKIP: tile decided
  // SKIP: the stage's K slot is free (its S done, its vote read); bar_em is then the V slot's.
  auto bar_ek = [&](int s) { return bar0 + 8 * (1 + 4 * ST + s); };
  // SKIP: need_v[2 * s + wg] != 0 iff warpgroup wg keeps the stage's tile (needs its V rows).
  volatile uint32_t* need_v = reinterpret_cast<volatile uint32_t*>(base + (bar_ek(ST) - base_s));

  const int4 item = a.items[blockIdx.x];
  const int seq = item.x, row0 = item.y;
  const int kvh = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = a.G;
  const int q0 = a.q_off[seq], Tq = a.q_off[seq + 1] - q0;
  const int L = a.kv_len[seq];
  // BLASST threshold (log2 units): fixed, or lambda = a / L with L = this chunk's end (p0 + T).
  const float thr = a.skip_per_length ? fminf(0.f, a.skip_log2 - log2f(float(L))) : a.skip_log2;
  const int n_rows = Tq * G;
  const int t_last = min((row0 + kPfBM - 1) / G, Tq - 1);
  const int t_first = row0 / G;
  const int n_keys = L - Tq + t_last + 1;
  const int min_limit = L - Tq + t_first + 1;
  const int n_tiles = (n_keys + BN - 1) / BN;

  if (tid == 0) {
    mbar_init(bar_q, 128);
    // SKIP: K and V have 64 loader threads each; the K slot is released by both consumer
    // warpgroups after S and by the V loaders after reading the vote, the V slot (bar_em) by
    // the consumers after P V (or the skip) and by the V loaders once they handled the tile
    // (so its phases never run ahead of their parity waits: the consumers get ST tiles ahead of
    // the V loaders when they skip).
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_fk(s), KTMA ? 1 : SKIP ? 64 : 128);
      // KTMA: one V loader thread arrives where SKIP's 64 did.
      mbar_init(bar_fv(s), KTMA ? 1 : SKIP ? 64 : 128);
      mbar_init(bar_em(s), SKIP ? (KTMA ? 256 + 1 : 256 + 64) : 256);
      if (SKIP) mbar_init(bar_dec(s), 256);
      if (SKIP) mbar_init(bar_ek(s), KTMA ? 256 + 1 : 256 + 64);
    }
  }
  __syncthreads();

  if (warp >= 8) {
    // ---------------- producer warpgroup (warps 8-11) ----------------
    SPADE_SETMAXNREG("setmaxnreg.dec.sync.aligned.u32 56;\n");
    const int ptid = tid - 256, pw = ptid >> 5;
    const int P = a.P;
    const int* pt = a.page_table + a.page_off[seq];
    const int p_shift = (P & (P - 1)) == 0 ? __ffs(P) - 1 : -1;
    auto pdiv = [&](int j) { return p_shift >= 0 ? j >> p_shift : j / P; };
    auto pmod = [&](int j) { return p_shift >= 0 ? j & (P - 1) : j % P; };
    const int64_t head_stride = int64_t(P) * D;
    const int64_t page_stride = int64_t(a.Hkv) * head_stride;
    const bool fast = P % 16 == 0;
    const int c = lane & 15, rh = lane >> 4;
    // Q: 128 rows x 16 chunks over 128 threads.
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
      const int r = 8 * i + (ptid >> 4);
      const int p = row0 + r;
      const bool valid = p < n_rows;
      const bf16* src = a.q;
      if (valid) src = a.q + (int64_t(q0 + p / G) * a.Hq + kvh * G + p % G) * D + c * 8;
      cp_async16(base + tile_off(r, c), src, valid);
    }
    cp_async_arrive_noinc(bar_q);
    // A tile is loaded by NW warps (index w): fast path, warp w loads the 16-row blocks
    // (8 / NW) w .. (8 / NW) (w + 1) - 1 of each tile (one page id each, held by lanes 0..,
    // read one tile ahead); otherwise rows (128 / NW) w .. with a page lookup per row.
    auto load_ids = [&](int t, int NW, int w) {
      const int nb = 8 / NW, jb = t * BN + 16 * (nb * w + lane);
      return (lane < nb && jb < n_keys) ? pt[pdiv(jb)] : 0;
    };
    auto load_tile = [&](const bf16* g, uint32_t dst, int kv0, int my_ids, int NW, int w) {
      unsigned char* d = base + (dst - base_s);
      if (fast) {
        const int nb = 8 / NW;
#pragma unroll 2
        for (int bb = 0; bb < nb; ++bb) {
          const int b = nb * w + bb;
          const int jb = kv0 + 16 * b;
          const int id = __shfl_sync(0xffffffffu, my_ids, bb);
          const bf16* src = g + int64_t(id) * page_stride + kvh * head_stride +
                            int64_t(pmod(jb) + rh) * D + c * 8;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int r = 16 * b + rh + 2 * i;
            const bool valid = kv0 + r < n_keys;
            cp_async16(d + tile_off(r, c), valid ? src + 2 * i * D : g, valid);
          }
        }
      } else {
        const int rows = 128 / NW;
#pragma unroll 4
        for (int i = 0; i < rows / 2; ++i) {
          const int r = rows * w + rh + 2 * i;
          const int j = kv0 + r;
          const bool valid = j < n_keys;
          const bf16* src = g;
          if (valid)
            src = g + int64_t(pt[pdiv(j)]) * page_stride + kvh * head_stride + int64_t(pmod(j)) * D + c * 8;
          cp_async16(d + tile_off(r, c), src, valid);
        }
      }
    };
    // KTMA (P % 16 == 0 and tensor maps of the K and V caches; the default): a tile by TMA
    // from one warp, whose lanes 0-7 hold its 8 page ids (kids, load_ids(t, 1, 0)); lane 0
    // issues 16 boxes (8 pages x 2 halves of 64 columns, 32 KB on the barrier with expect_tx).
    // TMA writes are in the async proxy, so the consumers need no proxy fence after the wait
    // (a skipped tile's whole chain otherwise starts with a MEMBAR), and the producer's
    // cp.async no longer take issue slots from the consumers. Rows past the keys come from page
    // 0 (ids past the table read as 0), not zero-filled like the cp.async path: K's are masked
    // to -inf before anything reads them; V's would meet P = 0, and 0 times a stale NaN is NaN,
    // so a partial last V tile still goes by cp.async. K and V come from different warps: K by
    // TMA from a warp that also copied its share of V by cp.async made the dense kernel 15-20%
    // slower (H100, bench/results/blasst_prefill_ktma_h100_20261127.json).
    auto issue_tma_tile = [&](uint32_t dst, uint32_t bar, int t, int kids, const CUtensorMap* map) {
      int id[8];
#pragma unroll
      for (int b = 0; b < 8; ++b) id[b] = __shfl_sync(0xffffffffu, kids, b);
      if (lane == 0) {
        mbar_expect_tx(bar, kTileBytes);
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          const int row = (id[b] * a.Hkv + kvh) * P + pmod(t * BN + 16 * b);
          tma_load_2d(dst + 16 * b * 128, map, 0, row, bar);
          tma_load_2d(dst + kHalf + 16 * b * 128, map, 64, row, bar);
        }
      }
    };
    auto issue_k_tma = [&](int t, int st, int kids) { issue_tma_tile(sK(st), bar_fk(st), t, kids, &tmk); };
    // V tile t by TMA, or, when the keys end inside it, by zero-filling cp.async from the whole
    // warp, which waits for its copies before lane 0 arrives (one arrival either way).
    auto issue_v_tma = [&](int t, int st, int kids) {
      if ((t + 1) * BN <= n_keys) {
        issue_tma_tile(sV(st), bar_fv(st), t, kids, &tmv);
      } else {
        load_tile(a.v, sV(st), t * BN, kids, 1, 0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_fv(st));
      }
    };
    int s = 0, ph = 0;  // stage of tile t, and the parity of its (t / ST)-th use
    if constexpr (!SKIP && KTMA) {
      // Dense with TMA: warp 8 loads K tiles, warp 9 V tiles (a partial last V tile by
      // zero-filling cp.async, then one arrival), ST ahead; warps 10-11 idle.
      if (pw < 2) {
        int kids = n_tiles > 0 ? load_ids(0, 1, 0) : 0;
        for (int t = 0; t < n_tiles; ++t) {
          if (t >= ST) mbar_wait(bar_em(s), ph ^ 1);
          const int kcur = kids;
          if (t + 1 < n_tiles) kids = load_ids(t + 1, 1, 0);
          if (pw == 0) issue_k_tma(t, s, kcur);
          else issue_v_tma(t, s, kcur);
          if (++s == ST) s = 0, ph ^= 1;
        }
      }
    } else if constexpr (!SKIP) {
      int ids = fast && n_tiles > 0 ? load_ids(0, 4, pw) : 0;
      for (int t = 0; t < n_tiles; ++t) {
        if (t >= ST) mbar_wait(bar_em(s), ph ^ 1);  // released use (t / ST) - 1
        const int cur = ids;
        if (fast && t + 1 < n_tiles) ids = load_ids(t + 1, 4, pw);
        load_tile(a.k, sK(s), t * BN, cur, 4, pw);
        cp_async_arrive_noinc(bar_fk(s));
        load_tile(a.v, sV(s), t * BN, cur, 4, pw);
        cp_async_arrive_noinc(bar_fv(s));
        if (++s == ST) s = 0, ph ^= 1;
      }
    } else if (KTMA && pw < 2) {
      // SKIP, K by TMA (issue_k_tma): warp 8 alone, ST tiles ahead; warp 9 has nothing to do.
      if (pw == 0) {
        int kids = n_tiles > 0 ? load_ids(0, 1, 0) : 0;
        for (int t = 0; t < n_tiles; ++t) {
          if (t >= ST) mbar_wait(bar_ek(s), ph ^ 1);
          const int kcur = kids;
          if (t + 1 < n_tiles) kids = load_ids(t + 1, 1, 0);
          issue_k_tma(t, s, kcur);
          if (++s == ST) s = 0, ph ^= 1;
        }
      }
    } else if (pw < 2) {
      // SKIP, warps 8-9: K tiles, ST ahead; a K slot returns once S of its tile is done (a kept
      // tile's V slot is held one tile longer, until its P V).
      int ids = fast && n_tiles > 0 ? load_ids(0, 2, pw) : 0;
      for (int t = 0; t < n_tiles; ++t) {
        if (t >= ST) mbar_wait(bar_ek(s), ph ^ 1);
        const int cur = ids;
        if (fast && t + 1 < n_tiles) ids = load_ids(t + 1, 2, pw);
        load_tile(a.k, sK(s), t * BN, cur, 2, pw);
        cp_async_arrive_noinc(bar_fk(s));
        if (++s == ST) s = 0, ph ^= 1;
      }
    } else if (KTMA) {
      // SKIP with TMA: warp 10 alone does what warps 10-11 do below (one arrival per barrier
      // from lane 0). A kept tile's V comes by TMA like K, except the last tile when it is
      // partial: its rows past the keys must be zeros (P = 0 times a stale NaN is NaN), so
      // warp 10 copies it with zero-filling cp.async, waits for the copies and then arrives;
      // the consumers fence (generic -> async proxy) after waiting for that tile only.
      if (pw == 2) {
        int vids = n_tiles > 0 ? load_ids(0, 1, 0) : 0;
        for (int t = 0; t < n_tiles; ++t) {
          const int vcur = vids;
          if (t + 1 < n_tiles) vids = load_ids(t + 1, 1, 0);
          mbar_wait(bar_dec(s), ph);
          const bool need = need_v[2 * s] | need_v[2 * s + 1];
          if (lane == 0) mbar_arrive(bar_ek(s));
          if (t >= ST) mbar_wait(bar_em(s), ph ^ 1);
          if (need) issue_v_tma(t, s, vcur);
          else if (lane == 0) mbar_arrive(bar_fv(s));
          if (lane == 0) mbar_arrive(bar_em(s));
          if (++s == ST) s = 0, ph ^= 1;
        }
      }
    } else {
      // SKIP, warps 10-11: V of tile t only once both warpgroups have voted on it, and only if
      // one of them keeps it: a skipped tile's V rows are never read from L2 (at high sparsity
      // the K + V stream, not the tensor cores, set the pace). Their arrival on the stage's K
      // slot barrier (after reading the vote) keeps the K loaders from refilling a stage whose
      // vote they have not read, so "decided" never runs two phases ahead of them; they load
      // into the V slot once the consumers released its previous tile (bar_em).
      int ids = fast && n_tiles > 0 ? load_ids(0, 2, pw - 2) : 0;
      for (int t = 0; t < n_tiles; ++t) {
        const int cur = ids;
        if (fast && t + 1 < n_tiles) ids = load_ids(t + 1, 2, pw - 2);
        mbar_wait(bar_dec(s), ph);
        const bool need = need_v[2 * s] | need_v[2 * s + 1];
        mbar_arrive(bar_ek(s));
        if (t >= ST) mbar_wait(bar_em(s), ph ^ 1);
        if (need) {
          load_tile(a.v, sV(s), t * BN, cur, 2, pw - 2);
          cp_async_arrive_noinc(bar_fv(s));
        } else {
          // A plain arrive, not a deferred one (which would also wait for this thread's
          // earlier copies); it follows the wait above, so a warpgroup that did not wait on
          // the previous phase never sees this one a phase ahead.
          mbar_arrive(bar_fv(s));
        }
        mbar_arrive(bar_em(s));
        if (++s == ST) s = 0, ph ^= 1;
      }
    }
    cp_async_wait<0>();
    return;
  }
  SPADE_SETMAXNREG("setmaxnreg.inc.sync.aligned.u32 224;\n");

  // ---------------- consumer warpgroups ----------------
  const int wg = warp >> 2, wl = warp & 3;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int rA = 64 * wg + 16 * wl + g8, rB = rA + 8;  // CTA rows held by this thread
  const int limA = L - Tq + min((row0 + rA) / G, Tq - 1) + 1;
  const int limB = L - Tq + min((row0 + rB) / G, Tq - 1) + 1;
  const float sl2 = a.scale_log2;
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  const uint32_t q_wg = sQ + wg * 64 * 128;
  const int bar_me = 1 + wg, bar_other = 2 - wg;
  uint32_t n_skip = 0;  // BLASST: tiles this warpgroup skipped
#ifdef SPADE_PREFILL_TILE_TRACE
  const bool tt_on = a.trace && blockIdx.x == gridDim.x / 2 && blockIdx.y == 0 && (tid & 127) == 0;
#endif

  mbar_wait(bar_q, 0);
  if (wg == 1) named_arrive(1, 256);  // warpgroup 0 issues first
  // S = Q K^T of the stage's K tile into sc (8 wgmma, committed as one group), in this
  // warpgroup's turn; the other warpgroup's turn starts right after the issue.
  auto issue_s = [&](float (&sc)[64], int s) {
    named_sync(bar_me, 256);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t da = gmma_desc(q_wg + (kk >> 2) * kHalf + (kk & 3) * 32, 16, 1024);
      const uint64_t db = gmma_desc(sK(s) + (kk >> 2) * kHalf + (kk & 3) * 32, 16, 1024);
      wgmma_m64n128k16_ss(sc, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    named_arrive(bar_other, 256);
  };
  // O += P V over the stage's V tile (8 wgmma, P from registers; the caller commits).
  auto issue_pv = [&](const uint32_t (&pa)[8][4], int s) {
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const uint64_t db = gmma_desc(sV(s) + kt * 2048, kHalf, 1024);
      wgmma_m64n128k16_rs_tb(o, pa[kt], db);
    }
  };
  // Causal mask (only tiles that reach a row's limit) and the two rows' tile maxima (raw).
  auto mask_max = [&](float (&sc)[64], int kv0, float& mxA, float& mxB) {
    if (kv0 + BN > min_limit) {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = kv0 + 8 * j + 2 * t4 + e;
          if (col >= limA) sc[4 * j + e] = -INFINITY;
          if (col >= limB) sc[4 * j + 2 + e] = -INFINITY;
        }
    }
    mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      mxA = fmaxf(mxA, fmaxf(sc[4 * j], sc[4 * j + 1]));
      mxB = fmaxf(mxB, fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
    }
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
  };
  // Online softmax of a kept tile: new maxima nA / nB, P = 2^(s * scale - m) in place in sc,
  // row sums into l; returns the rescale factors of O in alA / alB (O itself is not touched).
  auto softmax = [&](float (&sc)[64], float nA, float nB, float& alA, float& alB) {
    const float uA = nA == -INFINITY ? 0.f : nA, uB = nB == -INFINITY ? 0.f : nB;
    alA = ex2_ftz(mA - uA), alB = ex2_ftz(mB - uB);
    mA = nA;
    mB = nB;
    float rsA = 0.f, rsB = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pA = ex2_ftz(fmaf(sc[4 * j + e], sl2, -uA));
        const float pB = ex2_ftz(fmaf(sc[4 * j + 2 + e], sl2, -uB));
        sc[4 * j + e] = pA;
        sc[4 * j + 2 + e] = pB;
        rsA += pA;
        rsB += pB;
      }
    lA = lA * alA + rsA;
    lB = lB * alB + rsB;
  };
  auto rescale_pack = [&](const float (&sc)[64], float alA, float alB, uint32_t (&pa)[8][4]) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[4 * j] *= alA;
      o[4 * j + 1] *= alA;
      o[4 * j + 2] *= alB;
      o[4 * j + 3] *= alB;
    }
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      pa[kt][0] = pack_bf16(sc[8 * kt + 0], sc[8 * kt + 1]);
      pa[kt][1] = pack_bf16(sc[8 * kt + 2], sc[8 * kt + 3]);
      pa[kt][2] = pack_bf16(sc[8 * kt + 4], sc[8 * kt + 5]);
      pa[kt][3] = pack_bf16(sc[8 * kt + 6], sc[8 * kt + 7]);
    }
  };
  // Tile t's S = Q K^T from the stage's K tile: its K wait, the issue in this warpgroup's turn
  // and the wait for the result (every loop below).
  auto s_tile = [&](float (&sc)[64], int t, int s, int ph) {
    SPADE_TILE_STAMP(0);
    mbar_wait(bar_fk(s), ph);
    if constexpr (!KTMA) fence_proxy_async();  // cp.async (generic proxy) -> wgmma; TMA: none
    SPADE_TILE_STAMP(1);
    issue_s(sc, s);
    SPADE_TILE_STAMP(2);
    wgmma_wait0();  // S(t) (and, BLASST, a P V a skipped tile left running)
    reg_fence(sc);
    SPADE_TILE_STAMP(3);
  };
  // P V of a tile whose V sits in stage vs (parity vph): the V wait, the proxy fence when that
  // tile came by cp.async (vzero: a partial last tile, or no tensor maps), the issue; the caller
  // commits.
  auto pv_tile = [&](const uint32_t (&pa)[8][4], int vs, int vph, bool vzero) {
    mbar_wait(bar_fv(vs), vph);
    if (!KTMA || vzero) fence_proxy_async();
    wgmma_fence();
    issue_pv(pa, vs);
  };
  int s = 0, ph = 0;
  if constexpr (!SKIP && ST >= 3) {
    // Dense on the 3-stage ring (the default): P V one tile behind. Tile t: S(t) in the turn,
    // its maxima, then P V(t - 1) and its wait, then the exponentials of tile t and the packing
    // of P(t). Each warpgroup's two matrix products of a tile run back to back and its
    // softmax runs while the other warpgroup's do (FA3's ping-pong), where the plain loop
    // below splits them around the softmax. P V(t - 1) goes after S(t)'s wait so the other
    // warpgroup's S, issued in its turn, is not queued behind it. A stage is held until its
    // P V, in the next tile: hence 3 stages. GQA prefill on the H100 against the 2-stage ring:
    // +2-5% at 8K, -0.5..+2.6% at 32K, four same-call A/Bs
    // (bench/results/attention_prefill_pv_behind_ab_h100_20261127b.json). Letting that P V run
    // under the exponentials instead (its wait moved to the next tile's top) gave +0-1.5%.
    uint32_t pa[8][4];
    bool pend = false;    // P V of the previous tile pending
    int ps = 0, pph = 0;  // its stage and that stage's parity
    bool pzero = false;   // its V tile came by cp.async (fence before reading it)
    for (int t = 0; t < n_tiles; ++t) {
      float sc[64];
      s_tile(sc, t, s, ph);
      float mxA, mxB, alA, alB;
      mask_max(sc, t * BN, mxA, mxB);
      if (pend) pv_tile(pa, ps, pph, pzero);
      wgmma_commit();  // unconditional (an empty group at t = 0), like the waits
      wgmma_wait0();
      reg_fence(o);
      if (pend) mbar_arrive(bar_em(ps));
      SPADE_TILE_STAMP(4);  // here: maxima + P V(t - 1)
      softmax(sc, fmaxf(mA, mxA * sl2), fmaxf(mB, mxB * sl2), alA, alB);
      rescale_pack(sc, alA, alB, pa);
      reg_fence(o);
      reg_fence(pa);
      SPADE_TILE_STAMP(5);  // here: softmax + packing
      pend = true, ps = s, pph = ph, pzero = (t + 1) * BN > n_keys;
      if (++s == ST) s = 0, ph ^= 1;
    }
    if (pend) {
      pv_tile(pa, ps, pph, pzero);
      wgmma_commit();
      wgmma_wait0();
      reg_fence(o);
      mbar_arrive(bar_em(ps));
    }
  } else if constexpr (!SKIP) {
    for (int t = 0; t < n_tiles; ++t) {
      float sc[64];
      s_tile(sc, t, s, ph);
      float mxA, mxB, alA, alB;
      mask_max(sc, t * BN, mxA, mxB);
      softmax(sc, fmaxf(mA, mxA * sl2), fmaxf(mB, mxB * sl2), alA, alB);
      uint32_t pa[8][4];
      rescale_pack(sc, alA, alB, pa);
      SPADE_TILE_STAMP(4);
      reg_fence(o);
      pv_tile(pa, s, ph, (t + 1) * BN > n_keys);
      wgmma_commit();
      wgmma_wait0();
      reg_fence(o);
      mbar_arrive(bar_em(s));
      SPADE_TILE_STAMP(5);
      if (++s == ST) s = 0, ph ^= 1;
    }
  } else {
    // BLASST: P V runs one kept tile behind. Tile t: S(t) issues (then the turn passes), its
    // maxima and vote, then the pending P V of the last kept tile (its V rows were requested
    // when that tile was decided, a whole S + softmax ago). A kept tile waits for it before its
    // exponentials (ptxas puts the wait there: the block holds no other wgmma use; a variant
    // whose exponentials ran under the P V, the wait behind a second test of the vote, was
    // within +-1.5% at 70-80% sparsity and not kept), a skipped tile t not at all (its V slot
    // is released after the next tile's S wait, which covers every older group). Issuing the
    // P V before the vote, right behind S(t), queued the other warpgroup's S behind it and
    // doubled every vote's wait: P V after the vote took the zero-sparsity overhead from
    // +22-24% to +3-4% (GQA, H200) and 76.5% from 49.8 to 47.7 ms
    // (bench/results/blasst_prefill_pv_after_vote_ab_h200_20261127.json). The V loaders read a
    // tile's V only when a warpgroup keeps it.
    uint32_t pa[8][4];      // P of the pending kept tile (bf16 pairs)
    bool pend = false;      // a kept tile's P V is pending (uniform over the warpgroup)
    int ps = 0, pph = 0;    // its stage and that stage's parity
    bool pzero = false;     // its V came by cp.async (zero-filled rows past the keys)
    bool inflight = false;  // a P V issued in a skipped tile, not waited for; its V slot held
    int is = 0;             // that P V's stage
    for (int t = 0; t < n_tiles; ++t) {
      float sc[64];
      s_tile(sc, t, s, ph);
      mbar_arrive(bar_ek(s));  // K(t) read: the K loaders may refill the slot
      if (inflight) {
        mbar_arrive(bar_em(is));
        inflight = false;
      }
      float mxA, mxB;
      mask_max(sc, t * BN, mxA, mxB);
      SPADE_TILE_STAMP(7);
      const float nA = fmaxf(mA, mxA * sl2), nB = fmaxf(mB, mxB * sl2);
      // Vote (BLASST Algorithm 1): m~ - max(m, m~) < ln(lambda) for every visible row; rows
      // past the item (padding) and rows that see no key of the tile do not object.
      const bool vA = row0 + rA >= n_rows || mxA == -INFINITY || mxA * sl2 - nA < thr;
      const bool vB = row0 + rB >= n_rows || mxB == -INFINITY || mxB * sl2 - nB < thr;
      // The outer __all_sync only tells ptxas the result is warp-uniform: with an opaque
      // (inline asm) condition it moved the wgmma descriptor math of the whole loop off the
      // uniform datapath (2x the R2UR, ~+5% time).
      const bool skip = __all_sync(0xffffffffu, named_all(3 + wg, 128, __all_sync(0xffffffffu, vA && vB)));
      n_skip += skip;
      SPADE_TILE_STAMP(4);
#ifdef SPADE_PREFILL_TILE_TRACE
      if (tt_on && t < kTileTraceMax) a.trace[(size_t(wg) * kTileTraceMax + t) * 8 + 6] = skip;
#endif
      // Publish the vote to the V loaders (release: mbarrier arrive). Every thread writes
      // and arrives: a branch on the thread id here (P V in flight) made ptxas serialize the
      // wgmma.
      need_v[2 * s + wg] = skip ? 0u : 1u;
      mbar_arrive(bar_dec(s));
      // The pending kept tile's P V, issued only now: the other warpgroup's S, issued in its
      // turn meanwhile, goes first on the tensor cores, and every vote waits for S alone.
      if (pend) pv_tile(pa, ps, pph, pzero);
      // The commit stays unconditional (an empty group when nothing was issued); only a kept
      // tile waits for it, below (no O access on the skipped path, so ptxas keeps the wgmma
      // asynchronous).
      wgmma_commit();
      float alA = 1.f, alB = 1.f;
      if (!skip) softmax(sc, nA, nB, alA, alB);  // skipped: m, l and O stay
      if (!skip) {
        wgmma_wait0();
        reg_fence(o);
        if (pend) mbar_arrive(bar_em(ps));
        rescale_pack(sc, alA, alB, pa);
        reg_fence(o);  // the next P V's operands are final before the next wgmma fence
        reg_fence(pa);
        pend = true, ps = s, pph = ph, pzero = (t + 1) * BN > n_keys;
      } else {
        // A skipped tile leaves the pending P V running (the next tile's S queues behind it)
        if (pend) inflight = true, is = ps, pend = false;
        mbar_arrive(bar_em(s));  // K read; V not needed by this warpgroup
      }
      SPADE_TILE_STAMP(5);
      if (++s == ST) s = 0, ph ^= 1;
    }
    if (pend) {
      reg_fence(o);
      pv_tile(pa, ps, pph, pzero);
      wgmma_commit();
      wgmma_wait0();
      reg_fence(o);
      mbar_arrive(bar_em(ps));
    }
    wgmma_wait0();
    reg_fence(o);
    if (inflight) mbar_arrive(bar_em(is));
  }
  if (wg == 0) named_sync(1, 256);  // consume warpgroup 1's last turn signal
  if constexpr (SKIP) {
    if (a.skip_counts && tid == 128 * wg) {
      // Tiles the warpgroup's rows see: t * BN < the causal limit of its last valid row. Those
      // past it (only on the diagonal end of the item) had every vote "skip": not counted.
      const int first = row0 + 64 * wg, last = min(first + 63, n_rows - 1);
      const int keys = first < n_rows ? L - Tq + last / G + 1 : 0;
      const int seen = (keys + BN - 1) / BN;
      atomicAdd(a.skip_counts + 2 * kvh, (unsigned long long)seen);
      atomicAdd(a.skip_counts + 2 * kvh + 1, (unsigned long long)(n_skip - (n_tiles - seen)));
    }
  }

  lA += __shfl_xor_sync(0xffffffffu, lA, 1);
  lA += __shfl_xor_sync(0xffffffffu, lA, 2);
  lB += __shfl_xor_sync(0xffffffffu, lB, 1);
  lB += __shfl_xor_sync(0xffffffffu, lB, 2);
  const float iA = lA > 0.f ? 1.f / lA : 0.f, iB = lB > 0.f ? 1.f / lB : 0.f;
  const int pA = row0 + rA, pB = row0 + rB;
  if (pA < n_rows) {
    bf16* dst = a.out + (int64_t(q0 + pA / G) * a.Hq + kvh * G + pA % G) * D + 2 * t4;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) = __floats2bfloat162_rn(o[4 * j] * iA, o[4 * j + 1] * iA);
  }
  if (pB < n_rows) {
    bf16* dst = a.out + (int64_t(q0 + pB / G) * a.Hq + kvh * G + pB % G) * D + 2 * t4;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) = __floats2bfloat162_rn(o[4 * j + 2] * iB, o[4 * j + 3] * iB);
  }
#ifndef SPADE_PREFILL_TILE_TRACE
  if (a.trace && tid == 0) {
    unsigned long long t_end;
    uint32_t smid;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_end));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    unsigned long long* tr = a.trace + 4 * (size_t(blockIdx.y) * gridDim.x + blockIdx.x);
    tr[0] = t_start, tr[1] = t_end, tr[2] = smid, tr[3] = n_tiles;
  }
#endif  // SPADE_PREFILL_TILE_TRACE
#else
  __trap();  // built without sm_90a code: the host never launches this (prefill_wgmma_ok)
#endif
}

// Reports whether the image the runtime picked for this file was built with wgmma (sm_90a).
__global__ void wgmma_probe(int* flag) {
#ifdef SPADE_WGMMA
  *flag = 1;
#else
  *flag = 0;
#endif
}

template <int ST, bool SKIP, bool KTMA>
void prepare_prefill() {
  static PerDeviceOnce done;  // per device: tensor-parallel ranks as threads (per_device.h)
  if (done.pending()) {
    set_max_dynamic_smem(prefill_wgmma_kernel<ST, SKIP, KTMA>, int(pf_smem<ST>()));
    done.mark();
  }
}

}  // namespace

bool prefill_wgmma_ok(int D) {
  if (D != kPfD) return false;
  static int ok = -1;
  if (ok < 0) {
    ok = 0;
    if (cc_major() == 9 && cc_minor() == 0) {
      // The sm_90a image must be the one in use: the plain compute_90 PTX has no wgmma.
      int* d = nullptr;
      int h = 0;
      SPADE_CUDA(cudaMalloc(&d, sizeof(int)));
      wgmma_probe<<<1, 1>>>(d);
      SPADE_CUDA_LAUNCH();
      SPADE_CUDA(cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost));
      SPADE_CUDA(cudaFree(d));
      ok = h == 1 ? 1 : 0;
    }
  }
  return ok == 1;
}

namespace {
template <int ST, bool SKIP, bool KTMA = false>
void launch_pf(const AttnArgs& a, dim3 grid, cudaStream_t s, const CUtensorMap* tmk = nullptr,
               const CUtensorMap* tmv = nullptr) {
  prepare_prefill<ST, SKIP, KTMA>();
  CUtensorMap zero{};
  prefill_wgmma_kernel<ST, SKIP, KTMA>
      <<<grid, kPfThreads, pf_smem<ST>(), s>>>(a, tmk ? *tmk : zero, tmv ? *tmv : zero);
}

// K and V tiles by TMA when tensor maps are given (SPADE_PREFILL_TMA=0: cp.async, for A/B runs).
bool prefill_tma() {
  return tuning().prefill_tma && tuning().tma;
}

}  // namespace

void launch_prefill_wgmma(const AttnArgs& a, dim3 grid, cudaStream_t s, int stages,
                          const CUtensorMap* tmk, const CUtensorMap* tmv) {
  // BLASST always runs on 3 stages: its kept tiles hold their stage one tile longer (P V runs
  // one tile behind), which leaves a 2-stage ring no K prefetch (H100: +63% vs +28% at zero
  // sparsity, bench/bench_blasst_prefill.cu).
  const bool tma = tmk && tmv && a.P % 16 == 0 && prefill_tma();
  if (a.skip_log2 > -INFINITY) {
    if (tma) launch_pf<3, true, true>(a, grid, s, tmk, tmv);
    else launch_pf<3, true>(a, grid, s);
  } else if (tma) {
    if (stages == 3) launch_pf<3, false, true>(a, grid, s, tmk, tmv);
    else launch_pf<2, false, true>(a, grid, s, tmk, tmv);
  } else if (stages == 3) launch_pf<3, false>(a, grid, s);
  else launch_pf<2, false>(a, grid, s);
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda::attn_detail

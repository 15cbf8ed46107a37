// Quest page scores on the tensor cores (QuestArgs::fast; API in sparse_attention.h).
//
// max(q kmax, q kmin) = q+ kmax + q- kmin with q+ = max(q, 0), q- = min(q, 0) (one term is 0),
// so a page's bound for head g is a dot product of A_g = [q-_g | q+_g] (2D bf16, exact: the
// halves of a bf16) with the page's metadata row [kmin | kmax] (2D bf16): the score tile of a
// (request, KV head) is S = A M^T, the QK^T of decode attention with K = the metadata rows.
// bf16 x bf16 products are exact in fp32; only the summation order differs from the CPU's
// quest_page_bound (d in order), so scores agree to fp32 rounding (not bit for bit) and a
// selection can differ from the CPU's only where two pages' scores tie to ~1e-6 relative.
//
// Layout read: q bf16 [B, Hq, D]; meta [page][Hkv][2][D] bf16 (4*D bytes per page-head, rows
// gathered through the page table); writes scores fp32 [B][Hkv][max_pages] (pages < n - 1).
// Work: CTA = (chunk range, KV head, request), 4 warps; a chunk = 16 pages = a 16 x 2D bf16
// tile (8 KB at D = 128) streamed by one warp through its own 3-stage cp.async ring (rows
// swizzled for ldmatrix; page ids one chunk ahead), mma.sync m16n8k16 with the G <= 16 rows of
// A in registers (2D/16 k-steps), then the max over the G rows by shuffles; lanes 0..3 write
// the 16 scores. Shared memory: 8 KB A + 4 x 3 x 8 KB ring + 1 KB = 105 KB (2 CTAs per SM);
// where a block gets less (sm_86 / 89: 99 KB) a 2-stage ring, 73 KB at D = 128 (the same
// products and sums in the same order: the same scores).
// Bytes: the metadata rows (the floor) + 4 B per score; FLOPs 2 * 16 * 2D per page-head
// (padded rows): ~1/8 of the tensor-core rate at HBM speed, so memory-bound.
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/per_device.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
namespace {
using namespace attn_detail;

constexpr int kMW = 4;  // warps per CTA

template <int D, int kMS>  // kMS: ring stages
struct MCfg {
  static constexpr int K2 = 2 * D;            // columns of A and of a metadata row
  static constexpr int CH = K2 / 8;           // 16-byte pieces per row
  static constexpr int kTile = 16 * K2;       // bf16 elements of one chunk tile
  static constexpr size_t kA = size_t(16) * K2 * 2;
  static constexpr size_t kSmem = 1024 + kA + size_t(kMW) * kMS * kTile * 2;
};

template <int D, int kMS>
__global__ void __launch_bounds__(kMW * 32) quest_score_mma_kernel(const QuestArgs a, int cpc) {
  pdl_begin();  // pdl.cuh: first, before any global access
  using C = MCfg<D, kMS>;
  constexpr int K2 = C::K2, CH = C::CH;
  extern __shared__ __align__(1024) unsigned char smem_dyn[];
  unsigned char* smem_raw = smem_dyn + ((1024 - (smem_u32(smem_dyn) & 1023)) & 1023);
  bf16* sA = reinterpret_cast<bf16*>(smem_raw);
  bf16* ring = reinterpret_cast<bf16*>(smem_raw + C::kA);
  const int b = blockIdx.z, h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = a.Hq / a.Hkv;
  const int L = a.kv_len[b];
  const int n = (L + 15) / 16 - 1;  // scored pages
  const int n_ch = (n + 15) / 16;
  const int cb = blockIdx.x * cpc, ce = min(n_ch, cb + cpc);
  if (cb >= ce) return;
  const int n_my = ce - cb > warp ? (ce - cb - warp + kMW - 1) / kMW : 0;
  const int* pt = a.page_table + a.page_off[b];
  // A = [q- | q+] for the G heads (rows >= G zero), swizzled.
  for (int idx = tid; idx < 16 * K2; idx += kMW * 32) {
    const int r = idx / K2, col = idx % K2;
    float v = 0.f;
    if (r < G) {
      const float qv = __bfloat162float(a.q[(int64_t(b) * a.Hq + h * G + r) * D + (col % D)]);
      v = col < D ? fminf(qv, 0.f) : fmaxf(qv, 0.f);
    }
    sA[swz<K2>(r, col)] = __float2bfloat16(v);
  }
  auto chunk_of = [&](int k) { return cb + warp + k * kMW; };
  // Lane l < 16 holds the page id of row l of a chunk (-1: past the scored pages).
  auto row_pid = [&](int k) {
    const int p = chunk_of(k) * 16 + (lane & 15);
    return p < n ? __ldg(pt + p) : -1;
  };
  auto issue = [&](int st, int pid) {
    bf16* dst = ring + (warp * kMS + st) * C::kTile;
    constexpr int PER = 16 * CH / 32;  // 16-byte pieces per lane and chunk
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int idx = lane + 32 * u, r = idx / CH, c = idx % CH;
      const int pr = __shfl_sync(0xffffffffu, pid, r);
      const bool valid = pr >= 0;
      const bf16* src = valid ? a.meta + (int64_t(pr) * a.Hkv + h) * K2 + c * 8 : a.meta;
      cp_async16(dst + swz<K2>(r, c * 8), src, valid);
    }
  };
#pragma unroll
  for (int s = 0; s < kMS - 1; ++s) {
    if (s < n_my) issue(s, row_pid(s));
    cp_async_commit();
  }
  int pid_next = kMS - 1 < n_my ? row_pid(kMS - 1) : -1;
  __syncthreads();  // A is in shared memory
  uint32_t qa[K2 / 16][4];
  {
    const int mi = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < K2 / 16; ++kk) {
      const int r = (lane & 7) + ((mi & 1) ? 8 : 0);
      const int col = kk * 16 + ((mi & 2) ? 8 : 0);
      ldsm_x4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], sA + swz<K2>(r, col));
    }
  }
  const int t4 = lane & 3, g8 = lane >> 2;
  float* out = a.scores + (int64_t(b) * a.Hkv + h) * a.max_pages;
  int st_issue = kMS - 1, st_use = 0;
  for (int k = 0; k < n_my; ++k) {
    __syncwarp();
    const int kn = k + kMS - 1;
    if (kn < n_my) issue(st_issue, pid_next);
    cp_async_commit();
    if (kn + 1 < n_my) pid_next = row_pid(kn + 1);
    cp_async_wait<kMS - 1>();
    __syncwarp();
    const bf16* tile = ring + (warp * kMS + st_use) * C::kTile;
    float s[2][4], s2[2][4];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = 0.f, s2[nb][e] = 0.f;
    const int mi = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < K2 / 16; ++kk) {
      const int r = (lane & 7) + ((mi & 2) ? 8 : 0);
      const int col = kk * 16 + ((mi & 1) ? 8 : 0);
      uint32_t b0, b1, b2, b3;
      ldsm_x4(b0, b1, b2, b3, tile + swz<K2>(r, col));
      if (kk & 1) {
        mma16816(s2[0], qa[kk], b0, b1);
        mma16816(s2[1], qa[kk], b2, b3);
      } else {
        mma16816(s[0], qa[kk], b0, b1);
        mma16816(s[1], qa[kk], b2, b3);
      }
    }
    // Column j = nb * 8 + 2 * t4 + e (page), rows g8 and g8 + 8 (heads): max over rows < G.
    const int p0 = chunk_of(k) * 16;
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = g8 < G ? s[nb][e] + s2[nb][e] : -INFINITY;
        if (g8 + 8 < G) x = fmaxf(x, s[nb][2 + e] + s2[nb][2 + e]);
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
        v[e] = x;
      }
      const int p = p0 + nb * 8 + 2 * t4;
      if (g8 == 0) {
        if (p < n) out[p] = v[0];
        if (p + 1 < n) out[p + 1] = v[1];
      }
    }
    st_issue = st_issue + 1 == kMS ? 0 : st_issue + 1;
    st_use = st_use + 1 == kMS ? 0 : st_use + 1;
  }
  cp_async_wait<0>();
}

template <int D, int kMS>
void launch_mma(const QuestArgs& a, cudaStream_t s) {
  using C = MCfg<D, kMS>;
  static PerDeviceOnce done;  // per device: tensor-parallel ranks as threads (per_device.h)
  if (done.pending()) {
    set_max_dynamic_smem(quest_score_mma_kernel<D, kMS>, int(C::kSmem));
    done.mark();
  }
  // Chunks per CTA: about one wave of 2 CTAs per SM, 4..64 chunks each.
  const int n_ch = ((a.max_pages - 1) + 15) / 16;
  const int64_t total = int64_t(n_ch) * a.Hkv * a.B;
  const int64_t slots = int64_t(sm_count()) * 2;
  const int cpc = int(std::min<int64_t>(64, std::max<int64_t>(4, (total + slots - 1) / slots)));
  dim3 grid((n_ch + cpc - 1) / cpc, a.Hkv, a.B);
  if (grid.x == 0) return;
  launch_pdl(quest_score_mma_kernel<D, kMS>, grid, kMW * 32, C::kSmem, s, a, cpc);
  SPADE_CUDA_LAUNCH();
}

}  // namespace

void quest_score_fast(const QuestArgs& a, cudaStream_t s) {
  SPADE_CHECK(a.D == 64 || a.D == 128, "quest_score (tensor cores): head dim ", a.D);
  SPADE_CHECK(a.Hq % a.Hkv == 0 && a.Hq / a.Hkv <= 16, "quest_score (tensor cores): G must be <= 16");
  // The 3-stage ring where the device's shared memory per block allows it (static: 0 B).
  if (a.D == 128) {
    if (MCfg<128, 3>::kSmem <= smem_optin_bytes()) launch_mma<128, 3>(a, s);
    else launch_mma<128, 2>(a, s);
  } else {
    if (MCfg<64, 3>::kSmem <= smem_optin_bytes()) launch_mma<64, 3>(a, s);
    else launch_mma<64, 2>(a, s);
  }
}

}  // namespace spade::cuda

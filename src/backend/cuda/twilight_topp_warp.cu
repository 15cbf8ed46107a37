// Twilight's top-p over short lists (at most 512 slots: a base of 32 pages or 512 tokens, as
// at short contexts and in mixed serving loads): one CTA per list (request, KV head), one
// warp per query head, no grid handoff. The result is the tree search's (twilight.cu) bit for
// bit: the same softmax, Algorithm 1's double bisection and termination test, masses as exact
// 2^-52 fixed-point sums (topp_fixed52).
//
// twl_topp_warp_kernel<EPL> (N = 32 * EPL slots, EPL = 4, 8, 16)
//   reads  logits [list][g][max_slots] fp32 (the estimate's), the base CSR entries of the list
//   writes thr [list][g], kept [list][max_slots] token positions of the union of the G kept
//          sets in selection order, kept_cnt [list]
//   CTA = G warps (G * 32 threads <= 1024). Warp g: the softmax of its head's n slots (lane
//   holds slots lane + 32 k), then a bitonic sort of the weights (descending, in registers:
//   element lane * EPL + k) and their inclusive fixed-point prefix sums into shared memory.
//   Each bisection step is then O(EPL) ballots: count(w >= m) from the sorted registers, the
//   mass at or above m one shared-memory read, the undecided span two. The kept bits of each
//   head (one ballot per 32 slots) meet in shared memory; warp 0 ORs them, scans the word
//   counts and writes the positions.
//   Shared memory: G * N * 12 B (sorted weights fp32 + prefix sums u64) + G * EPL * 4 B
//   (kept bits): 4.7 KB at G = 3, N = 128; 49 KB at G = 8, N = 512.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/cuda_common.h"
#include "backend/cuda/per_device.h"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/topp_tree_search.cuh"
#include "backend/cuda/twilight_topp_warp.h"

namespace spade::cuda {
namespace {

constexpr int kMaxEpl = 16;

// Bitonic sort, descending, of the warp's 32 * EPL values: element e = lane * EPL + k.
template <int EPL>
__device__ __forceinline__ void warp_sort_desc(float (&v)[EPL], int lane) {
  constexpr int N = 32 * EPL;
#pragma unroll
  for (int s = 2; s <= N; s <<= 1) {
#pragma unroll
    for (int j = s >> 1; j > 0; j >>= 1) {
      if (j >= EPL) {  // partner in lane ^ (j / EPL), same register
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
          const int e = lane * EPL + k;
          const float o = __shfl_xor_sync(0xffffffffu, v[k], j / EPL);
          const bool lower = (e & j) == 0, desc = (e & s) == 0;
          v[k] = lower == desc ? fmaxf(v[k], o) : fminf(v[k], o);
        }
      } else {  // partner in register k ^ j of this lane
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
          const int p = k ^ j;
          if (p > k) {
            const bool desc = ((lane * EPL + k) & s) == 0;
            const float a = v[k], b = v[p];
            v[k] = desc ? fmaxf(a, b) : fminf(a, b);
            v[p] = desc ? fminf(a, b) : fmaxf(a, b);
          }
        }
      }
    }
  }
}

template <int EPL>
__global__ void __launch_bounds__(1024) twl_topp_warp_kernel(const ToppWarpArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  constexpr int N = 32 * EPL;
  extern __shared__ __align__(16) unsigned char smem[];
  const int G = a.G, list = blockIdx.x, g = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned long long* s_pre = reinterpret_cast<unsigned long long*>(smem) + size_t(g) * N;
  float* s_sorted = reinterpret_cast<float*>(smem + size_t(G) * N * 8) + size_t(g) * N;
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(smem + size_t(G) * N * 12);  // [G][EPL]
  const int e0 = a.base_off[list], ne = a.base_off[list + 1] - e0;
  const bool chunk = a.gran == SelGran::Chunk16;
  const int n = min(chunk ? 16 * ne : ne, a.max_slots);
  if (n == 0) {  // uniform over the CTA
    if (lane == 0) a.thr[list * G + g] = INFINITY;
    if (threadIdx.x == 0) a.kept_cnt[list] = 0;
    return;
  }
  // Softmax as twl_topp_kernel (and the CPU) computes it; slots past n and -inf logits hold -1.
  const float* lg = a.logits + (int64_t(list) * G + g) * a.max_slots;
  float w[EPL];
  float vmax = -INFINITY;
#pragma unroll
  for (int k = 0; k < EPL; ++k) {
    const int i = lane + 32 * k;
    w[k] = i < n ? __ldg(lg + i) : -INFINITY;
    vmax = fmaxf(vmax, w[k]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, o));
  double sum = 0.0, n_max = 0.0;
#pragma unroll
  for (int k = 0; k < EPL; ++k) {
    if (w[k] != -INFINITY) {
      w[k] = expf(w[k] - vmax);
      sum += double(w[k]);
      n_max += w[k] == 1.f ? 1.0 : 0.0;
    } else {
      w[k] = -1.f;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    n_max += __shfl_xor_sync(0xffffffffu, n_max, o);
  }
  const float inv = float(1.0 / sum), wmax = inv;
#pragma unroll
  for (int k = 0; k < EPL; ++k)
    if (w[k] >= 0.f) w[k] *= inv;
  float thr;
  if (!(sum > 0.0)) {
    thr = INFINITY;  // no valid slot: nothing kept
  } else if (n_max * double(wmax) >= a.p) {
    thr = wmax;  // the largest weights alone reach p
  } else {
    float v[EPL];
#pragma unroll
    for (int k = 0; k < EPL; ++k) v[k] = w[k];
    warp_sort_desc<EPL>(v, lane);
    unsigned long long run = 0, pre[EPL];
#pragma unroll
    for (int k = 0; k < EPL; ++k) {
      run += v[k] >= 0.f ? topp_fixed52(v[k]) : 0ull;
      pre[k] = run;
    }
    unsigned long long x = run;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    const unsigned long long before = x - run;
#pragma unroll
    for (int k = 0; k < EPL; ++k) {
      s_pre[lane * EPL + k] = before + pre[k];
      s_sorted[lane * EPL + k] = v[k];
    }
    __syncwarp();
    // Weights >= t (a float: w >= x for a double x iff w >= x rounded up to float).
    auto count_ge = [&](float t) {
      int c = 0;
#pragma unroll
      for (int k = 0; k < EPL; ++k) c += __popc(__ballot_sync(0xffffffffu, v[k] >= t));
      return c;
    };
    auto mass = [&](int c) { return c > 0 ? double(s_pre[c - 1]) * 0x1p-52 : 0.0; };
    // Algorithm 1 (sparse::topp_binary_search): the undecided weights, [l, r), are the
    // sorted elements [c_r, c_l).
    double l = 0, r = wmax;
    int cl = count_ge(0.f), cr = count_ge(wmax), it = 0;
    const float feps = float(a.eps);
    while (r - l >= a.eps && it < 64) {
      const double m = 0.5 * (l + r);
      const int c = count_ge(__double2float_ru(m));
      if (mass(c) >= a.p) l = m, cl = c;
      else r = m, cr = c;
      ++it;
      if (cl <= cr) break;  // none undecided
      if (!(s_sorted[cr] - s_sorted[cl - 1] >= feps)) break;
    }
    thr = float(l);
    if (double(thr) > l) thr = nextafterf(thr, -INFINITY);
  }
  if (lane == 0) a.thr[list * G + g] = thr;
#pragma unroll
  for (int k = 0; k < EPL; ++k) {
    const unsigned bits = __ballot_sync(0xffffffffu, w[k] >= thr);
    if (lane == 0) s_mask[g * EPL + k] = bits;
  }
  __syncthreads();
  if (g != 0) return;
  // Warp 0: the union's word `lane` (slots 32 lane ..), its count scanned over the lanes.
  const int nwords = (n + 31) >> 5;
  unsigned u = 0u;
  if (lane < nwords)
    for (int h = 0; h < G; ++h) u |= s_mask[h * EPL + lane];
  const int c = __popc(u);
  int incl = c;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  int32_t* out = a.kept + int64_t(list) * a.max_slots;
  int o = incl - c;
  while (u) {
    const int j = __ffs(u) - 1;
    u &= u - 1;
    const int i = lane * 32 + j;
    out[o++] = chunk ? __ldg(a.base_idx + e0 + i / 16) * 16 + i % 16 : __ldg(a.base_idx + e0 + i);
  }
  if (lane == 31) a.kept_cnt[list] = incl;
}

template <int EPL>
size_t warp_smem(int G) {
  return size_t(G) * 32 * EPL * 12 + size_t(G) * EPL * 4;
}

int warp_epl(int max_slots) {
  for (int epl = 4; epl <= kMaxEpl; epl *= 2)
    if (max_slots <= 32 * epl) return epl;
  return 0;
}

template <int EPL>
void launch_epl(const ToppWarpArgs& a, int n_lists, cudaStream_t s) {
  const size_t smem = warp_smem<EPL>(a.G);
  static PerDeviceMax attr;  // the largest dynamic shared memory granted so far, per device
  if (smem > (48u << 10) && attr.raise(smem)) set_max_dynamic_smem(twl_topp_warp_kernel<EPL>, smem);
  launch_pdl(twl_topp_warp_kernel<EPL>, n_lists, a.G * 32, smem, s, a);
}

}  // namespace

bool topp_warp_applies(int max_slots, int G) {
  const int epl = warp_epl(max_slots);
  if (epl == 0 || G < 1 || G > 32) return false;
  const size_t smem = size_t(G) * 32 * epl * 12 + size_t(G) * epl * 4;
  return smem <= smem_optin_bytes() - 1024;
}

void topp_warp(const ToppWarpArgs& a, int n_lists, cudaStream_t s) {
  SPADE_CHECK(topp_warp_applies(a.max_slots, a.G), "twilight: top-p of ", a.max_slots,
              " slots x ", a.G, " heads needs the CTA-per-head kernels");
  if (n_lists <= 0) return;
  switch (warp_epl(a.max_slots)) {
    case 4: launch_epl<4>(a, n_lists, s); break;
    case 8: launch_epl<8>(a, n_lists, s); break;
    default: launch_epl<16>(a, n_lists, s); break;
  }
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda

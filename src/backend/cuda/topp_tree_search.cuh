// Algorithm 1's top-p bisection (sparse::topp_binary_search), eight steps per pass over the
// weights: one CTA per weight row.
//
// Why it can: a pass over [l, r) (r - l = wmax / 2^k) bins every weight in [l, r) into the 256
// equal intervals [b_j, b_j+1), b_j = l + j (r - l) / 256. Every midpoint the next eight
// bisection steps can take is one of these b_j, and all of them are exact doubles while
// k + 8 <= 29 (wmax has 24 mantissa bits; l, r and every b_j are wmax * integer / 2^(k+8)),
// so the CPU's 0.5 * (l + r) is the same b_j and "w >= m" is "w's interval >= j". A 256-leaf
// tree of (mass, min, max) per interval then decides the eight steps as the sequential loop
// does: mass(w >= b_c) = mass(w >= r) + the tree's sum over [c, 256) (the mass at or above
// r is carried from the step that set r), and the termination test reads the min / max of
// the chosen half. Deeper searches (k > 21, e.g. a tiny eps) go on with the step-per-pass
// loop from where the tree passes stopped.
//
// Shared memory: TreeBins (256 x {u64 fixed-point mass as two u32, u32 min, u32 max},
// double-buffered: one is zeroed while the other fills) + TreeNodes (levels 0..7 of the
// tree, heap order from 1: double mass, u32 min, u32 max) + the walk's result. Weights are >= 0, so min / max run on
// fp32 bit patterns as unsigned integers; empty = (min +inf, max 0), whose span 0 - inf is
// negative and ends the search as the CPU's empty (+inf, -inf) does. Interval 0's mass is
// never asked for (every midpoint is some b_j, j >= 1), so it is not accumulated; its
// min / max go through one warp reduction per warp instead of a per-weight atomic.
#pragma once
#include <cstdint>

namespace spade::cuda {

constexpr int kTreeLeaves = 256;
constexpr int kTreeMaxStartDepth = 21;  // k + 8 <= 29: the pass's b_j are exact doubles
constexpr unsigned kTreeEmptyMin = 0x7f800000u;  // +inf

struct TreeBins {
  unsigned mass_lo[kTreeLeaves], mass_hi[kTreeLeaves];  // fixed point, 2^-52 units (below)
  unsigned mn[kTreeLeaves], mx[kTreeLeaves];
};
struct TreeNodes {
  double mass[kTreeLeaves];  // [1, 256): level s node i at (1 << s) + i
  unsigned mn[kTreeLeaves], mx[kTreeLeaves];
};
struct TreeWalk {
  double l, r, mass_r;  // the search's state after the pass
  int it, done;
};
struct TreeSmem {
  TreeBins bins[2];
  TreeNodes nodes;
  TreeWalk walk;
};

__device__ __forceinline__ void tree_bins_clear(TreeBins& b, int tid, int nt) {
  for (int i = tid; i < kTreeLeaves; i += nt)
    b.mass_lo[i] = 0u, b.mass_hi[i] = 0u, b.mn[i] = kTreeEmptyMin, b.mx[i] = 0u;
}

// Masses are summed exactly as 64-bit integers in units of 2^-52 (a weight <= 1 is at most
// 2^52 units; one bin's mass too), with 32-bit shared-memory atomics, which are native
// (a float atomicAdd on shared memory is a compare-and-swap loop): the low word's add
// returns the old value, whose overflow carries into the high word. Weights of at least
// 2^-29 are exact; smaller ones lose their bits below 2^-52 (truncation).
// A weight v in [0, 1] as 2^-52 units (truncated below 2^-52).
__device__ __forceinline__ unsigned long long topp_fixed52(float v) {
  const unsigned u = __float_as_uint(v);
  const int e = int(u >> 23);  // biased exponent; v = m * 2^(e - 150), m = 24-bit mantissa
  const unsigned long long m = e ? (u & 0x7fffffu) | 0x800000u : (u & 0x7fffffu);
  const int sh = max(e, 1) - 150 + 52;  // v * 2^52 = m * 2^sh
  return sh >= 0 ? m << sh : (sh > -64 ? m >> -sh : 0ull);
}
__device__ __forceinline__ void tree_bin_add_mass(TreeBins& b, int j, float v) {
  const unsigned long long w = topp_fixed52(v);
  const unsigned lo = unsigned(w), hi = unsigned(w >> 32);
  const unsigned old = atomicAdd(&b.mass_lo[j], lo);
  const unsigned carry = old + lo < old ? 1u : 0u;
  if (hi + carry) atomicAdd(&b.mass_hi[j], hi + carry);
}
__device__ __forceinline__ double tree_bin_mass(const TreeBins& b, int j) {
  return (double(b.mass_hi[j]) * 4294967296.0 + double(b.mass_lo[j])) * 0x1p-52;
}

// One pass over [l, r): interval h = (r - l) / 256 and the float images of l, r and b_1
// rounded up (a float weight v satisfies v >= x for a double x iff v >= ru(x)), so the
// weights outside [l, r) and those of interval 0 (the many small ones) are sorted out by
// float compares; the others estimate their interval in float and settle it against the
// exact double bounds (registers are tight: 16 weights per thread under a 64-register cap).
struct TreePass {
  double l, r, h, inv_h;
  float lf, rf, b1f, inv_hf;
};
__device__ __forceinline__ TreePass tree_pass(double l, double r) {
  TreePass p;
  p.l = l, p.r = r, p.h = (r - l) * (1.0 / kTreeLeaves), p.inv_h = double(kTreeLeaves) / (r - l);
  p.lf = __double2float_ru(l), p.rf = __double2float_ru(r), p.b1f = __double2float_ru(l + p.h);
  p.inv_hf = float(p.inv_h);
  return p;
}

// The same binning in double arithmetic throughout (fewer live registers: the 512-thread
// shape holds 16 weights per thread under a 64-register cap, where the float fast path
// below made ptxas spill).
__device__ __forceinline__ void tree_bin_weight_exact(TreeBins& b, float v, const TreePass& p,
                                                      unsigned& mn0, unsigned& mx0) {
  const double dv = double(v);
  if (!(dv >= p.l) || dv >= p.r) return;
  int j = min(int((dv - p.l) * p.inv_h), kTreeLeaves - 1);
  // (dv - l) * inv_h can be one interval off at a boundary; the b_j themselves are exact.
  if (j < kTreeLeaves - 1 && dv >= p.l + double(j + 1) * p.h) ++j;
  else if (j > 0 && dv < p.l + double(j) * p.h) --j;
  const unsigned u = __float_as_uint(v);
  if (j == 0) {
    mn0 = min(mn0, u), mx0 = max(mx0, u);
  } else {
    tree_bin_add_mass(b, j, v);
    atomicMin(&b.mn[j], u);
    atomicMax(&b.mx[j], u);
  }
}

// Bins one weight v (invalid slots hold -1) of the pass; interval 0's min / max go to
// (mn0, mx0) of the calling thread.
__device__ __forceinline__ void tree_bin_weight(TreeBins& b, float v, const TreePass& p,
                                                unsigned& mn0, unsigned& mx0) {
  if (!(v >= p.lf) || v >= p.rf) return;
  const unsigned u = __float_as_uint(v);
  if (v < p.b1f) {
    mn0 = min(mn0, u), mx0 = max(mx0, u);
    return;
  }
  // v >= b_1: the float estimate is within a few intervals (ulp(l) against h, deep passes
  // only); the exact bounds b_j = l + j h (exact doubles) settle it.
  const double dv = double(v);
  int j = min(max(int((v - p.lf) * p.inv_hf), 1), kTreeLeaves - 1);
  while (j < kTreeLeaves - 1 && dv >= p.l + double(j + 1) * p.h) ++j;
  while (j > 1 && dv < p.l + double(j) * p.h) --j;
  tree_bin_add_mass(b, j, v);
  atomicMin(&b.mn[j], u);
  atomicMax(&b.mx[j], u);
}

// After the weights are binned: every warp folds its interval-0 (min, max) into bin 0.
__device__ __forceinline__ void tree_bin_flush0(TreeBins& b, unsigned mn0, unsigned mx0) {
  mn0 = __reduce_min_sync(0xffffffffu, mn0);
  mx0 = __reduce_max_sync(0xffffffffu, mx0);
  if ((threadIdx.x & 31) == 0 && mn0 != kTreeEmptyMin) {
    atomicMin(&b.mn[0], mn0);
    atomicMax(&b.mx[0], mx0);
  }
}

// One warp builds levels 7..0 over the bins: lane L folds bins 8L..8L+7 into its levels 7, 6
// and 5 in registers, then levels 4..0 by shuffles.
__device__ __forceinline__ void tree_build_warp(const TreeBins& b, TreeNodes& t) {
  const int lane = threadIdx.x & 31;
  double m[8];
  unsigned lo[8], hi[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    m[k] = tree_bin_mass(b, 8 * lane + k);
    lo[k] = b.mn[8 * lane + k], hi[k] = b.mx[8 * lane + k];
  }
#pragma unroll
  for (int w = 1, s = 7; w < 8; w *= 2, --s) {  // level s: nodes of 2w bins
#pragma unroll
    for (int k = 0; k < 8; k += 2 * w) {
      m[k] += m[k + w], lo[k] = min(lo[k], lo[k + w]), hi[k] = max(hi[k], hi[k + w]);
      const int node = (1 << s) + (8 * lane + k) / (2 * w);
      t.mass[node] = m[k], t.mn[node] = lo[k], t.mx[node] = hi[k];
    }
  }
  double sm = m[0];
  unsigned sl = lo[0], sh = hi[0];
#pragma unroll
  for (int o = 1, s = 4; o < 32; o *= 2, --s) {
    sm += __shfl_xor_sync(0xffffffffu, sm, o);
    sl = min(sl, __shfl_xor_sync(0xffffffffu, sl, o));
    sh = max(sh, __shfl_xor_sync(0xffffffffu, sh, o));
    if ((lane & (2 * o - 1)) == 0) {
      const int node = (1 << s) + lane / (2 * o);
      t.mass[node] = sm, t.mn[node] = sl, t.mx[node] = sh;
    }
  }
  __syncwarp();
}

// The eight steps of the pass (one thread): from the root, each step compares mass(w >= m)
// = mass_r + mass(right child) with p, goes to the chosen child, and runs Algorithm 1's
// loop and termination tests. Returns the new state; done = the search has ended.
__device__ __forceinline__ TreeWalk tree_walk(const TreeBins& b, const TreeNodes& t, double l,
                                              double r, double mass_r, int it, double p,
                                              double eps) {
  const float feps = float(eps);
  int node = 1;  // heap index; level s nodes at [1 << s, 2 << s), bins past level 7
  TreeWalk w{l, r, mass_r, it, 0};
  for (int s = 0; s < 8; ++s) {
    if (!(w.r - w.l >= eps && w.it < 64)) {
      w.done = 1;
      return w;
    }
    const double m = 0.5 * (w.l + w.r);
    const int right = 2 * node + 1;
    const double mr = s == 7 ? tree_bin_mass(b, right - kTreeLeaves) : t.mass[right];
    const double mass_m = w.mass_r + mr;
    if (mass_m >= p) {
      w.l = m, node = right;
    } else {
      w.r = m, w.mass_r = mass_m, node = right - 1;
    }
    ++w.it;
    const unsigned lo = s == 7 ? b.mn[node - kTreeLeaves] : t.mn[node];
    const unsigned hi = s == 7 ? b.mx[node - kTreeLeaves] : t.mx[node];
    if (!(__uint_as_float(hi) - __uint_as_float(lo) >= feps)) {
      w.done = 1;
      return w;
    }
  }
  return w;
}

}  // namespace spade::cuda

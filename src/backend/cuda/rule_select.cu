// Selection rules over weight rows (rule_select.h): LycheeDecode's topk / ratio / topp /
// threshold modes on units of `block` tokens and oracle-topp, as the CPU computes them.
//
// Layout read / written and bytes: see rule_select.h (rows f32 [ld]; RuleCrit [rows];
// strided i32 [lists][stride] + i32 counts [lists]; CSR). Per row, rule_unit_weights reads
// L logits twice and writes U weights (a third read when block > 1); rule_criteria reads U
// weights once per radix pass (4, or 1 for threshold) plus the tie scan; rule_lists reads
// crit_per_list x U weights and writes the list; counted_compact_lists copies every list.
// One CTA per row / list: these are small launches next to the attention (B * Hkv CTAs).
#include <cmath>
#include <cstdint>

#include "backend/cuda/block_scan.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/rule_select.h"

namespace spade::cuda {

namespace {

__device__ __forceinline__ bool rule_row_on(int r, int rows_per_seq, uint32_t heads) {
  return rows_per_seq > 32 || ((heads >> (r % rows_per_seq)) & 1u);
}

// The rank key of a weight: its bit pattern when > 0 (ordered as unsigned integers for
// non-negative floats), else 0 (zeros and NaN rank last, as the CPU's NaN does).
__device__ __forceinline__ uint32_t rule_key(float v) { return v > 0.f ? __float_as_uint(v) : 0u; }

// A non-negative finite float in fixed point, units of 2^-52 (exact for v >= 2^-29; v <= 16
// fits: 2^56). The masses of a bin add exactly, in any order.
__device__ __forceinline__ unsigned long long fx52(float v) {
  const unsigned u = __float_as_uint(v);
  const int e = int(u >> 23);
  const unsigned long long m = e ? (u & 0x7fffffu) | 0x800000u : (u & 0x7fffffu);
  const int sh = max(e, 1) - 150 + 52;
  return sh >= 0 ? m << sh : (sh > -64 ? m >> -sh : 0ull);
}

__device__ float block_max_f(float v, float* s) {  // s: 32 floats
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = int(blockDim.x >> 5);
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) s[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nw ? s[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) s[0] = v;
  }
  __syncthreads();
  const float r = s[0];
  __syncthreads();
  return r;
}

__device__ double block_sum_d(double v, double* s) {  // s: 32 doubles
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = int(blockDim.x >> 5);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) s[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nw ? s[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s[0] = v;
  }
  __syncthreads();
  const double r = s[0];
  __syncthreads();
  return r;
}

__device__ unsigned long long block_max_u64(unsigned long long v, unsigned long long* s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = int(blockDim.x >> 5);
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long y = __shfl_xor_sync(0xffffffffu, v, o);
    v = y > v ? y : v;
  }
  if (lane == 0) s[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nw ? s[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long y = __shfl_xor_sync(0xffffffffu, v, o);
      v = y > v ? y : v;
    }
    if (lane == 0) s[0] = v;
  }
  __syncthreads();
  const unsigned long long r = s[0];
  __syncthreads();
  return r;
}

// One CTA per row: the CPU's ld_group_weights softmax (float exp of x - max, double sum,
// float reciprocal) of the row's L logits, then unit sums in double (ld_select's u_i).
constexpr int kRwThreads = 1024;
__global__ void __launch_bounds__(kRwThreads)
    rule_weights_kernel(const float* sc, int64_t ld, const int32_t* kv_len, int rows_per_seq,
                        uint32_t heads, int block, float* out) {
  pdl_begin();  // pdl.cuh: first, before any global access
  __shared__ float s_f[32];
  __shared__ double s_d[32];
  const int r = blockIdx.x;
  if (!rule_row_on(r, rows_per_seq, heads)) return;
  const int L = kv_len[r / rows_per_seq];
  if (L <= 0) return;
  const float* x = sc + int64_t(r) * ld;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < L; j += kRwThreads) m = fmaxf(m, x[j]);
  m = block_max_f(m, s_f);
  double sum = 0;
  for (int j = threadIdx.x; j < L; j += kRwThreads) sum += double(expf(x[j] - m));
  sum = block_sum_d(sum, s_d);  // (its barriers: every read of x above precedes the writes)
  const float inv = float(1.0 / sum);
  float* o = out + int64_t(r) * ld;
  if (block == 1) {  // in place allowed: each position is read and written by one thread
    for (int j = threadIdx.x; j < L; j += kRwThreads) o[j] = expf(x[j] - m) * inv;
    return;
  }
  const int U = (L + block - 1) / block;
  for (int i = threadIdx.x; i < U; i += kRwThreads) {
    double s = 0;
    const int hi = min(L, (i + 1) * block);
    for (int j = i * block; j < hi; ++j) s += double(expf(x[j] - m) * inv);
    o[i] = float(s);
  }
}

// One CTA per row: the row's criterion (rule_select.h).
constexpr int kRcThreads = 512;
__global__ void __launch_bounds__(kRcThreads)
    rule_criteria_kernel(const float* w, int64_t ld, const int32_t* kv_len, int rows_per_seq,
                         uint32_t heads, RuleParams p, RuleCrit* crit) {
  pdl_begin();  // pdl.cuh: first, before any global access
  __shared__ unsigned s_cnt[256];
  __shared__ unsigned long long s_mass[256];
  __shared__ int s_warp[64];
  __shared__ unsigned long long s_u64[32];
  __shared__ unsigned s_prefix, s_mask;
  __shared__ int s_above_c, s_chosen, s_cut;
  __shared__ unsigned long long s_above_m;
  const int r = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  if (!rule_row_on(r, rows_per_seq, heads)) return;
  const int L = kv_len[r / rows_per_seq];
  const int B = p.block;
  const int U = (L + B - 1) / B;
  if (U <= 0) return;
  const float* x = w + int64_t(r) * ld;
  const RuleCrit all{0u, 0x7fffffff};  // every unit: key >= 0 always passes

  if (p.mode == RuleMode::Threshold) {
    // Kept: w_i > tau (the CPU compares the float with the double tau), i.e. w_i > t with
    // t the largest float <= tau; none: the heaviest unit (lowest index among equals).
    const uint32_t tk = rule_key(__double2float_rd(p.tau));
    int c = 0;
    for (int i = tid; i < U; i += nt) c += rule_key(x[i]) > tk ? 1 : 0;
    int tot = 0;
    (void)block_exclusive_scan(c, s_warp, &tot);
    if (tot > 0) {
      if (tid == 0) crit[r] = RuleCrit{tk, 0};
      return;
    }
    unsigned long long best = 0;
    for (int i = tid; i < U; i += nt) {
      const unsigned long long v = (static_cast<unsigned long long>(rule_key(x[i])) << 32) |
                                   static_cast<unsigned long long>(0xffffffffu - unsigned(i));
      best = v > best ? v : best;
    }
    best = block_max_u64(best, s_u64);
    if (tid == 0) {
      const int idx = int(0xffffffffu - unsigned(best & 0xffffffffull));
      crit[r] = RuleCrit{unsigned(best >> 32), idx + 1};
    }
    return;
  }

  const bool by_mass = p.mode == RuleMode::TopP;
  int64_t k = U;  // count modes: units kept
  if (p.mode == RuleMode::TopK) {
    k = p.k_units;
  } else if (p.mode == RuleMode::Ratio) {
    const int64_t t = max(int64_t(1), int64_t(ceil(p.ratio * double(L))));
    k = (t + B - 1) / B;
  }
  if (!by_mass && k >= U) {
    if (tid == 0) crit[r] = all;
    return;
  }
  if (tid == 0) s_prefix = 0u, s_mask = 0u, s_above_c = 0, s_above_m = 0ull, s_cut = U;
  // Radix select, 8 bits a pass from the top: the bin holding the k-th key (counts) or the
  // key at which the best-first mass reaches p (masses); above_* = the keys above it.
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += nt) s_cnt[i] = 0u, s_mass[i] = 0ull;
    __syncthreads();
    const unsigned prefix = s_prefix, mask = s_mask;
    for (int i = tid; i < U; i += nt) {
      const uint32_t key = rule_key(x[i]);
      if ((key & mask) != prefix) continue;
      const int bin = int((key >> shift) & 255u);
      atomicAdd(&s_cnt[bin], 1u);
      if (by_mass && key) atomicAdd(&s_mass[bin], fx52(__uint_as_float(key)));
    }
    __syncthreads();
    if (tid == 0) {
      int chosen = -1;
      int above_c = s_above_c;
      unsigned long long above_m = s_above_m;
      for (int bin = 255; bin >= 0; --bin) {
        if (by_mass) {
          if (double(above_m + s_mass[bin]) * 0x1p-52 >= p.mass) {
            chosen = bin;
            break;
          }
          above_m += s_mass[bin];
        } else if (int64_t(above_c) + s_cnt[bin] >= k) {
          chosen = bin;
          break;
        }
        above_c += int(s_cnt[bin]);
      }
      s_chosen = chosen;
      s_above_c = above_c;
      s_above_m = above_m;
      if (chosen >= 0) {
        s_prefix = prefix | (unsigned(chosen) << shift);
        s_mask = mask | (255u << shift);
      }
    }
    __syncthreads();
    if (s_chosen < 0) {  // the whole row's mass stays below p (the CPU keeps every unit)
      if (tid == 0) crit[r] = all;
      return;
    }
    if (shift == 0) break;  // s_cnt[s_chosen]: the ties at the key
  }
  const uint32_t T = s_prefix;
  const int eq = int(s_cnt[s_chosen]);
  const int above_c = s_above_c;
  // Ties to take, lowest index first.
  int m;
  if (by_mass) {
    const double t = double(__uint_as_float(T));
    const double acc = double(s_above_m) * 0x1p-52;
    if (!(t > 0)) {
      m = eq;
    } else {
      m = int(fmin(double(eq), fmax(1.0, ceil((p.mass - acc) / t))));
      while (m > 1 && acc + double(m - 1) * t >= p.mass) --m;
      while (m < eq && acc + double(m) * t < p.mass) ++m;
    }
  } else {
    m = int(k - above_c);
  }
  m = max(1, min(m, eq));
  if (int64_t(above_c) + m >= U) {
    if (tid == 0) crit[r] = all;
    return;
  }
  int seen = 0;
  for (int base = 0; base < U; base += nt) {
    const int i = base + tid;
    const int f = i < U && rule_key(x[i]) == T ? 1 : 0;
    int tot = 0;
    const int before = block_exclusive_scan(f, s_warp, &tot);
    if (f && seen + before + 1 == m) s_cut = i + 1;
    seen += tot;
    if (seen >= m) break;  // uniform: every thread has the same tot
  }
  __syncthreads();
  if (tid == 0) crit[r] = RuleCrit{T, s_cut};
}

// One CTA per list (b, h): the kept units in ascending order (as units, or their tokens).
constexpr int kRlThreads = 256;
__global__ void __launch_bounds__(kRlThreads)
    rule_lists_kernel(const float* w, int64_t ld, const RuleCrit* crit, const int32_t* kv_len,
                      int Hkv, int cpl, uint32_t heads, int block, int expand, int32_t* strided,
                      int64_t stride, int32_t* cnt) {
  pdl_begin();  // pdl.cuh: first, before any global access
  __shared__ int s_warp[64];
  const int list = blockIdx.x, b = list / Hkv, h = list % Hkv, tid = threadIdx.x;
  if (Hkv <= 32 && !((heads >> h) & 1u)) return;
  const int L = kv_len[b];
  const int U = (L + block - 1) / block;
  int32_t* out = strided + int64_t(list) * stride;
  int base = 0;
  for (int i0 = 0; i0 < U; i0 += kRlThreads) {
    const int i = i0 + tid;
    bool keep = false;
    if (i < U)
      for (int g = 0; g < cpl; ++g) {
        const int64_t row = int64_t(list) * cpl + g;
        const RuleCrit c = crit[row];
        const uint32_t key = rule_key(w[row * ld + i]);
        keep |= key > c.t || (key == c.t && i < c.cut);
      }
    const int lo = i * block;
    const int n = keep ? (expand ? min(L, lo + block) - lo : 1) : 0;
    int tot = 0;
    const int before = block_exclusive_scan(n, s_warp, &tot);
    if (keep) {
      if (expand)
        for (int e = 0; e < n; ++e) out[base + before + e] = lo + e;
      else
        out[base + before] = i;
    }
    base += tot;
  }
  if (tid == 0) cnt[list] = base;
}

constexpr int kCcThreads = 128;
__global__ void __launch_bounds__(kCcThreads)
    counted_compact_kernel(const int32_t* strided, int64_t stride, const int32_t* cnt,
                           int n_lists, int32_t* off, int32_t* idx) {
  pdl_begin();  // pdl.cuh: first, before any global access
  __shared__ int s_warp[64];
  const int list = blockIdx.x;
  int part = 0;
  for (int l = threadIdx.x; l < list; l += kCcThreads) part += cnt[l];
  int start = 0;
  (void)block_exclusive_scan(part, s_warp, &start);
  const int n = cnt[list];
  const int32_t* src = strided + int64_t(list) * stride;
  for (int j = threadIdx.x; j < n; j += kCcThreads) idx[start + j] = src[j];
  if (threadIdx.x == 0) {
    off[list] = start;
    if (list == n_lists - 1) off[list + 1] = start + n;
  }
}

}  // namespace

void rule_unit_weights(const float* scores, int64_t ld, const int32_t* kv_len, int n_rows,
                       int rows_per_seq, uint32_t heads, int block, float* out, cudaStream_t s) {
  SPADE_CHECK(block >= 1 && rows_per_seq >= 1, "rule_unit_weights: bad block / rows");
  SPADE_CHECK(block == 1 || out != scores, "rule_unit_weights: in place needs block 1");
  if (n_rows <= 0) return;
  launch_pdl(rule_weights_kernel, n_rows, kRwThreads, 0, s, scores, ld, kv_len, rows_per_seq,
             heads, block, out);
  SPADE_CUDA(cudaGetLastError());
}

void rule_criteria(const float* w, int64_t ld, const int32_t* kv_len, int n_rows,
                   int rows_per_seq, uint32_t heads, const RuleParams& p, RuleCrit* crit,
                   cudaStream_t s) {
  SPADE_CHECK(p.block >= 1 && rows_per_seq >= 1 && p.k_units >= 1, "rule_criteria: bad params");
  if (n_rows <= 0) return;
  launch_pdl(rule_criteria_kernel, n_rows, kRcThreads, 0, s, w, ld, kv_len, rows_per_seq, heads,
             p, crit);
  SPADE_CUDA(cudaGetLastError());
}

void rule_lists(const float* w, int64_t ld, const RuleCrit* crit, const int32_t* kv_len, int B,
                int Hkv, int crit_per_list, uint32_t heads, int block, bool expand,
                int32_t* strided, int64_t stride, int32_t* cnt, cudaStream_t s) {
  SPADE_CHECK(block >= 1 && crit_per_list >= 1 && Hkv >= 1, "rule_lists: bad params");
  if (B * Hkv <= 0) return;
  launch_pdl(rule_lists_kernel, B * Hkv, kRlThreads, 0, s, w, ld, crit, kv_len, Hkv,
             crit_per_list, Hkv <= 32 ? heads : ~0u, block, expand ? 1 : 0, strided, stride, cnt);
  SPADE_CUDA(cudaGetLastError());
}

void counted_compact_lists(const int32_t* strided, int64_t stride, const int32_t* cnt,
                           int n_lists, int32_t* sel_off, int32_t* sel_idx, cudaStream_t s) {
  if (n_lists <= 0) return;
  launch_pdl(counted_compact_kernel, n_lists, kCcThreads, 0, s, strided, stride, cnt, n_lists,
             sel_off, sel_idx);
  SPADE_CUDA(cudaGetLastError());
}

}  // namespace spade::cuda

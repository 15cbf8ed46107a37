// See sampling.h. Reads: logits fp32 [R, V] (+ R x 32-byte row parameters for sample_rows);
// writes int32 [R].
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "backend/cuda/sampling.h"
#include "backend/cuda/load_stream.cuh"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint32_t okey(float x) {
  uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct ArgMax {
  float v;
  int i;
};
struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    if (a.v > b.v || (a.v == b.v && a.i < b.i)) return a;
    return b;
  }
};

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// One CTA samples one row; `key` seeds its uniform draw together with p.seed.
__device__ __forceinline__ void sample_row(const float* row, int V, const GpuSampling& p,
                                           uint64_t key, int32_t* out) {
  using RedA = cub::BlockReduce<ArgMax, kThreads>;
  using RedF = cub::BlockReduce<float, kThreads>;
  using RedI = cub::BlockReduce<int, kThreads>;
  using Scan = cub::BlockScan<float, kThreads>;
  __shared__ union {
    typename RedA::TempStorage a;
    typename RedF::TempStorage f;
    typename RedI::TempStorage i;
    typename Scan::TempStorage s;
  } tmp;
  __shared__ float sh_f;
  __shared__ int sh_i;
  const int tid = threadIdx.x;

  ArgMax best{-INFINITY, V};
  const auto take = [&](float x, int i) {
    if (x > best.v || (x == best.v && i < best.i)) best = {x, i};
  };
  // The max with the smallest index among ties: the same whatever order the logits are read
  // in, so rows of whole float4s take 16-byte loads, 4 per thread in flight (the scalar loop
  // waited for each of its ~125 loads at V = 128256).
  if (V % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    for_each_strided<4>(reinterpret_cast<const float4*>(row), V / 4, tid, kThreads,
                        [&](const float4& v, int c) {
                          take(v.x, 4 * c), take(v.y, 4 * c + 1), take(v.z, 4 * c + 2), take(v.w, 4 * c + 3);
                        });
  } else {
    for (int i = tid; i < V; i += kThreads) take(row[i], i);
  }
  ArgMax b = RedA(tmp.a).Reduce(best, ArgMaxOp());
  if (tid == 0) sh_i = b.i < V ? b.i : 0, sh_f = b.v;
  __syncthreads();
  const int amax = sh_i;
  const float lmax = sh_f;
  if (p.temperature <= 0.f) {
    if (tid == 0) *out = amax;
    return;
  }
  const float invT = 1.f / p.temperature;
  // Thresholds live on okey(logit): order-preserving, so a bisection over uint32 is exact.
  uint32_t thr = 0;
  if (p.top_k > 0 && p.top_k < V) {
    uint32_t lo = 0, hi = okey(lmax);
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo + 1) / 2;
      int c = 0;
      for (int i = tid; i < V; i += kThreads) c += okey(row[i]) >= mid;
      c = RedI(tmp.i).Sum(c);
      if (tid == 0) sh_i = c;
      __syncthreads();
      if (sh_i >= p.top_k) lo = mid; else hi = mid - 1;
      __syncthreads();
    }
    thr = lo;
  }
  // min-p: keep p_i >= min_p * p_max  <=>  (l_i - l_max)/T >= log(min_p).
  if (p.min_p > 0.f) {
    const float lmin = lmax + p.temperature * logf(p.min_p);
    // Smallest logit >= lmin: threshold at okey(lmin) (rounding: keep the boundary token).
    thr = max(thr, okey(lmin));
  }
  auto mass = [&](uint32_t t) {
    float sum = 0.f;
    for (int i = tid; i < V; i += kThreads) {
      const float x = row[i];
      if (okey(x) >= t) sum += __expf((x - lmax) * invT);
    }
    float tot = RedF(tmp.f).Sum(sum);
    if (tid == 0) sh_f = tot;
    __syncthreads();
    float r = sh_f;
    __syncthreads();
    return r;
  };
  const float Z = mass(thr);
  if (p.top_p < 1.f) {
    const float target = p.top_p * Z;
    uint32_t lo = thr, hi = okey(lmax);
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo + 1) / 2;
      if (mass(mid) >= target) lo = mid; else hi = mid - 1;
    }
    thr = lo;
  }
  const float Zk = mass(thr);
  // Uniform in [0, Zk), then the inverse CDF over contiguous per-thread chunks.
  const uint64_t h = mix64(p.seed ^ mix64(key));
  const float u = float(double(h >> 11) * (1.0 / 9007199254740992.0)) * Zk;
  const int chunk = (V + kThreads - 1) / kThreads;
  const int i0 = tid * chunk, i1 = min(V, i0 + chunk);
  float own = 0.f;
  for (int i = i0; i < i1; ++i) {
    const float x = row[i];
    if (okey(x) >= thr) own += __expf((x - lmax) * invT);
  }
  float before;
  Scan(tmp.s).ExclusiveSum(own, before);
  if (tid == 0) sh_i = amax;
  __syncthreads();
  if (own > 0.f && u >= before && u < before + own) {
    float acc = before;
    int pick = -1;
    for (int i = i0; i < i1; ++i) {
      const float x = row[i];
      if (okey(x) >= thr) {
        acc += __expf((x - lmax) * invT);
        pick = i;
        if (u < acc) break;
      }
    }
    if (pick >= 0) sh_i = pick;
  }
  __syncthreads();
  if (tid == 0) *out = sh_i;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* logits, int V,
                                                          GpuSampling p, uint64_t step,
                                                          const uint64_t* step_dev,
                                                          int32_t* out) {
  pdl_begin();  // pdl.cuh: first, before any global access
  if (step_dev) step = *step_dev;
  sample_row(logits + int64_t(blockIdx.x) * V, V, p, step * 0x9e3779b97f4a7c15ull + blockIdx.x,
             out + blockIdx.x);
}

__global__ void __launch_bounds__(kThreads) sample_rows_kernel(const float* logits, int V,
                                                               const GpuSamplingRow* rows,
                                                               int32_t* out) {
  pdl_begin();
  const GpuSamplingRow r = rows[blockIdx.x];
  sample_row(logits + int64_t(blockIdx.x) * V, V, r.p, r.draw * 0x9e3779b97f4a7c15ull,
             out + blockIdx.x);
}

}  // namespace

void sample(const float* logits, int R, int V, const GpuSampling& p, uint64_t step,
            int32_t* out, cudaStream_t s, const uint64_t* step_dev) {
  if (R == 0) return;
  launch_pdl(sample_kernel, R, kThreads, 0, s, logits, V, p, step, step_dev, out);
  SPADE_CUDA_LAUNCH();
}

void sample_rows(const float* logits, int R, int V, const GpuSamplingRow* rows, int32_t* out,
                 cudaStream_t s) {
  if (R == 0) return;
  launch_pdl(sample_rows_kernel, R, kThreads, 0, s, logits, V, rows, out);
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda

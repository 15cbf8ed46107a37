// What one decode-step kernel costs on this GPU before it moves any bytes: the floor under
// every batch-1 stage (Quest scores, top-k, the Twilight estimate and top-p, attention over a
// short selection), where a stage's byte floor is 1-4 us.
//
// Kernels (128 threads per CTA, grid G = 8 / 32 / 132 / 264 CTAs):
//   empty    no memory access;
//   chase-k  thread 0 of each CTA follows k dependent 4-byte loads through a 1 GiB ring of
//            random 128-byte-aligned slots (each hop misses L2: DRAM latency), then stores
//            where it ended; the other threads wait at a barrier. k = 1 is "read an input,
//            write an output"; a selection step's chain (list entry -> page id -> row ->
//            partial -> combine) is 4-6 such hops.
// Each kernel is launched N = 200 times back to back, and also as one CUDA graph of those N
// launches (the decode step's form); time per launch = total / N (CUDA events, median of 7
// repetitions). Every launch of every repetition starts its chains at new slots (a launch
// index that never repeats), so no hop finds its slot in L2 from an earlier launch.
// With and without programmatic dependent launch (pdl.cuh: the attribute + griddepcontrol at
// the top of the kernel). One JSON line per point to OUT (with $COMMIT, "unknown" without it).
// Build: nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc
//   bench/bench_latency_floor.cu <libspade_cuda.a> -o bench_latency_floor
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/cuda_common.h"
#include "backend/cuda/pdl.cuh"

using namespace spade::cuda;

namespace {

constexpr int64_t kSlots = (int64_t(1) << 30) / 128;  // 128-byte slots of the 1 GiB ring
constexpr int kStride = 32;                            // uint32 per slot

__global__ void empty_kernel(int) { pdl_begin(); }

__global__ void chase_kernel(const uint32_t* __restrict__ ring, uint32_t* __restrict__ out,
                             int hops, int launch) {
  pdl_begin();
  if (threadIdx.x == 0) {
    uint32_t s = uint32_t((uint64_t(launch) * 7919u + uint64_t(blockIdx.x) * 104729u) % kSlots);
    for (int h = 0; h < hops; ++h) s = ring[int64_t(s) * kStride];
    out[blockIdx.x] = s;
  }
  __syncthreads();
}

// ring[slot * kStride] = a pseudo-random other slot (a multiplicative hash: hops land far apart).
__global__ void init_ring(uint32_t* ring) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < kSlots) ring[i * kStride] = uint32_t((uint64_t(i) * 2654435761u + 12345u) % kSlots);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// launch_all(first launch index) enqueues the N launches; prepare(first) may build what the
// timed call needs (a graph) outside the timed region.
template <typename P, typename F>
double per_launch_us(P&& prepare, F&& launch_all, int n, cudaStream_t s, int& next) {
  cudaEvent_t a, b;
  SPADE_CUDA(cudaEventCreate(&a));
  SPADE_CUDA(cudaEventCreate(&b));
  prepare(next);
  launch_all(next);
  next += n;
  SPADE_CUDA(cudaStreamSynchronize(s));
  std::vector<double> per;
  for (int r = 0; r < 7; ++r) {
    prepare(next);
    SPADE_CUDA(cudaStreamSynchronize(s));
    SPADE_CUDA(cudaEventRecord(a, s));
    launch_all(next);
    next += n;
    SPADE_CUDA(cudaEventRecord(b, s));
    SPADE_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    SPADE_CUDA(cudaEventElapsedTime(&ms, a, b));
    per.push_back(double(ms) * 1000.0 / n);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(per);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    FILE* out = argc > 1 ? std::fopen(argv[1], "w") : stdout;
    if (!out) return 1;
    const char* commit = std::getenv("COMMIT");  // recorded in every row
    if (!commit || !*commit) commit = "unknown";
    std::printf("%s; PDL %s\n", device_summary().c_str(), pdl_enabled() ? "on" : "off (SPADE_PDL=0)");
    uint32_t *ring = nullptr, *sink = nullptr;
    SPADE_CUDA(cudaMalloc(&ring, size_t(1) << 30));
    SPADE_CUDA(cudaMalloc(&sink, 4096));
    init_ring<<<unsigned((kSlots + 255) / 256), 256>>>(ring);
    SPADE_CUDA(cudaDeviceSynchronize());
    cudaStream_t s;
    SPADE_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int n = 200;
    int next = 0;  // launch index: never repeats, so chains start at new slots
    for (int G : {8, 32, 132, 264})
      for (int hops : {0, 1, 2, 4, 6}) {
        auto enqueue = [&](int first) {
          for (int i = 0; i < n; ++i) {
            if (hops == 0) launch_pdl(empty_kernel, G, 128, 0, s, first + i);
            else launch_pdl(chase_kernel, G, 128, 0, s, ring, sink, hops, first + i);
          }
        };
        const double stream_us = per_launch_us([](int) {}, enqueue, n, s, next);
        cudaGraphExec_t ge = nullptr;
        auto capture = [&](int first) {
          if (ge) SPADE_CUDA(cudaGraphExecDestroy(ge));
          cudaGraph_t g;
          SPADE_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
          enqueue(first);
          SPADE_CUDA(cudaStreamEndCapture(s, &g));
          SPADE_CUDA(cudaGraphInstantiate(&ge, g, 0));
          SPADE_CUDA(cudaGraphUpload(ge, s));
          SPADE_CUDA(cudaGraphDestroy(g));
        };
        const double graph_us =
            per_launch_us(capture, [&](int) { SPADE_CUDA(cudaGraphLaunch(ge, s)); }, n, s, next);
        SPADE_CUDA(cudaGraphExecDestroy(ge));
        std::fprintf(out,
                     "{\"kernel\":\"%s\",\"ctas\":%d,\"hops\":%d,\"pdl\":%d,\"launches\":%d,"
                     "\"us_per_launch_stream\":%.3f,\"us_per_launch_graph\":%.3f,\"commit\":\"%s\"}\n",
                     hops ? "chase" : "empty", G, hops, int(pdl_enabled()), n, stream_us, graph_us,
                     commit);
        std::printf("%-6s G %3d hops %d: stream %.2f us, graph %.2f us per launch\n",
                    hops ? "chase" : "empty", G, hops, stream_us, graph_us);
      }
    if (out != stdout) std::fclose(out);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_latency_floor: %s\n", e.what());
    return 1;
  }
}

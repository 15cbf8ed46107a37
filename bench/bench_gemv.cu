// Decode projections: our GEMV (gemv.cu) vs cuBLASLt (Gemm with set_small_m(0)) on the
// Llama-3.1-8B shapes, M = 1, 2, 4, 8 tokens, bf16 weights, fp32 out.
// Each shape cycles through enough weight copies (>= 256 MB) that no launch finds its weights
// in the 50 MB L2; time = CUDA events around `reps` launches / reps. Bytes = 2 N K (weights)
// + 2 M K (x) + 4 M N (y); GB/s against the device-to-device copy bandwidth of the same run.
// Output: JSON lines (argv[1]) with device, date, commit (argv[2]) and command (argv[3]).
// Build: see bench/run_gpu_gemv.sh prebuild.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "backend/cuda/gemm.h"
#include "backend/cuda/ops.h"
#include "copy_bandwidth.h"

using namespace spade;
using namespace spade::cuda;

int main(int argc, char** argv) {
  try {
    FILE* out = argc > 1 ? std::fopen(argv[1], "w") : stdout;
    const std::string commit = argc > 2 ? argv[2] : "unknown";
    const std::string command = argc > 3 ? argv[3] : "bench_gemv";
    cudaDeviceProp prop;
    SPADE_CUDA(cudaGetDeviceProperties(&prop, 0));
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
    const double bw = copy_bandwidth();
    std::fprintf(stderr, "device: %s, copy bandwidth %.0f GB/s\n", device_summary().c_str(), bw * 1e-9);
    struct Shape { const char* name; int N, K; };
    const Shape shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096},
                            {"down", 4096, 14336}, {"lm_head", 128256, 4096}};
    const size_t max_w = size_t(128256) * 4096;
    const size_t pool_elems = std::max(max_w * 2, size_t(256) << 19);  // >= 2 copies, >= 256 MB
    DeviceArena arena(pool_elems * 2 + (size_t(64) << 20));
    bf16* pool = arena.alloc_n<bf16>(pool_elems, "weights");
    fill_random_bf16(pool, int64_t(pool_elems), 1, 0.02f, 0.f, 0);
    bf16* x = arena.alloc_n<bf16>(size_t(8) * 14336, "x");
    fill_random_bf16(x, int64_t(8) * 14336, 2, 1.f, 0.f, 0);
    float* y = arena.alloc_n<float>(size_t(8) * 128256, "y");
    Gemm gemm(arena);
    cudaEvent_t e0, e1;
    SPADE_CUDA(cudaEventCreate(&e0));
    SPADE_CUDA(cudaEventCreate(&e1));
    for (const Shape& sh : shapes) {
      const size_t w_elems = size_t(sh.N) * sh.K;
      const int copies = int(pool_elems / w_elems);
      for (int M : {1, 2, 4, 8}) {
        double us[2];
        for (int path = 0; path < 2; ++path) {  // 0 = cuBLASLt, 1 = ours
          gemm.set_small_m(path == 0 ? 0 : kGemvMaxM);
          const int reps = std::max(20, copies * 4);
          auto launch = [&](int i) {
            gemm.run_f32(x, pool + size_t(i % copies) * w_elems, y, M, sh.N, sh.K, 0.f, 0);
          };
          for (int i = 0; i < copies; ++i) launch(i);  // warm-up (and cuBLASLt's plan)
          std::vector<float> runs;
          for (int r = 0; r < 5; ++r) {
            SPADE_CUDA(cudaEventRecord(e0));
            for (int i = 0; i < reps; ++i) launch(i);
            SPADE_CUDA(cudaEventRecord(e1));
            SPADE_CUDA(cudaEventSynchronize(e1));
            float ms;
            SPADE_CUDA(cudaEventElapsedTime(&ms, e0, e1));
            runs.push_back(ms * 1e3f / reps);
          }
          std::sort(runs.begin(), runs.end());
          us[path] = runs[2];
        }
        const double bytes = 2.0 * w_elems + 2.0 * M * sh.K + 4.0 * M * sh.N;
        for (int path = 0; path < 2; ++path) {
          const double gbs = bytes / (us[path] * 1e-6) * 1e-9;
          std::fprintf(out,
                       "{\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\",\"command\":\"%s\","
                       "\"kind\":\"decode_gemv\",\"impl\":\"%s\",\"shape\":\"%s\",\"M\":%d,\"N\":%d,"
                       "\"K\":%d,\"us\":%.2f,\"bytes\":%.0f,\"GBps\":%.1f,\"copy_GBps\":%.1f,"
                       "\"of_copy\":%.3f,\"speedup_vs_cublaslt\":%.3f}\n",
                       prop.name, date, commit.c_str(), command.c_str(), path ? "spade_gemv" : "cublaslt",
                       sh.name, M, sh.N, sh.K, us[path], bytes, gbs, bw * 1e-9, gbs / (bw * 1e-9),
                       us[0] / us[path]);
        }
        std::fprintf(stderr, "%-8s M=%d: cuBLASLt %8.2f us (%4.0f GB/s)  ours %8.2f us (%4.0f GB/s)  %.2fx\n",
                     sh.name, M, us[0], bytes / us[0] * 1e-3, us[1], bytes / us[1] * 1e-3, us[0] / us[1]);
      }
    }
    if (out != stdout) std::fclose(out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemv: %s\n", e.what());
    return 1;
  }
  return 0;
}

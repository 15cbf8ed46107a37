// End-to-end decode time per output token (TPOT) of the CUDA model runner with synthetic
// weights of real 8B-class shapes, batch 1, at long contexts, vs the byte floor:
//   floor = (weight bytes read per step + K/V bytes of the context, all layers) / bandwidth
// where bandwidth is a device-to-device copy measured in the same run (read + write bytes).
// Weight bytes per step: every layer matrix + lm_head + norms (the embedding table: one row).
// The KV cache holds random values (fill_kv_random) instead of a real prefill: decode time
// does not depend on the values. Steps run through CUDA graphs; time = CUDA events around
// each step (median of 32 after 8 warm-up), plus host wall time per token.
// Build: see bench/run_gpu.sh.  Usage: [COMMIT=<hash>] bench_tpot OUT.json [model ...]
// (the JSON records $COMMIT, "unknown" without it, and the UTC date).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

#include "backend/cuda/cuda_common.h"
#include "copy_bandwidth.h"
#include "model/cuda_model.h"

using namespace spade;

int main(int argc, char** argv) {
  try {
    const char* out_path = argc > 1 ? argv[1] : "tpot.json";
    std::vector<std::string> models;
    for (int i = 2; i < argc; ++i) models.push_back(argv[i]);
    if (models.empty()) models = {"llama3-8b"};
    const double bw = copy_bandwidth();
    std::fprintf(stderr, "device: %s; copy bandwidth %.0f GB/s\n", cuda::device_summary().c_str(),
                 bw / 1e9);
    FILE* out = std::fopen(out_path, "w");
    const char* commit = std::getenv("COMMIT");
    char date[32] = {};
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    std::fprintf(out, "{\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\",\"copy_GBps\":%.1f,\"results\":[\n",
                 cuda::device_summary().c_str(), date, commit && *commit ? commit : "unknown", bw / 1e9);
    bool first = true;
    for (const std::string& name : models) {
      ModelConfig c = synthetic_config(name);
      // "128K": the longest context that leaves room for the 40 decoded tokens.
      for (int64_t L : {int64_t(32768), int64_t(131072 - 64)}) {
        if (L + 48 > c.max_context) continue;
        CudaModelOptions opt;
        opt.max_tokens = L + 48;
        opt.max_batch = 1;
        opt.max_step_tokens = 16;
        opt.max_logit_rows = 1;
        opt.cuda_graphs = true;
        CudaModel m(c, opt, 1234);
        PageTable pt;
        m.fill_kv_random(pt, L, 99);
        cuda::GpuSampling greedy;
        int32_t tok = 1;
        std::vector<float> dev_ms, wall_ms;
        for (int s = 0; s < 40; ++s) {
          auto t0 = std::chrono::steady_clock::now();
          tok = m.forward_sample({{&pt, &tok, 1, false}}, greedy, uint64_t(s))[0];
          double w = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
          if (s >= 8) {
            dev_ms.push_back(m.last_step_ms());
            wall_ms.push_back(float(w));
          }
        }
        std::sort(dev_ms.begin(), dev_ms.end());
        std::sort(wall_ms.begin(), wall_ms.end());
        const double H = c.hidden, F = c.ffn, D = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads;
        const double layer_w = ((Hq + 2 * Hkv) * D * H + H * Hq * D + 3 * F * H) * 2;
        const double wbytes = c.n_layers * layer_w + double(c.vocab) * H * 2;
        const double ctx = double(L + 20);  // mid-run context
        const double kvbytes = c.n_layers * ctx * Hkv * D * 2 * 2;
        const double floor_ms = (wbytes + kvbytes) / bw * 1e3;
        const double med = dev_ms[dev_ms.size() / 2];
        std::fprintf(out,
                     "%s{\"model\":\"%s\",\"context\":%lld,\"batch\":1,\"tpot_ms\":%.4f,"
                     "\"tpot_wall_ms\":%.4f,\"weight_bytes\":%.0f,\"kv_bytes\":%.0f,"
                     "\"floor_ms\":%.4f,\"ratio_to_floor\":%.3f,\"graphs\":%d}\n",
                     first ? "" : ",", name.c_str(), (long long)L, med,
                     wall_ms[wall_ms.size() / 2], wbytes, kvbytes, floor_ms, med / floor_ms,
                     m.graphs_captured());
        first = false;
        std::fprintf(stderr,
                     "%-10s ctx %6lld: TPOT %.3f ms (wall %.3f), floor %.3f ms (%.2f GB weights + "
                     "%.2f GB KV), ratio %.3f\n",
                     name.c_str(), (long long)L, med, wall_ms[wall_ms.size() / 2], floor_ms,
                     wbytes / 1e9, kvbytes / 1e9, med / floor_ms);
      }
    }
    std::fprintf(out, "]}\n");
    std::fclose(out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tpot: %s\n", e.what());
    return 1;
  }
  return 0;
}

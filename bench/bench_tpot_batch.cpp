// Batched decode step time of the CUDA model runner with synthetic weights (8B-class shapes)
// for full attention and the GPU sparse methods, at long contexts: B requests whose K/V hold
// random values (fill_kv_random, no prefill; the Quest page metadata and Twilight's INT4 key copy
// are computed from them as a prefill would), each decoding one token per step. Per
// configuration: `warm` steps (graph captures; LycheeCluster builds its indexes at the first
// one), then `steps` measured steps (CUDA events around each). Reports the median step (the
// steady state), the mean (lazy index updates and re-captures included) and the byte floor of
// dense attention ((weights + B x KV bytes) / copy bandwidth measured in the same run).
// LycheeCluster gets no token text here (random ids): fixed chunks of 16 tokens.
// A mixed spec "full|quest:budget=1024" runs per-request methods in one batch: request b gets
// the (b mod n)-th method (the first is the model's own, the others CudaModel::add_method).
// Usage: bench_tpot_batch OUT.json --model llama3-8b --lengths 32768:8,65536:4
//          --methods "full;quest:budget=1024;lycheecluster:budget=1024" [--steps 136] [--warm 8]
// (lengths: context:batch pairs). Build: bench/run_gpu_tpot_batch.sh prebuild.
// --kv-dtype bf16,fp8 (default bf16): each configuration with a bf16 and an FP8 (E4M3, issue 40;
// random codes, scales 1) KV cache, "kv" in its line; fp8 runs full attention only so far (the
// other methods are refused: a "skipped" record, as for a batch whose cache does not fit). At the same --lengths the fp8
// pool takes half the KV bytes (dense_kv_bytes counts them).
// --max-batch-at L: first, per --kv-dtype, the largest batch of L-token requests whose model
// (weights, the KV pool of B x (L + steps) tokens, workspaces) the GPU can hold: a bisection
// over constructions of the model, each allocation failure a spade::Error (issue 40: the fp8
// cache should double it). Records {"probe":"max_batch",...} in the same results array.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/cuda_common.h"
#include "backend/cuda/gemm.h"
#include "copy_bandwidth.h"
#include "model/cuda_model.h"
#include "sparse/registry.h"

using namespace spade;

namespace {
std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, sep);)
    if (!x.empty()) out.push_back(x);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) {
      std::fprintf(stderr, "usage: bench_tpot_batch OUT.json [--model M] [--lengths L:B,...] "
                           "[--methods \"spec;spec\"] [--steps N] [--warm N]\n");
      return 2;
    }
    const char* out_path = argv[1];
    std::string model = "llama3-8b", lengths = "32768:8", methods = "full", commit = "unknown",
                kv_dtypes = "bf16";
    int steps = 136, warm = 8;
    int64_t max_batch_at = 0;
    for (int i = 2; i + 1 < argc; i += 2) {
      const std::string k = argv[i], v = argv[i + 1];
      if (k == "--model") model = v;
      else if (k == "--lengths") lengths = v;
      else if (k == "--methods") methods = v;
      else if (k == "--steps") steps = std::stoi(v);
      else if (k == "--warm") warm = std::stoi(v);
      else if (k == "--commit") commit = v;
      else if (k == "--kv-dtype") kv_dtypes = v;
      else if (k == "--max-batch-at") max_batch_at = std::stoll(v);
      else throw std::runtime_error("unknown option " + k);
    }
    const double bw = copy_bandwidth();
    const ModelConfig c = synthetic_config(model);
    std::fprintf(stderr, "device: %s; copy bandwidth %.0f GB/s\n", cuda::device_summary().c_str(),
                 bw / 1e9);
    FILE* out = std::fopen(out_path, "w");
    SPADE_CHECK(out, "cannot write ", out_path);
    std::string command = "bench_tpot_batch";
    for (int i = 1; i < argc; ++i) command += std::string(" ") + (i == 1 ? "OUT.json" : argv[i]);
    char date[16];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    // Decode projections with M <= gemv_max_m tokens run our GEMV, the rest cuBLASLt
    // (backend/cuda/gemm.h; SPADE_GEMV overrides the default, 0 = cuBLASLt only).
    int gemv_max_m = cuda::Gemm::kDefaultSmallM;
    if (const char* e = std::getenv("SPADE_GEMV"); e && *e)
      gemv_max_m = std::clamp(std::atoi(e), 0, cuda::kGemvMaxM);
    std::fprintf(out, "{\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\",\"command\":\"%s\","
                      "\"gemv_max_m\":%d,\"copy_GBps\":%.1f,\"model\":\"%s\",\"steps\":%d,\"warm\":%d,\"what\":\"decode "
                      "step time (CUDA events) of B requests decoding one token each, synthetic weights, "
                      "random KV of the given context; median = steady state, mean includes lazy index "
                      "updates and graph re-captures; baseline: full attention in the same run\","
                      "\"results\":[\n",
                 cuda::device_summary().c_str(), date, commit.c_str(), command.c_str(), gemv_max_m,
                 bw / 1e9, model.c_str(), steps, warm);
    bool first = true;
    const double H = c.hidden, F = c.ffn, D = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads;
    const double layer_w = ((Hq + 2 * Hkv) * D * H + H * Hq * D + 3 * F * H) * 2;
    const double wbytes = c.n_layers * layer_w + double(c.vocab) * H * 2;
    if (max_batch_at > 0) {
      SPADE_CHECK(max_batch_at + warm + steps + 16 <= c.max_context, "--max-batch-at ", max_batch_at,
                  " + steps > ", c.max_context);
      for (const std::string& kvd : split(kv_dtypes, ',')) {
        const KvDtype kv_dtype = parse_kv_dtype(kvd);
        auto fits = [&](int B) {
          CudaModelOptions opt;
          opt.kv_dtype = kv_dtype;
          opt.max_tokens = int64_t(B) * (max_batch_at + warm + steps + 16);
          opt.max_batch = B;
          opt.max_step_tokens = std::max(16, B);
          opt.max_logit_rows = B;
          try {
            CudaModel m(c, opt, 1234);
            return true;
          } catch (const Error&) {
            (void)cudaGetLastError();  // the failed allocation's (not sticky) error
            return false;
          }
        };
        int lo = 0, hi = 1;  // fits(lo) (0: none), !fits(hi) once found
        while (hi <= 1024 && fits(hi)) lo = hi, hi *= 2;
        while (hi - lo > 1) {
          const int mid = (lo + hi) / 2;
          (fits(mid) ? lo : hi) = mid;
        }
        std::fprintf(out, "%s{\"probe\":\"max_batch\",\"kv\":\"%s\",\"context\":%lld,\"max_batch\":%d}\n",
                     first ? "" : ",", kvd.c_str(), (long long)max_batch_at, lo);
        first = false;
        std::fprintf(stderr, "largest batch at context %lld, kv %s: %d\n", (long long)max_batch_at,
                     kvd.c_str(), lo);
      }
    }
    for (const std::string& lb : split(lengths, ',')) {
      const auto p = split(lb, ':');
      SPADE_CHECK(p.size() == 2, "--lengths wants context:batch pairs, got ", lb);
      const int64_t L = std::stoll(p[0]);
      const int B = std::stoi(p[1]);
      SPADE_CHECK(L + warm + steps + 16 <= c.max_context, "context ", L, " + steps > ", c.max_context);
      for (const std::string& spec : split(methods, ';'))
      for (const std::string& kvd : split(kv_dtypes, ',')) {
        const KvDtype kv_dtype = parse_kv_dtype(kvd);
        SPADE_CHECK(kv_dtype == KvDtype::BF16 || kv_dtype == KvDtype::FP8, "--kv-dtype: bf16 or fp8");
        CudaModelOptions opt;
        opt.kv_dtype = kv_dtype;
        opt.max_tokens = int64_t(B) * (L + warm + steps + 16);
        opt.max_batch = B;
        opt.max_step_tokens = std::max(16, B);
        opt.max_logit_rows = B;
        const std::vector<std::string> mix = split(spec, '|');
        SPADE_CHECK(!mix.empty(), "empty method spec");
        opt.sparse = cuda_sparse_config(sparse::SparseConfig::parse_spec(mix[0]), c, 16);
        opt.any_method = mix.size() > 1;
        std::unique_ptr<CudaModel> mp;
        try {
          mp = std::make_unique<CudaModel>(c, opt, 1234);
        } catch (const Error& e) {
          // fp8 with a method it does not run yet, or a batch whose KV cache does not fit the
          // GPU (--max-batch-at says where the limit is): a record that says so, not a stop.
          (void)cudaGetLastError();
          std::string why = e.what();
          for (char& ch : why)
            if (ch == '"' || ch == '\\' || ch == '\n') ch = ' ';
          std::fprintf(out, "%s{\"method\":\"%s\",\"kv\":\"%s\",\"context\":%lld,\"batch\":%d,\"skipped\":\"%s\"}\n",
                       first ? "" : ",", spec.c_str(), kvd.c_str(), (long long)L, B, why.c_str());
          first = false;
          std::fprintf(stderr, "%-34s kv %s ctx %lld B %d: skipped (%s)\n", spec.c_str(), kvd.c_str(),
                       (long long)L, B, e.what());
          continue;
        }
        CudaModel& m = *mp;
        std::vector<int> ids = {0};
        for (size_t i = 1; i < mix.size(); ++i) {
          const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(mix[i]);
          ids.push_back(m.add_method(sc.to_string(), cuda_sparse_config(sc, c, 16)));
        }
        std::vector<PageTable> pts(static_cast<size_t>(B));
        std::vector<std::unique_ptr<sparse::MethodState>> states(static_cast<size_t>(B));
        std::vector<int32_t> toks(static_cast<size_t>(B), 1);
        std::vector<SeqInput> batch(static_cast<size_t>(B));
        for (int b = 0; b < B; ++b) {
          m.fill_kv_random(pts[size_t(b)], L, 99 + uint64_t(b));
          states[size_t(b)] = m.new_request_state(ids[size_t(b) % ids.size()]);
        }
        cuda::GpuSampling greedy;
        std::vector<float> dev_ms;
        float first_ms = 0;
        for (int s = 0; s < warm + steps; ++s) {
          for (int b = 0; b < B; ++b)
            batch[size_t(b)] = {&pts[size_t(b)], &toks[size_t(b)], 1, false, nullptr,
                                states[size_t(b)].get()};
          const std::vector<int32_t> next = m.forward_sample(batch, greedy, uint64_t(s));
          for (int b = 0; b < B; ++b) toks[size_t(b)] = next[size_t(b)];
          if (s == 0) first_ms = m.last_step_ms();
          if (s >= warm) dev_ms.push_back(m.last_step_ms());
        }
        double mean = 0;
        for (float x : dev_ms) mean += x;
        mean /= double(dev_ms.size());
        std::vector<float> sorted(dev_ms);
        std::sort(sorted.begin(), sorted.end());
        const double med = sorted[sorted.size() / 2];
        const double ctx = double(L + warm + steps / 2);  // mid-run context
        const double kvbytes = double(B) * c.n_layers * ctx * Hkv * D * 2 * (kv_dtype == KvDtype::FP8 ? 1 : 2);
        const double dense_floor = (wbytes + kvbytes) / bw * 1e3;
        std::fprintf(out,
                     "%s{\"method\":\"%s\",\"kv\":\"%s\",\"attention\":\"%s\",\"context\":%lld,\"batch\":%d,"
                     "\"median_step_ms\":%.4f,\"mean_step_ms\":%.4f,\"max_step_ms\":%.4f,"
                     "\"first_step_ms\":%.4f,\"weight_bytes\":%.0f,\"dense_kv_bytes\":%.0f,"
                     "\"dense_floor_ms\":%.4f,\"graphs\":%d}\n",
                     first ? "" : ",", spec.c_str(), kvd.c_str(), m.sparse().describe().c_str(), (long long)L,
                     B, med, mean, double(sorted.back()), double(first_ms), wbytes, kvbytes,
                     dense_floor, m.graphs_captured());
        first = false;
        std::fprintf(stderr,
                     "%-34s kv %-4s ctx %6lld B %2d: step median %.3f ms, mean %.3f, max %.2f, first %.1f "
                     "(dense floor %.3f ms)\n",
                     spec.c_str(), kvd.c_str(), (long long)L, B, med, mean, double(sorted.back()),
                     double(first_ms), dense_floor);
        for (auto& pt : pts) m.release(pt);
      }
    }
    std::fprintf(out, "]}\n");
    std::fclose(out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tpot_batch: %s\n", e.what());
    return 1;
  }
  return 0;
}

// TPOT of tensor parallelism on synthetic weights (issue 39's speed bars), only with
// SPADE_TP_SPEED=1. Per shape (context x batch) and rank count N: N ranks (threads, rank r on
// GPU r, NCCL all-reduces inside the captured decode graphs) run warm-up then timed decode
// steps of one token per sequence with greedy sampling on rank 0's GPU (the engine's path),
// over a KV cache of random values; rank 0's mean step time is the TPOT. Beside it:
//   byte floor   (rank 0's weight bytes + the KV bytes a rank reads per step) / the GPU's
//                device-to-device copy bandwidth measured in the same run (bench/copy_bandwidth.h)
//   all-reduce   the step's 2 x layers all-reduces of batch x hidden fp32, timed alone on the
//                same communicator (N > 1)
//   bar          1.3 x (byte floor + all-reduce), issue 39's
// A rank count whose shard (weights + KV) does not fit the GPU's free memory is reported as
// skipped (e.g. Llama-3.1-70B at TP = 1, or 128K x batch 8 at TP = 1), not run.
// SPADE_TP_METHODS runs each shape and rank count per method (full's TPOT beside it gives the
// method's speed-up at that shape): the method parsed for the whole model, each rank running it
// on its KV heads (CudaModelOptions::tp_model / tp_kv0), its page data (Quest bounds, INT4 keys)
// made by fill_kv_random as a prefill would, a request state per sequence where it keeps one.
// Env: SPADE_TP_MODEL (a synthetic_config name: llama3-8b (default), llama3-70b, qwen3-8b),
//      SPADE_TP_SHAPES ("context:batch,...", default 32768:1,32768:8; the context plus the
//      timed steps must fit the model's, e.g. 130900 for 128K), SPADE_TP_RANKS
//      (default "1,2"; counts above the visible GPUs are skipped), SPADE_TP_JSON (a file the
//      records are appended to, one JSON object per line).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "../../bench/copy_bandwidth.h"
#include "../tp_test_util.h"
#include "gpu_util.h"
#include "model/cuda_model.h"
#include "sparse/gpu/cuda_sparse.h"
#include "sparse/options.h"
#if defined(SPADE_HAVE_NCCL)
#include "dist/nccl_communicator.h"
#endif

using namespace spade;
using namespace spade::dist;

namespace {

std::string env_or(const char* name, const char* def) {
  const char* v = std::getenv(name);
  return v && *v ? v : def;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, sep);)
    if (!x.empty()) out.push_back(x);
  return out;
}

int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace

TEST(CudaTp, SpeedProbe) {
  const char* on = std::getenv("SPADE_TP_SPEED");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "set SPADE_TP_SPEED=1 to measure";
  SKIP_WITHOUT_GPU();
#if !defined(SPADE_HAVE_NCCL)
  GTEST_SKIP() << "this build has no NCCL (SPADE_HAVE_NCCL)";
#else
  const std::string model = env_or("SPADE_TP_MODEL", "llama3-8b");
  const ModelConfig full = synthetic_config(model);
  const std::string json_path = env_or("SPADE_TP_JSON", "");
  const int warm = 8, steps = 32;
  SPADE_CUDA(cudaSetDevice(0));
  const double bw = copy_bandwidth();
  auto emit = [&](const std::string& rec) {
    std::printf("[cuda tp] %s\n", rec.c_str());
    if (json_path.empty()) return;
    if (FILE* f = std::fopen(json_path.c_str(), "a")) {
      std::fprintf(f, "%s\n", rec.c_str());
      std::fclose(f);
    }
  };
  for (const std::string& shape : split(env_or("SPADE_TP_SHAPES", "32768:1,32768:8"), ',')) {
    const auto cb = split(shape, ':');
    ASSERT_EQ(cb.size(), 2u) << "SPADE_TP_SHAPES: context:batch, not '" << shape << "'";
    const int64_t ctx = std::stoll(cb[0]);
    const int batch = std::stoi(cb[1]);
    for (const std::string& spec : split(env_or("SPADE_TP_METHODS", "full"), ';'))
    for (const std::string& ns : split(env_or("SPADE_TP_RANKS", "1,2"), ',')) {
      const int n = std::stoi(ns);
      const sparse::SparseConfig sc = sparse::SparseConfig::parse_spec(spec);
      char head[384];
      std::snprintf(head, sizeof head,
                    "{\"model\":\"%s\",\"method\":\"%s\",\"context\":%lld,\"batch\":%d,\"tp\":%d,"
                    "\"copy_bw_gbs\":%.1f",
                    model.c_str(), spec.c_str(), (long long)ctx, batch, n, bw / 1e9);
      if (n > visible_gpus()) {
        emit(std::string(head) + ",\"skipped\":\"" + std::to_string(visible_gpus()) + " GPUs visible\"}");
        continue;
      }
      ModelConfig c = full;
      c.n_heads /= n, c.n_kv_heads /= n, c.ffn /= n;  // the shard's shapes (dist/shard.h)
      const double H = full.hidden, D = full.head_dim;
      // Rank 0's bytes: its shard of every layer plus the embedding and the (untied) LM head.
      const double layer_w = ((c.n_heads + 2.0 * c.n_kv_heads) * D * H + H * c.n_heads * D + 3.0 * c.ffn * H) * 2;
      const double est_w = full.n_layers * layer_w + double(full.vocab) * H * 2 * (full.tie_embeddings ? 1 : 2);
      const int64_t tokens = ctx + warm + steps + 16;
      const double kv_alloc = double(batch) * full.n_layers * double((tokens + 15) / 16 * 16) * c.n_kv_heads * D * 2 * 2;
      size_t free_b = 0, total_b = 0;
      SPADE_CUDA(cudaMemGetInfo(&free_b, &total_b));
      if (est_w + kv_alloc > 0.93 * double(free_b)) {
        char why[200];
        std::snprintf(why, sizeof why, ",\"skipped\":\"needs %.1f GiB per GPU (weights %.1f + KV %.1f), %.1f GiB free\"}",
                      (est_w + kv_alloc) / (1 << 30), est_w / (1 << 30), kv_alloc / (1 << 30),
                      double(free_b) / (1 << 30));
        emit(std::string(head) + why);
        continue;
      }
      double tpot = 0, ar_ms = 0, wbytes = 0;
      std::string attention;
      auto err = test::run_ranks(
          n,
          [&](Communicator& tcp) {
            const int r = tcp.rank();
            SPADE_CUDA(cudaSetDevice(r));
            std::unique_ptr<NcclCommunicator> nccl;
            if (n > 1) nccl = std::make_unique<NcclCommunicator>(tcp, r);
            CudaModelOptions o;
            o.max_batch = batch;
            o.max_step_tokens = 64;
            o.kv_pages = (tokens + 15) / 16 * batch + batch;
            o.tp = nccl.get();
            o.logits = r == 0;
            o.sparse = cuda_sparse_config(sc, full, o.page_size);
            if (n > 1) o.tp_model = full, o.tp_kv0 = r * c.n_kv_heads;
            CudaModel m(c, o, 1234);
            if (r == 0) wbytes = double(m.weight_bytes()), attention = m.sparse().describe();
            std::vector<PageTable> pt(static_cast<size_t>(batch));
            for (int b = 0; b < batch; ++b) m.fill_kv_random(pt[size_t(b)], ctx, 7 + uint64_t(b));
            std::vector<int32_t> tok(static_cast<size_t>(batch), 1);
            std::vector<SeqInput> in(static_cast<size_t>(batch));
            std::vector<std::unique_ptr<sparse::MethodState>> states(static_cast<size_t>(batch));
            for (int b = 0; b < batch; ++b) {
              states[size_t(b)] = m.new_request_state();
              in[size_t(b)].pages = &pt[size_t(b)], in[size_t(b)].tokens = &tok[size_t(b)],
              in[size_t(b)].n_tokens = 1, in[size_t(b)].device_state = states[size_t(b)].get();
            }
            std::vector<cuda::GpuSamplingRow> rows(static_cast<size_t>(batch));
            std::vector<int64_t> row_of;
            auto one = [&] {
              if (r == 0) m.forward_sample_rows(in, rows);
              else m.forward(in, row_of);
            };
            for (int i = 0; i < warm; ++i) one();
            if (nccl) nccl->barrier();
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < steps; ++i) one();
            const double dt =
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
            if (r == 0) tpot = dt;
            for (auto& p : pt) m.release(p);
            if (nccl) {
              // The step's all-reduces alone, as the step runs them: 2 per layer of
              // batch x hidden fp32 on one stream, captured into a graph, replayed.
              const int64_t n_ar = int64_t(batch) * full.hidden;
              float* buf = nullptr;
              SPADE_CUDA(cudaMalloc(&buf, sizeof(float) * size_t(n_ar)));
              SPADE_CUDA(cudaMemset(buf, 0, sizeof(float) * size_t(n_ar)));
              cudaStream_t st;
              SPADE_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
              cudaGraph_t g;
              cudaGraphExec_t ge;
              SPADE_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
              for (int l = 0; l < 2 * full.n_layers; ++l) nccl->all_reduce_sum_on(buf, n_ar, st);
              SPADE_CUDA(cudaStreamEndCapture(st, &g));
              SPADE_CUDA(cudaGraphInstantiate(&ge, g, 0));
              const int reps = 20;
              for (int w = 0; w < 2; ++w) {
                nccl->barrier();
                const auto a0 = std::chrono::steady_clock::now();
                for (int i = 0; i < (w ? reps : 3); ++i) SPADE_CUDA(cudaGraphLaunch(ge, st));
                nccl->synchronize(st);
                if (w && r == 0)
                  ar_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a0).count() / reps;
              }
              cudaGraphExecDestroy(ge);
              cudaGraphDestroy(g);
              cudaStreamDestroy(st);
              cudaFree(buf);
              nccl->barrier();
            }
          },
          test::tp_quick(std::chrono::seconds(120), std::chrono::seconds(300)));
      test::expect_ok(err);
      if (!(tpot > 0)) {
        emit(std::string(head) + ",\"failed\":\"a rank threw (the test's failure says what)\"}");
        continue;
      }
      const double ctx_mid = double(ctx + warm + steps / 2);
      const double kv_read = double(batch) * full.n_layers * ctx_mid * c.n_kv_heads * D * 2 * 2;
      const double floor_ms = (wbytes + kv_read) / bw * 1e3;
      const double bar_ms = 1.3 * (floor_ms + ar_ms);
      char rec[768];
      std::snprintf(rec, sizeof rec,
                    ",\"attention\":\"%s\",\"tpot_ms\":%.4f,\"weight_bytes_rank0\":%.0f,\"kv_bytes_per_rank\":%.0f,"
                    "\"byte_floor_ms\":%.4f,\"allreduce_ms\":%.4f,\"bar_ms\":%.4f,\"tpot_over_floor\":%.3f,"
                    "\"within_bar\":%s}",
                    attention.c_str(), tpot, wbytes, kv_read, floor_ms, ar_ms, bar_ms, tpot / (floor_ms + ar_ms),
                    tpot <= bar_ms ? "true" : "false");
      emit(std::string(head) + rec);
    }
  }
#endif
}

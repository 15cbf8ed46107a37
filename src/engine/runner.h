// One factory for the scheduler's model runner: `device` picks CpuModel over a host KV pool
// or CudaModel (CUDA builds), so front ends build a runner without branching on the device.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/step_model.h"
#include "kv/kv_pool.h"
#include "model/weights.h"
#include "sparse/options.h"

namespace spade {

namespace dist {
class TcpListener;
}

struct RunnerOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  int64_t kv_pages = 0;        // pages of page_size tokens (> 0)
  int page_size = 16;
  // cpu: the host cache's elements (front ends: bf16). cuda: fp8 gives the GPU an fp8 cache
  // (full attention only so far: other methods are refused by name), any other type its bf16 one.
  KvDtype kv_dtype = KvDtype::F32;
  float kv_scale = 0.f;  // fp8: KVLayout::kv_scale / CudaModelOptions::kv_scale (0: auto)
  int max_batch = 32;          // sequences per step
  int64_t max_step_tokens = 2048;
  int64_t max_logit_rows = 0;  // cuda: logit rows per step (0: max(max_batch, 64))
  bool deterministic = false;  // cuda: decode attention with the static schedule only
  sparse::SparseConfig sparse;  // the runner's own method (cuda: inside the model)
  bool per_request_methods = true;  // cuda: methods added per request (keeps their page data)
  // Tensor parallelism (issue 39, dist/tp_runner.h): tp > 1 makes this process rank 0 of tp
  // ranks (cpu only so far): it joins the followers at `dist_listener` (rank 0's socket, bound
  // before the followers started) or else listens on `dist_init` ("host:port").
  int tp = 1;
  std::string dist_init;
  std::shared_ptr<dist::TcpListener> dist_listener;
};

struct Runner {
  std::shared_ptr<void> owned;    // the model and pool behind `model` (destroyed last)
  std::unique_ptr<StepModel> model;
  // The host pool sparse sessions read (cpu), or null: the runner attends itself (cuda).
  KVPool* host_pool = nullptr;
  double kv_mib = 0;              // the KV cache's size
  int64_t max_logit_rows = 0;     // what one step may ask for (0: no limit)
  int64_t max_step_tokens = 0;    // tokens per step the runner takes (>= the options')
  // cuda: throws for a method the runner cannot add for a request (the checks it applies).
  std::function<void(const sparse::SparseConfig&)> check_method;
};

// KV pages a server-like front end allocates by default (`spade serve`, spade::api::LLM):
// room for one sequence of `context` tokens, or max_batch sequences of min(context, 1024).
int64_t default_kv_pages(int64_t context, int max_batch, int page_size);

// KV pages that `gib` GiB of K and V elements hold (`--kv-mem`): one page is every layer's
// and KV head's page_size rows of K and V in `t`'s bytes, so at the same memory fp8 holds
// twice bf16's pages and four times f32's. Per-page metadata a method keeps (Quest's bounds,
// Twilight's INT4 keys) comes on top. Throws when `gib` is not a positive finite number or
// holds not one page.
int64_t kv_pages_for_memory(const ModelConfig& c, int page_size, KvDtype t, double gib);

// Throws spade::Error for an unknown device, a build without it, or options it cannot run
// (its own method, GPU memory).
Runner make_runner(const ModelWeights& weights, const RunnerOptions& opt);

#if defined(SPADE_HAVE_CUDA)
Runner make_cuda_runner(const ModelWeights& weights, const RunnerOptions& opt);  // model/cuda_runner.cpp
#endif

}  // namespace spade

// Where each method run of a `spade eval` sweep decodes, and the one interface the
// sub-commands decode through. --device cpu: every run on the CPU backend (SharedPrefill:
// one dense prefill per prompt, a KV fork per method). --device cuda: every run whose
// method has a GPU path on a CudaModel of its own (CudaDecoder, src/eval/cuda_decode.h),
// the others on the CPU within the same sweep, so one command sweeps every method; each
// record says which backend produced it.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "eval/decode.h"
#include "eval/methods.h"
#include "model/weights.h"
#include "sparse/method.h"
#include "tokenizer/tokenizer.h"

namespace spade::eval {

// --device "cpu" or "cuda" (spade::Device of core/dtype.h); "cuda" throws in a build
// without the CUDA backend or on a machine without a visible GPU.
Device parse_device(const std::string& s);
const char* device_name(Device d);
// The GPU in words (cuda::device_summary), "" without CUDA.
std::string gpu_summary();

struct Placement {
  bool gpu = false;
  std::string why;  // --device cuda, on the CPU: the reason ("no GPU path", the GPU's error)
};

// Placement of every run. `gpu_error(run)`: "" when the GPU can run it, else why not (the
// CUDA build passes cuda_sparse_config's error; null: has_cuda_path decides alone).
std::vector<Placement> place_runs(const std::vector<MethodRun>& runs, Device d,
                                  const std::function<std::string(const MethodRun&)>& gpu_error = nullptr);
// Why cuda_sparse_config refuses `run` ("" when it accepts it; always "" without CUDA).
std::string gpu_config_error(const MethodRun& run, const ModelConfig& c, int page_size);
// "GPU: full, quest:budget=256; CPU: lycheecluster:budget=256 (no GPU path)"
std::string placement_line(const std::vector<MethodRun>& runs, const std::vector<Placement>& p);

struct RunnerOptions {
  int64_t max_prompt = 0;  // longest prompt
  int64_t max_new = 0;     // most tokens one decode emits
  int page_size = 16;
  int64_t chunk = 1024;    // prefill chunk
  bool deterministic = false;  // GPU: static decode schedule, bit-reproducible (CudaModelOptions)
  KvDtype kv_dtype = KvDtype::F32;  // KV cache (--kv-dtype; f32: the reference; GPU runs: fp8, else bf16)
  float kv_scale = 0.f;             // fp8 (--kv-scale; 0: auto, from each prompt's prefill)
};

class EvalRunner {
 public:
  // `cpu_methods[i]`: the CPU method of runs[i] (null for a run placed on the GPU).
  EvalRunner(const ModelWeights& w, const std::vector<MethodRun>& runs,
             std::vector<Placement> placement,
             std::vector<std::shared_ptr<const sparse::SparseMethod>> cpu_methods,
             const RunnerOptions& opt, const Tokenizer* tok);
  ~EvalRunner();
  EvalRunner(const EvalRunner&) = delete;
  EvalRunner& operator=(const EvalRunner&) = delete;

  // The prompt of the next decodes. The CPU prefill runs at the first CPU decode of it.
  void set_prompt(const std::vector<int32_t>& prompt);
  // Run `run` (index into the runs) on its backend.
  DecodeResult decode(size_t run, const DecodeOptions& opt);
  // Full attention on the backend of `run` (agree's reference: same numerics as the run).
  DecodeResult decode_full(size_t run, const DecodeOptions& opt);
  bool gpu(size_t run) const { return place_[run].gpu; }
  const char* backend(size_t run) const { return place_[run].gpu ? "cuda" : "cpu"; }
  // The method's parameters as its backend runs them.
  std::string describe(size_t run) const;

 private:
  DecodeResult on_cpu(std::shared_ptr<const sparse::SparseMethod> m, const DecodeOptions& opt);
  DecodeResult on_gpu(size_t run, bool full, const DecodeOptions& opt);

  const ModelWeights& w_;
  std::vector<MethodRun> runs_;
  std::vector<Placement> place_;
  std::vector<std::shared_ptr<const sparse::SparseMethod>> cpu_;
  std::shared_ptr<const sparse::SparseMethod> cpu_full_;
  std::vector<int64_t> correction_;  // per run: its method's cache-correction interval (0: none)
  RunnerOptions opt_;
  const Tokenizer* tok_;
  std::vector<int32_t> prompt_;
  std::unique_ptr<SharedPrefill> sp_;  // built at the first CPU decode
  bool sp_fresh_ = false;              // sp_ holds prompt_'s prefill
  double sp_seconds_ = 0;
  struct Gpu;  // the CudaDecoder and each run's CudaSparse (CUDA builds)
  std::unique_ptr<Gpu> gpu_;
};

}  // namespace spade::eval

// Placement and EvalRunner of src/eval/runner.h.
#include "eval/runner.h"

#include "core/error.h"
#include "model/cuda_methods.h"
#include "sparse/registry.h"
#if defined(SPADE_HAVE_CUDA)
#include "backend/cuda/cuda_common.h"
#include "eval/cuda_decode.h"
#include "model/cuda_model.h"
#endif

namespace spade::eval {

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::CPU;
  SPADE_CHECK(s == "cuda", "--device must be cpu or cuda, got '", s, "'");
#if defined(SPADE_HAVE_CUDA)
  SPADE_CHECK(cuda::device_available(), "--device cuda: no CUDA device is visible");
  return Device::CUDA;
#else
  fail("--device cuda: this spade was built without the CUDA backend (no nvcc at configure time)");
#endif
}

const char* device_name(Device d) { return d == Device::CUDA ? "cuda" : "cpu"; }

std::string gpu_summary() {
#if defined(SPADE_HAVE_CUDA)
  return cuda::device_summary();
#else
  return "";
#endif
}

std::string gpu_config_error(const MethodRun& run, const ModelConfig& c, int page_size) {
#if defined(SPADE_HAVE_CUDA)
  try {
    cuda_sparse_config(run.config, c, page_size);
  } catch (const Error& e) {
    return e.what();
  }
#endif
  return "";
}

std::vector<Placement> place_runs(const std::vector<MethodRun>& runs, Device d,
                                  const std::function<std::string(const MethodRun&)>& gpu_error) {
  std::vector<Placement> out(runs.size());
  if (d == Device::CPU) return out;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (!has_cuda_path(runs[i].name)) {
      out[i].why = "no GPU path";
      continue;
    }
    out[i].why = gpu_error ? gpu_error(runs[i]) : std::string();
    out[i].gpu = out[i].why.empty();
  }
  return out;
}

std::string placement_line(const std::vector<MethodRun>& runs, const std::vector<Placement>& p) {
  std::string gpu, cpu;
  for (size_t i = 0; i < runs.size(); ++i) {
    std::string& s = p[i].gpu ? gpu : cpu;
    s += (s.empty() ? "" : ", ") + runs[i].label + (p[i].why.empty() ? "" : " (" + p[i].why + ")");
  }
  if (gpu.empty()) return "CPU: " + cpu;
  return "GPU: " + gpu + (cpu.empty() ? "" : "; CPU: " + cpu);
}

struct EvalRunner::Gpu {
#if defined(SPADE_HAVE_CUDA)
  std::unique_ptr<CudaDecoder> dec;
  std::vector<CudaSparse> sparse;  // per run (default for CPU runs)
#endif
};

EvalRunner::EvalRunner(const ModelWeights& w, const std::vector<MethodRun>& runs,
                       std::vector<Placement> placement,
                       std::vector<std::shared_ptr<const sparse::SparseMethod>> cpu_methods,
                       const RunnerOptions& opt, const Tokenizer* tok)
    : w_(w),
      runs_(runs),
      place_(std::move(placement)),
      cpu_(std::move(cpu_methods)),
      opt_(opt),
      tok_(tok),
      gpu_(std::make_unique<Gpu>()) {
  SPADE_CHECK(place_.size() == runs_.size() && cpu_.size() == runs_.size(),
              "EvalRunner: one placement and one CPU method slot per run");
  bool any_gpu = false;
  for (size_t i = 0; i < runs_.size(); ++i) {
    SPADE_CHECK(place_[i].gpu || cpu_[i], "EvalRunner: run ", runs_[i].label, " has no CPU method");
    any_gpu |= place_[i].gpu;
    // The correction interval is the method's option, whichever backend runs it.
    correction_.push_back(cpu_[i] ? cpu_[i]->correction_every()
                                  : sparse::make_method(runs_[i].config, w.config)->correction_every());
  }
#if defined(SPADE_HAVE_CUDA)
  gpu_->sparse.resize(runs_.size());
  for (size_t i = 0; i < runs_.size(); ++i)
    if (place_[i].gpu) {
      gpu_->sparse[i] = cuda_sparse_config(runs_[i].config, w.config, opt.page_size);
      // A GPU method that does not read an fp8 cache yet: refused by name before any prompt.
      check_gpu_kv_dtype(opt.kv_dtype == KvDtype::FP8, gpu_->sparse[i]);
    }
  if (any_gpu)
    gpu_->dec = std::make_unique<CudaDecoder>(w, opt.max_prompt, opt.max_new, opt.page_size,
                                              opt.chunk, tok, opt.deterministic, opt.kv_dtype,
                                              opt.kv_scale);
#else
  SPADE_CHECK(!any_gpu, "EvalRunner: a run is placed on the GPU in a build without CUDA");
#endif
}

EvalRunner::~EvalRunner() = default;

void EvalRunner::set_prompt(const std::vector<int32_t>& prompt) {
  SPADE_CHECK(!prompt.empty(), "empty prompt");
  prompt_ = prompt;
  sp_fresh_ = false;
}

DecodeResult EvalRunner::on_cpu(std::shared_ptr<const sparse::SparseMethod> m,
                                const DecodeOptions& opt) {
  SPADE_CHECK(!prompt_.empty(), "decode before set_prompt");
  if (!sp_)
    sp_ = std::make_unique<SharedPrefill>(w_, opt_.max_prompt, opt_.max_new, opt_.page_size,
                                          opt_.chunk, tok_, opt_.kv_dtype, opt_.kv_scale);
  if (!sp_fresh_) {
    sp_seconds_ = sp_->prefill(prompt_);
    sp_fresh_ = true;
  }
  DecodeResult r = sp_->decode(std::move(m), opt);
  r.prefill_seconds = sp_seconds_;
  return r;
}

DecodeResult EvalRunner::on_gpu(size_t run, bool full, const DecodeOptions& opt) {
  SPADE_CHECK(!prompt_.empty(), "decode before set_prompt");
#if defined(SPADE_HAVE_CUDA)
  // The reference shares the model of a run labelled "full" (both are CudaSparse{}).
  if (full) return gpu_->dec->decode("full", CudaSparse{}, prompt_, opt);
  return gpu_->dec->decode(runs_[run].label, gpu_->sparse[run], prompt_, opt);
#else
  fail("EvalRunner: no CUDA backend in this build");
#endif
}

DecodeResult EvalRunner::decode(size_t run, const DecodeOptions& opt) {
  SPADE_CHECK(run < runs_.size(), "EvalRunner: no run ", run);
  DecodeOptions o = opt;
  o.correction_every = correction_[run];
  return place_[run].gpu ? on_gpu(run, false, o) : on_cpu(cpu_[run], o);
}

DecodeResult EvalRunner::decode_full(size_t run, const DecodeOptions& opt) {
  SPADE_CHECK(run < runs_.size(), "EvalRunner: no run ", run);
  if (place_[run].gpu) return on_gpu(run, true, opt);
  if (!cpu_full_) cpu_full_ = sparse::make_method(sparse::SparseConfig::parse_spec("full"), w_.config);
  return on_cpu(cpu_full_, opt);
}

std::string EvalRunner::describe(size_t run) const {
#if defined(SPADE_HAVE_CUDA)
  if (place_[run].gpu) return gpu_->sparse[run].describe();
#endif
  return cpu_[run]->describe();
}

}  // namespace spade::eval

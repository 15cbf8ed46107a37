// CudaModel as the scheduler's StepModel (CUDA builds): the device KV pool's pages are
// accounted on the host by CudaModel; attention is the model's methods': its own
// (CudaModelOptions::sparse, the server's --sparse) or one added for a request
// (new_request_state with a method: CudaModel::add_method, keyed by the method's canonical
// spec).
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include "backend/cuda/cuda_common.h"
#include "engine/step_model.h"
#include "model/cuda_model.h"

namespace spade {

class CudaStepModel final : public StepModel {
 public:
  explicit CudaStepModel(CudaModel& m) : m_(m) {}
  const ModelConfig& config() const override { return m_.config(); }
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    return m_.forward(batch, row_of);
  }
  int page_size() const override { return m_.page_size(); }
  int64_t total_pages() const override { return m_.total_pages(); }
  int64_t free_pages() const override { return m_.free_pages(); }
  void release(PageTable& pt) override { m_.release(pt); }
  bool supports_attention_callbacks() const override { return false; }
  std::string device() const override { return cuda::device_summary(); }
  std::unique_ptr<sparse::MethodState> new_request_state(
      const sparse::SparseConfig* method) override {
    if (!method) return m_.new_request_state(0);
    const CudaSparse gs = m_.method_spec(*method);
    return m_.new_request_state(m_.add_method(method->to_string(), gs));
  }
  bool runs_methods() const override { return true; }
  std::string stats_text() const override {
    if (!m_.sparse().blasst_any()) return {};
    double r[2] = {0, 0};  // skipped / visited tiles over every layer and KV head, per phase
    for (int ph = 0; ph < 2; ++ph) {
      uint64_t t = 0, k = 0;
      const std::vector<uint64_t> c = m_.blasst_counts(ph == 1);
      for (size_t i = 0; i + 1 < c.size(); i += 2) t += c[i], k += c[i + 1];
      r[ph] = t ? 100.0 * double(k) / double(t) : 0.0;
    }
    return cat("blasst (GPU): tiles skipped in prefill ",
               m_.blasst_prefill_active() ? cat(r[1], "%") : std::string("(dense prefill)"),
               ", in decode ", r[0], "%");
  }
  StepCounters step_counters() const override {
    const CudaModel::GraphCounters& g = m_.graph_counters();
    StepCounters c;
    c.replays = g.replays.load(), c.captures = g.captures.load(), c.updates = g.updates.load();
    c.instantiations = g.instantiations.load(), c.eager = g.eager.load();
    c.eager_host_s = 1e-9 * double(g.eager_host_ns.load());
    c.capture_host_s = 1e-9 * double(g.capture_host_ns.load());
    c.replay_host_s = 1e-9 * double(g.replay_host_ns.load());
    c.eager_device_s = 1e-9 * double(g.eager_device_ns.load());
    c.graph_device_s = 1e-9 * double(g.graph_device_ns.load());
    return c;
  }
  bool samples_on_device() const override { return true; }
  const std::vector<int32_t>& forward_sample(const std::vector<SeqInput>& batch,
                                             const std::vector<RowSampling>& rows) override {
    return m_.forward_sample_rows(batch, convert(rows));
  }
  void forward_sample_launch(const std::vector<SeqInput>& batch,
                             const std::vector<RowSampling>& rows) override {
    m_.forward_sample_rows_launch(batch, convert(rows));
  }
  const std::vector<int32_t>& forward_sample_wait() override { return m_.forward_sample_rows_wait(); }

 private:
  const std::vector<cuda::GpuSamplingRow>& convert(const std::vector<RowSampling>& rows) {
    rows_.resize(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const RowSampling& r = rows[i];
      rows_[i].p = cuda::GpuSampling{r.temperature, r.top_k, r.top_p, r.min_p, r.seed};
      rows_[i].draw = r.draw;
    }
    return rows_;
  }

  CudaModel& m_;
  std::vector<cuda::GpuSamplingRow> rows_;
};

}  // namespace spade
#endif  // SPADE_HAVE_CUDA

// What the scheduler needs from a model runner: one batched forward pass over paged
// sequences and the page accounting of the KV cache the runner owns. Two runners:
// CpuModel (host KV pool; honours SeqInput::attention, so sparse methods run there) and,
// in CUDA builds, CudaModel (device KV pool; dense attention only), see
// model/cuda_step_model.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/cpu_model.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade {

class StepModel {
 public:
  virtual ~StepModel() = default;
  virtual const ModelConfig& config() const = 0;
  // CpuModel::forward's contract: reserves the batch's pages first (throws with nothing
  // written when the pool is short), returns logits rows on the host, row_of[i] = the row
  // of sequence i, and advances every page table's length.
  virtual const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                            std::vector<int64_t>& row_of) = 0;
  virtual int page_size() const = 0;
  virtual int64_t total_pages() const = 0;
  virtual int64_t free_pages() const = 0;
  int64_t used_pages() const { return total_pages() - free_pages(); }
  virtual void release(PageTable& pt) = 0;
  // Whether SeqInput::attention callbacks (sparse methods) are honoured.
  virtual bool supports_attention_callbacks() const = 0;
  virtual std::string device() const = 0;  // "cpu", or the GPU's name
  // Sampling on the device (CudaModel): one token per sequence of `batch`, each with its own
  // parameters, and no logits copied to the host. The scheduler takes this path for steps in
  // which no request needs host logits (logprobs, repetition penalty).
  struct RowSampling {
    float temperature = 0.f;
    int top_k = 0;
    float top_p = 1.f;
    float min_p = 0.f;
    uint64_t seed = 0;
    uint64_t draw = 0;  // index of the token drawn within its request
  };
  virtual bool samples_on_device() const { return false; }
  virtual const std::vector<int32_t>& forward_sample(const std::vector<SeqInput>& batch,
                                                     const std::vector<RowSampling>& rows) {
    (void)batch, (void)rows;
    fail("this runner does not sample on the device");
  }
  // forward_sample in two halves, so that the scheduler delivers the previous step's tokens
  // while the device runs this one: launch enqueues the step (its page tables advanced, its
  // inputs consumed: the batch may change once it returns) and wait returns its tokens. No
  // other call on the runner in between. By default launch runs the whole forward_sample.
  virtual void forward_sample_launch(const std::vector<SeqInput>& batch,
                                     const std::vector<RowSampling>& rows) {
    launched_ = &forward_sample(batch, rows);
  }
  virtual const std::vector<int32_t>& forward_sample_wait() {
    SPADE_CHECK(launched_, "forward_sample_wait without a launched step");
    const std::vector<int32_t>* t = launched_;
    launched_ = nullptr;
    return *t;
  }
  // The state of a request whose method the runner runs itself (the GPU's methods), passed as
  // SeqInput::device_state on each of its steps: `method` null is the runner's own method,
  // else a method for this request only (runners with runs_methods()). nullptr when the
  // method keeps no state. Throws spade::Error for a method the runner cannot run.
  virtual std::unique_ptr<sparse::MethodState> new_request_state(
      const sparse::SparseConfig* method) {
    SPADE_CHECK(!method, "this runner (", device(), ") runs no per-request methods itself");
    return nullptr;
  }
  // Whether new_request_state takes per-request methods.
  virtual bool runs_methods() const { return false; }
  // How the runner's steps ran (CUDA graphs): replays of a captured graph, captures (each then
  // instantiated or updated in place), and steps run eagerly (launch by launch). Safe to read
  // from any thread while steps run.
  // Also the time by path: host seconds in launching (an eager step's launches; a capture with
  // its update or instantiation and replay; a replay alone) and device seconds of the steps
  // (CUDA events around each), eager and graph.
  struct StepCounters {
    uint64_t replays = 0, captures = 0, updates = 0, instantiations = 0, eager = 0;
    double eager_host_s = 0, capture_host_s = 0, replay_host_s = 0;
    double eager_device_s = 0, graph_device_s = 0;
  };
  virtual StepCounters step_counters() const { return {}; }
  // The runner's own counters of its methods for --stats, one line each (GPU: BLASST tiles
  // skipped per phase); empty when it keeps none.
  virtual std::string stats_text() const { return {}; }

 private:
  const std::vector<int32_t>* launched_ = nullptr;  // the default forward_sample_launch's tokens
};

// CpuModel over its KVPool.
// Tests derive from it to observe or change what the scheduler asks of a runner.
class CpuStepModel : public StepModel {
 public:
  explicit CpuStepModel(CpuModel& m) : m_(m) {}
  const ModelConfig& config() const override { return m_.config(); }
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    return m_.forward(batch, row_of);
  }
  int page_size() const override { return m_.kv().layout().page_size; }
  int64_t total_pages() const override { return m_.kv().n_pages(); }
  int64_t free_pages() const override { return m_.kv().free_pages(); }
  void release(PageTable& pt) override { m_.kv().release(pt); }
  bool supports_attention_callbacks() const override { return true; }
  std::string device() const override { return "cpu"; }

 protected:
  CpuModel& m_;
};

}  // namespace spade

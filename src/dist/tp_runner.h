// The tensor-parallel rank protocol (issue 39): rank 0 runs the engine (scheduler, tokenizer,
// HTTP) over a TpStepModel; every other rank runs run_follower(), which mirrors rank 0's steps
// on its own shard of the model (dist/shard.h) and its own KV pool (its KV heads only).
//
// Per forward step rank 0 broadcasts a StepPlan over the Communicator (two broadcasts: a fixed
// header with the payload's size, then the payload), then runs its own shard's forward; the
// followers run the same forward (the all-reduces inside it meet rank 0's). The plan is
// device-neutral: per sequence a stable id, the tokens, the length cached before them (their
// positions start there), the page ids of the sequence's page table after this step's
// reservation, and the all_logits / dense flags; plus the sequences released since the last
// step (their pages go back first) and, once, shutdown. Rank 0 reserves the pages before it
// broadcasts (all or nothing: a short pool throws before any rank hears of the step), so the
// page allocators of all ranks see the same requests in the same order and hand out the same
// ids, which each follower checks after its forward (a mismatch: the ranks diverged, an error).
//
// Before the first step rank 0 broadcasts a TpInit (the model's shape and the KV pool's
// options): followers need only the model path and the rendezvous address, and a follower
// that loaded another model makes every rank fail at start-up.
//
// Followers compute no logits (CpuModel::set_logits(false)). Sparse methods are refused under
// TP so far (the CPU sparse sessions would have to run on every rank; see docs/cli.md).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dist/communicator.h"
#include "engine/runner.h"
#include "engine/step_model.h"

namespace spade::dist {

struct StepPlan {
  struct Seq {
    uint64_t id = 0;
    int64_t cached = 0;  // tokens in the sequence's cache before this step
    bool all_logits = false, dense = false;
    std::vector<int32_t> tokens;
    std::vector<int32_t> pages;  // its page table once this step's pages are reserved
  };
  std::vector<uint64_t> released;  // sequences released before this step (in order)
  std::vector<Seq> seqs;
  std::vector<uint8_t> encode() const;
  static StepPlan decode(const uint8_t* p, size_t n);  // throws spade::Error on a bad payload
};

// What rank 0 tells the followers once, after the rendezvous.
struct TpInit {
  uint32_t magic = 0;
  int32_t tp = 0;
  int32_t n_layers = 0, hidden = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, ffn = 0, vocab = 0;
  int32_t page_size = 0, kv_dtype = 0;
  float kv_scale = 0.f;
  int64_t kv_pages = 0;
};

// Rank 0's model: its shard (CpuModel over a pool of its KV heads) driven through the step
// protocol. Destroying it tells the followers to shut down (when the ranks still talk).
class TpStepModel : public StepModel {
 public:
  // `comm`: rank 0 of tp ranks, every follower joined. Sends TpInit and checks that every rank
  // loaded the same model (throws spade::Error otherwise).
  TpStepModel(std::unique_ptr<Communicator> comm, const ModelWeights& w, const RunnerOptions& opt);
  ~TpStepModel() override;

  const ModelConfig& config() const override { return full_config_; }
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override;
  int page_size() const override { return kv_->layout().page_size; }
  int64_t total_pages() const override { return kv_->n_pages(); }
  int64_t free_pages() const override { return kv_->free_pages(); }
  void release(PageTable& pt) override;
  bool supports_attention_callbacks() const override { return false; }
  std::string device() const override;
  double kv_mib() const { return double(kv_->bytes()) / (1024.0 * 1024.0); }
  // Sends shutdown now (the destructor's job; idempotent).
  void shutdown();

 private:
  struct Tracked {
    uint64_t id = 0;
    int64_t length = 0;  // what the followers hold
  };
  std::unique_ptr<Communicator> comm_;
  ModelConfig full_config_;
  ModelWeights shard_;
  std::unique_ptr<KVPool> kv_;
  std::unique_ptr<CpuModel> model_;
  std::unordered_map<const PageTable*, Tracked> seqs_;
  std::vector<uint64_t> released_;  // since the last message
  uint64_t next_id_ = 1;
  std::string broken_;  // set once the ranks may have diverged: every later step throws it
  bool shut_down_ = false;
};

// rank 0: the runner for opt.tp > 1 (make_runner's TP branch). Joins the followers at
// opt.dist_listener (a socket already bound) or opt.dist_init (throws spade::Error for
// options TP cannot run yet: --device cuda, a sparse method).
Runner make_tp_runner(const ModelWeights& w, const RunnerOptions& opt);

// A follower's loop: mirrors rank 0's steps on `model` (its shard, logits off) until rank 0
// sends shutdown (returns) or a rank fails (throws spade::Error). `model` may be any StepModel
// whose page allocator works like KVPool's (a CudaModel rank later, see docs/design.md).
void run_follower(StepModel& model, Communicator& comm);

// A follower process: joins rank 0 at `address` as rank `rank` of `size`, receives TpInit,
// builds its shard of `w` (CPU), and runs run_follower until shutdown.
void run_follower_rank(const ModelWeights& w, const std::string& address, int rank, int size);

}  // namespace spade::dist

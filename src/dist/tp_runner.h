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
// Followers compute no logits (CpuModel::set_logits(false), CudaModelOptions::logits).
//
// Sparse methods (CPU ranks): the runner runs each request's method itself (runs_methods():
// new_request_state, the method of the request or RunnerOptions::sparse). Every rank runs a
// SparseSession of it over its own KV pool and heads: the method is built for the whole model
// (its defaults, LycheeDecode's roles), the session knows which of the model's heads it holds
// and how to gather across ranks (sparse/method.h HeadShard). The request's first step names
// its method in the plan (StepPlan::Seq::method), so followers make the same session; each
// step carries the token text given since the last (LycheeCluster's chunking). Selections per
// KV head stay on their rank (a KV head's query heads are on the same rank, dist/shard.h);
// LessIsMore's one set for all heads gathers every rank's per-head top lists (an all-reduce of
// a zero-padded table, exact) and merges them alike on every rank, so every rank's selection
// is the one-rank selection (tests/test_tp_sparse.cpp). Refused, with the reason: recall
// (it measures the attention mass over every head; a rank holds only its own), LycheeDecode
// roles in a reordered head order (sets would cross ranks).
//
// Sparse methods (GPU ranks): each rank's CudaModel adds the request's method itself
// (CudaStepModel::new_request_state; rank 0's state travels in a TpMethodState, the followers
// add theirs when the plan names the method), parsed for the whole model and run on the
// rank's heads (CudaModelOptions::tp_model / tp_kv0: LycheeDecode's roles sliced). Every
// method attends on the model's stream under TP (NCCL collectives of one communicator must
// not overlap); LessIsMore gathers its merge keys with an all-reduce on that stream, inside
// the captured decode graph too. On two H200s the runner with per-request methods and
// `generate --device cuda --tp 2 --sparse M` matched TP=1; selections can differ from TP=1's
// at near-ties (tests/gpu/test_cuda_tp.cpp CudaTp.SparseMethods*).
//
// GPU ranks (TpInit::cuda; tp_cuda.cpp, CUDA builds with NCCL): each rank is one process on
// its own GPU (rank r takes device r mod the visible GPUs), a CudaModel of its shard whose
// all-reduces go over NCCL (the communicator made after the TCP rendezvous, its unique id
// broadcast over TCP). The CudaModels' page allocators are identical and see the same
// reserve / release sequence, so every rank hands out rank 0's page ids (checked per step, as
// on the CPU). Rank 0 samples on its GPU (TpStepModel::forward_sample*). Full attention ran on
// two H200s (tests/gpu/test_cuda_tp.cpp CudaTp.*, tests/e2e/test_tp_cuda.py).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dist/communicator.h"
#include "engine/runner.h"
#include "engine/step_model.h"
#include "sparse/selection.h"

namespace spade::dist {

struct StepPlan {
  struct Seq {
    uint64_t id = 0;
    int64_t cached = 0;  // tokens in the sequence's cache before this step
    bool all_logits = false, dense = false;
    std::vector<int32_t> tokens;
    std::vector<int32_t> pages;  // its page table once this step's pages are reserved
    // The sequence's sparse method, sent with its first step (has_method; none: dense), and
    // the token text its method was given since the previous step (LycheeCluster's chunking).
    bool has_method = false;
    sparse::SparseConfig method;
    std::vector<std::string> text;
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
  // The GPU ranks (cuda != 0): what CudaModelOptions every rank needs alike.
  int32_t cuda = 0, max_batch = 0, deterministic = 0;
  int64_t max_step_tokens = 0, max_logit_rows = 0;
  // The GPU ranks keep every method's per-page data (CudaModelOptions::any_method): requests
  // may name methods, or the runner's own method is not full attention.
  int32_t any_method = 0;
};

class RankSessions;  // tp_runner.cpp: a rank's sparse sessions

// One rank's shard on its device, as TpStepModel (rank 0) and the followers drive it.
struct TpRankModel {
  std::shared_ptr<void> owned;  // what `step` runs on (the model, its pool or communicator)
  std::unique_ptr<StepModel> step;
  std::function<void(PageTable&, int64_t)> reserve;  // the pool's reserve (pages for a length)
  double kv_mib = 0;
  int64_t max_logit_rows = 0, max_step_tokens = 0;  // cuda: what the runner takes
  // CPU ranks: the pool of the rank's KV heads (its sparse sessions read it) and the shard's
  // config (the rank's head counts); null on GPU ranks.
  KVPool* pool = nullptr;
  ModelConfig shard_config;
};

// Tests: called with the final selection of every sparse decode layer on every CPU rank (the
// rank, the sequence's plan id, the layer, the selection over the rank's KV heads), from the
// ranks' threads. Process-wide: set it before the ranks start, clear it after they stopped.
using TpSelectTrace =
    std::function<void(int rank, uint64_t seq, int layer, const sparse::Selection& sel)>;
void set_tp_select_trace(TpSelectTrace fn);

// tp_cuda.cpp. Throws spade::Error unless this build has CUDA and NCCL and, when every rank
// runs on this host (`local`), at least `tp` GPUs are visible ("--tp 2 needs 2 GPUs, 1 visible").
void check_cuda_tp(int tp, bool local);
// The GPU of rank `rank` on its host: rank mod the visible GPUs.
int cuda_device_of_rank(int rank);
// Binds this thread to `device`, joins the NCCL communicator of bootstrap's ranks (collective:
// every rank calls it at the same point) and builds the CudaModel of `shard` (its config: the
// rank's heads / ffn) with init's options on it; logits on rank 0 only. Untested until a
// multi-GPU run. `full`: the whole model's config (sparse methods are parsed for it and run
// on the rank's heads: CudaModelOptions::tp_model).
TpRankModel make_cuda_rank(const ModelWeights& shard, const ModelConfig& full,
                           Communicator& bootstrap, const TpInit& init, int device);

// Rank 0's model: its shard (CpuModel over a pool of its KV heads, or a CudaModel on GPU 0)
// driven through the step protocol. Destroying it tells the followers to shut down (when the
// ranks still talk).
class TpStepModel : public StepModel {
 public:
  // `comm`: rank 0 of tp ranks, every follower joined. Sends TpInit and checks that every rank
  // loaded the same model (throws spade::Error otherwise).
  TpStepModel(std::unique_ptr<Communicator> comm, const ModelWeights& w, const RunnerOptions& opt);
  ~TpStepModel() override;

  const ModelConfig& config() const override { return full_config_; }
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override;
  int page_size() const override { return rank_.step->page_size(); }
  int64_t total_pages() const override { return rank_.step->total_pages(); }
  int64_t free_pages() const override { return rank_.step->free_pages(); }
  void release(PageTable& pt) override;
  bool supports_attention_callbacks() const override { return false; }
  std::string device() const override;
  // The GPU ranks sample on rank 0's GPU (the followers run the same step without logits).
  bool samples_on_device() const override { return rank_.step->samples_on_device(); }
  const std::vector<int32_t>& forward_sample(const std::vector<SeqInput>& batch,
                                             const std::vector<RowSampling>& rows) override;
  void forward_sample_launch(const std::vector<SeqInput>& batch,
                             const std::vector<RowSampling>& rows) override;
  const std::vector<int32_t>& forward_sample_wait() override;
  StepCounters step_counters() const override { return rank_.step->step_counters(); }
  std::string stats_text() const override { return rank_.step->stats_text(); }  // rank 0's
  // Sparse methods (CPU ranks): each request's method runs as a SparseSession on every rank
  // over the rank's KV heads; the state returned here holds rank 0's, and the request's first
  // step tells the followers to make theirs. nullptr for full attention.
  std::unique_ptr<sparse::MethodState> new_request_state(const sparse::SparseConfig* method) override;
  bool runs_methods() const override { return true; }
  double kv_mib() const { return rank_.kv_mib; }
  const TpRankModel& rank_model() const { return rank_; }
  // Sends shutdown now (the destructor's job; idempotent).
  void shutdown();

 private:
  struct Tracked {
    uint64_t id = 0;
    int64_t length = 0;  // what the followers hold
  };
  // Checks the step (a refused step reaches no rank), reserves its pages and broadcasts its
  // plan; from then on a failure leaves the ranks out of step (broken_).
  // Returns the batch for rank 0's shard (its sparse sessions' attention set).
  const std::vector<SeqInput>& begin_step(const std::vector<SeqInput>& batch);
  [[noreturn]] void broke(const std::exception& e);

  std::unique_ptr<Communicator> comm_;
  ModelConfig full_config_;
  sparse::SparseConfig own_method_;  // RunnerOptions::sparse: the method of requests with none
  bool cuda_ = false;
  std::vector<SeqInput> batch_;  // the step's batch as rank 0's shard runs it
  std::unique_ptr<RankSessions> sessions_;  // CPU ranks
  ModelWeights shard_;  // the CPU rank's weights (the CUDA rank's are on its GPU)
  TpRankModel rank_;
  std::unordered_map<const PageTable*, Tracked> seqs_;
  std::vector<uint64_t> released_;  // since the last message
  uint64_t next_id_ = 1;
  std::string broken_;  // set once the ranks may have diverged: every later step throws it
  bool shut_down_ = false;
};

// rank 0: the runner for opt.tp > 1 (make_runner's TP branch). Joins the followers at
// opt.dist_listener (a socket already bound: the ranks run on this host) or opt.dist_init
// (throws spade::Error for options TP cannot run yet: a sparse method; --device cuda without
// NCCL or with fewer local GPUs than ranks).
Runner make_tp_runner(const ModelWeights& w, const RunnerOptions& opt);

// A follower's loop: mirrors rank 0's steps on `model` (its shard, logits off) until rank 0
// sends shutdown (returns) or a rank fails (throws spade::Error). `model` may be any StepModel
// whose page allocator works like KVPool's (a CudaModel rank later, see docs/design.md).
void run_follower(StepModel& model, Communicator& comm);
// The same with the rank's sparse sessions (CPU ranks): a sequence's first step names its
// method, and the follower runs it on its heads as rank 0 does on its own.
void run_follower(StepModel& model, Communicator& comm, RankSessions* sessions);

// A follower process: joins rank 0 at `address` as rank `rank` of `size`, receives TpInit,
// builds its shard of `w` (on the CPU, or with TpInit::cuda a CudaModel on GPU
// cuda_device_of_rank(rank), selected before the process's first CUDA work), and runs
// run_follower until shutdown.
void run_follower_rank(const ModelWeights& w, const std::string& address, int rank, int size);

}  // namespace spade::dist

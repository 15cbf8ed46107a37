// The tensor-parallel step protocol (tp_runner.h): rank 0's TpStepModel and the followers' loop.
#include "dist/tp_runner.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "dist/shard.h"
#include "dist/tcp_communicator.h"
#include "model/cpu_model.h"
#include "sparse/registry.h"
#include "sparse/session.h"
#if defined(SPADE_HAVE_CUDA)
#include "sparse/gpu/method.h"
#endif

namespace spade::dist {

namespace {

constexpr uint32_t kInitMagic = 0x54504931;  // "TPI1"
constexpr uint32_t kMsgMagic = 0x54504d31;   // "TPM1"
enum : uint32_t { kStep = 1, kShutdown = 2 };

struct MsgHeader {
  uint32_t magic = kMsgMagic;
  uint32_t kind = 0;
  int64_t bytes = 0;
};

class Writer {
 public:
  template <typename T>
  void put(T v) {
    const size_t at = b_.size();
    b_.resize(at + sizeof(T));
    std::memcpy(b_.data() + at, &v, sizeof(T));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put<int64_t>(int64_t(v.size()));
    const size_t at = b_.size();
    b_.resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(b_.data() + at, v.data(), v.size() * sizeof(T));
  }
  void put_str(const std::string& v) { put_vec(std::vector<char>(v.begin(), v.end())); }
  std::vector<uint8_t> take() { return std::move(b_); }

 private:
  std::vector<uint8_t> b_;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_ + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string get_str() {
    const std::vector<char> v = get_vec<char>();
    return std::string(v.begin(), v.end());
  }
  template <typename T>
  std::vector<T> get_vec() {
    const int64_t n = get<int64_t>();
    SPADE_CHECK(n >= 0 && uint64_t(n) <= (n_ - at_) / sizeof(T), "tensor parallelism: bad step message");
    std::vector<T> v(static_cast<size_t>(n));
    if (n) std::memcpy(v.data(), p_ + at_, size_t(n) * sizeof(T));
    at_ += size_t(n) * sizeof(T);
    return v;
  }
  bool done() const { return at_ == n_; }

 private:
  void need(size_t k) const {
    SPADE_CHECK(k <= n_ - at_, "tensor parallelism: bad step message (truncated)");
  }
  const uint8_t* p_;
  size_t n_, at_ = 0;
};

void send_message(Communicator& c, uint32_t kind, std::vector<uint8_t> payload) {
  MsgHeader h;
  h.kind = kind;
  h.bytes = int64_t(payload.size());
  c.broadcast(&h, sizeof h, 0);
  if (h.bytes) c.broadcast(payload.data(), h.bytes, 0);
}

bool is_dense_method(const sparse::SparseConfig& m) {
  return m.method == "full" && m.options.empty() && !m.measure_recall;
}

TpInit make_init(const ModelConfig& c, int tp, const RunnerOptions& opt) {
  TpInit i;
  i.magic = kInitMagic;
  i.tp = tp;
  i.n_layers = c.n_layers;
  i.hidden = int32_t(c.hidden);
  i.n_heads = c.n_heads;
  i.n_kv_heads = c.n_kv_heads;
  i.head_dim = c.head_dim;
  i.ffn = int32_t(c.ffn);
  i.vocab = int32_t(c.vocab);
  i.page_size = opt.page_size;
  i.kv_dtype = int32_t(opt.kv_dtype);
  i.kv_scale = opt.kv_scale;
  i.kv_pages = opt.kv_pages;
  i.cuda = opt.device == "cuda" ? 1 : 0;
  i.max_batch = opt.max_batch;
  i.deterministic = opt.deterministic ? 1 : 0;
  i.max_step_tokens = opt.max_step_tokens;
  i.max_logit_rows = opt.max_logit_rows;
  i.any_method = opt.per_request_methods || !is_dense_method(opt.sparse) ? 1 : 0;
  return i;
}

bool same_shape(const TpInit& a, const TpInit& b) {
  return a.n_layers == b.n_layers && a.hidden == b.hidden && a.n_heads == b.n_heads &&
         a.n_kv_heads == b.n_kv_heads && a.head_dim == b.head_dim && a.ffn == b.ffn &&
         a.vocab == b.vocab;
}

// Every rank: whether all loaded the same model (rank 0's TpInit against each one's own).
void agree_on_model(Communicator& c, bool mine_matches) {
  float bad = mine_matches ? 0.f : 1.f;
  c.all_reduce_sum(&bad, 1);
  SPADE_CHECK(bad == 0.f, "tensor parallelism: ", int(bad), " rank(s) loaded a model of another "
              "shape than rank 0's (every rank needs the same --model)");
}

std::unique_ptr<KVPool> shard_pool(const ModelConfig& shard, int page_size, KvDtype dtype,
                                   float kv_scale, int64_t pages) {
  KVLayout lay{shard.n_layers, shard.n_kv_heads, shard.head_dim, page_size};
  lay.dtype = dtype;
  lay.kv_scale = kv_scale;
  return std::make_unique<KVPool>(lay, pages);
}

// The CPU rank: CpuModel of `shard` over a pool of its KV heads.
TpRankModel make_cpu_rank(const ModelWeights& shard, Communicator& comm, const TpInit& init,
                          bool logits) {
  struct Owned {
    std::unique_ptr<KVPool> kv;
    std::unique_ptr<CpuModel> model;
  };
  auto o = std::make_shared<Owned>();
  o->kv = shard_pool(shard.config, init.page_size, KvDtype(init.kv_dtype), init.kv_scale,
                     init.kv_pages);
  o->model = std::make_unique<CpuModel>(shard, *o->kv, &comm);
  o->model->set_logits(logits);
  TpRankModel r;
  r.step = std::make_unique<CpuStepModel>(*o->model);
  KVPool* kv = o->kv.get();
  r.pool = kv;
  r.shard_config = shard.config;
  r.reserve = [kv](PageTable& pt, int64_t n) { kv->reserve(pt, n); };
  r.kv_mib = double(kv->bytes()) / (1024.0 * 1024.0);
  r.owned = std::move(o);
  return r;
}

TpSelectTrace g_select_trace;  // tests (set_tp_select_trace)

// What a method needs to run under tensor parallelism, or a spade::Error saying why it cannot.
void check_tp_method(const sparse::SparseConfig& m, int tp) {
  SPADE_CHECK(!m.measure_recall, "--tp ", tp, ": sparse option 'recall' measures the attention "
              "mass over every head, and each rank holds only its own heads (use --tp 1)");
}

}  // namespace

// A rank's sparse sessions: each method is built for the whole model (its defaults and
// per-head tables are the model's), each session runs over the rank's pool and heads and
// gathers across the ranks through `comm` where its selection spans heads (sparse/method.h:
// HeadShard).
class RankSessions {
 public:
  RankSessions(const ModelConfig& full, const TpRankModel& rank, Communicator& comm)
      : full_(full), shard_(rank.shard_config), pool_(rank.pool), comm_(comm) {}

  std::unique_ptr<sparse::SparseSession> make(const sparse::SparseConfig& cfg) {
    SPADE_CHECK(pool_, "tensor parallelism: this rank has no host KV pool for sparse sessions");
    const std::string key = cfg.to_string();
    std::shared_ptr<const sparse::SparseMethod> m;
    if (auto it = methods_.find(key); it != methods_.end()) {
      m = it->second;
    } else {
      m = sparse::make_method(cfg, full_);
      if (methods_.size() < 64) methods_[key] = m;
    }
    sparse::HeadShard h;
    const int r = comm_.rank();
    h.q0 = r * shard_.n_heads;
    h.kv0 = r * shard_.n_kv_heads;
    h.Hq_all = full_.n_heads;
    h.Hkv_all = full_.n_kv_heads;
    Communicator* c = &comm_;
    h.all_reduce_sum = [c](float* p, int64_t n) { c->all_reduce_sum(p, n); };
    return std::make_unique<sparse::SparseSession>(std::move(m), shard_, *pool_,
                                                   sparse::SessionOptions{}, std::move(h));
  }

  // Sends the session's selections to the test trace as sequence `id`'s.
  void trace(sparse::SparseSession& s, uint64_t id) const {
    if (!g_select_trace) return;
    const int r = comm_.rank();
    s.on_select = [r, id](int layer, const sparse::Selection& sel) {
      if (g_select_trace) g_select_trace(r, id, layer, sel);
    };
  }

 private:
  ModelConfig full_, shard_;
  KVPool* pool_;
  Communicator& comm_;
  std::unordered_map<std::string, std::shared_ptr<const sparse::SparseMethod>> methods_;
};

namespace {

// Rank 0's state of a request with a sparse method: rank 0's part of it (CPU ranks: its
// session; GPU ranks: its CudaModel's request state, the model running the method on the
// rank's heads) and what the followers are told with the request's next step (the method on
// the first, the token text given since). One state serves one sequence from its first step
// to its release.
class TpMethodState : public sparse::MethodState {
 public:
  TpMethodState(sparse::SparseConfig cfg, std::unique_ptr<sparse::SparseSession> s,
                int64_t rows_per_token)
      : cfg_(std::move(cfg)), session_(std::move(s)), rows_per_token_(rows_per_token) {}
  TpMethodState(sparse::SparseConfig cfg, std::unique_ptr<sparse::MethodState> device, int ranks)
      : cfg_(std::move(cfg)), device_(std::move(device)), rows_per_token_(ranks) {}
  void append_token_text(std::string_view piece) override {
    if (!wants_token_text()) return;
    if (session_) session_->append_token_text(piece);
    if (device_) device_->append_token_text(piece);
    text_.emplace_back(piece);
  }
  bool wants_token_text() const override {
    return session_ ? session_->wants_token_text() : device_ && device_->wants_token_text();
  }
  // CPU: rank 0's mean per KV head times every KV head of the model; GPU: rank 0's rows times
  // the ranks.
  int64_t attended_rows() const override {
    if (session_) return int64_t(session_->totals().tokens_sum * double(rows_per_token_) + 0.5);
    const int64_t r = device_ ? device_->attended_rows() : -1;
    return r < 0 ? r : r * rows_per_token_;
  }
  sparse::SparseSession* session() { return session_.get(); }
  sparse::MethodState* device() { return device_.get(); }
  const sparse::SparseConfig& config() const { return cfg_; }
  std::vector<std::string> take_text() { return std::exchange(text_, {}); }
  uint64_t seq = 0;  // the plan id of its sequence, once it has run

 private:
  sparse::SparseConfig cfg_;
  std::unique_ptr<sparse::SparseSession> session_;
  std::unique_ptr<sparse::MethodState> device_;
  int64_t rows_per_token_;
  std::vector<std::string> text_;
};

}  // namespace

void set_tp_select_trace(TpSelectTrace fn) { g_select_trace = std::move(fn); }

std::vector<uint8_t> StepPlan::encode() const {
  Writer w;
  w.put_vec(released);
  w.put<int64_t>(int64_t(seqs.size()));
  for (const Seq& s : seqs) {
    w.put<uint64_t>(s.id);
    w.put<int64_t>(s.cached);
    w.put<uint32_t>((s.all_logits ? 1u : 0u) | (s.dense ? 2u : 0u) | (s.has_method ? 4u : 0u));
    w.put_vec(s.tokens);
    w.put_vec(s.pages);
    if (s.has_method) {
      w.put_str(s.method.method);
      w.put<uint32_t>(s.method.measure_recall ? 1u : 0u);
      w.put<int64_t>(int64_t(s.method.options.size()));
      for (const auto& [k, v] : s.method.options) {
        w.put_str(k);
        w.put_str(v);
      }
    }
    w.put<int64_t>(int64_t(s.text.size()));
    for (const std::string& t : s.text) w.put_str(t);
  }
  return w.take();
}

StepPlan StepPlan::decode(const uint8_t* p, size_t n) {
  Reader r(p, n);
  StepPlan plan;
  plan.released = r.get_vec<uint64_t>();
  const int64_t k = r.get<int64_t>();
  SPADE_CHECK(k >= 0 && uint64_t(k) <= n, "tensor parallelism: bad step message");
  plan.seqs.resize(size_t(k));
  for (Seq& s : plan.seqs) {
    s.id = r.get<uint64_t>();
    s.cached = r.get<int64_t>();
    const uint32_t f = r.get<uint32_t>();
    s.all_logits = f & 1u;
    s.dense = f & 2u;
    s.has_method = f & 4u;
    s.tokens = r.get_vec<int32_t>();
    s.pages = r.get_vec<int32_t>();
    if (s.has_method) {
      s.method.method = r.get_str();
      s.method.measure_recall = r.get<uint32_t>() & 1u;
      const int64_t m = r.get<int64_t>();
      SPADE_CHECK(m >= 0 && uint64_t(m) <= n, "tensor parallelism: bad step message");
      for (int64_t i = 0; i < m; ++i) {
        std::string key = r.get_str();
        s.method.options[key] = r.get_str();
      }
    }
    const int64_t t = r.get<int64_t>();
    SPADE_CHECK(t >= 0 && uint64_t(t) <= n, "tensor parallelism: bad step message");
    s.text.resize(size_t(t));
    for (std::string& x : s.text) x = r.get_str();
  }
  SPADE_CHECK(r.done(), "tensor parallelism: bad step message (trailing bytes)");
  return plan;
}

// ---- rank 0

TpStepModel::TpStepModel(std::unique_ptr<Communicator> comm, const ModelWeights& w,
                         const RunnerOptions& opt)
    : comm_(std::move(comm)), full_config_(w.config) {
  SPADE_CHECK(comm_ && comm_->rank() == 0, "TpStepModel runs on rank 0");
  const int tp = comm_->size();
  TpInit init = make_init(w.config, tp, opt);
  comm_->broadcast(&init, sizeof init, 0);
  agree_on_model(*comm_, true);
  shard_ = shard_weights(w, 0, tp);
  own_method_ = opt.sparse;
  cuda_ = init.cuda != 0;
  if (init.cuda) {
    rank_ = make_cuda_rank(shard_, full_config_, *comm_, init, cuda_device_of_rank(0));
    shard_ = ModelWeights{};  // uploaded
    comm_->barrier();  // every rank built its model (one that failed has closed its connection)
  } else {
    rank_ = make_cpu_rank(shard_, *comm_, init, true);
    sessions_ = std::make_unique<RankSessions>(full_config_, rank_, *comm_);
  }
}

std::unique_ptr<sparse::MethodState> TpStepModel::new_request_state(
    const sparse::SparseConfig* method) {
  const sparse::SparseConfig& m = method ? *method : own_method_;
  check_tp_method(m, comm_->size());
  if (is_dense_method(m)) return nullptr;
  if (cuda_)  // the rank's CudaModel runs it (its request state); the followers' alike
    return std::make_unique<TpMethodState>(m, rank_.step->new_request_state(&m), comm_->size());
  SPADE_CHECK(sessions_, "tensor parallelism: no sparse sessions on this rank");
  return std::make_unique<TpMethodState>(
      m, sessions_->make(m), int64_t(full_config_.n_layers) * full_config_.n_kv_heads);
}

TpStepModel::~TpStepModel() {
  try {
    shutdown();
  } catch (...) {
    // the ranks no longer talk: the followers see rank 0's connection close
  }
}

void TpStepModel::shutdown() {
  if (shut_down_ || !broken_.empty()) return;
  shut_down_ = true;
  Writer w;
  w.put_vec(released_);
  released_.clear();
  send_message(*comm_, kShutdown, w.take());
}

std::string TpStepModel::device() const {
  return cat(rank_.step->device(), ", --tp ", comm_->size());
}

void TpStepModel::release(PageTable& pt) {
  auto it = seqs_.find(&pt);
  if (it != seqs_.end()) {
    released_.push_back(it->second.id);
    seqs_.erase(it);
  }
  rank_.step->release(pt);
}

void TpStepModel::broke(const std::exception& e) {
  broken_ = cat("tensor parallelism stopped: ", e.what());
  throw Error(broken_);
}

const std::vector<float>& TpStepModel::forward(const std::vector<SeqInput>& batch,
                                               std::vector<int64_t>& row_of) {
  const std::vector<SeqInput>& mine = begin_step(batch);
  try {
    return rank_.step->forward(mine, row_of);
  } catch (const std::exception& e) {
    broke(e);
  }
}

const std::vector<int32_t>& TpStepModel::forward_sample(const std::vector<SeqInput>& batch,
                                                        const std::vector<RowSampling>& rows) {
  const std::vector<SeqInput>& mine = begin_step(batch);
  try {
    return rank_.step->forward_sample(mine, rows);
  } catch (const std::exception& e) {
    broke(e);
  }
}

void TpStepModel::forward_sample_launch(const std::vector<SeqInput>& batch,
                                        const std::vector<RowSampling>& rows) {
  const std::vector<SeqInput>& mine = begin_step(batch);
  try {
    rank_.step->forward_sample_launch(mine, rows);
  } catch (const std::exception& e) {
    broke(e);
  }
}

const std::vector<int32_t>& TpStepModel::forward_sample_wait() {
  SPADE_CHECK(broken_.empty(), broken_);
  try {
    return rank_.step->forward_sample_wait();
  } catch (const std::exception& e) {
    broke(e);
  }
}

const std::vector<SeqInput>& TpStepModel::begin_step(const std::vector<SeqInput>& batch) {
  SPADE_CHECK(broken_.empty(), broken_);
  SPADE_CHECK(!shut_down_, "tensor parallelism: the ranks were shut down");
  const ModelConfig& c = full_config_;
  // Everything the forward would refuse, refused before any rank hears of the step.
  const int64_t P = rank_.step->page_size();
  int64_t need = 0;
  for (const SeqInput& s : batch) {
    SPADE_CHECK(s.n_tokens > 0 && s.pages && s.tokens, "forward: empty sequence input");
    SPADE_CHECK(!s.attention || s.dense, "--tp: sparse attention callbacks do not run across "
                "tensor-parallel ranks (the runner runs each request's method: "
                "new_request_state)");
    SPADE_CHECK(!s.device_state || dynamic_cast<TpMethodState*>(s.device_state),
                "--tp: a request state that this runner did not make");
    SPADE_CHECK(s.pages->length + s.n_tokens <= c.max_context, "sequence of ",
                s.pages->length + s.n_tokens, " tokens exceeds the model's context of ",
                c.max_context, " tokens");
    for (int64_t t = 0; t < s.n_tokens; ++t)
      SPADE_CHECK(s.tokens[t] >= 0 && s.tokens[t] < c.vocab, "token id ", s.tokens[t],
                  " outside the vocabulary (", c.vocab, " tokens)");
    auto it = seqs_.find(s.pages);
    if (const auto* st = static_cast<const TpMethodState*>(s.device_state))
      SPADE_CHECK(st->seq == (it == seqs_.end() ? 0 : it->second.id), "--tp: a request state "
                  "serves one sequence (make a new one with new_request_state)");
    if (it == seqs_.end())
      SPADE_CHECK(s.pages->length == 0 && s.pages->pages.empty(),
                  "tensor parallelism: a sequence of ", s.pages->length,
                  " tokens the other ranks never saw (its page table was filled elsewhere)");
    else
      SPADE_CHECK(it->second.length == s.pages->length, "tensor parallelism: a sequence's length ",
                  "changed outside the runner (", it->second.length, " -> ", s.pages->length, ")");
    need += std::max<int64_t>(0, (s.pages->length + s.n_tokens + P - 1) / P -
                                     int64_t(s.pages->pages.size()));
  }
  SPADE_CHECK(need <= rank_.step->free_pages(), "KV cache full: need ", need, " more pages of ",
              P, " tokens for this step, ", rank_.step->free_pages(), " of ",
              rank_.step->total_pages(), " pages free (raise --kv-pages)");
  StepPlan plan;
  plan.released = std::move(released_);
  released_.clear();
  batch_ = batch;
  for (SeqInput& s : batch_) {
    rank_.reserve(*s.pages, s.pages->length + s.n_tokens);  // cannot fail now
    auto [it, fresh] = seqs_.try_emplace(s.pages);
    if (fresh) it->second.id = next_id_++;
    StepPlan::Seq q;
    q.id = it->second.id;
    q.cached = s.pages->length;
    q.all_logits = s.all_logits;
    q.dense = s.dense;
    q.tokens.assign(s.tokens, s.tokens + s.n_tokens);
    q.pages = s.pages->pages;
    if (auto* st = static_cast<TpMethodState*>(s.device_state)) {
      // The request's method: rank 0's session (or GPU state) here, the followers' in their
      // loop.
      if (fresh) {
        st->seq = q.id;
        q.has_method = true;
        q.method = st->config();
        if (st->session()) sessions_->trace(*st->session(), q.id);
      }
      q.text = st->take_text();
      if (st->session()) {
        s.attention = s.dense ? nullptr : &st->session()->attention();
        s.device_state = nullptr;
      } else {
        s.device_state = st->device();
      }
    }
    plan.seqs.push_back(std::move(q));
    it->second.length = s.pages->length + s.n_tokens;
  }
  // From here on every rank runs this step: a failure leaves them out of step for good.
  try {
    send_message(*comm_, kStep, plan.encode());
  } catch (const std::exception& e) {
    broke(e);
  }
  return batch_;
}

Runner make_tp_runner(const ModelWeights& w, const RunnerOptions& opt) {
  SPADE_CHECK(opt.device == "cpu" || opt.device == "cuda", "--device must be cpu or cuda, got '",
              opt.device, "'");
  check_tp_method(opt.sparse, opt.tp);
  check_shardable(w.config, opt.tp);
  if (opt.device == "cuda") check_cuda_tp(opt.tp, opt.dist_listener != nullptr);
  std::unique_ptr<Communicator> comm;
  if (opt.dist_listener)
    comm = std::make_unique<TcpCommunicator>(std::move(*opt.dist_listener), opt.tp);
  else
    comm = std::make_unique<TcpCommunicator>(opt.dist_init, 0, opt.tp);
  auto model = std::make_unique<TpStepModel>(std::move(comm), w, opt);
  Runner r;
  r.kv_mib = model->kv_mib();
  r.max_step_tokens = std::max(opt.max_step_tokens, model->rank_model().max_step_tokens);
  r.max_logit_rows = model->rank_model().max_logit_rows;
  const int tp = opt.tp;
  r.check_method = [tp](const sparse::SparseConfig& m) { check_tp_method(m, tp); };
#if defined(SPADE_HAVE_CUDA)
  if (opt.device == "cuda")  // what the GPU cannot run, before the request reaches any rank
    r.check_method = [tp, c = w.config, P = opt.page_size,
                      fp8 = opt.kv_dtype == KvDtype::FP8](const sparse::SparseConfig& m) {
      check_tp_method(m, tp);
      check_gpu_kv_dtype(fp8, cuda_sparse_config(m, c, P));
    };
#endif
  r.model = std::move(model);
  return r;
}

// ---- followers

void run_follower(StepModel& model, Communicator& comm) { run_follower(model, comm, nullptr); }

void run_follower(StepModel& model, Communicator& comm, RankSessions* sessions) {
  struct Seq {
    PageTable pt;
    std::unique_ptr<sparse::SparseSession> session;  // its method on this rank's heads (CPU)
    std::unique_ptr<sparse::MethodState> state;      // ... or the model's request state (GPU)
  };
  std::unordered_map<uint64_t, Seq> seqs;
  std::vector<uint8_t> payload;
  std::vector<SeqInput> batch;
  std::vector<int64_t> row_of;
  auto release = [&](const std::vector<uint64_t>& ids) {
    for (uint64_t id : ids) {
      auto it = seqs.find(id);
      SPADE_CHECK(it != seqs.end(), "tensor parallelism: rank 0 released sequence ", id,
                  ", unknown to rank ", comm.rank());
      model.release(it->second.pt);
      seqs.erase(it);
    }
  };
  for (;;) {
    MsgHeader h;
    comm.broadcast(&h, sizeof h, 0);
    SPADE_CHECK(h.magic == kMsgMagic && h.bytes >= 0, "tensor parallelism: bad message from rank 0");
    payload.resize(size_t(h.bytes));
    if (h.bytes) comm.broadcast(payload.data(), h.bytes, 0);
    if (h.kind == kShutdown) {
      Reader r(payload.data(), payload.size());
      release(r.get_vec<uint64_t>());
      for (auto& [id, q] : seqs) model.release(q.pt);
      return;
    }
    SPADE_CHECK(h.kind == kStep, "tensor parallelism: unknown message ", h.kind, " from rank 0");
    const StepPlan plan = StepPlan::decode(payload.data(), payload.size());
    release(plan.released);
    batch.clear();
    for (const StepPlan::Seq& s : plan.seqs) {
      auto it = seqs.find(s.id);
      if (it == seqs.end()) {
        SPADE_CHECK(s.cached == 0, "tensor parallelism: sequence ", s.id, " of ", s.cached,
                    " cached tokens is unknown to rank ", comm.rank());
        it = seqs.emplace(s.id, Seq{}).first;
        if (s.has_method && sessions) {
          it->second.session = sessions->make(s.method);
          sessions->trace(*it->second.session, s.id);
        } else if (s.has_method) {
          SPADE_CHECK(model.runs_methods(), "tensor parallelism: rank ", comm.rank(), " runs no "
                      "sparse methods (sequence ", s.id, " has method '", s.method.method, "')");
          it->second.state = model.new_request_state(&s.method);
        }
      }
      Seq& q = it->second;
      SPADE_CHECK(q.pt.length == s.cached, "tensor parallelism: rank ", comm.rank(),
                  " holds ", q.pt.length, " tokens of sequence ", s.id, ", rank 0 ", s.cached);
      for (const std::string& t : s.text) {
        if (q.session) q.session->append_token_text(t);
        if (q.state) q.state->append_token_text(t);
      }
      SeqInput in;
      in.pages = &q.pt;
      in.tokens = s.tokens.data();
      in.n_tokens = int64_t(s.tokens.size());
      in.all_logits = s.all_logits;
      in.dense = s.dense;
      if (q.session && !s.dense) in.attention = &q.session->attention();
      in.device_state = q.state.get();
      batch.push_back(in);
    }
    model.forward(batch, row_of);
    for (size_t i = 0; i < plan.seqs.size(); ++i)
      SPADE_CHECK(batch[i].pages->pages == plan.seqs[i].pages, "tensor parallelism: rank ",
                  comm.rank(), " diverged from rank 0 (the KV pages of sequence ",
                  plan.seqs[i].id, " differ)");
  }
}

void run_follower_rank(const ModelWeights& w, const std::string& address, int rank, int size) {
  SPADE_CHECK(rank >= 1 && rank < size, "--tp-rank must be in [1, ", size, "), got ", rank);
  check_shardable(w.config, size);
  TcpOptions o;
  // A follower waits for rank 0's next step as long as rank 0 is idle (a server with no
  // requests); rank 0 exiting closes its connection, which ends the wait at once.
  o.io_timeout = std::chrono::milliseconds(int64_t(1) << 29);
  TcpCommunicator comm(address, rank, size, o);
  TpInit init;
  comm.broadcast(&init, sizeof init, 0);
  SPADE_CHECK(init.magic == kInitMagic && init.tp == size, "tensor parallelism: rank 0 is not a "
              "spade rank of --tp ", size);
  RunnerOptions mine;
  agree_on_model(comm, same_shape(init, make_init(w.config, size, mine)));
  ModelWeights shard = shard_weights(w, rank, size);
  TpRankModel m;
  if (init.cuda) {
    m = make_cuda_rank(shard, w.config, comm, init, cuda_device_of_rank(rank));
    shard = ModelWeights{};  // uploaded
    comm.barrier();          // every rank built its model
    run_follower(*m.step, comm);
  } else {
    m = make_cpu_rank(shard, comm, init, false);
    RankSessions sessions(w.config, m, comm);
    run_follower(*m.step, comm, &sessions);
  }
}

}  // namespace spade::dist

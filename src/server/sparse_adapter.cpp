#include "server/sparse_adapter.h"

#include "sparse/registry.h"
#include "sparse/session.h"

namespace spade::server {

namespace {

// A SparseSession as the scheduler's SeqAttention; attended() in (layer, KV head, token)
// rows over the decode steps, the unit the scheduler counts dense rows in.
class SessionAttention : public SeqAttention {
 public:
  SessionAttention(std::shared_ptr<const sparse::SparseMethod> m, const ModelConfig& cfg,
                   KVPool& kv, bool recall)
      : session_(std::move(m), cfg, kv, sparse::SessionOptions{recall, false}),
        rows_per_token_(int64_t(cfg.n_layers) * cfg.n_kv_heads) {}
  const AttentionFn* fn() override { return &session_.attention(); }
  void on_tokens(const int32_t* ids, int64_t n, const TokenText& text) override {
    if (!session_.wants_token_text()) return;  // no per-token text work for other methods
    for (int64_t i = 0; i < n; ++i) session_.append_token_text(text.piece(ids[i]));
  }
  int64_t attended() const override {
    return int64_t(session_.totals().tokens_sum * double(rows_per_token_) + 0.5);
  }

 private:
  sparse::SparseSession session_;
  int64_t rows_per_token_;
};

}  // namespace

SparseMethods::SparseMethods(const ModelConfig& cfg, KVPool* kv, SparseSpec fallback,
                             std::string device, DeviceCheck device_check)
    : cfg_(cfg),
      kv_(kv),
      fallback_(std::move(fallback)),
      device_(std::move(device)),
      device_check_(std::move(device_check)) {
  SPADE_CHECK(kv_ || !device_.empty(), "SparseMethods: no KV pool for sparse sessions");
  resolve(std::nullopt);  // a bad default fails at start-up (and sets device_key_)
}

ResolvedSparse SparseMethods::resolve(const std::optional<SparseSpec>& given) {
  const SparseSpec& spec = given ? *given : fallback_;
  sparse::SparseConfig cfg;
  cfg.method = spec.method;
  for (const auto& [k, v] : spec.options) {
    if (k == "recall") {
      SPADE_CHECK(v == "true" || v == "false" || v == "1" || v == "0",
                  "sparse option 'recall' expects true or false, got '", v, "'");
      cfg.measure_recall = v == "true" || v == "1";
    } else {
      cfg.set(k, v);
    }
  }
  // Options that name files (blasst config=, lycheedecode roles=PATH) are for the operator's
  // flags only: a request must not make the server read files of its choosing.
  if (given) sparse::reject_local_only_options(cfg);
  ResolvedSparse r;
  r.method = spec.method;
  const std::string key = cfg.to_string() + (cfg.measure_recall ? " +recall" : "");
  std::shared_ptr<const sparse::SparseMethod> m;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      m = it->second;
    } else {
      m = sparse::make_method(cfg, cfg_);
      if (kv_) m->check_kv_layout(kv_->layout());  // e.g. Quest pages vs KV pages: a 400 now
      if (cache_.size() < 256) cache_[key] = m;
    }
  }
  r.description = m->describe();
  r.correction_every = m->correction_every();
  if (!device_.empty()) {
    // The GPU model runs the method itself: the server's own (no device_method), or one it
    // adds for this request.
    if (!given) device_key_ = key;
    if (cfg.measure_recall && device_check_) device_check_(cfg);  // the runner's reason (--tp)
    SPADE_CHECK(!cfg.measure_recall, "sparse option 'recall' is CPU-only (spade serve --device cpu)");
    if (key == device_key_) return r;
    if (device_check_) device_check_(cfg);
    r.device_method = std::make_shared<const sparse::SparseConfig>(cfg);
    return r;
  }
  if (spec.method == "full" && cfg.options.empty() && !cfg.measure_recall) return r;  // dense path
  const ModelConfig& mc = cfg_;
  KVPool& kv = *kv_;
  const bool recall = cfg.measure_recall;
  r.maker = [m, &mc, &kv, recall]() -> std::unique_ptr<SeqAttention> {
    return std::make_unique<SessionAttention>(m, mc, kv, recall);
  };
  return r;
}

}  // namespace spade::server

#include "server/sparse_adapter.h"

#include "sparse/registry.h"
#include "sparse/session.h"

namespace spade::server {

namespace {

// A SparseSession as the scheduler's SeqAttention; attended() in (layer, KV head, token)
// rows over the decode steps, the unit the scheduler counts dense rows in.
//
// CpuModel writes a step's K/V into the cache before attention but advances the page
// table's length only after the whole forward pass, while the sparse attention checks
// the selection against pt.length. The callback therefore hands the session a view of the
// table whose length covers the tokens just written (p0 + T); the view's page list reuses
// its capacity, so this costs a copy of a few page ids per layer and no allocation.
class SessionAttention : public SeqAttention {
 public:
  SessionAttention(std::shared_ptr<const sparse::SparseMethod> m, const ModelConfig& cfg,
                   KVPool& kv, bool recall)
      : session_(std::move(m), cfg, kv, sparse::SessionOptions{recall, false}),
        rows_per_token_(int64_t(cfg.n_layers) * cfg.n_kv_heads) {
    fn_ = [this](int layer, const PageTable& pt, const float* q, int64_t p0, int64_t T, float* out) {
      if (pt.length >= p0 + T) return session_.attend(layer, pt, q, p0, T, out);
      view_.pages.assign(pt.pages.begin(), pt.pages.end());
      view_.length = p0 + T;
      session_.attend(layer, view_, q, p0, T, out);
    };
  }
  const AttentionFn* fn() override { return &fn_; }
  int64_t attended() const override {
    return int64_t(session_.totals().tokens_sum * double(rows_per_token_) + 0.5);
  }

 private:
  sparse::SparseSession session_;
  int64_t rows_per_token_;
  PageTable view_;
  AttentionFn fn_;
};

}  // namespace

SparseMethods::SparseMethods(const ModelConfig& cfg, KVPool& kv, SparseSpec fallback)
    : cfg_(cfg), kv_(kv), fallback_(std::move(fallback)) {
  resolve(fallback_);  // a bad default fails at start-up
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
      if (cache_.size() < 256) cache_[key] = m;
    }
  }
  r.description = m->describe();
  if (spec.method == "full" && cfg.options.empty() && !cfg.measure_recall) return r;  // dense path
  const ModelConfig& mc = cfg_;
  KVPool& kv = kv_;
  const bool recall = cfg.measure_recall;
  r.maker = [m, &mc, &kv, recall]() -> std::unique_ptr<SeqAttention> {
    return std::make_unique<SessionAttention>(m, mc, kv, recall);
  };
  return r;
}

}  // namespace spade::server

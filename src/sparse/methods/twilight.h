// twilight (Lin et al., "Twilight: adaptive attention sparsity with hierarchical top-p
// pruning"): select-then-prune over any base selector.
//
//   1. Select: the base method (quest by default, any method or stack) picks a conservative
//      set; its budget defaults to max(8192, L/4) (paper section 5.1, option budget=auto).
//   2. Prune: for the selected tokens of each KV head, estimate q.k with an INT4 copy of the
//      keys (kv/int4_keys.h: asymmetric, per token and KV head, fp16 scale and zero point,
//      quantized once when the token is appended), softmax over the selection, and keep the
//      smallest set whose estimated mass reaches p, found by the binary search on the weight
//      threshold of Algorithm 1 (topp_binary_search below; no sort).
//   3. Attend: exact attention over the kept tokens with the fp32 K/V.
// GQA (head_combine): `union` (default): each of the G query heads of a KV head runs its own
// top-p search and the KV head reads the union, so every query head keeps estimated mass
// >= p; `mean`: one search over the group-mean of the G estimated distributions.
// The first `dense_layers` (2) layers are not pruned. A layer whose base asked for its
// attention scores (tidal's selection layers) is not pruned either.
//
// Stacking (docs/twilight_blasst.md): `base` names the selector, a method or a stack
// "a+b" read left to right as pipeline stages (select, prune, skip): base=quest,
// base=lycheecluster, base=full. Options not Twilight's own are forwarded to the base
// stage(s) that declare them; `budget` and `dense_layers` go to both.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kv/int4_keys.h"
#include "model/config.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

// ---- Algorithm 1: top-p via binary search on the weight threshold ----
struct TopPResult {
  float threshold = 0.f;  // kept set = { i : w[i] >= threshold }
  int iterations = 0;
};
// w[0..n): normalized weights. Finds l with sum_{w >= l} w >= p by bisection of [0, max w]
// (l feasible, r infeasible), stopping when r - l < eps or when the undecided weights
// (l <= w < r) span less than eps (Algorithm 1's termination test). The kept set contains
// the minimal top set reaching p; any extra element lies within eps of that set's smallest
// weight. Sums are accumulated in double.
TopPResult topp_binary_search(const float* w, int64_t n, double p, double eps,
                              int max_iterations = 64);
// Softmax of one query head's estimated logits in place, in the pruner's arithmetic (float max
// and exp, double sum, float reciprocal and product): the weights Algorithm 1 runs on (the GPU
// pruner's tests compare against exactly these).
void softmax_weights(float* w, int64_t n);

// ---- Composition of modifier stages over a base ----

// State of a stage that wraps a base: the base's own state lives inside.
struct ComposedState : MethodState {
  std::unique_ptr<MethodState> base;
  void append_token_text(std::string_view piece) override {
    if (base) base->append_token_text(piece);
  }
  bool wants_token_text() const override { return base && base->wants_token_text(); }
};

// A stage over a base method: by default every hook forwards to the base, which sees its
// own state in ctx.state.
class ComposedMethod : public SparseMethod {
 public:
  explicit ComposedMethod(std::shared_ptr<const SparseMethod> base);
  const SparseMethod& base() const { return *base_; }
  void check_kv_layout(const KVLayout& layout) const override { base_->check_kv_layout(layout); }
  void on_prefill(StepContext& ctx, int64_t p0, int64_t T) const override;
  void on_append(StepContext& ctx) const override;
  void select(StepContext& ctx, Selection& out) const override;
  void prune(StepContext& ctx, Selection& sel) const override;
  void on_scores(StepContext& ctx, const Selection& sel, const float* scores) const override;
  bool attend_decode(StepContext& ctx, const Selection& sel, float* out) const override;
  bool attend_prefill(StepContext& ctx, const float* q, int64_t p0, int64_t T,
                      float* out) const override;
  const Selection* read_selection(StepContext& ctx) const override;

 protected:
  // Switches ctx.state to the base's state for the guard's lifetime.
  struct BaseScope {
    BaseScope(StepContext& c);
    ~BaseScope() { ctx.state = saved; }
    StepContext& ctx;
    MethodState* saved;
  };
  std::shared_ptr<const SparseMethod> base_;
};

// Splits "quest+twilight" into {"quest", "twilight"}; throws on empty stages and on more
// than kMaxStackStages stages (a base, twilight and blasst are 3).
constexpr int kMaxStackStages = 8;
std::vector<std::string> split_stack(const std::string& spec);
// Builds a method or stack from its spec and options: "quest" (a registered method), or
// "a+b+c" = c over (b over a); every stage but the first must be a modifier (twilight,
// blasst). Options are routed to every stage that declares them.
std::shared_ptr<const SparseMethod> make_stack(const std::string& spec,
                                               const std::map<std::string, std::string>& options,
                                               const ModelConfig& cfg);
// The options a modifier accepts in the registry: its own, plus every other method's
// (forwarded to the base; kind String, validated by the base).
std::vector<OptionSpec> with_forwarded_options(const std::string& self,
                                               std::vector<OptionSpec> own);
// The given options of `o` (keys set by the user).
std::map<std::string, std::string> given_options(const MethodOptions& o);
// Splits `given` between a modifier with `own` options and its base stack `base_spec`:
// returns the base's options (keys the base declares; keys both declare go to both) and
// throws for keys neither declares.
std::map<std::string, std::string> route_to_base(const std::string& self,
                                                 const std::vector<OptionSpec>& own,
                                                 const std::string& base_spec,
                                                 const std::map<std::string, std::string>& given);

// ---- Twilight ----

// Kept budget per head and step (the paper's "average budget").
struct TwilightStats {
  int n_layers = 0, n_kv_heads = 0;
  // Latest decode step, [layer][kv_head]: tokens the base selected / Twilight kept.
  std::vector<int64_t> base_count, kept_count;
  std::vector<uint8_t> pruned;  // [layer] 1 when the latest step pruned the layer
  // Sums over decode steps of pruned layers, [layer][kv_head].
  std::vector<double> base_sum, kept_sum;
  std::vector<int64_t> steps;
  void init(int layers, int hkv);
  void clear();
  // Means over every pruned (layer, KV head, step).
  double mean_base() const;
  double mean_kept() const;
  double mean_kept(int layer, int head) const;
};

struct TwilightState : ComposedState {
  Int4KeyStore keys;
  TwilightStats stats;
  Selection kept;            // scratch: the pruned selection
  std::vector<float> w, qs;  // scratch: weights [G, n], query sums
  std::vector<uint8_t> mark;
};

class TwilightMethod final : public ComposedMethod {
 public:
  enum class Combine { Union, Mean };
  enum class Keys { Int4, Exact };
  struct Params {
    double p = 0.95;
    double eps = 1e-6;
    Combine combine = Combine::Union;
    Keys keys = Keys::Int4;
    int dense_layers = 2;
    // budget=auto: the base is rebuilt with budget max(auto_budget, ceil(L/4 / 1024) * 1024)
    // when L/4 exceeds auto_budget (only for bases that have a budget option).
    bool auto_budget = false;
    int64_t auto_budget_min = 8192;
  };
  // `base_spec` and `base_options` rebuild the base with a larger budget (budget=auto).
  TwilightMethod(std::shared_ptr<const SparseMethod> base, Params prm, std::string base_spec = "",
                 std::map<std::string, std::string> base_options = {},
                 const ModelConfig* cfg = nullptr);
  std::string name() const override { return "twilight"; }
  std::string describe() const override;
  std::unique_ptr<MethodState> new_state() const override;
  void on_prefill(StepContext& ctx, int64_t p0, int64_t T) const override;
  void on_append(StepContext& ctx) const override;
  void select(StepContext& ctx, Selection& out) const override;
  void prune(StepContext& ctx, Selection& sel) const override;
  const Params& params() const { return prm_; }

 private:
  const SparseMethod& base_for(int64_t L) const;
  Params prm_;
  std::string base_spec_;
  std::map<std::string, std::string> base_options_;
  ModelConfig cfg_;
  mutable std::mutex mu_;
  mutable std::map<int64_t, std::shared_ptr<const SparseMethod>> by_budget_;
};

// The state of type T of some stage of a stack (walking ComposedState::base), or nullptr;
// e.g. find_stage_state<LycheeClusterState>(state) under twilight.
template <class T>
T* find_stage_state(MethodState* s) {
  while (s) {
    if (auto* t = dynamic_cast<T*>(s)) return t;
    auto* c = dynamic_cast<ComposedState*>(s);
    s = c ? c->base.get() : nullptr;
  }
  return nullptr;
}

// The Twilight statistics inside a method state (a Twilight stage anywhere in the stack),
// or nullptr.
const TwilightStats* twilight_stats(const MethodState* state);
TwilightState* twilight_state(MethodState* state);

std::vector<OptionSpec> twilight_own_options();
std::vector<OptionSpec> twilight_options();
std::unique_ptr<SparseMethod> make_twilight(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse

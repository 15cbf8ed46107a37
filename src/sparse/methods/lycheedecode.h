// lycheedecode (LycheeDecode, paper section 3.1, Algorithm 1, appendix F; docs/lycheedecode.md).
//
// Each (layer, KV head) is a retrieval head or a sparse head (HeadRoles, head_roles.h; layer
// 0 is all retrieval). Per decode step and layer l:
//   retrieval head h  attends to every cached token; from the group-averaged query
//                     q_bar = mean of its G query heads it computes the weights
//                     w_j = softmax_j(q_bar . k_j / sqrt(D)) over all L tokens and selects
//                     the token set S_h of the same head index h in layer l+1;
//   sparse head h     attends only to the set S_h it inherited and passes it on unchanged.
// Token sets follow the original head index (HeadRoles::origin) so reordered weights compute
// the same thing. Selection modes (paper section 4.4.1), on units of `block` tokens
// (block = 1: tokens; 64: the paper's block-sparse kernel), unit weight = sum of its w_j:
//   topk       the ceil(budget / block) heaviest units
//   ratio      the ceil(ceil(ratio * L) / block) heaviest units (grows with L)
//   topp       the fewest heaviest units whose weight sum reaches p
//   threshold  every unit heavier than tau (at least the heaviest one)
// Ranking: weight descending, ties by lower position. A set that covers all L tokens is
// "all"; a layer whose heads all read everything is a Dense selection (bit-identical to
// full attention), e.g. budget >= L.
//
// Cache correction (paper section 4.2.2, TidalDecode): every N decoded tokens, recompute the
// K/V of those N tokens with a dense pass (sparse/cache_correction.h; the method only carries
// the option, SparseMethod::correction_every, and the decode loops run it).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/cpu_model.h"
#include "sparse/head_roles.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

enum class LdMode { TopK, TopP, Threshold, Ratio };

struct LdRule {
  LdMode mode = LdMode::TopK;
  int64_t budget = 4096;  // topk
  double p = 0.99;        // topp
  double tau = 1e-4;      // threshold
  double ratio = 0.3;     // ratio: kept fraction of L
  int block = 1;          // selection unit in tokens
  std::string describe() const;
  static LdMode parse_mode(const std::string& s);
};

// Per-request state: the token sets in flight within one decode step, indexed by original KV
// head index (column). Public so that tests can compare (and replace) them.
struct LdState : MethodState {
  std::vector<std::vector<int32_t>> set;  // [column] sorted positions
  std::vector<uint8_t> all;               // [column] the set is every token
  std::vector<int64_t> step, length;      // [column] decode step / L the set was made for
};

// The selection rule on weights w[0..L) (non-negative, summing to ~1): writes the selected
// positions in increasing order to out[0..n) (out grows as needed) and returns n >= 1.
int64_t ld_select(const float* w, int64_t L, const LdRule& rule, SelectScratch& scratch,
                  std::vector<int32_t>& out);

// w[0..L) = softmax over every cached token of the group-averaged query of KV head `head`
// (mean of its G query heads of ctx.q) times the keys of ctx.layer: a retrieval head's
// selection weights (not its attention output, which uses each query head itself).
// head_dim <= kLdMaxHeadDim (make_lycheedecode checks the model).
constexpr int kLdMaxHeadDim = 512;
void ld_group_weights(const StepContext& ctx, int head, float* w);

class LycheeDecodeMethod final : public SparseMethod {
 public:
  LycheeDecodeMethod(HeadRoles roles, LdRule rule, bool correction, int64_t correction_every);
  std::string name() const override { return "lycheedecode"; }
  std::string describe() const override;
  std::unique_ptr<MethodState> new_state() const override;
  void select(StepContext& ctx, Selection& out) const override;

  const HeadRoles& roles() const { return roles_; }
  const LdRule& rule() const { return rule_; }
  int64_t correction_every() const override { return correction_ ? every_ : 0; }

 private:
  HeadRoles roles_;
  LdRule rule_;
  bool correction_;
  int64_t every_;
};

std::vector<OptionSpec> lycheedecode_options();
std::unique_ptr<SparseMethod> make_lycheedecode(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse

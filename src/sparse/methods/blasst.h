// blasst (Yuan et al., "BLASST: dynamic blocked attention sparsity via softmax
// thresholding"): a modifier that skips, inside attention, the key tiles whose scores are far
// below the running row maximum (backend/cpu/attention_blasst.h). It composes with every
// selector: `base` picks the tokens (full by default: `--sparse blasst` = full + skipping),
// and the skipping happens inside the selected tokens (tiles of the selected rows).
//
//   lambda   fixed threshold for both phases (lambda option), or lambda = a / L with one `a`
//            per phase (a: decode, prefill_a: prefill), given directly or read from the
//            calibration files of `spade calibrate blasst` (config=FILE[,FILE]: each file sets
//            the `a` of the phase it was calibrated for). Defaults: SmolLM2-135M's 50%
//            calibrations (configs/blasst_smollm2_*_s50.json). In decode L is the number of
//            keys the head attends (length=selected, the default: the selection's size, the
//            context for full) or the context length (length=context); in prefill
//            L = p0 + T, the context at the end of the chunk.
//   tiles    decode: `tile` (64) selected keys per tile, decided per KV head for the whole
//            GQA group; prefill: `prefill_tile` (128) keys x `q_block` (128) query rows of
//            one query head.
//   order    sequential | reverse | sink_recent (the paper's reordering ablation).
//   skip ratio per layer and head: BlasstStats (skipped tiles / tiles), prefill per query
//            head, decode per KV head.
//
// Attention hooks: SparseMethod::attend_decode / attend_prefill (sparse/method.h), which the
// sessions call with the final selection / the prefill chunk. A session that attends
// without calling them makes BLASST throw: it never silently falls back to dense attention.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/attention_blasst.h"
#include "sparse/methods/twilight.h"

namespace spade::sparse {

struct BlasstStats {
  int n_layers = 0, n_heads = 0, n_kv_heads = 0;
  std::vector<cpu::TileCounts> prefill;  // [layer][q_head], summed over prefill chunks
  std::vector<cpu::TileCounts> decode;   // [layer][kv_head], summed over decode steps
  std::vector<cpu::TileCounts> step;     // [layer][kv_head], the latest decode step
  void init(int layers, int hq, int hkv);
  void clear();
  // skipped / tiles over everything of a phase (0 when no tile).
  static double ratio(const std::vector<cpu::TileCounts>& v);
  static double layer_ratio(const std::vector<cpu::TileCounts>& v, int layer, int heads);
  double prefill_sparsity() const { return ratio(prefill); }
  double decode_sparsity() const { return ratio(decode); }
};

struct BlasstState : ComposedState {
  BlasstStats stats;
  cpu::BlasstScratch scratch;
  std::vector<float> log_lambda;  // [kv_head] of the current decode layer
  int pending_layer = -1;         // decode layer whose selection awaits attend_decode()
  int prefill_layer = -1;         // layer of the latest attend_prefill()
  // The latest attend_decode: its tiles' skip flags (per KV head in tile order) and the rows of
  // the kept tiles (read_selection()).
  std::vector<uint8_t> skipped;
  Selection kept;
  bool kept_valid = false;
  const cpu::BlasstTrace* trace = nullptr;  // optional per-tile trace (calibration, tests)
};

class BlasstMethod final : public ComposedMethod {
 public:
  struct Params {
    double lambda = -1;     // fixed lambda (both phases) when >= 0
    double a = -1;          // decode: lambda = a / L when lambda < 0
    double prefill_a = -1;  // prefill: lambda = prefill_a / L (< 0: use a)
    bool length_selected = true;
    int64_t tile = 64, prefill_tile = 128, q_block = 128;
    cpu::TileOrder order = cpu::TileOrder::Sequential;
    bool prefill = false, decode = true;  // prefill skipping is opt-in (option prefill=1)
  };
  BlasstMethod(std::shared_ptr<const SparseMethod> base, Params prm);
  std::string name() const override { return "blasst"; }
  std::string describe() const override;
  std::unique_ptr<MethodState> new_state() const override;
  void on_prefill(StepContext& ctx, int64_t p0, int64_t T) const override;
  void select(StepContext& ctx, Selection& out) const override;
  void prune(StepContext& ctx, Selection& sel) const override;

  // The attention hooks; false (the session's exact attention) when the phase is off.
  bool attend_decode(StepContext& ctx, const Selection& sel, float* out) const override;
  bool attend_prefill(StepContext& ctx, const float* q, int64_t p0, int64_t T,
                      float* out) const override;
  // The rows of the tiles the last attend_decode kept (density and recall count those).
  const Selection* read_selection(StepContext& ctx) const override;

  // ln(lambda) for attention over `length` keys in decode / prefill (-inf for lambda = 0).
  float log_lambda(int64_t length, bool prefill = false) const;
  const Params& params() const { return prm_; }

 private:
  Params prm_;
};

// The BLASST stage of a method (the outermost stage), or nullptr.
const BlasstMethod* as_blasst(const SparseMethod& m);
BlasstState* blasst_state(MethodState* state);

// Reads `a` (and the phase it was calibrated for: "prefill" or "decode") from a calibration
// file written by `spade calibrate blasst`.
double read_blasst_config_a(const std::string& path, std::string* phase = nullptr);
// Defaults when neither lambda, a nor config is given: SmolLM2-135M-Instruct calibrated for
// 50% sparsity on KJV text, lengths 1024-4096 (configs/blasst_smollm2_decode_s50.json,
// configs/blasst_smollm2_prefill_s50.json).
constexpr double kBlasstDefaultA = 26.96;
constexpr double kBlasstDefaultPrefillA = 1153.85;

std::vector<OptionSpec> blasst_own_options();
std::vector<OptionSpec> blasst_options();
std::unique_ptr<SparseMethod> make_blasst(const MethodOptions& o, const ModelConfig& cfg);

}  // namespace spade::sparse

#include "sparse/model_defaults.h"

#include <cmath>

#include "core/error.h"

namespace spade::sparse {

namespace {

struct Row {
  Arch arch;
  int n_layers;
  int hidden;      // 0: any
  int n_kv_heads;  // 0: any
  int reselect;
  const char* source;
};

// Selection layer 2 (after the two dense layers) plus one re-selection layer per model.
// Re-selection layers: TidalDecode (Yang et al. 2024) and LessIsMore Table 11.
const Row kTable[] = {
    // LongChat-7B-v1.5-32k (Llama-2 MHA): layer 7 (LessIsMore Table 11).
    {Arch::Llama, 32, 4096, 32, 7, "LongChat-7B-v1.5 (MHA): TidalDecode / LessIsMore Table 11"},
    // Llama-3-8B, Llama-3.1-8B: 13. (DeepSeek-R1-Distill-Llama-8B, same shape, used 12.)
    {Arch::Llama, 32, 4096, 8, 13, "Llama-3(.1)-8B: TidalDecode / LessIsMore Table 11"},
    {Arch::Qwen3, 36, 4096, 0, 12, "Qwen3-8B: LessIsMore Table 11"},
    {Arch::Qwen3, 36, 2560, 0, 20, "Qwen3-4B: LessIsMore Table 11"},
    {Arch::Qwen3, 40, 5120, 0, 12, "Qwen3-14B: LessIsMore Table 11"},
    // SmolLM2-135M (30 layers): chosen as TidalDecode chose its layers, by a needle test
    // (docs/sparse.md: 2K-token KJV haystack, budget 128, re-selection layers 4..24): 14 was
    // the only layer where LessIsMore answered exactly and TidalDecode got 4 of 5 digits.
    // (Llama-3-8B's proportion, 13/32 of the depth, would give 12.)
    {Arch::Llama, 30, 576, 3, 14, "SmolLM2-135M: needle sweep of the re-selection layer (docs/sparse.md)"},
};

}  // namespace

LayerDefaults layer_defaults(const ModelConfig& cfg) {
  LayerDefaults d;
  d.dense_layers = 2;
  for (const Row& r : kTable) {
    if (r.arch == cfg.arch && r.n_layers == cfg.n_layers && (!r.hidden || r.hidden == cfg.hidden) &&
        (!r.n_kv_heads || r.n_kv_heads == cfg.n_kv_heads)) {
      d.selection_layers = {2, r.reselect};
      d.source = r.source;
      return d;
    }
  }
  // Not in the table: Llama-3-8B's proportion (13 of 32 layers).
  int re = int(std::lround(13.0 * cfg.n_layers / 32.0));
  if (cfg.n_layers <= 2) {
    d.dense_layers = 0;
    d.selection_layers = {0};
  } else if (re <= 2 || re >= cfg.n_layers) {
    d.selection_layers = {2};
  } else {
    d.selection_layers = {2, re};
  }
  d.source = cat("not in the table: re-selection at 13/32 of ", cfg.n_layers, " layers");
  return d;
}

}  // namespace spade::sparse

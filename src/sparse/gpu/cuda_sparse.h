// The GPU form of a sparse method: its parameters as the GPU kernels take them (CudaSparse),
// parsed from a sparse::SparseConfig through the CPU method's option table and checks
// (cuda_sparse_config). A GpuMethod subclass (method.h; its row in registry.h) runs one.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "sparse/layer_schedule.h"
#include "sparse/methods/lycheecluster.h"
#include "sparse/options.h"
#include "sparse/registry.h"

namespace spade {

// Sparse decode on the GPU (issue 9): the methods with a GPU selector, with the CPU method's
// parameters. Prefill stays dense; decode steps (every sequence q_len == 1) attend over the
// selection in layers >= dense_layers. Quest: per-page key min/max kept on every append for
// every layer, page scores + radix top-k + attention over the selected pages (the CPU's
// QuestMethod with group=max and page_size == KV page size == 16). Streaming: sinks + the
// recent window, one list shared by the KV heads (StreamingMethod). BLASST (over full
// attention): tile skipping inside the dense kernels (backend/cuda/attention.h BlasstSkip)
// with the CPU method's lambda (fixed, or a / L per sequence); decode tiles are each warp's
// 16-token chunks, prefill tiles 64 packed rows x 128 keys (wgmma prefill, head_dim 128) or
// 32 packed rows x 64 keys (the generic prefill kernel, head_dim 64; describe() says which).
// BLASST decode default a on the GPU (lambda = a / L): SmolLM2-135M-Instruct calibrated for
// 50% sparsity with the GPU kernels (configs/blasst_smollm2_gpu_decode_s50.json).
constexpr double kBlasstDefaultGpuDecodeA = 4.128;

struct CudaSparse {
  enum class Method {
    None, Streaming, Quest, Tidal, LessIsMore, LycheeDecode, OracleTopK, Blasst, Twilight,
    LycheeCluster, OracleTopP
  };
  Method method = Method::None;
  int64_t budget = 0;
  int sinks = 0;         // streaming, lessismore
  int64_t recent = 0;    // lessismore: the recency window (round(budget * recent_ratio))
  int dense_layers = 0;  // leading full-attention layers
  int quest_fast = 0;    // 1: tensor-core page scores (fp32 rounding; near-tie selections)
  bool force_lists = false;  // tests: attend over lists even when they cover the whole context
  // blasst: lambda >= 0 fixed (0 = never skip), else a / L (decode a, prefill prefill_a)
  double blasst_lambda = -1, blasst_a = 0, blasst_prefill_a = 0;
  bool blasst_decode = true, blasst_prefill = true;
  // BLASST over a selection (`--sparse quest+blasst`, blasst:base=M): `method` is the base's,
  // and its attention launches also skip: over the lists (SparseAttention's SelSkip, lambda =
  // a / the selection's tokens when blasst_len_selected, else a / the context) and in its dense
  // launches (dense layers, the dense fallback, prefill when blasst_prefill). Launches that
  // emit scores (Tidal / LessIsMore selection layers, LycheeDecode retrieval heads) do not skip.
  bool blasst_sel = false, blasst_len_selected = true;
  bool blasst_any() const { return method == Method::Blasst || blasst_sel; }
  int head_dim = 0;  // set by cuda_sparse_config (describe: prefill skipping needs 128)
  // tidal, lessismore: layer roles (dense / select / reuse); dense_layers mirrors schedule's
  sparse::LayerSchedule schedule;
  bool scheduled() const { return method == Method::Tidal || method == Method::LessIsMore; }
  // lessismore: merged tokens besides the sinks and the recency window.
  int64_t lim_unified() const { return budget - recent - sinks; }
  // lycheedecode: retrieval[layer][h] = 1 for retrieval heads (the rest are sparse heads),
  // roles in identity order. Its selection rule (sparse::LdRule): ld_mode 0 topk (budget =
  // tokens per sparse head; 0 in the other modes), 1 ratio, 2 topp, 3 threshold, on units
  // of ld_block tokens. topk on tokens ranks by score (the token top-k); every other rule
  // runs the rule kernels (backend/cuda/rule_select.h) on the retrieval heads' weights.
  std::vector<std::vector<uint8_t>> retrieval;
  std::string roles_source;
  int ld_mode = 0, ld_block = 1;
  double ld_p = 0.99, ld_tau = 1e-4, ld_ratio = 0.3;
  bool ld_rule() const { return ld_mode != 0 || ld_block != 1; }
  // oracle-topp: each query head's smallest true top set reaching oracle_p, the KV head
  // reading their union (oracle_union), or the smallest top set of the group weights W
  // reaching oracle_p * G (group=mean).
  double oracle_p = 0.95;
  bool oracle_union = true;
  std::string describe() const;
  // Attends over selection lists (streaming, quest); BLASST skips inside the dense kernels.
  bool selects() const {
    return method == Method::Streaming || quest_base() || scheduled() ||
           method == Method::LycheeDecode || method == Method::OracleTopK ||
           method == Method::LycheeCluster || method == Method::OracleTopP;
  }
  // lycheecluster: the CPU method's parameters (budget, budget_mode, sink, buffer,
  // dense_layers, chunking, index and search options; the GPU supports the defaults' bound
  // space, pooling, seeding, center dtype, grouping and ranking). budget and dense_layers
  // above mirror lc.budget and lc.dense_layers.
  sparse::LycheeClusterParams lc;
  // twilight: top-p mass and bisection resolution. Over quest (`quest+twilight`,
  // twilight:base=quest) the method is Twilight (budget = the Quest budget, dense_layers shared).
  // Over another GPU selector X (`X+twilight`, twilight:base=X; X = full, tidal, lessismore,
  // lycheecluster) `method` is X's with twilight_sel set: X selects as it does alone and every
  // layer >= twilight_dense_layers that X does not run dense with scores (Tidal / LessIsMore
  // selection layers) prunes X's lists (sparse/gpu/twilight_stage.h), or the whole context in
  // X's dense layers (the CPU prunes the base's dense selection too). Full: dense_layers =
  // n_layers (every layer is the base's dense one).
  double twilight_p = 0.95, twilight_eps = 1e-6;
  bool twilight_sel = false;
  int twilight_dense_layers = 0;  // twilight_sel: leading layers Twilight does not prune
  bool twilight_any() const { return method == Method::Twilight || twilight_sel; }
  // Leading layers Twilight does not prune (over quest: the shared dense_layers).
  int twilight_dense() const {
    return method == Method::Twilight ? dense_layers : twilight_dense_layers;
  }
  // Quest selects (quest itself, or twilight's base).
  bool quest_base() const { return method == Method::Quest || method == Method::Twilight; }
  // Per-page data the model keeps on every KV append for this method (method.h
  // GpuPageHooks): Quest's key min/max per page, Twilight's INT4 copy of the keys.
  bool needs_quest_meta() const { return quest_base(); }
  bool needs_int4_keys() const { return twilight_any(); }
};
// The GPU form of a sparse::SparseConfig, through the same option table and checks as the
// CPU method (sparse/registry.h). "full" -> Method::None; methods without a GPU path and
// unsupported options (quest group=sum, page_size != 16) throw spade::Error. Extra option
// "gpu_scores=exact|fast" is read by the GPU only (fast: tensor-core Quest scores).
CudaSparse cuda_sparse_config(const sparse::SparseConfig& cfg, const ModelConfig& model,
                              int kv_page_size);
// describe(): the skip decision blocks of the prefill kernel that runs at this head dim.
std::string cuda_prefill_tiles_text(int head_dim);

}  // namespace spade

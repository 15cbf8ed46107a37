// The GPU form of a sparse method (cuda_sparse.h CudaSparse): the CPU method's option table and
// checks, then the parameters the GPU kernels take; and its one-line description.
#if defined(SPADE_HAVE_CUDA)
#include "core/error.h"
#include "model/cuda_methods.h"
#include "sparse/gpu/cuda_sparse.h"
#include "sparse/gpu/registry.h"
#include "sparse/gpu/twilight_stage.h"
#include "backend/cuda/sparse_attention.h"
#include "sparse/methods/blasst.h"
#include "sparse/methods/lessismore.h"
#include "sparse/methods/lycheecluster.h"
#include "sparse/methods/lycheedecode.h"
#include "sparse/methods/twilight.h"
#include "sparse/registry.h"

namespace spade {

namespace {
std::string blasst_lambda_text(const CudaSparse& s, bool prefill) {
  if (s.blasst_lambda >= 0) return cat("lambda=", s.blasst_lambda);
  return cat("lambda=", prefill ? s.blasst_prefill_a : s.blasst_a, "/L");
}
}  // namespace

std::string cuda_prefill_tiles_text(int head_dim) {
  return head_dim == 128 ? " (tiles: 64 rows x 128 keys; 32 x 32 where the wgmma kernel is unavailable)"
                         : " (tiles: 32 rows x 64 keys)";
}

std::string CudaSparse::describe() const {
  if (blasst_sel) {
    CudaSparse base = *this;
    base.blasst_sel = false;
    return cat("blasst over [", base.describe(), "]: decode ",
               blasst_decode ? cat(blasst_lambda_text(*this, false), " (L: ",
                                   blasst_len_selected ? "the selection's tokens" : "the context",
                                   "; tiles: 16-entry warp chunks of the lists, V rows of skipped "
                                   "chunks not read; launches that emit scores do not skip)")
                             : std::string("off"),
               ", prefill ", !blasst_prefill ? std::string("dense (prefill=1 turns skipping on)")
                             : blasst_lambda_text(*this, true) + cuda_prefill_tiles_text(head_dim));
  }
  if (twilight_sel) {
    CudaSparse base = *this;
    base.twilight_sel = false;
    if (base.method == Method::None) base.dense_layers = 0;
    return twilight_stage_describe(*this, base.describe());
  }
  // The method's own line (its class in src/sparse/gpu/, through the GPU registry).
  return find_gpu_method(*this).kind->describe(*this);
}

CudaSparse cuda_sparse_config(const sparse::SparseConfig& cfg_in, const ModelConfig& model,
                              int kv_page_size) {
  CudaSparse r;
  sparse::SparseConfig cfg = cfg_in;
  // GPU-only option, removed before the CPU's option table checks the rest.
  std::string scores = "exact";
  const bool gave_scores = cfg.options.count("gpu_scores") > 0;
  if (auto it = cfg.options.find("gpu_scores"); it != cfg.options.end()) {
    scores = it->second;
    cfg.options.erase(it);
  }
  SPADE_CHECK(scores == "exact" || scores == "fast", "gpu_scores must be exact or fast, got '",
              scores, "'");
  // A stack "a+b[+c]" is its last stage over base "a[+b]" (as sparse::make_stack builds it).
  if (cfg.method.find('+') != std::string::npos) {
    const std::vector<std::string> st = sparse::split_stack(cfg.method);
    SPADE_CHECK(!cfg.options.count("base"), "sparse stack '", cfg.method, "' and option base= both "
                "name a base");
    std::string base;
    for (size_t i = 0; i + 1 < st.size(); ++i) base += (i ? "+" : "") + st[i];
    cfg.method = st.back();
    cfg.options["base"] = base;
  }
  const sparse::MethodInfo& info = sparse::find_method(cfg.method);
  if (info.name == "full") return r;
  SPADE_CHECK(has_cuda_path(info.name), "--device cuda: sparse method '", cfg.method,
              "' has no GPU path (GPU methods: ", cuda_method_list(),
              "; the others run with --device cpu)");
  auto method = sparse::make_method(cfg, model);  // the CPU method's own checks
  sparse::MethodOptions o(info.name, info.options(), cfg.options, model);
  r.head_dim = model.head_dim;
  if (info.name == "blasst") {
    const sparse::BlasstMethod* bm = sparse::as_blasst(*method);
    SPADE_CHECK(bm, "--device cuda: blasst: not a BLASST method");
    for (const char* k : {"tile", "prefill_tile", "q_block"})
      SPADE_CHECK(!cfg.options.count(k), "--device cuda: blasst option '", k, "' is fixed by the "
                  "GPU kernels (decode tiles: 16-token warp chunks; prefill: 64 rows x 128 keys)");
    SPADE_CHECK(bm->params().order == cpu::TileOrder::Sequential,
                "--device cuda: blasst visits tiles in sequential order only");
    const std::string base = o.str("base");
    if (base != "full") {
      // BLASST inside a GPU selection: the base's GPU form, whose attention launches skip.
      sparse::SparseConfig bc;
      bc.method = base;
      bc.options = sparse::route_to_base("blasst", sparse::blasst_own_options(), base,
                                         sparse::given_options(o));
      if (gave_scores) bc.options["gpu_scores"] = scores;
      CudaSparse b = cuda_sparse_config(bc, model, kv_page_size);
      SPADE_CHECK(b.method != CudaSparse::Method::None && !b.blasst_any(), "--device cuda: blasst "
                  "base '", base, "' must be a GPU selector");
      b.blasst_sel = true;
      b.blasst_lambda = bm->params().lambda;
      b.blasst_a = bm->params().a;
      b.blasst_prefill_a = bm->params().prefill_a >= 0 ? bm->params().prefill_a : bm->params().a;
      b.blasst_decode = bm->params().decode;
      b.blasst_prefill = bm->params().prefill;  // prefill=1 (off by default, as on the CPU)
      b.blasst_len_selected = bm->params().length_selected;
      b.head_dim = model.head_dim;
      return b;
    }
    r.method = CudaSparse::Method::Blasst;
    r.blasst_lambda = bm->params().lambda;
    r.blasst_a = bm->params().a;
    // Decode default (no lambda, a or config given): the GPU kernels' own 50% calibration of
    // SmolLM2-135M (configs/blasst_smollm2_gpu_decode_s50.json): their 16-token seeded tiles
    // skip more than the CPU's 64-token tiles at the same a.
    if (!cfg.options.count("lambda") && !cfg.options.count("a") && !cfg.options.count("config"))
      r.blasst_a = kBlasstDefaultGpuDecodeA;
    r.blasst_prefill_a = bm->params().prefill_a >= 0 ? bm->params().prefill_a : bm->params().a;
    r.blasst_decode = bm->params().decode;
    // Prefill skipping only when asked for (prefill=1, the method's default 0 on CPU and GPU):
    // on real SmolLM2 prefills of 3.5K / 7.5K tokens skipping up to 79% of the tiles gave no
    // prefill speed-up beyond run-to-run noise
    // (bench/results/blasst_prefill_real_smollm2_h100_20261122.json), while at zero sparsity
    // the skip kernel costs +9% over the default dense prefill (docs/results.md "BLASST
    // prefill"); its gain needs long contexts and high sparsity (1.57x at 64K, 79%).
    r.blasst_prefill = bm->params().prefill;
    return r;
  }
  if (info.name == "lycheedecode") {
    const auto& ld = static_cast<const sparse::LycheeDecodeMethod&>(*method);
    const sparse::LdRule& rule = ld.rule();
    // Every mode (topk, ratio, topp, threshold) and block size of the CPU method: topk on
    // tokens ranks by score, the others run the rule kernels (backend/cuda/rule_select.h).
    // Cache correction (correction=1) needs nothing of the method: the decode loop re-feeds
    // the tokens as a dense chunk (sparse/cache_correction.h).
    const sparse::HeadRoles& roles = ld.roles();
    SPADE_CHECK(roles.identity_order(), "--device cuda: lycheedecode needs head roles in "
                "identity order (reordered weights are a CPU-only layout)");
    SPADE_CHECK(roles.n_kv_heads <= 32, "--device cuda: lycheedecode supports up to 32 KV heads");
    r.method = CudaSparse::Method::LycheeDecode;
    r.ld_mode = rule.mode == sparse::LdMode::TopK    ? 0
                : rule.mode == sparse::LdMode::Ratio ? 1
                : rule.mode == sparse::LdMode::TopP  ? 2
                                                     : 3;
    r.ld_block = rule.block;
    r.ld_p = rule.p;
    r.ld_tau = rule.tau;
    r.ld_ratio = rule.ratio;
    SPADE_CHECK(rule.block >= 1 && rule.block <= (1 << 16), "lycheedecode block out of range");
    r.budget = r.ld_mode == 0 ? rule.budget : 0;
    r.roles_source = roles.source;
    r.retrieval.assign(size_t(roles.n_layers), std::vector<uint8_t>(size_t(roles.n_kv_heads), 0));
    for (int l = 0; l < roles.n_layers; ++l)
      for (int h = 0; h < roles.n_kv_heads; ++h)
        r.retrieval[size_t(l)][size_t(h)] = roles.is_retrieval(l, h) ? 1 : 0;
    SPADE_CHECK(r.ld_mode != 0 || (r.budget > 0 && r.budget <= (int64_t(1) << 30)),
                "sparse budget out of range");
    return r;
  }
  if (info.name == "oracle-topp") {
    // The true per-head weights (full attention), then each query head's smallest top set
    // reaching p (the KV head reads their union) or the group weights' (group=mean).
    r.method = CudaSparse::Method::OracleTopP;
    r.oracle_p = o.number("p");
    r.oracle_union = o.str("group") == "union";
    r.dense_layers = int(o.integer("dense_layers"));
    return r;
  }
  if (info.name == "lycheecluster") {
    const auto& p = static_cast<const sparse::LycheeClusterMethod&>(*method).params();
    using sparse::BoundSpace, sparse::Pooling, sparse::GroupAgg, sparse::RankBy;
    SPADE_CHECK(p.index.space == BoundSpace::Token && p.index.pooling == Pooling::Mean &&
                    p.index.kmeans.seeding == sparse::KMeansSeeding::Stride && p.index.f16_centers &&
                    p.index.coarse_units == 0 && p.search.group == GroupAgg::Max &&
                    p.search.rank == RankBy::Bound && !p.stability,
                "--device cuda: lycheecluster runs with bound=token pooling=mean seeding=stride "
                "center_dtype=f16 coarse_units=0 group=max rank=bound stability=0 (the defaults); "
                "the other settings are CPU-only");
    SPADE_CHECK(p.index.max_coarse <= 64, "--device cuda: lycheecluster max_coarse <= 64");
    SPADE_CHECK(model.head_dim % 32 == 0, "--device cuda: lycheecluster needs head_dim % 32 == 0");
    SPADE_CHECK(p.budget <= (int64_t(1) << 30), "sparse budget out of range");
    r.method = CudaSparse::Method::LycheeCluster;
    r.lc = p;
    r.budget = p.budget;
    r.dense_layers = p.dense_layers;
    return r;
  }
  if (info.name == "twilight") {
    // GPU: the union of the heads' top-p sets on INT4 keys, over a GPU selector with an
    // explicit budget (full needs none).
    const std::string tb = o.str("base");
    SPADE_CHECK(tb == "quest" || tb == "full" || tb == "tidal" || tb == "lessismore" ||
                    tb == "lycheecluster",
                "--device cuda: twilight runs over base=quest, full, tidal, lessismore or "
                "lycheecluster (got base=", tb, ")");
    SPADE_CHECK(tb == "full" || !o.is_auto("budget"), "--device cuda: twilight needs an explicit "
                "budget (the base's; budget=auto grows it with the context)");
    SPADE_CHECK(o.str("head_combine") == "union" && o.str("keys") == "int4",
                "--device cuda: twilight supports head_combine=union keys=int4 only");
    if (tb != "quest") {
      // Twilight over another selector: the base's GPU form, which prunes its lists.
      sparse::SparseConfig bc;
      bc.method = tb;
      bc.options = sparse::route_to_base("twilight", sparse::twilight_own_options(), tb,
                                         sparse::given_options(o));
      CudaSparse b = cuda_sparse_config(bc, model, kv_page_size);
      SPADE_CHECK(!b.blasst_any() && !b.twilight_any(), "--device cuda: twilight base '", tb,
                  "' must be a GPU selector");
      b.twilight_sel = true;
      b.twilight_p = o.number("p");
      b.twilight_eps = o.number("eps");
      b.twilight_dense_layers = int(o.integer("dense_layers"));
      if (b.method == CudaSparse::Method::None) b.dense_layers = model.n_layers;  // full
      SPADE_CHECK(b.twilight_dense_layers >= b.dense_layers || kv_page_size % 16 == 0,
                  "--device cuda: twilight over ", tb, " prunes whole contexts in 16-token "
                  "chunks and needs a KV page size divisible by 16 (got ", kv_page_size, ")");
      b.head_dim = model.head_dim;
      return b;
    }
    for (const auto& [k, v] : cfg.options)
      SPADE_CHECK((k != "group" || v == "max") && (k != "page_size" || v == "16"),
                  "--device cuda: twilight's quest base supports group=max page_size=16 only");
    SPADE_CHECK(kv_page_size == 16, "--device cuda: twilight's quest base needs a KV page size "
                "of 16 (got ", kv_page_size, ")");
    r.method = CudaSparse::Method::Twilight;
    r.budget = o.integer("budget");
    r.dense_layers = int(o.integer("dense_layers"));
    r.twilight_p = o.number("p");
    r.twilight_eps = o.number("eps");
    r.twilight_dense_layers = r.dense_layers;
    r.quest_fast = scores == "fast" ? 1 : 0;
    SPADE_CHECK(r.budget >= 16 && r.budget <= (int64_t(1) << 30), "sparse budget out of range");
    return r;
  }
  r.budget = o.integer("budget");
  const bool scheduled = info.name == "tidal" || info.name == "lessismore";
  if (!scheduled) r.dense_layers = int(o.integer("dense_layers"));  // scheduled: "auto"
  if (scheduled) {
    r.method = info.name == "tidal" ? CudaSparse::Method::Tidal : CudaSparse::Method::LessIsMore;
    r.schedule = sparse::LayerSchedule::from_options(o, model);
    r.dense_layers = r.schedule.dense_layers;  // (make_method checked the schedule)
    if (r.method == CudaSparse::Method::LessIsMore) {
      r.sinks = int(o.integer("sinks"));
      r.recent = static_cast<const sparse::LessIsMoreMethod&>(*method).n_recent();
      const int64_t n_uni = r.budget - r.recent - r.sinks;
      SPADE_CHECK(n_uni >= 1 && n_uni <= cuda::kLessIsMoreMaxUnified, "--device cuda: lessismore "
                  "merges ", n_uni, " tokens per request (budget - recent - sinks); the GPU "
                  "merge supports 1 to ", cuda::kLessIsMoreMaxUnified);
    }
  } else if (info.name == "oracle-topk") {
    r.method = CudaSparse::Method::OracleTopK;
  } else if (info.name == "streaming") {
    r.method = CudaSparse::Method::Streaming;
    r.sinks = int(o.integer("sinks"));
  } else {
    r.method = CudaSparse::Method::Quest;
    SPADE_CHECK(o.str("group") == "max", "--device cuda: quest supports group=max only");
    SPADE_CHECK(o.integer("page_size") == 16 && kv_page_size == 16,
                "--device cuda: quest needs page_size 16 and a KV page size of 16 (got ",
                o.integer("page_size"), " and ", kv_page_size, ")");
    r.quest_fast = scores == "fast" ? 1 : 0;
  }
  SPADE_CHECK(r.budget > 0 && r.budget <= (int64_t(1) << 30), "sparse budget out of range");
  return r;
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA

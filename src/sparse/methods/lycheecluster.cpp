#include "sparse/methods/lycheecluster.h"

#include <algorithm>
#include <chrono>
#include <ctime>

#include "core/error.h"
#include "core/thread_pool.h"
#include "sparse/methods/common.h"

namespace spade::sparse {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double cpu_clock(clockid_t id) {
  timespec ts;
  clock_gettime(id, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
}  // namespace

// ---- state ----

void LycheeClusterState::ensure(int n_layers, int hkv) {
  if (!idx_.empty()) return;
  hkv_ = hkv;
  idx_.resize(size_t(n_layers) * size_t(hkv));
  layer_chunks_.assign(size_t(n_layers), 0);
  stab_.resize(size_t(n_layers) * size_t(hkv));
}

const ClusterIndex* LycheeClusterState::index(int layer, int head) const {
  const size_t i = size_t(layer) * size_t(hkv_) + size_t(head);
  if (i >= idx_.size() || !idx_[i].built()) return nullptr;
  return &idx_[i];
}

size_t LycheeClusterState::index_bytes() const {
  size_t b = chunks_.starts().size() * sizeof(int32_t);
  for (const auto& x : idx_) b += x.bytes();
  return b;
}

void LycheeClusterState::extend_chunks(int64_t L, int sink, const ChunkerOptions& opt) {
  const auto t0 = Clock::now();
  chunks_.extend(text_, L, sink, opt);
  stats_.chunk_seconds += since(t0);
}

LycheeClusterState* lycheecluster_state(MethodState* s) {
  return dynamic_cast<LycheeClusterState*>(s);
}

// ---- method ----

LycheeClusterMethod::LycheeClusterMethod(const LycheeClusterParams& p) : p_(p) {
  SPADE_CHECK(p.budget > 0, "lycheecluster: budget must be positive");
  SPADE_CHECK(p.sink >= 0 && p.buffer >= 1 && p.dense_layers >= 0,
              "lycheecluster: sink >= 0, buffer >= 1, dense_layers >= 0");
  validate(p.chunker);
  SPADE_CHECK(p.index.chunks_per_fine > 0, "lycheecluster: chunks_per_fine must be positive");
  SPADE_CHECK(p.index.max_coarse >= 1 && p.index.coarse_units >= 0,
              "lycheecluster: max_coarse >= 1, coarse_units >= 0");
  SPADE_CHECK(p.index.kmeans.iterations >= 0, "lycheecluster: kmeans_iters >= 0");
  SPADE_CHECK(p.search.coarse_topk >= 0 && p.search.coarse_cover > 0,
              "lycheecluster: coarse_topk >= 0, coarse_cover > 0");
  SPADE_CHECK(p.stability_window >= 1, "lycheecluster: stability_window >= 1");
}

std::string LycheeClusterMethod::describe() const {
  const auto& c = p_.chunker;
  const auto& x = p_.index;
  return cat("lycheecluster budget=", p_.budget, " budget_mode=", p_.budget_total ? "total" : "clusters",
             " sink=", p_.sink, " buffer=", p_.buffer, " dense_layers=", p_.dense_layers,
             " chunking=", c.fixed ? "fixed" : "structure", " min_chunk=", c.min_tokens,
             " max_chunk=", c.max_tokens, " fixed_chunk=", c.fixed_tokens,
             " tie=", c.tie == ChunkTie::Last ? "last" : "first",
             " pooling=", x.pooling == Pooling::Mean ? "mean" : "max",
             " bound=", x.space == BoundSpace::Token ? "token" : "chunk",
             " chunks_per_fine=", x.chunks_per_fine, " max_coarse=", x.max_coarse,
             " coarse_units=", x.coarse_units ? std::to_string(x.coarse_units) : std::string("auto"),
             " kmeans_iters=", x.kmeans.iterations,
             " seeding=", x.kmeans.seeding == KMeansSeeding::Stride ? "stride" : "kmeans++",
             " center_dtype=", x.f16_centers ? "f16" : "f32",
             " coarse_topk=", p_.search.coarse_topk ? std::to_string(p_.search.coarse_topk) : std::string("auto"),
             " coarse_cover=", p_.search.coarse_cover,
             " group=", p_.search.group == GroupAgg::Max ? "max" : "sum",
             " rank=", p_.search.rank == RankBy::Bound ? "bound" : "center",
             " stability=", p_.stability ? 1 : 0);
}

std::unique_ptr<MethodState> LycheeClusterMethod::new_state() const {
  return std::make_unique<LycheeClusterState>();
}

void LycheeClusterMethod::sync(StepContext& c, LycheeClusterState& st) const {
  const int layer = c.layer;
  const int32_t have = st.layer_chunks_[size_t(layer)];
  const int64_t indexed_end = have > 0 ? st.chunk_starts()[size_t(have)] : p_.sink;
  if (have > 0 && c.L - indexed_end < p_.buffer) return;
  // The index covers the chunks that the tokens before the current one close (the paper
  // builds it after prefill, over the prompt): their K is in every layer's cache before the
  // step, so a GPU builds every layer at once; the current token is in the un-indexed tail,
  // which is always read.
  st.extend_chunks(c.L - 1, p_.sink, p_.chunker);
  const int32_t avail = st.n_chunks();
  if (avail <= have) return;
  const int Hkv = c.Hkv;
  const auto t0 = Clock::now();
  const double cpu0 = cpu_clock(CLOCK_PROCESS_CPUTIME_ID);
  auto per_head = [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      ClusterIndex& ix = st.idx_[size_t(layer) * size_t(Hkv) + size_t(h)];
      // One key at a time (the index reads each before asking the next), widened to fp32.
      thread_local std::vector<float> row;  // grown once per thread
      if (row.size() < size_t(c.D)) row.resize(size_t(c.D));
      KeyFn key = [&, h](int64_t pos) {
        c.kv->load_k(layer, *c.pt, pos, int(h), 1, row.data());
        return static_cast<const float*>(row.data());
      };
      if (have == 0) {
        ix.build(c.D, key, st.chunk_starts().data(), avail, p_.index);
      } else {
        for (int32_t ch = have; ch < avail; ++ch) ix.insert(key, st.chunk_starts().data(), ch);
      }
    }
  };
  ThreadPool::global().parallel_for(Hkv, 1, per_head);
  if (have == 0) {
    st.stats_.build_seconds += since(t0);
    st.stats_.build_cpu_seconds += cpu_clock(CLOCK_PROCESS_CPUTIME_ID) - cpu0;
    st.stats_.builds += Hkv;
    if (p_.stability)
      for (int h = 0; h < Hkv; ++h) {
        auto& s = st.stab_[size_t(layer) * size_t(Hkv) + size_t(h)];
        s.last_seen.assign(size_t(st.idx_[size_t(layer) * size_t(Hkv) + size_t(h)].n_fine()), -1);
      }
  } else {
    st.stats_.update_seconds += since(t0);
    st.stats_.inserted_chunks += int64_t(avail - have) * Hkv;
  }
  st.layer_chunks_[size_t(layer)] = avail;
}

void LycheeClusterMethod::select(StepContext& c, Selection& out) const {
  const int64_t L = c.L;
  if (c.layer < p_.dense_layers ||
      (p_.budget_total ? L <= p_.budget : L <= int64_t(p_.sink) + p_.budget)) {
    out.set_dense(c.Hkv, L);
    return;
  }
  SPADE_CHECK(c.state, "lycheecluster: no per-request state");
  auto& st = static_cast<LycheeClusterState&>(*c.state);
  st.ensure(c.n_layers, c.Hkv);
  sync(c, st);

  const auto t0 = Clock::now();
  const double cpu0 = cpu_clock(CLOCK_THREAD_CPUTIME_ID);
  const int32_t have = st.layer_chunks_[size_t(c.layer)];
  const int64_t sink = std::min<int64_t>(p_.sink, L);
  const int64_t recent_begin = have > 0 ? st.chunk_starts()[size_t(have)] : sink;
  SearchParams sp = p_.search;
  if (p_.budget_total) sp.budget = std::max<int64_t>(0, p_.budget - sink - (L - recent_begin));
  else sp.budget = p_.budget;

  out.begin_per_head(c.Hkv, L);
  for (int h = 0; h < c.Hkv; ++h) {
    for (int64_t p = 0; p < sink; ++p) out.push(int32_t(p));
    const ClusterIndex* ix = have > 0 ? &st.idx_[size_t(c.layer) * size_t(c.Hkv) + size_t(h)] : nullptr;
    if (ix && ix->built()) {
      st.sel_chunks_.clear();
      st.fines_.clear();
      const int64_t got = ix->search(c.q + int64_t(h) * c.G * c.D, c.G, sp, st.chunk_starts().data(),
                                     st.sel_chunks_, p_.stability ? &st.fines_ : nullptr, st.search_);
      st.stats_.searches++;
      st.stats_.selected_tokens += got;
      std::sort(st.sel_chunks_.begin(), st.sel_chunks_.end());
      for (int32_t ch : st.sel_chunks_)
        for (int32_t p = st.chunk_starts()[size_t(ch)]; p < st.chunk_starts()[size_t(ch) + 1]; ++p) out.push(p);
      if (p_.stability) {
        auto& s = st.stab_[size_t(c.layer) * size_t(c.Hkv) + size_t(h)];
        const int64_t n = int64_t(st.fines_.size());
        if (s.t > 0 && n > 0) {
          int64_t inter = 0, hit = 0;
          for (int32_t f : st.fines_) {
            const int64_t ls = s.last_seen[size_t(f)];
            inter += ls == s.t - 1;
            hit += ls >= 0 && ls >= s.t - p_.stability_window;
          }
          const int64_t uni = n + s.prev_size - inter;
          st.stats_.jaccard_sum += uni ? double(inter) / double(uni) : 1.0;
          st.stats_.jaccard_n++;
          st.stats_.window_hit_sum += double(hit) / double(n);
          st.stats_.window_hit_n++;
        }
        for (int32_t f : st.fines_) s.last_seen[size_t(f)] = s.t;
        s.prev_size = n;
        s.t++;
      }
    }
    for (int64_t p = std::max(recent_begin, sink); p < L; ++p) out.push(int32_t(p));
    out.close_head();
  }
  st.stats_.search_seconds += since(t0);
  st.stats_.search_cpu_seconds += cpu_clock(CLOCK_THREAD_CPUTIME_ID) - cpu0;
}

// ---- options ----

namespace {
// k-means iterations per index build (appendix A: 10); more only costs time.
constexpr int64_t kMaxKMeansIterations = 1000;
}  // namespace

std::vector<OptionSpec> lycheecluster_options() {
  OptionSpec budget = budget_option();
  budget.def = "1024";
  budget.help = "chunk tokens attended per KV head, sink and recent tokens not counted "
                "unless budget_mode=total (LycheeCluster appendix A: 1024)";
  using S = OptionSpec;
  constexpr auto Int = OptKind::Int, Float = OptKind::Float, Str = OptKind::String;
  return {
      budget,
      S{"budget_mode", Str, "clusters",
        "clusters: budget counts chunk tokens only (paper); total: it includes sink + recent"}
          .one_of({"clusters", "total"}),
      S{"sink", Int, "16", "attention-sink tokens always attended (appendix A: 16)"}
          .range(0, kMaxTokenCount),
      S{"buffer", Int, "128",
        "lazy update: index the closed chunks once this many tokens wait (appendix A: 128)"}
          .range(1, kMaxTokenCount),
      dense_layers_count("2", "leading full-attention layers (appendix A: 2)"),
      S{"chunking", Str, "structure",
        "structure (table 4 delimiters) or fixed (section 5.4 ablation)"}
          .one_of({"structure", "fixed"}),
      S{"min_chunk", Int, "8", "minimum chunk length (appendix A: 8)"}.range(1, kMaxTile),
      S{"max_chunk", Int, "16", "maximum chunk length, forced split (appendix A: 16)"}
          .range(1, kMaxTile),
      S{"fixed_chunk", Int, "16", "chunk length of chunking=fixed (section 5.4: 16)"}
          .range(1, kMaxTile),
      S{"tie", Str, "last", "equal-level delimiters in the window: last (longest chunk) or first"}
          .one_of({"last", "first"}),
      S{"pooling", Str, "mean", "chunk key pooling: mean (paper) or max (table 3 ablation)"}
          .one_of({"mean", "max"}),
      S{"bound", Str, "token",
        "node bound space: token (raw member keys: bounds every token's q.k) or chunk "
        "(paper-literal: normalized chunk keys)"}
          .one_of({"token", "chunk"}),
      S{"chunks_per_fine", Float, "2", "average chunks per fine cluster (appendix A/E: 2)"}
          .range(1, kMaxTile),
      S{"max_coarse", Int, "64", "most coarse units (appendix A: 64)"}.range(1, kMaxTile),
      S{"coarse_units", Int, "0", "coarse units; 0 = min(max_coarse, ceil(sqrt(#fine)))"}
          .range(0, kMaxTile),
      S{"kmeans_iters", Int, "10", "spherical k-means iterations (appendix A: 10)"}
          .range(0, kMaxKMeansIterations),
      S{"seeding", Str, "stride",
        "k-means seeding: stride (evenly spaced points) or kmeans++ (fixed seed)"}
          .one_of({"stride", "kmeans++"}),
      S{"seed", Int, "24301", "seed of seeding=kmeans++ (any 64-bit integer)"},
      S{"center_dtype", Str, "f16", "stored node centers: f16 or f32"}.one_of({"f16", "f32"}),
      S{"coarse_topk", Int, "0",
        "k_g coarse units searched; 0 = auto: the fewest top units holding coarse_cover x "
        "budget tokens"}
          .range(0, kMaxTile),
      S{"coarse_cover", Float, "4", "auto k_g: token cover of the kept units / budget"}
          .range(0, kMaxTokenCount)
          .open_lo(),
      S{"group", Str, "max",
        "GQA: node score over the group's query heads: max (upper bound for each) or sum"}
          .one_of({"max", "sum"}),
      S{"rank", Str, "bound",
        "node ranking: bound (q.c + |q| r, Algorithm 1) or center (q.c only, ablation)"}
          .one_of({"bound", "center"}),
      S{"stability", Int, "0", "1: appendix D counters (Jaccard, window hit rate)"}.range(0, 1),
      S{"stability_window", Int, "32", "window hit rate history w (appendix D: 32)"}
          .range(1, kMaxTokenCount),
  };
}

namespace {
// A String option whose value MethodOptions checked against its choices.
std::string pick(const MethodOptions& o, const std::string& key,
                 std::initializer_list<const char*> valid) {
  const std::string v = o.str(key);
  std::string list;
  for (const char* x : valid) {
    if (v == x) return v;
    list += (list.empty() ? "" : ", ") + std::string(x);
  }
  fail("lycheecluster option '", key, "' must be one of ", list, "; got '", v, "'");
}
}  // namespace

std::unique_ptr<SparseMethod> make_lycheecluster(const MethodOptions& o, const ModelConfig&) {
  LycheeClusterParams p;
  p.budget = o.integer("budget");
  p.budget_total = pick(o, "budget_mode", {"clusters", "total"}) == "total";
  p.sink = int(o.integer("sink"));
  p.buffer = int(o.integer("buffer"));
  p.dense_layers = int(o.integer("dense_layers"));  // [0, n_layers]: MethodOptions
  p.chunker.fixed = pick(o, "chunking", {"structure", "fixed"}) == "fixed";
  p.chunker.min_tokens = int(o.integer("min_chunk"));
  p.chunker.max_tokens = int(o.integer("max_chunk"));
  p.chunker.fixed_tokens = int(o.integer("fixed_chunk"));
  p.chunker.tie = pick(o, "tie", {"last", "first"}) == "last" ? ChunkTie::Last : ChunkTie::First;
  p.index.pooling = pick(o, "pooling", {"mean", "max"}) == "mean" ? Pooling::Mean : Pooling::Max;
  p.index.space = pick(o, "bound", {"token", "chunk"}) == "token" ? BoundSpace::Token : BoundSpace::Chunk;
  p.index.chunks_per_fine = o.number("chunks_per_fine");
  p.index.max_coarse = int(o.integer("max_coarse"));
  p.index.coarse_units = int(o.integer("coarse_units"));
  p.index.kmeans.iterations = int(o.integer("kmeans_iters"));
  p.index.kmeans.seeding =
      pick(o, "seeding", {"stride", "kmeans++"}) == "stride" ? KMeansSeeding::Stride : KMeansSeeding::PlusPlus;
  p.index.kmeans.seed = uint64_t(o.integer("seed"));
  p.index.f16_centers = pick(o, "center_dtype", {"f16", "f32"}) == "f16";
  p.search.coarse_topk = int(o.integer("coarse_topk"));
  p.search.coarse_cover = o.number("coarse_cover");
  p.search.group = pick(o, "group", {"max", "sum"}) == "max" ? GroupAgg::Max : GroupAgg::Sum;
  p.search.rank = pick(o, "rank", {"bound", "center"}) == "bound" ? RankBy::Bound : RankBy::Center;
  p.stability = o.integer("stability") != 0;
  p.stability_window = int(o.integer("stability_window"));
  return std::make_unique<LycheeClusterMethod>(p);
}

}  // namespace spade::sparse

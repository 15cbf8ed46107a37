// lycheecluster (LycheeCluster, Li et al.; ../shared/papers/lycheecluster.md section 4,
// appendices A-F; docs/lycheecluster.md). Per (layer >= dense_layers, KV head) a
// hierarchical index coarse unit -> fine cluster -> chunk (sparse/cluster_index.h) over
// structure-aware chunks of 8..16 tokens (sparse/chunker.h).
//
// Decode step of a sparse layer, per KV head:
//   1. sync: the first sparse step builds the index over every chunk that the tokens
//      before the current one close (the end of prefill: the framework does not signal the
//      last prefill chunk, so the build is deferred to the first decode step that needs a
//      sparse selection, and its time is counted as index build time). Later, once >=
//      `buffer` (128) tokens wait behind the index, the chunks closed since are inserted
//      (lazy update). The current token is never indexed in its own step (its K is written
//      layer by layer; the GPU builds every layer before the first sparse one).
//   2. search: coarse units by bound q.c + |q| r (max over the GQA group's query heads:
//      one search per KV head, shared by its G query heads; group=sum optional), top k_g;
//      their fine clusters by the same bound; chunks of the best clusters up to `budget`.
//   3. attend to: sink tokens [0, sink) + chosen chunks + every token not yet indexed
//      (the recent buffer, the decode token included).
// Dense (exact full attention) whenever everything fits: L <= sink + budget (budget_mode
// clusters, the paper's: budget counts chunk tokens only) or L <= budget (budget_mode
// total: budget counts sink and recent tokens too; the cluster budget is what is left).
// First `dense_layers` (2) layers are dense.
//
// Token text. Structure-aware chunking needs each token's decoded text; the method reads it
// from its per-request state (LycheeClusterState::set_token_text / append_token_text, e.g.
// Tokenizer::token_bytes of each prompt id). Positions without text read as "" (no
// delimiter), so without text the chunking degrades to fixed chunks of max_chunk tokens.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "sparse/chunker.h"
#include "sparse/cluster_index.h"
#include "sparse/method.h"
#include "sparse/options.h"

namespace spade::sparse {

struct LycheeClusterParams {
  int64_t budget = 1024;       // appendix A: token budget 1024
  bool budget_total = false;   // budget_mode=total: the budget includes sink + recent tokens
  int sink = 16;               // appendix A: attention sink 16
  int buffer = 128;            // appendix A: lazy-update buffer 128 tokens
  int dense_layers = 2;        // appendix A: first 2 layers full
  ChunkerOptions chunker;      // 8..16, structure-aware (fixed: the section 5.4 ablation)
  ClusterIndexOptions index;   // ~2 chunks per fine cluster, <= 64 coarse, 10 iterations
  SearchParams search;         // k_g auto (cover 4x budget), group max, rank by bound
  bool stability = false;      // appendix D counters
  int stability_window = 32;   // appendix D: w = 32
};

// Counters of one request (LycheeClusterState::stats()).
struct LycheeClusterStats {
  double chunk_seconds = 0;    // text chunking
  double build_seconds = 0;    // chunk pooling + k-means + radii, every layer and head
  double update_seconds = 0;   // lazy inserts
  double search_seconds = 0;   // hierarchical search + building the selection
  // CPU time (robust to a loaded machine): the build runs on the thread pool, so it is the
  // process's CPU time across the build (includes whatever else the process runs then);
  // the search runs on the calling thread (thread CPU time).
  double build_cpu_seconds = 0;
  double search_cpu_seconds = 0;
  int64_t builds = 0;          // (layer, head) indexes built
  int64_t inserted_chunks = 0; // lazy inserts, over (layer, head)
  int64_t searches = 0;        // (layer, head, step) searches
  int64_t selected_tokens = 0; // chunk tokens chosen, summed over searches
  // Appendix D (only with stability=1), over (layer, KV head, sparse step), fine clusters
  // as the retrieved units: Jaccard of consecutive sets, share of this step's clusters
  // that were retrieved in the previous `stability_window` steps.
  double jaccard_sum = 0, window_hit_sum = 0;
  int64_t jaccard_n = 0, window_hit_n = 0;
  double mean_jaccard() const { return jaccard_n ? jaccard_sum / double(jaccard_n) : 0.0; }
  double mean_window_hit() const { return window_hit_n ? window_hit_sum / double(window_hit_n) : 0.0; }
};

class LycheeClusterMethod;

class LycheeClusterState final : public MethodState {
 public:
  // text[pos] = the decoded bytes of the token at position pos (Tokenizer::token_bytes).
  void set_token_text(std::vector<std::string> text) { text_ = std::move(text); }
  void append_token_text(std::string_view piece) override { text_.emplace_back(piece); }
  bool wants_token_text() const override { return true; }
  const std::vector<std::string>& token_text() const { return text_; }

  // Closed chunks: chunk c covers [chunk_starts()[c], chunk_starts()[c + 1]); the last entry
  // is where the next chunk will start (empty before the first chunking).
  const std::vector<int32_t>& chunk_starts() const { return chunks_.starts(); }
  int32_t n_chunks() const { return chunks_.n_chunks(); }
  // The index of (layer, KV head); nullptr when that layer has none (yet).
  const ClusterIndex* index(int layer, int head) const;
  // Chunks indexed at `layer` (0 before its build).
  int32_t indexed_chunks(int layer) const {
    return layer < int(layer_chunks_.size()) ? layer_chunks_[size_t(layer)] : 0;
  }
  // Bytes of every index of this request plus the shared chunk boundaries.
  size_t index_bytes() const;
  const LycheeClusterStats& stats() const { return stats_; }

 private:
  friend class LycheeClusterMethod;
  struct Stability {
    std::vector<int64_t> last_seen;  // [n_fine] sparse step that last retrieved the cluster
    int64_t t = 0;                   // sparse steps so far
    int64_t prev_size = 0;
  };
  void ensure(int n_layers, int hkv);
  // Closes chunks over [next start, L) (streaming: the tail stays open).
  void extend_chunks(int64_t L, int sink, const ChunkerOptions& opt);

  std::vector<std::string> text_;
  StreamingChunks chunks_;
  int hkv_ = 0;
  std::vector<ClusterIndex> idx_;       // [layer][head]
  std::vector<int32_t> layer_chunks_;   // [layer]
  std::vector<Stability> stab_;         // [layer][head]
  LycheeClusterStats stats_;
  // Selection scratch.
  SearchScratch search_;
  std::vector<int32_t> sel_chunks_, fines_;
};

class LycheeClusterMethod final : public SparseMethod {
 public:
  explicit LycheeClusterMethod(const LycheeClusterParams& p);
  std::string name() const override { return "lycheecluster"; }
  std::string describe() const override;
  std::unique_ptr<MethodState> new_state() const override;
  void select(StepContext& ctx, Selection& out) const override;
  const LycheeClusterParams& params() const { return p_; }

 private:
  void sync(StepContext& ctx, LycheeClusterState& st) const;
  LycheeClusterParams p_;
};

std::vector<OptionSpec> lycheecluster_options();
std::unique_ptr<SparseMethod> make_lycheecluster(const MethodOptions& o, const ModelConfig& cfg);
// The method's per-request state, or nullptr when `s` is not a LycheeClusterState.
LycheeClusterState* lycheecluster_state(MethodState* s);

}  // namespace spade::sparse

// LycheeCluster's hierarchical index of one (layer, KV head): coarse units -> fine
// clusters -> chunks -> tokens (lycheecluster.md section 4; docs/lycheecluster.md).
//
// Build (prefill):
//   chunk key   k_j = normalize(mean of the chunk's raw keys)   (Pooling::Max: element-wise
//               max instead of the mean, the paper's ablation)
//   fine level  spherical k-means of {k_j} into ceil(M / chunks_per_fine) clusters
//   coarse      spherical k-means of the fine centroids into P units,
//               P = coarse_units, or auto = min(max_coarse, ceil(sqrt(#fine)))
//   Fine ids are renumbered so that each coarse unit owns a contiguous range of them.
//
// Node bound. Every node n stores a center c_n and a covering radius r_n, and
//     bound_n(q) = q . c_n + |q| * r_n
// is >= q . v for every member v within distance r_n of c_n (Cauchy-Schwarz). The space of
// the members is explicit (BoundSpace):
//   Token (default): members are the raw (un-normalized, post-RoPE) keys of every token of
//     the node's chunks; c_n = their mean, r_n = max_tok ||k - c_n||. So bound_n(q) >= q.k
//     for every token the node would bring into attention: the bound is on real attention
//     logits (times 1/sqrt(D)).
//   Chunk (paper-literal): members are the unit chunk keys k_j; fine c = the spherical
//     centroid, coarse c = the spherical centroid of its fine centroids; r = max over the
//     node's chunk keys (a coarse radius covers every chunk below it, not only its fine
//     centroids, so the bound is valid for every descendant chunk). The bound is on q.k_j,
//     not on any token's q.k.
// Radii are measured from the center as stored (fp16 when f16_centers) and rounded up to
// the next float, so the bound holds exactly for the stored center; only the fp32 dot
// product q.c itself rounds.
//
// Lazy update (decode): a new chunk goes to the coarse unit whose center is most similar
// (cosine with the chunk key), then to the most similar fine cluster of that unit. Each of
// the two nodes: c' = running mean (Token: token-weighted mean of raw keys; Chunk: mean of
// chunk keys), r' = max(r + |c' - c|, max over the new members |v - c'|): old members were
// within r of c, hence within r + |c' - c| of c'. Radii only grow; the bound stays valid.
//
// Search (decode): coarse units ranked by bound (aggregated over the GQA group), the top
// k_g kept; their fine clusters ranked by bound; chunks of the ranked clusters taken in
// order (a chunk that does not fit the remaining budget is skipped) until the budget is
// spent or the candidates run out.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "sparse/kmeans.h"

namespace spade::sparse {

enum class Pooling { Mean, Max };
enum class BoundSpace { Token, Chunk };
enum class GroupAgg { Max, Sum };
// What ranks the nodes in the search: the bound q.c + |q| r (paper, Algorithm 1) or the
// center score q.c alone (an ablation; with BoundSpace::Token it is the mean of the
// members' q.k).
enum class RankBy { Bound, Center };

struct ClusterIndexOptions {
  double chunks_per_fine = 2.0;  // appendix A/E: ~2 chunks per fine cluster
  int max_coarse = 64;           // appendix A: at most 64 coarse units
  int coarse_units = 0;          // 0: auto = min(max_coarse, ceil(sqrt(#fine)))
  KMeansOptions kmeans;          // 10 iterations, stride seeding
  Pooling pooling = Pooling::Mean;
  BoundSpace space = BoundSpace::Token;
  bool f16_centers = true;       // centers stored as IEEE fp16 (index memory)
};

struct SearchParams {
  int64_t budget = 1024;          // tokens of selected chunks at most
  int coarse_topk = 0;            // k_g; 0: auto (coarse_cover)
  double coarse_cover = 4.0;      // auto k_g: fewest top units holding >= cover * budget tokens
  GroupAgg group = GroupAgg::Max; // GQA: max (an upper bound for every head) or sum
  RankBy rank = RankBy::Bound;
};

// Keys of one (layer, KV head): key(pos) -> D floats.
using KeyFn = std::function<const float*(int64_t)>;

struct SearchScratch {
  std::vector<float> score, cbuf;
  std::vector<int32_t> order, cand;
};

class ClusterIndex {
 public:
  enum Level { kFine = 0, kCoarse = 1 };

  // Chunk c covers positions [starts[c], starts[c + 1]); builds over chunks [0, n_chunks).
  void build(int D, const KeyFn& key, const int32_t* starts, int32_t n_chunks,
             const ClusterIndexOptions& opt);
  // Lazy update with chunk c == n_chunks() covering [starts[c], starts[c + 1]).
  void insert(const KeyFn& key, const int32_t* starts, int32_t c);

  bool built() const { return built_; }
  int D() const { return D_; }
  const ClusterIndexOptions& options() const { return opt_; }
  int32_t n_chunks() const { return n_chunks_; }
  int n_nodes(Level l) const { return int(lv_[l].radius.size()); }
  int n_fine() const { return n_nodes(kFine); }
  int n_coarse() const { return n_nodes(kCoarse); }

  // Node data: center (D floats, as stored), radius, tokens covered.
  void center(Level l, int node, float* out) const;
  float radius(Level l, int node) const { return lv_[l].radius[size_t(node)]; }
  int64_t tokens(Level l, int node) const { return lv_[l].tokens[size_t(node)]; }
  // bound(q) = q . c + |q| * r for one query head (qnorm = |q|).
  float bound(Level l, int node, const float* q, float qnorm) const;

  // Fine clusters of coarse unit g: [fine_begin(g), fine_begin(g + 1)).
  int fine_begin(int g) const { return coarse_first_[size_t(g)]; }
  // Chunks of fine cluster i in position order: c = first_chunk(i); c >= 0; c = next_chunk(c).
  int32_t first_chunk(int i) const { return fine_head_[size_t(i)]; }
  int32_t next_chunk(int32_t c) const { return chunk_next_[size_t(c)]; }
  int coarse_of(int fine) const;

  // Hierarchical search for the G query heads q [G, D] of one KV head. Appends the chosen
  // chunk ids (unsorted) to `chunks` and, when `fines` is non-null, the fine clusters they
  // came from (each once) to `fines`. Returns the tokens chosen (<= p.budget).
  int64_t search(const float* q, int G, const SearchParams& p, const int32_t* starts,
                 std::vector<int32_t>& chunks, std::vector<int32_t>* fines,
                 SearchScratch& s) const;

  // Bytes of the index: centers, radii, counters, membership links.
  size_t bytes() const;

 private:
  struct LevelData {
    std::vector<uint16_t> c16;   // [n, D] when f16_centers
    std::vector<float> c32;      // [n, D] otherwise
    std::vector<float> radius;   // [n]
    std::vector<int32_t> tokens; // [n] tokens covered
    std::vector<int32_t> count;  // [n] members of the running mean (Token: tokens, Chunk: chunks)
  };
  void set_center(Level l, int node, const double* c);
  void pool_chunk(const KeyFn& key, int32_t b, int32_t e, double* mean, float* unit) const;
  void update_node(Level l, int node, const KeyFn& key, int32_t b, int32_t e, const double* mean,
                   const float* unit);
  int most_similar(Level l, int lo, int hi, const float* unit) const;

  bool built_ = false;
  int D_ = 0;
  ClusterIndexOptions opt_;
  int32_t n_chunks_ = 0;
  LevelData lv_[2];
  std::vector<int32_t> coarse_first_;  // [n_coarse + 1]
  std::vector<int32_t> fine_head_, fine_tail_;
  std::vector<int32_t> chunk_next_;    // [n_chunks], -1 ends a list
};

// Upward-rounded float of a non-negative double.
float round_up_float(double x);

}  // namespace spade::sparse

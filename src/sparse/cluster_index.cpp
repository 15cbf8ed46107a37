#include "sparse/cluster_index.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/half.h"
#include "sparse/topk.h"

namespace spade::sparse {

float round_up_float(double x) {
  float f = float(x);
  if (double(f) < x) f = std::nextafter(f, INFINITY);
  return f;
}

namespace {

float dot(const float* a, const float* b, int D) {
  float s = 0.f;
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

double dist(const float* a, const float* b, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) {
    const double t = double(a[d]) - double(b[d]);
    s += t * t;
  }
  return std::sqrt(s);
}

float norm(const float* a, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) s += double(a[d]) * a[d];
  return float(std::sqrt(s));
}

// fp16 holds |x| <= 65504; any center is valid (radii are measured from the stored one).
constexpr double kF16Clamp = 65000.0;

}  // namespace

void ClusterIndex::set_center(Level l, int node, const double* c) {
  LevelData& v = lv_[l];
  if (opt_.f16_centers) {
    uint16_t* o = v.c16.data() + size_t(node) * D_;
    for (int d = 0; d < D_; ++d) o[d] = f32_to_f16(float(std::clamp(c[d], -kF16Clamp, kF16Clamp)));
  } else {
    float* o = v.c32.data() + size_t(node) * D_;
    for (int d = 0; d < D_; ++d) o[d] = float(c[d]);
  }
}

void ClusterIndex::center(Level l, int node, float* out) const {
  const LevelData& v = lv_[l];
  if (opt_.f16_centers) {
    const uint16_t* c = v.c16.data() + size_t(node) * D_;
    for (int d = 0; d < D_; ++d) out[d] = f16_to_f32(c[d]);
  } else {
    std::copy_n(v.c32.data() + size_t(node) * D_, D_, out);
  }
}

float ClusterIndex::bound(Level l, int node, const float* q, float qnorm) const {
  const LevelData& v = lv_[l];
  float c[512];
  std::vector<float> big;
  float* cp = c;
  if (D_ > 512) {
    big.resize(size_t(D_));
    cp = big.data();
  }
  center(l, node, cp);
  return dot(q, cp, D_) + qnorm * v.radius[size_t(node)];
}

int ClusterIndex::coarse_of(int fine) const {
  auto it = std::upper_bound(coarse_first_.begin(), coarse_first_.end(), fine);
  return int(it - coarse_first_.begin()) - 1;
}

// Raw mean of the chunk's keys (double) and its unit chunk key (mean or max pooling).
void ClusterIndex::pool_chunk(const KeyFn& key, int32_t b, int32_t e, double* mean,
                              float* unit) const {
  std::fill_n(mean, D_, 0.0);
  if (opt_.pooling == Pooling::Max) std::fill_n(unit, D_, -INFINITY);
  for (int32_t p = b; p < e; ++p) {
    const float* k = key(p);
    for (int d = 0; d < D_; ++d) mean[d] += k[d];
    if (opt_.pooling == Pooling::Max)
      for (int d = 0; d < D_; ++d) unit[d] = std::max(unit[d], k[d]);
  }
  const double inv = 1.0 / double(std::max(1, e - b));
  for (int d = 0; d < D_; ++d) mean[d] *= inv;
  if (opt_.pooling == Pooling::Mean)
    for (int d = 0; d < D_; ++d) unit[d] = float(mean[d]);
  l2_normalize(unit, D_);
}

void ClusterIndex::build(int D, const KeyFn& key, const int32_t* starts, int32_t M,
                         const ClusterIndexOptions& opt) {
  SPADE_CHECK(D > 0 && M > 0, "ClusterIndex::build: need D > 0 and at least one chunk");
  SPADE_CHECK(opt.chunks_per_fine > 0 && opt.max_coarse >= 1 && opt.coarse_units >= 0,
              "ClusterIndex: bad options");
  *this = ClusterIndex();
  D_ = D;
  opt_ = opt;
  n_chunks_ = M;

  // Chunk keys.
  std::vector<double> means(size_t(M) * D);
  std::vector<float> X(size_t(M) * D);
  for (int32_t c = 0; c < M; ++c)
    pool_chunk(key, starts[c], starts[c + 1], means.data() + size_t(c) * D, X.data() + size_t(c) * D);

  // Fine clusters, then coarse units over the fine centroids.
  const int K = int(std::clamp<double>(std::ceil(double(M) / opt.chunks_per_fine), 1.0, double(M)));
  KMeansResult fine = spherical_kmeans(X.data(), M, D, K, opt.kmeans);
  int P = opt.coarse_units > 0 ? opt.coarse_units
                               : std::min(opt.max_coarse, int(std::ceil(std::sqrt(double(fine.K)))));
  P = std::clamp(P, 1, fine.K);
  KMeansResult coarse = spherical_kmeans(fine.centroids.data(), fine.K, D, P, opt.kmeans);
  const int G = coarse.K;

  // Renumber fine clusters so that each coarse unit owns a contiguous range.
  std::vector<int32_t> order(size_t(fine.K));
  for (int i = 0; i < fine.K; ++i) order[size_t(i)] = i;
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return coarse.assign[size_t(a)] < coarse.assign[size_t(b)];
  });
  std::vector<int32_t> new_id(size_t(fine.K));
  for (int i = 0; i < fine.K; ++i) new_id[size_t(order[size_t(i)])] = i;
  coarse_first_.assign(size_t(G) + 1, 0);
  for (int i = 0; i < fine.K; ++i) ++coarse_first_[size_t(coarse.assign[size_t(i)]) + 1];
  for (int g = 0; g < G; ++g) coarse_first_[size_t(g) + 1] += coarse_first_[size_t(g)];

  const int NF = fine.K;
  for (int l = 0; l < 2; ++l) {
    const int n = l == kFine ? NF : G;
    if (opt.f16_centers) lv_[l].c16.assign(size_t(n) * D, 0);
    else lv_[l].c32.assign(size_t(n) * D, 0.f);
    lv_[l].radius.assign(size_t(n), 0.f);
    lv_[l].tokens.assign(size_t(n), 0);
    lv_[l].count.assign(size_t(n), 0);
  }
  std::vector<int32_t> chunk_fine(static_cast<size_t>(M));
  fine_head_.assign(size_t(NF), -1);
  fine_tail_.assign(size_t(NF), -1);
  chunk_next_.assign(size_t(M), -1);
  for (int32_t c = 0; c < M; ++c) {
    const int f = new_id[size_t(fine.assign[size_t(c)])];
    chunk_fine[size_t(c)] = f;
    if (fine_tail_[size_t(f)] < 0) fine_head_[size_t(f)] = c;
    else chunk_next_[size_t(fine_tail_[size_t(f)])] = c;
    fine_tail_[size_t(f)] = c;
  }
  auto coarse_of_fine = [&](int f) { return coarse.assign[size_t(order[size_t(f)])]; };

  // Centers.
  std::vector<double> acc[2] = {std::vector<double>(size_t(NF) * D, 0.0),
                                std::vector<double>(size_t(G) * D, 0.0)};
  for (int32_t c = 0; c < M; ++c) {
    const int f = chunk_fine[size_t(c)], g = coarse_of_fine(f);
    const int32_t m = starts[c + 1] - starts[c];
    const int node[2] = {f, g};
    for (int l = 0; l < 2; ++l) {
      lv_[l].tokens[size_t(node[l])] += m;
      lv_[l].count[size_t(node[l])] += opt.space == BoundSpace::Token ? m : 1;
      if (opt.space == BoundSpace::Token) {
        double* a = acc[l].data() + size_t(node[l]) * D;
        const double* mu = means.data() + size_t(c) * D;
        for (int d = 0; d < D; ++d) a[d] += mu[d] * m;
      }
    }
  }
  std::vector<double> tmp(static_cast<size_t>(D));
  for (int l = 0; l < 2; ++l) {
    const int n = l == kFine ? NF : G;
    for (int i = 0; i < n; ++i) {
      if (opt.space == BoundSpace::Token) {
        const double inv = 1.0 / double(std::max(1, lv_[l].count[size_t(i)]));
        for (int d = 0; d < D; ++d) tmp[size_t(d)] = acc[l][size_t(i) * D + d] * inv;
      } else {
        const float* c = l == kFine ? fine.centroids.data() + size_t(order[size_t(i)]) * D
                                    : coarse.centroids.data() + size_t(i) * D;
        for (int d = 0; d < D; ++d) tmp[size_t(d)] = c[d];
      }
      set_center(Level(l), i, tmp.data());
    }
  }

  // Radii, measured from the stored centers.
  std::vector<float> cf(size_t(NF) * D), cg(size_t(G) * D);
  for (int i = 0; i < NF; ++i) center(kFine, i, cf.data() + size_t(i) * D);
  for (int g = 0; g < G; ++g) center(kCoarse, g, cg.data() + size_t(g) * D);
  std::vector<double> rad[2] = {std::vector<double>(size_t(NF), 0.0), std::vector<double>(size_t(G), 0.0)};
  for (int32_t c = 0; c < M; ++c) {
    const int f = chunk_fine[size_t(c)], g = coarse_of_fine(f);
    const float* fc = cf.data() + size_t(f) * D;
    const float* gc = cg.data() + size_t(g) * D;
    if (opt.space == BoundSpace::Token) {
      for (int32_t p = starts[c]; p < starts[c + 1]; ++p) {
        const float* k = key(p);
        rad[kFine][size_t(f)] = std::max(rad[kFine][size_t(f)], dist(k, fc, D));
        rad[kCoarse][size_t(g)] = std::max(rad[kCoarse][size_t(g)], dist(k, gc, D));
      }
    } else {
      const float* x = X.data() + size_t(c) * D;
      rad[kFine][size_t(f)] = std::max(rad[kFine][size_t(f)], dist(x, fc, D));
      rad[kCoarse][size_t(g)] = std::max(rad[kCoarse][size_t(g)], dist(x, gc, D));
    }
  }
  for (int l = 0; l < 2; ++l)
    for (size_t i = 0; i < rad[l].size(); ++i) lv_[l].radius[i] = round_up_float(rad[l][i]);
  built_ = true;
}

int ClusterIndex::most_similar(Level l, int lo, int hi, const float* unit) const {
  std::vector<float> c(static_cast<size_t>(D_));
  int best = lo;
  float best_s = -INFINITY;
  for (int i = lo; i < hi; ++i) {
    center(l, i, c.data());
    const float n = norm(c.data(), D_);
    const float s = n > 0 ? dot(unit, c.data(), D_) / n : -INFINITY;
    if (s > best_s) {
      best_s = s;
      best = i;
    }
  }
  return best;
}

void ClusterIndex::update_node(Level l, int node, const KeyFn& key, int32_t b, int32_t e,
                               const double* mean, const float* unit) {
  LevelData& v = lv_[l];
  const int32_t m = e - b;
  std::vector<float> old_c(static_cast<size_t>(D_)), new_c(static_cast<size_t>(D_));
  std::vector<double> c(static_cast<size_t>(D_));
  center(l, node, old_c.data());
  const int32_t n = v.count[size_t(node)];
  if (opt_.space == BoundSpace::Token) {
    const double w = double(m) / double(n + m);
    for (int d = 0; d < D_; ++d) c[size_t(d)] = old_c[size_t(d)] + w * (mean[d] - old_c[size_t(d)]);
    v.count[size_t(node)] += m;
  } else {
    const double w = 1.0 / double(n + 1);
    for (int d = 0; d < D_; ++d) c[size_t(d)] = old_c[size_t(d)] + w * (unit[d] - old_c[size_t(d)]);
    v.count[size_t(node)] += 1;
  }
  v.tokens[size_t(node)] += m;
  set_center(l, node, c.data());
  center(l, node, new_c.data());
  double r = double(v.radius[size_t(node)]) + dist(old_c.data(), new_c.data(), D_);
  if (opt_.space == BoundSpace::Token) {
    for (int32_t p = b; p < e; ++p) r = std::max(r, dist(key(p), new_c.data(), D_));
  } else {
    r = std::max(r, dist(unit, new_c.data(), D_));
  }
  v.radius[size_t(node)] = round_up_float(r);
}

void ClusterIndex::insert(const KeyFn& key, const int32_t* starts, int32_t c) {
  SPADE_CHECK(built_, "ClusterIndex::insert before build");
  SPADE_CHECK(c == n_chunks_, "ClusterIndex::insert: chunk ", c, " is not the next chunk (",
              n_chunks_, ")");
  const int32_t b = starts[c], e = starts[c + 1];
  SPADE_CHECK(e > b, "ClusterIndex::insert: empty chunk");
  std::vector<double> mean(static_cast<size_t>(D_));
  std::vector<float> unit(static_cast<size_t>(D_));
  pool_chunk(key, b, e, mean.data(), unit.data());
  const int g = most_similar(kCoarse, 0, n_coarse(), unit.data());
  const int f = most_similar(kFine, fine_begin(g), fine_begin(g + 1), unit.data());
  update_node(kFine, f, key, b, e, mean.data(), unit.data());
  update_node(kCoarse, g, key, b, e, mean.data(), unit.data());
  chunk_next_.push_back(-1);
  if (fine_tail_[size_t(f)] < 0) fine_head_[size_t(f)] = c;
  else chunk_next_[size_t(fine_tail_[size_t(f)])] = c;
  fine_tail_[size_t(f)] = c;
  ++n_chunks_;
}

int64_t ClusterIndex::search(const float* q, int G, const SearchParams& p, const int32_t* starts,
                             std::vector<int32_t>& chunks, std::vector<int32_t>* fines,
                             SearchScratch& s) const {
  if (!built_ || p.budget <= 0) return 0;
  const int NG = n_coarse(), NF = n_fine();
  float qn[64];
  std::vector<float> qn_big;
  float* qnorm = qn;
  if (G > 64) {
    qn_big.resize(size_t(G));
    qnorm = qn_big.data();
  }
  for (int g = 0; g < G; ++g) qnorm[g] = norm(q + size_t(g) * D_, D_);
  if (s.cbuf.size() < size_t(D_)) s.cbuf.resize(size_t(D_));
  float* cb = s.cbuf.data();
  // Same arithmetic as bound(): fp32 dot over the (converted) center, plus |q| r.
  auto agg_bound = [&](Level l, int node) {
    center(l, node, cb);
    const float r = p.rank == RankBy::Bound ? lv_[l].radius[size_t(node)] : 0.f;
    float a = p.group == GroupAgg::Max ? -INFINITY : 0.f;
    for (int g = 0; g < G; ++g) {
      const float b = dot(q + size_t(g) * D_, cb, D_) + qnorm[g] * r;
      a = p.group == GroupAgg::Max ? std::max(a, b) : a + b;
    }
    return a;
  };
  if (s.score.size() < size_t(std::max(NG, NF))) s.score.resize(size_t(std::max(NG, NF)));
  // Coarse level.
  for (int g = 0; g < NG; ++g) s.score[size_t(g)] = agg_bound(kCoarse, g);
  const int64_t kg_all = top_k_range(s.score.data(), 0, NG, NG, s.order);
  int64_t kg = kg_all;
  if (p.coarse_topk > 0) {
    kg = std::min<int64_t>(kg_all, p.coarse_topk);
  } else {
    const double want = p.coarse_cover * double(p.budget);
    double have = 0;
    for (kg = 0; kg < kg_all && have < want; ++kg) have += double(tokens(kCoarse, s.order[size_t(kg)]));
  }
  // Fine candidates of the kept units.
  s.cand.clear();
  for (int64_t j = 0; j < kg; ++j) {
    const int g = s.order[size_t(j)];
    for (int f = fine_begin(g); f < fine_begin(g + 1); ++f) s.cand.push_back(f);
  }
  std::sort(s.cand.begin(), s.cand.end());  // fine ids ascending: ties rank the lower id first
  const int32_t nc = int32_t(s.cand.size());
  for (int32_t j = 0; j < nc; ++j) s.score[size_t(j)] = agg_bound(kFine, s.cand[size_t(j)]);
  const int64_t kc = top_k_range(s.score.data(), 0, nc, nc, s.order);
  // Fill the budget with the chunks of the ranked clusters.
  int64_t left = p.budget;
  for (int64_t j = 0; j < kc && left > 0; ++j) {
    const int f = s.cand[size_t(s.order[size_t(j)])];
    bool used = false;
    for (int32_t c = first_chunk(f); c >= 0; c = next_chunk(c)) {
      const int64_t len = starts[c + 1] - starts[c];
      if (len > left) continue;
      chunks.push_back(c);
      left -= len;
      used = true;
    }
    if (used && fines) fines->push_back(f);
  }
  return p.budget - left;
}

size_t ClusterIndex::bytes() const {
  size_t b = 0;
  for (const auto& v : lv_)
    b += v.c16.size() * sizeof(uint16_t) + v.c32.size() * sizeof(float) +
         v.radius.size() * sizeof(float) + v.tokens.size() * sizeof(int32_t) +
         v.count.size() * sizeof(int32_t);
  b += coarse_first_.size() * sizeof(int32_t) + fine_head_.size() * sizeof(int32_t) +
       fine_tail_.size() * sizeof(int32_t) + chunk_next_.size() * sizeof(int32_t);
  return b;
}

}  // namespace spade::sparse

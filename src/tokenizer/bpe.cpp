#include "tokenizer/bpe.h"

#include <algorithm>

namespace spade::tok {

namespace {
constexpr uint64_t kNone = ~uint64_t(0);
inline uint32_t rank_of(uint64_t v) { return uint32_t(v >> 32); }
}  // namespace

void BpeMerges::apply(std::vector<int32_t>& syms) const {
  if (syms.size() < 2) return;
  if (syms.size() <= 64)
    apply_small(syms);
  else
    apply_heap(syms);
}

// Quadratic but allocation-free and fast for the short words that dominate real text.
void BpeMerges::apply_small(std::vector<int32_t>& s) const {
  uint64_t pr[64];
  size_t n = s.size();
  for (size_t i = 0; i + 1 < n; ++i) pr[i] = lookup(s[i], s[i + 1]);
  while (n > 1) {
    size_t best = n;
    uint32_t best_rank = ~uint32_t(0);
    for (size_t i = 0; i + 1 < n; ++i) {
      if (pr[i] != kNone && rank_of(pr[i]) < best_rank) {
        best_rank = rank_of(pr[i]);
        best = i;
      }
    }
    if (best == n) break;
    s[best] = int32_t(uint32_t(pr[best]));
    // Remove symbol best+1 and pair best+1.
    for (size_t i = best + 1; i + 1 < n; ++i) s[i] = s[i + 1];
    for (size_t i = best + 1; i + 2 < n; ++i) pr[i] = pr[i + 1];
    --n;
    if (best > 0) pr[best - 1] = lookup(s[best - 1], s[best]);
    if (best + 1 < n) pr[best] = lookup(s[best], s[best + 1]);
  }
  s.resize(n);
}

// Linked symbols and a binary heap of candidate merges ordered by (rank, position);
// stale entries are skipped when popped. O(n log n) for long words.
void BpeMerges::apply_heap(std::vector<int32_t>& s) const {
  struct Cand {
    uint32_t rank, pos;
    int32_t merged;
  };
  auto worse = [](const Cand& a, const Cand& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  size_t n = s.size();
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = int32_t(i) - 1;
    next[i] = (i + 1 < n) ? int32_t(i + 1) : -1;
  }
  std::vector<Cand> heap;
  heap.reserve(n);
  for (size_t i = 0; i + 1 < n; ++i) {
    uint64_t v = lookup(s[i], s[i + 1]);
    if (v != kNone) heap.push_back({rank_of(v), uint32_t(i), int32_t(uint32_t(v))});
  }
  std::make_heap(heap.begin(), heap.end(), worse);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    Cand c = heap.back();
    heap.pop_back();
    uint32_t i = c.pos;
    if (!alive[i] || next[i] < 0) continue;
    int32_t j = next[i];
    uint64_t v = lookup(s[i], s[j]);
    if (v == kNone || rank_of(v) != c.rank || int32_t(uint32_t(v)) != c.merged) continue;
    s[i] = c.merged;
    alive[j] = 0;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = int32_t(i);
    if (prev[i] >= 0) {
      uint64_t w = lookup(s[prev[i]], s[i]);
      if (w != kNone) {
        heap.push_back({rank_of(w), uint32_t(prev[i]), int32_t(uint32_t(w))});
        std::push_heap(heap.begin(), heap.end(), worse);
      }
    }
    if (next[i] >= 0) {
      uint64_t w = lookup(s[i], s[next[i]]);
      if (w != kNone) {
        heap.push_back({rank_of(w), i, int32_t(uint32_t(w))});
        std::push_heap(heap.begin(), heap.end(), worse);
      }
    }
  }
  size_t out = 0;
  for (size_t i = 0; i < n; ++i)
    if (alive[i]) s[out++] = s[i];
  s.resize(out);
}

}  // namespace spade::tok

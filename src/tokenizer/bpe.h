// The BPE merge loop: given a word's initial symbols (token ids), repeatedly merges the
// adjacent pair of lowest rank, leftmost first, until no pair has a merge. Ranks come from
// the merges list (tokenizer.json, GGUF gpt2 vocabularies) or from token scores
// (SentencePiece vocabularies: equal scores share a rank, so ties go to the leftmost pair,
// as SentencePiece and llama.cpp do).
#pragma once
#include <cstdint>
#include <vector>

#include "tokenizer/hash.h"

namespace spade::tok {

class BpeMerges {
 public:
  void reserve(size_t n) { map_.reserve(n); }
  // Keeps the first (lowest-rank) entry for a pair that appears twice.
  void add(int32_t left, int32_t right, uint32_t rank, int32_t merged) {
    map_.insert(key(left, right), (uint64_t(rank) << 32) | uint32_t(merged));
  }
  size_t size() const { return map_.size(); }
  // Merges `syms` in place. Symbols < 0 (unknown) never merge.
  void apply(std::vector<int32_t>& syms) const;

 private:
  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  // (rank << 32 | merged id) or ~0 when the pair does not merge.
  uint64_t lookup(int32_t a, int32_t b) const {
    if (a < 0 || b < 0) return ~uint64_t(0);
    const uint64_t* v = map_.find(key(a, b));
    return v ? *v : ~uint64_t(0);
  }
  void apply_small(std::vector<int32_t>& syms) const;
  void apply_heap(std::vector<int32_t>& syms) const;
  FlatMap64 map_;
};

}  // namespace spade::tok

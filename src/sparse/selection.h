// The one thing a sparse method hands to attention: which cached token positions each KV
// head of one request reads at one layer of one decode step.
//
//   Dense    every position [0, length) for every head ("all" is a valid answer).
//   PerHead  CSR over KV heads: head h reads positions[offsets[h] .. offsets[h+1]).
//   Shared   one list for all KV heads, stored once: positions[0 .. offsets[1]).
//
// Positions are int32, strictly increasing within a head, each < length. The attention
// kernel gathers exactly these rows through the page table (each row once per KV head, for
// the whole GQA group); there is never a mask over dense scores.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace spade::sparse {

enum class SelKind { Dense, PerHead, Shared };

struct Selection {
  SelKind kind = SelKind::Dense;
  int n_kv_heads = 0;
  int64_t length = 0;              // context length L the selection was made for
  std::vector<int32_t> offsets;    // PerHead: n_kv_heads + 1 entries; Shared: {0, n}
  std::vector<int32_t> positions;

  // Builders. They keep the vectors' capacity, so a steady decode loop does not allocate.
  void set_dense(int hkv, int64_t L) {
    kind = SelKind::Dense;
    n_kv_heads = hkv;
    length = L;
    offsets.clear();
    positions.clear();
  }
  // Starts a CSR selection; append each head's positions with push() then close_head(),
  // heads in order 0..hkv-1.
  void begin_per_head(int hkv, int64_t L) {
    kind = SelKind::PerHead;
    n_kv_heads = hkv;
    length = L;
    offsets.clear();
    positions.clear();
    offsets.push_back(0);
  }
  // Starts a shared selection; push() its positions then close_head() once.
  void begin_shared(int hkv, int64_t L) {
    begin_per_head(hkv, L);
    kind = SelKind::Shared;
  }
  void push(int32_t pos) { positions.push_back(pos); }
  void close_head() { offsets.push_back(int32_t(positions.size())); }

  bool dense() const { return kind == SelKind::Dense; }
  // Tokens head h reads.
  int64_t count(int h) const {
    if (kind == SelKind::Dense) return length;
    const int i = kind == SelKind::Shared ? 0 : h;
    return offsets[size_t(i) + 1] - offsets[size_t(i)];
  }
  // Positions of head h (nullptr for Dense: all of [0, length)).
  const int32_t* head(int h) const {
    if (kind == SelKind::Dense) return nullptr;
    const int i = kind == SelKind::Shared ? 0 : h;
    return positions.data() + offsets[size_t(i)];
  }
  // Every head reads the same list (Dense or Shared).
  bool uniform() const { return kind != SelKind::PerHead; }
};

// Throws spade::Error unless `s` is well formed for context length L and hkv heads
// (offsets consistent, positions strictly increasing and in range).
void validate(const Selection& s, int hkv, int64_t L);

}  // namespace spade::sparse

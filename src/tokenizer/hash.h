// Small hashing helpers for the tokenizer's hot paths: a fast byte-string hash (for
// std::unordered_map with heterogeneous string_view lookup) and an open-addressing map
// from 64-bit keys to 64-bit values (the BPE merge table).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace spade::tok {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0x100000001B3ull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ mix64(w)) * 0x100000001B3ull;
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ mix64(w ^ (uint64_t(n) << 56))) * 0x100000001B3ull;
  }
  return mix64(h);
}

struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return hash_bytes(s.data(), s.size()); }
  size_t operator()(const std::string& s) const { return hash_bytes(s.data(), s.size()); }
};
struct StrEq {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};

// Open addressing, linear probing; key ~0 is reserved as "empty".
class FlatMap64 {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, 0);
    mask_ = cap - 1;
    size_ = 0;
  }
  // Inserts unless present; returns false when the key was already there.
  bool insert(uint64_t key, uint64_t val) {
    if ((size_ + 1) * 2 > keys_.size()) grow();
    size_t i = mix64(key) & mask_;
    while (keys_[i] != kEmpty) {
      if (keys_[i] == key) return false;
      i = (i + 1) & mask_;
    }
    keys_[i] = key;
    vals_[i] = val;
    ++size_;
    return true;
  }
  const uint64_t* find(uint64_t key) const {
    if (keys_.empty()) return nullptr;
    size_t i = mix64(key) & mask_;
    while (true) {
      uint64_t k = keys_[i];
      if (k == key) return &vals_[i];
      if (k == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  void grow() {
    std::vector<uint64_t> k = std::move(keys_), v = std::move(vals_);
    reserve(k.empty() ? 16 : k.size());
    for (size_t i = 0; i < k.size(); ++i)
      if (k[i] != kEmpty) insert(k[i], v[i]);
  }
  std::vector<uint64_t> keys_, vals_;
  size_t mask_ = 0, size_ = 0;
};

}  // namespace spade::tok

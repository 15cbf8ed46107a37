#include "model/rope_permute.h"

#include <cstring>
#include <vector>

#include "core/error.h"

namespace spade {

namespace {

// to_hf: true moves GGUF row (h, i, j) = h*D + 2i + j to HF row h*D + j*D/2 + i.
void move_rows(float* w, int64_t n_heads, int64_t head_dim, int64_t cols, bool to_hf) {
  SPADE_CHECK(head_dim % 2 == 0, "RoPE row permutation: head_dim ", head_dim, " is odd");
  const int64_t half = head_dim / 2;
  std::vector<float> head(size_t(head_dim * cols));
  for (int64_t h = 0; h < n_heads; ++h) {
    float* base = w + h * head_dim * cols;
    std::memcpy(head.data(), base, head.size() * sizeof(float));
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t j = 0; j < 2; ++j) {
        int64_t gguf_row = 2 * i + j, hf_row = j * half + i;
        int64_t dst = to_hf ? hf_row : gguf_row, src = to_hf ? gguf_row : hf_row;
        std::memcpy(base + dst * cols, head.data() + src * cols, size_t(cols) * sizeof(float));
      }
    }
  }
}

}  // namespace

void unpermute_rope_rows(float* w, int64_t n_heads, int64_t head_dim, int64_t cols) {
  move_rows(w, n_heads, head_dim, cols, true);
}

void permute_rope_rows(float* w, int64_t n_heads, int64_t head_dim, int64_t cols) {
  move_rows(w, n_heads, head_dim, cols, false);
}

}  // namespace spade

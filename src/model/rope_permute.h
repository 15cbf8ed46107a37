// llama.cpp's converter stores q/k projection rows of "llama" models in the order that
// suits interleaved-pair RoPE: within each head, rows (j, i) of a (2, D/2) grid are moved
// to (i, j). spade uses Hugging Face's rotate-halves RoPE, so the GGUF rows are moved back.
#pragma once
#include <cstdint>

namespace spade {

// In place on a row-major [n_heads * head_dim, cols] matrix: row h*D + 2i + j goes back to
// row h*D + j*(D/2) + i (the inverse of convert_hf_to_gguf's permute()).
void unpermute_rope_rows(float* w, int64_t n_heads, int64_t head_dim, int64_t cols);

// The forward direction (what the converter does); for tests and writers.
void permute_rope_rows(float* w, int64_t n_heads, int64_t head_dim, int64_t cols);

}  // namespace spade

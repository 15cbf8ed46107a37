#include "kv/kv_pool.h"

#include <algorithm>
#include <cstring>

namespace spade {

KVPool::KVPool(const KVLayout& layout, int64_t n_pages) : layout_(layout), n_pages_(n_pages) {
  SPADE_CHECK(layout.n_layers > 0 && layout.n_kv_heads > 0 && layout.head_dim > 0 &&
                  layout.page_size > 0 && n_pages > 0,
              "KV pool: invalid layout (layers ", layout.n_layers, ", kv heads ",
              layout.n_kv_heads, ", head dim ", layout.head_dim, ", page size ",
              layout.page_size, ", pages ", n_pages, ")");
  size_t floats = size_t(layout.n_layers) * size_t(n_pages) * size_t(layout.page_floats());
  k_.assign(floats, 0.f);
  v_.assign(floats, 0.f);
  free_.resize(size_t(n_pages));
  // Free list used as a stack: lowest ids are handed out first.
  for (int64_t i = 0; i < n_pages; ++i) free_[size_t(i)] = int32_t(n_pages - 1 - i);
}

void KVPool::reserve(PageTable& pt, int64_t new_length) {
  int64_t need = (new_length + layout_.page_size - 1) / layout_.page_size - int64_t(pt.pages.size());
  if (need <= 0) return;
  SPADE_CHECK(need <= free_pages(), "KV cache full: need ", need, " more pages of ",
              layout_.page_size, " tokens for a sequence of ", new_length, " tokens, ",
              free_pages(), " of ", n_pages_, " pages free (raise --kv-pages)");
  for (int64_t i = 0; i < need; ++i) {
    pt.pages.push_back(free_.back());
    free_.pop_back();
  }
}

void KVPool::release(PageTable& pt) {
  for (int32_t p : pt.pages) free_.push_back(p);
  pt.pages.clear();
  pt.length = 0;
}

void KVPool::write(int layer, const PageTable& pt, int64_t pos, const float* k, const float* v) {
  const int D = layout_.head_dim;
  float* kp = k_page(layer, pt.pages[size_t(pos / layout_.page_size)]);
  float* vp = v_page(layer, pt.pages[size_t(pos / layout_.page_size)]);
  for (int h = 0; h < layout_.n_kv_heads; ++h) {
    std::memcpy(kp + row_offset(pos, h), k + int64_t(h) * D, sizeof(float) * size_t(D));
    std::memcpy(vp + row_offset(pos, h), v + int64_t(h) * D, sizeof(float) * size_t(D));
  }
}

}  // namespace spade

// Paged KV cache. One pool holds every layer's K and V for `n_pages` pages; a page id
// names the same `page_size` token slots in every layer. Inside a page the layout is HND:
//   k[layer][page][kv_head][slot][D]   (same for v), fp32 on the CPU backend.
// A sequence owns a PageTable (list of page ids + length). Pages are taken from and
// returned to a free list; nothing is allocated after construction.
//
// Per-page metadata (Quest, docs/sparse.md): when `layout.page_minmax` is on, the pool keeps
// for every (layer, page, kv_head) the element-wise min and max of the page's keys,
//   kmin[layer][page][kv_head][D], kmax[...]   (fp32),
// updated by write() (one min/max per element per appended row, never recomputed per step)
// and reset when the page is handed out by reserve().
//
// Pages are reference counted so a prefilled prefix can be shared: fork() gives a new
// PageTable that shares every full page of its source and owns a copy of a partially
// filled last page. A shared page is read-only: write() into a page with more than one
// owner is an error. release() drops one reference; a page returns to the free list when
// its last owner releases it.
#pragma once
#include <cstdint>
#include <vector>

#include "core/error.h"

namespace spade {

struct KVLayout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int page_size = 16;
  bool page_minmax = true;  // keep per-page key min/max (Quest metadata)
  // Floats of one page of one layer (K or V): Hkv * page_size * D.
  int64_t page_floats() const { return int64_t(n_kv_heads) * page_size * head_dim; }
};

struct PageTable {
  std::vector<int32_t> pages;  // page ids in token order
  int64_t length = 0;          // tokens written
  int64_t capacity(int page_size) const { return int64_t(pages.size()) * page_size; }
};

class KVPool {
 public:
  KVPool(const KVLayout& layout, int64_t n_pages);

  const KVLayout& layout() const { return layout_; }
  int64_t n_pages() const { return n_pages_; }
  int64_t free_pages() const { return int64_t(free_.size()); }
  int64_t used_pages() const { return n_pages_ - free_pages(); }
  size_t bytes() const { return (k_.size() * 2 + kmin_.size() * 2) * sizeof(float); }

  // Grows `pt` so it can hold `new_length` tokens; throws spade::Error (nothing changed)
  // when the pool has too few free pages.
  void reserve(PageTable& pt, int64_t new_length);
  // Drops `pt`'s reference to each of its pages (a page is freed with its last reference)
  // and empties it.
  void release(PageTable& pt);
  // A new table with the same length and contents as `src`: full pages are shared, a
  // partially filled last page is copied (K, V and metadata, every layer) so that the fork
  // can append. Throws when no page is free for that copy.
  PageTable fork(const PageTable& src);
  int32_t refcount(int32_t page) const { return refs_[size_t(page)]; }

  float* k_page(int layer, int32_t page) { return k_.data() + offset(layer, page); }
  float* v_page(int layer, int32_t page) { return v_.data() + offset(layer, page); }
  const float* k_page(int layer, int32_t page) const { return k_.data() + offset(layer, page); }
  const float* v_page(int layer, int32_t page) const { return v_.data() + offset(layer, page); }

  // Row of token `pos` of `pt` for one KV head (D floats).
  const float* k_row(int layer, const PageTable& pt, int64_t pos, int head) const {
    return k_page(layer, pt.pages[pos / layout_.page_size]) + row_offset(pos, head);
  }
  const float* v_row(int layer, const PageTable& pt, int64_t pos, int head) const {
    return v_page(layer, pt.pages[pos / layout_.page_size]) + row_offset(pos, head);
  }

  // Element-wise min / max (D floats) of the keys written so far into `page` for one KV
  // head. Only with layout().page_minmax. An empty page has min = +inf, max = -inf.
  const float* page_kmin(int layer, int32_t page, int head) const {
    return kmin_.data() + meta_offset(layer, page, head);
  }
  const float* page_kmax(int layer, int32_t page, int head) const {
    return kmax_.data() + meta_offset(layer, page, head);
  }

  // Writes K and V of token `pos` (all KV heads: [Hkv, D] each) into the cache and updates
  // the page's key min/max.
  void write(int layer, const PageTable& pt, int64_t pos, const float* k, const float* v);

 private:
  int64_t offset(int layer, int32_t page) const {
    return (int64_t(layer) * n_pages_ + page) * layout_.page_floats();
  }
  int64_t row_offset(int64_t pos, int head) const {
    return (int64_t(head) * layout_.page_size + pos % layout_.page_size) * layout_.head_dim;
  }
  int64_t meta_offset(int layer, int32_t page, int head) const {
    return ((int64_t(layer) * n_pages_ + page) * layout_.n_kv_heads + head) * layout_.head_dim;
  }
  void reset_meta(int32_t page);
  int32_t take_page();

  KVLayout layout_;
  int64_t n_pages_;
  std::vector<float> k_, v_;
  std::vector<float> kmin_, kmax_;
  std::vector<int32_t> free_;
  std::vector<int32_t> refs_;
};

}  // namespace spade

// Paged KV cache. One pool holds every layer's K and V for `n_pages` pages; a page id
// names the same `page_size` token slots in every layer. Inside a page the layout is HND:
//   k[layer][page][kv_head][slot][D]   (same for v), elements of layout.dtype (f32, bf16, f16,
// fp8: kv/kv_dtype.h; rounded to nearest even by write(), widened to fp32 by the readers).
//
// FP8 scales (--kv-dtype fp8, issue 40; docs/cli.md "KV cache type"): one per (layer, KV head)
// for K and one for V, powers of two, kept here: code = e4m3(x / scale), value read = e4m3
// value * scale (kv/fp8_e4m3.h), exactly, in every reader. layout.kv_scale > 0 fixes every
// scale; 0 (auto) leaves a layer's scales unset until calibrate_scales() sees its first rows
// (CpuModel passes each layer every row of its first forward step: the first prefill), each
// from that head's largest |K| or |V| (fp8_e4m3_scale_for_amax: 2x headroom); later values
// beyond 448 scale saturate. write() into a layer still unset calibrates from that one row.
// Keys of an fp8 cache are stored rotated (kv/key_rotation.h, keys_rotated()); scales are
// those of the rotated rows.
// Scales stay for the life of the pool (reset_scales() forgets them while it is empty).
// A sequence owns a PageTable (list of page ids + length). Pages are taken from and
// returned to a free list; nothing is allocated after construction.
//
// Per-page metadata (Quest, docs/sparse.md): when `layout.page_minmax` is on, the pool keeps
// for every (layer, page, kv_head) the element-wise min and max of the page's keys,
//   kmin[layer][page][kv_head][D], kmax[...]   (fp32, of the keys as stored: exact bounds of
// what attention reads), updated by write() (one min/max per element per appended row, never
// recomputed per step)
// and reset when the page is handed out by reserve().
//
// Pages are reference counted so a prefilled prefix can be shared: fork() gives a new
// PageTable that shares every full page of its source and owns a copy of a partially
// filled last page. A shared page is read-only: write() into a page with more than one
// owner is an error. release() drops one reference; a page returns to the free list when
// its last owner releases it.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "core/error.h"
#include "kv/kv_dtype.h"

namespace spade {

struct KVLayout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int page_size = 16;
  bool page_minmax = true;  // keep per-page key min/max (Quest metadata)
  KvDtype dtype = KvDtype::F32;  // element type (front ends default to bf16: --kv-dtype)
  // fp8 only (--kv-scale): 0 = auto (from the first prefill), > 0 = every scale (a power of two
  // in [2^-40, 2^40]: parse_kv_scale rounds up to one).
  float kv_scale = 0.f;
  // Elements of one page of one layer (K or V): Hkv * page_size * D.
  int64_t page_floats() const { return int64_t(n_kv_heads) * page_size * head_dim; }
  int64_t page_elems() const { return page_floats(); }
  size_t elem_bytes() const { return kv_dtype_bytes(dtype); }
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
  KvDtype dtype() const { return layout_.dtype; }
  size_t bytes() const { return data_bytes_ * 2 + kmin_.size() * 2 * sizeof(float); }

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

  // Raw pages and rows, elements of dtype(): HND within a page, so the rows of one KV head in
  // a page are contiguous (page_size * D elements).
  const void* k_page_data(int layer, int32_t page) const { return k_ + offset(layer, page) * esize_; }
  const void* v_page_data(int layer, int32_t page) const { return v_ + offset(layer, page) * esize_; }
  const void* k_row_data(int layer, const PageTable& pt, int64_t pos, int head) const {
    return k_ + (offset(layer, pt.pages[size_t(pos / layout_.page_size)]) + row_offset(pos, head)) * esize_;
  }
  const void* v_row_data(int layer, const PageTable& pt, int64_t pos, int head) const {
    return v_ + (offset(layer, pt.pages[size_t(pos / layout_.page_size)]) + row_offset(pos, head)) * esize_;
  }
  // Rows [pos, pos + n) of one KV head as fp32 into dst[n, D]; the rows may cross pages.
  void load_k(int layer, const PageTable& pt, int64_t pos, int head, int64_t n, float* dst) const {
    load(true, layer, pt, pos, head, n, dst);
  }
  void load_v(int layer, const PageTable& pt, int64_t pos, int head, int64_t n, float* dst) const {
    load(false, layer, pt, pos, head, n, dst);
  }

  // fp32 views: only for a pool of dtype f32 (throws otherwise); tests and fp32-only tools.
  float* k_page(int layer, int32_t page) { return f32() + offset(layer, page); }
  float* v_page(int layer, int32_t page) { return f32v() + offset(layer, page); }
  const float* k_page(int layer, int32_t page) const {
    return const_cast<KVPool*>(this)->k_page(layer, page);
  }
  const float* v_page(int layer, int32_t page) const {
    return const_cast<KVPool*>(this)->v_page(layer, page);
  }
  // Row of token `pos` of `pt` for one KV head (D floats).
  const float* k_row(int layer, const PageTable& pt, int64_t pos, int head) const {
    return k_page(layer, pt.pages[size_t(pos / layout_.page_size)]) + row_offset(pos, head);
  }
  const float* v_row(int layer, const PageTable& pt, int64_t pos, int head) const {
    return v_page(layer, pt.pages[size_t(pos / layout_.page_size)]) + row_offset(pos, head);
  }

  // Element-wise min / max (D floats) of the keys written so far into `page` for one KV
  // head. Only with layout().page_minmax. An empty page has min = +inf, max = -inf. With
  // keys_rotated(): of the stored rows turned back to the model's basis (R applied once more,
  // R R = I up to rounding), where a box bounds keys tightly (a rotation spreads every key over
  // all channels and would make the box loose); the query meeting them is un-rotated alike.
  // q'.k' = q.(R k') makes Quest's bound hold, to fp32 rounding, for what attention reads.
  const float* page_kmin(int layer, int32_t page, int head) const {
    return kmin_.data() + meta_offset(layer, page, head);
  }
  const float* page_kmax(int layer, int32_t page, int head) const {
    return kmax_.data() + meta_offset(layer, page, head);
  }

  // fp8 caches of a power-of-two head dim store each key row rotated (kv/key_rotation.h): what
  // load_k / k_row_data give is R k, and a query must be rotated alike (rotate_key_rows; the
  // CPU model does) before it meets them. write() and calibrate_scales() take keys unrotated;
  // the page bounds stay in the model's basis (page_kmin).
  bool keys_rotated() const { return rotates_keys_; }

  // Writes K and V of token `pos` (all KV heads: [Hkv, D] each, fp32) into the cache, rounded
  // to dtype(), and updates the page's key min/max from the stored keys.
  void write(int layer, const PageTable& pt, int64_t pos, const float* k, const float* v);

  // FP8 scales of (layer, KV head): value read = stored e4m3 value * scale. 1 for the other
  // types, and 0 for an fp8 layer whose auto scales are not set yet.
  float k_scale(int layer, int head) const { return kscale_[size_t(layer) * size_t(layout_.n_kv_heads) + size_t(head)]; }
  float v_scale(int layer, int head) const { return vscale_[size_t(layer) * size_t(layout_.n_kv_heads) + size_t(head)]; }
  // Every scale, [n_layers][Hkv] (what a device copy of the cache needs).
  const std::vector<float>& k_scales() const { return kscale_; }
  const std::vector<float>& v_scales() const { return vscale_; }
  bool scales_set(int layer) const { return scale_set_[size_t(layer)] != 0; }
  // Sets one layer's fp8 scales ([Hkv] each; powers of two in [2^-40, 2^40]). Only on an fp8
  // pool, before that layer holds data written with other scales (the caller's concern).
  void set_scales(int layer, const float* k_scales, const float* v_scales);
  // Auto scales: when `layer`'s are unset, sets them from `rows` rows of K and V ([rows, Hkv, D]
  // each, fp32, as write() takes them): per head, fp8_e4m3_scale_for_amax of the largest
  // finite |value|. Does nothing once set, for a fixed --kv-scale, or for other types.
  void calibrate_scales(int layer, const float* k, const float* v, int64_t rows);
  // Forgets auto scales (each layer calibrates again from its next rows); only while no page
  // is in use. Fixed scales and other types: nothing changes.
  void reset_scales();

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
  void load(bool keys, int layer, const PageTable& pt, int64_t pos, int head, int64_t n,
            float* dst) const;
  float* f32() {
    SPADE_CHECK(layout_.dtype == KvDtype::F32, "KV pool: fp32 view of a ",
                kv_dtype_name(layout_.dtype), " cache");
    return reinterpret_cast<float*>(k_);
  }
  float* f32v() {
    f32();
    return reinterpret_cast<float*>(v_);
  }
  struct FreeDeleter {
    void operator()(unsigned char* p) const { std::free(p); }
  };

  KVLayout layout_;
  int64_t n_pages_;
  size_t esize_ = 4;       // bytes per element
  size_t data_bytes_ = 0;  // bytes of K (as many of V)
  // calloc'd: pages never written are never touched (they cost no resident memory).
  std::unique_ptr<unsigned char[], FreeDeleter> kbuf_, vbuf_;
  unsigned char* k_ = nullptr;
  unsigned char* v_ = nullptr;
  std::vector<float> kmin_, kmax_;
  std::vector<float> kscale_, vscale_;   // [n_layers][Hkv]
  std::vector<uint8_t> scale_set_;       // [n_layers]
  bool rotates_keys_ = false;            // kv_rotates_keys(dtype, head_dim)
  std::vector<int32_t> free_;
  std::vector<int32_t> refs_;
};

}  // namespace spade

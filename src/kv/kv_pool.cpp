#include "kv/kv_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <new>

#include "kv/fp8_e4m3.h"
#include "kv/key_rotation.h"

namespace spade {

namespace {
void advise_huge(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t huge = uintptr_t(2) << 20;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(huge - 1);
  if (e > b) (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}
}  // namespace

KVPool::KVPool(const KVLayout& layout, int64_t n_pages) : layout_(layout), n_pages_(n_pages) {
  SPADE_CHECK(layout.n_layers > 0 && layout.n_kv_heads > 0 && layout.head_dim > 0 &&
                  layout.page_size > 0 && n_pages > 0,
              "KV pool: invalid layout (layers ", layout.n_layers, ", kv heads ",
              layout.n_kv_heads, ", head dim ", layout.head_dim, ", page size ",
              layout.page_size, ", pages ", n_pages, ")");
  SPADE_CHECK(n_pages <= INT32_MAX, "KV pool: ", n_pages, " pages; page ids are 32-bit (at most ",
              INT32_MAX, ")");
  // Bytes first, in floating point (no overflow), against the machine's memory: a pool that
  // cannot fit gets an error saying so instead of std::bad_alloc or an OOM kill.
  const double floats_d = double(layout.n_layers) * double(n_pages) * double(layout.page_floats());
  const double meta_d = layout.page_minmax ? floats_d / double(layout.page_size) : 0.0;
  const double esize = double(kv_dtype_bytes(layout.dtype));
  const double bytes = 2.0 * floats_d * esize + 2.0 * meta_d * sizeof(float) + double(n_pages) * 8.0;
  const double phys = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  const double gib = 1024.0 * 1024.0 * 1024.0;
  SPADE_CHECK(phys <= 0 || bytes <= phys,
              "KV cache of ", n_pages, " pages x ", layout.page_size, " tokens needs ", bytes / gib,
              " GiB (K and V in ", kv_dtype_name(layout.dtype), ", ", layout.n_layers, " layers x ", layout.n_kv_heads,
              " KV heads x ", layout.head_dim, "), more than this machine's ", phys / gib,
              " GiB of memory; lower --kv-pages (or --max-batch)");
  try {
    esize_ = kv_dtype_bytes(layout.dtype);
    data_bytes_ = size_t(floats_d) * esize_;
    // calloc: zeroed pages from the kernel, resident only once written.
    kbuf_.reset(static_cast<unsigned char*>(std::calloc(data_bytes_, 1)));
    vbuf_.reset(static_cast<unsigned char*>(std::calloc(data_bytes_, 1)));
    if (!kbuf_ || !vbuf_) throw std::bad_alloc();
    k_ = kbuf_.get();
    v_ = vbuf_.get();
    // Transparent huge pages where the kernel offers them on request: a decode step walks the
    // whole cache, and 4 KB pages cost a TLB miss every 4 KB.
    advise_huge(k_, data_bytes_);
    advise_huge(v_, data_bytes_);
    if (layout.page_minmax) {
      kmin_.assign(size_t(meta_d), INFINITY);
      kmax_.assign(size_t(meta_d), -INFINITY);
    }
  } catch (const std::bad_alloc&) {
    fail("KV cache of ", n_pages, " pages needs ", bytes / gib,
         " GiB and that much memory could not be allocated; lower --kv-pages (or --max-batch)");
  }
  {
    const size_t ns = size_t(layout.n_layers) * size_t(layout.n_kv_heads);
    const bool fp8 = layout.dtype == KvDtype::FP8;
    SPADE_CHECK(!fp8 || layout.kv_scale == 0.f ||
                    (layout.kv_scale >= kFp8ScaleMin && layout.kv_scale <= kFp8ScaleMax &&
                     fp8_pow2_ceil(layout.kv_scale) == layout.kv_scale),
                "KV pool: fp8 scale ", layout.kv_scale,
                " is not a power of two in [2^-40, 2^40] (parse_kv_scale rounds up to one)");
    const bool fixed = !fp8 || layout.kv_scale > 0.f;
    const float s0 = !fp8 ? 1.f : layout.kv_scale;
    kscale_.assign(ns, s0);
    vscale_.assign(ns, s0);
    scale_set_.assign(size_t(layout.n_layers), fixed ? 1 : 0);
    rotates_keys_ = kv_rotates_keys(layout.dtype, layout.head_dim);
  }
  refs_.assign(size_t(n_pages), 0);
  free_.resize(size_t(n_pages));
  // Free list used as a stack: lowest ids are handed out first.
  for (int64_t i = 0; i < n_pages; ++i) free_[size_t(i)] = int32_t(n_pages - 1 - i);
}

void KVPool::set_scales(int layer, const float* ks, const float* vs) {
  SPADE_CHECK(layout_.dtype == KvDtype::FP8, "KV pool: scales of a ", kv_dtype_name(layout_.dtype),
              " cache (only fp8 has them)");
  SPADE_CHECK(layer >= 0 && layer < layout_.n_layers, "KV pool: layer ", layer, " out of range");
  const size_t H = size_t(layout_.n_kv_heads);
  for (size_t h = 0; h < H; ++h)
    for (float s : {ks[h], vs[h]})
      SPADE_CHECK(s >= kFp8ScaleMin && s <= kFp8ScaleMax && fp8_pow2_ceil(s) == s,
                  "KV pool: fp8 scale ", s, " (layer ", layer, ", head ", h,
                  ") is not a power of two in [2^-40, 2^40]");
  std::copy(ks, ks + H, kscale_.begin() + long(size_t(layer) * H));
  std::copy(vs, vs + H, vscale_.begin() + long(size_t(layer) * H));
  scale_set_[size_t(layer)] = 1;
}

void KVPool::calibrate_scales(int layer, const float* k, const float* v, int64_t rows) {
  if (layout_.dtype != KvDtype::FP8 || scales_set(layer)) return;
  const int H = layout_.n_kv_heads, D = layout_.head_dim;
  std::vector<float> ks(static_cast<size_t>(H)), vs(static_cast<size_t>(H));
  const bool rot = keys_rotated();
  std::vector<float> krot(rot ? size_t(D) : 0);
  for (int h = 0; h < H; ++h) {
    float ka = 0.f, va = 0.f;
    for (int64_t r = 0; r < rows; ++r) {
      const float* kr = k + (r * H + h) * int64_t(D);
      const float* vr = v + (r * H + h) * int64_t(D);
      if (rot) {  // the keys as they will be stored (key_rotation.h)
        std::copy(kr, kr + D, krot.begin());
        rotate_key_row(krot.data(), D);
        kr = krot.data();
      }
      for (int d = 0; d < D; ++d) {
        // Largest finite magnitude (NaN and inf are left out: they saturate or stay NaN).
        const float a = std::fabs(kr[d]), b = std::fabs(vr[d]);
        if (a > ka && std::isfinite(a)) ka = a;
        if (b > va && std::isfinite(b)) va = b;
      }
    }
    ks[size_t(h)] = fp8_e4m3_scale_for_amax(ka);
    vs[size_t(h)] = fp8_e4m3_scale_for_amax(va);
  }
  set_scales(layer, ks.data(), vs.data());
}

void KVPool::reset_scales() {
  if (layout_.dtype != KvDtype::FP8 || layout_.kv_scale > 0.f) return;
  SPADE_CHECK(used_pages() == 0, "KV pool: reset_scales with ", used_pages(), " pages in use");
  std::fill(kscale_.begin(), kscale_.end(), 0.f);
  std::fill(vscale_.begin(), vscale_.end(), 0.f);
  std::fill(scale_set_.begin(), scale_set_.end(), uint8_t(0));
}

void KVPool::reset_meta(int32_t page) {
  if (!layout_.page_minmax) return;
  const size_t n = size_t(layout_.n_kv_heads) * size_t(layout_.head_dim);
  for (int l = 0; l < layout_.n_layers; ++l) {
    std::fill_n(kmin_.begin() + meta_offset(l, page, 0), n, INFINITY);
    std::fill_n(kmax_.begin() + meta_offset(l, page, 0), n, -INFINITY);
  }
}

int32_t KVPool::take_page() {
  int32_t p = free_.back();
  free_.pop_back();
  refs_[size_t(p)] = 1;
  reset_meta(p);
  return p;
}

void KVPool::reserve(PageTable& pt, int64_t new_length) {
  int64_t need = (new_length + layout_.page_size - 1) / layout_.page_size - int64_t(pt.pages.size());
  if (need <= 0) return;
  SPADE_CHECK(need <= free_pages(), "KV cache full: need ", need, " more pages of ",
              layout_.page_size, " tokens for a sequence of ", new_length, " tokens, ",
              free_pages(), " of ", n_pages_, " pages free (raise --kv-pages)");
  for (int64_t i = 0; i < need; ++i) pt.pages.push_back(take_page());
}

void KVPool::release(PageTable& pt) {
  for (int32_t p : pt.pages) {
    SPADE_CHECK(refs_[size_t(p)] > 0, "KV pool: page ", p, " released twice");
    if (--refs_[size_t(p)] == 0) free_.push_back(p);
  }
  pt.pages.clear();
  pt.length = 0;
}

PageTable KVPool::fork(const PageTable& src) {
  const int64_t P = layout_.page_size;
  PageTable out;
  out.length = src.length;
  const int64_t used = (src.length + P - 1) / P;  // pages holding tokens
  const bool partial = src.length % P != 0;
  SPADE_CHECK(!partial || free_pages() > 0, "KV cache full: no free page to fork a sequence of ",
              src.length, " tokens (raise --kv-pages)");
  out.pages.reserve(size_t(used));
  for (int64_t i = 0; i < used; ++i) {
    int32_t p = src.pages[size_t(i)];
    if (partial && i == used - 1) {
      int32_t q = take_page();
      const size_t n = size_t(layout_.page_floats()) * esize_;
      for (int l = 0; l < layout_.n_layers; ++l) {
        std::memcpy(k_ + offset(l, q) * esize_, k_ + offset(l, p) * esize_, n);
        std::memcpy(v_ + offset(l, q) * esize_, v_ + offset(l, p) * esize_, n);
        if (layout_.page_minmax) {
          const size_t m = size_t(layout_.n_kv_heads) * size_t(layout_.head_dim);
          std::memcpy(kmin_.data() + meta_offset(l, q, 0), kmin_.data() + meta_offset(l, p, 0),
                      m * sizeof(float));
          std::memcpy(kmax_.data() + meta_offset(l, q, 0), kmax_.data() + meta_offset(l, p, 0),
                      m * sizeof(float));
        }
      }
      out.pages.push_back(q);
    } else {
      ++refs_[size_t(p)];
      out.pages.push_back(p);
    }
  }
  return out;
}

void KVPool::write(int layer, const PageTable& pt, int64_t pos, const float* k, const float* v) {
  const int D = layout_.head_dim;
  const int32_t page = pt.pages[size_t(pos / layout_.page_size)];
  SPADE_CHECK(refs_[size_t(page)] == 1, "KV pool: write into page ", page, " shared by ",
              refs_[size_t(page)], " sequences (a forked prefix is read-only)");
  if (!scales_set(layer)) calibrate_scales(layer, k, v, 1);
  unsigned char* kp = k_ + offset(layer, page) * esize_;
  unsigned char* vp = v_ + offset(layer, page) * esize_;
  float stored[512], rotated[512];
  const bool rot = keys_rotated();
  for (int h = 0; h < layout_.n_kv_heads; ++h) {
    const float* kh = k + int64_t(h) * D;
    if (rot) {  // fp8: the key rotated (key_rotation.h; D <= 512)
      std::copy(kh, kh + D, rotated);
      rotate_key_row(rotated, D);
      kh = rotated;
    }
    void* kd = kp + row_offset(pos, h) * esize_;
    const float ksc = k_scale(layer, h);
    kv_from_f32(layout_.dtype, kh, D, kd, ksc);
    kv_from_f32(layout_.dtype, v + int64_t(h) * D, D, vp + row_offset(pos, h) * esize_,
                v_scale(layer, h));
    if (layout_.page_minmax) {
      // The bounds of the keys as stored (rounded), so Quest's bound holds for what is read.
      float* mn = kmin_.data() + meta_offset(layer, page, h);
      float* mx = kmax_.data() + meta_offset(layer, page, h);
      for (int d0 = 0; d0 < D; d0 += 512) {
        const int n = std::min(512, D - d0);
        const float* ks = kh + d0;
        if (layout_.dtype != KvDtype::F32) {
          kv_to_f32(layout_.dtype, static_cast<unsigned char*>(kd) + size_t(d0) * esize_, n, stored, ksc);
          // Rotated keys (D <= 512: one chunk): the bounds are in the model's basis, the stored
          // row turned back (R R = I), so Quest's box keeps its meaning (kv_pool.h).
          if (rot) rotate_key_row(stored, D);
          ks = stored;
        }
        for (int d = 0; d < n; ++d) {
          mn[d0 + d] = std::min(mn[d0 + d], ks[d]);
          mx[d0 + d] = std::max(mx[d0 + d], ks[d]);
        }
      }
    }
  }
}

void KVPool::load(bool keys, int layer, const PageTable& pt, int64_t pos, int head, int64_t n,
                  float* dst) const {
  const int64_t P = layout_.page_size, D = layout_.head_dim;
  const unsigned char* base = keys ? k_ : v_;
  const float sc = keys ? k_scale(layer, head) : v_scale(layer, head);
  while (n > 0) {
    // Within a page and head, slots are contiguous: convert the run at once.
    const int64_t run = std::min(n, P - pos % P);
    const int32_t page = pt.pages[size_t(pos / P)];
    kv_to_f32(layout_.dtype, base + (offset(layer, page) + row_offset(pos, head)) * esize_,
              run * D, dst, sc);
    dst += run * D;
    pos += run;
    n -= run;
  }
}

}  // namespace spade

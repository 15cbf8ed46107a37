// CPU decode attention: one query token over a selection's rows, read in place from the paged
// cache (the chunk driver, its scalar kernel, the fp8 widening and the merge of the chunks).
#include "backend/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/attention_internal.h"
#include "backend/cpu/qgemv.h"
#include "core/thread_pool.h"

namespace spade::cpu {

using namespace attn;

namespace {

// One chunk of rows of one KV head: rows' K and V pointers (elements of the cache's dtype), the
// G queries of the head.
struct DecodeChunk {
  const void* const* k;  // [pf_len] row pointers: the chunk's len rows, then rows to prefetch
  const void* const* v;
  int64_t len;
  int64_t pf_len;
  const float* q;  // [G, D]
  int G;
  int64_t D;
  float scale;
  float* s;     // scratch [G, len]
  float* part;  // out: [G, D + 2]: unnormalized sum of p v, then max score, then sum of p
  float* logits;  // optional: scaled scores, row g at logits + g * ld
  int64_t ld;
};

// Softmax pieces of one score row: max, exp in place, sum (double, as attend_gathered).
inline void chunk_softmax(float* s, int64_t len, float* mx_out, float* sum_out) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < len; ++i) mx = std::max(mx, s[i]);
  double sum = 0;
  for (int64_t i = 0; i < len; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  *mx_out = mx;
  *sum_out = float(sum);
}

// Scalar reference: each row widened to fp32 (exactly) before the same arithmetic.
void chunk_scalar(const DecodeChunk& c, KvDtype dt) {
  const int64_t D = c.D, len = c.len;
  thread_local std::vector<float> kv_row;
  if (kv_row.size() < size_t(D)) kv_row.resize(size_t(D));
  float* k = kv_row.data();
  for (int64_t i = 0; i < len; ++i) {
    kv_to_f32(dt, c.k[i], D, k);
    for (int g = 0; g < c.G; ++g) {
      const float* q = c.q + g * D;
      float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      int64_t d = 0;
      for (; d + 4 <= D; d += 4) {
        a0 += q[d] * k[d];
        a1 += q[d + 1] * k[d + 1];
        a2 += q[d + 2] * k[d + 2];
        a3 += q[d + 3] * k[d + 3];
      }
      for (; d < D; ++d) a0 += q[d] * k[d];
      c.s[g * len + i] = ((a0 + a1) + (a2 + a3)) * c.scale;
    }
  }
  for (int g = 0; g < c.G; ++g) {
    float* s = c.s + g * len;
    if (c.logits) std::memcpy(c.logits + g * c.ld, s, sizeof(float) * size_t(len));
    float* part = c.part + g * (D + 2);
    chunk_softmax(s, len, part + D, part + D + 1);
    std::fill(part, part + D, 0.f);
    float* v = kv_row.data();
    for (int64_t i = 0; i < len; ++i) {
      const float p = s[i];
      kv_to_f32(dt, c.v[i], D, v);
      for (int64_t d = 0; d < D; ++d) part[d] += p * v[d];
    }
  }
}

// fp8 cache: the n rows at kp / vp (KV head h of `layer`) widened into fp32 rows k / v
// ([n, D] each), times the head's K / V scales, and the pointers moved to them.
// Rows that lie one after another in the cache (a head's rows within a page, K and V alike:
// same offsets) convert as one run.
void widen_fp8_rows(const KVPool& kv, int layer, int h, const void** kp, const void** vp,
                    int64_t n, int64_t D, float* k, float* v) {
  const float ks = kv.k_scale(layer, h), vs = kv.v_scale(layer, h);
  int64_t i = 0;
  while (i < n) {
    const unsigned char* k0 = static_cast<const unsigned char*>(kp[i]);
    const unsigned char* v0 = static_cast<const unsigned char*>(vp[i]);
    int64_t run = 1;
    while (i + run < n && kp[i + run] == k0 + run * D && vp[i + run] == v0 + run * D) ++run;
    kv_to_f32(KvDtype::FP8, k0, run * D, k + i * D, ks);
    kv_to_f32(KvDtype::FP8, v0, run * D, v + i * D, vs);
    for (int64_t j = i; j < i + run; ++j) {
      kp[j] = k + j * D;
      vp[j] = v + j * D;
    }
    i += run;
  }
}

}  // namespace

void decode_attention(const KVPool& kv, int layer, const PageTable& pt, const float* q, int Hq,
                      float scale, const sparse::Selection& sel, float* out,
                      AttentionScratch& sc, float* logits) {
  const int Hkv = kv.layout().n_kv_heads;
  const int64_t D = kv.layout().head_dim, P = kv.layout().page_size;
  const int G = Hq / Hkv;
  const int64_t L = sel.length;
  SPADE_CHECK(sel.n_kv_heads == Hkv && L <= pt.capacity(int(P)),
              "attention_selected: selection for ", sel.n_kv_heads, " heads / ", L,
              " tokens, cache has ", Hkv, " heads / room for ", pt.capacity(int(P)), " tokens");
  SPADE_CHECK(!logits || sel.uniform(), "attention_selected: logits need a uniform selection");
  // Work items: (head, chunk) pairs, head-major; item_base[h] is head h's first.
  int64_t item_base[65];
  SPADE_CHECK(Hkv <= 64, "decode_attention: more than 64 KV heads");
  int64_t items = 0;
  for (int h = 0; h < Hkv; ++h) {
    const int64_t n = sel.count(h);
    SPADE_CHECK(n > 0, "attention_selected: KV head ", h, " of layer ", layer,
                " selects no token");
    item_base[h] = items;
    items += (n + kDecodeChunk - 1) / kDecodeChunk;
  }
  item_base[Hkv] = items;
  const int64_t part_stride = int64_t(G) * (D + 2);
  float* parts = AttentionScratch::ensure(sc.part, size_t(items * part_stride));
#if SPADE_ATT_X86
  const bool avx2 = D % 8 == 0 && simd_level() != SimdLevel::Scalar;
#endif
  const int64_t ld = logits ? sel.count(0) : 0;
  // fp8: each chunk's rows are widened (times their head's scales) into fp32 rows first and the
  // kernels run as on an f32 cache (widen_fp8_rows): the values an f32 cache of the dequantized
  // cache would hold, through the same arithmetic.
  const bool fp8 = kv.dtype() == KvDtype::FP8;
  const KvDtype dt = fp8 ? KvDtype::F32 : kv.dtype();
  const size_t esize = kv.layout().elem_bytes();
#if SPADE_ATT_X86
  const bool avx512_64 = D == 64 && simd_level() == SimdLevel::Avx512;
  auto run_chunk = [&](const HeadsChunk& c) {
    if (avx512_64)
      run_chunk64_avx512(c, dt);
    else
      run_chunk_avx2(c, dt);
  };
#endif
  auto run = [&](int64_t it0, int64_t it1) {
    thread_local std::vector<const void*> ptrs;
    thread_local std::vector<float> scores, wide;
    constexpr int64_t kRows = kDecodeChunk + kDecodePrefetch;
    if (ptrs.size() < size_t(2 * kRows)) ptrs.resize(size_t(2 * kRows));
    if (scores.size() < size_t(G * kDecodeChunk)) scores.resize(size_t(G * kDecodeChunk));
    if (fp8 && wide.size() < size_t(2 * kDecodeChunk * D)) wide.resize(size_t(2 * kDecodeChunk * D));
    int h = 0;
    for (int64_t it = it0; it < it1; ++it) {
      while (item_base[h + 1] <= it) ++h;
      const int64_t n = sel.count(h), r0 = (it - item_base[h]) * kDecodeChunk;
      const int64_t len = std::min(kDecodeChunk, n - r0);
      // The chunk's rows, then the next rows of the head, which the kernel only prefetches.
      int64_t pf_len = std::min(kRows, n - r0);
      const void** kp = ptrs.data();
      const void** vp = ptrs.data() + kRows;
      const int64_t head_off = int64_t(h) * P * D;
      if (sel.dense()) {
        // Consecutive positions: walk pages and slots without a division per row.
        int64_t page = r0 / P, slot = r0 % P;
        for (int64_t i = 0; i < pf_len; ++i) {
          const int32_t id = pt.pages[size_t(page)];
          const int64_t e = (head_off + slot * D) * int64_t(esize);
          kp[i] = static_cast<const unsigned char*>(kv.k_page_data(layer, id)) + e;
          vp[i] = static_cast<const unsigned char*>(kv.v_page_data(layer, id)) + e;
          if (++slot == P) slot = 0, ++page;
        }
      } else {
        const int32_t* pos = sel.head(h) + r0;
        for (int64_t i = 0; i < pf_len; ++i) {
          kp[i] = kv.k_row_data(layer, pt, pos[i], h);
          vp[i] = kv.v_row_data(layer, pt, pos[i], h);
        }
      }
      if (fp8) {
        widen_fp8_rows(kv, layer, h, kp, vp, len, D, wide.data(), wide.data() + kDecodeChunk * D);
        pf_len = len;
      }
      DecodeChunk c{kp, vp, len, pf_len, q + int64_t(h) * G * D, G, D, scale, scores.data(),
                    parts + it * part_stride,
                    logits ? logits + int64_t(h) * G * ld + r0 : nullptr, ld};
#if SPADE_ATT_X86
      if (avx2) {
        // The dense path's kernel for one head: the same arithmetic per (head, row).
        HeadsChunk hc{kp, vp, kRows, len, pf_len, 1, G, D, scale, c.q, scores.data(), c.part,
                      part_stride, c.logits, ld};
        run_chunk(hc);
        continue;
      }
#endif
      chunk_scalar(c, dt);
    }
  };
  // Very short histories stay on the calling thread: a hand-off costs more than their work.
  int64_t total_rows = 0;
  for (int h = 0; h < Hkv; ++h) total_rows += sel.count(h);
#if SPADE_ATT_X86
  if (avx2 && sel.dense()) {
    // Dense: a work item is a chunk of every head (chunk_heads_avx2, the cache read in order);
    // its partials land where the head-major items' would, so the merge below is shared.
    const int64_t chunks = item_base[1];
    auto run_heads = [&](int64_t c0, int64_t c1) {
      thread_local std::vector<const void*> ptrs;
      thread_local std::vector<float> scores, wide;
      constexpr int64_t kRows = kDecodeChunk + kDecodePrefetch;
      const size_t need = size_t(2 * Hkv * kRows);
      if (ptrs.size() < need) ptrs.resize(need);
      if (scores.size() < size_t(Hkv * G * kDecodeChunk)) scores.resize(size_t(Hkv * G * kDecodeChunk));
      const size_t wneed = size_t(2 * Hkv * kDecodeChunk * D);
      if (fp8 && wide.size() < wneed) wide.resize(wneed);
      for (int64_t ch = c0; ch < c1; ++ch) {
        const int64_t r0 = ch * kDecodeChunk, len = std::min(kDecodeChunk, L - r0);
        int64_t pf_len = std::min(kRows, L - r0);
        const void** kp = ptrs.data();
        const void** vp = ptrs.data() + Hkv * kRows;
        for (int h = 0; h < Hkv; ++h) {
          const int64_t head_off = int64_t(h) * P * D;
          int64_t page = r0 / P, slot = r0 % P;
          for (int64_t i = 0; i < pf_len; ++i) {
            const int32_t id = pt.pages[size_t(page)];
            const int64_t e = (head_off + slot * D) * int64_t(esize);
            kp[h * kRows + i] = static_cast<const unsigned char*>(kv.k_page_data(layer, id)) + e;
            vp[h * kRows + i] = static_cast<const unsigned char*>(kv.v_page_data(layer, id)) + e;
            if (++slot == P) slot = 0, ++page;
          }
        }
        if (fp8) {
          for (int h = 0; h < Hkv; ++h)
            widen_fp8_rows(kv, layer, h, kp + h * kRows, vp + h * kRows, len, D,
                           wide.data() + h * kDecodeChunk * D,
                           wide.data() + (Hkv + h) * kDecodeChunk * D);
          pf_len = len;
        }
        HeadsChunk c{kp, vp, kRows, len, pf_len, Hkv, G, D, scale, q, scores.data(),
                     parts + ch * part_stride, chunks * part_stride, logits ? logits + r0 : nullptr,
                     ld};
        run_chunk(c);
      }
    };
    if (chunks < 2 || total_rows < 256)
      run_heads(0, chunks);
    else
      ThreadPool::global().parallel_for(chunks, 1, [&run_heads](int64_t a, int64_t b) { run_heads(a, b); });
  } else
#endif
  if (items < 2 || total_rows < 256)
    run(0, items);
  else
    // (Through a one-reference lambda: std::function keeps that without allocating.)
    ThreadPool::global().parallel_for(items, 1, [&run](int64_t a, int64_t b) { run(a, b); });
  // Merge each head's chunks in order.
  for (int h = 0; h < Hkv; ++h)
    for (int g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t it = item_base[h]; it < item_base[h + 1]; ++it)
        mx = std::max(mx, parts[it * part_stride + g * (D + 2) + D]);
      float* o = out + (int64_t(h) * G + g) * D;
      std::fill(o, o + D, 0.f);
      double den = 0;
      for (int64_t it = item_base[h]; it < item_base[h + 1]; ++it) {
        const float* part = parts + it * part_stride + g * (D + 2);
        const float w = std::exp(part[D] - mx);
        den += double(w) * double(part[D + 1]);
        for (int64_t d = 0; d < D; ++d) o[d] += w * part[d];
      }
      const float inv = float(1.0 / den);
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

void attention_selected(const KVPool& kv, int layer, const PageTable& pt, const float* q, int Hq,
                        float scale, const sparse::Selection& sel, float* out,
                        AttentionScratch& sc, float* logits) {
  decode_attention(kv, layer, pt, q, Hq, scale, sel, out, sc, logits);
}

}  // namespace spade::cpu

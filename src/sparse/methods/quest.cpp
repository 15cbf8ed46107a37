#include "sparse/methods/quest.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kv/key_rotation.h"
#include "sparse/methods/common.h"
#include "sparse/topk.h"

namespace spade::sparse {

float quest_page_bound(const float* q, const float* kmin, const float* kmax, int D) {
  float s = 0.f;
  for (int d = 0; d < D; ++d) s += std::max(q[d] * kmax[d], q[d] * kmin[d]);
  return s;
}

QuestMethod::QuestMethod(int64_t budget, int page_size, int dense_layers, Group group)
    : budget_(budget), page_(page_size), dense_layers_(dense_layers), group_(group) {
  SPADE_CHECK(page_size > 0, "quest: page_size must be positive");
  SPADE_CHECK(budget >= page_size, "quest: budget (", budget, ") must be at least one page (",
              page_size, " tokens)");
}

std::string QuestMethod::describe() const {
  return cat("quest budget=", budget_, " page_size=", page_, " pages=", budget_ / page_,
             " dense_layers=", dense_layers_, " group=", group_ == Group::Max ? "max" : "sum");
}

void QuestMethod::check_kv_layout(const KVLayout& lay) const {
  SPADE_CHECK(lay.page_minmax, "quest needs the KV pool's per-page key min/max (page_minmax)");
  SPADE_CHECK(lay.page_size > 0 && page_ % lay.page_size == 0, "quest: page_size ", page_,
              " is not a multiple of the KV cache page size ", lay.page_size);
}

void QuestMethod::select(StepContext& c, Selection& out) const {
  const int64_t n_pages = (c.L + page_ - 1) / page_;
  const int64_t k_pages = budget_ / page_;
  if (c.layer < dense_layers_ || k_pages >= n_pages) {
    out.set_dense(c.Hkv, c.L);
    return;
  }
  const KVLayout& lay = c.kv->layout();
  SPADE_CHECK(lay.page_minmax, "quest needs the KV pool's per-page key min/max (page_minmax)");
  SPADE_CHECK(page_ % lay.page_size == 0, "quest: page_size ", page_,
              " is not a multiple of the KV cache page size ", lay.page_size);
  const int chunk = page_ / lay.page_size;
  const int D = c.D;
  float* score = SelectScratch::ensure(c.scratch.f0, size_t(n_pages));
  float* comb = SelectScratch::ensure(c.scratch.f1, size_t(2 * D + c.G * D));
  float* q_plain = comb + 2 * D;
  const bool rotated = c.kv->keys_rotated();
  out.begin_per_head(c.Hkv, c.L);
  for (int h = 0; h < c.Hkv; ++h) {
    const float* qh = c.q + int64_t(h) * c.G * D;
    if (rotated) {  // fp8: the query comes rotated, the page bounds do not (kv_pool.h page_kmin)
      std::copy(qh, qh + int64_t(c.G) * D, q_plain);
      rotate_key_rows(q_plain, c.G, D);
      qh = q_plain;
    }
    for (int64_t i = 0; i + 1 < n_pages; ++i) {  // the last page is always taken
      const float *mn, *mx;
      if (chunk == 1) {
        mn = c.kv->page_kmin(c.layer, c.pt->pages[size_t(i)], h);
        mx = c.kv->page_kmax(c.layer, c.pt->pages[size_t(i)], h);
      } else {
        std::fill_n(comb, D, INFINITY);
        std::fill_n(comb + D, D, -INFINITY);
        for (int j = 0; j < chunk; ++j) {
          const int32_t pg = c.pt->pages[size_t(i * chunk + j)];
          const float* a = c.kv->page_kmin(c.layer, pg, h);
          const float* b = c.kv->page_kmax(c.layer, pg, h);
          for (int d = 0; d < D; ++d) {
            comb[d] = std::min(comb[d], a[d]);
            comb[D + d] = std::max(comb[D + d], b[d]);
          }
        }
        mn = comb;
        mx = comb + D;
      }
      float s = group_ == Group::Max ? -INFINITY : 0.f;
      for (int g = 0; g < c.G; ++g) {
        const float b = quest_page_bound(qh + int64_t(g) * D, mn, mx, D);
        s = group_ == Group::Max ? std::max(s, b) : s + b;
      }
      score[i] = s;
    }
    const int64_t k = top_k_range(score, 0, int32_t(n_pages - 1), k_pages - 1, c.scratch.i0);
    std::sort(c.scratch.i0.begin(), c.scratch.i0.begin() + k);
    c.scratch.i0[size_t(k)] = int32_t(n_pages - 1);
    for (int64_t j = 0; j <= k; ++j) {
      const int64_t p0 = int64_t(c.scratch.i0[size_t(j)]) * page_;
      const int64_t p1 = std::min<int64_t>(p0 + page_, c.L);
      for (int64_t p = p0; p < p1; ++p) out.push(int32_t(p));
    }
    out.close_head();
  }
}

std::vector<OptionSpec> quest_options() {
  return {budget_option(),
          OptionSpec{"page_size", OptKind::Int, "16",
                     "tokens per Quest page, a multiple of the KV page size (Quest: 16)"}
              .range(1, kMaxTile),
          dense_layers_count("2", "leading full-attention layers (Quest: 2)"),
          OptionSpec{"group", OptKind::String, "max",
                     "GQA aggregation of the group's page bounds: max (an upper bound) or sum"}
              .one_of({"max", "sum"})};
}

std::unique_ptr<SparseMethod> make_quest(const MethodOptions& o, const ModelConfig&) {
  // (MethodOptions checked every value against quest_options()' ranges.)
  return std::make_unique<QuestMethod>(o.integer("budget"), int(o.integer("page_size")),
                                       int(o.integer("dense_layers")),
                                       o.str("group") == "max" ? QuestMethod::Group::Max
                                                               : QuestMethod::Group::Sum);
}

}  // namespace spade::sparse

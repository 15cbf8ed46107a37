// Selection rules over weight rows on the GPU (issue 37 item 6): the CPU's
// sparse::ld_select (LycheeDecode's topk / ratio / topp / threshold modes over units of
// `block` tokens) and sparse::OracleTopPMethod (each row's smallest best-first set whose
// mass reaches p; the union over a GQA group's query heads), with the CPU's order: weight
// descending, ties by the lower unit index.
//
// Four launches, each one CTA per row or per list:
//   rule_unit_weights   logits -> the CPU's softmax (float exp, double sum, float 1 / sum),
//                       then per unit of `block` tokens the double sum of its weights
//   rule_criteria       per row the exact cut of its rule: unit i is kept iff
//                       key(w_i) > t or (key(w_i) == t and i < cut), key = the fp32 bit
//                       pattern of w_i > 0, else 0 (NaN and zeros rank last). Found by a
//                       4 x 8-bit radix select on the keys with counts (topk, ratio) or
//                       masses (topp: 64-bit fixed point in units of 2^-52, exact and
//                       order-free), then the ties at t taken by index; threshold: t = the
//                       largest float <= tau, or the heaviest unit when none is above
//   rule_lists          per (request, KV head) list the kept units (a unit kept by any of
//                       the list's criteria rows: the union), ascending, as unit indices or
//                       expanded to token positions, into a strided table + counts
//   counted_compact_lists  strided table + counts -> CSR (sel_off / sel_idx)
//
// Layout / bytes: rows are f32 [ld] (ld >= the longest context); row r of a launch belongs
// to request r / rows_per_seq and holds L = kv_len[that request] logits or U = ceil(L /
// block) unit weights. Criteria: RuleCrit [rows] (8 B each). Lists: i32 strided [lists]
// [stride] (stride >= the longest list: L tokens or U units) + i32 counts [lists]; list
// (b, h) = b * Hkv + h, its criteria and weight rows (b * Hkv + h) * crit_per_list + g.
// CSR: sel_off [lists + 1], sel_idx [sum of counts]. Shared memory: rule_criteria 3 KiB of
// bins; the others one 64-int scan buffer.
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

enum class RuleMode : int { TopK = 0, Ratio = 1, TopP = 2, Threshold = 3 };

struct RuleCrit {
  uint32_t t;   // key threshold
  int32_t cut;  // units with key == t kept below this index
};

struct RuleParams {
  RuleMode mode = RuleMode::TopK;
  int block = 1;        // tokens per unit
  int64_t k_units = 1;  // topk: ceil(max(1, budget) / block)
  double ratio = 0.3;   // ratio: ceil(ceil(ratio * L) / block) units
  double mass = 0.99;   // topp: the mass to reach (OracleTopP group=mean: p * G)
  double tau = 1e-4;    // threshold: units heavier than tau
};

// Rows r < n_rows whose bit (r % rows_per_seq) is set in `heads` (all rows when
// rows_per_seq > 32): out[r * ld + i] = the weight sum of unit i (tokens [i * block,
// min(L, (i + 1) * block))) of softmax(scores row r over [0, L)). out may be `scores` when
// block == 1 (in place).
void rule_unit_weights(const float* scores, int64_t ld, const int32_t* kv_len, int n_rows,
                       int rows_per_seq, uint32_t heads, int block, float* out, cudaStream_t s);

// The criteria of rows r < n_rows (bit as above) over their U unit weights w[r * ld + i].
void rule_criteria(const float* w, int64_t ld, const int32_t* kv_len, int n_rows,
                   int rows_per_seq, uint32_t heads, const RuleParams& p, RuleCrit* crit,
                   cudaStream_t s);

// Lists b * Hkv + h (b < B; heads whose bit is set when Hkv <= 32): the units kept by any of
// its crit_per_list criteria rows, ascending, into strided[list * stride + ...] and
// cnt[list]: unit indices, or (expand) every token position of each kept unit. Other lists
// are left untouched.
void rule_lists(const float* w, int64_t ld, const RuleCrit* crit, const int32_t* kv_len, int B,
                int Hkv, int crit_per_list, uint32_t heads, int block, bool expand,
                int32_t* strided, int64_t stride, int32_t* cnt, cudaStream_t s);

// CSR of lists l < n_lists: sel_off[l] = the sum of cnt before l, sel_idx from strided
// rows (cnt[l] entries each).
void counted_compact_lists(const int32_t* strided, int64_t stride, const int32_t* cnt,
                           int n_lists, int32_t* sel_off, int32_t* sel_idx, cudaStream_t s);

}  // namespace spade::cuda

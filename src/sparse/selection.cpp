#include "sparse/selection.h"

#include "core/error.h"

namespace spade::sparse {

void validate(const Selection& s, int hkv, int64_t L) {
  SPADE_CHECK(s.n_kv_heads == hkv && s.length == L, "selection for ", s.n_kv_heads,
              " heads and ", s.length, " tokens, expected ", hkv, " and ", L);
  if (s.kind == SelKind::Dense) return;
  const size_t want = s.kind == SelKind::Shared ? 2 : size_t(hkv) + 1;
  SPADE_CHECK(s.offsets.size() == want && s.offsets.front() == 0 &&
                  size_t(s.offsets.back()) == s.positions.size(),
              "selection: malformed CSR offsets");
  for (size_t h = 0; h + 1 < s.offsets.size(); ++h) {
    SPADE_CHECK(s.offsets[h + 1] > s.offsets[h], "selection: head ", h, " selects no token");
    for (int32_t i = s.offsets[h]; i < s.offsets[h + 1]; ++i) {
      const int32_t p = s.positions[size_t(i)];
      SPADE_CHECK(p >= 0 && p < L, "selection: position ", p, " outside [0, ", L, ")");
      SPADE_CHECK(i == s.offsets[h] || p > s.positions[size_t(i) - 1],
                  "selection: positions of head ", h, " not strictly increasing");
    }
  }
}

}  // namespace spade::sparse

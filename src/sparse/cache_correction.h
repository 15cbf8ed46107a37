// Cache correction (LycheeDecode section 4.2.2; TidalDecode's option): sparse decode steps write
// K/V computed from sparse attention in the layers after the first sparse one; every N decoded
// tokens, the decode loop recomputes those N tokens' K/V with one dense pass over them at their
// own positions (a prefill chunk: every method attends densely in prefill) and carries on
// decoding sparsely. The N is the method's (SparseMethod::correction_every, CudaSparse::
// correction_every); the scheduler does the same with its correction chunks.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/cpu_model.h"

namespace spade::sparse {

class CacheCorrection {
 public:
  // The model's forward pass over one sequence input (its pages, tokens, count; dense
  // attention: SeqInput::attention null and SeqInput::dense set, so that CudaModel does not
  // plan a one-token chunk as a sparse decode row), logits dropped.
  using Forward = std::function<void(const SeqInput&)>;
  // every >= 1.
  explicit CacheCorrection(int64_t every);
  // Call after every decode forward, once its logits were used (a correction runs the model
  // again): `token` is the token that step fed (now at position pt.length - 1). After every
  // `every` of them, rewinds `pt` by `every` tokens and runs them again as one chunk through
  // `forward`, overwriting their K/V in every layer; returns true when it did. Those tokens'
  // pages must be owned by `pt` alone. `device_state` goes into the chunk's SeqInput.
  bool after_decode(const Forward& forward, PageTable& pt, int32_t token,
                    MethodState* device_state = nullptr);
  int64_t every() const { return every_; }
  int64_t corrections() const { return corrections_; }
  void reset() { pending_.clear(); }

 private:
  int64_t every_;
  int64_t corrections_ = 0;
  std::vector<int32_t> pending_;
};

}  // namespace spade::sparse

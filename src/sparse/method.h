// The SparseMethod interface (docs/sparse.md). A method object holds only its configuration
// and is shared by every request that uses it; whatever crosses layers within a decode
// step (TidalDecode / LessIsMore token sets) lives in a per-request MethodState reached
// through the StepContext.
//
// Per decode step and layer, SparseSession calls, in order:
//   on_append(ctx)           the token's K/V were just written to the paged cache
//   select(ctx, sel)         choose the positions each KV head reads (may request_scores())
//   prune(ctx, sel)          optional shrink of the selection (Twilight)
//   -- attention over exactly `sel` (backend/cpu/attention.h: attention_selected), or
//      the method's own attend_decode (BLASST) --
//   on_scores(ctx, sel, lg)  only if requested: the layer's scaled q.k scores [Hq, n]
// Prefill chunks are attended densely (causal) for every method; after each layer's chunk
// on_prefill(ctx, p0, T) lets a method index the new tokens (ctx.q: the chunk's queries
// [T, Hq, D], ctx.L = p0 + T). Per-page key min/max (Quest)
// is maintained by the KV pool itself on every append.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/cpu/attention.h"
#include "kv/kv_pool.h"
#include "model/config.h"
#include "sparse/selection.h"

namespace spade::sparse {

struct MethodState {
  virtual ~MethodState() = default;
  // The decoded bytes of the token at the next position (Tokenizer::token_bytes), called in
  // position order, prompt first, for methods that read token text (LycheeCluster's
  // structure-aware chunking). Others ignore it.
  virtual void append_token_text(std::string_view piece) { (void)piece; }
  // Whether append_token_text is used (callers skip decoding token text otherwise).
  virtual bool wants_token_text() const { return false; }
  // (layer, KV head, token) rows the request's attention read in its decode steps so far, the
  // unit the scheduler's density counts in; -1 when the state does not count them (the CPU
  // methods count through their SparseSession instead).
  virtual int64_t attended_rows() const { return -1; }
};

// Grow-only scratch for selection code (no allocation once warm).
struct SelectScratch {
  std::vector<float> f0, f1;
  std::vector<int32_t> i0, i1, i2;
  std::vector<uint8_t> mark;
  template <typename T>
  static T* ensure(std::vector<T>& b, size_t n) {
    if (b.size() < n) b.resize(n);
    return b.data();
  }
};

// Tensor parallelism (dist/tp_runner.h): a session that runs one rank's heads. The rank holds
// the model's query heads [q0, q0 + Hq) and KV heads [kv0, kv0 + Hkv) of Hq_all / Hkv_all
// (StepContext::Hq / Hkv are the rank's counts); all_reduce_sum sums a float vector over the
// ranks in place (every rank gets the same values), called by every rank at the same point of
// the same layer. Methods whose selection spans KV heads (LessIsMore's one set) gather what
// they need through it; methods with tables indexed by the model's head (LycheeDecode's
// roles) read them at kv0 + h. Default: one rank, every head.
struct HeadShard {
  int q0 = 0, kv0 = 0;
  int Hq_all = 0, Hkv_all = 0;  // 0: the context's Hq / Hkv (set by StepContext::bind)
  std::function<void(float*, int64_t)> all_reduce_sum;  // null: one rank
  bool split() const { return bool(all_reduce_sum); }
};

class StepContext {
 public:
  // What the current layer's selection sees.
  int layer = 0;
  int n_layers = 0;
  int Hq = 0, Hkv = 0, D = 0, G = 1;
  float scale = 1.f;
  const KVPool* kv = nullptr;
  const PageTable* pt = nullptr;
  const float* q = nullptr;  // [Hq, D] queries of the decode token (after RoPE; rotated when kv->keys_rotated())
  int64_t L = 0;             // context length, the decode token included (its position L-1)
  int64_t step = 0;          // decode step index in this request
  MethodState* state = nullptr;
  SelectScratch scratch;
  HeadShard shard;  // the rank's heads under tensor parallelism (one rank: every head)

  // True full-attention softmax weights [Hq, L] of this layer's query: a measurement
  // computed on first use per layer (oracle methods, recall), never the attention output.
  const float* full_weights();
  bool has_full_weights() const { return weights_layer_ == layer && weights_step_ == step; }
  // Ask to receive this layer's attention scores in on_scores() (uniform selections only).
  void request_scores() { want_scores_ = true; }
  bool scores_requested() const { return want_scores_; }

  // Called by the session at the start of each decode layer.
  void begin_layer(int layer_, const PageTable& pt_, const float* q_, int64_t L_) {
    layer = layer_;
    pt = &pt_;
    q = q_;
    L = L_;
    want_scores_ = false;
  }
  void invalidate_weights() { weights_layer_ = -1; }
  // Shapes from the model, the KV pool (its layout must match the model; `who` names the
  // session in the error) and the session's attention scratch.
  void bind(const ModelConfig& cfg, const KVPool& pool, cpu::AttentionScratch* scratch,
            const char* who);
  // Pre-sizes the scratch for contexts up to max_len tokens (no growth in the decode loop).
  void reserve(int64_t max_len);
  cpu::AttentionScratch* attention_scratch = nullptr;  // shared with the session

 private:
  std::vector<float> weights_;
  int weights_layer_ = -1;
  int64_t weights_step_ = -1;
  bool want_scores_ = false;
};

class SparseMethod {
 public:
  virtual ~SparseMethod() = default;
  virtual std::string name() const = 0;
  // One line: the method and its effective parameters (after defaults).
  virtual std::string describe() const = 0;
  // Per-request state; nullptr when the method keeps none.
  virtual std::unique_ptr<MethodState> new_state() const { return nullptr; }
  // Throws spade::Error when the method cannot run on a KV cache of this layout (Quest: its
  // page_size must be a multiple of the KV page size). SparseSession checks it at
  // construction, so such a method fails before the first step, not in the middle of one.
  virtual void check_kv_layout(const KVLayout& layout) const { (void)layout; }
  // Cache correction (LycheeDecode section 4.2.2, TidalDecode's option): every N decoded
  // tokens the decode loop recomputes those N tokens' K/V with a dense pass and continues
  // (CacheCorrection; the scheduler's correction chunks). N, or 0 when the method asks for none.
  virtual int64_t correction_every() const { return 0; }
  virtual void on_prefill(StepContext& ctx, int64_t p0, int64_t T) const {}
  virtual void on_append(StepContext& ctx) const {}
  virtual void select(StepContext& ctx, Selection& out) const = 0;
  virtual void prune(StepContext& ctx, Selection& sel) const {}
  virtual void on_scores(StepContext& ctx, const Selection& sel, const float* scores) const {}
  // Optional: run the attention itself (BLASST: skipping inside the kernel). Return false to
  // let the session run its exact attention. attend_decode gets the final selection (it is
  // not called when the method requested scores: such a layer attends exactly);
  // attend_prefill gets a prefill chunk's queries [T, Hq, D] (ctx.L = p0 + T).
  virtual bool attend_decode(StepContext& ctx, const Selection& sel, float* out) const {
    return false;
  }
  virtual bool attend_prefill(StepContext& ctx, const float* q, int64_t p0, int64_t T,
                              float* out) const {
    return false;
  }
  // After an attend_decode that returned true: the rows it actually attended when fewer than
  // the selection's (BLASST: the rows of its kept tiles; a skipped tile's rows get no weight
  // in the output), or nullptr. The session counts density and recall over them.
  virtual const Selection* read_selection(StepContext& ctx) const {
    (void)ctx;
    return nullptr;
  }
};

}  // namespace spade::sparse

// Shared by the scheduler tests (test_scheduler*.cpp): a letter-per-token text, a small
// random model with its pool, collecting a request's deltas, prompts, and the greedy check
// against one unbatched forward pass.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/step_model.h"
#include "test_util.h"

namespace spade::sched_test {

using namespace std::chrono_literals;


// Token id -> one letter; ids of a multiple of 26 never produce text (like special tokens).
class LetterStream : public TextStream {
 public:
  std::string push(int32_t id) override { return id % 26 == 0 ? "" : std::string(1, char('a' + id % 26)); }
  std::string flush() override { return {}; }
};
class LetterText : public TokenText {
 public:
  std::unique_ptr<TextStream> stream(int32_t) const override { return std::make_unique<LetterStream>(); }
  std::string piece(int32_t id) const override { return LetterStream().push(id); }
};

struct Result {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  FinishReason reason = FinishReason::None;
  std::string error;
  int64_t prompt_tokens = 0, completion_tokens = 0;
  int deltas = 0;
  double density = -1;
};

inline Result collect(RequestChannel& ch, std::chrono::seconds limit = 60s) {
  Result r;
  RequestDelta d;
  const auto end = std::chrono::steady_clock::now() + test::scaled(limit);
  while (std::chrono::steady_clock::now() < end) {
    if (!ch.wait_take(d, 20ms)) continue;
    ++r.deltas;
    r.text += d.text;
    r.tokens.insert(r.tokens.end(), d.tokens.begin(), d.tokens.end());
    r.logprobs.insert(r.logprobs.end(), d.logprobs.begin(), d.logprobs.end());
    if (d.finished) {
      r.reason = d.reason;
      r.error = d.error;
      r.prompt_tokens = d.prompt_tokens;
      r.completion_tokens = d.completion_tokens;
      r.density = d.density;
      return r;
    }
  }
  ADD_FAILURE() << "request did not finish in time";
  return r;
}

inline std::vector<int32_t> make_prompt(int n, int seed, int vocab) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[size_t(i)] = 1 + (seed * 31 + i * 7) % (vocab - 1);
  return p;
}

struct Fixture {
  explicit Fixture(int64_t pages = 256, int page_size = 16)
      : cfg(test::tiny_config()), w(test::random_model(cfg, 7)),
        kv(KVLayout{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page_size}, pages),
        model(w, kv) {}
  ModelConfig cfg;
  ModelWeights w;
  KVPool kv;
  CpuModel model;
  LetterText text;
};

// Every generated token must be the argmax (within fp tolerance of batched vs unbatched
// arithmetic) of a fresh single-sequence forward pass over prompt + previous tokens.
inline void expect_greedy(const ModelWeights& w, const std::vector<int32_t>& prompt,
                   const std::vector<int32_t>& gen) {
  const ModelConfig& c = w.config;
  KVPool kv(KVLayout{c.n_layers, c.n_kv_heads, c.head_dim, 16}, 64);
  CpuModel m(w, kv);
  PageTable pt;
  std::vector<int32_t> seq(prompt);
  seq.insert(seq.end(), gen.begin(), gen.end());
  std::vector<SeqInput> b(1);
  b[0].pages = &pt;
  b[0].tokens = seq.data();
  b[0].n_tokens = int64_t(seq.size()) - 1;
  b[0].all_logits = true;
  std::vector<int64_t> row_of;
  const auto& logits = m.forward(b, row_of);
  for (size_t i = 0; i < gen.size(); ++i) {
    const float* row = logits.data() + (int64_t(prompt.size()) - 1 + int64_t(i)) * c.vocab;
    const float best = row[argmax(row, c.vocab)];
    EXPECT_GE(row[gen[i]], best - 1e-3f) << "token " << i << " is not the greedy choice";
  }
}

inline EngineRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}


// A runner that "samples on the device" (greedy over the CPU model's logits), recording what
// the scheduler asked of it: the path a CUDA server takes, checked without a GPU.
class DeviceSamplingRunner final : public CpuStepModel {
 public:
  explicit DeviceSamplingRunner(CpuModel& m) : CpuStepModel(m) {}
  const std::vector<float>& forward(const std::vector<SeqInput>& batch,
                                    std::vector<int64_t>& row_of) override {
    ++host_steps;
    return m_.forward(batch, row_of);
  }
  bool samples_on_device() const override { return true; }
  const std::vector<int32_t>& forward_sample(const std::vector<SeqInput>& batch,
                                             const std::vector<RowSampling>& rows) override {
    ++device_steps;
    EXPECT_EQ(rows.size(), batch.size());
    const auto& logits = m_.forward(batch, row_of_);
    out_.resize(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      EXPECT_EQ(rows[i].temperature, 0.f);
      draws.push_back({rows[i].seed, rows[i].draw});
      out_[i] = argmax(logits.data() + row_of_[i] * m_.config().vocab, m_.config().vocab);
    }
    return out_;
  }

  int host_steps = 0, device_steps = 0;
  std::vector<std::pair<uint64_t, uint64_t>> draws;  // (seed, draw) of every row

 private:
  std::vector<int64_t> row_of_;
  std::vector<int32_t> out_;
};

}  // namespace spade::sched_test

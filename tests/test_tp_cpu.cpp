// Tensor parallelism on the CPU (issue 39's groundwork): the TCP communicator's collectives
// and failures (src/dist/tcp_communicator.h), Megatron sharding of the weights
// (src/dist/shard.h), and CpuModel over a shard per rank against one rank. Ranks are threads
// of this process, each with its own TcpCommunicator on 127.0.0.1 and an ephemeral port.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>

#include "core/half.h"
#include "dist/shard.h"
#include "dist/tcp_communicator.h"
#include "model/cpu_model.h"
#include "model/loader.h"
#include "test_util.h"
#include "tp_test_util.h"

using namespace spade;
using namespace spade::dist;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::expect_ok;
using test::run_ranks;
using test::tp_quick;

namespace {

std::string message(const std::exception_ptr& e) {
  if (!e) return "(no error)";
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    return x.what();
  } catch (const std::exception& x) {
    return std::string("not a spade::Error: ") + x.what();
  }
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// ---------------------------------------------------------------- the TCP communicator

TEST(TpComm, AllReduceBroadcastBarrier) {
  for (int n : {1, 2, 3, 4}) {
    const int64_t len = 300001;  // several socket buffers
    std::vector<std::vector<float>> got(static_cast<size_t>(n));
    auto err = run_ranks(n, [&](Communicator& c) {
      const int r = c.rank();
      EXPECT_EQ(c.size(), n);
      std::vector<float> v = test::random_vec(size_t(len), 10 + uint32_t(r));
      c.all_reduce_sum(v.data(), len);
      got[size_t(r)] = v;
      for (int root = 0; root < n; ++root) {
        std::vector<uint8_t> b(1000, uint8_t(r));
        c.broadcast(b.data(), int64_t(b.size()), root);
        for (uint8_t x : b) ASSERT_EQ(x, uint8_t(root));
      }
      c.barrier();
      c.all_reduce_sum(nullptr, 0);
    });
    expect_ok(err);
    // Rank order: ((x0 + x1) + x2) + x3, bitwise, on every rank.
    std::vector<float> want = test::random_vec(size_t(len), 10);
    for (int r = 1; r < n; ++r) {
      auto x = test::random_vec(size_t(len), 10 + uint32_t(r));
      for (int64_t i = 0; i < len; ++i) want[size_t(i)] += x[size_t(i)];
    }
    for (int r = 0; r < n; ++r)
      EXPECT_EQ(0, std::memcmp(got[size_t(r)].data(), want.data(), sizeof(float) * size_t(len)))
          << "n " << n << " rank " << r;
  }
}

TEST(TpComm, RankThatExitsMakesTheOthersThrow) {
  const auto t0 = Clock::now();
  auto err = run_ranks(3, [](Communicator& c) {
    if (c.rank() == 1) return;  // exits: its communicator closes
    std::vector<float> v(16, 1.f);
    c.all_reduce_sum(v.data(), 16);
  });
  EXPECT_LT(Clock::now() - t0, test::scaled(5s));
  EXPECT_FALSE(err[1]);
  EXPECT_TRUE(has(message(err[0]), "rank 1 closed its connection")) << message(err[0]);
  // Rank 2 learns it from rank 0: its abort message, or its closed connection (a send or a
  // receive that fails), whichever comes first.
  EXPECT_TRUE(has(message(err[2]), "tensor-parallel rank 2 of 3: ")) << message(err[2]);
}

TEST(TpComm, StalledRankTimesOutAndLaterCallsThrow) {
  const auto t0 = Clock::now();
  std::atomic<bool> rank0_done{false};
  std::string again;
  auto err = run_ranks(
      3,
      [&](Communicator& c) {
        std::vector<float> v(16, 1.f);
        if (c.rank() == 1) {  // alive, but never joins the collective until rank 0 gave up
          while (!rank0_done) std::this_thread::sleep_for(10ms);
          c.all_reduce_sum(v.data(), 16);
          return;
        }
        try {
          c.all_reduce_sum(v.data(), 16);
        } catch (const Error&) {
          if (c.rank() == 0) {
            rank0_done = true;
            try {
              c.barrier();  // broken: throws the first failure again
            } catch (const Error& e) {
              again = e.what();
            }
          }
          throw;
        }
      },
      tp_quick(10s, 300ms));
  EXPECT_LT(Clock::now() - t0, test::scaled(5s));
  EXPECT_TRUE(has(message(err[0]), "no data from rank 1 for ")) << message(err[0]);
  EXPECT_EQ(again, message(err[0]));
  EXPECT_TRUE(err[1]);
  EXPECT_TRUE(err[2]);
  EXPECT_TRUE(has(message(err[2]), "rank 0 stopped")) << message(err[2]);
}

TEST(TpComm, DivergedCollectivesAreNamed) {
  auto err = run_ranks(2, [](Communicator& c) {
    std::vector<float> v(8, 1.f);
    c.all_reduce_sum(v.data(), c.rank() == 0 ? 4 : 5);
  });
  EXPECT_TRUE(has(message(err[0]), "diverged: rank 0 called all_reduce_sum of 4 floats")) << message(err[0]);
  EXPECT_TRUE(has(message(err[1]), "rank 1 called all_reduce_sum of 5 floats")) << message(err[1]);
}

TEST(TpComm, RendezvousFailuresAreErrors) {
  TcpOptions o = tp_quick();
  o.connect_timeout = 300ms;
  // Nobody listens: the peer gives up.
  int port = 0;
  {
    TcpListener l("127.0.0.1:0");
    port = l.port();
  }
  try {
    TcpCommunicator c("127.0.0.1:" + std::to_string(port), 1, 2, o);
    FAIL() << "connected";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "could not reach rank 0 at 127.0.0.1:")) << e.what();
  }
  // Rank 0 of 3 with one peer only: both stop.
  TcpListener l("127.0.0.1:0");
  const std::string addr = "127.0.0.1:" + std::to_string(l.port());
  std::string peer;
  std::thread t([&] {
    try {
      TcpCommunicator c(addr, 1, 3, o);
    } catch (const Error& e) {
      peer = e.what();
    }
  });
  try {
    TcpCommunicator c(std::move(l), 3, o);
    ADD_FAILURE() << "rendezvous completed";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "only 2 of 3 ranks joined")) << e.what();
    EXPECT_TRUE(has(e.what(), "missing: rank 2")) << e.what();
  }
  t.join();
  EXPECT_FALSE(peer.empty());
  // Bad arguments.
  EXPECT_THROW(parse_host_port("localhost"), Error);
  EXPECT_THROW(parse_host_port("localhost:99999"), Error);
  EXPECT_THROW(parse_host_port(":80"), Error);
  EXPECT_EQ(parse_host_port("[::1]:29500").host, "::1");
  EXPECT_EQ(parse_host_port("node-3:29500").port, 29500);
  EXPECT_THROW(TcpCommunicator(addr, 2, 2, o), Error);
  EXPECT_THROW(TcpCommunicator(addr, 0, 0, o), Error);
}

// ---------------------------------------------------------------- sharding

namespace {

ModelConfig tp_config(Arch arch) {  // 6 KV heads, 12 query heads: splits over 2 and 3 ranks
  ModelConfig c = test::tiny_config(arch);
  c.hidden = 64;
  c.n_heads = 12;
  c.n_kv_heads = 6;
  c.head_dim = 16;
  c.ffn = 96;
  return c;
}

std::string shard_error(const ModelWeights& w, int rank, int n) {
  try {
    shard_weights(w, rank, n);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Q8_0 blocks of a row-major fp32 [rows, cols] matrix (cols a multiple of 32).
std::vector<uint8_t> quantize_q8_0(const float* x, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out;
  for (int64_t i = 0; i < rows * cols; i += 32) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(x[i + j]));
    const float d = amax / 127.f;
    const uint16_t h = f32_to_f16(d);
    out.push_back(uint8_t(h & 0xff));
    out.push_back(uint8_t(h >> 8));
    for (int j = 0; j < 32; ++j)
      out.push_back(uint8_t(int8_t(d ? std::lround(x[i + j] / d) : 0)));
  }
  return out;
}

// The Linear weights of `w` as Q8_0 (CpuWeights::Native's form: fp32 tensors empty).
void quantize_linears(ModelWeights& w) {
  auto q = [&](HostTensor& t, cpu::QuantMatrix& m, int64_t rows, int64_t cols) {
    w.owned.push_back(quantize_q8_0(t.data(), rows, cols));
    m = cpu::QuantMatrix{DType::Q8_0, w.owned.back().data(), rows, cols};
    t = HostTensor();
  };
  const ModelConfig& c = w.config;
  const int64_t H = c.hidden, D = c.head_dim;
  for (LayerWeights& L : w.layers) {
    q(L.wq, L.qwq, c.n_heads * D, H);
    q(L.wk, L.qwk, c.n_kv_heads * D, H);
    q(L.wv, L.qwv, c.n_kv_heads * D, H);
    q(L.wo, L.qwo, H, c.n_heads * D);
    q(L.w_gate, L.qw_gate, c.ffn, H);
    q(L.w_up, L.qw_up, c.ffn, H);
    q(L.w_down, L.qw_down, H, c.ffn);
  }
}

}  // namespace

TEST(TpShard, SlicesAreTheRanksHeadsAndColumns) {
  ModelConfig c = tp_config(Arch::Qwen2);
  ModelWeights w = test::random_model(c, 5);
  const int64_t H = c.hidden, D = c.head_dim;
  for (int n : {1, 2, 3}) {
    std::vector<float> wo_cat;
    for (int r = 0; r < n; ++r) {
      ModelWeights s = shard_weights(w, r, n);
      EXPECT_EQ(s.config.n_heads, 12 / n);
      EXPECT_EQ(s.config.n_kv_heads, 6 / n);
      EXPECT_EQ(s.config.ffn, 96 / n);
      EXPECT_EQ(s.config.group_size(), c.group_size());
      const LayerWeights &L = w.layers[1], &S = s.layers[1];
      const int64_t hq = 12 / n, hkv = 6 / n, f = 96 / n;
      ASSERT_EQ(S.wq.numel(), hq * D * H);
      EXPECT_EQ(0, std::memcmp(S.wq.data(), L.wq.data() + r * hq * D * H, sizeof(float) * size_t(S.wq.numel())));
      EXPECT_EQ(0, std::memcmp(S.wk.data(), L.wk.data() + r * hkv * D * H, sizeof(float) * size_t(S.wk.numel())));
      EXPECT_EQ(0, std::memcmp(S.bv.data(), L.bv.data() + r * hkv * D, sizeof(float) * size_t(hkv * D)));
      EXPECT_EQ(0, std::memcmp(S.w_up.data(), L.w_up.data() + r * f * H, sizeof(float) * size_t(f * H)));
      EXPECT_EQ(S.w_down.data()[1 * f + 2], L.w_down.data()[1 * c.ffn + r * f + 2]);
      EXPECT_EQ(S.attn_norm.storage, L.attn_norm.storage);
      EXPECT_EQ(s.lm_head.storage, w.lm_head.storage);
      for (int64_t row = 0; row < H; ++row)
        for (int64_t j = 0; j < hq * D; ++j) wo_cat.push_back(S.wo.data()[row * hq * D + j]);
    }
    // The ranks' o-proj columns, side by side, are the whole o-proj.
    for (int64_t row = 0; row < H; row += 7)
      for (int r = 0; r < n; ++r)
        for (int64_t j = 0; j < 12 / n * D; j += 5)
          ASSERT_EQ(wo_cat[size_t(r * H * (12 / n * D) + row * (12 / n * D) + j)],
                    w.layers[1].wo.data()[row * 12 * D + r * (12 / n * D) + j]);
  }
}

TEST(TpShard, CountsThatDoNotSplitAreErrors) {
  ModelConfig c = test::tiny_config();  // 6 heads, 2 KV heads, ffn 96
  ModelWeights w = test::random_model(c, 1);
  EXPECT_EQ(shard_error(w, 0, 3), "--tp 3: 2 KV heads are not divisible by 3");
  EXPECT_EQ(shard_error(w, 0, 0), "--tp must be at least 1, got 0");
  EXPECT_EQ(shard_error(w, 2, 2), "--tp 2: rank 2 is outside [0, 2)");
  EXPECT_EQ(shard_error(w, -1, 2), "--tp 2: rank -1 is outside [0, 2)");
  c.ffn = 97;
  EXPECT_THROW(check_shardable(c, 2), Error);
  EXPECT_NO_THROW(check_shardable(c, 1));
  try {
    check_shardable(c, 2);
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--tp 2: the feed-forward size 97 is not divisible by 2");
  }
  // Stored Q8_0 (blocks of 32): o-proj's 96 columns split into 48 per rank, not whole blocks.
  ModelConfig q = test::tiny_config();
  q.hidden = 64;
  ModelWeights wq = test::random_model(q, 2);
  quantize_linears(wq);
  const std::string e = shard_error(wq, 0, 2);
  EXPECT_TRUE(has(e, "--tp 2: layer 0 o_proj is stored as q8_0 in blocks of 32 columns")) << e;
  EXPECT_TRUE(has(e, "--cpu-weights f32")) << e;
}

// ---------------------------------------------------------------- the model over ranks

namespace {

// Two sequences (prefill of 9 tokens with every logit, and of 17 in two chunks), then decode
// steps of both; every logits row of every call, concatenated.
std::vector<float> run_schedule(const ModelWeights& w, Communicator* tp, int decode_steps = 4) {
  const ModelConfig& c = w.config;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 8}, 64);
  CpuModel m(w, kv, tp);
  std::vector<std::vector<int32_t>> ids = {std::vector<int32_t>(size_t(9 + decode_steps)),
                                           std::vector<int32_t>(size_t(17 + decode_steps))};
  for (size_t i = 0; i < 2; ++i)
    for (size_t t = 0; t < ids[i].size(); ++t) ids[i][t] = int32_t((t * 37 + i * 11 + 3) % size_t(c.vocab));
  std::vector<PageTable> pt(2);
  std::vector<int64_t> row_of;
  std::vector<float> out;
  auto step = [&](const std::vector<SeqInput>& b) {
    const auto& lg = m.forward(b, row_of);
    out.insert(out.end(), lg.begin(), lg.end());
  };
  step({{&pt[0], ids[0].data(), 9, true, nullptr}, {&pt[1], ids[1].data(), 10, false, nullptr}});
  step({{&pt[1], ids[1].data() + 10, 7, false, nullptr}});
  for (int s = 0; s < decode_steps; ++s)
    step({{&pt[0], ids[0].data() + pt[0].length, 1, false, nullptr},
          {&pt[1], ids[1].data() + pt[1].length, 1, false, nullptr}});
  return out;
}

// Greedy decoding of one prompt: the tokens, and every logits row on the way.
std::pair<std::vector<int32_t>, std::vector<float>> greedy(const ModelWeights& w, Communicator* tp,
                                                           std::vector<int32_t> ids, int steps) {
  const ModelConfig& c = w.config;
  KVPool kv({c.n_layers, c.n_kv_heads, c.head_dim, 16}, 64);
  CpuModel m(w, kv, tp);
  PageTable pt;
  std::vector<int64_t> row_of;
  std::vector<float> logits;
  std::vector<int32_t> out;
  for (int s = 0; s < steps; ++s) {
    const auto& lg = m.forward({{&pt, ids.data() + pt.length, int64_t(ids.size()) - pt.length, false, nullptr}}, row_of);
    logits.insert(logits.end(), lg.begin(), lg.begin() + c.vocab);
    ids.push_back(int32_t(std::max_element(lg.begin(), lg.begin() + c.vocab) - lg.begin()));
    out.push_back(ids.back());
  }
  kv.release(pt);
  return {out, logits};
}

struct Diff {
  double max_abs = 0, max_ref = 0;
};
Diff compare(const std::vector<float>& a, const std::vector<float>& ref) {
  Diff d;
  EXPECT_EQ(a.size(), ref.size());
  for (size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    d.max_abs = std::max(d.max_abs, double(std::abs(a[i] - ref[i])));
    d.max_ref = std::max(d.max_ref, double(std::abs(ref[i])));
  }
  return d;
}

// Every rank's logits over `n` ranks (each rank runs fn on its shard).
template <typename Fn>
std::vector<std::vector<float>> over_ranks(const ModelWeights& w, int n, Fn fn) {
  std::vector<ModelWeights> shards;
  for (int r = 0; r < n; ++r) shards.push_back(shard_weights(w, r, n));
  std::vector<std::vector<float>> got(static_cast<size_t>(n));
  expect_ok(run_ranks(n, [&](Communicator& c) { got[size_t(c.rank())] = fn(shards[size_t(c.rank())], c); }));
  return got;
}

// fp32 tolerance, relative to the largest |logit| (at least 1): each rank's o-proj / down-proj
// sums 1/N of the products and the ranks' partials are added in rank order, so only the
// summation order differs from one rank. Measured: at most 7.4e-7 (SmolLM2 TP=3; the tiny
// models 2.7e-7 to 5.4e-7, stories260k 5.2e-7).
constexpr double kTol = 1e-5;

}  // namespace

class TpArch : public ::testing::TestWithParam<std::tuple<Arch, int>> {};

TEST_P(TpArch, LogitsEqualOneRank) {
  const auto [arch, n] = GetParam();
  ModelWeights w = test::random_model(tp_config(arch), 7);
  const std::vector<float> ref = run_schedule(w, nullptr);
  auto got = over_ranks(w, n, [](const ModelWeights& s, Communicator& c) { return run_schedule(s, &c); });
  for (int r = 1; r < n; ++r) EXPECT_EQ(got[size_t(r)], got[0]) << "rank " << r << " differs from rank 0";
  const Diff d = compare(got[0], ref);
  EXPECT_LT(d.max_abs, kTol * std::max(1.0, d.max_ref)) << "max |ref| " << d.max_ref;
}

INSTANTIATE_TEST_SUITE_P(Tp, TpArch,
                         ::testing::Combine(::testing::Values(Arch::Llama, Arch::Qwen2, Arch::Qwen3),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::string(arch_name(std::get<0>(info.param))) + "_tp" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(TpCpuModel, StoredQ8WeightsShard) {
  ModelConfig c = test::tiny_config();
  c.hidden = 64;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 32;
  c.ffn = 128;  // o-proj 128 and down-proj 128 columns: 64 per rank, two Q8_0 blocks
  ModelWeights w = test::random_model(c, 9);
  quantize_linears(w);
  ASSERT_TRUE(w.native());
  const std::vector<float> ref = run_schedule(w, nullptr);
  auto got = over_ranks(w, 2, [](const ModelWeights& s, Communicator& comm) {
    EXPECT_TRUE(s.native());
    return run_schedule(s, &comm);
  });
  EXPECT_EQ(got[1], got[0]);
  const Diff d = compare(got[0], ref);
  EXPECT_LT(d.max_abs, kTol * std::max(1.0, d.max_ref)) << "max |ref| " << d.max_ref;
}

TEST(TpCpuModel, Stories260kGreedyTp2) {
  const std::string path = test::source_dir() + "/tests/fixtures/models/stories260k-hf";
  auto w = load_model(path);
  const std::vector<int32_t> prompt = {1, 403, 407, 261, 1029 % 512, 300, 17};
  const auto ref = greedy(*w, nullptr, prompt, 6);
  auto got = over_ranks(*w, 2, [&](const ModelWeights& s, Communicator& c) {
    auto g = greedy(s, &c, prompt, 6);
    if (c.rank() == 0) {
      EXPECT_EQ(g.first, ref.first);
    }
    return g.second;
  });
  EXPECT_EQ(got[1], got[0]);
  const Diff d = compare(got[0], ref.second);
  EXPECT_LT(d.max_abs, kTol * std::max(1.0, d.max_ref)) << "max |ref| " << d.max_ref;
  // stories260k has 4 KV heads and ffn 172: 3 ranks cannot split it.
  EXPECT_EQ(shard_error(*w, 0, 3), "--tp 3: 4 KV heads are not divisible by 3");
}

// The real SmolLM2-135M (3 KV heads, 9 query heads) at TP = 3, its weights as stored (Q4_1,
// 32-element blocks: o-proj's 192 and down-proj's 512 columns per rank split on them).
TEST(TpCpuModel, SmolLM2StoredQ4_1Tp3) {
  const std::string path = test::source_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no " << path;
  auto w = load_model(path, CpuWeights::Native);
  ASSERT_TRUE(w->native());
  const std::vector<int32_t> prompt = {1, 504, 3458, 282, 4649, 314, 253};
  const auto ref = greedy(*w, nullptr, prompt, 3);
  auto got = over_ranks(*w, 3, [&](const ModelWeights& s, Communicator& c) {
    auto g = greedy(s, &c, prompt, 3);
    if (c.rank() == 0) {
      EXPECT_EQ(g.first, ref.first);
    }
    return g.second;
  });
  EXPECT_EQ(got[2], got[0]);
  const Diff d = compare(got[0], ref.second);
  EXPECT_LT(d.max_abs, kTol * std::max(1.0, d.max_ref)) << "max |ref| " << d.max_ref;
  EXPECT_EQ(shard_error(*w, 0, 2), "--tp 2: 3 KV heads are not divisible by 2");
}

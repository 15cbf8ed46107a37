// GGUF reader: tiny files written here, metadata and tensors read back, and every
// malformed-input path raising spade::Error (never a crash).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>

#include "core/error.h"
#include "gguf_test_writer.h"
#include "io/dequant.h"
#include "io/gguf.h"

namespace spade {
namespace {

using test::GgufTensorSpec;
using test::GgufWriter;

std::unique_ptr<GgufFile> parse(const std::vector<uint8_t>& b) {
  return GgufFile::parse(b.data(), b.size(), "test.gguf");
}

// Expects spade::Error whose message contains every one of `parts`.
void expect_error(const std::vector<uint8_t>& b, std::initializer_list<const char*> parts) {
  try {
    parse(b);
    ADD_FAILURE() << "parsed without error; expected: " << *parts.begin();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
  }
}

std::vector<float> iota(size_t n, float start = 0.f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + float(i);
  return v;
}

GgufWriter sample_writer(uint32_t version = 3) {
  GgufWriter w(version);
  w.kv_str("general.architecture", "llama");
  w.kv_u32("llama.block_count", 2);
  w.kv_i32("some.int", -7);
  w.kv_f32("llama.rope.freq_base", 100000.f);
  w.kv_bool("some.flag", true);
  w.kv_u64("some.u64", 1ull << 40);
  w.kv_u8("some.u8", 200);
  w.kv_i64("some.i64", -(1ll << 40));
  w.kv_f64("some.f64", 0.125);
  w.kv_str_array("tokenizer.ggml.tokens", {"<unk>", "a", "bc", ""});
  w.kv_i32_array("some.ints", {1, -2, 3});
  w.kv_f32_array("some.floats", {0.5f, -1.5f});
  w.tensor_f32("a.weight", {3, 2}, iota(6));  // ne [3, 2] -> shape [2, 3]
  // Q8_0 [32, 2]: two blocks, d = 1 (f16 0x3c00), q = j - 16.
  GgufTensorSpec q{"q.weight", {32, 2}, 8, {}, {}, {}};
  for (int b = 0; b < 2; ++b) {
    q.data.push_back(0x00);
    q.data.push_back(0x3c);
    for (int j = 0; j < 32; ++j) q.data.push_back(uint8_t(int8_t(j - 16 + b)));
  }
  w.tensor(q);
  w.tensor({"q5.weight", {32}, 6, std::vector<uint8_t>(22, 0), {}, {}});  // q5_0: unsupported
  w.tensor_f32("last.weight", {4}, iota(4, 10.f));
  return w;
}

TEST(Gguf, ParsesMetadataOfEveryType) {
  auto bytes = sample_writer().build();
  auto g = parse(bytes);
  EXPECT_EQ(g->version(), 3u);
  EXPECT_EQ(g->metadata().size(), 12u);
  EXPECT_EQ(g->get_string("general.architecture"), "llama");
  EXPECT_EQ(g->get_int("llama.block_count"), 2);
  EXPECT_EQ(g->get_int("some.int"), -7);
  EXPECT_EQ(g->get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(g->get_int("some.flag"), 1);
  EXPECT_EQ(g->get_int("some.u64"), int64_t(1) << 40);
  EXPECT_EQ(g->get_int("some.u8"), 200);
  EXPECT_EQ(g->get_int("some.i64"), -(int64_t(1) << 40));
  EXPECT_EQ(g->get_float("some.f64"), 0.125);
  EXPECT_EQ(g->get_float("some.int"), -7.0);  // integers read as numbers too
  const GgufValue* tok = g->find("tokenizer.ggml.tokens");
  ASSERT_TRUE(tok && tok->is_array());
  EXPECT_EQ(tok->elem_type, GgufValueType::STRING);
  EXPECT_EQ(tok->strings, (std::vector<std::string>{"<unk>", "a", "bc", ""}));
  EXPECT_EQ(g->get_array_size("tokenizer.ggml.tokens"), 4u);
  EXPECT_EQ(g->find("some.ints")->numbers, (std::vector<double>{1, -2, 3}));
  EXPECT_EQ(g->find("some.floats")->numbers, (std::vector<double>{0.5, -1.5}));
  EXPECT_FALSE(g->get_int_opt("missing").has_value());
  EXPECT_EQ(*g->get_string_opt("general.architecture"), "llama");
}

TEST(Gguf, TypedGettersNameTheKey) {
  auto bytes = sample_writer().build();
  auto g = parse(bytes);
  try {
    g->get_int("llama.context_length");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("llama.context_length"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("test.gguf"), std::string::npos);
  }
  EXPECT_THROW(g->get_int("general.architecture"), Error);
  EXPECT_THROW(g->get_string("llama.block_count"), Error);
  EXPECT_THROW(g->get_float("tokenizer.ggml.tokens"), Error);
  EXPECT_THROW(g->get_array_size("some.int"), Error);
}

TEST(Gguf, ReadsTensorsInRowMajorOrder) {
  for (uint32_t version : {2u, 3u}) {
    auto bytes = sample_writer(version).build();
    auto g = parse(bytes);
    EXPECT_EQ(g->version(), version);
    ASSERT_EQ(g->tensors().size(), 4u);
    EXPECT_EQ(g->alignment(), 32u);
    EXPECT_EQ(g->data_offset() % 32, 0u);

    const GgufTensorInfo* a = g->find_tensor("a.weight");
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(a->ne, (std::vector<int64_t>{3, 2}));
    EXPECT_EQ(a->shape(), (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(a->numel(), 6);
    EXPECT_EQ(a->nbytes, 24u);
    TensorView v = g->view(*a);
    EXPECT_EQ(v.ndim, 2);
    EXPECT_EQ(v.shape[0], 2);
    EXPECT_EQ(v.shape[1], 3);
    for (int i = 0; i < 6; ++i) EXPECT_EQ(v.as<const float>()[i], float(i));

    TensorView q = g->view("q.weight");
    EXPECT_EQ(q.dtype, DType::Q8_0);
    EXPECT_EQ(q.shape[0], 2);
    EXPECT_EQ(q.shape[1], 32);
    std::vector<float> out(64);
    dequantize(q.dtype, q.data, out.data(), 64);
    for (int b = 0; b < 2; ++b)
      for (int j = 0; j < 32; ++j) EXPECT_EQ(out[size_t(32 * b + j)], float(j - 16 + b));

    TensorView last = g->view("last.weight");
    EXPECT_EQ(last.as<const float>()[3], 13.f);
  }
}

TEST(Gguf, UnsupportedTypeParsesButErrorsOnDataRequest) {
  GgufWriter w = sample_writer();
  w.tensor({"weird.weight", {8}, 200, {}, uint64_t(0), {}});  // id unknown to ggml
  auto bytes = w.build();
  auto g = parse(bytes);
  const GgufTensorInfo* q5 = g->find_tensor("q5.weight");
  ASSERT_NE(q5, nullptr);
  EXPECT_FALSE(q5->dtype_known);
  EXPECT_EQ(q5->ggml_type, 6u);
  EXPECT_EQ(q5->type_name(), "q5_0");
  EXPECT_EQ(q5->nbytes, 22u);
  try {
    g->view(*q5);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("q5.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("q5_0"), std::string::npos) << m;
  }
  const GgufTensorInfo* weird = g->find_tensor("weird.weight");
  ASSERT_NE(weird, nullptr);
  EXPECT_EQ(weird->type_name(), "ggml_type_200");
  EXPECT_THROW(g->view(*weird), Error);
  EXPECT_THROW(g->view("no.such.tensor"), Error);
}

TEST(Gguf, HonorsCustomAlignment) {
  GgufWriter w(3, 64);
  w.kv_u32("general.alignment", 64);
  w.tensor_f32("x", {5}, iota(5));
  w.tensor_f32("y", {3}, iota(3, 100.f));
  auto bytes = w.build();
  auto g = parse(bytes);
  EXPECT_EQ(g->alignment(), 64u);
  EXPECT_EQ(g->data_offset() % 64, 0u);
  EXPECT_EQ(g->find_tensor("y")->offset, 64u);
  EXPECT_EQ(g->view("y").as<const float>()[2], 102.f);
}

TEST(Gguf, VocabOnlyFileWithoutTensors) {
  GgufWriter w;
  w.kv_str("tokenizer.ggml.model", "gpt2");
  auto bytes = w.build();
  auto g = parse(bytes);
  EXPECT_TRUE(g->tensors().empty());
  EXPECT_EQ(g->get_string("tokenizer.ggml.model"), "gpt2");
}

TEST(GgufErrors, BadHeader) {
  auto good = sample_writer().build();
  auto b = good;
  b[0] = 'X';
  expect_error(b, {"test.gguf", "magic"});
  b = good;
  b[4] = 1;
  expect_error(b, {"version 1"});
  b = good;
  b[4] = 4;
  expect_error(b, {"version 4"});
  b = good;
  b[4] = 0, b[7] = 3;
  expect_error(b, {"big-endian"});
  expect_error({}, {"truncated", "magic"});
}

TEST(GgufErrors, TruncatedAtEveryByte) {
  auto good = sample_writer().build();
  for (size_t n = 0; n < good.size(); ++n) {
    std::vector<uint8_t> b(good.begin(), good.begin() + long(n));
    EXPECT_THROW(parse(b), Error) << "prefix of " << n << " bytes";
  }
  EXPECT_NO_THROW(parse(good));
}

TEST(GgufErrors, AbsurdCounts) {
  auto good = sample_writer().build();
  auto b = good;
  uint64_t huge = uint64_t(1) << 60;
  std::memcpy(&b[8], &huge, 8);  // tensor_count
  expect_error(b, {"tensor_count"});
  b = good;
  std::memcpy(&b[16], &huge, 8);  // metadata_kv_count
  expect_error(b, {"metadata_kv_count"});
  b = good;
  uint64_t more = 30;  // passes the size bound, but the file runs out of kv pairs
  std::memcpy(&b[16], &more, 8);
  EXPECT_THROW(parse(b), Error);
}

TEST(GgufErrors, AbsurdStringLength) {
  auto good = sample_writer().build();
  auto b = good;
  uint64_t huge = ~uint64_t(0) - 3;
  std::memcpy(&b[24], &huge, 8);  // first key's length
  expect_error(b, {"metadata key #0", "string length"});
}

std::vector<uint8_t> with_kv(std::function<void(test::ByteSink&)> body) {
  test::ByteSink s;
  body(s);
  GgufWriter w;
  w.kv_str("general.architecture", "llama");
  w.kv_raw(s.bytes);
  w.tensor_f32("x", {2}, {1.f, 2.f});
  return w.build();
}

TEST(GgufErrors, BadValues) {
  expect_error(with_kv([](test::ByteSink& s) {
                 s.put_str("k");
                 s.put<uint32_t>(13);  // no such value type
               }),
               {"'k'", "unknown GGUF value type 13"});
  expect_error(with_kv([](test::ByteSink& s) {
                 s.put_str("nested");
                 s.put<uint32_t>(9);
                 s.put<uint32_t>(9);  // array of arrays
                 s.put<uint64_t>(1);
               }),
               {"'nested'", "nested arrays"});
  expect_error(with_kv([](test::ByteSink& s) {
                 s.put_str("arr");
                 s.put<uint32_t>(9);
                 s.put<uint32_t>(5);
                 s.put<uint64_t>(uint64_t(1) << 62);  // int32 elements: far beyond the file
               }),
               {"'arr'", "array length"});
  expect_error(with_kv([](test::ByteSink& s) {
                 s.put_str("strs");
                 s.put<uint32_t>(9);
                 s.put<uint32_t>(8);
                 s.put<uint64_t>(1000000);
               }),
               {"'strs'", "array length"});
  expect_error(with_kv([](test::ByteSink& s) {
                 s.put_str("general.architecture");  // duplicate key
                 s.put<uint32_t>(8);
                 s.put_str("qwen2");
               }),
               {"duplicate metadata key 'general.architecture'"});
}

TEST(GgufErrors, BadAlignment) {
  for (uint32_t al : {0u, 3u, 48u, 1u << 30}) {
    GgufWriter w;
    w.kv_u32("general.alignment", al);
    w.tensor_f32("x", {2}, {1.f, 2.f});
    expect_error(w.build(), {"general.alignment"});
  }
  GgufWriter w;
  w.kv_str("general.alignment", "32");
  w.tensor_f32("x", {2}, {1.f, 2.f});
  expect_error(w.build(), {"general.alignment", "integer"});
}

std::vector<uint8_t> one_tensor(GgufTensorSpec t) {
  GgufWriter w;
  w.kv_str("general.architecture", "llama");
  w.tensor_f32("ok", {2}, {1.f, 2.f});
  w.tensor(std::move(t));
  return w.build();
}

TEST(GgufErrors, BadTensorInfo) {
  expect_error(one_tensor({"t", {1, 1, 1, 1, 1}, 0, test::f32_bytes({1}), {}, {}}),
               {"tensor 't'", "n_dims 5"});
  expect_error(one_tensor({"t", {}, 0, {}, {}, {}}), {"tensor 't'", "n_dims 0"});
  expect_error(one_tensor({"t", {4, 0}, 0, {}, {}, {}}), {"tensor 't'", "ne[1] = 0"});
  expect_error(one_tensor({"t", {1ull << 32, 1ull << 32}, 0, {}, {}, {}}),
               {"tensor 't'", "overflows"});
  expect_error(one_tensor({"t", {1ull << 63}, 0, {}, {}, {}}), {"tensor 't'", "ne[0]"});
  // In range of int64 but too many bytes: 2^61 f32 elements.
  expect_error(one_tensor({"t", {1ull << 61}, 0, {}, {}, {}}), {"tensor 't'"});
  expect_error(one_tensor({"t", {2}, 0, test::f32_bytes({1, 2}), uint64_t(1) << 40, {}}),
               {"tensor 't'", "outside the file"});
  expect_error(one_tensor({"t", {2}, 0, test::f32_bytes({1, 2}), uint64_t(4), {}}),
               {"tensor 't'", "not a multiple of the alignment"});
  expect_error(one_tensor({"t", {64}, 0, test::f32_bytes({1, 2}), {}, {}}),
               {"tensor 't'", "beyond the end of the file"});
  expect_error(one_tensor({"t", {31, 2}, 8, std::vector<uint8_t>(68), {}, {}}),
               {"tensor 't'", "not a multiple of the q8_0 block size 32"});
  expect_error(one_tensor({"ok", {2}, 0, test::f32_bytes({1, 2}), {}, {}}),
               {"duplicate tensor name 'ok'"});
}

TEST(GgufErrors, TensorDataSectionBeyondFile) {
  GgufWriter w;
  w.tensor({"t", {1}, 0, {}, uint64_t(0), {}});  // no data bytes at all
  auto b = w.build();
  b.resize(b.size() - 1);  // cut into the alignment padding too
  EXPECT_THROW(parse(b), Error);
}

// Random byte mutations of a valid file: every outcome is a parse or a spade::Error.
TEST(GgufErrors, RandomMutationsNeverCrash) {
  auto good = sample_writer().build();
  std::mt19937 rng(1234);
  int parsed = 0;
  for (int it = 0; it < 3000; ++it) {
    auto b = good;
    int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      size_t at = rng() % b.size();
      if (rng() % 2) b[at] = uint8_t(rng());
      else b[at] ^= uint8_t(1u << (rng() % 8));
    }
    if (rng() % 8 == 0) b.resize(rng() % b.size());
    try {
      auto g = parse(b);
      for (const auto& t : g->tensors()) {
        if (!t.dtype_known) continue;
        TensorView v = g->view(t);
        std::vector<float> out(size_t(t.numel()));
        dequantize(v.dtype, v.data, out.data(), t.numel());
      }
      ++parsed;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(parsed, 0);
}

}  // namespace
}  // namespace spade

// Dequantization against gguf-py's decoder (fixtures from python/make_dequant_fixtures.py),
// fp16/bf16 against a from-the-definition decoder, and hand-computed blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "io/dequant.h"

namespace spade {
namespace {

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << "missing fixture " << path;
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

struct FixtureCase {
  const char* name;
  DType dtype;
};

class DequantFixture : public ::testing::TestWithParam<FixtureCase> {};

// Tolerance: 1e-6 relative to the value, or to the largest value of its block where the
// value itself is a near-cancellation (d*q - m). In practice the match is exact.
TEST_P(DequantFixture, MatchesGgufPy) {
  const FixtureCase& c = GetParam();
  std::string dir = std::string(SPADE_SOURCE_DIR) + "/tests/fixtures/dequant/";
  std::vector<uint8_t> raw = read_bytes(dir + c.name + ".bin");
  std::vector<uint8_t> ref_bytes = read_bytes(dir + c.name + ".f32");
  ASSERT_FALSE(raw.empty());
  size_t n = ref_bytes.size() / 4;
  std::vector<float> ref(n);
  std::memcpy(ref.data(), ref_bytes.data(), n * 4);
  const DTypeInfo& info = dtype_info(c.dtype);
  ASSERT_EQ(raw.size(), n / size_t(info.block_elems) * size_t(info.block_bytes));

  std::vector<float> out(n, -12345.f);
  dequantize(c.dtype, raw.data(), out.data(), int64_t(n));
  const size_t be = size_t(info.block_elems);
  size_t exact = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(ref[i])) {
      EXPECT_TRUE(std::isnan(out[i])) << c.name << " element " << i;
      continue;
    }
    float block_max = 0;
    for (size_t k = i / be * be; k < (i / be + 1) * be; ++k)
      if (!std::isnan(ref[k]) && !std::isinf(ref[k])) block_max = std::max(block_max, std::fabs(ref[k]));
    float tol = 1e-6f * std::max(std::fabs(ref[i]), block_max);
    if (std::isinf(ref[i])) {
      EXPECT_EQ(out[i], ref[i]) << c.name << " element " << i;
    } else {
      EXPECT_NEAR(out[i], ref[i], tol) << c.name << " element " << i;
    }
    exact += std::memcmp(&out[i], &ref[i], 4) == 0;
  }
  RecordProperty("exact_matches", int(exact));
}

INSTANTIATE_TEST_SUITE_P(AllTypes, DequantFixture,
                         ::testing::Values(FixtureCase{"f32", DType::F32},
                                           FixtureCase{"f16", DType::F16},
                                           FixtureCase{"bf16", DType::BF16},
                                           FixtureCase{"q8_0", DType::Q8_0},
                                           FixtureCase{"q4_0", DType::Q4_0},
                                           FixtureCase{"q4_1", DType::Q4_1},
                                           FixtureCase{"q4_k", DType::Q4_K},
                                           FixtureCase{"q5_k", DType::Q5_K},
                                           FixtureCase{"q6_k", DType::Q6_K}),
                         [](const auto& info) { return std::string(info.param.name); });

// IEEE binary16 from its definition: (-1)^s * 2^(e-15) * 1.m, subnormals 2^-14 * 0.m.
float naive_f16(uint16_t h) {
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) v = std::ldexp(double(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(double(1024 + m), e - 25);
  return float(s ? -v : v);
}

// bfloat16: 8-bit exponent (bias 127), 7-bit mantissa.
float naive_bf16(uint16_t h) {
  int s = h >> 15, e = (h >> 7) & 255, m = h & 127;
  double v;
  if (e == 0) v = std::ldexp(double(m), -133);
  else if (e == 255) v = m ? NAN : INFINITY;
  else v = std::ldexp(double(128 + m), e - 134);
  return float(s ? -v : v);
}

TEST(Dequant, F16AllBitPatternsMatchDefinition) {
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[size_t(i)] = uint16_t(i);
  std::vector<float> out(65536);
  dequantize(DType::F16, all.data(), out.data(), 65536);
  for (int i = 0; i < 65536; ++i) {
    float want = naive_f16(uint16_t(i));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[size_t(i)])) << std::hex << i;
    } else {
      ASSERT_EQ(out[size_t(i)], want) << "f16 bits 0x" << std::hex << i;
      ASSERT_EQ(std::signbit(out[size_t(i)]), std::signbit(want)) << std::hex << i;
    }
  }
}

TEST(Dequant, Bf16AllBitPatternsMatchDefinition) {
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[size_t(i)] = uint16_t(i);
  std::vector<float> out(65536);
  dequantize(DType::BF16, all.data(), out.data(), 65536);
  for (int i = 0; i < 65536; ++i) {
    float want = naive_bf16(uint16_t(i));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[size_t(i)])) << std::hex << i;
    } else {
      ASSERT_EQ(out[size_t(i)], want) << "bf16 bits 0x" << std::hex << i;
      ASSERT_EQ(std::signbit(out[size_t(i)]), std::signbit(want)) << std::hex << i;
    }
  }
}

TEST(Dequant, F32ToHalfRoundTripsEveryFiniteHalf) {
  for (int i = 0; i < 65536; ++i) {
    float f = naive_f16(uint16_t(i));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), uint16_t(i)) << std::hex << i;
  }
}

TEST(Dequant, HandComputedQ8_0AndQ4_0AndQ4_1) {
  // Q8_0: d = 0.5 (f16 0x3800), q = -16..15 -> x = q / 2.
  std::vector<uint8_t> q8(34);
  q8[0] = 0x00, q8[1] = 0x38;
  for (int j = 0; j < 32; ++j) q8[size_t(2 + j)] = uint8_t(int8_t(j - 16));
  std::vector<float> y(32);
  dequantize(DType::Q8_0, q8.data(), y.data(), 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[size_t(j)], 0.5f * float(j - 16)) << j;

  // Q4_0: d = 2 (0x4000); byte j = low nibble j%16, high nibble 15-j%16.
  std::vector<uint8_t> q4(18);
  q4[0] = 0x00, q4[1] = 0x40;
  for (int j = 0; j < 16; ++j) q4[size_t(2 + j)] = uint8_t(j | ((15 - j) << 4));
  dequantize(DType::Q4_0, q4.data(), y.data(), 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[size_t(j)], 2.f * float(j - 8)) << j;
    EXPECT_EQ(y[size_t(j + 16)], 2.f * float(15 - j - 8)) << j;
  }

  // Q4_1: d = 0.25 (0x3400), m = -1 (0xbc00): x = code/4 - 1.
  std::vector<uint8_t> q41(20);
  q41[0] = 0x00, q41[1] = 0x34, q41[2] = 0x00, q41[3] = 0xbc;
  for (int j = 0; j < 16; ++j) q41[size_t(4 + j)] = uint8_t(j | ((15 - j) << 4));
  dequantize(DType::Q4_1, q41.data(), y.data(), 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[size_t(j)], 0.25f * float(j) - 1.f) << j;
    EXPECT_EQ(y[size_t(j + 16)], 0.25f * float(15 - j) - 1.f) << j;
  }
}

TEST(Dequant, HandComputedQ6_KScalesAndHighBits) {
  // All low nibbles 0, all high 2-bit fields 2 -> code 32 -> x = 0; then set value 0's
  // code to 63 (low nibble 15, high bits 3): x = d * scale0 * 31.
  std::vector<uint8_t> b(210, 0);
  for (int i = 0; i < 64; ++i) b[size_t(128 + i)] = 0xAA;  // every 2-bit field = 2
  for (int i = 0; i < 16; ++i) b[size_t(192 + i)] = uint8_t(int8_t(i - 8));
  b[208] = 0x00, b[209] = 0x3c;  // d = 1
  b[0] = 0x0F;
  b[128] = 0xAB;  // value 0's high bits = 3
  std::vector<float> y(256);
  dequantize(DType::Q6_K, b.data(), y.data(), 256);
  EXPECT_EQ(y[0], -8.f * 31.f);
  for (int i = 1; i < 256; ++i) EXPECT_EQ(y[size_t(i)], 0.f) << i;
}

TEST(Dequant, ParallelMatchesSerialOnLargeInput) {
  for (DType t : {DType::Q4_K, DType::Q8_0, DType::BF16}) {
    const DTypeInfo& info = dtype_info(t);
    const int64_t blocks = 3001;  // odd, so chunks are uneven
    std::vector<uint8_t> raw(size_t(blocks * info.block_bytes));
    std::mt19937 rng(7);
    for (auto& x : raw) x = uint8_t(rng());
    // Keep f16 scale fields finite so NaN != NaN does not spoil the comparison.
    if (t != DType::BF16)
      for (int64_t b = 0; b < blocks; ++b) raw[size_t(b * info.block_bytes + 1)] &= 0x3f;
    if (t == DType::Q4_K)
      for (int64_t b = 0; b < blocks; ++b) raw[size_t(b * info.block_bytes + 3)] &= 0x3f;
    const int64_t n = blocks * info.block_elems;
    std::vector<float> a(static_cast<size_t>(n)), s(static_cast<size_t>(n));
    dequantize(t, raw.data(), a.data(), n);
    dequantize_serial(t, raw.data(), s.data(), n);
    ASSERT_EQ(std::memcmp(a.data(), s.data(), a.size() * 4), 0) << dtype_name(t);
  }
}

TEST(Dequant, RejectsPartialBlocksAndIntegerTypes) {
  std::vector<uint8_t> raw(1024);
  std::vector<float> out(1024);
  EXPECT_THROW(dequantize(DType::Q8_0, raw.data(), out.data(), 31), Error);
  EXPECT_THROW(dequantize(DType::Q4_K, raw.data(), out.data(), 255), Error);
  EXPECT_THROW(dequantize(DType::I32, raw.data(), out.data(), 4), Error);
  EXPECT_THROW(dequantize(DType::I8, raw.data(), out.data(), 4), Error);
  EXPECT_NO_THROW(dequantize(DType::Q4_K, raw.data(), out.data(), 0));
}

}  // namespace
}  // namespace spade

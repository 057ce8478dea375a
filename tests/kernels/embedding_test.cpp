#include "kernels/cpu/embedding.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernels/cpu/op_util.h"
#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::make_weight;
using testing::Weight;

// Gathering is a conversion of stored values, which is exact in fp32 for all three dtypes:
// the result must equal the reference bit for bit (tolerance 0).
TEST(EmbeddingTest, GathersRowsForEveryDtype) {
  CpuContext ctx(3);
  const int64_t vocab = 97, hidden = 40;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    const Weight table = make_weight(dtype, {vocab, hidden}, 11);
    std::vector<int32_t> ids = {0, 96, 5, 5, 42, 1, 95, 17};
    std::vector<float> out(ids.size() * hidden, -7.0f);
    ASSERT_TRUE(embedding(ctx, table.view(), ids, out).is_ok());
    for (size_t t = 0; t < ids.size(); ++t) {
      for (int64_t c = 0; c < hidden; ++c) {
        ASSERT_EQ(out[t * hidden + c], table.value[ids[t] * hidden + c])
            << dtype_name(dtype) << " token " << t << " col " << c;
      }
    }
  }
}

// Large enough to be split over the pool.
TEST(EmbeddingTest, ManyTokensInParallel) {
  CpuContext ctx(4);
  const int64_t vocab = 1000, hidden = 256;
  const Weight table = make_weight(DType::kBF16, {vocab, hidden}, 12);
  std::vector<int32_t> ids(3000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7919) % vocab);
  std::vector<float> out(ids.size() * hidden);
  ASSERT_TRUE(embedding(ctx, table.view(), ids, out).is_ok());
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t c = 0; c < hidden; ++c) {
      ASSERT_EQ(out[t * hidden + c], table.value[ids[t] * hidden + c]);
    }
  }
}

TEST(EmbeddingTest, OutOfRangeIdIsAnErrorAndWritesNothing) {
  CpuContext ctx(2);
  const Weight table = make_weight(DType::kF32, {10, 4}, 13);
  for (int32_t bad : {-1, 10, 1 << 30}) {
    std::vector<int32_t> ids = {1, 2, bad};
    std::vector<float> out(ids.size() * 4, 123.0f);
    Status st = embedding(ctx, table.view(), ids, out);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find(std::to_string(bad)), std::string::npos) << st.message();
    for (float v : out) EXPECT_EQ(v, 123.0f);
  }
}

TEST(EmbeddingTest, ShapeErrors) {
  CpuContext ctx(1);
  const Weight table = make_weight(DType::kF32, {10, 4}, 14);
  std::vector<int32_t> ids = {1, 2};
  std::vector<float> short_out(7);
  EXPECT_EQ(embedding(ctx, table.view(), ids, short_out).code(), Code::kInvalidArgument);
  TensorView one_d{table.f32.data(), DType::kF32, {40}};
  std::vector<float> out(8);
  EXPECT_EQ(embedding(ctx, one_d, ids, out).code(), Code::kInvalidArgument);
}

// The fast fp16 conversion used for weights agrees with common's for all 65536 bit patterns
// (NaNs compared by bits).
TEST(EmbeddingTest, HalfConversionMatchesCommonForEveryBitPattern) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const float a = detail::half_to_float(static_cast<uint16_t>(h));
    const float b = f16_to_float(static_cast<uint16_t>(h));
    uint32_t ab, bb;
    std::memcpy(&ab, &a, 4);
    std::memcpy(&bb, &b, 4);
    ASSERT_EQ(ab, bb) << "half bits 0x" << std::hex << h;
  }
}

}  // namespace
}  // namespace tessera::cpu

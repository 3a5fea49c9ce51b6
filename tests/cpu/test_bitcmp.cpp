// The bit-pattern comparator: equality means equal uint32 patterns, and the first mismatch is
// reported with its index, both values in %a and both bit patterns.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "detlogp/bitcmp.hpp"

namespace bc = detlogp::bitcmp;

TEST(BitCompare, IdenticalArraysHaveNoMismatch) {
  const std::vector<float> a = {0.0f,
                                -0.0f,
                                1.5f,
                                -3.25e-7f,
                                std::numeric_limits<float>::infinity(),
                                bc::float_from_bits(0x7FC00000u),
                                bc::float_from_bits(0x00000001u)};
  const std::vector<float> b = a;
  const bc::Result r = bc::compare(a, b);
  EXPECT_TRUE(r.identical());
  EXPECT_TRUE(static_cast<bool>(r));
  EXPECT_EQ(r.mismatches, 0);
  EXPECT_EQ(r.compared, static_cast<int64_t>(a.size()));
  EXPECT_FALSE(r.first.has_value());
  EXPECT_EQ(r.describe("logp"), "logp: 7 elements bit-identical");
}

TEST(BitCompare, NegativeZeroDiffersFromPositiveZero) {
  const float pos = 0.0f, neg = -0.0f;
  ASSERT_TRUE(pos == neg);  // equal as values...
  const bc::Result r = bc::compare(&pos, &neg, 1);
  EXPECT_EQ(r.mismatches, 1);  // ...but not as bits
  ASSERT_TRUE(r.first.has_value());
  EXPECT_EQ(r.first->index, 0);
  EXPECT_EQ(r.first->expected_bits, 0x00000000u);
  EXPECT_EQ(r.first->actual_bits, 0x80000000u);
}

TEST(BitCompare, NanPayloadsDifferAndSameNanBitsMatch) {
  const float canonical = bc::float_from_bits(0x7FC00000u);
  const float payload = bc::float_from_bits(0x7FC00001u);
  const float negative = bc::float_from_bits(0xFFC00000u);
  EXPECT_EQ(bc::compare(&canonical, &payload, 1).mismatches, 1);
  EXPECT_EQ(bc::compare(&canonical, &negative, 1).mismatches, 1);
  EXPECT_EQ(bc::compare(&canonical, &canonical, 1).mismatches, 0);  // NaN != NaN as values, equal as bits
}

TEST(BitCompare, CountsAllMismatchesAndReportsTheFirst) {
  std::vector<float> expected(100), actual(100);
  for (int i = 0; i < 100; ++i) expected[i] = actual[i] = 0.125f * static_cast<float>(i);
  actual[37] = std::nextafter(expected[37], 100.0f);  // one ulp up: 4.625 -> 4.625 + 2^-21
  actual[80] = -expected[80];
  const bc::Result r = bc::compare(expected, actual);
  EXPECT_EQ(r.compared, 100);
  EXPECT_EQ(r.mismatches, 2);
  ASSERT_TRUE(r.first.has_value());
  EXPECT_EQ(r.first->index, 37);
  EXPECT_EQ(r.first->expected, 4.625f);
  EXPECT_EQ(r.first->expected_bits, 0x40940000u);
  EXPECT_EQ(r.first->actual_bits, 0x40940001u);
  EXPECT_EQ(r.describe("lse"),
            "lse: 2 of 100 elements differ; first at [37]: expected 0x1.28p+2 (0x40940000), "
            "actual 0x1.280002p+2 (0x40940001)");
}

TEST(BitCompare, DescribeFloatPrintsHexFloatAndBits) {
  EXPECT_EQ(bc::describe_float(1.0f), "0x1p+0 (0x3F800000)");
  EXPECT_EQ(bc::describe_float(-0.0f), "-0x0p+0 (0x80000000)");
  EXPECT_EQ(bc::describe_float(bc::float_from_bits(0x00000001u)), "0x1p-149 (0x00000001)");
}

TEST(BitCompare, LengthDifferenceCountsAsMismatch) {
  const std::vector<float> a = {1.0f, 2.0f, 3.0f};
  const std::vector<float> b = {1.0f, 2.0f};
  const bc::Result r = bc::compare(a, b);
  EXPECT_EQ(r.compared, 3);
  EXPECT_EQ(r.mismatches, 1);
  ASSERT_TRUE(r.first.has_value());
  EXPECT_EQ(r.first->index, 2);
  EXPECT_EQ(r.first->expected, 3.0f);
}

TEST(BitCompare, StridedRowsReportFlatIndex) {
  // 3 rows of 4 columns; the actual matrix has a row stride of 6.
  std::vector<float> expected(12), actual(18, -1.0f);
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 4; ++c) expected[r * 4 + c] = actual[r * 6 + c] = static_cast<float>(r * 10 + c);
  EXPECT_TRUE(bc::compare_rows(expected.data(), 4, actual.data(), 6, 3, 4).identical());
  actual[2 * 6 + 1] = 99.0f;
  const bc::Result r = bc::compare_rows(expected.data(), 4, actual.data(), 6, 3, 4);
  EXPECT_EQ(r.mismatches, 1);
  ASSERT_TRUE(r.first.has_value());
  EXPECT_EQ(r.first->index, 2 * 4 + 1);
  EXPECT_EQ(r.first->expected, 21.0f);
  EXPECT_EQ(r.first->actual, 99.0f);
}

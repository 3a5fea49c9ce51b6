// Special values of the contract transcendentals and a fast sampled accuracy check (the
// exhaustive scan is test_transcendentals_exhaustive, label `exhaustive`).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "detlogp/transcendentals.hpp"
#include "test_util.hpp"
#include "transcendental_check.hpp"

using detlogp::expc;
using detlogp::logc;
using detlogp::fp::bits;
using detlogp::fp::from_bits;

namespace {
constexpr float kInf = std::numeric_limits<float>::infinity();
}

TEST(Expc, SpecialValues) {
  EXPECT_EQ(bits(expc(0.0f)), bits(1.0f));
  EXPECT_EQ(bits(expc(-0.0f)), bits(1.0f));
  EXPECT_EQ(bits(expc(-kInf)), 0x00000000u);  // +0, not -0
  EXPECT_TRUE(std::isnan(expc(from_bits(0x7FC00000u))));
  EXPECT_TRUE(std::isnan(expc(from_bits(0xFFC00001u))));
  EXPECT_EQ(bits(expc(-104.5f)), 0x00000000u);
  EXPECT_EQ(bits(expc(std::nextafter(-104.0f, -kInf))), 0x00000000u);
  EXPECT_EQ(bits(expc(-1e30f)), 0x00000000u);
  EXPECT_EQ(bits(expc(-std::numeric_limits<float>::max())), 0x00000000u);
  // Tiny arguments round to 1 (e^x = 1 + x within half an ulp of 1 for |x| < 2^-25).
  EXPECT_EQ(bits(expc(-0x1p-30f)), bits(1.0f));
  EXPECT_EQ(bits(expc(-from_bits(1u))), bits(1.0f));
  // Monotone non-increasing as the argument decreases, on a sample across the domain.
  float prev = expc(0.0f);
  for (float x = -0.001f; x >= -104.0f; x -= 0.37f) {
    const float e = expc(x);
    EXPECT_LE(e, prev) << "x = " << x;
    prev = e;
  }
}

TEST(Expc, SubnormalResultsNearTheUnderflowThreshold) {
  // e^-100 ~ 3.7e-44 is subnormal: the result must be a subnormal within 1 ulp (2^-149).
  for (float x : {-87.4f, -88.0f, -95.0f, -100.0f, -103.0f, -103.9f, -104.0f}) {
    const double ref = std::exp(static_cast<double>(x));
    const double err = std::fabs(static_cast<double>(expc(x)) - ref) / detlogp_test::fp32_ulp_of(ref);
    EXPECT_LE(err, 1.0) << "x = " << x;
    EXPECT_GE(expc(x), 0.0f);
  }
}

TEST(Expc, SampledAccuracyWithinOneUlp) {
  // Every 997th float of the domain [-104, -0]: a 1.1M-value sample of the exhaustive scan.
  detlogp_test::UlpScan worst;
  for (uint32_t b = 0x80000000u; b <= 0xC2D00000u; b += 997u) {
    const float x = from_bits(b);
    const double ref = std::exp(static_cast<double>(x));
    const double err = std::fabs(static_cast<double>(expc(x)) - ref) / detlogp_test::fp32_ulp_of(ref);
    if (err > worst.max_ulp) {
      worst.max_ulp = err;
      worst.worst_bits = b;
    }
  }
  std::printf("expc sampled max error %.4f ulp at x = %a\n", worst.max_ulp,
              static_cast<double>(from_bits(worst.worst_bits)));
  EXPECT_LE(worst.max_ulp, 1.0);
}

TEST(Expc, ScaleOverflowsToInfFromKEquals128) {
  // Outside the contract's domain (x <= 0), pinned as implemented (docs/contract.md 4.1 step 5):
  // k = 128 builds 2^k as +inf, so +inf already from x = 0x1.61814ep+6 (88.376...), below kOverflow.
  const float first_inf = 0x1.61814ep+6f;
  EXPECT_EQ(detlogp::fp::bits(expc(first_inf)), detlogp::fp::bits(kInf));
  EXPECT_EQ(detlogp::fp::bits(expc(detlogp::expc_constants::kOverflow)), detlogp::fp::bits(kInf));
  const float last_finite = std::nextafter(first_inf, 0.0f);
  EXPECT_TRUE(std::isfinite(expc(last_finite))) << expc(last_finite);
  EXPECT_GT(expc(last_finite), 0x1.6p+127f);
}

TEST(Expc, NormalPathVariantGivesTheSameBitsOnSamples) {
  // The exhaustive suite covers the whole domain; here: both ends, and a million samples.
  for (float x : {detlogp::kExpcNormalMin, std::nextafter(detlogp::kExpcNormalMin, 0.0f), -1e-30f, -0.0f, 0.0f, -1.0f,
                  -0.5f, -86.99f, 1.0f, 87.5f, detlogp::kExpcNormalMax})
    EXPECT_EQ(detlogp::fp::bits(detlogp::expc_normal(x)), detlogp::fp::bits(expc(x))) << "x = " << x;
  detlogp_test::Rng rng(1);
  int differ = 0;
  for (int i = 0; i < 1000000; ++i) {
    const float x = detlogp::kExpcNormalMin * rng.next_unit_float();  // [-87, 0]
    differ += detlogp::fp::bits(detlogp::expc_normal(x)) != detlogp::fp::bits(expc(x));
  }
  EXPECT_EQ(differ, 0);
}

TEST(Logc, SpecialValues) {
  EXPECT_EQ(bits(logc(1.0f)), 0x00000000u);  // +0 exactly
  EXPECT_EQ(bits(logc(kInf)), bits(kInf));
  EXPECT_EQ(bits(logc(0.0f)), bits(-kInf));
  EXPECT_TRUE(std::isnan(logc(from_bits(0x7FC00000u))));
  EXPECT_TRUE(std::isnan(logc(-1.0f)));
  EXPECT_EQ(logc(2.0f), 0x1.62e43p-1f);  // fl(ln 2)
  // Powers of two: e * ln 2 within 1 ulp.
  for (int e = 1; e < 128; ++e) {
    const float x = std::ldexp(1.0f, e);
    const double ref = e * 0.69314718055994530942;
    EXPECT_LE(std::fabs(logc(x) - ref) / detlogp_test::fp32_ulp_of(ref), 1.0) << "x = 2^" << e;
  }
}

TEST(Logc, SampledAccuracyWithinOneUlpAcrossAllPositiveFloats) {
  // Every 257th positive finite float (subnormals included) except 1 itself: ~8M values.
  detlogp_test::UlpScan worst;
  for (uint32_t b = 1u; b < 0x7F800000u; b += 257u) {
    const float x = from_bits(b);
    if (x == 1.0f) continue;
    const double ref = std::log(static_cast<double>(x));
    const double err = std::fabs(static_cast<double>(logc(x)) - ref) / detlogp_test::fp32_ulp_of(ref);
    if (err > worst.max_ulp) {
      worst.max_ulp = err;
      worst.worst_bits = b;
    }
  }
  std::printf("logc sampled (all positive floats) max error %.4f ulp at x = %a\n", worst.max_ulp,
              static_cast<double>(from_bits(worst.worst_bits)));
  EXPECT_LE(worst.max_ulp, 1.0);
}

TEST(Logc, IsMonotoneOnTheChainSumRange) {
  float prev = logc(1.0f);
  for (float x = 1.0f; x < 1e9f; x = x * 1.001f + 1e-3f) {
    const float l = logc(x);
    EXPECT_GE(l, prev) << "x = " << x;
    prev = l;
  }
}

// Exhaustive accuracy of the contract transcendentals (docs/contract.md §4): expc over every
// fp32 in its contract domain [-104, 0] and logc over every fp32 in [1, 2^32), each against
// std::exp / std::log in double. The max error, in ulps of the fp32 ulp of the reference, is
// printed with its argument and must be <= 1. Also: every fp32 below -104 gives expc = +0.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "detlogp/transcendentals.hpp"
#include "transcendental_check.hpp"

using detlogp::fp::bits;
using detlogp::fp::from_bits;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void print_scan(const char* name, const detlogp_test::UlpScan& s, double secs) {
  std::printf("%s: %llu values, max error %.4f ulp at x = %a (0x%08X): got %a, reference %.17g  [%.1f s]\n", name,
              static_cast<unsigned long long>(s.checked), s.max_ulp, static_cast<double>(from_bits(s.worst_bits)),
              s.worst_bits, static_cast<double>(s.worst_value), s.worst_reference, secs);
  std::fflush(stdout);
}

}  // namespace

TEST(ExhaustiveTranscendentals, ExpcWithinOneUlpOnEveryFloatInMinus104To0) {
  const uint32_t minus_zero = 0x80000000u;
  const uint32_t minus_104 = bits(-104.0f);
  ASSERT_EQ(minus_104, 0xC2D00000u);
  const auto t0 = std::chrono::steady_clock::now();
  // Negative floats: bit patterns ascend from -0 to -104 as the magnitude grows.
  detlogp_test::UlpScan s = detlogp_test::scan_ulp(
      minus_zero, minus_104, [](float x) { return detlogp::expc(x); }, [](double x) { return std::exp(x); });
  print_scan("expc on [-104, -0]", s, seconds_since(t0));
  EXPECT_EQ(s.checked, static_cast<uint64_t>(minus_104 - minus_zero) + 1);
  EXPECT_EQ(s.non_finite_mismatches, 0u) << "first at bits 0x" << std::hex << s.first_non_finite_bits;
  EXPECT_LE(s.max_ulp, 1.0) << "expc error above 1 ulp at x = " << from_bits(s.worst_bits);
  EXPECT_EQ(bits(detlogp::expc(0.0f)), bits(1.0f));
}

TEST(ExhaustiveTranscendentals, ExpcIsExactlyPositiveZeroBelowMinus104) {
  // Every finite float below -104 and -inf: the result must be +0 bit for bit.
  const auto t0 = std::chrono::steady_clock::now();
  const auto [bad, first] = detlogp_test::count_bits_where(bits(-104.0f) + 1, 0xFF800000u,
                                                           [](float x) { return bits(detlogp::expc(x)) != 0u; });
  std::printf("expc below -104: %llu values, %llu not +0  [%.1f s]\n",
              static_cast<unsigned long long>(0xFF800000u - bits(-104.0f)), static_cast<unsigned long long>(bad),
              seconds_since(t0));
  EXPECT_EQ(bad, 0u) << "first at x = " << from_bits(first) << " (0x" << std::hex << first << ")";
}

TEST(ExhaustiveTranscendentals, ExpcNormalEqualsExpcOnItsWholeDomain) {
  // Every fp32 in [kExpcNormalMin, -0] and [+0, kExpcNormalMax]: expc_normal gives expc's bits.
  const auto t0 = std::chrono::steady_clock::now();
  const auto differs = [](float x) { return bits(detlogp::expc_normal(x)) != bits(detlogp::expc(x)); };
  const auto [bad_neg, first_neg] = detlogp_test::count_bits_where(0x80000000u, bits(detlogp::kExpcNormalMin), differs);
  const auto [bad_pos, first_pos] = detlogp_test::count_bits_where(0u, bits(detlogp::kExpcNormalMax), differs);
  std::printf("expc_normal vs expc on [%g, %a]: %llu values, %llu differ  [%.1f s]\n",
              static_cast<double>(detlogp::kExpcNormalMin), static_cast<double>(detlogp::kExpcNormalMax),
              static_cast<unsigned long long>(bits(detlogp::kExpcNormalMin) - 0x80000000u + 1 +
                                              bits(detlogp::kExpcNormalMax) + 1),
              static_cast<unsigned long long>(bad_neg + bad_pos), seconds_since(t0));
  EXPECT_EQ(bad_neg, 0u) << "first at x = " << from_bits(first_neg);
  EXPECT_EQ(bad_pos, 0u) << "first at x = " << from_bits(first_pos);
}

TEST(ExhaustiveTranscendentals, LogcWithinOneUlpOnEveryFloatIn1To2Pow32) {
  const uint32_t one = bits(1.0f);
  const uint32_t two_pow_32 = bits(0x1p32f);
  const auto t0 = std::chrono::steady_clock::now();
  detlogp_test::UlpScan s = detlogp_test::scan_ulp(
      one, two_pow_32 - 1, [](float x) { return detlogp::logc(x); }, [](double x) { return std::log(x); });
  print_scan("logc on [1, 2^32)", s, seconds_since(t0));
  EXPECT_EQ(s.checked, static_cast<uint64_t>(two_pow_32 - one));
  EXPECT_EQ(s.non_finite_mismatches, 0u) << "first at bits 0x" << std::hex << s.first_non_finite_bits;
  EXPECT_LE(s.max_ulp, 1.0) << "logc error above 1 ulp at x = " << from_bits(s.worst_bits);
}

// The contract's own transcendentals (docs/contract.md §4). One definition, compiled for host
// and device alike, built from the pinned fp32 operations in fpops.hpp and integer bit
// manipulation for powers of two. Coefficients come from tools/contract/fit_polys.py; the
// exhaustive tests in tests/cpu/test_transcendentals.cpp bound the error at <= 1 ulp.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/fpops.hpp"

namespace detlogp {

namespace expc_constants {
inline constexpr float kLog2e = 0x1.715476p+0f;
inline constexpr float kRoundMagic = 0x1.8p+23f;  // fma(x, log2e, magic) - magic = rint(x*log2e)
inline constexpr float kLn2Hi = 0x1.62e43p-1f;    // fl(ln 2): x - k*hi is exact for |r| < 0.5
inline constexpr float kLn2Lo = -0x1.05c61p-29f;  // fl(ln 2 - hi)
inline constexpr float kC2 = 0x1.fffff8p-2f;
inline constexpr float kC3 = 0x1.55548ep-3f;
inline constexpr float kC4 = 0x1.555b5cp-5f;
inline constexpr float kC5 = 0x1.123bdcp-7f;
inline constexpr float kC6 = 0x1.687b46p-10f;
inline constexpr float kUnderflow = -104.0f;        // e^x < 2^-150 below: rounds to +0
inline constexpr float kOverflow = 0x1.62e42ep+6f;  // e^x > FLT_MAX above: +inf (and from
                                                    // 0x1.61814ep+6 on, k = 128 makes 2^k +inf)
}  // namespace expc_constants

// e^r for the reduced argument r = x - kf * ln 2 (kf = rint(x * log2e), ln 2 in two parts): the
// degree-6 polynomial that expc and expc_normal both scale by 2^k.
DETLOGP_HD float expc_reduced(float x, float kf) {
  using namespace expc_constants;
  float r = fp::fma(kf, -kLn2Hi, x);
  r = fp::fma(kf, -kLn2Lo, r);
  float p = kC6;
  p = fp::fma(p, r, kC5);
  p = fp::fma(p, r, kC4);
  p = fp::fma(p, r, kC3);
  p = fp::fma(p, r, kC2);
  p = fp::fma(p, r, 1.0f);
  return fp::fma(p, r, 1.0f);
}

// e^x in fp32. Contract domain: x <= 0 (arguments y - m_g and m_g - M), NaN passes through.
// Also defined for 0 < x: overflow gives +inf.
DETLOGP_HD float expc(float x) {
  using namespace expc_constants;
  if (!(x >= kUnderflow)) return fp::is_nan(x) ? x : 0.0f;  // also -inf
  if (x > kOverflow) return fp::pos_inf();
  const float shifted = fp::fma(x, kLog2e, kRoundMagic);
  const float kf = fp::sub(shifted, kRoundMagic);
  const int k = static_cast<int>(kf);
  float p = expc_reduced(x, kf);
  if (k >= -126) return fp::mul(p, fp::from_bits(static_cast<uint32_t>(k + 127) << 23));
  // Subnormal result: the first scaling is exact, the second rounds once.
  p = fp::mul(p, fp::from_bits(static_cast<uint32_t>(k + 127 + 64) << 23));
  return fp::mul(p, 0x1p-64f);
}

// The lower end of expc_normal's domain: every x >= kExpcNormalMin has k = rint(x * log2e) >= -126,
// so expc takes its normal (non-subnormal) path; and where k = -126 (x < -87.3 only) is not reached,
// so every result there is a normal number (k = -126 needs x > -87.34 here, where r = x - k ln2 > 0.33
// and the polynomial is above 1).
inline constexpr float kExpcNormalMin = -87.0f;
// The upper end: k <= 127 (expc's own 2^128 factor would be +inf already below kOverflow).
inline constexpr float kExpcNormalMax = 88.0f;

// expc(x) for kExpcNormalMin <= x <= kExpcNormalMax, bit for bit (exhaustively tested): the same fp32
// operations as expc's normal path with no range branches. The final scaling by 2^k is exact there
// (the result is normal), so it is done as an integer add of k << 23 to the polynomial's bits, with
// k << 23 read off the bits of `shifted` (= 0x4B400000 + k, whose << 23 is k << 23 mod 2^32): one
// integer instruction instead of a conversion and an fp32 multiply. Straight-line, so a caller can
// interleave many of them; the SM90 epilogues use it when a warp's whole fragment lies in the
// domain (warp-uniform test) and expc otherwise.
DETLOGP_HD float expc_normal(float x) {
  using namespace expc_constants;
  const float shifted = fp::fma(x, kLog2e, kRoundMagic);
  const float kf = fp::sub(shifted, kRoundMagic);
  return fp::from_bits(fp::bits(expc_reduced(x, kf)) + (fp::bits(shifted) << 23));
}

namespace logc_constants {
inline constexpr float kLn2Hi = 0x1.62e4p-1f;  // 16 significant bits: e * hi exact
inline constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
inline constexpr float kR1 = 0x1.555554p-1f;
inline constexpr float kR2 = 0x1.999a7ep-2f;
inline constexpr float kR3 = 0x1.24383cp-2f;
inline constexpr float kR4 = 0x1.e30b5p-3f;
inline constexpr uint32_t kSqrtHalfBits = 0x3F3504F3u;  // mantissa split point fl(sqrt(1/2))
}  // namespace logc_constants

// ln(x) in fp32. Contract domain: x >= 1 (the chain sum S of a row with a real lane).
// Also defined elsewhere: +0 -> -inf, x < 0 -> NaN, +inf -> +inf, NaN passes through.
DETLOGP_HD float logc(float x) {
  using namespace logc_constants;
  if (fp::is_nan(x)) return x;
  if (x == 0.0f) return fp::neg_inf();
  if (x < 0.0f) return fp::canonical_nan();
  if (x == fp::pos_inf()) return x;
  uint32_t u = fp::bits(x);
  int e = 0;
  if (u < 0x00800000u) {  // subnormal: normalize exactly
    x = fp::mul(x, 0x1p+25f);
    u = fp::bits(x);
    e = -25;
  }
  // x = 2^e * m with m in [sqrt(1/2), sqrt(2)).
  const uint32_t shifted = u + (0x3F800000u - kSqrtHalfBits);
  e += static_cast<int>(shifted >> 23) - 127;
  const float m = fp::from_bits((shifted & 0x007FFFFFu) + kSqrtHalfBits);
  const float f = fp::sub(m, 1.0f);  // exact (Sterbenz)
  const float s = fp::div(f, fp::add(2.0f, f));
  const float z = fp::mul(s, s);
  float r = kR4;
  r = fp::fma(r, z, kR3);
  r = fp::fma(r, z, kR2);
  r = fp::fma(r, z, kR1);
  r = fp::mul(r, z);
  const float hfsq = fp::mul(fp::mul(0.5f, f), f);
  const float ef = static_cast<float>(e);
  // ln x = e*ln2_hi + (f - (hfsq - (s*(hfsq + R) + e*ln2_lo)))
  const float tail = fp::fma(s, fp::add(hfsq, r), fp::mul(ef, kLn2Lo));
  const float log1p_f = fp::sub(f, fp::sub(hfsq, tail));
  return fp::fma(ef, kLn2Hi, log1p_f);
}

}  // namespace detlogp

// Pinned IEEE fp32 operations. Every bit-relevant arithmetic site of the contract goes through
// these, so the rounding points are explicit: no compiler contraction, no fast-math intrinsics.
// Host builds must use -ffp-contract=off (the detlogp CMake target sets it PUBLIC); device code
// uses the _rn intrinsics, which nvcc never fuses.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "detlogp/config.hpp"

namespace detlogp::fp {

DETLOGP_HD float add(float a, float b) {
#if DETLOGP_DEVICE_PASS
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

DETLOGP_HD float sub(float a, float b) {
#if DETLOGP_DEVICE_PASS
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

DETLOGP_HD float mul(float a, float b) {
#if DETLOGP_DEVICE_PASS
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DETLOGP_HD float div(float a, float b) {
#if DETLOGP_DEVICE_PASS
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// a * b + c with a single rounding.
DETLOGP_HD float fma(float a, float b, float c) {
#if DETLOGP_DEVICE_PASS
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The host's bit cast between two 4-byte types (memcpy: no aliasing assumptions).
template <class To, class From>
inline To host_bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the width");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

// The bit pattern of an fp32 and back (each compilation pass sees one pair of definitions).
#if DETLOGP_DEVICE_PASS
DETLOGP_HD uint32_t bits(float x) { return __float_as_uint(x); }
DETLOGP_HD float from_bits(uint32_t u) { return __uint_as_float(u); }
#else
DETLOGP_HD uint32_t bits(float x) { return host_bit_cast<uint32_t>(x); }
DETLOGP_HD float from_bits(uint32_t u) { return host_bit_cast<float>(u); }
#endif

DETLOGP_HD bool is_nan(float x) { return x != x; }

// -x exactly: the sign bit flipped (no rounding; a NaN stays NaN).
DETLOGP_HD float neg(float x) { return from_bits(bits(x) ^ 0x80000000u); }

DETLOGP_HD float canonical_nan() { return from_bits(kCanonicalNanBits); }

DETLOGP_HD float neg_inf() { return from_bits(0xFF800000u); }

DETLOGP_HD float pos_inf() { return from_bits(0x7F800000u); }

// NaN-propagating max (any NaN operand gives the canonical NaN). Exact, so order-free up to the
// sign of zero; the contract normalizes -0 to +0 where a maximum is taken (reduce.hpp).
DETLOGP_HD float max_nan(float a, float b) {
#if DETLOGP_DEVICE_PASS
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  if (a != a || b != b) return canonical_nan();
  return a > b ? a : b;
#endif
}

// bf16 is the upper half of an fp32; widening is exact.
DETLOGP_HD float bf16_to_float(uint16_t b) { return from_bits(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16, round to nearest even on the bits (exact ties to even, overflow to inf, subnormals
// kept); every NaN becomes the canonical quiet kCanonicalNanBf16. The project's one rounding to
// bf16: the gradient kernels, the CPU backend, the input generators and the tests all call it.
DETLOGP_HD uint16_t bf16_round(float x) {
  if (is_nan(x)) return kCanonicalNanBf16;
  const uint32_t u = bits(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace detlogp::fp

// The bit-level model of SM90 wgmma bf16 x bf16 -> fp32 accumulation that the CPU emulation of the
// SM90 logits relies on (docs/contract.md §3.1.1). Integer arithmetic only: every significand is an
// integer, every alignment an explicit shift, every truncation and rounding spelled out.
//
// One k-block of 16 products and the running accumulator c form one block FMA:
//   1. The products a_i * b_i are exact: integer significand products with exponent e_a + e_b
//      (each bf16's exponent, -126 for a subnormal), not renormalized (up to 2 integer bits).
//   2. E = the largest exponent among the nonzero products and c (when c != 0), at least -133.
//   3. Every term is aligned to a fixed-point window whose last bit is 2^(E - 25) (the fp32
//      significand's 23 fraction bits plus 2 extra bits): shifted right, the lost bits dropped
//      (truncation of the magnitude, no sticky bit). Zero products and c = 0 take no part.
//   4. The signed integer sum S of the aligned terms is exact; the result is S * 2^(E - 25)
//      rounded toward zero to fp32 (gradual underflow, a result that truncates to 0 is +0; an
//      exponent past fp32's range gives +-inf).
//      S = 0 gives +0.
// K is walked as ascending blocks of 16 on one accumulator that starts at +0. NaN and infinity
// follow IEEE rules over the block (any NaN, inf * 0 or inf - inf gives NaN, written as
// kWgmmaNanBits; otherwise an infinite term gives that infinity).
//
// Host and device: the device computes the logits with wgmma itself and uses these pieces only to
// recompute a few lanes exactly (the top-k output's candidate path, src/sm90/device/wgmma_lane.cuh).
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/fpops.hpp"

namespace detlogp::wgmma {

inline constexpr int kBlockK = 16;                      // products per block FMA (one wgmma k16 step)
inline constexpr int kAlignBits = 2;                    // extra alignment bits below the fp32 significand
inline constexpr int kWindowFracBits = 25;              // 23 + kAlignBits: the window's bits below 2^E
inline constexpr int kProductFracBits = 14;             // a bf16 significand product has 14 fraction bits
inline constexpr int kMinBlockExp = -133;               // the block exponent E is never below this
inline constexpr int32_t kZeroExp = -4096;              // exponent of a zero operand: never the block maximum
inline constexpr int kMaxShift = 31;                    // every aligned term is < 2^27: a shift of 31 clears it
inline constexpr uint32_t kWgmmaNanBits = 0x7FFFFFFFu;  // the NaN the model writes

// A finite bf16 as a signed integer significand and an exponent: x = sig * 2^(exp - 7), |sig| in
// [128, 255] for a normal number, [1, 127] for a subnormal (exp = -126), sig = 0 and exp = kZeroExp
// for +-0.
struct Bf16Parts {
  int32_t sig = 0;
  int32_t exp = kZeroExp;
};

DETLOGP_HD bool bf16_finite(uint16_t b) { return (b & 0x7F80u) != 0x7F80u; }
DETLOGP_HD bool bf16_is_nan(uint16_t b) { return (b & 0x7FFFu) > 0x7F80u; }

DETLOGP_HD Bf16Parts bf16_parts(uint16_t b) {
  const int32_t biased = (b >> 7) & 0xFF;
  const int32_t frac = b & 0x7F;
  Bf16Parts p;
  if (biased == 0 && frac == 0) return p;
  const int32_t mag = biased == 0 ? frac : (frac | 0x80);
  p.sig = (b & 0x8000u) ? -mag : mag;
  p.exp = biased == 0 ? -126 : biased - 127;
  return p;
}

// Lane helpers written once for a scalar int32 and for a GCC vector of int32 lanes (the CPU GEMM
// runs the same steps on 8 lanes): every operation below is elementwise.
template <class I>
DETLOGP_HD I splat(int32_t x) {
  return I{} + x;
}
template <class I>
DETLOGP_HD I max_lanes(I a, I b) {
  return a > b ? a : b;
}
template <class I>
DETLOGP_HD I min_lanes(I a, I b) {
  return a < b ? a : b;
}

// The exponent an fp32 accumulator (its bits) takes in step 2: -126 for a subnormal, kZeroExp for
// +-0 (c = 0 takes no part).
template <class I>
DETLOGP_HD I accumulator_exp(I c_bits) {
  const I biased = (c_bits >> 23) & 0xFF;
  const I e = biased == 0 ? splat<I>(-126) : biased - 127;
  return (c_bits & 0x7FFFFFFF) == 0 ? splat<I>(kZeroExp) : e;
}

// Step 2: E from the largest exponent sum of the block's nonzero products (kZeroExp-based for a
// zero product) and the accumulator.
template <class I>
DETLOGP_HD I block_exponent(I product_max_exp, I c_bits) {
  return max_lanes(max_lanes(product_max_exp, accumulator_exp(c_bits)), splat<I>(kMinBlockExp));
}

// Step 3 for one product: the signed significand product p = sig_a * sig_b (|p| < 2^16, 14
// fraction bits) placed in the window (kWindowFracBits fraction bits) and shifted right by
// `shift` = E - (e_a + e_b), the magnitude truncated. Each aligned product is below 2^27, so 16 of
// them sum exactly in int32 (at most 16 * 255^2 * 2^11 = 2130739200 < 2^31).
template <class I>
DETLOGP_HD I align_product(I p, I shift) {
  const I mag = p < 0 ? -p : p;
  const I t = (mag << (kWindowFracBits - kProductFracBits)) >> min_lanes(shift, splat<I>(kMaxShift));
  return p < 0 ? -t : t;
}

// A finite fp32 accumulator: |c| = mag * 2^(exp - 23), mag < 2^24; c = +-0 has mag = 0.
struct Fp32Parts {
  uint32_t mag = 0;
  int32_t exp = kZeroExp;
  bool neg = false;
};

DETLOGP_HD Fp32Parts fp32_parts(uint32_t bits) {
  Fp32Parts p;
  p.neg = (bits >> 31) != 0;
  p.exp = accumulator_exp(static_cast<int32_t>(bits));
  const uint32_t frac = bits & 0x7FFFFFu;
  p.mag = p.exp == kZeroExp ? 0u : (bits & 0x7F800000u) == 0 ? frac : (frac | 0x800000u);
  return p;
}

// Step 3 for the accumulator: its 24-bit magnitude placed in the window and shifted right by
// E - exp, truncated.
DETLOGP_HD int64_t align_accumulator(const Fp32Parts& c, int32_t e) {
  if (c.mag == 0) return 0;
  const int32_t shift = e - c.exp;
  const int64_t t = shift > kMaxShift ? 0 : static_cast<int64_t>((uint64_t{c.mag} << kAlignBits) >> shift);
  return c.neg ? -t : t;
}

// Step 4: S * 2^(e - kWindowFracBits) rounded toward zero to fp32 bits.
DETLOGP_HD uint32_t round_block_sum(int64_t s, int32_t e) {
  if (s == 0) return 0;
  const uint32_t sign = s < 0 ? 0x80000000u : 0u;
  const uint64_t m = s < 0 ? uint64_t(0) - static_cast<uint64_t>(s) : static_cast<uint64_t>(s);
#if DETLOGP_DEVICE_PASS
  const int len = 64 - __clzll(static_cast<long long>(m));  // bit length of |S|
#else
  const int len = 64 - __builtin_clzll(m);  // bit length of |S|
#endif
  const int32_t lead = e - kWindowFracBits + len - 1;  // exponent of its leading bit
  if (lead >= 128) return sign | 0x7F800000u;          // past FLT_MAX: infinity
  if (lead >= -126) {                                  // normal: the top 24 bits, truncated
    const uint64_t sig = len > 24 ? m >> (len - 24) : m << (24 - len);
    return sign | (static_cast<uint32_t>(lead + 127) << 23) | (static_cast<uint32_t>(sig) & 0x7FFFFFu);
  }
  // Subnormal: the multiple of 2^-149, truncated. A sum that truncates to 0 is +0 whatever its sign
  // (measured on the H200: sm90_wgmma_proof's subnormal case, 7071 elements of 1e7).
  const int32_t shift = e - kWindowFracBits + 149;
  const uint64_t frac = shift >= 0 ? m << shift : (-shift >= 64 ? 0 : m >> -shift);
  return frac == 0 ? 0u : sign | static_cast<uint32_t>(frac);
}

// Steps 3-4 given the products' aligned sum at block exponent e and the accumulator's bits, for a
// block whose products are all finite: an infinite accumulator stays as it is (a NaN one is
// kWgmmaNanBits).
DETLOGP_HD uint32_t finish_block(int64_t product_sum, int32_t e, uint32_t c_bits) {
  if ((c_bits & 0x7F800000u) == 0x7F800000u) return (c_bits & 0x7FFFFFu) != 0 ? kWgmmaNanBits : c_bits;
  return round_block_sum(product_sum + align_accumulator(fp32_parts(c_bits), e), e);
}

// The non-finite operands of a block FMA and its accumulator: any NaN, inf * 0, or infinities of
// both signs give NaN (kWgmmaNanBits); otherwise an infinite term gives that infinity. Flags only,
// so a block's products may note theirs in any order (the device's lanes each note one).
struct BlockSpecials {
  bool nan = false, pos_inf = false, neg_inf = false;
  DETLOGP_HD bool any() const { return nan || pos_inf || neg_inf; }
  DETLOGP_HD uint32_t bits() const {
    if (nan || (pos_inf && neg_inf)) return kWgmmaNanBits;
    return pos_inf ? 0x7F800000u : 0xFF800000u;
  }
};

DETLOGP_HD BlockSpecials accumulator_specials(uint32_t c_bits) {
  BlockSpecials s;
  s.nan = (c_bits & 0x7FFFFFFFu) > 0x7F800000u;
  s.pos_inf = c_bits == 0x7F800000u;
  s.neg_inf = c_bits == 0xFF800000u;
  return s;
}

// Notes the product a * b in s when an operand is not finite.
DETLOGP_HD void note_product_specials(uint16_t a, uint16_t b, BlockSpecials& s) {
  if (bf16_finite(a) && bf16_finite(b)) return;
  const bool a_zero = (a & 0x7FFFu) == 0, b_zero = (b & 0x7FFFu) == 0;
  if (bf16_is_nan(a) || bf16_is_nan(b) || a_zero || b_zero) {
    s.nan = true;  // a NaN operand, or inf * 0
  } else if (((a ^ b) & 0x8000u) != 0) {
    s.neg_inf = true;
  } else {
    s.pos_inf = true;
  }
}

// Step 1 for one product of finite operands: its integer significand and exponent; `nonzero` false
// for a zero product, which takes no part in steps 2-4.
struct ProductParts {
  int32_t sig = 0;
  int32_t exp = kZeroExp;
  bool nonzero = false;
};

DETLOGP_HD ProductParts product_parts(uint16_t a, uint16_t b) {
  const Bf16Parts pa = bf16_parts(a), pb = bf16_parts(b);
  ProductParts p;
  p.nonzero = pa.sig != 0 && pb.sig != 0;
  if (p.nonzero) {
    p.sig = pa.sig * pb.sig;
    p.exp = pa.exp + pb.exp;
  }
  return p;
}

// One block FMA over n <= kBlockK products: the fp32 bits of the model's a . b + c.
DETLOGP_HD uint32_t block_fma_bits(const uint16_t* a, const uint16_t* b, int n, uint32_t c_bits) {
  BlockSpecials special = accumulator_specials(c_bits);
  for (int i = 0; i < n; ++i) note_product_specials(a[i], b[i], special);
  if (special.any()) return special.bits();
  ProductParts pp[kBlockK];
  int32_t product_max = kZeroExp;
  for (int i = 0; i < n; ++i) {
    pp[i] = product_parts(a[i], b[i]);
    if (pp[i].nonzero && pp[i].exp > product_max) product_max = pp[i].exp;
  }
  const int32_t e = block_exponent(product_max, static_cast<int32_t>(c_bits));
  int32_t product_sum = 0;
  for (int i = 0; i < n; ++i)
    if (pp[i].nonzero) product_sum += align_product<int32_t>(pp[i].sig, e - pp[i].exp);
  return finish_block(product_sum, e, c_bits);
}

// The model's fp32 dot product of two bf16 vectors of length k: ascending blocks of kBlockK (the
// last one shorter when k is not a multiple) on one accumulator starting at +0.
DETLOGP_HD float dot(const uint16_t* a, const uint16_t* b, int64_t k) {
  uint32_t acc = 0;
  for (int64_t k0 = 0; k0 < k; k0 += kBlockK)
    acc = block_fma_bits(a + k0, b + k0, static_cast<int>(k - k0 < kBlockK ? k - k0 : kBlockK), acc);
  return fp::from_bits(acc);
}

}  // namespace detlogp::wgmma

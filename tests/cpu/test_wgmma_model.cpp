// The SM90 wgmma bf16 -> fp32 model (detlogp/wgmma_model.hpp, docs/contract.md §3.1.1): hand-computed
// block FMAs for each of its rules (truncation, the window's two extra bits, no sticky bit, the
// accumulator's part in the alignment, the block exponent's floor, cancellation, subnormal
// products, infinities, NaN, signed zeros), where it must differ from an fma chain, an independent
// floating-point oracle of the same rules on random blocks, and the emulated backend's GEMM
// against the scalar model element by element.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/reduce.hpp"
#include "detlogp/wgmma_model.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace wgmma = detlogp::wgmma;
using detlogp::bitcmp::float_bits;
using detlogp::bitcmp::float_from_bits;

namespace {

constexpr const char* kEmulatedId = "cpu-sm90-emulated-contract-v1";

// Exactly representable values only: the conversion must not round.
uint16_t bf(double x) {
  const float f = static_cast<float>(x);
  const uint16_t b = bf16_round(f);
  EXPECT_EQ(static_cast<double>(bf16_to_float(b)), x) << x << " is not a bf16";
  return b;
}

std::vector<uint16_t> bfs(const std::vector<double>& xs) {
  std::vector<uint16_t> out;
  for (double x : xs) out.push_back(bf(x));
  return out;
}

// One block FMA of the model: a . b + c.
uint32_t block(const std::vector<double>& a, const std::vector<double>& b, float c = 0.0f) {
  EXPECT_EQ(a.size(), b.size());
  const auto ab = bfs(a), bb = bfs(b);
  return wgmma::block_fma_bits(ab.data(), bb.data(), static_cast<int>(ab.size()), float_bits(c));
}

// The model's dot over several blocks.
uint32_t dot_bits(const std::vector<double>& a, const std::vector<double>& b) {
  const auto ab = bfs(a), bb = bfs(b);
  return float_bits(wgmma::dot(ab.data(), bb.data(), static_cast<int64_t>(ab.size())));
}

// What an IEEE fp32 fma chain (k ascending) gives for the same products.
uint32_t fma_chain_bits(const std::vector<double>& a, const std::vector<double>& b, float c = 0.0f) {
  float acc = c;
  for (size_t i = 0; i < a.size(); ++i) acc = std::fma(static_cast<float>(a[i]), static_cast<float>(b[i]), acc);
  return float_bits(acc);
}

uint32_t bits_of(double x) { return float_bits(static_cast<float>(x)); }

}  // namespace

TEST(WgmmaModel, SmallIntegersAreExact) {
  Rng rng(3);
  for (int64_t dim : {1, 16, 64, 1000}) {
    std::vector<double> a(static_cast<size_t>(dim)), b(a.size());
    double exact = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      a[k] = static_cast<double>(static_cast<int64_t>(rng.below(33)) - 16);
      b[k] = static_cast<double>(static_cast<int64_t>(rng.below(33)) - 16);
      exact += a[k] * b[k];
    }
    EXPECT_EQ(dot_bits(a, b), bits_of(exact + 0.0)) << "dim " << dim;
  }
  // 1 + 2 + ... + 16 squared: 1496.
  std::vector<double> a;
  for (int i = 1; i <= 16; ++i) a.push_back(i);
  EXPECT_EQ(block(a, a), bits_of(1496));
}

TEST(WgmmaModel, RoundsTowardZeroNotToNearest) {
  // 1 + 1.5 * 2^-24 = 1 + 0.75 ulp: the window keeps it (2^-25 is its last bit), the final
  // rounding truncates to 1; round to nearest (the fma chain) gives 1 + 2^-23.
  EXPECT_EQ(block({1.0, 1.5 * 0x1p-12}, {1.0, 0x1p-12}), bits_of(1.0));
  EXPECT_EQ(fma_chain_bits({1.0, 1.5 * 0x1p-12}, {1.0, 0x1p-12}), bits_of(1.0 + 0x1p-23));
  // Toward zero for a negative result too.
  EXPECT_EQ(block({-1.0, -1.5 * 0x1p-12}, {1.0, 0x1p-12}), bits_of(-1.0));
  // 3 - 2^-23 lies halfway between 3 - 2^-22 and 3 (to nearest even: 3); toward zero: 3 - 2^-22.
  EXPECT_EQ(block({3.0, -0x1p-12}, {1.0, 0x1p-11}), bits_of(3.0 - 0x1p-22));
  EXPECT_EQ(fma_chain_bits({3.0, -0x1p-12}, {1.0, 0x1p-11}), bits_of(3.0));
}

TEST(WgmmaModel, TheWindowKeepsTwoBitsBelowTheSignificand) {
  // Eight products of 2^-25 beside 1: each is the window's last bit, kept: 1 + 2^-22.
  std::vector<double> a(9, 0x1p-13), b(9, 0x1p-12);
  a[8] = 1.0;
  b[8] = 1.0;
  EXPECT_EQ(block(a, b), bits_of(1.0 + 0x1p-22));
  // Eight of 2^-26: each falls below the window and is lost, where the fma chain (small terms
  // first) adds them exactly before the 1 arrives.
  std::fill(b.begin(), b.begin() + 8, 0x1p-13);
  EXPECT_EQ(block(a, b), bits_of(1.0));
  EXPECT_EQ(fma_chain_bits(a, b), bits_of(1.0 + 0x1p-23));
}

TEST(WgmmaModel, NoStickyBitATermBelowTheWindowBorrowsNothing) {
  // 1 - 2^-26 rounded toward zero is 1 - 2^-24; the model drops -2^-26 before the sum: 1.
  EXPECT_EQ(block({1.0, -0x1p-13}, {1.0, 0x1p-13}), bits_of(1.0));
  EXPECT_EQ(fma_chain_bits({1.0, -0x1p-13}, {1.0, 0x1p-13}), bits_of(1.0));  // RN: 1 as well
}

TEST(WgmmaModel, TheAccumulatorTakesPartInTheAlignment) {
  // Block 1 leaves 2^24 in the accumulator; block 2's sixteen products of 0.375 fall below the
  // window of E = 24 (last bit 2^-1): each truncated to 0.  Summing the products first and adding
  // the accumulator after would give 2^24 + 6.
  std::vector<double> a(32, 0.75), b(32, 0.5);
  for (int k = 1; k < 16; ++k) a[k] = b[k] = 0.0;
  a[0] = 0x1p12;
  b[0] = 0x1p12;
  EXPECT_EQ(dot_bits(a, b), bits_of(0x1p24));
  // The accumulator is truncated like a product: c = 1 + 2^-23 against a product -8 (E = 3,
  // last bit 2^-22) becomes 1, so the sum is -7 exactly, not -(7 - 2^-23) rounded toward zero.
  EXPECT_EQ(block({-4.0}, {2.0}, 1.0f + 0x1p-23f), bits_of(-7.0));
  // An accumulator at the block's largest exponent keeps all its 24 bits.
  EXPECT_EQ(block({0x1p-20}, {1.0}, 1.0f + 0x1p-23f), bits_of(1.0 + 0x1p-23 + 0x1p-20));
}

TEST(WgmmaModel, CancellationInsideTheWindow) {
  // E = 20: the window's last bit is 2^-5, so 1.5 survives the cancellation of 2^20.
  EXPECT_EQ(block({0x1p10, -0x1p10, 1.5}, {0x1p10, 0x1p10, 1.0}), bits_of(1.5));
  // E = 40: 1.5 is below the window; the result is an exact zero, +0.
  EXPECT_EQ(block({0x1p20, -0x1p20, 1.5}, {0x1p20, 0x1p20, 1.0}), 0u);
  EXPECT_EQ(fma_chain_bits({0x1p20, -0x1p20, 1.5}, {0x1p20, 0x1p20, 1.0}), bits_of(1.5));
  // A zero sum is +0 whatever the signs.
  EXPECT_EQ(block({-3.0, 3.0}, {1.0, 1.0}), 0u);
  EXPECT_EQ(block({-3.0}, {1.0}, 3.0f), 0u);
}

TEST(WgmmaModel, HugeAndTinyExponentsInOneBlock) {
  // Products beyond fp32's range are exact inside the block: 2^200 - 2^200 + 2^-100 gives +0 (the
  // tiny one is below the window), where the fp32 fma chain overflows to inf at the first step.
  const std::vector<double> a = {0x1p100, -0x1p100, 0x1p-50}, b = {0x1p100, 0x1p100, 0x1p-50};
  EXPECT_EQ(block(a, b), 0u);
  EXPECT_EQ(fma_chain_bits(a, b), 0x7F800000u);
  // 2^127 * 2 overflows: +inf; two of them of opposite sign cancel.
  EXPECT_EQ(block({0x1p127}, {2.0}), 0x7F800000u);
  EXPECT_EQ(block({0x1p127, -0x1p127}, {2.0, 2.0}), 0u);
  // Near the overflow.
  EXPECT_EQ(block({0x1.fep127, 0x1.fep127}, {1.0, 1.0}), 0x7F800000u);  // 2 * 0x1.fep127 > FLT_MAX
  EXPECT_EQ(block({0x1.fep127, 0x1p104}, {1.0, 1.0}), 0x7F7F0001u);     // 0x1.fep127 + 2^104: exact
  EXPECT_EQ(block({0x1.fep127, 0x1p103}, {1.0, 1.0}), 0x7F7F0000u);     // + half an ulp: truncated
  // A tiny product beside a huge one is lost, and so is a tiny accumulator.
  EXPECT_EQ(block({0x1p60, 0x1p-60}, {0x1p60, 0x1p-60}), bits_of(0x1p120));
  EXPECT_EQ(block({0x1p60}, {0x1p60}, 0x1p-100f), bits_of(0x1p120));
}

TEST(WgmmaModel, SubnormalProductsAndOperands) {
  // A subnormal bf16 operand (2^-130 = 8 * 2^-133, exponent -126): exact product.
  EXPECT_EQ(block({0x1p-130}, {1.0}), 0x00080000u);
  EXPECT_EQ(block({0x1p-133}, {0x1p100}), bits_of(0x1p-33));
  // Sixteen products of 2^-152 each (below fp32's smallest subnormal) are summed exactly in the
  // window before the rounding: 2^-148. The fma chain rounds each to 0.
  const std::vector<double> tiny(16, 0x1p-76);
  EXPECT_EQ(block(tiny, tiny), 2u);
  EXPECT_EQ(fma_chain_bits(tiny, tiny), 0u);
  // One negative product below the smallest subnormal truncates to 0, and the result is +0 (the
  // H200 writes +0 for every sum that truncates to zero, whatever its sign).
  EXPECT_EQ(block({-0x1p-76}, {0x1p-76}), 0u);
  // The block exponent's floor, -133 (window last bit 2^-158): (23 * 2^-80)(89 * 2^-80) =
  // 2047 * 2^-160 keeps 511 * 2^-158 and 2^-160 is lost, so the exact sum 2^-149 becomes +0.
  EXPECT_EQ(block({23 * 0x1p-80, 0x1p-80}, {89 * 0x1p-80, 0x1p-80}), 0u);
  // A subnormal result from normal products: 3 * 2^-140 = 3 * 2^9 * 2^-149.
  EXPECT_EQ(block({3 * 0x1p-70}, {0x1p-70}), 3u << 9);
  // A subnormal accumulator (exponent -126) keeps its bits.
  EXPECT_EQ(block({0x1p-130}, {1.0}, float_from_bits(0x00000001u)), 0x00080001u);
}

TEST(WgmmaModel, InfinitiesAndNaN) {
  const double inf = HUGE_VAL;
  EXPECT_EQ(block({inf, 1.0}, {2.0, 1.0}), 0x7F800000u);
  EXPECT_EQ(block({inf}, {-1.0}), 0xFF800000u);
  EXPECT_EQ(block({inf}, {0.0}), wgmma::kWgmmaNanBits);             // inf * 0
  EXPECT_EQ(block({inf, -inf}, {1.0, 1.0}), wgmma::kWgmmaNanBits);  // inf - inf
  EXPECT_EQ(block({1.0}, {1.0}, float_from_bits(0x7F800000u)), 0x7F800000u);
  EXPECT_EQ(block({-inf}, {1.0}, float_from_bits(0x7F800000u)), wgmma::kWgmmaNanBits);
  const uint16_t nan_bf16 = 0x7FC1u, one = bf(1.0);
  EXPECT_EQ(wgmma::block_fma_bits(&nan_bf16, &one, 1, 0), wgmma::kWgmmaNanBits);
  EXPECT_EQ(wgmma::block_fma_bits(&one, &one, 1, 0xFFC00001u), wgmma::kWgmmaNanBits);
  // An infinity stays through later finite blocks, an overflow too.
  std::vector<double> a(64, 1.0), b(64, 1.0);
  a[40] = inf;
  EXPECT_EQ(dot_bits(a, b), 0x7F800000u);
  a[40] = 1.0;
  a[3] = 0x1p127;
  b[3] = 4.0;
  EXPECT_EQ(dot_bits(a, b), 0x7F800000u);
  a[40] = -inf;
  EXPECT_EQ(dot_bits(a, b), wgmma::kWgmmaNanBits);  // +inf from an overflow meets a -inf term
}

TEST(WgmmaModel, SignedZeros) {
  // Zero products take no part; a block of them gives +0, also over an accumulator of -0.
  EXPECT_EQ(block({-0.0, 0.0}, {1.0, -1.0}), 0u);
  EXPECT_EQ(block({-0.0}, {1.0}, -0.0f), 0u);
  EXPECT_EQ(block({-1.0, 1.0}, {1.0, 1.0}), 0u);
  // A -0 accumulator beside a product is the product.
  EXPECT_EQ(block({-2.0}, {1.0}, -0.0f), bits_of(-2.0));
  // K not a multiple of 16: the short last block is the zero-padded one.
  std::vector<double> a(17, 1.0), b(17, 0.5);
  EXPECT_EQ(dot_bits(a, b), bits_of(8.5));
}

// An independent statement of the same rules in floating point (exact double operations only),
// against the integer model on random blocks: exponents spread from tight to 60 binades, signs,
// subnormal operands, zeros, accumulators of every magnitude.
namespace {

uint32_t oracle_block(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, float c) {
  auto e_of = [](double x) { return std::max(std::ilogb(x), -126); };
  int e = -133;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_float(a[i]), y = bf16_to_float(b[i]);
    if (x != 0 && y != 0) e = std::max(e, e_of(x) + e_of(y));
  }
  if (c != 0) e = std::max(e, e_of(c));
  const double grid = std::ldexp(1.0, e - 25);
  double sum = std::trunc(static_cast<double>(c) / grid) * grid;
  for (size_t i = 0; i < a.size(); ++i) {
    const double p = static_cast<double>(bf16_to_float(a[i])) * bf16_to_float(b[i]);
    sum += std::trunc(p / grid) * grid;
  }
  if (sum == 0) return 0;
  if (std::fabs(sum) >= 0x1p128) return sum < 0 ? 0xFF800000u : 0x7F800000u;
  float f = static_cast<float>(sum);  // to nearest, then one step toward zero where it went past
  if (std::fabs(static_cast<double>(f)) > std::fabs(sum)) f = std::nextafter(f, 0.0f);
  return f == 0.0f ? 0u : float_bits(f);  // a sum that truncates to zero is +0
}

uint16_t random_bf16_at(Rng& rng, int exp_lo, int exp_hi) {
  if (rng.below(16) == 0) return rng.below(2) ? 0x8000u : 0u;
  const int e = exp_lo + static_cast<int>(rng.below(static_cast<uint64_t>(exp_hi - exp_lo + 1)));
  const uint32_t sign = rng.below(2) ? 0x8000u : 0u;
  if (e < -126) return static_cast<uint16_t>(sign | (1 + rng.below(127)));  // subnormal
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(e + 127) << 7) | rng.below(128));
}

}  // namespace

TEST(WgmmaModel, AgreesWithAFloatingPointOracleOnRandomBlocks) {
  Rng rng(17);
  int64_t blocks = 0, nonzero = 0;
  for (int spread : {0, 2, 8, 24, 60}) {
    for (int base : {-133, -120, -60, -10, 0, 10, 60, 120}) {
      for (int rep = 0; rep < 2000; ++rep) {
        const int n = 1 + static_cast<int>(rng.below(16));
        std::vector<uint16_t> a(static_cast<size_t>(n)), b(a.size());
        for (int i = 0; i < n; ++i) {
          a[i] = random_bf16_at(rng, std::max(-133, base - spread), std::min(127, std::max(-133, base + spread)));
          b[i] = random_bf16_at(rng, std::max(-133, -spread / 2), std::min(127, spread / 2));
        }
        float c = 0.0f;
        if (rng.below(3) != 0) {
          const int ce = std::clamp(base + static_cast<int>(rng.below(2 * spread + 3)) - spread - 1, -149, 127);
          c = std::ldexp(static_cast<float>(1 + rng.below(1u << 23)) / 0x1p23f, ce);
          if (rng.below(2)) c = -c;
        }
        const uint32_t got = wgmma::block_fma_bits(a.data(), b.data(), n, float_bits(c));
        ASSERT_EQ(got, oracle_block(a, b, c)) << "spread " << spread << " base " << base << " rep " << rep;
        ++blocks;
        nonzero += got != 0;
      }
    }
  }
  EXPECT_GT(nonzero, blocks / 2);
}

// ------------------------------------------------------------- the emulated backend's GEMM

namespace {

// A problem whose values stress the model: random rows, a peaked row, huge and tiny exponents, a
// subnormal column, an exact-cancellation column, -0, and (with specials) an infinity and a NaN.
Problem adversarial_problem(int64_t rows, int64_t dim, int64_t vocab, bool specials, uint64_t seed) {
  Problem p = make_problem({.rows = rows, .dim = dim, .vocab = vocab, .bias = true, .seed = seed});
  Rng rng(seed + 99);
  for (int64_t k = 0; k < dim; ++k) {
    p.hidden[static_cast<size_t>(1 % rows * dim + k)] = random_bf16_at(rng, -40, 40);
    if (vocab > 2) p.weight[static_cast<size_t>(2 * dim + k)] = random_bf16_at(rng, -133, -100);
    if (vocab > 3) p.weight[static_cast<size_t>(3 * dim + k)] = k % 2 ? p.weight[3 * dim + k - 1] ^ 0x8000u : 0x3F80u;
  }
  if (rows > 2) std::copy_n(p.weight.begin() + 5 % vocab * dim, dim, p.hidden.begin() + 2 * dim);  // peaked row
  p.hidden[0] = 0x8000u;
  if (specials && rows > 3 && vocab > 6) {
    p.hidden[static_cast<size_t>(3 * dim + dim / 2)] = 0x7F80u;  // +inf in row 3
    p.weight[static_cast<size_t>(6 * dim + dim - 1)] = 0xFFC1u;  // a NaN in column 6
  }
  return p;
}

// The model's serving logits of p on the host: wgmma::dot per element, then the bias as the SM90
// epilogue adds it (a NaN written as the SM90 writes it).
std::vector<float> model_logits(const Problem& p) {
  std::vector<float> z(static_cast<size_t>(p.rows * p.vocab));
  for (int64_t n = 0; n < p.rows; ++n)
    for (int64_t v = 0; v < p.vocab; ++v) {
      float x = wgmma::dot(p.hidden.data() + n * p.dim, p.weight.data() + v * p.dim, p.dim);
      if (!p.bias.empty()) x = detlogp::add_bias(x, p.bias[static_cast<size_t>(v)]);
      if (std::isnan(x)) x = float_from_bits(wgmma::kWgmmaNanBits);
      z[static_cast<size_t>(n * p.vocab + v)] = x;
    }
  return z;
}

detlogp::CallOptions emulated_options() {
  detlogp::CallOptions opt;
  opt.backend = kEmulatedId;
  return opt;
}

}  // namespace

TEST(WgmmaEmulatedBackend, ServingLogitsAreTheModelsElementByElement) {
  for (int64_t dim : {1, 15, 16, 17, 100, 384, 1000}) {
    for (bool specials : {false, true}) {
      const Problem p = adversarial_problem(9, dim, 203, specials, static_cast<uint64_t>(dim) + specials);
      const Outputs out = run_linear_logp(p, true, emulated_options());
      const std::vector<float> want = model_logits(p);
      int64_t differ = 0;
      for (size_t i = 0; i < want.size(); ++i) differ += float_bits(out.logits[i]) != float_bits(want[i]);
      EXPECT_EQ(differ, 0) << "dim " << dim << " specials " << specials;
      // The statistics are the contract's reducer over those logits.
      const Outputs red = run_reduce_logits(p, out.logits);
      EXPECT_TRUE(detlogp::bitcmp::compare(red.logp, out.logp)) << "dim " << dim;
      EXPECT_TRUE(detlogp::bitcmp::compare(red.lse, out.lse)) << "dim " << dim;
    }
  }
}

TEST(WgmmaEmulatedBackend, TheThreadCountChangesNoBit) {
  const Problem p = adversarial_problem(37, 256, 777, true, 5);
  const Outputs a = run_linear_logp(p, true, emulated_options());
  ScopedEnv one("DETLOGP_CPU_THREADS", "1");
  const Outputs b = run_linear_logp(p, true, emulated_options());
  EXPECT_TRUE(detlogp::bitcmp::compare(a.logits, b.logits)) << detlogp::bitcmp::compare(a.logits, b.logits).describe();
  EXPECT_TRUE(detlogp::bitcmp::compare(a.logp, b.logp));
  EXPECT_TRUE(detlogp::bitcmp::compare(a.lse, b.lse));
}

TEST(WgmmaEmulatedBackend, DiffersFromTheCpuFp32ChainOnRandomRows) {
  const Problem p = make_problem({.rows = 16, .dim = 384, .vocab = 512, .seed = 8});
  const Outputs emu = run_linear_logp(p, true, emulated_options());
  const Outputs cpu = run_linear_logp(p, true);
  int64_t differ = 0;
  for (size_t i = 0; i < emu.logits.size(); ++i) differ += float_bits(emu.logits[i]) != float_bits(cpu.logits[i]);
  EXPECT_GT(differ, static_cast<int64_t>(emu.logits.size() / 10)) << "the two K walks should round differently";
}

TEST(WgmmaEmulatedBackend, IsListedWithTheSm90KeyAndNeverChosenByAuto) {
  const auto all = detlogp::list_backends();
  const detlogp::BackendInfo* emu = nullptr;
  for (const auto& b : all)
    if (b.id == kEmulatedId) emu = &b;
  ASSERT_NE(emu, nullptr);
  EXPECT_TRUE(emu->contract_bearing);
  EXPECT_TRUE(emu->available);
  EXPECT_EQ(emu->memory, detlogp::Memory::host);
  EXPECT_EQ(emu->provenance.arch, "sm90a");
  EXPECT_EQ(emu->provenance.cc, 90);
  EXPECT_EQ(emu->provenance.entropy_id, detlogp::kEntropyId);
  detlogp::CallReport r;
  run_linear_logp(make_problem({}), false, detlogp::CallOptions{}, &r);
  EXPECT_NE(r.provenance.backend_id, kEmulatedId);
  detlogp::CallOptions strict = emulated_options();
  strict.strict = true;
  run_linear_logp(make_problem({}), false, strict, &r);
  EXPECT_EQ(r.provenance.backend_id, kEmulatedId);
  EXPECT_FALSE(r.fallback);
}

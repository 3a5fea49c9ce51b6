// The CPU contract GEMM's kernels (every instruction set this CPU runs) and its vectorized tile
// summary against their plain scalar definitions, bit for bit: a K-ascending loop of separately
// rounded multiplies and adds from +0 (docs/contract.md §3.1), and detlogp::tile_summary (§5).
// Odd shapes reach every tail: partial panels (V = 17, 123, 2053), K tails of the packing
// (D = 1, 7, 1000), row blocks of every height (N = 1, 5, 64).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_tile_summary.hpp"
#include "scoped_env.hpp"
#include "test_util.hpp"

namespace {

using detlogp::fp::bf16_round;
using detlogp::fp::bf16_to_float;
using detlogp::fp::bits;
using detlogp::fp::from_bits;
namespace cpu = detlogp::cpu;

enum class Data { kRandom, kPeaked, kSpecial };
const char* data_name(Data d) { return d == Data::kRandom ? "random" : d == Data::kPeaked ? "peaked" : "special"; }

struct Operands {
  int64_t n = 0, d = 0, v = 0;
  std::vector<uint16_t> h, w;  // [n][d], [v][d] bf16
};

// random: h ~ N(0, 1), W ~ N(0, 0.02). peaked: row r's hidden is 40x weight row (7r mod V), so
// that one logit a row dominates. special: random, with 1 entry in 8 replaced by a subnormal
// bf16, a value near the fp32 maximum (products overflow), +-inf, NaN or -0.
Operands make_operands(int64_t n, int64_t d, int64_t v, Data data, uint64_t seed) {
  detlogp_test::Rng rng(seed);
  Operands o{n, d, v, detlogp_test::random_bf16(static_cast<size_t>(n * d), 1.0, rng),
             detlogp_test::random_bf16(static_cast<size_t>(v * d), 0.02, rng)};
  if (data == Data::kPeaked)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t k = 0; k < d; ++k) o.h[r * d + k] = bf16_round(40.0f * bf16_to_float(o.w[(7 * r % v) * d + k]));
  if (data == Data::kSpecial) {
    const uint16_t specials[] = {0x0001, 0x8003, 0x007F, 0x7F00, 0xFF00, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x8000};
    for (auto* m : {&o.h, &o.w})
      for (auto& b : *m)
        if (rng.below(8) == 0) b = specials[rng.below(sizeof specials / sizeof specials[0])];
  }
  return o;
}

// The definition: one accumulator from +0, k ascending, fl(acc + fl(h * w)). On x86 the multiply
// and the add are written out with the operand order the vector kernels use (h * w, acc + product),
// which decides the payload where both operands are NaN; elsewhere the compiler's order (the test
// inherits -ffp-contract=off from the library target).
float mul_add(float acc, float h, float w) {
#if defined(__x86_64__)
  float product;
  asm("mulss %2, %0" : "=x"(product) : "0"(h), "x"(w));
  asm("addss %1, %0" : "+x"(acc) : "x"(product));
  return acc;
#else
  return acc + h * w;
#endif
}

float scalar_logit(const Operands& o, int64_t r, int64_t c) {
  float acc = 0.0f;
  for (int64_t k = 0; k < o.d; ++k)
    acc = mul_add(acc, bf16_to_float(o.h[r * o.d + k]), bf16_to_float(o.w[c * o.d + k]));
  return acc;
}

std::vector<float> scalar_logits(const Operands& o) {
  std::vector<float> z(static_cast<size_t>(o.n * o.v));
  for (int64_t r = 0; r < o.n; ++r)
    for (int64_t c = 0; c < o.v; ++c) z[r * o.v + c] = scalar_logit(o, r, c);
  return z;
}

// "" when z equals want bit for bit, else the first mismatch. With nan_class, a NaN matches any
// NaN: which payload x86 keeps when both operands of a multiply or an add are NaN depends on their
// order in the instruction, which the compiler may swap in code written with + and * (the portable
// kernel, and the backend on a CPU without AVX2).
std::string first_mismatch(const std::vector<float>& want, const std::vector<float>& got, int64_t cols,
                           bool nan_class = false) {
  for (size_t i = 0; i < want.size(); ++i)
    if (bits(want[i]) != bits(got[i]) && !(nan_class && want[i] != want[i] && got[i] != got[i])) {
      std::ostringstream s;
      s << "first mismatch at row " << i / cols << " column " << i % cols << ": got " << got[i] << " (0x" << std::hex
        << bits(got[i]) << "), the scalar walk gives " << want[i] << " (0x" << bits(want[i]) << ")";
      return s.str();
    }
  return "";
}

std::vector<cpu::GemmIsa> supported_isas() {
  std::vector<cpu::GemmIsa> out;
  for (cpu::GemmIsa isa : {cpu::GemmIsa::kPortable, cpu::GemmIsa::kAvx2, cpu::GemmIsa::kAvx512})
    if (cpu::gemm_isa_supported(isa)) out.push_back(isa);
  return out;
}

// Every panel of the weight packed and multiplied by one kernel, rows fed `group` at a time as the
// backends feed them.
std::vector<float> kernel_logits(const Operands& o, cpu::GemmIsa isa, int group) {
  std::vector<float> h32(o.h.size());
  for (size_t i = 0; i < h32.size(); ++i) h32[i] = bf16_to_float(o.h[i]);
  std::vector<float> z(static_cast<size_t>(o.n * o.v));
  std::vector<float> tile(static_cast<size_t>(group) * cpu::kPanelCols);
  cpu::WeightPanel panel;
  for (int64_t c0 = 0; c0 < o.v; c0 += cpu::kPanelCols) {
    const int cols = static_cast<int>(std::min<int64_t>(cpu::kPanelCols, o.v - c0));
    cpu::load_weight_panel(isa, o.w.data(), o.d, c0, cols, o.d, panel);
    for (int64_t r0 = 0; r0 < o.n; r0 += group) {
      const int rows = static_cast<int>(std::min<int64_t>(group, o.n - r0));
      cpu::gemm_rows_panel(isa, h32.data() + r0 * o.d, rows, o.d, panel, tile.data(), cpu::kPanelCols);
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) z[(r0 + r) * o.v + c0 + c] = tile[r * cpu::kPanelCols + c];
    }
  }
  return z;
}

class CpuGemm : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, Data>> {};

TEST_P(CpuGemm, EveryKernelEqualsTheScalarWalk) {
  const auto [v, d, n, data] = GetParam();
  const Operands o = make_operands(n, d, v, data, static_cast<uint64_t>(v * 1000003 + d * 101 + n));
  const std::vector<float> want = scalar_logits(o);
  for (cpu::GemmIsa isa : supported_isas())
    for (int group : {cpu::kRowGroup, 7}) {
      const std::string m = first_mismatch(want, kernel_logits(o, isa, group), v, isa == cpu::GemmIsa::kPortable);
      EXPECT_EQ(m, "") << cpu::gemm_isa_name(isa) << " kernel, rows fed " << group << " at a time, N=" << n
                       << " D=" << d << " V=" << v << " " << data_name(data) << ": " << m;
    }
}

// The backend end to end (panels, row blocks, workers, prefetch): its serving logits are z.
TEST_P(CpuGemm, TheBackendsLogitsEqualTheScalarWalk) {
  const auto [v, d, n, data] = GetParam();
  const Operands o = make_operands(n, d, v, data, static_cast<uint64_t>(v * 7919 + d * 31 + n));
  const std::vector<float> want = scalar_logits(o);
  detlogp_test::Problem p;
  p.rows = n, p.dim = d, p.vocab = v, p.real_vocab = v;
  p.hidden = o.h, p.weight = o.w;
  for (int64_t r = 0; r < n; ++r) p.targets.push_back((7 * r) % v);
  for (const char* threads : {"1", "3"}) {
    detlogp_test::ScopedEnv env("DETLOGP_CPU_THREADS", std::string(threads));
    const detlogp_test::Outputs out = detlogp_test::run_linear_logp(p, /*with_logits=*/true);
    const std::string m = first_mismatch(want, out.logits, v, cpu::gemm_isa() == cpu::GemmIsa::kPortable);
    EXPECT_EQ(m, "") << "backend logits, DETLOGP_CPU_THREADS=" << threads << ", N=" << n << " D=" << d << " V=" << v
                     << " " << data_name(data) << ": " << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuGemm,
                         ::testing::Combine(::testing::Values(17, 123, 2053), ::testing::Values(1, 7, 64, 1000),
                                            ::testing::Values(1, 5, 64),
                                            ::testing::Values(Data::kRandom, Data::kPeaked, Data::kSpecial)),
                         [](const auto& info) {
                           return "V" + std::to_string(std::get<0>(info.param)) + "_D" +
                                  std::to_string(std::get<1>(info.param)) + "_N" +
                                  std::to_string(std::get<2>(info.param)) + "_" + data_name(std::get<3>(info.param));
                         });

// ---------------------------------------------------------------- tile summary

std::string summary_mismatch(const float* y, int lanes) {
  const detlogp::TileSummary want = detlogp::tile_summary(y, lanes);
  const detlogp::TileSummary got = cpu::fast_tile_summary(y, lanes);
  // A NaN field matches any NaN: a NaN tile takes the scalar definition itself, whose NaN payloads
  // depend on how the compiler orders its commutative adds (the library and the test are compiled
  // apart).
  const auto same = [](float a, float b) { return bits(a) == bits(b) || (a != a && b != b); };
  if (same(want.max, got.max) && same(want.sum, got.sum)) return "";
  std::ostringstream s;
  s << "real lanes " << lanes << ": got {" << got.max << ", " << got.sum << "} (0x" << std::hex << bits(got.max)
    << ", 0x" << bits(got.sum) << "), the definition gives {" << want.max << ", " << want.sum << "} (0x"
    << bits(want.max) << ", 0x" << bits(want.sum) << ")";
  return s.str();
}

TEST(CpuTileSummary, EqualsTheDefinitionBitForBit) {
  detlogp_test::Rng rng(2024);
  // Scales from a flat tile to one whose lanes span expc's whole range: x = y - m down to and
  // past -87 (subnormal e, the two-step scaling) and -104 (e = 0).
  const double scales[] = {1e-3, 1.0, 8.0, 30.0, 60.0, 200.0};
  float y[detlogp::kVocabTile];
  int vectorized = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const double scale = scales[trial % 6];
    for (float& x : y) x = static_cast<float>(rng.normal() * scale);
    if (trial % 7 == 0) y[rng.below(64)] = -0.0f;
    if (trial % 11 == 0)
      for (float& x : y) x = -0.0f;  // a -0 maximum
    if (trial % 13 == 0) y[rng.below(64)] = detlogp::fp::neg_inf();
    if (trial % 17 == 0) y[rng.below(64)] = detlogp::fp::pos_inf();
    if (trial % 19 == 0) y[rng.below(64)] = from_bits(0x7FC12345u);
    if (trial % 23 == 0) y[rng.below(64)] = from_bits(0x00000005u);  // a subnormal logit
    const int lanes = trial % 5 == 0 ? static_cast<int>(rng.below(65)) : detlogp::kVocabTile;
    detlogp::TileSummary unused;
    vectorized += lanes == detlogp::kVocabTile && cpu::vector_tile_summary(y, unused);
    const std::string m = summary_mismatch(y, lanes);
    ASSERT_EQ(m, "") << "trial " << trial << ", scale " << scale << ": " << m;
  }
  if (cpu::gemm_isa_supported(cpu::GemmIsa::kAvx512)) {
    EXPECT_GT(vectorized, 3000) << "the vector path was not taken";
  }
}

// The vector expc lane by lane against expc: every 61st fp32 from +0 down to -110, every fp32
// within 2^12 ulps of the range ends (-104, the subnormal switch near -87.3, 0), positive x up to
// the overflow and past it, and NaN.
TEST(CpuTileSummary, TheVectorExpcEqualsExpc) {
  std::vector<float> x;
  for (uint32_t u = 0x80000000u; from_bits(u) >= -110.0f; u += 61) x.push_back(from_bits(u));
  for (float edge : {-104.0f, -87.33654f, -0.0f, 88.0f, 88.72283f})
    for (int i = -4096; i <= 4096; ++i)
      x.push_back(from_bits(static_cast<uint32_t>(static_cast<int64_t>(bits(edge)) + i)));
  for (float v :
       {0.5f, 1.0f, 10.0f, 87.0f, 1e30f, detlogp::fp::pos_inf(), detlogp::fp::neg_inf(), from_bits(0x7FC00000u)})
    x.push_back(v);
  x.resize((x.size() + 15) / 16 * 16, 0.0f);
  std::vector<float> e(x.size());
  if (!cpu::vector_expc(x.data(), e.data(), static_cast<int64_t>(x.size()))) GTEST_SKIP() << "no AVX-512 on this CPU";
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = detlogp::expc(x[i]);
    ASSERT_EQ(bits(e[i]), bits(want)) << "x = " << x[i] << " (0x" << std::hex << bits(x[i]) << "): got 0x" << bits(e[i])
                                      << ", expc gives 0x" << bits(want);
  }
}

}  // namespace

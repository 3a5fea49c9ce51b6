// The CPU contract backend against a float64 reference, the exact K-ascending fp32 logits of the
// serving entry, temperature, ignore_index, padding and the public reducer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <tuple>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;

namespace {

struct AccuracyStats {
  double max_logp_err = 0, max_lse_err = 0;
  double max_ratio = 0;    // max over rows and outputs of |err| / bound
  double max_rel_eps = 0;  // max of |err| / ((1 + |ref|) 2^-23)
  double max_logp_bound = 0;
};

// Checks every row of out against the float64 reference within the per-row bound of
// test_util.hpp (see the error model there) and returns the statistics.
AccuracyStats check_against_reference(const Problem& p, const Outputs& out, const std::string& label) {
  AccuracyStats st;
  for (int64_t n = 0; n < p.rows; ++n) {
    const ReferenceRow ref = reference_row(p, n);
    const double lse_err = std::fabs(static_cast<double>(out.lse[n]) - ref.lse);
    EXPECT_LE(lse_err, ref.lse_bound) << label << " row " << n << ": lse " << out.lse[n] << " vs reference " << ref.lse;
    st.max_lse_err = std::max(st.max_lse_err, lse_err);
    st.max_ratio = std::max(st.max_ratio, lse_err / ref.lse_bound);
    st.max_rel_eps = std::max(st.max_rel_eps, lse_err / ((1 + std::fabs(ref.lse)) * 0x1p-23));
    if (ref.ignored) continue;
    const double logp_err = std::fabs(static_cast<double>(out.logp[n]) - ref.logp);
    EXPECT_LE(logp_err, ref.logp_bound) << label << " row " << n << ": logp " << out.logp[n] << " vs reference "
                                        << ref.logp;
    EXPECT_LE(out.logp[n], 0.0f);
    st.max_logp_err = std::max(st.max_logp_err, logp_err);
    st.max_ratio = std::max(st.max_ratio, logp_err / ref.logp_bound);
    st.max_rel_eps = std::max(st.max_rel_eps, logp_err / ((1 + std::fabs(ref.logp)) * 0x1p-23));
    st.max_logp_bound = std::max(st.max_logp_bound, ref.logp_bound);
  }
  std::printf(
      "%-34s max|dlogp| %.3e  max|dlse| %.3e  max err/bound %.3f  max err/((1+|ref|)2^-23) %.1f  (logp bound <= "
      "%.3e)\n",
      label.c_str(), st.max_logp_err, st.max_lse_err, st.max_ratio, st.max_rel_eps, st.max_logp_bound);
  std::fflush(stdout);
  return st;
}

// Sets row 0's target to its largest logit (logp near 0: exercises the clamp side).
void target_row0_argmax(Problem& p) {
  int64_t best = 0;
  float best_z = -INFINITY;
  for (int64_t v = 0; v < p.real_vocab; ++v) {
    const float z = contract_logit(p, 0, v);
    if (z > best_z) best_z = z, best = v;
  }
  p.targets[0] = best;
}

}  // namespace

// ---------------------------------------------------------------- accuracy vs float64

class AccuracyVsFloat64 : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(AccuracyVsFloat64, WithinTheStatedFp32Bound) {
  const auto [D, V, bias] = GetParam();
  ProblemSpec s;
  s.rows = 12;
  s.dim = D;
  s.vocab = V;
  s.bias = bias;
  s.seed = static_cast<uint64_t>(D * 100003 + V * 2 + bias);
  Problem p = make_problem(s);
  target_row0_argmax(p);
  const Outputs out = run_linear_logp(p);
  const std::string label = "D=" + std::to_string(D) + " V=" + std::to_string(V) + (bias ? " bias" : " no-bias");
  const AccuracyStats st = check_against_reference(p, out, label);
  // The bound is a few standard deviations of the fp32 error, not a loose tolerance: the
  // observed error must be a visible fraction of it (this catches a bound that drifted loose).
  EXPECT_GT(st.max_ratio, 1e-3) << "bound far looser than the observed error";
}

INSTANTIATE_TEST_SUITE_P(Shapes, AccuracyVsFloat64,
                         ::testing::Combine(::testing::Values(64, 1024), ::testing::Values(17, 123, 2053, 30522),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "D" + std::to_string(std::get<0>(info.param)) + "_V" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_bias" : "_nobias");
                         });

TEST(AccuracyVsFloat64, PeakedLogitsWithinBound) {
  // Logits with standard deviation 12: softmax mass on a handful of ids, logp down to ~ -100.
  ProblemSpec s{
      .rows = 12, .dim = 512, .vocab = 2053, .real_vocab = -1, .bias = true, .logit_stddev = 12.0, .seed = 77};
  Problem p = make_problem(s);
  target_row0_argmax(p);
  check_against_reference(p, run_linear_logp(p), "D=512 V=2053 bias stddev 12");
}

// ---------------------------------------------------------------- exact logits

class ServingLogits : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ServingLogits, EqualTheScalarAscendingKWalkBitForBit) {
  const auto [D, bias] = GetParam();
  ProblemSpec s{.rows = 5,
                .dim = D,
                .vocab = 123,
                .real_vocab = -1,
                .bias = bias,
                .logit_stddev = 3.0,
                .seed = static_cast<uint64_t>(D + 1000 * bias)};
  const Problem p = make_problem(s);
  const Outputs out = run_linear_logp(p, /*with_logits=*/true);
  std::vector<float> want(static_cast<size_t>(p.rows * p.vocab));
  for (int64_t n = 0; n < p.rows; ++n)
    for (int64_t v = 0; v < p.vocab; ++v) want[n * p.vocab + v] = contract_logit(p, n, v);
  const bc::Result r = bc::compare(want, out.logits);
  EXPECT_TRUE(r.identical()) << r.describe("logits (row-major [N, V], expected = scalar K-ascending fp32 walk)");
}

INSTANTIATE_TEST_SUITE_P(Dims, ServingLogits,
                         ::testing::Combine(::testing::Values(1, 31, 64, 100, 1024), ::testing::Bool()),
                         [](const auto& info) {
                           return "D" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_bias" : "_nobias");
                         });

TEST(ServingLogits, SubnormalProductsFollowTheSeparatelyRoundedWalk) {
  // h, W ~ 2^-70: products ~ 2^-140 are subnormal in fp32 and round (the only case where a
  // bf16 x bf16 product is inexact), so a fused multiply-add would give other bits.
  Problem p = make_problem(ProblemSpec{
      .rows = 4, .dim = 100, .vocab = 70, .real_vocab = -1, .bias = false, .logit_stddev = 1.0, .seed = 99});
  for (auto& b : p.hidden) b = bf16_round(bf16_to_float(b) * 0x1p-70f);
  for (auto& b : p.weight) b = bf16_round(bf16_to_float(b) * 0x1p-60f);
  const Outputs out = run_linear_logp(p, true);
  std::vector<float> want(static_cast<size_t>(p.rows * p.vocab));
  int64_t differs_from_fma = 0;
  for (int64_t n = 0; n < p.rows; ++n) {
    for (int64_t v = 0; v < p.vocab; ++v) {
      want[n * p.vocab + v] = contract_logit(p, n, v);
      float fused = 0.0f;
      for (int64_t k = 0; k < p.dim; ++k) fused = std::fma(p.h(n, k), p.w(v, k), fused);
      differs_from_fma += bc::float_bits(fused) != bc::float_bits(want[n * p.vocab + v]);
    }
  }
  ASSERT_GT(differs_from_fma, 0) << "the inputs do not exercise inexact products";
  const bc::Result r = bc::compare(want, out.logits);
  EXPECT_TRUE(r.identical()) << r.describe("subnormal-product logits");
  // Everything is ~1e-40: softmax is uniform, lse = ln(V) to within an ulp.
  for (int64_t n = 0; n < p.rows; ++n) EXPECT_NEAR(out.lse[n], std::log(70.0), 1e-6);
}

// ---------------------------------------------------------------- temperature

TEST(Temperature, ScalarValuesAgainstFloat64) {
  for (float T : {1.0f, 0.7f, 1e-3f, 100.0f}) {
    ProblemSpec s{
        .rows = 12, .dim = 256, .vocab = 2053, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 5};
    Problem p = make_problem(s);
    p.temperature = T;
    char label[64];
    std::snprintf(label, sizeof label, "T=%g D=256 V=2053 bias", static_cast<double>(T));
    check_against_reference(p, run_linear_logp(p), label);
  }
}

TEST(Temperature, PerRowValuesAgainstFloat64AndEqualToScalarRunsOfTheSameRows) {
  ProblemSpec s{.rows = 12, .dim = 256, .vocab = 2053, .real_vocab = -1, .bias = false, .logit_stddev = 2.0, .seed = 6};
  Problem p = make_problem(s);
  const float temps[4] = {1.0f, 0.7f, 1e-3f, 100.0f};
  p.temperature_rows.resize(static_cast<size_t>(p.rows));
  for (int64_t n = 0; n < p.rows; ++n) p.temperature_rows[n] = temps[n % 4];
  const Outputs per_row = run_linear_logp(p);
  check_against_reference(p, per_row, "per-row T D=256 V=2053");
  // Row n with per-row T equals row n run with the scalar T of the same value, bit for bit.
  for (int k = 0; k < 4; ++k) {
    Problem q = p;
    q.temperature_rows.clear();
    q.temperature = temps[k];
    const Outputs scalar = run_linear_logp(q);
    for (int64_t n = k; n < p.rows; n += 4) {
      EXPECT_EQ(bc::float_bits(per_row.logp[n]), bc::float_bits(scalar.logp[n])) << "row " << n << " T " << temps[k];
      EXPECT_EQ(bc::float_bits(per_row.lse[n]), bc::float_bits(scalar.lse[n])) << "row " << n << " T " << temps[k];
    }
  }
}

TEST(Temperature, OneIsBitIdenticalToNoTemperature) {
  ProblemSpec s{.rows = 9, .dim = 128, .vocab = 517, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 8};
  const Problem plain = make_problem(s);  // temperature left at its default
  Problem ones = plain;
  ones.temperature = 1.0f;
  ones.temperature_rows.assign(static_cast<size_t>(plain.rows), 1.0f);
  const Outputs a = run_linear_logp(plain), b = run_linear_logp(ones);
  EXPECT_TRUE(bc::compare(a.logp, b.logp).identical()) << bc::compare(a.logp, b.logp).describe("logp");
  EXPECT_TRUE(bc::compare(a.lse, b.lse).identical()) << bc::compare(a.lse, b.lse).describe("lse");
}

TEST(Temperature, ServingLogitsAreUnscaled) {
  ProblemSpec s{.rows = 4, .dim = 64, .vocab = 200, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 9};
  Problem p = make_problem(s);
  const Outputs t1 = run_linear_logp(p, true);
  p.temperature = 0.7f;
  const Outputs t07 = run_linear_logp(p, true);
  EXPECT_TRUE(bc::compare(t1.logits, t07.logits).identical()) << bc::compare(t1.logits, t07.logits).describe("logits");
  EXPECT_FALSE(bc::compare(t1.lse, t07.lse).identical());
}

// ---------------------------------------------------------------- ignore_index

TEST(IgnoreIndex, DefaultMinus100GivesPositiveZeroAndTheRowsLse) {
  ProblemSpec s{.rows = 10, .dim = 128, .vocab = 777, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 10};
  const Problem p = make_problem(s);
  Problem q = p;
  for (int64_t n : {0, 3, 9}) q.targets[n] = -100;
  const Outputs a = run_linear_logp(p), b = run_linear_logp(q);
  for (int64_t n = 0; n < p.rows; ++n) {
    const bool ignored = n == 0 || n == 3 || n == 9;
    if (ignored) {
      EXPECT_EQ(bc::float_bits(b.logp[n]), 0x00000000u) << "row " << n;
    } else {
      EXPECT_EQ(bc::float_bits(b.logp[n]), bc::float_bits(a.logp[n])) << "row " << n;
    }
    EXPECT_EQ(bc::float_bits(b.lse[n]), bc::float_bits(a.lse[n])) << "row " << n;
  }
}

TEST(IgnoreIndex, CustomValueIsHonouredAndMinus100IsThenAnError) {
  ProblemSpec s{.rows = 6, .dim = 64, .vocab = 300, .real_vocab = -1, .bias = false, .logit_stddev = 2.0, .seed = 11};
  const Problem p = make_problem(s);
  Problem q = p;
  q.ignore_index = -1;
  q.targets[2] = -1;
  const Outputs a = run_linear_logp(p), b = run_linear_logp(q);
  EXPECT_EQ(bc::float_bits(b.logp[2]), 0x00000000u);
  EXPECT_EQ(bc::float_bits(b.lse[2]), bc::float_bits(a.lse[2]));
  for (int64_t n : {0, 1, 3, 4, 5}) EXPECT_EQ(bc::float_bits(b.logp[n]), bc::float_bits(a.logp[n]));
  q.targets[4] = -100;  // no longer the ignore value: a negative target
  EXPECT_THROW(run_linear_logp(q), detlogp::Error);
}

TEST(IgnoreIndex, ServingEntryStillWritesTheIgnoredRowsLogits) {
  ProblemSpec s{.rows = 3, .dim = 64, .vocab = 130, .real_vocab = -1, .bias = false, .logit_stddev = 2.0, .seed = 12};
  Problem p = make_problem(s);
  p.targets[1] = -100;
  const Outputs out = run_linear_logp(p, true);
  for (int64_t v = 0; v < p.vocab; ++v)
    ASSERT_EQ(bc::float_bits(out.logits[1 * p.vocab + v]), bc::float_bits(contract_logit(p, 1, v))) << "v " << v;
}

// ---------------------------------------------------------------- padding

namespace {

// The same problem with the weight (and bias) padded to padded_vocab rows; padding rows are
// filled with `fill` (bf16 bits) or, when fill == 0, with large random values.
Problem pad_vocab(const Problem& p, int64_t padded_vocab, uint16_t fill, uint64_t seed) {
  Problem q = p;
  q.vocab = padded_vocab;
  q.real_vocab = p.vocab;
  Rng rng(seed);
  q.weight.resize(static_cast<size_t>(padded_vocab * p.dim));
  for (size_t i = p.weight.size(); i < q.weight.size(); ++i)
    q.weight[i] = fill ? fill : bf16_round(static_cast<float>(rng.normal() * 1e3));
  if (!p.bias.empty()) {
    q.bias.resize(static_cast<size_t>(padded_vocab));
    for (size_t i = p.bias.size(); i < q.bias.size(); ++i) q.bias[i] = fill ? bf16_to_float(fill) : 5e3f;
  }
  return q;
}

void expect_same_rows(const Outputs& a, const Outputs& b, const std::string& what) {
  const bc::Result lp = bc::compare(a.logp, b.logp), ls = bc::compare(a.lse, b.lse);
  EXPECT_TRUE(lp.identical()) << lp.describe(what + " logp");
  EXPECT_TRUE(ls.identical()) << ls.describe(what + " lse");
}

}  // namespace

TEST(Padding, PaddedVocabGivesTheUnpaddedBits) {
  ProblemSpec s{.rows = 16, .dim = 96, .vocab = 1000, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 13};
  Problem p = make_problem(s);
  p.targets[5] = 999;  // the last real id, in the partially padded tile
  p.targets[6] = 960;  // the first id of that tile
  const Outputs plain = run_linear_logp(p, true);
  for (int64_t padded : {1005, 1024, 1088, 1152}) {
    const Problem q = pad_vocab(p, padded, 0, static_cast<uint64_t>(padded));
    const Outputs out = run_linear_logp(q, true);
    expect_same_rows(plain, out, "padded to " + std::to_string(padded));
    const bc::Result lg = bc::compare_rows(plain.logits.data(), p.vocab, out.logits.data(), padded, p.rows, p.vocab);
    EXPECT_TRUE(lg.identical()) << lg.describe("real logits columns, padded to " + std::to_string(padded));
  }
}

TEST(Padding, NanInPaddingRowsDoesNotLeak) {
  ProblemSpec s{.rows = 8, .dim = 64, .vocab = 1000, .real_vocab = -1, .bias = false, .logit_stddev = 2.0, .seed = 14};
  const Problem p = make_problem(s);
  const Outputs plain = run_linear_logp(p);
  expect_same_rows(plain, run_linear_logp(pad_vocab(p, 1088, detlogp::kCanonicalNanBf16, 1)), "NaN padding to 1088");
}

TEST(Padding, RealVocabBelowTheWeightRowsWithoutAnExtraTile) {
  // real_vocab = 960 exactly on a tile boundary with one whole padding tile after it.
  ProblemSpec s{.rows = 8, .dim = 64, .vocab = 960, .real_vocab = -1, .bias = false, .logit_stddev = 2.0, .seed = 15};
  const Problem p = make_problem(s);
  expect_same_rows(run_linear_logp(p), run_linear_logp(pad_vocab(p, 1024, 0, 2)), "padded 960 -> 1024");
}

// ---------------------------------------------------------------- the public reducer

TEST(ReduceLogits, OnTheServingLogitsGivesTheLinearLogpBits) {
  ProblemSpec s{
      .rows = 11, .dim = 160, .vocab = 1088, .real_vocab = 1000, .bias = true, .logit_stddev = 3.0, .seed = 16};
  Problem p = make_problem(s);
  p.targets[3] = -100;
  for (int variant = 0; variant < 3; ++variant) {
    if (variant == 1) p.temperature = 0.7f;
    if (variant == 2) {
      p.temperature_rows.resize(static_cast<size_t>(p.rows));
      for (int64_t n = 0; n < p.rows; ++n) p.temperature_rows[n] = 0.5f + 0.25f * static_cast<float>(n);
    }
    const Outputs served = run_linear_logp(p, true);
    const Outputs reduced = run_reduce_logits(p, served.logits);
    expect_same_rows(served, reduced, "reduce_logits variant " + std::to_string(variant));
  }
}

TEST(ReduceLogits, MatchesTheContractCoreRowByRow) {
  // reduce_logits over arbitrary fp32 logits == tile_summary + reduce_row_summaries.
  const int64_t rows = 5, V = 300;
  Rng rng(17);
  std::vector<float> z(static_cast<size_t>(rows * V));
  for (auto& x : z) x = static_cast<float>(rng.normal() * 5);
  z[2 * V + 7] = -INFINITY;
  Problem p;
  p.rows = rows;
  p.vocab = V;
  p.real_vocab = 290;
  p.temperature = 0.9f;
  p.targets = {0, 289, 7, -100, 150};
  const Outputs out = run_reduce_logits(p, z);
  const float inv = detlogp::inverse_temperature(p.temperature);
  for (int64_t n = 0; n < rows; ++n) {
    std::vector<detlogp::TileSummary> tiles;
    float y_t = 0.0f;
    for (int64_t g = 0; g * 64 < V; ++g) {
      float y[64] = {};
      const int real = static_cast<int>(std::clamp<int64_t>(p.real_vocab - g * 64, 0, 64));
      for (int l = 0; l < 64 && g * 64 + l < V; ++l) {
        y[l] = detlogp::scale_logit(z[n * V + g * 64 + l], inv);
        if (g * 64 + l == p.targets[n]) y_t = y[l];
      }
      tiles.push_back(detlogp::tile_summary(y, real));
    }
    const auto r =
        detlogp::reduce_row_summaries(tiles.data(), static_cast<int64_t>(tiles.size()), y_t, p.targets[n] == -100);
    EXPECT_EQ(bc::float_bits(out.lse[n]), bc::float_bits(r.lse)) << "row " << n;
    EXPECT_EQ(bc::float_bits(out.logp[n]), bc::float_bits(r.logp)) << "row " << n;
  }
}

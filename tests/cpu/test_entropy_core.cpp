// Unit tests of the entropy formulation of the contract core (include/detlogp/reduce.hpp,
// docs/contract.md §10): the lane term, the tile's entropy sum beside its summary, the entropy
// chain and finalize, against the definition H = -sum p log p evaluated in float64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "detlogp/reduce.hpp"
#include "test_random.hpp"

using detlogp::TileEntropySummary;
using detlogp::TileSummary;
using detlogp::fp::bits;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The entropy of scaled logits y[0..real) in float64: H = lse - sum p y.
double entropy_fp64(const std::vector<float>& y, int64_t real) {
  double m = -INFINITY;
  for (int64_t v = 0; v < real; ++v) m = std::max(m, static_cast<double>(y[v]));
  double s = 0.0, u = 0.0;
  for (int64_t v = 0; v < real; ++v) {
    const double e = std::exp(y[v] - m);
    s += e;
    u += e * (y[v] - m);
  }
  return std::log(s) - u / s;
}

// The contract's entropy of a row of scaled logits, through the tile functions and the chain.
float entropy_contract(const std::vector<float>& y, int64_t real) {
  const int64_t tiles = (static_cast<int64_t>(y.size()) + 63) / 64;
  std::vector<TileSummary> summaries(tiles);
  std::vector<float> usums(tiles);
  for (int64_t g = 0; g < tiles; ++g) {
    const int lanes = static_cast<int>(std::clamp<int64_t>(real - 64 * g, 0, 64));
    float lanes_y[64] = {};
    for (int i = 0; i < 64 && 64 * g + i < static_cast<int64_t>(y.size()); ++i) lanes_y[i] = y[64 * g + i];
    const TileEntropySummary t = detlogp::tile_entropy_summary(lanes_y, lanes);
    summaries[g] = t.summary;
    usums[g] = t.usum;
  }
  return detlogp::entropy_row_summaries(summaries.data(), usums.data(), tiles);
}

std::vector<float> normal_row(detlogp_test::Rng& rng, int64_t v, double scale) {
  std::vector<float> y(v);
  for (auto& x : y) x = static_cast<float>(scale * rng.normal());
  return y;
}

void expect_accurate(const std::vector<float>& y, int64_t real, const char* what) {
  const double want = entropy_fp64(y, real);
  const float got = entropy_contract(y, real);
  EXPECT_LE(std::abs(got - want), 1e-4 * std::max(1.0, want)) << what << ": H=" << got << " fp64=" << want;
  EXPECT_GE(got, 0.0f) << what;
}

}  // namespace

TEST(EntropyCore, TileSummaryBitsAreThoseOfTheLogpOnlyForm) {
  detlogp_test::Rng rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    float y[64];
    for (float& x : y) x = static_cast<float>(4.0 * rng.normal());
    const int real = static_cast<int>(rng.below(65));
    const TileSummary a = detlogp::tile_summary(y, real);
    const TileEntropySummary b = detlogp::tile_entropy_summary(y, real);
    EXPECT_EQ(bits(a.max), bits(b.summary.max));
    EXPECT_EQ(bits(a.sum), bits(b.summary.sum));
  }
}

TEST(EntropyCore, UsumIsTheAdjacentPairwiseTreeOfTheLaneTerms) {
  detlogp_test::Rng rng(11);
  float y[64];
  for (float& x : y) x = static_cast<float>(3.0 * rng.normal());
  const int real = 50;
  const TileEntropySummary t = detlogp::tile_entropy_summary(y, real);
  float w[64];
  for (int v = 0; v < 64; ++v) {
    if (v >= real) {
      w[v] = 0.0f;
      continue;
    }
    const float x = detlogp::fp::sub(y[v], t.summary.max);
    w[v] = detlogp::entropy_lane_term(detlogp::expc(x), x);
  }
  EXPECT_EQ(bits(t.usum), bits(detlogp::tile_tree_sum(w)));
  EXPECT_LE(t.usum, 0.0f);
}

TEST(EntropyCore, LaneTermIsZeroWhereTheExponentialIsZero) {
  EXPECT_EQ(bits(detlogp::entropy_lane_term(0.0f, -kInf)), 0u);  // never 0 * -inf
  EXPECT_EQ(bits(detlogp::entropy_lane_term(0.0f, -200.0f)), 0u);
  EXPECT_EQ(detlogp::entropy_lane_term(0.5f, -2.0f), -1.0f);
}

TEST(EntropyCore, PaddingLanesAreNeutralWhateverTheirContent) {
  float clean[64], dirty[64];
  detlogp_test::Rng rng(3);
  for (int v = 0; v < 64; ++v) clean[v] = dirty[v] = static_cast<float>(rng.normal());
  for (int v = 40; v < 64; ++v) {
    clean[v] = 0.0f;
    dirty[v] = v % 3 == 0 ? std::numeric_limits<float>::quiet_NaN() : (v % 3 == 1 ? kInf : 1e30f);
  }
  const TileEntropySummary a = detlogp::tile_entropy_summary(clean, 40);
  const TileEntropySummary b = detlogp::tile_entropy_summary(dirty, 40);
  EXPECT_EQ(bits(a.usum), bits(b.usum));
  EXPECT_EQ(bits(a.summary.sum), bits(b.summary.sum));
}

TEST(EntropyCore, OneRealLaneOrAllMassOnOneLaneGivesExactlyZero) {
  std::vector<float> y(300, 0.0f);
  y[0] = 3.0f;
  EXPECT_EQ(bits(entropy_contract(y, 1)), 0u);  // V_real = 1
  std::vector<float> peaked(2053, -150.0f);     // every other lane's exponential is exactly 0
  peaked[1234] = 20.0f;
  EXPECT_EQ(bits(entropy_contract(peaked, 2053)), 0u);
  std::vector<float> with_minus_inf(130, -kInf);
  with_minus_inf[77] = -5.0f;
  EXPECT_EQ(bits(entropy_contract(with_minus_inf, 130)), 0u);
}

TEST(EntropyCore, TwoEqualLanesGiveLn2AndUniformRowsGiveLogV) {
  std::vector<float> two = {1.5f, 1.5f};
  EXPECT_NEAR(entropy_contract(two, 2), std::log(2.0), 2e-7);
  std::vector<float> flat(151936, -0.25f);
  EXPECT_NEAR(entropy_contract(flat, 151936), std::log(151936.0), 1e-4 * std::log(151936.0));
}

TEST(EntropyCore, NanStaysInItsRowAndAnEmptyRowIsNan) {
  std::vector<float> y(200, 1.0f);
  y[150] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(bits(entropy_contract(y, 200)), detlogp::kCanonicalNanBits);
  std::vector<float> inf_row(100, 0.0f);
  inf_row[5] = kInf;
  EXPECT_EQ(bits(entropy_contract(inf_row, 100)), detlogp::kCanonicalNanBits);
  std::vector<float> all_minus_inf(64, -kInf);
  EXPECT_EQ(bits(entropy_contract(all_minus_inf, 64)), detlogp::kCanonicalNanBits);
}

TEST(EntropyCore, ChainSkipsTilesFarBelowTheMaximumExactly) {
  // A tile whose factor expc(m_g - M) is 0 contributes nothing, even where s_g * d would overflow.
  const TileSummary far{-3.0e38f, 1.0f};
  const float u = detlogp::entropy_chain_step(-0.5f, far, -2.0f, 3.0e38f);
  EXPECT_EQ(bits(u), bits(-0.5f));
  const TileSummary empty{-kInf, 0.0f};
  EXPECT_EQ(bits(detlogp::entropy_chain_step(-0.25f, empty, 0.0f, 1.0f)), bits(-0.25f));
}

TEST(EntropyCore, FoldedChainStepHasTheStepsBits) {
  // The device combine's form (term and skip folded into the operands, one fma per tile) against
  // entropy_chain_step, over tiles that take every branch: skipped (s_g == 0, factor 0), NaN, the
  // maximum's own tile (d = 0), and ordinary ones, from every kind of running U.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<TileSummary> tiles = {{0.0f, 1.0f},     {-3.0e38f, 1.0f}, {-kInf, 0.0f}, {-1.5f, 3.25f},
                                          {-100.0f, 64.0f}, {nan, 2.0f},      {-0.0f, 1.0f}, {-87.5f, 1.0f},
                                          {-20.0f, 1e-30f}, {-1e-6f, 63.5f}};
  const std::vector<float> usums = {0.0f, -2.0f, 0.0f, -1.0f, -50.0f, nan, -0.0f, -3.0f, -1e-30f, -0.75f};
  const std::vector<float> running = {0.0f, -0.0f, -0.5f, -1e30f, -kInf, nan, -1e-45f};
  for (float global_max : {0.0f, 3.0e38f, 1e-6f}) {
    for (size_t g = 0; g < tiles.size(); ++g) {
      const float f = detlogp::chain_factor_or_skip(tiles[g], global_max);
      const float a = detlogp::entropy_chain_term_or_skip(tiles[g], usums[g], global_max, f);
      for (float u : running) {
        const float step = detlogp::entropy_chain_step(u, tiles[g], usums[g], global_max);
        const float folded = detlogp::entropy_chain_fma(u, a, f);
        if (step != step) {
          EXPECT_NE(folded, folded) << "tile " << g << " U " << u;
        } else {
          EXPECT_EQ(bits(folded), bits(step)) << "tile " << g << " U " << u << " M " << global_max;
        }
      }
    }
  }
}

TEST(EntropyCore, MeetsTheAccuracyBoundOnRandomPeakedFlatAndLargeRows) {
  detlogp_test::Rng rng(2026);
  for (int64_t v : {17, 123, 2053, 151936}) {
    expect_accurate(normal_row(rng, v, 1.0), v, "random");
    expect_accurate(normal_row(rng, v, 0.02), v, "flat");
    std::vector<float> peaked = normal_row(rng, v, 1.0);
    peaked[rng.below(v)] = 40.0f;  // logp of the peak near 0, H near 0
    expect_accurate(peaked, v, "peaked");
    std::vector<float> large = normal_row(rng, v, 80.0 / 0.3 / 3.0);  // |z| ~ 80 at T = 0.3
    expect_accurate(large, v, "large logits");
  }
  // Mildly peaked: one lane about 8..16 above the rest, so S = 1 + eps with eps spread over every
  // tile at about an ulp of S per step (the case the compensation C is for): within 1e-3 of H.
  for (float peak : {8.0f, 10.0f, 12.0f, 14.0f, 16.0f}) {
    std::vector<float> mild = normal_row(rng, 151936, 1.0);
    mild[rng.below(151936)] = peak + 4.0f;
    const double want = entropy_fp64(mild, 151936);
    const float got = entropy_contract(mild, 151936);
    expect_accurate(mild, 151936, "mildly peaked");
    EXPECT_LE(std::abs(got - want), 1e-3 * want) << "mildly peaked, peak " << peak << ": H=" << got << " fp64=" << want;
  }
  // Padded: the real vocabulary ends inside a tile.
  std::vector<float> padded = normal_row(rng, 2112, 2.0);
  expect_accurate(padded, 2053, "padded");
}

TEST(EntropyCore, HasItsOwnId) {
  EXPECT_NE(std::string(detlogp::kEntropyId), std::string(detlogp::kTreeId));
  EXPECT_NE(std::string(detlogp::kEntropyId).find("-v1"), std::string::npos);
}

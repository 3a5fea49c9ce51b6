// Unit tests of the contract core (include/detlogp/reduce.hpp): the in-tile tree, the tile
// summary, the chain, finalize, temperature scaling and the frozen constants.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "detlogp/bitcmp.hpp"
#include "detlogp/config.hpp"
#include "detlogp/reduce.hpp"
#include "test_util.hpp"

using detlogp::TileSummary;
using detlogp::fp::bits;
using detlogp::fp::from_bits;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The adjacent-pairwise tree written as the obvious recursion: a block of n lanes is the sum
// of its left half and its right half (for n a power of two this is level l adding elements
// 2i and 2i+1 of level l-1).
float recursive_adjacent_tree(const float* e, int n) {
  if (n == 1) return e[0];
  const float left = recursive_adjacent_tree(e, n / 2);
  const float right = recursive_adjacent_tree(e + n / 2, n / 2);
  return left + right;
}

float sequential_sum(const float* e, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s = s + e[i];
  return s;
}

// Pairs i with i + n/2 at each level (the usual "strided" GPU reduction): a different tree.
float strided_tree(std::vector<float> e) {
  for (size_t half = e.size() / 2; half >= 1; half /= 2)
    for (size_t i = 0; i < half; ++i) e[i] = e[i] + e[i + half];
  return e[0];
}

}  // namespace

TEST(FrozenConstants, HaveTheContractV1Values) {
  EXPECT_EQ(detlogp::kContractVersion, 1);
  EXPECT_EQ(detlogp::kVocabTile, 64);
  EXPECT_EQ(detlogp::kTileTreeLevels, 6);
  EXPECT_EQ(detlogp::kKSlab, 32);
  EXPECT_EQ(detlogp::kDefaultIgnoreIndex, -100);
  EXPECT_EQ(detlogp::kCanonicalNanBits, 0x7FC00000u);
  EXPECT_GT(std::strlen(detlogp::kTreeId), 0u);
  EXPECT_GT(std::strlen(detlogp::kTranscendentalId), 0u);
  EXPECT_GT(std::strlen(detlogp::kTemperatureId), 0u);
}

TEST(TileTree, HandWorkedCaseWhereAssociationMatters) {
  // 2^24 + 1 rounds back to 2^24 (tie to even), but 1 + 1 = 2 is exact and 2^24 + 2 is
  // representable. Lanes: e[0] = 2^24, e[2] = e[3] = 1, the rest 0.
  float e[64] = {};
  e[0] = 0x1p24f;
  e[2] = 1.0f;
  e[3] = 1.0f;
  // Adjacent tree: (e0 + e1) = 2^24, (e2 + e3) = 2, then 2^24 + 2: exact.
  EXPECT_EQ(detlogp::tile_tree_sum(e), 0x1p24f + 2.0f);
  // Sequential: ((2^24 + 0) + 1) + 1 loses both ones.
  EXPECT_EQ(sequential_sum(e, 64), 0x1p24f);
  // Strided (i, i + 32), (i, i + 16), ...: ends with (2^24 + 1) + 1, loses both ones too.
  EXPECT_EQ(strided_tree(std::vector<float>(e, e + 64)), 0x1p24f);
}

TEST(TileTree, EqualsExplicitRecursionOnAdversarialInputs) {
  detlogp_test::Rng rng(42);
  int differs_from_sequential = 0, differs_from_strided = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    float e[64];
    for (float& x : e) {
      // Mixes of 1e8, 1, tiny values and cancellations: association changes the result.
      const uint64_t pick = rng.next() % 6;
      const float mag = pick == 0   ? 1e8f
                        : pick == 1 ? 1.0f
                        : pick == 2 ? 3.0e-8f
                        : pick == 3 ? 0x1p24f
                        : pick == 4 ? 0.5f
                                    : 1e-3f;
      const float sign = (rng.next() & 1) ? -1.0f : 1.0f;
      x = sign * mag * static_cast<float>(1.0 + rng.uniform());
    }
    const float tree = detlogp::tile_tree_sum(e);
    const float want = recursive_adjacent_tree(e, 64);
    ASSERT_EQ(bits(tree), bits(want)) << "trial " << trial;
    differs_from_sequential += bits(tree) != bits(sequential_sum(e, 64));
    differs_from_strided += bits(tree) != bits(strided_tree(std::vector<float>(e, e + 64)));
  }
  // The inputs really are adversarial: the tree is distinguishable from other orders.
  EXPECT_GT(differs_from_sequential, 1000);
  EXPECT_GT(differs_from_strided, 1000);
}

TEST(TileTree, EqualsExplicitRecursionOnSoftmaxLikeInputs) {
  // Values in (0, 1] as the tile summary produces them.
  detlogp_test::Rng rng(7);
  for (int trial = 0; trial < 20000; ++trial) {
    float e[64];
    for (float& x : e) x = detlogp::expc(static_cast<float>(-20.0 * rng.uniform()));
    ASSERT_EQ(bits(detlogp::tile_tree_sum(e)), bits(recursive_adjacent_tree(e, 64))) << "trial " << trial;
  }
}

TEST(TileSummary, MatchesItsDefinitionForEveryRealLaneCount) {
  detlogp_test::Rng rng(3);
  for (int real = 1; real <= 64; ++real) {
    float y[64];
    for (float& v : y) v = static_cast<float>(rng.normal() * 4.0);
    float m = -kInf;
    for (int v = 0; v < real; ++v) m = std::max(m, y[v]);
    float e[64];
    for (int v = 0; v < 64; ++v) e[v] = v < real ? detlogp::expc(y[v] - m) : 0.0f;
    const TileSummary s = detlogp::tile_summary(y, real);
    EXPECT_EQ(bits(s.max), bits(m)) << "real lanes " << real;
    EXPECT_EQ(bits(s.sum), bits(recursive_adjacent_tree(e, 64))) << "real lanes " << real;
  }
}

TEST(TileSummary, PaddingLanesContributeExactlyZeroWhateverTheirContent) {
  detlogp_test::Rng rng(5);
  for (int real : {1, 5, 17, 63}) {
    float clean[64], dirty[64];
    for (int v = 0; v < 64; ++v) clean[v] = dirty[v] = static_cast<float>(rng.normal());
    for (int v = real; v < 64; ++v) {
      clean[v] = 0.0f;
      dirty[v] = (v % 3 == 0) ? from_bits(0x7FC00000u) : (v % 3 == 1) ? kInf : 1e30f;  // NaN, +inf, huge
    }
    const TileSummary a = detlogp::tile_summary(clean, real);
    const TileSummary b = detlogp::tile_summary(dirty, real);
    EXPECT_EQ(bits(a.max), bits(b.max)) << "real lanes " << real;
    EXPECT_EQ(bits(a.sum), bits(b.sum)) << "real lanes " << real;
    EXPECT_FALSE(std::isnan(b.sum));
  }
}

TEST(TileSummary, AllMinusInfinityOrNoRealLaneGivesMinusInfAndZero) {
  float y[64];
  for (float& v : y) v = -kInf;
  TileSummary s = detlogp::tile_summary(y, 64);
  EXPECT_EQ(bits(s.max), bits(-kInf));
  EXPECT_EQ(bits(s.sum), 0x00000000u);
  for (float& v : y) v = 1.0f;
  s = detlogp::tile_summary(y, 0);
  EXPECT_EQ(bits(s.max), bits(-kInf));
  EXPECT_EQ(bits(s.sum), 0x00000000u);
}

TEST(TileSummary, SomeMinusInfinityLanesContributeZero) {
  float y[64], finite_only[64];
  for (int v = 0; v < 64; ++v) y[v] = finite_only[v] = 0.25f * static_cast<float>(v % 7);
  for (int v = 0; v < 64; v += 3) y[v] = -kInf;
  const TileSummary s = detlogp::tile_summary(y, 64);
  float e[64];
  for (int v = 0; v < 64; ++v) e[v] = (v % 3 == 0) ? 0.0f : detlogp::expc(finite_only[v] - s.max);
  EXPECT_EQ(s.max, 1.5f);
  EXPECT_EQ(bits(s.sum), bits(recursive_adjacent_tree(e, 64)));
}

TEST(TileSummary, NanLanePropagatesToMaxAndSum) {
  float y[64];
  for (int v = 0; v < 64; ++v) y[v] = static_cast<float>(v) * 0.1f;
  y[40] = from_bits(0x7FC01234u);
  const TileSummary s = detlogp::tile_summary(y, 64);
  EXPECT_TRUE(std::isnan(s.max));
  EXPECT_TRUE(std::isnan(s.sum));
  // And a row containing that tile finalizes to the canonical NaN in both outputs.
  const TileSummary tiles[2] = {detlogp::tile_summary(y + 0, 32), s};
  const detlogp::RowResult r = detlogp::reduce_row_summaries(tiles, 2, 1.0f, false);
  EXPECT_EQ(bits(r.lse), detlogp::kCanonicalNanBits);
  EXPECT_EQ(bits(r.logp), detlogp::kCanonicalNanBits);
}

TEST(TileSummary, NegativeZeroMaximumIsNormalizedToPositiveZero) {
  float y[64];
  for (int v = 0; v < 64; ++v) y[v] = -1.0f - static_cast<float>(v);
  y[9] = -0.0f;
  TileSummary s = detlogp::tile_summary(y, 64);
  EXPECT_EQ(bits(s.max), 0x00000000u);
  // +0 and -0 in either order: still +0, so the summary is order-free.
  y[3] = 0.0f;
  s = detlogp::tile_summary(y, 64);
  EXPECT_EQ(bits(s.max), 0x00000000u);
  y[3] = -0.0f;
  y[9] = 0.0f;
  EXPECT_EQ(bits(detlogp::tile_summary(y, 64).max), 0x00000000u);
  EXPECT_EQ(bits(detlogp::normalize_zero(-0.0f)), 0x00000000u);
  EXPECT_EQ(bits(detlogp::normalize_zero(-2.5f)), bits(-2.5f));
}

TEST(Chain, StepSkipsTilesWithZeroSumExactly) {
  const float running = 3.0000002f;
  // A padding-only tile (-inf, 0) under a global max of -inf would give NaN via
  // expc(-inf - -inf); the skip must return the running sum untouched.
  EXPECT_EQ(bits(detlogp::chain_step(running, TileSummary{-kInf, 0.0f}, -kInf)), bits(running));
  EXPECT_EQ(bits(detlogp::chain_step(running, TileSummary{-kInf, 0.0f}, 5.0f)), bits(running));
  EXPECT_EQ(bits(detlogp::chain_step(0.0f, TileSummary{-kInf, 0.0f}, -kInf)), 0x00000000u);
}

TEST(Chain, FoldedSkipGivesTheBitsOfChainStep) {
  // The serial form used on the GPU (factor 0 for an empty tile, then a plain fma) against
  // chain_step, over the running sums and tile summaries the chain can meet, specials included.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> sums = {0.0f, 1e-30f, 0.5f, 1.0f, 3.0000002f, 64.0f, 1e30f, kInf, nan};
  const std::vector<float> maxes = {-kInf, -80.0f, -1.0f, 0.0f, 2.5f, 50.0f, kInf, nan};
  const std::vector<float> tile_sums = {0.0f, 1e-40f, 1.0f, 17.25f, 64.0f, kInf, nan};
  for (float S : sums)
    for (float m : maxes)
      for (float M : maxes)
        for (float s : tile_sums) {
          const TileSummary t{m, s};
          const float folded = detlogp::chain_fma(S, s, detlogp::chain_factor_or_skip(t, M));
          ASSERT_EQ(bits(folded), bits(detlogp::chain_step(S, t, M)))
              << "S=" << S << " m=" << m << " M=" << M << " s=" << s;
        }
}

TEST(Chain, StepIsOneFusedMultiplyAdd) {
  detlogp_test::Rng rng(9);
  for (int i = 0; i < 10000; ++i) {
    const TileSummary t{static_cast<float>(rng.normal() * 10), static_cast<float>(1 + 63 * rng.uniform())};
    const float M = t.max + static_cast<float>(20 * rng.uniform());
    const float S = static_cast<float>(100 * rng.uniform());
    const float want = std::fma(t.sum, detlogp::expc(t.max - M), S);
    ASSERT_EQ(bits(detlogp::chain_step(S, t, M)), bits(want));
  }
}

TEST(Chain, RowReductionIsGlobalMaxThenAscendingChain) {
  detlogp_test::Rng rng(11);
  std::vector<TileSummary> tiles(300);
  for (auto& t : tiles) t = {static_cast<float>(rng.normal() * 3), static_cast<float>(1 + 63 * rng.uniform())};
  tiles[17] = {-kInf, 0.0f};  // a padding tile in the middle
  float M = -kInf;
  for (const auto& t : tiles) M = std::max(M, t.max);
  float S = 0.0f;
  for (const auto& t : tiles)
    if (t.sum != 0.0f) S = std::fma(t.sum, detlogp::expc(t.max - M), S);
  const float target = 0.5f;
  const float lse = M + detlogp::logc(S);
  const detlogp::RowResult r =
      detlogp::reduce_row_summaries(tiles.data(), static_cast<int64_t>(tiles.size()), target, false);
  EXPECT_EQ(bits(r.lse), bits(lse));
  EXPECT_EQ(bits(r.logp), bits(std::min(target - lse, 0.0f)));
  // The chain order is part of the contract: the descending chain gives other bits for some
  // inputs, so the ascending one above is really what is computed.
  float S_desc = 0.0f;
  for (auto it = tiles.rbegin(); it != tiles.rend(); ++it)
    if (it->sum != 0.0f) S_desc = std::fma(it->sum, detlogp::expc(it->max - M), S_desc);
  EXPECT_NE(bits(S), bits(S_desc)) << "pick other inputs: this one does not distinguish the orders";
}

TEST(Finalize, IgnoredRowGivesPositiveZeroAndStillReportsLse) {
  const detlogp::RowResult r = detlogp::finalize_row(2.0f, 3.0f, 123.0f, true);
  EXPECT_EQ(bits(r.logp), 0x00000000u);
  EXPECT_EQ(bits(r.lse), bits(2.0f + detlogp::logc(3.0f)));
  // Even when the target logit is NaN (it must not be read, but if it were, it must not leak).
  EXPECT_EQ(bits(detlogp::finalize_row(2.0f, 3.0f, from_bits(0x7FC00000u), true).logp), 0x00000000u);
}

TEST(Finalize, LogpIsClampedToAtMostZero) {
  // target logit above lse by rounding: logp would be positive, the clamp makes it +0.
  const float lse = 1.0f + detlogp::logc(1.0f);  // = 1
  detlogp::RowResult r = detlogp::finalize_row(1.0f, 1.0f, 1.5f, false);
  EXPECT_EQ(bits(r.lse), bits(lse));
  EXPECT_EQ(bits(r.logp), 0x00000000u);
  r = detlogp::finalize_row(1.0f, 1.0f, 1.0f, false);  // y_t == lse: +0, not -0
  EXPECT_EQ(bits(r.logp), 0x00000000u);
  r = detlogp::finalize_row(1.0f, 1.0f, 0.25f, false);
  EXPECT_EQ(r.logp, -0.75f);
}

TEST(Finalize, NanRowGivesCanonicalNanBits) {
  const float nan_payload = from_bits(0xFFC0BEEFu);
  detlogp::RowResult r = detlogp::finalize_row(nan_payload, 3.0f, 1.0f, false);
  EXPECT_EQ(bits(r.lse), detlogp::kCanonicalNanBits);
  EXPECT_EQ(bits(r.logp), detlogp::kCanonicalNanBits);
  r = detlogp::finalize_row(1.0f, nan_payload, 1.0f, false);
  EXPECT_EQ(bits(r.lse), detlogp::kCanonicalNanBits);
  EXPECT_EQ(bits(r.logp), detlogp::kCanonicalNanBits);
  // NaN target logit alone: logp canonical NaN, lse finite.
  r = detlogp::finalize_row(1.0f, 2.0f, nan_payload, false);
  EXPECT_EQ(bits(r.logp), detlogp::kCanonicalNanBits);
  EXPECT_EQ(bits(r.lse), bits(1.0f + detlogp::logc(2.0f)));
  // Ignored NaN row: lse canonical NaN, logp still +0.
  r = detlogp::finalize_row(nan_payload, 1.0f, 0.0f, true);
  EXPECT_EQ(bits(r.lse), detlogp::kCanonicalNanBits);
  EXPECT_EQ(bits(r.logp), 0x00000000u);
}

TEST(Finalize, TwoEqualLogitsGiveLn2) {
  const float y[2] = {0.0f, 0.0f};
  const TileSummary s = detlogp::tile_summary(y, 2);
  EXPECT_EQ(s.sum, 2.0f);
  const detlogp::RowResult r = detlogp::reduce_row_summaries(&s, 1, 0.0f, false);
  EXPECT_EQ(bits(r.lse), bits(detlogp::logc(2.0f)));
  EXPECT_EQ(bits(r.logp), bits(-detlogp::logc(2.0f)));
}

TEST(Temperature, OneLeavesEveryLogitBitIdentical) {
  const float inv = detlogp::inverse_temperature(1.0f);
  EXPECT_EQ(bits(inv), bits(1.0f));
  detlogp_test::Rng rng(13);
  for (int i = 0; i < 100000; ++i) {
    const float z = from_bits(static_cast<uint32_t>(rng.next()));
    if (std::isnan(z)) continue;
    ASSERT_EQ(bits(detlogp::scale_logit(z, inv)), bits(z));
  }
  EXPECT_EQ(bits(detlogp::scale_logit(-0.0f, inv)), 0x80000000u);
}

TEST(Temperature, IsMultiplicationByTheRoundedReciprocal) {
  for (float T : {0.7f, 1e-3f, 100.0f, 3.0f}) {
    const float inv = detlogp::inverse_temperature(T);
    EXPECT_EQ(bits(inv), bits(1.0f / T));
    for (float z : {1.0f, -2.5f, 17.125f, 3e4f}) EXPECT_EQ(bits(detlogp::scale_logit(z, inv)), bits(z * (1.0f / T)));
  }
  EXPECT_EQ(bits(detlogp::add_bias(1.0f, 0x1p-30f)), bits(1.0f + 0x1p-30f));
}

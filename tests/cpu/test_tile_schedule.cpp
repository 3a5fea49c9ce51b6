// The persistent SM90 kernels' tile order (src/sm90/sm90_tile_schedule.hpp), checked on the host:
// over every CTA of a grid, each (M tile, weight tile) is computed exactly once; with 2-CTA
// clusters the two CTAs of a cluster walk the same weight tiles in the same order and the same
// number of units (their shared ring requires it), and tiles past m_tiles appear only as the
// second half of the last M group. Shapes include odd counts, partial raster groups and grids
// larger than the work.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sm90/device/tile_schedule.hpp"
#include "test_random.hpp"

using detlogp::sm90::FastDivider;
using detlogp::sm90::raster_tile;
using detlogp::sm90::TileWalk;

namespace {

// Runs every CTA's walk; fails the test at the first broken property.
void check_grid(int m_tiles, int n_tiles, int group_m, int cluster, int grid) {
  SCOPED_TRACE(testing::Message() << "m_tiles=" << m_tiles << " n_tiles=" << n_tiles << " group_m=" << group_m
                                  << " cluster=" << cluster << " grid=" << grid);
  std::vector<int> seen(static_cast<size_t>(m_tiles) * n_tiles, 0);
  std::vector<std::vector<int>> n_seq(grid);
  for (int block = 0; block < grid; ++block) {
    const TileWalk w = TileWalk::make(m_tiles, n_tiles, group_m, cluster, block, grid, block % cluster);
    for (int unit = w.first; unit < w.count; unit += w.stride) {
      int m, n;
      w.coords(unit, m, n);
      ASSERT_GE(n, 0);
      ASSERT_LT(n, n_tiles);
      ASSERT_GE(m, 0);
      n_seq[block].push_back(n);
      if (m >= m_tiles) {  // a phantom row tile: only rank > 0 of the last, partial M group
        ASSERT_GT(block % cluster, 0);
        ASSERT_GE(m, (m_tiles / cluster) * cluster);
        continue;
      }
      ++seen[static_cast<size_t>(m) * n_tiles + n];
    }
  }
  for (int m = 0; m < m_tiles; ++m)
    for (int n = 0; n < n_tiles; ++n)
      ASSERT_EQ(seen[static_cast<size_t>(m) * n_tiles + n], 1) << "tile (" << m << ", " << n << ")";
  for (int block = 0; block < grid; block += cluster)
    for (int r = 1; r < cluster; ++r) ASSERT_EQ(n_seq[block], n_seq[block + r]) << "cluster of block " << block;
}

TEST(TileSchedule, EveryTileExactlyOnceWithoutClusters) {
  for (int m_tiles : {1, 2, 3, 7, 16, 33, 64})
    for (int n_tiles : {1, 5, 17, 594})
      for (int group_m : {1, 8, 32})
        for (int grid : {1, 3, 132, 1000}) check_grid(m_tiles, n_tiles, group_m, 1, grid);
}

TEST(TileSchedule, TwoCtaClustersShareWeightTilesInLockstep) {
  for (int m_tiles : {1, 2, 3, 7, 16, 33, 64, 65})
    for (int n_tiles : {1, 5, 17, 594})
      for (int group_m : {1, 2, 8, 32})
        for (int grid : {2, 6, 132, 1000}) check_grid(m_tiles, n_tiles, group_m, 2, grid);
}

TEST(TileSchedule, FastDividerIsExactBelowTwoToThe31) {
  detlogp_test::Rng rng(7);
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (uint32_t s = 12; s < 31; ++s)
    for (uint32_t d : {(1u << s) - 1, 1u << s, (1u << s) + 1}) divisors.push_back(d);
  for (int i = 0; i < 2000; ++i) divisors.push_back(1 + static_cast<uint32_t>(rng.below(0x7FFFFFFF)));
  for (uint32_t d : divisors) {
    const FastDivider f = FastDivider::make(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 2 * d - 1, 0x7FFFFFFFu, 0x7FFFFFFFu - d};
    for (uint32_t k : {1u, 2u, 3u, 1000u, 65535u}) {  // around multiples of d
      const uint64_t kd = uint64_t{k} * d;
      if (kd < 0x80000000u) {
        ns.push_back(static_cast<uint32_t>(kd));
        ns.push_back(static_cast<uint32_t>(kd - 1));
      }
    }
    for (int i = 0; i < 200; ++i) ns.push_back(static_cast<uint32_t>(rng.next()) & 0x7FFFFFFFu);
    for (uint32_t n : ns) {
      if (n > 0x7FFFFFFFu) continue;
      ASSERT_EQ(f.divide(n), n / d) << "n=" << n << " d=" << d;
    }
  }
}

TEST(TileSchedule, WalkOrderIsTheRasterOrder) {
  for (int m_tiles : {1, 3, 7, 16, 33, 64, 129})
    for (int n_tiles : {1, 5, 17, 594, 2374})
      for (int group_m : {1, 2, 8, 16, 32}) {
        const TileWalk w = TileWalk::make(m_tiles, n_tiles, group_m, 1, 0, 1, 0);
        for (int unit = 0; unit < w.count; ++unit) {
          int m, n, rm, rn;
          w.coords(unit, m, n);
          raster_tile(unit, m_tiles, n_tiles, group_m, rm, rn);
          ASSERT_EQ(m, rm) << "unit " << unit << " m_tiles=" << m_tiles << " n_tiles=" << n_tiles
                           << " group_m=" << group_m;
          ASSERT_EQ(n, rn) << "unit " << unit << " m_tiles=" << m_tiles << " n_tiles=" << n_tiles
                           << " group_m=" << group_m;
        }
      }
}

TEST(TileSchedule, RasterGroupsKeepWeightTilesTogether) {
  // Within one raster group the M tiles of a weight tile are consecutive units.
  const TileWalk w = TileWalk::make(64, 10, 32, 1, 0, 1, 0);
  for (int unit = 0; unit + 1 < 32; ++unit) {
    int m0, n0, m1, n1;
    w.coords(unit, m0, n0);
    w.coords(unit + 1, m1, n1);
    EXPECT_EQ(n0, n1);
    EXPECT_EQ(m1, m0 + 1);
  }
}

}  // namespace

// whole_local_tiles against the per-tile definition the epilogues used before (tile_real_lanes:
// a local tile is whole when its 64 lanes lie inside both the shard and the real vocabulary), over
// shards with and without padding, tensor-parallel offsets and real vocabularies ending before,
// inside and after the shard.
TEST(TileSchedule, WholeLocalTilesMatchesPerTileTest) {
  using detlogp::sm90::whole_local_tiles;
  for (int64_t vocab_local : {1, 17, 63, 64, 65, 123, 128, 2053, 76032}) {
    for (int64_t vocab_start : {int64_t{0}, int64_t{64}, int64_t{76032}, int64_t{100}}) {
      for (int64_t excess : {int64_t{-200}, int64_t{-64}, int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{5000}}) {
        const int64_t real_vocab = vocab_start + vocab_local + excess;
        const int64_t local_tiles = (vocab_local + 63) / 64;
        int64_t whole = 0;
        for (int64_t g = 0; g < local_tiles; ++g) {
          const int64_t first = vocab_start + 64 * g;
          const int64_t end = std::min(vocab_start + vocab_local, real_vocab);
          if (end - first >= 64) whole = g + 1;
        }
        EXPECT_EQ(whole_local_tiles(vocab_local, vocab_start, real_vocab), whole)
            << "vocab_local=" << vocab_local << " vocab_start=" << vocab_start << " real_vocab=" << real_vocab;
      }
    }
  }
}

// The tile order of the persistent SM90 kernels, as plain arithmetic shared by the kernels
// (pipeline.cuh feeds it blockIdx.x, gridDim.x and the cluster rank) and
// the host test that proves every tile is visited exactly once (tests/cpu/test_tile_schedule.cpp).
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"

namespace detlogp::sm90 {

// n / d for a divisor fixed at kernel start, as a multiply-high, an add and a shift (Granlund and
// Montgomery's round-up method): the persistent kernels map a work unit to its tile before every
// tile's epilogue, and the two general 32-bit divisions of raster_tile cost ~100 instructions per
// thread there (IABS, I2F, MUFU.RCP and the corrections), against ~10 for these. Exact for every
// n < 2^31 (then umulhi(n, m) + n cannot wrap) and every d >= 1.
struct FastDivider {
  uint32_t multiplier = 1, shift = 0;

  DETLOGP_HD static FastDivider make(uint32_t d) {
    FastDivider f;
    while ((uint64_t{1} << f.shift) < d) ++f.shift;  // shift = ceil(log2 d)
    f.multiplier = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d) / d + 1);
    return f;
  }
  DETLOGP_HD uint32_t divide(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, multiplier);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

// Grouped rasterization of a linear tile index: group_m M tiles walk each weight tile together.
DETLOGP_HD void raster_tile(int tile, int m_tiles, int n_tiles, int group_m, int& m_tile, int& n_tile) {
  const int group_size = group_m * n_tiles;
  const int first_m = (tile / group_size) * group_m;
  const int left = m_tiles - first_m;
  const int rows_in_group = left < group_m ? left : group_m;
  m_tile = first_m + (tile % group_size) % rows_in_group;
  n_tile = (tile % group_size) / rows_in_group;
}

// The persistent walk of one CTA over work units: unit u = first, first + stride, ... < count.
// cluster = 1: a unit is a tile. cluster > 1: a unit is a cluster tile (`cluster` M tiles sharing
// one weight tile); the cluster's CTAs (consecutive blocks) walk the same units, CTA `rank` takes
// M tile cluster * g + rank (past m_tiles in the last group when m_tiles is not a multiple of
// `cluster`: zero-filled rows the epilogue skips, loaded only so the peer's weight stage arrives).
struct TileWalk {
  int first, stride, count, m_groups, n_tiles, group_m, cluster, rank;
  // raster_tile's divisions by the group size (group_m * n_tiles), by group_m (every group but a
  // partial last one) and by the last group's row count.
  FastDivider by_group_size, by_group_m, by_last_rows;

  // block / grid: the CTA's index and the grid size (a multiple of cluster); group_m in M tiles.
  DETLOGP_HD static TileWalk make(int m_tiles, int n_tiles, int group_m, int cluster, int block, int grid, int rank) {
    TileWalk w;
    w.cluster = cluster;
    w.m_groups = (m_tiles + cluster - 1) / cluster;
    w.n_tiles = n_tiles;
    w.group_m = group_m / cluster > 1 ? group_m / cluster : 1;
    w.count = w.m_groups * n_tiles;
    w.first = block / cluster;
    w.stride = grid / cluster;
    w.rank = rank;
    const int last_rows = w.m_groups % w.group_m == 0 ? w.group_m : w.m_groups % w.group_m;
    w.by_group_size = FastDivider::make(static_cast<uint32_t>(w.group_m * n_tiles));
    w.by_group_m = FastDivider::make(static_cast<uint32_t>(w.group_m));
    w.by_last_rows = FastDivider::make(static_cast<uint32_t>(last_rows));
    return w;
  }
  // raster_tile(unit, m_groups, n_tiles, group_m) with the divisions above (the same tile order;
  // tests/cpu/test_tile_schedule.cpp compares the two).
  DETLOGP_HD void coords(int unit, int& m_tile, int& n_tile) const {
    const uint32_t u = static_cast<uint32_t>(unit);
    const uint32_t group = by_group_size.divide(u);
    const uint32_t within = u - group * static_cast<uint32_t>(group_m * n_tiles);
    const uint32_t first_m = group * static_cast<uint32_t>(group_m);
    const bool whole = first_m + static_cast<uint32_t>(group_m) <= static_cast<uint32_t>(m_groups);
    const uint32_t rows = whole ? static_cast<uint32_t>(group_m) : static_cast<uint32_t>(m_groups) - first_m;
    const uint32_t n = (whole ? by_group_m : by_last_rows).divide(within);
    n_tile = static_cast<int>(n);
    m_tile = static_cast<int>(first_m + within - n * rows) * cluster + rank;
  }
};

// The shard's local vocab tiles whose 64 lanes are all real: the real lanes are the prefix
// [vocab_start, min(vocab_start + vocab_local, real_vocab)) of the shard, so these tiles are a
// prefix too. The epilogues' whole-fragment test reads it instead of recomputing it per tile.
DETLOGP_HD int64_t whole_local_tiles(int64_t vocab_local, int64_t vocab_start, int64_t real_vocab) {
  const int64_t real_lanes = real_vocab - vocab_start < vocab_local ? real_vocab - vocab_start : vocab_local;
  return real_lanes <= 0 ? 0 : real_lanes / kVocabTile;
}

}  // namespace detlogp::sm90

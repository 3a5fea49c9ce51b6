// The tile order of the persistent SM90 kernels, as plain arithmetic shared by the kernels
// (sm90_mainloop_pingpong_tma_wgmma.cuh feeds it blockIdx.x, gridDim.x and the cluster rank) and
// the host test that proves every tile is visited exactly once (tests/test_tile_schedule.cpp).
#pragma once

#include "detlogp/config.hpp"

namespace detlogp::sm90 {

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
    return w;
  }
  DETLOGP_HD void coords(int unit, int& m_tile, int& n_tile) const {
    int g;
    raster_tile(unit, m_groups, n_tiles, group_m, g, n_tile);
    m_tile = g * cluster + rank;
  }
};

}  // namespace detlogp::sm90

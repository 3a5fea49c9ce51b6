// The tiles that straddle a shard boundary (docs/contract.md §7, "Shards at any boundary"): which
// ranks' edge lanes make up each of them, and its summary from those lanes. The host merge
// (src/tp) and the device merge (src/sm90/combine.cu) take the same plan and call the same
// straddle_summary, so a straddling tile is finished once, in rank order, by the contract's own
// tile functions.
#pragma once

#include <cstdint>
#include <vector>

#include "detlogp/reduce.hpp"
#include "detlogp/shards.hpp"

namespace detlogp::detail {

// Consecutive edge lanes of one rank inside a straddling tile: row n's values are
// src[n * stride + i], i < count, the tile's lanes lane .. lane + count - 1.
struct EdgeRun {
  const float* src;
  int32_t stride;  // the rank's edge lanes per row
  int16_t lane;
  int16_t count;
};

// One straddling tile: its real lanes (a prefix of 1..64) come from runs [first_run, first_run + runs)
// of the plan. It is complete once `completed_by` (a rank index in rank order) has given its lanes,
// and it takes its place in the chain right before that rank's whole tiles (ascending global order).
struct StraddleTile {
  int64_t tile;
  int16_t real_lanes;
  int16_t runs;
  int16_t first_run;
  int16_t completed_by;
};

struct StraddlePlan {
  std::vector<StraddleTile> tiles;
  std::vector<EdgeRun> runs;
  bool empty() const { return tiles.empty(); }
};

// One rank as the plan needs it: its shard and its edge lanes' buffer ([rows][edge_lanes] scaled
// logits, null when the shard has none).
struct RankEdges {
  int64_t vocab_start;
  int64_t vocab_local;
  const float* edge_logits;
};

// The straddling tiles of shards whose layouts have been checked (contiguous from id 0 in rank
// order, covering real_vocab: check_layouts), in ascending tile order. Empty when every boundary is
// 64-aligned. Throws on an inconsistent layout (an internal error once the layouts were checked).
StraddlePlan plan_straddles(const std::vector<RankEdges>& ranks_in_order, int64_t real_vocab);

// The lanes of straddling tile t for row `row` assembled from the runs into y[0, 64): its real lanes
// (a prefix of t.real_lanes), the rest +0 (padding: the tile functions never read them as lanes).
DETLOGP_HD void straddle_lanes(const StraddleTile& t, const EdgeRun* runs, int64_t row, float* y) {
  for (int v = 0; v < kVocabTile; ++v) y[v] = 0.0f;
  for (int k = 0; k < t.runs; ++k) {
    const EdgeRun& run = runs[t.first_run + k];
    const float* src = run.src + row * run.stride;
    for (int i = 0; i < run.count; ++i) y[run.lane + i] = src[i];
  }
}

// The summary of straddling tile t for row `row` (and with kEntropy its entropy sum): its lanes
// assembled from the runs, lanes past real_lanes padding, then the contract's tile summary.
template <bool kEntropy>
DETLOGP_HD TileEntropySummary straddle_summary(const StraddleTile& t, const EdgeRun* runs, int64_t row) {
  float y[kVocabTile];
  straddle_lanes(t, runs, row, y);
  if constexpr (kEntropy) return tile_entropy_summary(y, t.real_lanes);
  return {tile_summary(y, t.real_lanes), 0.0f};
}

}  // namespace detlogp::detail

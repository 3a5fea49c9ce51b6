#include "core/straddle.hpp"

#include "detlogp/error.hpp"

namespace detlogp::detail {

StraddlePlan plan_straddles(const std::vector<RankEdges>& ranks, int64_t real_vocab) {
  StraddlePlan plan;
  bool open = false;  // a straddling tile waits for more lanes
  int64_t filled = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankEdges& rank = ranks[r];
    const ShardGeometry g = shard_geometry(rank.vocab_start, rank.vocab_local, real_vocab);
    const int32_t stride = static_cast<int32_t>(g.edge_lanes());
    if (g.head_lanes > 0) {
      // The tile holding vocab_start: opened by an earlier rank, whose lanes end right before ours.
      const int64_t tile = rank.vocab_start / kVocabTile;
      const int64_t lane = rank.vocab_start - tile * kVocabTile;
      DETLOGP_CHECK(open && plan.tiles.back().tile == tile && filled == lane,
                    "internal: rank " << r << " has edge lanes in tile " << tile
                                      << " that no earlier rank began (the layouts were not checked)");
      StraddleTile& t = plan.tiles.back();
      plan.runs.push_back({rank.edge_logits, stride, static_cast<int16_t>(lane), static_cast<int16_t>(g.head_lanes)});
      ++t.runs;
      filled += g.head_lanes;
      if (filled == t.real_lanes) {
        t.completed_by = static_cast<int16_t>(r);
        open = false;
      }
    }
    DETLOGP_CHECK(!open || g.tiles == 0, "internal: rank " << r << " starts a whole tile while tile "
                                                           << plan.tiles.back().tile
                                                           << " still lacks lanes (the layouts were not checked)");
    if (g.tail_lanes > 0) {
      DETLOGP_CHECK(!open, "internal: rank " << r << " ends inside a second open straddling tile");
      const int64_t tile = (rank.vocab_start + rank.vocab_local - 1) / kVocabTile;
      const int64_t real = real_vocab - tile * kVocabTile;
      plan.tiles.push_back({tile, static_cast<int16_t>(real < kVocabTile ? real : kVocabTile), 0,
                            static_cast<int16_t>(plan.runs.size()), -1});
      plan.runs.push_back({rank.edge_logits + g.head_lanes, stride, 0, static_cast<int16_t>(g.tail_lanes)});
      plan.tiles.back().runs = 1;
      filled = g.tail_lanes;
      open = true;
    }
  }
  DETLOGP_CHECK(!open, "internal: straddling tile " << plan.tiles.back().tile
                                                    << " lacks lanes at the last rank (the layouts were not checked)");
  return plan;
}

}  // namespace detlogp::detail

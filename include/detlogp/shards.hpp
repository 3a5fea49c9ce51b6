// Where one vocabulary shard's partials sit among the global vocab tiles (docs/contract.md §7):
// which global tiles the shard finishes itself (whole tiles), and which of its lanes lie in a tile
// that straddles a shard boundary (edge lanes), whose summary the merge forms from every holder's
// lanes. One definition for the backends, the merge and the bindings, host and device.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"

namespace detlogp {

// A shard [vocab_start, vocab_start + V_local) of a vocabulary whose ids >= real_vocab are padding.
// Its local columns, in order:
//   [0, head_cols)                              before its first whole tile (vocab_start % 64 != 0):
//                                               the shard's lanes of the global tile holding
//                                               vocab_start; the first head_lanes are real
//   [head_cols, head_cols + whole_cols)         whole tiles first_tile .. first_tile + tiles - 1
//   [V_local - tail_lanes, V_local)             the shard's lanes of the tile holding its last id,
//                                               when that tile has real lanes past the shard
// A global tile is whole in the shard that holds its first id and every real id of it. A tile with
// real lanes in two or more shards straddles: each of them exports its real lanes of it (at most
// 63: the head lanes, or the tail lanes) and the merge assembles the tile. An aligned shard
// (vocab_start % 64 == 0, ending on a multiple of 64 or at or past real_vocab) has no edge lanes and
// ceil(V_local / 64) whole tiles, as shard_tiles says.
struct ShardGeometry {
  int64_t first_tile = 0;  // global index of the first whole tile
  int64_t tiles = 0;       // whole tiles (0 for a shard inside one straddling tile)
  int64_t head_cols = 0;   // local columns before the first whole tile, 0..63
  int64_t head_lanes = 0;  // the real ones among them: global ids [vocab_start, vocab_start + head_lanes)
  int64_t whole_cols = 0;  // local columns of the whole tiles (64 * tiles, less where the shard ends past real_vocab)
  int64_t tail_lanes = 0;  // local columns [V_local - tail_lanes, V_local), all real, 0..63

  // Edge lanes per row in a shard's partials: the head lanes, then the tail lanes.
  DETLOGP_HD int64_t edge_lanes() const { return head_lanes + tail_lanes; }
  // Real lanes of whole tile j (0..64; 0 for a tile of padding only).
  DETLOGP_HD int real_lanes(int64_t j, int64_t real_vocab) const {
    const int64_t n = real_vocab - (first_tile + j) * kVocabTile;
    return n <= 0 ? 0 : (n >= kVocabTile ? kVocabTile : static_cast<int>(n));
  }
};

namespace detail {
DETLOGP_HD int64_t ceil_tiles(int64_t ids) { return (ids + kVocabTile - 1) / kVocabTile; }
}  // namespace detail

// vocab_start >= 0, vocab_local >= 1, real_vocab >= 1 (the entries check them first).
DETLOGP_HD ShardGeometry shard_geometry(int64_t vocab_start, int64_t vocab_local, int64_t real_vocab) {
  ShardGeometry g;
  const int64_t end = vocab_start + vocab_local;
  g.first_tile = detail::ceil_tiles(vocab_start);
  const int64_t first_id = g.first_tile * kVocabTile;
  g.head_cols = first_id - vocab_start < vocab_local ? first_id - vocab_start : vocab_local;
  const int64_t head_real = (real_vocab < vocab_start + g.head_cols ? real_vocab : vocab_start + g.head_cols);
  g.head_lanes = head_real > vocab_start ? head_real - vocab_start : 0;
  if (first_id < end) {
    // The tiles that start in the shard; the last of them is whole unless its real lanes go on past the shard.
    const int64_t last = detail::ceil_tiles(end) - 1;
    const int64_t last_real_end = real_vocab < (last + 1) * kVocabTile ? real_vocab : (last + 1) * kVocabTile;
    g.tiles = last - g.first_tile + (last_real_end <= end ? 1 : 0);
  }
  const int64_t rest = vocab_local - g.head_cols;
  g.whole_cols = rest < g.tiles * kVocabTile ? rest : g.tiles * kVocabTile;
  g.tail_lanes = rest - g.whole_cols;
  return g;
}

}  // namespace detlogp

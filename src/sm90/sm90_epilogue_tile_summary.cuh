// SM90 fused epilogue: from the wgmma accumulators to the contract's per-64-lane tile summaries,
// the owned scaled target logit y_t and (serving entry) the fp32 logits z.
//
// Accumulator fragment of wgmma m64nNk16 (f32), thread t of the warpgroup, warp w = t / 32,
// lane l, q = l % 4: acc[4j + 2h + e] holds row 16w + l/4 + 8h, column 8j + 2q + e.
// The contract tree (reduce.hpp tile_tree_sum, adjacent pairs at every level) maps onto it as:
//   level 1  lanes (2i, 2i+1)            = in-thread pair e = 0, 1
//   level 2  pairs of level 1            = shfl_xor 1 (q, q^1): columns 8j+0..3 / 8j+4..7
//   level 3  pairs of level 2            = shfl_xor 2 (q, q^2): columns 8j+0..7
//   levels 4-6 over the 8 column groups  = in-thread over j, adjacent pairs
// IEEE addition is commutative, so both shuffle partners hold identical bits after each level.
#pragma once

#include <cstdint>
#include <type_traits>

#include "detlogp/reduce.hpp"
#include "sm90/sm90_common.hpp"

namespace detlogp::sm90 {

__device__ __forceinline__ int tile_real_lanes(const FusedParams& p, int64_t local_tile) {
  const int64_t first = p.vocab_start + local_tile * kVocabTile;
  int64_t end = p.vocab_start + p.vocab_local;
  if (p.real_vocab < end) end = p.real_vocab;
  const int64_t n = end - first;
  return n <= 0 ? 0 : (n >= kVocabTile ? kVocabTile : static_cast<int>(n));
}

// Stores the column pair (c, c + 1) of z, c relative to the tile; cols = columns of this tile
// inside the shard (1..64). vec2: row stride even and base 8-byte aligned (checked on host).
__device__ __forceinline__ void store_logit_pair(float* tile_ptr, int c, int cols, float z0, float z1, bool vec2) {
  if (vec2 && c + 1 < cols) {
    __stcs(reinterpret_cast<float2*>(tile_ptr + c), make_float2(z0, z1));  // streaming: read by the sampler later
  } else {
    if (c < cols) __stcs(tile_ptr + c, z0);
    if (c + 1 < cols) __stcs(tile_ptr + c + 1, z1);
  }
}

// The rest of one (row, vocab tile) summary from its thread's 8 level-1 sums: tree levels 2-3 over
// the quad (shfl_xor 1, 2; both partners hold the same bits after each), levels 4-6 in-thread, +0
// when the tile max m is -inf (no real lane, or all real lanes -inf), stored by the quad's q == 0.
__device__ __forceinline__ void finish_tile_summary(float (&level)[8], float m, const FusedParams& p, int64_t row,
                                                    bool row_ok, int64_t local_tile, int q) {
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) level[jj] = tree_add(level[jj], __shfl_xor_sync(0xFFFFFFFFu, level[jj], 1));
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) level[jj] = tree_add(level[jj], __shfl_xor_sync(0xFFFFFFFFu, level[jj], 2));
  const float l4a = tree_add(level[0], level[1]), l4b = tree_add(level[2], level[3]);
  const float l4c = tree_add(level[4], level[5]), l4d = tree_add(level[6], level[7]);
  float s = tree_add(tree_add(l4a, l4b), tree_add(l4c, l4d));
  if (m == fp::neg_inf()) s = 0.0f;
  if (q == 0 && row_ok) p.summaries[(row - p.row_begin) * p.local_tiles + local_tile] = TileSummary{m, s};
}

// Whether every vocab tile of a BlockN-column fragment at local column col0 is whole and inside
// the shard (uniform over the CTA): whole tiles are a prefix of the shard, counted once on the host
// (whole_local_tiles), where recomputing the last tile's real lanes cost ~25 instructions a tile.
template <int BlockN>
__device__ __forceinline__ bool fragment_whole(const FusedParams& p, int64_t col0) {
  return col0 / kVocabTile + BlockN / kVocabTile <= p.whole_tiles;
}

// The per-row inputs of a thread's two rows of an m64 fragment (lane / 4 + 8 h of each warp's 16),
// loaded raw before the fragment's mainloop so the global-load latency hides behind the K walk
// (a non-overlapped epilogue would otherwise wait for it on every tile). Raw means no instruction
// touches the loaded registers until the epilogue: an int32 target is widened there, not here (a
// sign extension right after the load stalled every tile ~400 cycles before its K walk, ncu run 41),
// and the temperature is inverted there. Rows at or past row_limit read row row_limit - 1 instead
// (their values are not used), so the loads are predicated on uniform tests only.
struct FragmentRows {
  float temperature[2];
  int32_t target_lo[2];  // an int32 target, or the low word of an int64 one
  int32_t target_hi[2];  // the high word of an int64 target

  __device__ __forceinline__ int64_t target(int h, const FusedParams& p) const {
    return p.targets_i64 ? static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(target_hi[h])) << 32) |
                                                static_cast<uint32_t>(target_lo[h]))
                         : static_cast<int64_t>(target_lo[h]);
  }
  // fl(1 / T): the host's for a scalar temperature (the same IEEE division), else this row's.
  __device__ __forceinline__ float inv_t(int h, const FusedParams& p) const {
    return p.temperature_rows ? inverse_temperature(temperature[h]) : p.inv_temperature;
  }
};

__device__ __forceinline__ FragmentRows load_fragment_rows(const FusedParams& p, int64_t row_tile0, int64_t row_limit) {
  const int t = threadIdx.x % 128;
  FragmentRows r;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row_tile0 + 16 * (t / 32) + (t % 32) / 4 + 8 * h;
    const int64_t read = row < row_limit ? row : row_limit - 1;
    r.temperature[h] = 1.0f;
    r.target_hi[h] = 0;
    if (p.temperature_rows) r.temperature[h] = p.temperature_rows[read];
    if (p.targets_i64) {
      const int2 w = reinterpret_cast<const int2*>(p.targets)[read];
      r.target_lo[h] = w.x;
      r.target_hi[h] = w.y;
    } else {
      r.target_lo[h] = static_cast<const int32_t*>(p.targets)[read];
    }
  }
  return r;
}

// The per-row quantities of the wide epilogue for a thread's two rows of one fragment: integer
// work with nothing to overlap inside the epilogue, so the cooperative kernel computes them while
// its last wgmma group runs (coop_consume's before_wait), where the consumer warps otherwise wait.
struct WideRows {
  int64_t row[2];         // row_tile0 + 16 warp + lane / 4 + 8 h
  float inv_t[2];         // 1 where the row is not this tile's
  int target_rel[2];      // the target's column relative to col0 when it lies in this fragment, else -1
  bool row_ok[2];         // row < row_limit
  bool unit_temperature;  // warp-uniform: every inverse temperature of the warp is 1
};

// Every lane of the warp calls it (a vote). Selects, not per-row branches: straight-line code the
// scheduler interleaves (ncu run 73: with the branches this prelude ran at half the issue rate).
template <int BlockN>
__device__ __forceinline__ WideRows prepare_wide_rows(const FusedParams& p, const FragmentRows& rows, int64_t row_tile0,
                                                      int64_t row_limit, int64_t col0) {
  const int t = threadIdx.x % 128;
  const int warp = t / 32;
  const int lane = t % 32;
  WideRows w;
  const int64_t fragment_col = p.vocab_start + col0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    w.row[h] = row_tile0 + 16 * warp + lane / 4 + 8 * h;
    w.row_ok[h] = w.row[h] < row_limit;
    const float it = rows.inv_t(h, p);
    w.inv_t[h] = w.row_ok[h] ? it : 1.0f;
    const int64_t tgt = rows.target(h, p);
    const int64_t rel = tgt - fragment_col;
    const bool in_fragment = w.row_ok[h] && tgt != p.ignore_index && static_cast<uint64_t>(rel) < uint64_t{BlockN};
    w.target_rel[h] = in_fragment ? static_cast<int>(rel) : -1;
  }
  w.unit_temperature = __all_sync(0xFFFFFFFFu, w.inv_t[0] == 1.0f && w.inv_t[1] == 1.0f);
  return w;
}

// The plain epilogue of a whole fragment (fragment_whole; no bias, no logits output), written for
// throughput: each phase runs over all 2 * BlockN / 64 slices (vocab tile tt, row half h) before the
// next, in place on acc, so the dependent chains of different slices (the 16-deep max, the two
// shuffle levels, the tree) overlap instead of running one slice after another, and a single warp
// vote covers the whole fragment's exponentials. Every value goes through the operations of
// epilogue_tile_summaries in the same order, so the bits are the same: scale, the slice's max
// (exact, ascending within the slice), the lane max over q, -0 normalized, x = y - m, expc
// (expc_normal on its domain), level 1 in-thread, levels 2-3 over q, levels 4-6 in-thread.
// Instruction count is the cost here (the fp32 work competes with the tensor cores for issue), so:
// the scale is skipped where every inverse temperature of the warp is 1 (y == z exactly; the one
// stored target logit still goes through scale_logit, so even a NaN's bits are unchanged), and
// tree levels 2-3 are a reduce-scatter over the slices (each lane pair adds half of the slices,
// tree_add commutes), after which lane q finishes and stores its own slices.
// kPlain = false: the launch may have a bias (added to every value first, as add_bias) and a logits
// output (z stored as float2 pairs with st.global.cs before the scale; the caller checked that the
// pairs are 8-byte aligned, logits_vec2), both decided once per fragment.
// kPrepared: the rows come prepared in *prepared (prepare_wide_rows, the same fragment); otherwise
// they are set up here, from `rows`, by the same operations.
template <int BlockN, bool kPlain, bool kPrepared>
__device__ __forceinline__ void epilogue_tile_summaries_wide(float (&acc)[BlockN / 2], const FusedParams& p,
                                                             const FragmentRows& rows, const WideRows* prepared,
                                                             int64_t row_tile0, int64_t row_limit, int64_t col0) {
  static_assert(BlockN % kVocabTile == 0, "whole vocab tiles per fragment");
  static_assert(kVocabTile == 64 && kTileTreeLevels == 6, "the shuffle mapping below covers a 64-lane, 6-level tree");
  constexpr int kTiles = BlockN / kVocabTile;
  constexpr int kSlices = 2 * kTiles;  // slice 2 tt + h
  const int t = threadIdx.x % 128;
  const int warp = t / 32;
  const int lane = t % 32;
  const int q = lane % 4;
  if (row_tile0 + 16 * warp >= row_limit) return;  // warp-uniform: all 16 rows past the chunk
  // Set up here for the ping-pong kernels, as before 060e574, so their SASS stays that of 4d39a35
  // (060e574's restructured dispatcher had cost prefill_c2 64 more spill stores, and even a shared
  // helper for these lines changes its schedule).
  int64_t row[2];
  bool row_ok[2];
  float inv_t[2];
  int target_rel[2];  // the target's column relative to col0 when it lies in this fragment, else -1
  if constexpr (kPrepared) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row[h] = prepared->row[h];
      row_ok[h] = prepared->row_ok[h];
      inv_t[h] = prepared->inv_t[h];
      target_rel[h] = prepared->target_rel[h];
    }
  } else {
    // Selects, not per-row branches: straight-line code the scheduler interleaves (ncu run 73: with
    // the branches this prelude ran at half the issue rate, ~0.3 % of a tile).
    const int64_t fragment_col = p.vocab_start + col0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row[h] = row_tile0 + 16 * warp + lane / 4 + 8 * h;
      row_ok[h] = row[h] < row_limit;
      const float it = rows.inv_t(h, p);
      inv_t[h] = row_ok[h] ? it : 1.0f;
      const int64_t tgt = rows.target(h, p);
      const int64_t rel = tgt - fragment_col;
      const bool in_fragment = row_ok[h] && tgt != p.ignore_index && static_cast<uint64_t>(rel) < uint64_t{BlockN};
      target_rel[h] = in_fragment ? static_cast<int>(rel) : -1;
    }
  }
  // acc index of value i (0..15) of slice (tt, h).
  auto at = [](int tt, int h, int i) { return (tt * 8 + i / 2) * 4 + 2 * h + i % 2; };

  if constexpr (!kPlain) {
    // z = fl(acc + b), then the stored logits: the general path's order for every value.
    if (p.bias != nullptr) {
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float b = p.bias[col0 + kVocabTile * tt + 8 * (i / 2) + 2 * q + i % 2];
#pragma unroll
          for (int h = 0; h < 2; ++h) acc[at(tt, h, i)] = add_bias(acc[at(tt, h, i)], b);
        }
    }
    if (p.logits != nullptr) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!row_ok[h]) continue;
        float* out = p.logits + row[h] * p.vocab_local + col0 + 2 * q;
#pragma unroll
        for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
          for (int jj = 0; jj < 8; ++jj)
            __stcs(reinterpret_cast<float2*>(out + kVocabTile * tt + 8 * jj),
                   make_float2(acc[at(tt, h, 2 * jj)], acc[at(tt, h, 2 * jj + 1)]));
      }
    }
  }

  // Scale in place (unless every factor of the warp is 1) and each slice's max, values ascending
  // within a slice. The running max starts at the slice's first value rather than at max(-inf,
  // first): the same bits (max_nan(-inf, v) is v for every non-NaN v, and a NaN turns the
  // canonical NaN at the next step either way), one instruction less per slice.
  float m[kSlices];
  if (kPrepared ? prepared->unit_temperature : __all_sync(0xFFFFFFFFu, inv_t[0] == 1.0f && inv_t[1] == 1.0f)) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          m[2 * tt + h] = i == 0 ? acc[at(tt, h, 0)] : fp::max_nan(m[2 * tt + h], acc[at(tt, h, i)]);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& v = acc[at(tt, h, i)];
          v = scale_logit(v, inv_t[h]);
          m[2 * tt + h] = i == 0 ? v : fp::max_nan(m[2 * tt + h], v);
        }
  }
  // The target logit, picked by its owner only (column 8 jj + 2 q + e is value 2 jj + e of thread
  // q); scale_logit again is exact where the values were scaled (inv_t != 1) and the identity else.
  // One warp-uniform branch around both halves: a warp's 16 rows rarely have a target here.
  bool owner[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) owner[h] = target_rel[h] >= 0 && ((target_rel[h] >> 1) & 3) == q;
  if (__any_sync(0xFFFFFFFFu, owner[0] || owner[1])) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!owner[h]) continue;
      const int rel = target_rel[h];
      const int tt_t = rel / kVocabTile;
      const int idx = ((rel % kVocabTile) >> 3) * 2 + (rel & 1);
      float v = 0.0f;
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt) {
        float w = acc[at(tt, h, 0)];
#pragma unroll
        for (int i = 1; i < 16; ++i) w = i == idx ? acc[at(tt, h, i)] : w;
        v = tt == tt_t ? w : v;
      }
      p.target_logit[row[h] - p.row_begin] = inv_t[h] == 1.0f ? scale_logit(v, 1.0f) : v;  // the single owner
    }
  }
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl) m[sl] = fp::max_nan(m[sl], __shfl_xor_sync(0xFFFFFFFFu, m[sl], 1));
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl) m[sl] = fp::max_nan(m[sl], __shfl_xor_sync(0xFFFFFFFFu, m[sl], 2));
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl) m[sl] = normalize_zero(m[sl]);

  // x = y - m in place; one vote for the whole fragment on "every x >= kExpcNormalMin", decided
  // per slice as: m finite, and the largest bit pattern of its x (unsigned) at most that of
  // kExpcNormalMin. With m finite no y is NaN and every y <= m, so x = fl(y - m) is +0 (bits 0) or
  // negative (bits 0x80000000 + |x|, increasing with |x|, -inf the largest): the same decision as
  // the per-value test x >= kExpcNormalMin, and with m NaN or infinite that test fails too. The
  // 3-way unsigned max is one instruction per two values (VIMNMX3) and 2 * BlockN / 64 independent
  // chains, where the per-value compare was one predicate chain through every value.
  uint32_t xbits_max[kSlices];
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl) xbits_max[sl] = 0u;
#pragma unroll
  for (int i = 0; i < 16; i += 2)
#pragma unroll
    for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& v0 = acc[at(tt, h, i)];
        float& v1 = acc[at(tt, h, i + 1)];
        v0 = fp::sub(v0, m[2 * tt + h]);
        v1 = fp::sub(v1, m[2 * tt + h]);
        xbits_max[2 * tt + h] = __vimax3_u32(xbits_max[2 * tt + h], fp::bits(v0), fp::bits(v1));
      }
  bool normal = true;
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl)
    normal = normal && (fp::bits(m[sl]) & 0x7F800000u) != 0x7F800000u && xbits_max[sl] <= fp::bits(kExpcNormalMin);
  const bool fast = __all_sync(0xFFFFFFFFu, normal);
  // Exponentials and tree level 1 (in-thread pairs) of slice (tt, h) into lv: expc_normal, or, when
  // the vote failed (an argument below -87 or a NaN somewhere in the warp's fragment), expc with its
  // range branches through a local copy (a rolled loop keeps the rare path's code small).
  auto level1 = [&](auto fast_path, int tt, int h, float(&lv)[8]) {
    if constexpr (decltype(fast_path)::value) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
        lv[jj] = tree_add(expc_normal(acc[at(tt, h, 2 * jj)]), expc_normal(acc[at(tt, h, 2 * jj + 1)]));
    } else {
      float xs[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) xs[i] = acc[at(tt, h, i)];
#pragma unroll 1
      for (int i = 0; i < 16; ++i) xs[i] = expc(xs[i]);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) lv[jj] = tree_add(xs[2 * jj], xs[2 * jj + 1]);
    }
  };

  // Tree level 2 (lanes q, q ^ 1) as a reduce-scatter: of the slice pair (2 s, 2 s + 1) the lane
  // with q bit 0 = b keeps slice 2 s + b and sends the other, so afterwards it holds level 2 of
  // slice 2 s + b0.
  static_assert(kSlices % 2 == 0, "slices come in row-half pairs");
  constexpr int kS2 = kSlices / 2;
  const bool b0 = (q & 1) != 0;
  const bool b1 = (q & 2) != 0;
  auto level2 = [&](const float(&even)[8], const float(&odd)[8], float(&out)[8]) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float keep = b0 ? odd[jj] : even[jj];
      const float send = b0 ? even[jj] : odd[jj];
      out[jj] = tree_add(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 1));
    }
  };
  // Slice 2 s + b0 is vocab tile s, row half b0.
  const int64_t row_h = b0 ? row[1] : row[0];
  const bool row_ok_h = b0 ? row_ok[1] : row_ok[0];
  // Levels 4-6 of one slice held by this lane, +0 when its max is -inf, and its summary.
  auto finish = [&](const float(&l)[8], float mx, int tt, bool store) {
    const float l4a = tree_add(l[0], l[1]), l4b = tree_add(l[2], l[3]);
    const float l4c = tree_add(l[4], l[5]), l4d = tree_add(l[6], l[7]);
    float sum = tree_add(tree_add(l4a, l4b), tree_add(l4c, l4d));
    if (mx == fp::neg_inf()) sum = 0.0f;  // all lanes -inf
    if (store && row_ok_h)
      p.summaries[(row_h - p.row_begin) * p.local_tiles + col0 / kVocabTile + tt] = TileSummary{mx, sum};
  };
  // The groups below, with the exponentials of the vote's outcome (one branch for the fragment, so
  // each path is straight-line code the scheduler can interleave).
  auto groups = [&](auto fast_path) {  // std::true_type: expc_normal; std::false_type: expc
    if constexpr (kS2 % 2 == 0) {
      // Vocab tiles 2 u and 2 u + 1 (slices 4 u .. 4 u + 3) make a closed group: level 2 pairs slices
      // (4 u, 4 u + 1) and (4 u + 2, 4 u + 3), level 3 (lanes q, q ^ 2, which hold the same slices)
      // scatters again over those two pairs, and lane q ends with slice 4 u + q = vocab tile
      // 2 u + b1, row half b0. Each group runs its exponentials and then its tree, so one group's
      // shuffle rounds can overlap the next group's exponentials (same operations, same bits).
#pragma unroll
      for (int u = 0; u < kS2 / 2; ++u) {
        float lv[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k) level1(fast_path, 2 * u + k / 2, k % 2, lv[k]);
        float l2a[8], l2b[8], l3[8];
        level2(lv[0], lv[1], l2a);
        level2(lv[2], lv[3], l2b);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float keep = b1 ? l2b[jj] : l2a[jj];
          const float send = b1 ? l2a[jj] : l2b[jj];
          l3[jj] = tree_add(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 2));
        }
        const float m_lo = b0 ? m[4 * u + 1] : m[4 * u];
        const float m_hi = b0 ? m[4 * u + 3] : m[4 * u + 2];
        finish(l3, b1 ? m_hi : m_lo, 2 * u + (b1 ? 1 : 0), true);
      }
    } else {
      // An odd number of slice pairs (BlockN = 192): per vocab tile, level 2 as above and level 3 as
      // a plain exchange (both lanes hold the same bits), stored by the lane with b1 = 0.
#pragma unroll
      for (int s = 0; s < kS2; ++s) {
        float lv[2][8];
        level1(fast_path, s, 0, lv[0]);
        level1(fast_path, s, 1, lv[1]);
        float l2[8], l3[8];
        level2(lv[0], lv[1], l2);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) l3[jj] = tree_add(l2[jj], __shfl_xor_sync(0xFFFFFFFFu, l2[jj], 2));
        finish(l3, b0 ? m[2 * s + 1] : m[2 * s], s, !b1);
      }
    }
  };
  if (fast)
    groups(std::true_type{});
  else
    groups(std::false_type{});
}

// One whole vocab tile (all 64 lanes real) of the plain epilogue, row half h: the operations of
// epilogue_tile_summaries in the same order, with the per-lane tests that are constant over a
// whole tile hoisted out: no real-lane test, no logits store or bias (the caller has neither), and
// the target logit picked out of the 16 values only by the thread that owns it (one tile in V / 64
// per row), instead of a compare and a select on every value.
template <int BlockN>
__device__ __forceinline__ void plain_whole_tile_summary(const float (&acc)[BlockN / 2], int tt, int h,
                                                         const FusedParams& p, int64_t row, bool row_ok, float inv_t,
                                                         int64_t target_col, int64_t tile_col0, int64_t local_tile,
                                                         float& y_target, bool& owns) {
  const int q = (threadIdx.x % 32) % 4;
  float y[16];
  float m = fp::neg_inf();
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    y[i] = scale_logit(acc[(tt * 8 + i / 2) * 4 + 2 * h + i % 2], inv_t);
    m = fp::max_nan(m, y[i]);
  }
  // Column 8 jj + 2 q + e of the tile is value 2 jj + e of thread q.
  const int64_t rel = target_col - tile_col0;
  if (target_col >= 0 && rel >= 0 && rel < kVocabTile && ((rel >> 1) & 3) == q) {
    const int idx = static_cast<int>((rel >> 3) * 2 + (rel & 1));
    float v = y[0];
#pragma unroll
    for (int i = 1; i < 16; ++i) v = i == idx ? y[i] : v;
    y_target = v;
    owns = true;
  }
  m = fp::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
  m = fp::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
  m = normalize_zero(m);

  float level[8];
  float x[16];
  bool normal = true;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    x[i] = fp::sub(y[i], m);
    normal = normal && x[i] >= kExpcNormalMin;
  }
  if (__all_sync(0xFFFFFFFFu, normal)) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) level[jj] = tree_add(expc_normal(x[2 * jj]), expc_normal(x[2 * jj + 1]));
  } else {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) level[jj] = tree_add(expc(x[2 * jj]), expc(x[2 * jj + 1]));
  }
  finish_tile_summary(level, m, p, row, row_ok, local_tile, q);
}

// Epilogue of one m64 accumulator fragment of a consumer warpgroup: its 64 rows start at
// `row_tile0`, rows at or past `row_limit` are not this tile's (past the chunk, or replicas of an
// 8-row tile), its columns start at local column `col0` (a multiple of 64); `rows` holds the
// thread's two rows' temperature and target (load_fragment_rows, ideally before the mainloop).
// acc is consumed in place.
// kPlain: the launch has neither bias nor logits output (the trainer entry without bias), so whole
// vocab tiles take plain_whole_tile_summary; same bits, fewer instructions per value.
// kPrepared: the wide epilogue's rows come prepared in *prepared (prepare_wide_rows, this fragment).
template <int BlockN, bool kPlain = false, bool kPrepared = false>
__device__ __forceinline__ void epilogue_tile_summaries(float (&acc)[BlockN / 2], const FusedParams& p,
                                                        const FragmentRows& rows, int64_t row_tile0, int64_t row_limit,
                                                        int64_t col0, bool logits_vec2,
                                                        const WideRows* prepared = nullptr) {
  static_assert(BlockN % kVocabTile == 0, "whole vocab tiles per CTA");
  static_assert(kVocabTile == 64 && kTileTreeLevels == 6, "the shuffle mapping below covers a 64-lane, 6-level tree");
  const int t = threadIdx.x % 128;
  const int warp = t / 32;
  const int lane = t % 32;
  const int q = lane % 4;
  // Warp-uniform: all 16 rows of this warp lie past the chunk (decode: most warps idle).
  if (row_tile0 + 16 * warp >= row_limit) return;
  // Whole fragments (and, with logits, 8-byte aligned pairs) take the phase-ordered form.
  if (fragment_whole<BlockN>(p, col0) && (kPlain || p.logits == nullptr || logits_vec2))
    return epilogue_tile_summaries_wide<BlockN, kPlain, kPrepared>(acc, p, rows, prepared, row_tile0, row_limit, col0);

  int64_t row[2];
  bool row_ok[2];
  float inv_t[2];
  int64_t target_col[2];  // local column of the target, -1 when ignored
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = row_tile0 + 16 * warp + lane / 4 + 8 * h;
    row_ok[h] = row[h] < row_limit;
    inv_t[h] = 1.0f;
    target_col[h] = -1;
    if (row_ok[h]) {
      inv_t[h] = rows.inv_t(h, p);
      const int64_t tgt = rows.target(h, p);
      if (tgt != p.ignore_index) target_col[h] = tgt - p.vocab_start;
    }
  }
  float y_target[2] = {0.0f, 0.0f};
  bool owns[2] = {false, false};

#pragma unroll
  for (int tt = 0; tt < BlockN / kVocabTile; ++tt) {
    const int64_t tile_col0 = col0 + tt * kVocabTile;
    const int64_t local_tile = tile_col0 / kVocabTile;
    if (local_tile >= p.local_tiles) break;  // uniform: past the shard
    const int real = tile_real_lanes(p, local_tile);
    if constexpr (kPlain) {
      if (real == kVocabTile) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          plain_whole_tile_summary<BlockN>(acc, tt, h, p, row[h], row_ok[h], inv_t[h], target_col[h], tile_col0,
                                           local_tile, y_target[h], owns[h]);
        continue;
      }
    }
    // 32-bit per-tile quantities: columns inside the shard, target column inside this tile.
    const int64_t left = p.vocab_local - tile_col0;
    const int cols = left >= kVocabTile ? kVocabTile : static_cast<int>(left);
    int rel_target[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t rel = target_col[h] - tile_col0;
      rel_target[h] = (target_col[h] >= 0 && rel >= 0 && rel < kVocabTile) ? static_cast<int>(rel) : -1;
    }

    float bias_v[16];
    if (!kPlain && p.bias != nullptr) {
      const float* b = p.bias + tile_col0;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int c = 8 * (i / 2) + 2 * q + (i % 2);
        bias_v[i] = c < cols ? b[c] : 0.0f;
      }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float y[16];
      float m = fp::neg_inf();
      float* logit_tile =
          !kPlain && p.logits != nullptr && row_ok[h] ? p.logits + row[h] * p.vocab_local + tile_col0 : nullptr;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        float z[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          z[e] = acc[(tt * 8 + jj) * 4 + 2 * h + e];
          if (!kPlain && p.bias != nullptr) z[e] = add_bias(z[e], bias_v[2 * jj + e]);
        }
        const int lane_col = 8 * jj + 2 * q;  // column of e = 0 inside the tile
        if (logit_tile != nullptr) store_logit_pair(logit_tile, lane_col, cols, z[0], z[1], logits_vec2);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float yv = scale_logit(z[e], inv_t[h]);
          y[2 * jj + e] = yv;
          if (lane_col + e == rel_target[h]) {
            y_target[h] = yv;
            owns[h] = true;
          }
          if (lane_col + e < real) m = fp::max_nan(m, yv);
        }
      }
      // Tile max: exact, so any combination order gives the same bits.
      m = fp::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      m = fp::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
      m = normalize_zero(m);

      float level[8];
      // Fast path, same bits: every lane real and every y - m in expc_normal's domain (NaN fails
      // the test) across the warp, so all 16 exponentials of this thread are straight-line code the
      // compiler can interleave; otherwise expc with its range branches, lane by lane.
      float x[16];
      bool normal = real == kVocabTile;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        x[i] = fp::sub(y[i], m);
        normal = normal && x[i] >= kExpcNormalMin;
      }
      if (__all_sync(0xFFFFFFFFu, normal)) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) level[jj] = tree_add(expc_normal(x[2 * jj]), expc_normal(x[2 * jj + 1]));
      } else {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int lane_col = 8 * jj + 2 * q;
          const float e0 = lane_col < real ? expc(x[2 * jj]) : 0.0f;
          const float e1 = lane_col + 1 < real ? expc(x[2 * jj + 1]) : 0.0f;
          level[jj] = tree_add(e0, e1);  // level 1
        }
      }
      finish_tile_summary(level, m, p, row[h], row_ok[h], local_tile, q);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (owns[h]) p.target_logit[row[h] - p.row_begin] = y_target[h];  // the single owner in the grid
}

// The same, loading the rows' temperature and target first (when nothing was prefetched).
template <int BlockN, bool kPlain = false>
__device__ __forceinline__ void epilogue_tile_summaries(float (&acc)[BlockN / 2], const FusedParams& p,
                                                        int64_t row_tile0, int64_t row_limit, int64_t col0,
                                                        bool logits_vec2) {
  if (row_tile0 + 16 * ((threadIdx.x % 128) / 32) >= row_limit) return;  // warp-uniform, before any load
  const FragmentRows rows = load_fragment_rows(p, row_tile0, row_limit);
  epilogue_tile_summaries<BlockN, kPlain>(acc, p, rows, row_tile0, row_limit, col0, logits_vec2);
}

// The 16 accumulators of epilogue slice `slice` (vocab tile slice / 2, row half slice % 2) of a
// BlockN-column fragment, chosen without a branch or a dynamic register index: a chain of selp
// over the slices, all in inline PTX. The schedule calls this while the next tile's wgmma group is
// in flight, and ptxas serializes every wgmma of the kernel when a non-wgmma instruction redefines
// (or a divergent path reads) a register that a wgmma also uses as accumulator; a runtime slice
// index keeps one copy of the slice code instead of one per slice (instruction-cache footprint).
template <int BlockN, int S = 0>
__device__ __forceinline__ void select_slice_values(const float (&acc)[BlockN / 2], int slice, float (&v)[16]) {
  constexpr int kSlices = 2 * BlockN / 64;
  if constexpr (S < kSlices) {
    constexpr int tt = S / 2, h = S % 2;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // acc index of value i of this slice: (tt * 8 + i / 2) * 4 + 2 h + i % 2, i = 8 half + k
#define DETLOGP_SLICE_ACC(k) acc[(tt * 8 + (8 * half + (k)) / 2) * 4 + 2 * h + (k) % 2]
      if constexpr (S == 0) {
        asm("mov.b32 %0, %8;\n\tmov.b32 %1, %9;\n\tmov.b32 %2, %10;\n\tmov.b32 %3, %11;\n\t"
            "mov.b32 %4, %12;\n\tmov.b32 %5, %13;\n\tmov.b32 %6, %14;\n\tmov.b32 %7, %15;"
            : "=f"(v[8 * half + 0]), "=f"(v[8 * half + 1]), "=f"(v[8 * half + 2]), "=f"(v[8 * half + 3]),
              "=f"(v[8 * half + 4]), "=f"(v[8 * half + 5]), "=f"(v[8 * half + 6]), "=f"(v[8 * half + 7])
            : "f"(DETLOGP_SLICE_ACC(0)), "f"(DETLOGP_SLICE_ACC(1)), "f"(DETLOGP_SLICE_ACC(2)),
              "f"(DETLOGP_SLICE_ACC(3)), "f"(DETLOGP_SLICE_ACC(4)), "f"(DETLOGP_SLICE_ACC(5)),
              "f"(DETLOGP_SLICE_ACC(6)), "f"(DETLOGP_SLICE_ACC(7)));
      } else {
        asm("{\n\t.reg .pred p;\n\tsetp.eq.s32 p, %16, %17;\n\t"
            "selp.f32 %0, %8, %0, p;\n\tselp.f32 %1, %9, %1, p;\n\tselp.f32 %2, %10, %2, p;\n\t"
            "selp.f32 %3, %11, %3, p;\n\tselp.f32 %4, %12, %4, p;\n\tselp.f32 %5, %13, %5, p;\n\t"
            "selp.f32 %6, %14, %6, p;\n\tselp.f32 %7, %15, %7, p;\n\t}"
            : "+f"(v[8 * half + 0]), "+f"(v[8 * half + 1]), "+f"(v[8 * half + 2]), "+f"(v[8 * half + 3]),
              "+f"(v[8 * half + 4]), "+f"(v[8 * half + 5]), "+f"(v[8 * half + 6]), "+f"(v[8 * half + 7])
            : "f"(DETLOGP_SLICE_ACC(0)), "f"(DETLOGP_SLICE_ACC(1)), "f"(DETLOGP_SLICE_ACC(2)),
              "f"(DETLOGP_SLICE_ACC(3)), "f"(DETLOGP_SLICE_ACC(4)), "f"(DETLOGP_SLICE_ACC(5)),
              "f"(DETLOGP_SLICE_ACC(6)), "f"(DETLOGP_SLICE_ACC(7)), "r"(slice), "n"(S));
      }
#undef DETLOGP_SLICE_ACC
    }
    select_slice_values<BlockN, S + 1>(acc, slice, v);
  }
}

// One slice of epilogue_tile_summaries: vocab tile `tt` of the fragment, row half `h` (rows
// lane/4 + 8h of each warp's 16), from its 16 values v (select_slice_values), with the same
// operations in the same order, so a schedule can spread a fragment's 2 * BlockN / 64 slices between
// the wgmma groups of its next tile (the cooperative overlap schedule). The target logit is stored
// by its owner in the slice that holds it.
__device__ __forceinline__ void epilogue_tile_summary_slice(const float (&v)[16], int tt, int h, const FusedParams& p,
                                                            int64_t row_tile0, int64_t row_limit, int64_t col0,
                                                            bool logits_vec2) {
  static_assert(kVocabTile == 64 && kTileTreeLevels == 6, "the shuffle mapping below covers a 64-lane, 6-level tree");
  const int t = threadIdx.x % 128;
  const int warp = t / 32;
  const int lane = t % 32;
  const int q = lane % 4;
  const int64_t tile_col0 = col0 + tt * kVocabTile;
  const int64_t local_tile = tile_col0 / kVocabTile;
  const int64_t row = row_tile0 + 16 * warp + lane / 4 + 8 * h;
  // No early return (a branch around code that follows a read of wgmma registers): rows past the
  // tile or tiles past the shard only switch the stores off.
  const bool tile_ok = local_tile < p.local_tiles;
  const bool row_ok = row < row_limit && tile_ok;
  float inv_t = 1.0f;
  int64_t target_col = -1;
  if (row_ok) {
    inv_t = inverse_temperature(p.temperature_rows ? p.temperature_rows[row] : p.temperature);
    const int64_t tgt = load_target(p.targets, p.targets_i64, row);
    if (tgt != p.ignore_index) target_col = tgt - p.vocab_start;
  }
  const int real = tile_ok ? tile_real_lanes(p, local_tile) : 0;
  const int64_t left = p.vocab_local - tile_col0;
  const int cols = left >= kVocabTile ? kVocabTile : static_cast<int>(left);
  const int64_t rel = target_col - tile_col0;
  const int rel_target = (target_col >= 0 && rel >= 0 && rel < kVocabTile) ? static_cast<int>(rel) : -1;

  float y[16];
  float m = fp::neg_inf();
  float* logit_tile = p.logits != nullptr && row_ok ? p.logits + row * p.vocab_local + tile_col0 : nullptr;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const int lane_col = 8 * jj + 2 * q;  // column of e = 0 inside the tile
    float z[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      z[e] = v[2 * jj + e];
      if (p.bias != nullptr) z[e] = add_bias(z[e], lane_col + e < cols ? p.bias[tile_col0 + lane_col + e] : 0.0f);
    }
    if (logit_tile != nullptr) store_logit_pair(logit_tile, lane_col, cols, z[0], z[1], logits_vec2);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float yv = scale_logit(z[e], inv_t);
      y[2 * jj + e] = yv;
      if (lane_col + e == rel_target) p.target_logit[row - p.row_begin] = yv;  // the single owner in the grid
      if (lane_col + e < real) m = fp::max_nan(m, yv);
    }
  }
  m = fp::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
  m = fp::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
  m = normalize_zero(m);

  float level[8];
  float x[16];
  bool normal = real == kVocabTile;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    x[i] = fp::sub(y[i], m);
    normal = normal && x[i] >= kExpcNormalMin;
  }
  if (__all_sync(0xFFFFFFFFu, normal)) {
    // Two batches of 8: the second batch's arguments are tied to the first batch's results, so
    // at most 8 exponentials are in flight (registers: two accumulator sets are live here).
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) level[jj] = tree_add(expc_normal(x[2 * jj]), expc_normal(x[2 * jj + 1]));
    asm volatile(""
                 : "+f"(level[0]), "+f"(level[1]), "+f"(level[2]), "+f"(level[3]), "+f"(x[8]), "+f"(x[9]), "+f"(x[10]),
                   "+f"(x[11]), "+f"(x[12]), "+f"(x[13]), "+f"(x[14]), "+f"(x[15]));
#pragma unroll
    for (int jj = 4; jj < 8; ++jj) level[jj] = tree_add(expc_normal(x[2 * jj]), expc_normal(x[2 * jj + 1]));
  } else {
    // Rare (an argument below -87, a NaN, a partial tile): expc one value at a time through a
    // local copy, so the 16 branchy exponentials do not all hold registers while the two
    // accumulator sets are live.
    float xs[16], es[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) xs[i] = x[i];
#pragma unroll 1
    for (int i = 0; i < 16; ++i) es[i] = 8 * (i / 2) + 2 * q + (i % 2) < real ? expc(xs[i]) : 0.0f;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) level[jj] = tree_add(es[2 * jj], es[2 * jj + 1]);  // level 1
  }
  finish_tile_summary(level, m, p, row, row_ok, local_tile, q);
}

}  // namespace detlogp::sm90

// SM90 fused epilogue: from the wgmma accumulators to the contract's per-64-lane tile summaries,
// the owned scaled target logit y_t and (serving entry) the fp32 logits z. One definition of the
// math (fragment_tile_summaries); the launch's features (bias, logits output) and the fragment's
// position (whole vocab tiles, or the shard's edge) are template parameters of it.
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
#include "sm90/device/ptx.cuh"
#include "sm90/params.hpp"

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
// sign extension right after the load stalled every tile ~400 cycles before its K walk, measured under ncu),
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

// kMulti ([N, K] targets): the targets are not loaded here (the epilogue reads a row's K targets
// itself, pick_target_logits), only the temperatures.
template <bool kMulti = false>
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
    if constexpr (kMulti) {
      r.target_lo[h] = 0;
    } else if (p.targets_i64) {
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
// scheduler interleaves (measured under ncu: with the branches this prelude ran at half the issue rate).
// kMulti: no single target (target_rel -1; pick_target_logits takes the row's K targets).
template <int BlockN, bool kMulti = false>
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
    if constexpr (kMulti) {
      w.target_rel[h] = -1;
    } else {
      const int64_t tgt = rows.target(h, p);
      const int64_t rel = tgt - fragment_col;
      const bool in_fragment = w.row_ok[h] && tgt != p.ignore_index && static_cast<uint64_t>(rel) < uint64_t{BlockN};
      w.target_rel[h] = in_fragment ? static_cast<int>(rel) : -1;
    }
  }
  w.unit_temperature = __all_sync(0xFFFFFFFFu, w.inv_t[0] == 1.0f && w.inv_t[1] == 1.0f);
  return w;
}

// [N, K] targets: the lines holding the K targets of this warp's 16 rows of an m64 fragment (rows
// from row_tile0 + 16 warp, below row_limit) into L1, one line per lane, issued where the fragment's
// per-row loads are (before its mainloop, or a tile ahead): pick_target_logits then reads them from
// L1 instead of waiting on L2 or memory in an epilogue that nothing overlaps (the cooperative kernel).
__device__ __forceinline__ void prefetch_fragment_targets(const FusedParams& p, int64_t row_tile0, int64_t row_limit) {
  const int64_t warp_row0 = row_tile0 + 16 * ((threadIdx.x % 128) / 32);
  if (warp_row0 >= row_limit) return;  // warp-uniform
  const int64_t rows_here = row_limit - warp_row0 < 16 ? row_limit - warp_row0 : 16;
  const int64_t width = p.targets_i64 ? 8 : 4;
  const auto* first = static_cast<const uint8_t*>(p.targets) + warp_row0 * p.targets_per_row * width;
  const int64_t bytes = rows_here * p.targets_per_row * width;
  // From the line holding the first byte: 128-byte lines, at most 16 * 64 * 8 bytes (65 lines).
  const uintptr_t line0 = reinterpret_cast<uintptr_t>(first) & ~uintptr_t{127};
  const uintptr_t end = reinterpret_cast<uintptr_t>(first) + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = line0 + 128 * (threadIdx.x % 32); line < end; line += 32 * 128)
    ptx::prefetch_l1(reinterpret_cast<const void*>(line));
}

// The target logits of [N, K] targets (FusedParams::targets_per_row = K > 1) that lie in this
// fragment, each stored by its single owner into target_logit[row - row_begin][k] with the
// single-target pick's operations (so each entry has the bits of a one-target call for its id).
// Called where that pick runs: acc holds y (or z where every factor of the warp is 1, scale_logit
// again being exact), not yet x. The warp's 16 rows' K targets are contiguous in targets
// ([N][K]): the lanes read them in coalesced rounds of 32 entries from global memory (L1) here,
// not held in registers through the mainloop, and a ballot per round finds the entries whose id
// falls in the fragment's columns (rare: about K * BlockN / V of a warp's rows); each such entry
// goes to the lane holding its column (row r: lane 4 (r % 8) + q, half r / 8), which selects its
// value. Four rounds' loads issue together, so K <= 8 waits for one load latency per fragment.
template <int BlockN>
__device__ __forceinline__ void pick_target_logits(const float (&acc)[BlockN / 2], const FusedParams& p,
                                                   const int64_t (&row)[2], const float (&inv_t)[2], int64_t warp_row0,
                                                   int64_t row_limit, int64_t col0) {
  constexpr int kTiles = BlockN / kVocabTile;
  constexpr int kBatch = 4;  // rounds of 32 entries whose loads issue together
  const int lane = threadIdx.x % 32;
  const int k_per_row = p.targets_per_row;
  const int64_t rows_here = row_limit - warp_row0 < 16 ? row_limit - warp_row0 : 16;  // >= 1 (caller's test)
  const int entries = static_cast<int>(rows_here) * k_per_row;                        // <= 16 * kMaxTargetsPerRow
  const int64_t base = warp_row0 * k_per_row;  // flat index of the warp's first entry
  const int64_t fragment_col = p.vocab_start + col0;
  auto at = [](int tt, int h, int i) { return (tt * 8 + i / 2) * 4 + 2 * h + i % 2; };
  for (int e0 = 0; e0 < entries; e0 += 32 * kBatch) {  // warp-uniform
    int64_t tgt[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = e0 + 32 * b + lane;
      tgt[b] = e < entries ? load_target(p.targets, p.targets_i64, base + e) : p.ignore_index;
    }
    uint32_t hits[kBatch];  // per round, the lanes whose entry lies in the fragment
    int rel[kBatch];        // that entry's column relative to col0
    uint32_t any = 0;
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t r64 = tgt[b] - fragment_col;
      rel[b] = static_cast<int>(r64);
      hits[b] = __ballot_sync(0xFFFFFFFFu, tgt[b] != p.ignore_index && static_cast<uint64_t>(r64) < uint64_t{BlockN});
      any |= hits[b];
    }
    // None (the common case) or the hits one entry at a time, in a rolled loop over the rounds: the
    // selection below is emitted once (rare; unrolled it would add thousands of instructions).
    if (any == 0) continue;  // warp-uniform
#pragma unroll 1
    for (int b = 0; b < kBatch; ++b) {
      uint32_t left = hits[0];
      int rel_b = rel[0];
#pragma unroll
      for (int c = 1; c < kBatch; ++c) {
        left = b == c ? hits[c] : left;
        rel_b = b == c ? rel[c] : rel_b;
      }
      while (left != 0) {  // warp-uniform
        const int src = __ffs(left) - 1;
        left &= left - 1;
        const int rel_s = __shfl_sync(0xFFFFFFFFu, rel_b, src);
        const int e = e0 + 32 * b + src;
        const int r = e / k_per_row;  // the entry's row within the warp's 16
        const int k = e - r * k_per_row;
        const int h = r / 8;
        if (lane != 4 * (r % 8) + ((rel_s >> 1) & 3)) continue;
        const int tt_t = rel_s / kVocabTile;
        const int idx = ((rel_s % kVocabTile) >> 3) * 2 + (rel_s & 1);
        float v = 0.0f;
#pragma unroll
        for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            float w = acc[at(tt, hh, 0)];
#pragma unroll
            for (int i = 1; i < 16; ++i) w = i == idx ? acc[at(tt, hh, i)] : w;
            v = tt == tt_t && hh == h ? w : v;
          }
        const float it = h == 0 ? inv_t[0] : inv_t[1];
        const int64_t row_h = h == 0 ? row[0] : row[1];
        p.target_logit[(row_h - p.row_begin) * k_per_row + k] = it == 1.0f ? scale_logit(v, 1.0f) : v;
      }
    }
  }
}

// The top-k candidates of one lane group (a thread's 16 lanes of one vocab tile and row: columns
// 8 j + 2 q + e), offered its lanes in ascending column order with the running max before each:
// `first`, the position (0..15) of the group's first lane equal to its max (the max itself is the
// running max at the end), and `second`, the largest of its other lanes (NaN where the group holds
// a NaN, which makes the group's max NaN too and its candidates unknown; see topk_candidates). A
// lane that ties the max before it goes to `second`, so the lower column stays first. kEdge: only
// real lanes are offered (lane_real), and the first real lane takes first even at -inf.
template <bool kEdge>
struct GroupCandidates {
  static constexpr int kNone = 16;
  float second = fp::neg_inf();
  int first = kEdge ? kNone : 0;
  __device__ __forceinline__ void offer(int i, float v, float max_before, bool lane_real) {
    if constexpr (kEdge) {
      if (!lane_real) return;
      const bool takes = first == kNone || v > max_before;
      second = fp::max_nan(second, takes ? max_before : v);
      first = takes ? i : first;
    } else {
      if (i == 0) return;  // first = 0 and second = -inf: the group's first lane is its running max
      const bool takes = v > max_before;
      second = fp::max_nan(second, takes ? max_before : v);
      first = takes ? i : first;
    }
  }
};

// The epilogue of one m64 accumulator fragment, written for throughput: each phase runs over all
// 2 * BlockN / 64 slices (vocab tile tt, row half h) before the next, in place on acc, so the
// dependent chains of different slices (the 16-deep max, the two shuffle levels, the tree) overlap
// instead of running one slice after another, and a single warp vote covers the whole fragment's
// exponentials. The operations, in the contract's order (docs/contract.md): bias, scale, the slice's
// max (exact, ascending within the slice; real lanes only), the lane max over q, -0 normalized,
// x = y - m, expc (expc_normal on its domain; exactly 0 for a padding lane), level 1 in-thread,
// levels 2-3 over q, levels 4-6 in-thread, +0 when the tile max is -inf.
// Instruction count is the cost here (the fp32 work competes with the tensor cores for issue), so:
// the scale is skipped where every inverse temperature of the warp is 1 (y == z exactly; the one
// stored target logit still goes through scale_logit, so even a NaN's bits are unchanged), and
// tree levels 2-3 are a reduce-scatter over the slices (each lane pair adds half of the slices,
// tree_add commutes), after which lane q finishes and stores its own slices.
// kPlain = false: the launch may have a bias (added to every value first, as add_bias) and a logits
// output (z stored with st.global.cs before the scale), both decided once per fragment.
// kEdge = false: every vocab tile of the fragment is whole and inside the shard (fragment_whole)
// and logits, if stored, go out as 8-byte aligned float2 pairs (logits_vec2). kEdge = true: the
// fragment at the shard's edge, or logits that are not pair-aligned: lanes past real_vocab are
// padding, columns past the shard are neither loaded nor stored, tiles past it store no summary,
// and the exponentials take expc lane by lane (same bits; this form runs once per row and shard).
// kPrepared: the rows come prepared in *prepared (prepare_wide_rows, the same fragment); otherwise
// they are set up here, from `rows`, by the same operations.
// kEntropy: also each tile's entropy sum u_g (docs/contract.md §10) into p.usums, by a second tree
// over the lane terms e * x that takes the e tree's pairs at every level (same lanes, same shuffles),
// so u_g is reduce.hpp's tile_tree_sum of entropy_lane_term; without it the code is unchanged.
// kCandidates: also each lane group's top-k candidates (GroupCandidates, the top-k output's
// candidate path), taken in the max pass; without it the code is unchanged.
template <int BlockN, bool kPlain, bool kPrepared, bool kEdge, bool kEntropy, bool kMulti = false,
          bool kCandidates = false>
__device__ __forceinline__ void fragment_tile_summaries(float (&acc)[BlockN / 2], const FusedParams& p,
                                                        const FragmentRows& rows, const WideRows* prepared,
                                                        int64_t row_tile0, int64_t row_limit, int64_t col0,
                                                        bool logits_vec2) {
  static_assert(BlockN % kVocabTile == 0, "whole vocab tiles per fragment");
  static_assert(kVocabTile == 64 && kTileTreeLevels == 6, "the shuffle mapping below covers a 64-lane, 6-level tree");
  constexpr int kTiles = BlockN / kVocabTile;
  constexpr int kSlices = 2 * kTiles;  // slice 2 tt + h
  const int t = threadIdx.x % 128;
  const int warp = t / 32;
  const int lane = t % 32;
  const int q = lane % 4;
  if (row_tile0 + 16 * warp >= row_limit) return;  // warp-uniform: all 16 rows past the chunk
  // Set up in place for the ping-pong kernels: a by-value WideRows here cost the serving kernel
  // (prefill_c2) 64 more spill stores.
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
    // Selects, not per-row branches, as in prepare_wide_rows.
    const int64_t fragment_col = p.vocab_start + col0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row[h] = row_tile0 + 16 * warp + lane / 4 + 8 * h;
      row_ok[h] = row[h] < row_limit;
      const float it = rows.inv_t(h, p);
      inv_t[h] = row_ok[h] ? it : 1.0f;
      if constexpr (kMulti) {
        target_rel[h] = -1;
      } else {
        const int64_t tgt = rows.target(h, p);
        const int64_t rel = tgt - fragment_col;
        const bool in_fragment = row_ok[h] && tgt != p.ignore_index && static_cast<uint64_t>(rel) < uint64_t{BlockN};
        target_rel[h] = in_fragment ? static_cast<int>(rel) : -1;
      }
    }
  }
  // acc index of value i (0..15) of slice (tt, h).
  auto at = [](int tt, int h, int i) { return (tt * 8 + i / 2) * 4 + 2 * h + i % 2; };

  if constexpr (!kPlain) {
    // z = fl(acc + b) (+0 past the shard's columns), then the stored logits.
    if (p.bias != nullptr) {
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int64_t c = col0 + kVocabTile * tt + 8 * (i / 2) + 2 * q + i % 2;
          const float b = !kEdge || c < p.vocab_local ? p.bias[c] : 0.0f;
#pragma unroll
          for (int h = 0; h < 2; ++h) acc[at(tt, h, i)] = add_bias(acc[at(tt, h, i)], b);
        }
    }
    if (p.logits != nullptr) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!row_ok[h]) continue;
        if constexpr (kEdge) {
#pragma unroll
          for (int tt = 0; tt < kTiles; ++tt) {
            const int64_t tile_col0 = col0 + kVocabTile * tt;
            if (tile_col0 >= p.vocab_local) break;  // uniform: past the shard
            const int64_t left = p.vocab_local - tile_col0;
            const int cols = left >= kVocabTile ? kVocabTile : static_cast<int>(left);
            float* out = p.logits + row[h] * p.logits_stride + tile_col0;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
              store_logit_pair(out, 8 * jj + 2 * q, cols, acc[at(tt, h, 2 * jj)], acc[at(tt, h, 2 * jj + 1)],
                               logits_vec2);
          }
        } else {
          float* out = p.logits + row[h] * p.logits_stride + col0 + 2 * q;
#pragma unroll
          for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
              __stcs(reinterpret_cast<float2*>(out + kVocabTile * tt + 8 * jj),
                     make_float2(acc[at(tt, h, 2 * jj)], acc[at(tt, h, 2 * jj + 1)]));
        }
      }
    }
  }

  // Scale in place (unless every factor of the warp is 1) and each slice's max, values ascending
  // within a slice. The running max starts at the slice's first value rather than at max(-inf,
  // first): the same bits (max_nan(-inf, v) is v for every non-NaN v, and a NaN turns the
  // canonical NaN at the next step either way), one instruction less per slice.
  // At the edge the max runs over the real lanes only and starts at -inf (no real lane: -inf).
  float m[kSlices];
  int real[kTiles];  // kEdge: real lanes of each vocab tile (0 past the shard)
  GroupCandidates<kEdge> cand[kCandidates ? kSlices : 1];
  if constexpr (kEdge) {
#pragma unroll
    for (int tt = 0; tt < kTiles; ++tt) {
      const int64_t local_tile = col0 / kVocabTile + tt;
      real[tt] = local_tile < p.local_tiles ? tile_real_lanes(p, local_tile) : 0;
    }
  }
  if (!kEdge &&
      (kPrepared ? prepared->unit_temperature : __all_sync(0xFFFFFFFFu, inv_t[0] == 1.0f && inv_t[1] == 1.0f))) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kCandidates) cand[2 * tt + h].offer(i, acc[at(tt, h, i)], m[2 * tt + h], true);
          m[2 * tt + h] = i == 0 ? acc[at(tt, h, 0)] : fp::max_nan(m[2 * tt + h], acc[at(tt, h, i)]);
        }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& v = acc[at(tt, h, i)];
          v = scale_logit(v, inv_t[h]);
          if constexpr (kEdge) {
            const float before = i == 0 ? fp::neg_inf() : m[2 * tt + h];
            const bool lane_real = 8 * (i / 2) + 2 * q + i % 2 < real[tt];
            if constexpr (kCandidates) cand[2 * tt + h].offer(i, v, before, lane_real);
            m[2 * tt + h] = lane_real ? fp::max_nan(before, v) : before;
          } else {
            if constexpr (kCandidates) cand[2 * tt + h].offer(i, v, m[2 * tt + h], true);
            m[2 * tt + h] = i == 0 ? v : fp::max_nan(m[2 * tt + h], v);
          }
        }
  }
  if constexpr (kCandidates) {
    // m holds each slice's (lane group's) max before the shuffles below.
#pragma unroll
    for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t local_tile = col0 / kVocabTile + tt;
        if (!row_ok[h] || (kEdge && local_tile >= p.local_tiles)) continue;
        const int64_t slot =
            (row[h] - p.row_begin) * (p.local_tiles * kGroupsPerTile) + local_tile * kGroupsPerTile + q;
        const GroupCandidates<kEdge>& c = cand[2 * tt + h];
        p.cand_max[slot] = m[2 * tt + h];
        p.cand_second[slot] = c.second;
        p.cand_lane[slot] = c.first == GroupCandidates<kEdge>::kNone
                                ? kNoCandidateLane
                                : static_cast<uint8_t>(8 * (c.first / 2) + 2 * q + c.first % 2);
      }
  }
  // The target logit, picked by its owner only (column 8 jj + 2 q + e is value 2 jj + e of thread
  // q); scale_logit again is exact where the values were scaled (inv_t != 1) and the identity else.
  // One warp-uniform branch around both halves: a warp's 16 rows rarely have a target here.
  // kMulti: the row's K targets instead (pick_target_logits, the same selection and store).
  if constexpr (kMulti) {
    pick_target_logits<BlockN>(acc, p, row, inv_t, row_tile0 + 16 * warp, row_limit, col0);
  } else {
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
  // At the edge no vote: the exponentials take expc lane by lane.
  bool fast = false;
  if constexpr (kEdge) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
        for (int h = 0; h < 2; ++h) acc[at(tt, h, i)] = fp::sub(acc[at(tt, h, i)], m[2 * tt + h]);
  } else {
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
    fast = __all_sync(0xFFFFFFFFu, normal);
  }
  // Exponentials and tree level 1 (in-thread pairs) of slice (tt, h) into lv: expc_normal, or, when
  // the vote failed (an argument below -87 or a NaN somewhere in the warp's fragment), expc with its
  // range branches through a local copy (a rolled loop keeps the rare path's code small), 0 for a
  // lane that is not real.
  // kEntropy: level 1 of the entropy terms too, into wv.
  auto level1 = [&](auto fast_path, int tt, int h, float(&lv)[8], float(&wv)[kEntropy ? 8 : 1]) {
    if constexpr (decltype(fast_path)::value) {
      if constexpr (kEntropy) {
        // e > 0 on expc_normal's domain (its results are normal), so entropy_lane_term is the product.
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float x0 = acc[at(tt, h, 2 * jj)], x1 = acc[at(tt, h, 2 * jj + 1)];
          const float e0 = expc_normal(x0), e1 = expc_normal(x1);
          lv[jj] = tree_add(e0, e1);
          wv[jj] = tree_add(fp::mul(e0, x0), fp::mul(e1, x1));
        }
      } else {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
          lv[jj] = tree_add(expc_normal(acc[at(tt, h, 2 * jj)]), expc_normal(acc[at(tt, h, 2 * jj + 1)]));
      }
    } else if constexpr (kEntropy) {
      float xs[16], es[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) xs[i] = acc[at(tt, h, i)];
#pragma unroll 1
      for (int i = 0; i < 16; ++i) es[i] = !kEdge || 8 * (i / 2) + 2 * q + i % 2 < real[tt] ? expc(xs[i]) : 0.0f;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        lv[jj] = tree_add(es[2 * jj], es[2 * jj + 1]);
        wv[jj] = tree_add(entropy_lane_term(es[2 * jj], xs[2 * jj]), entropy_lane_term(es[2 * jj + 1], xs[2 * jj + 1]));
      }
    } else {
      float xs[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) xs[i] = acc[at(tt, h, i)];
      if constexpr (kEdge) {
#pragma unroll 1
        for (int i = 0; i < 16; ++i) xs[i] = 8 * (i / 2) + 2 * q + i % 2 < real[tt] ? expc(xs[i]) : 0.0f;
      } else {
#pragma unroll 1
        for (int i = 0; i < 16; ++i) xs[i] = expc(xs[i]);
      }
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
  // Levels 2-3 of a closed group of four slices (see groups below): level 2 pairs slices (0, 1) and
  // (2, 3), level 3 (lanes q, q ^ 2) scatters again over those two pairs.
  auto level23 = [&](const auto& lv, float(&l3)[8]) {
    float l2a[8], l2b[8];
    level2(lv[0], lv[1], l2a);
    level2(lv[2], lv[3], l2b);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float keep = b1 ? l2b[jj] : l2a[jj];
      const float send = b1 ? l2a[jj] : l2b[jj];
      l3[jj] = tree_add(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 2));
    }
  };
  // Levels 2-3 of one vocab tile's two slices: level 2 as above, level 3 a plain exchange (both
  // lanes hold the same bits).
  auto level23_exchange = [&](const auto& lv, float(&l3)[8]) {
    float l2[8];
    level2(lv[0], lv[1], l2);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) l3[jj] = tree_add(l2[jj], __shfl_xor_sync(0xFFFFFFFFu, l2[jj], 2));
  };
  // Slice 2 s + b0 is vocab tile s, row half b0.
  const int64_t row_h = b0 ? row[1] : row[0];
  const bool row_ok_h = b0 ? row_ok[1] : row_ok[0];
  // Levels 4-6 of one slice held by this lane, +0 when its max is -inf, and its summary (kEntropy:
  // and its entropy sum from lw, the same way).
  auto levels456 = [](const float(&l)[8]) {
    const float l4a = tree_add(l[0], l[1]), l4b = tree_add(l[2], l[3]);
    const float l4c = tree_add(l[4], l[5]), l4d = tree_add(l[6], l[7]);
    return tree_add(tree_add(l4a, l4b), tree_add(l4c, l4d));
  };
  auto finish = [&](const float(&l)[8], const float(&lw)[kEntropy ? 8 : 1], float mx, int tt, bool store) {
    float sum = levels456(l);
    if (mx == fp::neg_inf()) sum = 0.0f;  // all lanes -inf
    const int64_t local_tile = col0 / kVocabTile + tt;
    if (store && row_ok_h && (!kEdge || local_tile < p.local_tiles)) {
      const int64_t slot = (row_h - p.row_begin) * p.local_tiles + local_tile;
      p.summaries[slot] = TileSummary{mx, sum};
      if constexpr (kEntropy) p.usums[slot] = mx == fp::neg_inf() ? 0.0f : levels456(lw);
    }
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
        float lv[4][8], wv[4][kEntropy ? 8 : 1];
#pragma unroll
        for (int k = 0; k < 4; ++k) level1(fast_path, 2 * u + k / 2, k % 2, lv[k], wv[k]);
        float l3[8], w3[kEntropy ? 8 : 1];
        level23(lv, l3);
        if constexpr (kEntropy) level23(wv, w3);
        const float m_lo = b0 ? m[4 * u + 1] : m[4 * u];
        const float m_hi = b0 ? m[4 * u + 3] : m[4 * u + 2];
        finish(l3, w3, b1 ? m_hi : m_lo, 2 * u + (b1 ? 1 : 0), true);
      }
    } else {
      // An odd number of slice pairs (BlockN = 192): per vocab tile, level 2 as above and level 3 as
      // a plain exchange (both lanes hold the same bits), stored by the lane with b1 = 0.
#pragma unroll
      for (int s = 0; s < kS2; ++s) {
        float lv[2][8], wv[2][kEntropy ? 8 : 1];
        level1(fast_path, s, 0, lv[0], wv[0]);
        level1(fast_path, s, 1, lv[1], wv[1]);
        float l3[8], w3[kEntropy ? 8 : 1];
        level23_exchange(lv, l3);
        if constexpr (kEntropy) level23_exchange(wv, w3);
        finish(l3, w3, b0 ? m[2 * s + 1] : m[2 * s], s, !b1);
      }
    }
  };
  if constexpr (kEdge)
    groups(std::false_type{});
  else if (fast)
    groups(std::true_type{});
  else
    groups(std::false_type{});
}

// Epilogue of one m64 accumulator fragment of a consumer warpgroup: its 64 rows start at
// `row_tile0`, rows at or past `row_limit` are not this tile's (past the chunk, or replicas of an
// 8-row tile), its columns start at local column `col0` (a multiple of 64); `rows` holds the
// thread's two rows' temperature and target (load_fragment_rows, ideally before the mainloop).
// acc is consumed in place. kPlain: the launch has neither bias nor logits output (the trainer
// entry without bias). kPrepared: the rows come prepared in *prepared (prepare_wide_rows). kMulti:
// [N, K] targets, K = p.targets_per_row > 1 (pick_target_logits); the single-target form without it.
template <int BlockN, bool kPlain = false, bool kPrepared = false, bool kEntropy = false, bool kMulti = false,
          bool kCandidates = false>
__device__ __forceinline__ void epilogue_tile_summaries(float (&acc)[BlockN / 2], const FusedParams& p,
                                                        const FragmentRows& rows, int64_t row_tile0, int64_t row_limit,
                                                        int64_t col0, bool logits_vec2,
                                                        const WideRows* prepared = nullptr) {
  // Warp-uniform: all 16 rows of this warp lie past the chunk (decode: most warps idle).
  if (row_tile0 + 16 * ((threadIdx.x % 128) / 32) >= row_limit) return;
  if (fragment_whole<BlockN>(p, col0) && (kPlain || p.logits == nullptr || logits_vec2))
    return fragment_tile_summaries<BlockN, kPlain, kPrepared, false, kEntropy, kMulti, kCandidates>(
        acc, p, rows, prepared, row_tile0, row_limit, col0, logits_vec2);
  // The edge sets its rows up from `rows` even where they come prepared: that form of the
  // cooperative kernel measured up to 0.6 % faster than the one reading *prepared (docs/perf.md).
  fragment_tile_summaries<BlockN, kPlain, false, true, kEntropy, kMulti, kCandidates>(acc, p, rows, prepared, row_tile0,
                                                                                      row_limit, col0, logits_vec2);
}

}  // namespace detlogp::sm90

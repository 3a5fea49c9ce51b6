// The contract chain over a row's tile summaries on the device (docs/contract.md: M = max over
// the tile maxima, then S <- fma(s_g, expc(m_g - M), S) in ascending g, then finalize_row), in
// three schedules with identical operations and bits:
//   chain_row_cta:      one CTA per row, any number of segments, 32 registers (the tensor-parallel
//                       merge of more than 256 rows);
//   chain_row_cta_held: one CTA per row, any number of segments, the row's tiles held in registers
//                       (latency first: the full-mode combine and the merge up to 256 rows);
//   chain_rows_lanes:   kRows rows of one segment per CTA, one chain per lane of a chain warp (kRows
//                       chains per fma instruction) fed through two shared stages by four factor
//                       warps (the full-mode combine above 256 rows).
// With kEntropy every schedule also runs the entropy chain U and the compensation C beside S (§10;
// U's term fma(s_g, d_g, u_g) formed off the serial path with the factor, entropy_chains_step on
// it) and writes the entropy.
// Shared by combine.cu (the kernels) and bench/bench_sm90_combine.cu (the A/B).
#pragma once

#include <cstdint>

#include "sm90/device/ptx.cuh"
#include "sm90/params.hpp"

namespace detlogp::sm90 {

inline constexpr int kCombineCtaThreads = 256;  // chain_row_cta: one CTA per row
inline constexpr int kChainChunk = 2048;        // chain_row_cta: tiles staged per chain step

// The CTA's maximum of every thread's `m` (kCombineCtaThreads threads; one __syncthreads).
__device__ __forceinline__ float cta_row_max(float m, float (&warp_max)[kCombineCtaThreads / 32]) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = chain_max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = warp_max[0];
#pragma unroll
  for (int w = 1; w < kCombineCtaThreads / 32; ++w) m = chain_max(m, warp_max[w]);
  return m;
}

// Row `row`'s K = k_per_row entries of logp [N][K] and its lse from its maximum and chain sum: each
// target's finalize_row with its own y_t (y_of(k), not read for an ignored target), so every entry
// has the bits of a single-target call for its id. K = 1: the [N] targets.
template <class YOf>
__device__ __forceinline__ void finish_row_targets(const void* targets, int targets_i64, int64_t ignore_index,
                                                   int k_per_row, int64_t row, float global_max, float sum,
                                                   const YOf& y_of, float* logp, float* lse) {
  for (int k = 0; k < k_per_row; ++k) {
    const int64_t i = row * k_per_row + k;
    const bool ignored = load_target(targets, targets_i64, i) == ignore_index;
    const RowResult res = finalize_row(global_max, sum, ignored ? 0.0f : y_of(k), ignored);
    logp[i] = res.logp;
    lse[row] = res.lse;
  }
}

// Row r's logp and lse from its maximum and chain sum (and its entropy from S and U, where
// entropy is non-null); each y_t from the segment that owns that target (no read for an ignored one).
__device__ __forceinline__ void finish_segmented_row(const MergeSegment* segments, int count, int64_t r, int64_t row,
                                                     const void* targets, int targets_i64, int64_t ignore_index,
                                                     int k_per_row, float global_max, float sum, float usum, float comp,
                                                     float* logp, float* lse, float* entropy) {
  if (entropy != nullptr) entropy[row] = finalize_entropy(sum, usum, comp);
  finish_row_targets(
      targets, targets_i64, ignore_index, k_per_row, row, global_max, sum,
      [&](int k) {
        const int64_t i = r * k_per_row + k;
        float y_t = 0.0f;
        for (int s = 0; s < count; ++s)
          if (segments[s].owned == nullptr || segments[s].owned[i] != 0) y_t = segments[s].target_logit[i];
        return y_t;
      },
      logp, lse);
}

// One ascending step of the three chains of §10 over tile g: S's fma, the compensation of its
// rounding, and U's fma on the tile's term (entropy_chain_term_or_skip). U does not wait for S;
// the compensation takes S's result. Every schedule's entropy runs exactly these operations.
__device__ __forceinline__ void entropy_chains_step(float& sum, float& usum, float& comp, float tile_sum, float factor,
                                                    float term) {
  const float before = sum;
  sum = chain_fma(sum, tile_sum, factor);
  comp = compensation_step(comp, before, sum, tile_sum, factor);
  usum = entropy_chain_fma(usum, term, factor);
}

// One CTA (kCombineCtaThreads) per row. The CTA computes the factors expc(m_g - M) of a chunk of
// tiles in parallel into shared memory and one thread runs the sequential fma chain over them.
// The row's tiles are the concatenation of `count` segments in ascending global tile order (one
// per tensor-parallel rank in the merge); y_t comes from the segment that owns the target
// (owned == null: the segment owns every non-ignored row).
// kHeads: segments may carry a head tile (a straddling tile, MergeSegment::head), chained by the
// chain thread right before the segment's tiles, with the same operations as a staged tile.
template <bool kEntropy = false, bool kHeads = false>
__device__ __forceinline__ void chain_row_cta(const MergeSegment* segments, int count, int64_t r, int64_t row,
                                              const void* targets, int targets_i64, int64_t ignore_index, int k_per_row,
                                              float* logp, float* lse, float* entropy = nullptr) {
  __shared__ float warp_max[kCombineCtaThreads / 32];
  __shared__ alignas(16) float chunk_sum[kChainChunk];
  __shared__ alignas(16) float chunk_scale[kChainChunk];
  __shared__ alignas(16) float chunk_term[kEntropy ? kChainChunk : 1];
  const int tid = threadIdx.x;

  float global_max = fp::neg_inf();
  for (int s = 0; s < count; ++s) {
    const TileSummary* tiles = segments[s].summaries + r * segments[s].tiles;
    if constexpr (kHeads)
      if (tid == 0 && segments[s].head != nullptr) global_max = chain_max(global_max, segments[s].head[r].max);
#pragma unroll 4
    for (int64_t g = tid; g < segments[s].tiles; g += kCombineCtaThreads)
      global_max = chain_max(global_max, tiles[g].max);
  }
  global_max = cta_row_max(global_max, warp_max);

  float sum = 0.0f, usum = 0.0f, comp = 0.0f;
  for (int s = 0; s < count; ++s) {
    const TileSummary* tiles = segments[s].summaries + r * segments[s].tiles;
    if constexpr (kHeads) {
      if (tid == 0 && segments[s].head != nullptr) {  // the straddling tile before the segment's own
        const TileSummary ts = segments[s].head[r];
        const float factor = chain_factor_or_skip(ts, global_max);
        if constexpr (kEntropy)
          entropy_chains_step(sum, usum, comp, ts.sum, factor,
                              entropy_chain_term_or_skip(ts, segments[s].head_usum[r], global_max, factor));
        else
          sum = chain_fma(sum, ts.sum, factor);
      }
    }
    for (int64_t base = 0; base < segments[s].tiles; base += kChainChunk) {
      const int64_t left = segments[s].tiles - base;
      const int n = static_cast<int>(left < kChainChunk ? left : kChainChunk);
      for (int i = tid; i < n; i += kCombineCtaThreads) {
        const TileSummary ts = tiles[base + i];
        chunk_sum[i] = ts.sum;
        const float factor = chain_factor_or_skip(ts, global_max);  // off the serial path
        chunk_scale[i] = factor;
        if constexpr (kEntropy)
          chunk_term[i] =
              entropy_chain_term_or_skip(ts, segments[s].usums[r * segments[s].tiles + base + i], global_max, factor);
      }
      __syncthreads();
      if (tid == 0) {  // the serial path: one dependent fma per tile (a plain loop keeps 32 registers)
        if constexpr (kEntropy) {
#pragma unroll 16
          for (int i = 0; i < n; ++i) entropy_chains_step(sum, usum, comp, chunk_sum[i], chunk_scale[i], chunk_term[i]);
        } else {
#pragma unroll 16
          for (int i = 0; i < n; ++i) sum = chain_fma(sum, chunk_sum[i], chunk_scale[i]);
        }
      }
      __syncthreads();
    }
  }
  if (tid == 0)
    finish_segmented_row(segments, count, r, row, targets, targets_i64, ignore_index, k_per_row, global_max, sum, usum,
                         comp, logp, lse, kEntropy ? entropy : nullptr);
}

// ---- chain_rows_lanes ------------------------------------------------------------------------
inline constexpr int kLanesChunk = 128;                         // tiles per stage (one per factor thread)
inline constexpr int kLanesFactorThreads = kLanesChunk;         // warps 1..4
inline constexpr int kLanesThreads = 32 + kLanesFactorThreads;  // warp 0: the chains

// The serial fma chain of one lane over a staged row: v[i] = {s_g, factor}, ascending i; v is
// 16-byte aligned. Blocks of kBlock pairs, each fully unrolled: two pairs per 16-byte shared load,
// every load addressed by an immediate offset from the block's base, so ptxas issues them ahead
// of their fmas with nothing to drain in between. (A loop over register buffers of 16 pairs ran
// at ~10 cycles a step instead of the fma's 4: ptxas issued a buffer's loads just before the
// back branch, and the branch's address increment waited for those loads to read the old
// address.)
template <int kBlock = 64>
__device__ __forceinline__ float chain_fma_pairs(float sum, const float2* v, int n) {
  static_assert(kBlock % 2 == 0, "whole 16-byte loads");
  const float4* block = reinterpret_cast<const float4*>(v);
  int i = 0;
  for (; i + kBlock <= n; i += kBlock, block += kBlock / 2) {
#pragma unroll
    for (int k = 0; k < kBlock / 2; ++k) {
      const float4 two = block[k];
      sum = chain_fma(sum, two.x, two.y);
      sum = chain_fma(sum, two.z, two.w);
    }
  }
  for (; i < n; ++i) sum = chain_fma(sum, v[i].x, v[i].y);
  return sum;
}

// chain_fma_pairs with the entropy chains beside (entropy_chains_step): t[i] the tiles' entropy
// terms (or -0 to skip), 16-byte aligned like v. Per block of kBlock tiles, two 16-byte loads of
// pairs and one of terms feed four steps, all at immediate offsets from the block's base.
template <int kBlock = 32>
__device__ __forceinline__ void chain_fma_pairs_entropy(float& sum, float& usum, float& comp, const float2* v,
                                                        const float* t, int n) {
  static_assert(kBlock % 4 == 0, "whole 16-byte loads");
  const float4* pairs = reinterpret_cast<const float4*>(v);
  const float4* terms = reinterpret_cast<const float4*>(t);
  int i = 0;
  for (; i + kBlock <= n; i += kBlock, pairs += kBlock / 2, terms += kBlock / 4) {
#pragma unroll
    for (int k = 0; k < kBlock / 4; ++k) {
      const float4 a = pairs[2 * k], b = pairs[2 * k + 1], term = terms[k];
      entropy_chains_step(sum, usum, comp, a.x, a.y, term.x);
      entropy_chains_step(sum, usum, comp, a.z, a.w, term.y);
      entropy_chains_step(sum, usum, comp, b.x, b.y, term.z);
      entropy_chains_step(sum, usum, comp, b.z, b.w, term.w);
    }
  }
  for (; i < n; ++i) entropy_chains_step(sum, usum, comp, v[i].x, v[i].y, t[i]);
}

// The serial fma chain of one thread over a row staged in shared memory, v[i] = {s_g, factor},
// ascending i, for chain_row_cta_held: two register buffers of kRound pairs take turns, one loaded
// while the other's fmas run. Slower per step than chain_fma_pairs in isolation, yet the held
// schedule with it takes 12.9 us a 2374-tile row against 14.2 with chain_fma_pairs (H200; that
// form also takes the kernel from 102 to 59 registers and changes how its tile loads are placed).
template <int kRound = 16>
__device__ __forceinline__ float chain_fma_rounds(float sum, const float2* v, int n) {
  const int rounds = n / kRound;
  float2 a[kRound], b[kRound];
  auto load = [&](float2(&dst)[kRound], int q) {
#pragma unroll
    for (int k = 0; k < kRound; ++k) dst[k] = v[q * kRound + k];
  };
  auto run = [&](const float2(&src)[kRound]) {
#pragma unroll
    for (int k = 0; k < kRound; ++k) sum = chain_fma(sum, src[k].x, src[k].y);
  };
  if (rounds > 0) load(a, 0);
  int q = 0;
  for (; q + 1 < rounds; q += 2) {
    load(b, q + 1);
    run(a);
    if (q + 2 < rounds) load(a, q + 2);
    run(b);
  }
  if (q < rounds) run(a);
  for (int i = kRound * rounds; i < n; ++i) sum = chain_fma(sum, v[i].x, v[i].y);
  return sum;
}

// chain_fma_rounds with the entropy chains beside (entropy_chains_step): t[i] the tiles' entropy
// terms (or -0 to skip), the same factors.
template <int kRound = 16>
__device__ __forceinline__ void chain_fma_rounds_entropy(float& sum, float& usum, float& comp, const float2* v,
                                                         const float* t, int n) {
  const int rounds = n / kRound;
  float2 a[kRound], b[kRound];
  float ta[kRound], tb[kRound];
  auto load = [&](float2(&dst)[kRound], float(&dt)[kRound], int q) {
#pragma unroll
    for (int k = 0; k < kRound; ++k) {
      dst[k] = v[q * kRound + k];
      dt[k] = t[q * kRound + k];
    }
  };
  auto run = [&](const float2(&src)[kRound], const float(&st)[kRound]) {
#pragma unroll
    for (int k = 0; k < kRound; ++k) entropy_chains_step(sum, usum, comp, src[k].x, src[k].y, st[k]);
  };
  if (rounds > 0) load(a, ta, 0);
  int q = 0;
  for (; q + 1 < rounds; q += 2) {
    load(b, tb, q + 1);
    run(a, ta);
    if (q + 2 < rounds) load(a, ta, q + 2);
    run(b, tb);
  }
  if (q < rounds) run(a, ta);
  for (int i = kRound * rounds; i < n; ++i) entropy_chains_step(sum, usum, comp, v[i].x, v[i].y, t[i]);
}

// One CTA (kCombineCtaThreads) per row, latency first (the combine of up to a few hundred rows is
// about one CTA's latency after the fused kernel): each thread loads its tiles
// g = tid + kCombineCtaThreads k, k < kHeld, into registers, all loads in flight together, and
// takes the row maximum from them; then the whole row's {s_g, expc(m_g - M) or skip} goes to shared
// memory in one step, and one thread runs the fma chain over it (chain_fma_rounds). Rows longer
// than a chunk (kCombineCtaThreads x kHeld tiles) go chunk by chunk, the chunks after the first
// loaded again. Same operations and order as chain_row_cta, so the same bits; the row's tiles are
// the concatenation of `count` segments in ascending global tile order, as there.
// bench_sm90_combine (H200, 2374 tiles): 12.8 us at N = 1 against chain_row_cta's 17.3;
// copying the tiles to shared memory first (fewer registers, several rows per CTA) was slower: the
// loads then go in rounds.
inline constexpr int kHeldTiles = 12;  // 3072 tiles a chunk: Qwen3-8B's 2374 in one
// kHeads: segments may carry a head tile (MergeSegment::head), the segment's tile 0 here, its own
// tiles after it.
template <int kHeld = kHeldTiles, int kRound = 16, bool kEntropy = false, bool kHeads = false>
__device__ __forceinline__ void chain_row_cta_held(const MergeSegment* segments, int count, int64_t r, int64_t row,
                                                   const void* targets, int targets_i64, int64_t ignore_index,
                                                   int k_per_row, float* logp, float* lse, float* entropy = nullptr) {
  constexpr int kChunk = kCombineCtaThreads * kHeld;
  __shared__ float warp_max[kCombineCtaThreads / 32];
  __shared__ alignas(16) float2 pairs[kChunk];
  __shared__ alignas(16) float terms[kEntropy ? kChunk : 1];
  static_assert(sizeof(pairs) + sizeof(terms) + sizeof(warp_max) <= 48 * 1024, "static shared memory");
  const int tid = threadIdx.x;
  // Tiles of segment s in the row: its own, and with kHeads its head before them.
  auto tiles_of = [&](int s) {
    if constexpr (kHeads) return segments[s].tiles + (segments[s].head != nullptr ? 1 : 0);
    return segments[s].tiles;
  };
  int64_t total = 0;
  for (int s = 0; s < count; ++s) total += tiles_of(s);
  auto tile_at = [&](int64_t g) {  // tile g of the row across the segments
    int s = 0;
    while (s + 1 < count && g >= tiles_of(s)) g -= tiles_of(s++);
    if constexpr (kHeads) {
      if (segments[s].head != nullptr) {
        if (g == 0) return segments[s].head[r];
        --g;
      }
    }
    return segments[s].summaries[r * segments[s].tiles + g];
  };
  auto usum_at = [&](int64_t g) {  // its entropy sum
    int s = 0;
    while (s + 1 < count && g >= tiles_of(s)) g -= tiles_of(s++);
    if constexpr (kHeads) {
      if (segments[s].head != nullptr) {
        if (g == 0) return segments[s].head_usum[r];
        --g;
      }
    }
    return segments[s].usums[r * segments[s].tiles + g];
  };

  TileSummary held[kHeld];
  float held_usum[kEntropy ? kHeld : 1];
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    const int64_t g = tid + int64_t{kCombineCtaThreads} * k;
    held[k] = g < total ? tile_at(g) : TileSummary{fp::neg_inf(), 0.0f};
    if constexpr (kEntropy) held_usum[k] = g < total ? usum_at(g) : 0.0f;
  }
  float global_max = fp::neg_inf();
#pragma unroll
  for (int k = 0; k < kHeld; ++k) global_max = chain_max(global_max, held[k].max);
  for (int64_t g = kChunk + tid; g < total; g += kCombineCtaThreads) global_max = chain_max(global_max, tile_at(g).max);
  global_max = cta_row_max(global_max, warp_max);

  float sum = 0.0f, usum = 0.0f, comp = 0.0f;
  for (int64_t base = 0; base < total; base += kChunk) {
    const int n = static_cast<int>(total - base < kChunk ? total - base : kChunk);
    if (base > 0) __syncthreads();  // the chain thread is done with the previous chunk
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const int i = tid + kCombineCtaThreads * k;
      if (i < n) {
        const TileSummary ts = base == 0 ? held[k] : tile_at(base + i);
        const float factor = chain_factor_or_skip(ts, global_max);  // off the serial path
        pairs[i] = float2{ts.sum, factor};
        if constexpr (kEntropy)
          terms[i] = entropy_chain_term_or_skip(ts, base == 0 ? held_usum[k] : usum_at(base + i), global_max, factor);
      }
    }
    __syncthreads();
    if (tid == 0) {  // the serial path
      if constexpr (kEntropy)
        chain_fma_rounds_entropy<kRound>(sum, usum, comp, pairs, terms, n);
      else
        sum = chain_fma_rounds<kRound>(sum, pairs, n);
    }
  }
  if (tid == 0)
    finish_segmented_row(segments, count, r, row, targets, targets_i64, ignore_index, k_per_row, global_max, sum, usum,
                         comp, logp, lse, kEntropy ? entropy : nullptr);
}

// Probe: called at fixed points by one thread each, with a value the point waits for
// (bench_sm90_combine --trace: the phases per CTA); the library passes NoProbe, which compiles to
// nothing.
struct NoProbe {
  __device__ __forceinline__ void operator()(int, float = 0.0f) const {}
};
inline constexpr int kProbeMaxDone = 1;       // tid 0: the max pass is over
inline constexpr int kProbeChainChunk = 2;    // + c: the chain lane has stage c (c < 32)
inline constexpr int kProbeFactorChunk = 34;  // + c: factor thread 0 handed stage c over (c < 32)
inline constexpr int kProbeChainDone = 66;    // + c: the chain lane's fmas over stage c are done
inline constexpr int kProbeFactorWoke = 98;   // + c: factor thread 0 may write stage c
inline constexpr int kProbeChainEnd = 130;    // the chain lane's last fma is done

// kRows rows of one segment per CTA of kLanesThreads threads (the full-mode combine). A row's
// chain is serial, so the schedule runs many at once: lane l < kRows of warp 0 walks row l, so one
// fma instruction advances kRows chains (the other lanes leave: running copies of the chains made
// every shared load slower, 5.9 against 4.7 cycles a step alone, measured on an H200). Warps
// 1..4 own one tile column f of two shared stages ([kRows][kLanesChunk] each): per chunk they
// write {s_g, expc(m_g - M) or skip} of their tiles (the next chunk's loads in flight; the first
// chunk's issued before the max pass) and hand the stage to warp 0 through an mbarrier (full: the
// 128 factor threads arrive); warp 0 hands it back through a second one after its chains read it
// (empty: its kRows lanes arrive). An arrive releases the thread's shared-memory accesses before it
// and a completed wait acquires them, so both hand-overs are ordered for compute-sanitizer's
// racecheck too (named barriers with bar.arrive were not, for the write after read). The max pass
// reads the tile maxima with every thread. Rows past p.rows repeat the CTA's last row and write
// nothing. kEntropy: the factor threads also load u_g and stage the term of U (a third array beside
// the pairs, row stride kLanesChunk + 4 floats: 16-byte rows, conflict-free like the pairs), and
// each chain lane runs S, U and C (chain_fma_pairs_entropy).
template <int kRows, bool kEntropy = false, class Probe = NoProbe>
__device__ __forceinline__ void chain_rows_lanes(const CombineParams& p, const Probe& probe = Probe{}) {
  static_assert(kRows >= 1 && kRows <= 32 && 32 % kRows == 0, "kRows divides a warp");
  // Row stride kLanesChunk + 2 pairs (16-byte rows, 4 banks apart): the chain lanes' 16-byte reads
  // of one tile pair hit distinct banks.
  __shared__ alignas(16) float2 stage[2][kRows][kLanesChunk + 2];
  __shared__ alignas(16) float term_stage[kEntropy ? 2 : 1][kEntropy ? kRows : 1][kLanesChunk + 4];
  __shared__ float warp_max[kLanesThreads / 32][kRows];
  __shared__ float row_max[kRows];
  __shared__ alignas(8) uint64_t full_bar[2], empty_bar[2];
  static_assert(
      sizeof(stage) + sizeof(term_stage) + sizeof(warp_max) + sizeof(row_max) + sizeof(full_bar) + sizeof(empty_bar) <=
          48 * 1024,
      "static shared memory");
  if (p.status->code != kStatusOk) return;  // uniform: before any barrier

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      ptx::mbar_init(&full_bar[b], kLanesFactorThreads);
      ptx::mbar_init(&empty_bar[b], kRows);
    }
  }  // the max pass's __syncthreads orders the init before any use
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int64_t r0 = int64_t{blockIdx.x} * kRows;
  const int rows_here = static_cast<int>(p.rows - r0 < kRows ? p.rows - r0 : kRows);
  const int64_t n = p.tiles;
  const int chunks = static_cast<int>((n + kLanesChunk - 1) / kLanesChunk);

  // Factor threads: tile f of each stage, the first chunk's loads issued now.
  const int f = tid - 32;
  const float2* rows_tiles[kRows];
  const float* rows_usums[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row_offset = (r0 + (r < rows_here ? r : rows_here - 1)) * n;
    rows_tiles[r] = reinterpret_cast<const float2*>(p.summaries + row_offset);
    if constexpr (kEntropy) rows_usums[r] = p.usums + row_offset;
  }
  float2 next[kRows];
  float next_usum[kEntropy ? kRows : 1];
  auto load_stage = [&](int c) {
    const int64_t g = int64_t{c} * kLanesChunk + f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      next[r] = g < n ? rows_tiles[r][g] : float2{fp::neg_inf(), 0.0f};
      if constexpr (kEntropy) next_usum[r] = g < n ? rows_usums[r][g] : 0.0f;
    }
  };
  if (warp > 0) load_stage(0);

  // The max pass: 4 x kRows independent loads per step, all threads.
  {
    float m[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) m[r] = fp::neg_inf();
#pragma unroll 4
    for (int64_t i = tid; i < n; i += kLanesThreads) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) m[r] = chain_max(m[r], reinterpret_cast<const float*>(rows_tiles[r] + i)[0]);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) m[r] = chain_max(m[r], __shfl_xor_sync(0xFFFFFFFFu, m[r], off));
      if (lane == 0) warp_max[warp][r] = m[r];
    }
    __syncthreads();
    if (tid < kRows) {
      float mr = warp_max[0][tid];
#pragma unroll
      for (int w = 1; w < kLanesThreads / 32; ++w) mr = chain_max(mr, warp_max[w][tid]);
      row_max[tid] = mr;
    }
    __syncthreads();
  }
  if (tid == 0) probe(kProbeMaxDone);

  if (warp == 0) {              // the chains
    if (lane >= kRows) return;  // one lane per row: lanes reading other rows' words slow every shared load
    const int r = lane;
    float sum = 0.0f, usum = 0.0f, comp = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const int b = c & 1;
      ptx::mbar_wait(&full_bar[b], static_cast<uint32_t>(c >> 1) & 1u);  // use c >> 1 of stage b
      if (lane == 0 && c < 32) probe(kProbeChainChunk + c);
      const int64_t left = n - int64_t{c} * kLanesChunk;
      const int count = static_cast<int>(left < kLanesChunk ? left : kLanesChunk);
      if constexpr (kEntropy)
        chain_fma_pairs_entropy(sum, usum, comp, stage[b][r], term_stage[b][r], count);
      else
        sum = chain_fma_pairs(sum, stage[b][r], count);
      if (lane == 0 && c < 32) probe(kProbeChainDone + c, sum);
      if (c + 2 < chunks) ptx::mbar_arrive(&empty_bar[b]);  // stage b is free
    }
    if (lane == 0) probe(kProbeChainEnd, sum);
    if (lane >= rows_here) return;
    const int64_t rr = r0 + lane;
    if constexpr (kEntropy) p.entropy[p.row_begin + rr] = finalize_entropy(sum, usum, comp);
    const int k_per_row = p.targets_per_row;
    finish_row_targets(
        p.targets, p.targets_i64, p.ignore_index, k_per_row, p.row_begin + rr, row_max[lane], sum,
        [&](int k) { return p.target_logit[rr * k_per_row + k]; }, p.logp, p.lse);
    return;
  }

  float global_max[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) global_max[r] = row_max[r];
  for (int c = 0; c < chunks; ++c) {
    const int b = c & 1;
    float2 cur[kRows];
    float cur_usum[kEntropy ? kRows : 1];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      cur[r] = next[r];
      if constexpr (kEntropy) cur_usum[r] = next_usum[r];
    }
    if (c + 1 < chunks) load_stage(c + 1);  // in flight while this stage is computed and handed over
    if (c >= 2) ptx::mbar_wait(&empty_bar[b], static_cast<uint32_t>((c >> 1) - 1) & 1u);  // read by the chains
    if (f == 0 && c < 32) probe(kProbeFactorWoke + c);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const TileSummary tile{cur[r].x, cur[r].y};
      const float factor = chain_factor_or_skip(tile, global_max[r]);
      stage[b][r][f] = float2{tile.sum, factor};
      if constexpr (kEntropy)
        term_stage[b][r][f] = entropy_chain_term_or_skip(tile, cur_usum[r], global_max[r], factor);
    }
    ptx::mbar_arrive(&full_bar[b]);
    if (f == 0 && c < 32) probe(kProbeFactorChunk + c);
  }
}

}  // namespace detlogp::sm90

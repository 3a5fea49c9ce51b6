// An experiment, not in the library: the SM90 persistent cooperative-overlap schedule (measured
// slower than the ping-pong: docs/history/sm90-coop-overlap.md): both consumer warpgroups work on one 128-row CTA tile
// (64 rows each) and read the same weight stage, which halves the weight bytes TMA writes into shared memory per FLOP
// against the 64-row ping-pong tile; the epilogue stays hidden because each warpgroup keeps two
// accumulator sets and runs the previous tile's epilogue in slices (epilogue_tile_summary_slice)
// between the asynchronous wgmma groups of the next tile. Optional 2-CTA clusters along M share the
// weight stage further (multicast), as the ping-pong's ClusterM.
// Bit-relevant facts are those of every schedule: BLOCK_K = 64, one fp32 accumulator per output for
// the whole K walk, k16 steps ascending, no split-K; the epilogue slices are the ping-pong
// epilogue's operations in the same order.
#pragma once

#include <cstdint>

#include "cuda/validate.cuh"
#include "detlogp/config.hpp"
#include "sm90/device/configs.cuh"
#include "sm90/device/epilogue_tile_summary.cuh"
#include "sm90/device/mainloop.cuh"

namespace detlogp::sm90 {

// The per-slice epilogue the overlap schedule spreads between wgmma groups (the library's
// epilogue, epilogue_tile_summary.cuh, runs a whole fragment at once): the same operations in the same
// order, so the same bits.
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

// The tile max from each thread's max `m` over the quad (exact; -0 normalized), x = y - m, and
// `normal` cleared unless every x lies in expc_normal's domain.
__device__ __forceinline__ float quad_max_and_offsets(const float (&y)[16], float m, float (&x)[16], bool& normal) {
  m = fp::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
  m = fp::max_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
  m = normalize_zero(m);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    x[i] = fp::sub(y[i], m);
    normal = normal && x[i] >= kExpcNormalMin;
  }
  return m;
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
  float level[8];
  float x[16];
  bool normal = real == kVocabTile;
  m = quad_max_and_offsets(y, m, x, normal);
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

// BlockN columns per CTA tile, 128 rows (two consumer warpgroups of 64), Stages ring stages.
// The member names follow PingpongConfig so pingpong_produce and RingSmem serve this schedule.
template <int BlockN, int Stages, int ClusterM = 1>
struct CoopOverlapConfig {
  static constexpr int kWgM = 64;
  static constexpr int kTileRows = 128;  // hidden rows per CTA tile (the TMA box)
  static constexpr int kBlockN = BlockN;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = Stages;
  static constexpr int kFragments = 1;
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  static constexpr int kAccRegs = BlockN / 2;
  static constexpr uint32_t kABytes = uint32_t(kTileRows) * kBlockK * 2;
  static constexpr uint32_t kAGroupStride = 1024;
  static constexpr uint32_t kBBytes = uint32_t(BlockN) * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr int kClusterM = ClusterM;
  static constexpr int kBSliceRows = BlockN / ClusterM;
  static constexpr uint32_t kBSliceBytes = uint32_t(kBSliceRows) * kBlockK * 2;
  static constexpr int kBarriers = 2 * Stages;
  static constexpr int kSmemBytes = int(Stages * kStageBytes) + kBarriers * 8 + 1024;
  // setmaxnreg moves registers inside the CTA's allocation at entry (kEntryRegs per thread, what
  // __launch_bounds__(384, 1) gives), not the whole 65536-entry file: a consumer's .inc waits until
  // the producer's .dec has freed enough, so asking for more than the entry allocation hangs.
  static constexpr int kEntryRegs = 168;           // 65536 / 384, rounded down to a multiple of 8
  static constexpr int kProducerRegs = 24;         // the TMA issue loop of one thread
  static constexpr int kConsumerRegs = 240;        // two accumulator sets + one epilogue slice
  static constexpr int kSlices = 2 * BlockN / 64;  // epilogue slices of one tile: vocab tiles x row halves

  static_assert(BlockN % kVocabTile == 0 && BlockN <= 256 && BlockN % 64 == 0, "whole vocab tiles, wgmma n <= 256");
  static_assert(2 * kAccRegs <= 192, "two accumulator sets must leave registers for the epilogue");
  static_assert(kBlockK * 2 == 128, "BLOCK_K must fill exactly one 128-byte swizzle row");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "stage tiles keep 1024-byte swizzle alignment");
  static_assert(ClusterM == 1 || ClusterM == 2, "one CTA or a 2-CTA cluster along M");
  static_assert(BlockN % ClusterM == 0 && kBSliceBytes % 1024 == 0, "whole swizzle atoms per weight slice");
  static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory limit of SM90");
  static_assert(kEntryRegs * kThreads <= 65536, "one CTA per SM");
  static_assert(kProducerRegs * 128 + 2 * kConsumerRegs * 128 <= kEntryRegs * kThreads,
                "setmaxnreg budget: the entry allocation, redistributed");
};

// The previous tile of a consumer warpgroup whose epilogue is still due (cooperative overlap):
// only its work unit is carried across the K walk (registers are scarce there); the slices derive
// the rows and columns from it.
struct PendingTile {
  int row0_unit;  // work unit of the pending tile, -1 when none
  __device__ bool valid() const { return row0_unit >= 0; }
};

struct TileSpan {
  int64_t row0, row_limit, col0;
};

template <class Cfg>
__device__ __forceinline__ TileSpan overlap_span(const TileWalk& walk, int unit, const FusedParams& p, int c) {
  int m_tile, n_tile;
  walk.coords(unit, m_tile, n_tile);
  TileSpan t;
  t.row0 = p.row_begin + int64_t{m_tile} * Cfg::kTileRows + 64 * c;
  t.row_limit = min(p.row_end, t.row0 + 64);
  t.col0 = int64_t{n_tile} * Cfg::kBlockN;
  return t;
}

// Epilogue slice `slice` (vocab tile slice / 2, row half slice % 2) of a pending tile. The slice
// index is a runtime value, so the kernel holds one copy of the slice code per accumulator set.
template <class Cfg>
__device__ __forceinline__ void overlap_slice(const float (&acc)[Cfg::kAccRegs], const PendingTile& t,
                                              const TileWalk& walk, const FusedParams& p, bool vec2, int c, int slice) {
  if (t.valid()) {
    float v[16];
    select_slice_values<Cfg::kBlockN>(acc, slice, v);
    const TileSpan span = overlap_span<Cfg>(walk, t.row0_unit, p, c);
    epilogue_tile_summary_slice(v, slice / 2, slice % 2, p, span.row0, span.row_limit, span.col0, vec2);
  }
}

// The ring position and operands of one consumer warpgroup's mainloop.
// One base pointer: the ring's parts sit at constant offsets from it (RingSmem's layout).
struct OverlapRing {
  uint8_t* base;
  int c;  // consumer warpgroup: A rows 64c..64c+63 of each stage
  template <class Cfg>
  __device__ const uint8_t* a() const {
    return base;
  }
  template <class Cfg>
  __device__ const uint8_t* b() const {
    return base + Cfg::kStages * Cfg::kABytes;
  }
  template <class Cfg>
  __device__ uint64_t* full() const {
    return reinterpret_cast<uint64_t*>(base + Cfg::kStages * (Cfg::kABytes + Cfg::kBBytes));
  }
  template <class Cfg>
  __device__ uint64_t* empty() const {
    return full<Cfg>() + Cfg::kStages;
  }
};

// Issues K block kb's wgmma group into acc (stage `it`). kFirst = 0 or 1 fixes `first` at compile
// time: one wgmma group per K block (a runtime `first` splits the group at the branch).
template <class Cfg, int kFirst = -1>
__device__ __forceinline__ void overlap_issue(float (&acc)[Cfg::kAccRegs], const OverlapRing& r, uint32_t it,
                                              bool first) {
  if constexpr (kFirst >= 0) first = kFirst == 1;
  using Mma = ptx::WgmmaBf16<Cfg::kBlockN>;
  static_assert(Mma::kAccRegs == Cfg::kAccRegs, "accumulator fragment size");
  const uint32_t s = it % Cfg::kStages;
  ptx::mbar_wait(&r.full<Cfg>()[s], (it / Cfg::kStages) & 1u);
  const uint64_t desc_a = ptx::smem_desc_k_major_sw128(r.a<Cfg>() + s * Cfg::kABytes + r.c * (64 * 128));
  const uint64_t desc_b = ptx::smem_desc_k_major_sw128(r.b<Cfg>() + s * Cfg::kBBytes);
  ptx::wgmma_fence();
#pragma unroll
  for (int k = 0; k < Cfg::kBlockK / 16; ++k) {
    if (k == 0 && first)
      Mma::mma_overwrite(acc, desc_a, desc_b);  // the tile's first k16 step: no zeroed registers
    else
      Mma::mma(acc, desc_a + 2 * k, desc_b + 2 * k);
  }
  ptx::wgmma_commit();
}

// Waits for the previous K block's group and releases its stage (kb > 0).
template <class Cfg>
__device__ __forceinline__ void overlap_retire(float (&acc)[Cfg::kAccRegs], const OverlapRing& r, uint32_t it, int kb) {
  ptx::wgmma_wait<1>();
  if (kb > 0) release_stage<Cfg>(r.empty<Cfg>(), (it - 1) % Cfg::kStages, threadIdx.x % 32);
}

// One tile's mainloop (k_blocks K blocks, 0 to only flush) into `acc` with the pending tile's
// epilogue slices (from `prev`) spread over its K walk: slice s runs between the issue and the
// retire of the first K block of segment s (segments `spacing` K blocks long); on return `pending`
// is this tile. Runtime loops keep the code small: a static unroll of the slices (one copy each)
// made the kernel ~600 KB of SASS and its warps stalled on instruction fetch (measured under ncu).
template <class Cfg>
__device__ __forceinline__ void coop_overlap_tile(float (&acc)[Cfg::kAccRegs], float (&prev)[Cfg::kAccRegs],
                                                  PendingTile& pending, int unit, const TileWalk& walk,
                                                  const FusedParams& p, bool vec2, const OverlapRing& r, uint32_t& it,
                                                  int k_blocks) {
  // Nothing is in flight here (the previous tile ended with wait<0>); saying so again, with the
  // pending accumulators fenced, keeps ptxas from inserting a wait<0> after this tile's first
  // issue (C7517: it did not carry the retirement of `prev` around the loop).
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(prev[i]);
  const int spacing = max(1, k_blocks / Cfg::kSlices);
  int kb = 0;
#pragma unroll 1
  for (int s = 0; s < Cfg::kSlices; ++s) {
    const bool issue = kb < k_blocks;
    if (issue) overlap_issue<Cfg>(acc, r, it, kb == 0);
    overlap_slice<Cfg>(prev, pending, walk, p, vec2, r.c, s);
    if (issue) {
      overlap_retire<Cfg>(acc, r, it, kb);
      ++kb;
      ++it;
    }
    const int seg_end = min(k_blocks, (s + 1) * spacing);
#pragma unroll 1
    for (; kb < seg_end; ++kb, ++it) {
      overlap_issue<Cfg>(acc, r, it, false);
      overlap_retire<Cfg>(acc, r, it, kb);
    }
  }
#pragma unroll 1
  for (; kb < k_blocks; ++kb, ++it) {
    overlap_issue<Cfg>(acc, r, it, false);
    overlap_retire<Cfg>(acc, r, it, kb);
  }
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[i]);
  if (k_blocks > 0) release_stage<Cfg>(r.empty<Cfg>(), (it - 1) % Cfg::kStages, threadIdx.x % 32);
  pending.row0_unit = unit;
}

// Persistent cooperative overlap: warpgroup 0 produces (pingpong_produce over 128-row tiles), both
// consumer warpgroups consume every stage (64 rows each), alternating two accumulator sets.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fused_linear_logp_sm90_coop_overlap_kernel(const __grid_constant__ CUtensorMap map_hidden,
                                               const __grid_constant__ CUtensorMap map_weight, const FusedParams p,
                                               const int logits_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.validate_in_kernel == 0 && p.status->code != kStatusOk) return;
  asm volatile("griddepcontrol.launch_dependents;");

  extern __shared__ uint8_t smem_raw[];
  const auto ring = RingSmem<Cfg>::carve(smem_raw);
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    ring.init(&map_hidden, &map_weight, 8 * Cfg::kClusterM);  // every consuming warp of every cluster CTA
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if constexpr (Cfg::kClusterM > 1) ptx::cluster_sync();

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    produce_persistent<Cfg>(p, &map_hidden, &map_weight, ring);
  } else {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int c = warpgroup - 1;
    const bool vec2 = logits_vec2 != 0;
    const TileWalk walk = make_tile_walk<Cfg>(p.m_tiles, p.n_tiles, p.group_m);
    const OverlapRing r{ring.a, c};
    float acc0[Cfg::kAccRegs], acc1[Cfg::kAccRegs];
    PendingTile pending{-1};
    uint32_t it = 0;
    // Two call sites in all: a tile with no K blocks left only flushes the pending tile's epilogue.
    int unit = walk.first;
    bool more = unit < walk.count;
#pragma unroll 1
    while (true) {
      coop_overlap_tile<Cfg>(acc0, acc1, pending, unit, walk, p, vec2, r, it, more ? p.k_blocks : 0);
      if (!more) break;
      unit += walk.stride;
      more = unit < walk.count;
      coop_overlap_tile<Cfg>(acc1, acc0, pending, unit, walk, p, vec2, r, it, more ? p.k_blocks : 0);
      if (!more) break;
      unit += walk.stride;
      more = unit < walk.count;
    }
  }
  if constexpr (Cfg::kClusterM > 1) ptx::cluster_sync();
#endif
}

}  // namespace detlogp::sm90

// The fused forward kernels of the SM90 backend: TMA producer, wgmma mainloop, tile-summary
// epilogue (device/). Two schedules, instantiated by the launch table (launch_table.cu) for each
// of its tile configurations:
//   ping-pong:    the two consumer warpgroups take alternate tiles, so one's epilogue overlaps
//                 the other's mainloop (decode, prefill and the serving entry);
//   cooperative:  both consumer warpgroups take 64 rows of every stage of one 128-row tile, then
//                 run their epilogue, not overlapped (the trainer entry at large N), so the fp32
//                 epilogue pays no issue tax on concurrent tensor-core work.
// kPlain: the launch has neither bias nor logits output. kEntropy: the epilogue also writes the
// tiles' entropy sums (p.usums); the launch table instantiates both forms. kMulti: [N, K] targets
// (K = p.targets_per_row > 1), each tile's epilogue picking the rows' K target logits
// (pick_target_logits); without it the single-target code, unchanged. kCandidates: the epilogue
// also writes each lane group's top-k candidates (FusedParams::cand_*; the top-k output's
// candidate path, neither entropy nor [N, K] targets).
#pragma once

#include <cstdint>

#include "sm90/device/epilogue_tile_summary.cuh"
#include "sm90/device/mainloop.cuh"
#include "sm90/params.hpp"

namespace detlogp::sm90 {

// The start of every fused kernel: on invalid input it writes nothing (the status is uniform over
// the grid; in-kernel validation writes only workspace before the verdict, so it does not wait
// for one), and it lets the combine, a programmatic dependent, launch now and wait for the grid.
__device__ __forceinline__ bool fused_kernel_starts(const FusedParams& p) {
  if (p.validate_in_kernel == 0 && p.status->code != kStatusOk) return false;
  ptx::launch_dependents();
  return true;
}

// Persistent ping-pong: warpgroup 0 produces, warpgroups 1 and 2 take alternate tiles of this
// CTA (local tile j = 0, 1, 2, ... is work unit walk.first + j * walk.stride; see TileWalk).
template <class Cfg, bool kPlain, bool kEntropy, bool kMulti = false, bool kCandidates = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fused_pingpong_kernel(const __grid_constant__ CUtensorMap map_hidden,
                          const __grid_constant__ CUtensorMap map_weight, const FusedParams p, const int logits_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (!fused_kernel_starts(p)) return;
  extern __shared__ uint8_t smem_raw[];
  // Each consuming warp of every cluster CTA releases each stage; two more barriers, one phase per
  // finished mainloop of each consumer warpgroup.
  const auto ring = persistent_prologue<Cfg>(smem_raw, &map_hidden, &map_weight, 4 * Cfg::kClusterM, 2);
  uint64_t* mainloop_done = ring.empty + Cfg::kStages;
  warp_specialize<Cfg>([&] { produce_persistent<Cfg, kMulti>(p, &map_hidden, &map_weight, ring); },
                       [&](int c) {
                         pingpong_walk<Cfg>(
                             p.m_tiles, p.n_tiles, p.group_m, c, mainloop_done, [&](int j, int m_tile, int n_tile) {
                               const int64_t row0 = p.row_begin + int64_t{m_tile} * Cfg::kTileRows;
                               const int64_t row_limit = min(p.row_end, row0 + Cfg::kTileRows);
                               const int64_t col0 = int64_t{n_tile} * Cfg::kBlockN;
                               // The rows' temperature and target load while the K walk runs.
                               FragmentRows rows[Cfg::kFragments];
#pragma unroll
                               for (int f = 0; f < Cfg::kFragments; ++f) {
                                 rows[f] = load_fragment_rows<kMulti>(p, row0 + 64 * f, row_limit);
                                 if constexpr (kMulti) prefetch_fragment_targets(p, row0 + 64 * f, row_limit);
                               }
                               float acc[Cfg::kFragments][Cfg::kAccRegs];
                               const uint32_t it0 = static_cast<uint32_t>(j) * p.k_blocks;
                               pingpong_consume_issue<Cfg>(acc, ring.a, ring.b, ring.full, ring.empty, p.k_blocks, it0);
                               // Hand the tensor cores over while this tile's last wgmma still runs.
                               if (threadIdx.x % 32 == 0) ptx::mbar_arrive(&mainloop_done[c]);
                               pingpong_consume_tail<Cfg>(acc, ring.empty, p.k_blocks, it0);
#pragma unroll
                               for (int f = 0; f < Cfg::kFragments; ++f)
                                 epilogue_tile_summaries<Cfg::kBlockN, kPlain, false, kEntropy, kMulti, kCandidates>(
                                     acc[f], p, rows[f], row0 + 64 * f, row_limit, col0, logits_vec2 != 0);
                             });
                       });
#endif
}

// Persistent cooperative: warpgroup 0 produces 128-row tiles, warpgroups 1 and 2 each run the
// mainloop of 64 of its rows on every stage (a stage is free once both have released it), then
// their epilogue; no overlap of epilogue and tensor-core work within the CTA.
template <class Cfg, bool kPlain, bool kEntropy, bool kMulti = false, bool kCandidates = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fused_cooperative_kernel(const __grid_constant__ CUtensorMap map_hidden,
                             const __grid_constant__ CUtensorMap map_weight, const FusedParams p,
                             const int logits_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (!fused_kernel_starts(p)) return;
  extern __shared__ uint8_t smem_raw[];
  // Every consuming warp of both warpgroups, of every cluster CTA, releases each stage.
  const auto ring = persistent_prologue<Cfg>(smem_raw, &map_hidden, &map_weight, 8 * Cfg::kClusterM);
  warp_specialize<Cfg>([&] { produce_persistent<Cfg, kMulti>(p, &map_hidden, &map_weight, ring); },
                       [&](int c) {
                         const TileWalk walk = make_tile_walk<Cfg>(p.m_tiles, p.n_tiles, p.group_m);
                         // A tile's coordinates and its rows' temperature and target are taken one tile ahead, while
                         // the previous tile's last wgmma group runs: the walk's integer divisions issue where the
                         // warps would wait anyway, and the loads' latency hides behind that tile's epilogue.
                         auto tile_rows = [&](int unit, int& m_tile, int& n_tile, FragmentRows& rows) {
                           walk.coords(unit, m_tile, n_tile);
                           const int64_t row0 = p.row_begin + int64_t{m_tile} * Cfg::kTileRows;
                           rows = load_fragment_rows<kMulti>(p, row0 + 64 * c, min(p.row_end, row0 + Cfg::kTileRows));
                           if constexpr (kMulti)
                             prefetch_fragment_targets(p, row0 + 64 * c, min(p.row_end, row0 + Cfg::kTileRows));
                         };
                         int m_tile = 0, n_tile = 0;
                         FragmentRows rows{};
                         if (walk.first < walk.count) tile_rows(walk.first, m_tile, n_tile, rows);
                         uint32_t it0 = 0;
                         for (int unit = walk.first; unit < walk.count; unit += walk.stride) {
                           const int64_t row0 = p.row_begin + int64_t{m_tile} * Cfg::kTileRows;
                           const int64_t row_limit = min(p.row_end, row0 + Cfg::kTileRows);
                           const int64_t col0 = int64_t{n_tile} * Cfg::kBlockN;
                           const int64_t frag0 = row0 + 64 * c;  // this warpgroup's first row
                           float acc[Cfg::kAccRegs];
                           int next_m = 0, next_n = 0;
                           FragmentRows next_rows{};
                           WideRows wide_rows;
                           // While the last wgmma group runs: this fragment's epilogue rows, the next tile's rows.
                           auto before_wait = [&] {
                             wide_rows = prepare_wide_rows<Cfg::kBlockN, kMulti>(p, rows, frag0, row_limit, col0);
                             if (unit + walk.stride < walk.count)
                               tile_rows(unit + walk.stride, next_m, next_n, next_rows);
                           };
                           const uint8_t* smem_a =
                               ring.a + c * Cfg::kAHalfBytes;  // this warpgroup's 64 rows; B is shared
                           coop_consume<Cfg>(acc, smem_a, ring.b, ring.full, ring.empty, p.k_blocks, it0, before_wait);
                           it0 += static_cast<uint32_t>(p.k_blocks);
                           const bool vec2 = logits_vec2 != 0;
                           epilogue_tile_summaries<Cfg::kBlockN, kPlain, true, kEntropy, kMulti, kCandidates>(
                               acc, p, rows, frag0, row_limit, col0, vec2, &wide_rows);
                           m_tile = next_m;
                           n_tile = next_n;
                           rows = next_rows;
                         }
                       });
#endif
}

}  // namespace detlogp::sm90

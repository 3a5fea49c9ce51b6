// The consumer side of the SM90 mainloops: wgmma m64nBNk16 (bf16 -> fp32) over the ring's stages.
// Ping-pong: each consumer warpgroup runs whole tiles, the two alternating, so one runs its K walk
// while the other runs the (SIMT-heavy) epilogue of its previous tile; an ordering barrier keeps the
// mainloops in tile order, which also keeps every ring wait within one phase lap. Cooperative: both
// warpgroups take 64 rows of every stage of one 128-row tile, then both run their epilogue.
// Bit-relevant: every k16 step adds into the same fp32 accumulator in ascending K, whatever the
// schedule, BLOCK_N or stage depth; no split-K.
#pragma once

#include <cstdint>

#include "sm90/device/pipeline.cuh"
#include "sm90/device/wgmma_bf16.cuh"

namespace detlogp::sm90 {

// Mainloop of one tile for a consumer warpgroup; `it0` = ring index of the tile's first K block.
// Returns with the last K block's wgmma still in flight: the caller hands the tensor cores to the
// other warpgroup first, then calls pingpong_consume_tail.
template <class Cfg>
__device__ __forceinline__ void pingpong_consume_issue(float (&acc)[Cfg::kFragments][Cfg::kAccRegs],
                                                       const uint8_t* smem_a, const uint8_t* smem_b, uint64_t* full,
                                                       uint64_t* empty, int k_blocks, uint32_t it0) {
  using Mma = ptx::WgmmaBf16<Cfg::kBlockN>;
  static_assert(Mma::kAccRegs == Cfg::kAccRegs, "accumulator fragment size");
#pragma unroll
  for (int f = 0; f < Cfg::kFragments; ++f)
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) acc[f][i] = 0.0f;
  const int lane = threadIdx.x % 32;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const uint32_t it = it0 + static_cast<uint32_t>(kb);
    const uint32_t s = it % Cfg::kStages;
    ptx::mbar_wait(&full[s], (it / Cfg::kStages) & 1u);
    const uint64_t desc_b = ptx::smem_desc_k_major_sw128(smem_b + s * Cfg::kBBytes);
#pragma unroll
    for (int f = 0; f < Cfg::kFragments; ++f)
#pragma unroll
      for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[f][i]);
    ptx::wgmma_fence();
    // k16 steps ascending; each fragment's accumulator sees them in K order.
#pragma unroll
    for (int k = 0; k < Cfg::kBlockK / 16; ++k)
#pragma unroll
      for (int f = 0; f < Cfg::kFragments; ++f) {
        const uint64_t desc_a =
            ptx::smem_desc_k_major_sw128(smem_a + s * Cfg::kABytes + f * (64 * 128), Cfg::kAGroupStride);
        Mma::mma(acc[f], desc_a + 2 * k, desc_b + 2 * k);
      }
    ptx::wgmma_commit();
    // Keep this K block's wgmma in flight; the previous one has completed, so its stage is free.
    ptx::wgmma_wait<1>();
#pragma unroll
    for (int f = 0; f < Cfg::kFragments; ++f)
#pragma unroll
      for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[f][i]);
    if (kb > 0) release_stage<Cfg>(empty, (it - 1) % Cfg::kStages, lane);
  }
}

// The ping-pong walk of consumer warpgroup c (0 or 1) over its local tiles j = c, c + 2, ... (work
// units walk.first + j * walk.stride, see TileWalk): each tile starts once the other warpgroup's
// mainloop of tile j - 1 has handed the tensor cores over (one phase of mainloop_done[1 - c] per
// mainloop), so the mainloops run in local tile order. tile(j, m_tile, n_tile) runs the tile and
// must arrive on mainloop_done[c] (lane 0 of each warp) once its mainloop is issued.
template <class Cfg, class Tile>
__device__ __forceinline__ void pingpong_walk(int m_tiles, int n_tiles, int group_m, int c, uint64_t* mainloop_done,
                                              Tile&& tile) {
  const TileWalk walk = make_tile_walk<Cfg>(m_tiles, n_tiles, group_m);
  uint32_t n = 0;  // tiles this warpgroup has taken so far
  for (int j = c, unit = walk.first + c * walk.stride; unit < walk.count; j += 2, unit += 2 * walk.stride, ++n) {
    if (j >= 1) {
      const uint32_t completion = c == 1 ? n : n - 1;
      ptx::mbar_wait(&mainloop_done[1 - c], completion & 1u);
    }
    int m_tile, n_tile;
    walk.coords(unit, m_tile, n_tile);
    tile(j, m_tile, n_tile);
  }
}

// Completes a tile's mainloop: waits for its last wgmma and releases the last stage.
template <class Cfg>
__device__ __forceinline__ void pingpong_consume_tail(float (&acc)[Cfg::kFragments][Cfg::kAccRegs], uint64_t* empty,
                                                      int k_blocks, uint32_t it0) {
  const int lane = threadIdx.x % 32;
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int f = 0; f < Cfg::kFragments; ++f)
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[f][i]);
  if (k_blocks > 0) release_stage<Cfg>(empty, (it0 + k_blocks - 1) % Cfg::kStages, lane);
}

// A whole tile's mainloop, accumulators complete on return.
template <class Cfg>
__device__ __forceinline__ void pingpong_consume(float (&acc)[Cfg::kFragments][Cfg::kAccRegs], const uint8_t* smem_a,
                                                 const uint8_t* smem_b, uint64_t* full, uint64_t* empty, int k_blocks,
                                                 uint32_t it0) {
  pingpong_consume_issue<Cfg>(acc, smem_a, smem_b, full, empty, k_blocks, it0);
  pingpong_consume_tail<Cfg>(acc, empty, k_blocks, it0);
}

// One K block of a cooperative warpgroup's tile (see coop_consume); kFirst: the tile's first block,
// whose first k16 step overwrites the accumulators. A separate instantiation, not a runtime test:
// ptxas serializes every wgmma of the kernel (C7520) when the overwrite sits on a divergent path.
template <class Cfg, bool kFirst>
__device__ __forceinline__ void coop_k_block(float (&acc)[Cfg::kAccRegs], const uint8_t* smem_a, const uint8_t* smem_b,
                                             uint64_t* full, uint64_t* empty, uint32_t it, int lane) {
  using Mma = ptx::WgmmaBf16<Cfg::kBlockN>;
  const uint32_t s = it % Cfg::kStages;
  ptx::mbar_wait(&full[s], (it / Cfg::kStages) & 1u);
  const uint64_t desc_a = ptx::smem_desc_k_major_sw128(smem_a + s * Cfg::kABytes, Cfg::kAGroupStride);
  const uint64_t desc_b = ptx::smem_desc_k_major_sw128(smem_b + s * Cfg::kBBytes);
  ptx::wgmma_fence();
#pragma unroll
  for (int k = 0; k < Cfg::kBlockK / 16; ++k) {
    if (kFirst && k == 0)
      Mma::mma_overwrite(acc, desc_a, desc_b);
    else
      Mma::mma(acc, desc_a + 2 * k, desc_b + 2 * k);
  }
  ptx::wgmma_commit();
  ptx::wgmma_wait<1>();
  if (!kFirst) release_stage<Cfg>(empty, (it - 1) % Cfg::kStages, lane);
}

// A whole tile's mainloop for one warpgroup of a cooperative CTA (kFragments == 1, `smem_a` = its
// 64-row half of stage 0; k_blocks >= 1, as D >= 1 is checked on the host): the first k16 step
// overwrites the accumulators (no zeroing pass), the operands are fenced once after the last wait
// instead of around every K block, and each K block's stage is released once the next block's
// wgmma group is in flight. The same wgmma sequence as pingpong_consume, so the same bits;
// bench/experiments/bench_sm90_mainloop measures this form of the K walk at 0.92-0.93x the cuBLAS GEMM (D = 4096).
// before_wait runs once the last wgmma group is issued, before the wait for it: the warps would
// otherwise sit idle there for about a group's duration (~1.4 % of the consumers' samples
// under ncu). Work placed there must not touch acc and should not branch divergently.
template <class Cfg, class BeforeWait>
__device__ __forceinline__ void coop_consume(float (&acc)[Cfg::kAccRegs], const uint8_t* smem_a, const uint8_t* smem_b,
                                             uint64_t* full, uint64_t* empty, int k_blocks, uint32_t it0,
                                             BeforeWait&& before_wait) {
  static_assert(ptx::WgmmaBf16<Cfg::kBlockN>::kAccRegs == Cfg::kAccRegs && Cfg::kFragments == 1,
                "one accumulator fragment per warpgroup");
  const int lane = threadIdx.x % 32;
  coop_k_block<Cfg, true>(acc, smem_a, smem_b, full, empty, it0, lane);
  for (int kb = 1; kb < k_blocks; ++kb)
    coop_k_block<Cfg, false>(acc, smem_a, smem_b, full, empty, it0 + static_cast<uint32_t>(kb), lane);
  before_wait();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[i]);
  release_stage<Cfg>(empty, (it0 + k_blocks - 1) % Cfg::kStages, lane);
}

}  // namespace detlogp::sm90

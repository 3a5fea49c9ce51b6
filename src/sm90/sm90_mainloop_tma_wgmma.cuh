// SM90 mainloop: a producer thread streams K-major hidden/weight tiles with TMA into a
// multi-stage mbarrier ring; consumer warpgroups run wgmma m64nBNk16 (bf16 -> fp32) over them.
// Bit-relevant facts pinned here: BLOCK_K = 64 for every configuration, each consumer keeps one
// fp32 accumulator per output for the whole K walk, k16 steps issued in ascending K order, no
// split-K. Stages, BLOCK_M, BLOCK_N and warp counts are free axes.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "sm90/ptx.cuh"
#include "sm90/ptx_wgmma_bf16.cuh"

namespace detlogp::sm90 {

template <int BlockM, int BlockN, int Stages, int MinCtasPerSm>
struct FusedConfig {
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kBlockK = 64;  // one 128-byte swizzle row of bf16; the same in every bucket
  static constexpr int kStages = Stages;
  static constexpr int kMinCtasPerSm = MinCtasPerSm;
  static constexpr int kConsumerWarpgroups = BlockM / 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kAccRegs = BlockN / 2;
  static constexpr int kTilesPerBlockN = BlockN / kVocabTile;
  static constexpr uint32_t kABytes = uint32_t(BlockM) * kBlockK * 2;
  static constexpr uint32_t kBBytes = uint32_t(BlockN) * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  // +1024: the dynamic buffer is re-aligned to the 1024-byte swizzle atom inside the kernel.
  static constexpr int kSmemBytes = int(Stages * kStageBytes) + 2 * Stages * 8 + 1024;
  // Register split (setmaxnreg): the producer warpgroup gives registers to the consumers.
  static constexpr int kEntryRegs = (65536 / (kThreads * MinCtasPerSm)) / 8 * 8;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegsRaw = kEntryRegs + (kEntryRegs - kProducerRegs) / kConsumerWarpgroups;
  static constexpr int kConsumerRegs = (kConsumerRegsRaw > 256 ? 256 : kConsumerRegsRaw) / 8 * 8;

  static_assert(BlockM == 64 || BlockM == 128, "one or two consumer warpgroups of m64 each");
  static_assert(BlockN % kVocabTile == 0, "a CTA's columns must be whole 64-lane vocab tiles (contract tree)");
  static_assert(BlockN == 64 || BlockN == 128 || BlockN == 256, "wgmma n and TMA box limit (<= 256 rows)");
  static_assert(kBlockK * 2 == 128, "BLOCK_K must fill exactly one 128-byte swizzle row");
  static_assert(kBlockK % kKSlab == 0, "BLOCK_K is a whole number of contract K slabs");
  static_assert(kKSlab % 16 == 0, "K slab is a whole number of wgmma k16 steps");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "stage tiles keep 1024-byte swizzle alignment");
  static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory limit of SM90");
  static_assert(kConsumerRegs >= kEntryRegs && kConsumerRegs >= 128, "consumer register budget");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <= kEntryRegs * kThreads,
                "setmaxnreg must not ask for more registers than the CTA holds");
};

// Producer: one thread walks K ascending, filling stage kb % Stages once consumers freed it.
template <class Cfg>
__device__ __forceinline__ void produce_tiles(const CUtensorMap* map_hidden, const CUtensorMap* map_weight,
                                              uint8_t* smem_a, uint8_t* smem_b, uint64_t* full, uint64_t* empty,
                                              int k_blocks, int32_t row0, int32_t col0) {
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int s = kb % Cfg::kStages;
    const uint32_t round = static_cast<uint32_t>(kb / Cfg::kStages);
    ptx::mbar_wait(&empty[s], (round & 1u) ^ 1u);  // first round passes on a fresh barrier
    ptx::mbar_arrive_expect_tx(&full[s], Cfg::kStageBytes);
    ptx::tma_load_2d(smem_a + s * Cfg::kABytes, map_hidden, &full[s], kb * Cfg::kBlockK, row0);
    ptx::tma_load_2d(smem_b + s * Cfg::kBBytes, map_weight, &full[s], kb * Cfg::kBlockK, col0);
  }
}

// Consumer warpgroup `cw`: acc[BN/2] += A[64 rows of cw] * B^T over the whole K walk.
template <class Cfg>
__device__ __forceinline__ void consume_tiles(float (&acc)[Cfg::kAccRegs], const uint8_t* smem_a, const uint8_t* smem_b,
                                              uint64_t* full, uint64_t* empty, int k_blocks, int cw) {
  using Mma = ptx::WgmmaBf16<Cfg::kBlockN>;
  static_assert(Mma::kAccRegs == Cfg::kAccRegs, "accumulator fragment size");
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.0f;
  const int lane = threadIdx.x % 32;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int s = kb % Cfg::kStages;
    const uint32_t round = static_cast<uint32_t>(kb / Cfg::kStages);
    ptx::mbar_wait(&full[s], round & 1u);
    const uint64_t desc_a = ptx::smem_desc_k_major_sw128(smem_a + s * Cfg::kABytes + cw * (64 * 128));
    const uint64_t desc_b = ptx::smem_desc_k_major_sw128(smem_b + s * Cfg::kBBytes);
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[i]);
    ptx::wgmma_fence();
    // Four k16 steps, ascending; +2 in the descriptor = +32 bytes = +16 bf16 along K.
#pragma unroll
    for (int k = 0; k < Cfg::kBlockK / 16; ++k) Mma::mma(acc, desc_a + 2 * k, desc_b + 2 * k);
    ptx::wgmma_commit();
    // Keep this K block's wgmma in flight; the previous one has completed, so its stage is free.
    ptx::wgmma_wait<1>();
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[i]);
    if (kb > 0 && lane == 0) ptx::mbar_arrive(&empty[(kb - 1) % Cfg::kStages]);  // one arrival per warp
  }
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[i]);
  if (k_blocks > 0 && lane == 0) ptx::mbar_arrive(&empty[(k_blocks - 1) % Cfg::kStages]);
}

}  // namespace detlogp::sm90

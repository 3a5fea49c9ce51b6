// The tile shapes of the SM90 kernels as template constants, each checked by static_asserts
// against the hardware (wgmma n, TMA box, shared memory, setmaxnreg budget) and the contract.
// Bit-relevant facts pinned here: BLOCK_K = 64 for every configuration, one fp32 accumulator per
// output for the whole K walk, k16 steps issued in ascending K order, no split-K. Tile rows,
// BLOCK_N, stages, cluster size and the register split are free axes.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"

namespace detlogp::sm90 {

// WgM rows x BlockN columns per consumer-warpgroup tile (WgM/64 wgmma m64 fragments). TileRows
// hidden rows per tile: WgM, or 8 for decode (an 8-row TMA box, replicated over the m64 operand
// by a zero group stride, so the ring spends its shared memory on weight bytes in flight).
// ClusterM > 1: a cluster of ClusterM CTAs along M walks the same weight tiles in lockstep (tile
// rows m = ClusterM * g + rank); each CTA loads 1/ClusterM of every weight stage and multicasts it
// to all, so L2 serves each weight byte once per cluster instead of once per CTA.
template <int WgM, int BlockN, int Stages, int TileRows = WgM, int ClusterM = 1>
struct PingpongConfig {
  static constexpr int kWgM = WgM;
  static constexpr int kTileRows = TileRows;
  static constexpr int kBlockN = BlockN;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = Stages;
  static constexpr int kFragments = WgM / 64;
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  static constexpr int kAccRegs = BlockN / 2;
  static constexpr uint32_t kABytes = uint32_t(TileRows) * kBlockK * 2;
  static constexpr uint32_t kAGroupStride = TileRows == 8 ? 0 : 1024;
  static constexpr uint32_t kBBytes = uint32_t(BlockN) * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr int kClusterM = ClusterM;
  static constexpr int kBSliceRows = BlockN / ClusterM;  // weight rows each CTA loads (the TMA box)
  static constexpr uint32_t kBSliceBytes = uint32_t(kBSliceRows) * kBlockK * 2;
  static constexpr int kBarriers = 2 * Stages + 2;  // full, empty, mainloop-done x2
  static constexpr int kSmemBytes = int(Stages * kStageBytes) + kBarriers * 8 + 1024;
  static constexpr int kEntryRegs = 168;  // 65536 / 384, multiple of 8
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;  // 168 + (168 - 40) / 2

  static_assert(WgM == 64 || WgM == 128, "one or two m64 fragments per consumer warpgroup");
  static_assert(TileRows == WgM || (TileRows == 8 && WgM == 64), "an 8-row tile replicates into one m64 fragment");
  static_assert(BlockN % kVocabTile == 0, "a tile's columns must be whole 64-lane vocab tiles (contract tree)");
  static_assert(BlockN == 64 || BlockN == 128 || BlockN == 192 || BlockN == 256,
                "wgmma n and TMA box limit (<= 256 rows)");
  static_assert(kFragments * kAccRegs <= 128, "accumulators must fit the consumer register budget");
  static_assert(kBlockK * 2 == 128, "BLOCK_K must fill exactly one 128-byte swizzle row");
  static_assert(kBlockK % kKSlab == 0 && kKSlab % 16 == 0, "BLOCK_K = whole K slabs = whole wgmma k16 steps");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "stage tiles keep 1024-byte swizzle alignment");
  static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory limit of SM90");
  static_assert(kEntryRegs * kThreads <= 65536, "one CTA per SM");
  static_assert(kProducerRegs * 128 + 2 * kConsumerRegs * 128 <= kEntryRegs * kThreads, "setmaxnreg budget");
  static_assert(ClusterM == 1 || ClusterM == 2 || ClusterM == 4, "cluster of 1, 2 or 4 CTAs along M");
  static_assert(ClusterM == 1 || TileRows == WgM, "8-row decode tiles have one M tile: nothing to share");
  static_assert(BlockN % ClusterM == 0 && kBSliceBytes % 1024 == 0,
                "each CTA's weight slice keeps the 1024-byte swizzle atoms whole");
};

// Persistent cooperative tiles: a 128 x BlockN CTA tile whose two consumer warpgroups each take 64
// rows of every ring stage (the weight stage shared), so per weight byte twice the rows of the
// ping-pong. Member names as PingpongConfig (one m64 fragment per warpgroup, kTileRows = 128 hidden
// rows per stage), so pingpong_produce, RingSmem, release_stage and the consumers (mainloop.cuh) serve:
// a warpgroup passes its half of the A stage (smem_a + 64 rows) and the stage stride stays kABytes.
template <int BlockN, int Stages, int ClusterM = 1>
struct CoopPersistentConfig {
  static constexpr int kWgM = 64;
  static constexpr int kTileRows = 128;
  static constexpr int kBlockN = BlockN;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = Stages;
  static constexpr int kFragments = 1;
  static constexpr int kThreads = 384;
  static constexpr int kAccRegs = BlockN / 2;
  static constexpr uint32_t kABytes = uint32_t(kTileRows) * kBlockK * 2;
  static constexpr uint32_t kAGroupStride = 1024;
  static constexpr uint32_t kAHalfBytes = 64u * kBlockK * 2;  // one warpgroup's 64 rows of a stage
  static constexpr uint32_t kBBytes = uint32_t(BlockN) * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr int kClusterM = ClusterM;
  static constexpr int kBSliceRows = BlockN / ClusterM;
  static constexpr uint32_t kBSliceBytes = uint32_t(kBSliceRows) * kBlockK * 2;
  static constexpr int kBarriers = 2 * Stages;
  static constexpr int kSmemBytes = int(Stages * kStageBytes) + kBarriers * 8 + 1024;
  static constexpr int kEntryRegs = 168;
  // 24 / 240 rather than 40 / 232: the producer spills a few words to L1 in its TMA loop, where it
  // waits on the ring anyway, and the consumers' epilogue keeps two exponential chains in flight
  // in its last group instead of one (measured under ncu: -0.24 % kernel cycles at N = 1024).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static_assert(BlockN % kVocabTile == 0, "a tile's columns must be whole 64-lane vocab tiles (contract tree)");
  static_assert(BlockN == 128 || BlockN == 192 || BlockN == 256, "wgmma n and TMA box limit (<= 256 rows)");
  static_assert(kAccRegs <= 128, "one m64nN accumulator set per consumer warpgroup");
  static_assert(kBlockK * 2 == 128, "BLOCK_K must fill exactly one 128-byte swizzle row");
  static_assert(kABytes % 1024 == 0 && kAHalfBytes % 1024 == 0 && kBBytes % 1024 == 0,
                "stage tiles and each warpgroup's half keep 1024-byte swizzle alignment");
  static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory limit of SM90");
  static_assert(kEntryRegs * kThreads <= 65536, "one CTA per SM");
  static_assert(kProducerRegs * 128 + 2 * kConsumerRegs * 128 <= kEntryRegs * kThreads, "setmaxnreg budget");
  static_assert(ClusterM == 1 || ClusterM == 2, "cluster of 1 or 2 CTAs along M");
  static_assert(BlockN % ClusterM == 0 && kBSliceBytes % 1024 == 0,
                "each CTA's weight slice keeps the 1024-byte swizzle atoms whole");
};

}  // namespace detlogp::sm90

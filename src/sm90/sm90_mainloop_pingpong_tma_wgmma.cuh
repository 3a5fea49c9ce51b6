// SM90 persistent ping-pong schedule: one CTA per SM walks tiles blockIdx.x, +gridDim.x, ...;
// a producer thread streams every tile's K blocks through one mbarrier ring with TMA, and the two
// consumer warpgroups take alternate tiles, so one runs its wgmma mainloop while the other runs
// the (SIMT-heavy) tile-summary epilogue of its previous tile. An ordering barrier keeps the
// mainloops in tile order, which also keeps every ring wait within one phase lap.
// Bit-relevant facts are those of sm90_mainloop_tma_wgmma.cuh: BLOCK_K = 64, one fp32
// accumulator per output for the whole K walk, k16 steps ascending, no split-K.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "sm90/ptx.cuh"
#include "sm90/ptx_wgmma_bf16.cuh"
#include "sm90/sm90_tile_schedule.hpp"
#include "sm90/sm90_validate.cuh"

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
// rows per stage), so pingpong_produce, RingSmem, release_stage and pingpong_consume_issue serve:
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
  // in its last group instead of one (ncu run 74: -0.24 % kernel cycles at N = 1024).
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

// This CTA's walk (sm90_tile_schedule.hpp) for a Cfg::kClusterM-CTA cluster along M.
template <class Cfg>
__device__ __forceinline__ TileWalk make_tile_walk(int m_tiles, int n_tiles, int group_m) {
  const int rank = Cfg::kClusterM > 1 ? static_cast<int>(ptx::cluster_ctarank()) : 0;
  return TileWalk::make(m_tiles, n_tiles, group_m, Cfg::kClusterM, static_cast<int>(blockIdx.x),
                        static_cast<int>(gridDim.x), rank);
}

// The dynamic shared memory of every schedule (forward cooperative and ping-pong, grad-logits):
// kStages A tiles, kStages B tiles, then the full/empty barrier ring (a schedule's own barriers follow it), 1024-byte
// aligned for the 128-byte swizzle.
template <class Cfg>
struct RingSmem {
  uint8_t* a;
  uint8_t* b;
  uint64_t* full;
  uint64_t* empty;

  __device__ static RingSmem carve(uint8_t* raw) {
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    RingSmem r;
    r.a = base;
    r.b = base + Cfg::kStages * Cfg::kABytes;
    r.full = reinterpret_cast<uint64_t*>(r.b + Cfg::kStages * Cfg::kBBytes);
    r.empty = r.full + Cfg::kStages;
    return r;
  }
  // Thread 0 only, before fence_barrier_init: tensor-map prefetch and the ring's barriers
  // (one TMA arrival fills a stage; `consumer_arrivals` warps release it).
  __device__ void init(const CUtensorMap* map_hidden, const CUtensorMap* map_weight, uint32_t consumer_arrivals) const {
    ptx::prefetch_tensormap(map_hidden);
    ptx::prefetch_tensormap(map_weight);
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], consumer_arrivals);
    }
  }
};

// The start of every persistent kernel: thread 0 initializes the ring's barriers
// (`consumer_arrivals` warps release a stage) and `mainloop_done` more barriers after them (the
// ping-pong's ordering pair, 4 arrivals each); then the CTA, and with clusters the cluster, waits,
// so the peers' barriers exist before any multicast reaches them.
template <class Cfg>
__device__ __forceinline__ RingSmem<Cfg> persistent_prologue(uint8_t* smem_raw, const CUtensorMap* map_hidden,
                                                             const CUtensorMap* map_weight, uint32_t consumer_arrivals,
                                                             int mainloop_done = 0) {
  const auto ring = RingSmem<Cfg>::carve(smem_raw);
  if (threadIdx.x == 0) {
    ring.init(map_hidden, map_weight, consumer_arrivals);
    for (int i = 0; i < mainloop_done; ++i) ptx::mbar_init(&ring.empty[Cfg::kStages + i], 4);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if constexpr (Cfg::kClusterM > 1) ptx::cluster_sync();
  return ring;
}

// Warp specialization of the persistent kernels: warpgroup 0 gives registers up and runs
// `produce`, the consumer warpgroups take them and run `consume(c)` (c = 0, 1). With clusters no CTA
// leaves while a peer may still multicast into it or arrive on its barriers.
template <class Cfg, class Produce, class Consume>
__device__ __forceinline__ void warp_specialize(Produce&& produce, Consume&& consume) {
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    produce();
  } else {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    consume(warpgroup - 1);
  }
  if constexpr (Cfg::kClusterM > 1) ptx::cluster_sync();
}

template <class Cfg>
__device__ __forceinline__ void pingpong_produce(const CUtensorMap* map_hidden, const CUtensorMap* map_weight,
                                                 uint8_t* smem_a, uint8_t* smem_b, uint64_t* full, uint64_t* empty,
                                                 int k_blocks, int64_t row_begin, int m_tiles, int n_tiles,
                                                 int group_m) {
  const TileWalk walk = make_tile_walk<Cfg>(m_tiles, n_tiles, group_m);
  constexpr uint16_t kAllCtas = static_cast<uint16_t>((1u << Cfg::kClusterM) - 1u);
  uint32_t it = 0;
  for (int unit = walk.first; unit < walk.count; unit += walk.stride) {
    int m_tile, n_tile;
    walk.coords(unit, m_tile, n_tile);
    const int32_t row0 = static_cast<int32_t>(row_begin + int64_t{m_tile} * Cfg::kTileRows);
    const int32_t col0 = n_tile * Cfg::kBlockN;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const uint32_t s = it % Cfg::kStages;
      const uint32_t round = it / Cfg::kStages;
      // ClusterM > 1: every cluster CTA's consumers have released stage s (they arrive on all).
      ptx::mbar_wait(&empty[s], (round & 1u) ^ 1u);
      ptx::mbar_arrive_expect_tx(&full[s], Cfg::kStageBytes);
      ptx::tma_load_2d(smem_a + s * Cfg::kABytes, map_hidden, &full[s], kb * Cfg::kBlockK, row0);
      if constexpr (Cfg::kClusterM == 1) {
        ptx::tma_load_2d(smem_b + s * Cfg::kBBytes, map_weight, &full[s], kb * Cfg::kBlockK, col0);
      } else {
        const int32_t slice = walk.rank * Cfg::kBSliceRows;
        ptx::tma_load_2d_multicast(smem_b + s * Cfg::kBBytes + uint32_t(walk.rank) * Cfg::kBSliceBytes, map_weight,
                                   &full[s], kb * Cfg::kBlockK, col0 + slice, kAllCtas);
      }
    }
  }
}

// The producer warpgroup of the persistent kernels: warp 1 of CTA 0 validates the inputs when the
// launch asks for it (the trainer's first launch), thread 0 streams the ring.
template <class Cfg, class Ring>
__device__ __forceinline__ void produce_persistent(const FusedParams& p, const CUtensorMap* map_hidden,
                                                   const CUtensorMap* map_weight, const Ring& ring) {
  if (p.validate_in_kernel != 0 && blockIdx.x == 0 && threadIdx.x / 32 == 1) validate_rows_warp(p.validate);
  if (threadIdx.x == 0)
    pingpong_produce<Cfg>(map_hidden, map_weight, ring.a, ring.b, ring.full, ring.empty, p.k_blocks, p.row_begin,
                          p.m_tiles, p.n_tiles, p.group_m);
}

// Releases ring stage s: one arrival per warp on this CTA's empty barrier, or with ClusterM > 1
// on every cluster CTA's (lane r arrives on CTA r's), as each CTA's producer refills the stage in
// all of them.
template <class Cfg>
__device__ __forceinline__ void release_stage(uint64_t* empty, uint32_t s, int lane) {
  if constexpr (Cfg::kClusterM == 1) {
    if (lane == 0) ptx::mbar_arrive(&empty[s]);
  } else {
    if (lane < Cfg::kClusterM) ptx::mbar_arrive_cluster(&empty[s], static_cast<uint32_t>(lane));
  }
}

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
// bench_sm90_mainloop measures this form of the K walk at 0.92-0.93x the cuBLAS GEMM (D = 4096).
// before_wait runs once the last wgmma group is issued, before the wait for it: the warps would
// otherwise sit idle there for about a group's duration (perf-notes run 79: ~1.4 % of the consumers'
// samples). Work placed there must not touch acc and should not branch divergently.
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

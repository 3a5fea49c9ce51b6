// The TMA pipeline of the persistent SM90 kernels: the shared-memory ring (A and B stages and
// their full/empty mbarriers), the kernels' common prologue, warp specialization, the producer
// thread that streams every tile's K blocks in the persistent tile order (tile_schedule.hpp), and
// the release of a stage by the consumers (with clusters, on every cluster CTA).
#pragma once

#include <cstdint>

#include "cuda/validate.cuh"
#include "sm90/device/ptx.cuh"
#include "sm90/device/tile_schedule.hpp"
#include "sm90/params.hpp"

namespace detlogp::sm90 {

// This CTA's walk (tile_schedule.hpp) for a Cfg::kClusterM-CTA cluster along M.
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
// launch asks for it (the trainer's first launch), thread 0 streams the ring. kMulti: [N, K] targets.
template <class Cfg, bool kMulti = false, class Ring>
__device__ __forceinline__ void produce_persistent(const FusedParams& p, const CUtensorMap* map_hidden,
                                                   const CUtensorMap* map_weight, const Ring& ring) {
  if (p.validate_in_kernel != 0 && blockIdx.x == 0 && threadIdx.x / 32 == 1)
    cuda::validate_rows_warp<kMulti>(p.validate);
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

}  // namespace detlogp::sm90

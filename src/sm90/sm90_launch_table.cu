// Fused kernel (TMA + wgmma mainloop, tile-summary epilogue) and its launch table.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "sm90/sm90_epilogue_tile_summary.cuh"
#include "sm90/sm90_launch_table.hpp"
#include "sm90/sm90_mainloop_pingpong_tma_wgmma.cuh"
#include "sm90/sm90_mainloop_tma_wgmma.cuh"

namespace detlogp::sm90 {

// The dynamic shared memory of both schedules: kStages A tiles, kStages B tiles, then the
// full/empty barrier ring (a schedule's own barriers follow it), 1024-byte aligned for the
// 128-byte swizzle.
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

// Warpgroup 0 produces (one TMA thread), warpgroups 1.. consume 64 rows each.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtasPerSm)
    fused_linear_logp_sm90_kernel(const __grid_constant__ CUtensorMap map_hidden,
                                  const __grid_constant__ CUtensorMap map_weight, const FusedParams p,
                                  const int logits_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.status->code != kStatusOk) return;  // invalid input: write nothing (uniform over the grid)

  extern __shared__ uint8_t smem_raw[];
  const auto ring = RingSmem<Cfg>::carve(smem_raw);
  uint8_t* smem_a = ring.a;
  uint8_t* smem_b = ring.b;
  uint64_t* full = ring.full;
  uint64_t* empty = ring.empty;

  int m_tile, n_tile;
  raster_tile(static_cast<int>(blockIdx.x), p.m_tiles, p.n_tiles, p.group_m, m_tile, n_tile);
  const int64_t row0 = p.row_begin + int64_t{m_tile} * Cfg::kBlockM;
  const int64_t col0 = int64_t{n_tile} * Cfg::kBlockN;

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    ring.init(&map_hidden, &map_weight, 4 * Cfg::kConsumerWarpgroups);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0)
      produce_tiles<Cfg>(&map_hidden, &map_weight, smem_a, smem_b, full, empty, p.k_blocks, static_cast<int32_t>(row0),
                         static_cast<int32_t>(col0));
  } else {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int cw = warpgroup - 1;
    float acc[Cfg::kAccRegs];
    consume_tiles<Cfg>(acc, smem_a, smem_b, full, empty, p.k_blocks, cw);
    epilogue_tile_summaries<Cfg::kBlockN>(acc, p, row0 + 64 * cw, col0, logits_vec2 != 0);
  }
#endif
}

// Persistent ping-pong: warpgroup 0 produces, warpgroups 1 and 2 take alternate tiles of this
// CTA (local tile j = 0, 1, 2, ... is tile blockIdx.x + j * gridDim.x).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fused_linear_logp_sm90_pingpong_kernel(const __grid_constant__ CUtensorMap map_hidden,
                                           const __grid_constant__ CUtensorMap map_weight, const FusedParams p,
                                           const int logits_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.status->code != kStatusOk) return;  // invalid input: write nothing (uniform over the grid)

  extern __shared__ uint8_t smem_raw[];
  const auto ring = RingSmem<Cfg>::carve(smem_raw);
  uint8_t* smem_a = ring.a;
  uint8_t* smem_b = ring.b;
  uint64_t* full = ring.full;
  uint64_t* empty = ring.empty;
  uint64_t* mainloop_done = empty + Cfg::kStages;  // [2]: one phase per finished mainloop of each consumer

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    ring.init(&map_hidden, &map_weight, 4);
    ptx::mbar_init(&mainloop_done[0], 4);
    ptx::mbar_init(&mainloop_done[1], 4);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0)
      pingpong_produce<Cfg>(&map_hidden, &map_weight, smem_a, smem_b, full, empty, p.k_blocks, p.row_begin, p.m_tiles,
                            p.n_tiles, p.group_m);
  } else {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int c = warpgroup - 1;
    const int lane = threadIdx.x % 32;
    const int total = p.m_tiles * p.n_tiles;
    uint32_t n = 0;  // tiles this warpgroup has taken so far
    for (int j = c, tile = blockIdx.x + c * gridDim.x; tile < total; j += 2, tile += 2 * gridDim.x, ++n) {
      // Mainloops run in local tile order: wait for the other warpgroup's mainloop of tile j - 1.
      if (j >= 1) {
        const uint32_t completion = c == 1 ? n : n - 1;
        ptx::mbar_wait(&mainloop_done[1 - c], completion & 1u);
      }
      int m_tile, n_tile;
      raster_tile(tile, p.m_tiles, p.n_tiles, p.group_m, m_tile, n_tile);
      const int64_t row0 = p.row_begin + int64_t{m_tile} * Cfg::kWgM;
      const int64_t col0 = int64_t{n_tile} * Cfg::kBlockN;
      float acc[Cfg::kFragments][Cfg::kAccRegs];
      pingpong_consume<Cfg>(acc, smem_a, smem_b, full, empty, p.k_blocks, static_cast<uint32_t>(j) * p.k_blocks);
      if (lane == 0) ptx::mbar_arrive(&mainloop_done[c]);
#pragma unroll
      for (int f = 0; f < Cfg::kFragments; ++f)
        epilogue_tile_summaries<Cfg::kBlockN>(acc[f], p, row0 + 64 * f, col0, logits_vec2 != 0);
    }
  }
#endif
}

namespace {

using DecodeCfg = PingpongConfig<64, 128, 8>;        // few rows: HBM-bound, deep ring, epilogue hidden
using PrefillCfg = PingpongConfig<64, 256, 5>;       // many rows: one m64n256 wgmma per k16 step
using Pingpong128Cfg = PingpongConfig<128, 128, 6>;  // alternative: two m64n128 fragments per warpgroup
using Coop64Cfg = FusedConfig<64, 128, 4, 2>;        // non-persistent variants: free-axis alternatives
using Coop128Cfg = FusedConfig<128, 128, 6, 1>;
using Coop256Cfg = FusedConfig<128, 256, 4, 1>;

template <class Cfg>
BucketInfo coop_info(const char* name) {
  return {name, Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages, Cfg::kMinCtasPerSm, Cfg::kThreads, Cfg::kSmemBytes, false};
}
template <class Cfg>
BucketInfo pingpong_info(const char* name) {
  return {name, Cfg::kWgM, Cfg::kBlockN, Cfg::kStages, 1, Cfg::kThreads, Cfg::kSmemBytes, true};
}

void check_grid(int64_t blocks) {
  DETLOGP_CHECK(blocks > 0 && blocks < (int64_t{1} << 31), "fused kernel grid of " << blocks << " CTAs out of range");
}

template <class Cfg>
void launch_coop(const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2, cudaStream_t stream) {
  auto kernel = fused_linear_logp_sm90_kernel<Cfg>;
  // Per device and process; cheap enough to repeat (a host-side attribute write).
  DETLOGP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const int64_t blocks = int64_t{p.m_tiles} * p.n_tiles;
  check_grid(blocks);
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(mh, mw, p, vec2 ? 1 : 0);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

template <class Cfg>
void launch_pingpong(const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2,
                     cudaStream_t stream) {
  auto kernel = fused_linear_logp_sm90_pingpong_kernel<Cfg>;
  DETLOGP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  int device = 0, sms = 0;
  DETLOGP_CUDA_CHECK(cudaGetDevice(&device));
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t tiles = int64_t{p.m_tiles} * p.n_tiles;
  check_grid(tiles);
  const int64_t blocks = std::min<int64_t>(tiles, sms);  // persistent: one CTA per SM
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(mh, mw, p, vec2 ? 1 : 0);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace

const char* bucket_env_name() { return "DETLOGP_SM90_BUCKET"; }

BucketInfo bucket_info(Bucket b) {
  switch (b) {
    case Bucket::decode:
      return pingpong_info<DecodeCfg>("decode");
    case Bucket::prefill:
      return pingpong_info<PrefillCfg>("prefill");
    case Bucket::pingpong128x128:
      return pingpong_info<Pingpong128Cfg>("pingpong128x128");
    case Bucket::coop64x128:
      return coop_info<Coop64Cfg>("coop64x128");
    case Bucket::coop128x128:
      return coop_info<Coop128Cfg>("coop128x128");
    case Bucket::coop128x256:
      return coop_info<Coop256Cfg>("coop128x256");
  }
  DETLOGP_FAIL("unknown SM90 bucket " << static_cast<int>(b));
}

Bucket select_bucket(int64_t rows) {
  if (const char* v = std::getenv(bucket_env_name()); v != nullptr && *v != '\0' && std::strcmp(v, "auto") != 0) {
    std::string names;
    for (int i = 0; i < kBucketCount; ++i) {
      const char* name = bucket_info(static_cast<Bucket>(i)).name;
      if (std::strcmp(v, name) == 0) return static_cast<Bucket>(i);
      names += std::string(", ") + name;
    }
    DETLOGP_FAIL(bucket_env_name() << "=" << v << " is not a launch bucket; use auto" << names);
  }
  return rows <= 64 ? Bucket::decode : Bucket::prefill;
}

void launch_fused(Bucket b, const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2,
                  cudaStream_t stream) {
  switch (b) {
    case Bucket::decode:
      return launch_pingpong<DecodeCfg>(mh, mw, p, vec2, stream);
    case Bucket::prefill:
      return launch_pingpong<PrefillCfg>(mh, mw, p, vec2, stream);
    case Bucket::pingpong128x128:
      return launch_pingpong<Pingpong128Cfg>(mh, mw, p, vec2, stream);
    case Bucket::coop64x128:
      return launch_coop<Coop64Cfg>(mh, mw, p, vec2, stream);
    case Bucket::coop128x128:
      return launch_coop<Coop128Cfg>(mh, mw, p, vec2, stream);
    case Bucket::coop128x256:
      return launch_coop<Coop256Cfg>(mh, mw, p, vec2, stream);
  }
  DETLOGP_FAIL("unknown SM90 bucket " << static_cast<int>(b));
}

}  // namespace detlogp::sm90

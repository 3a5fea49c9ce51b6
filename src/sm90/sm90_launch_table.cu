// Fused kernel (TMA + wgmma mainloop, tile-summary epilogue) and its launch table.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

#include "sm90/sm90_epilogue_tile_summary.cuh"
#include "sm90/sm90_launch_persistent.cuh"
#include "sm90/sm90_launch_table.hpp"
#include "sm90/sm90_mainloop_coop_overlap.cuh"
#include "sm90/sm90_mainloop_pingpong_tma_wgmma.cuh"
#include "sm90/sm90_mainloop_tma_wgmma.cuh"
#include "sm90/sm90_validate.cuh"

namespace detlogp::sm90 {

// Warpgroup 0 produces (one TMA thread), warpgroups 1.. consume 64 rows each.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtasPerSm)
    fused_linear_logp_sm90_kernel(const __grid_constant__ CUtensorMap map_hidden,
                                  const __grid_constant__ CUtensorMap map_weight, const FusedParams p,
                                  const int logits_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Invalid input: write nothing (uniform over the grid). In-kernel validation writes only
  // workspace before the verdict, so it does not wait for one.
  if (p.validate_in_kernel == 0 && p.status->code != kStatusOk) return;
  asm volatile("griddepcontrol.launch_dependents;");  // the combine may launch now and wait for us

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
    if (p.validate_in_kernel != 0 && blockIdx.x == 0 && threadIdx.x / 32 == 1) validate_rows_warp(p.validate);
    if (threadIdx.x == 0)
      produce_tiles<Cfg>(&map_hidden, &map_weight, smem_a, smem_b, full, empty, p.k_blocks, static_cast<int32_t>(row0),
                         static_cast<int32_t>(col0));
  } else {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int cw = warpgroup - 1;
    float acc[Cfg::kAccRegs];
    consume_tiles<Cfg>(acc, smem_a, smem_b, full, empty, p.k_blocks, cw);
    epilogue_tile_summaries<Cfg::kBlockN>(acc, p, row0 + 64 * cw, p.row_end, col0, logits_vec2 != 0);
  }
#endif
}

// Persistent ping-pong: warpgroup 0 produces, warpgroups 1 and 2 take alternate tiles of this
// CTA (local tile j = 0, 1, 2, ... is work unit walk.first + j * walk.stride; see TileWalk).
// kPlain: a launch with neither bias nor logits output (epilogue_tile_summaries<., true>).
template <class Cfg, bool kPlain>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fused_linear_logp_sm90_pingpong_kernel(const __grid_constant__ CUtensorMap map_hidden,
                                           const __grid_constant__ CUtensorMap map_weight, const FusedParams p,
                                           const int logits_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Invalid input: write nothing (uniform over the grid). In-kernel validation writes only
  // workspace before the verdict, so it does not wait for one.
  if (p.validate_in_kernel == 0 && p.status->code != kStatusOk) return;
  asm volatile("griddepcontrol.launch_dependents;");  // the combine may launch now and wait for us

  extern __shared__ uint8_t smem_raw[];
  // Each consuming warp of every cluster CTA releases each stage; two more barriers, one phase per
  // finished mainloop of each consumer warpgroup.
  const auto ring = persistent_prologue<Cfg>(smem_raw, &map_hidden, &map_weight, 4 * Cfg::kClusterM, 2);
  uint64_t* mainloop_done = ring.empty + Cfg::kStages;
  warp_specialize<Cfg>([&] { produce_persistent<Cfg>(p, &map_hidden, &map_weight, ring); },
                       [&](int c) {
                         const int lane = threadIdx.x % 32;
                         const TileWalk walk = make_tile_walk<Cfg>(p.m_tiles, p.n_tiles, p.group_m);
                         uint32_t n = 0;  // tiles this warpgroup has taken so far
                         for (int j = c, unit = walk.first + c * walk.stride; unit < walk.count;
                              j += 2, unit += 2 * walk.stride, ++n) {
                           // Mainloops run in local tile order: wait for the other warpgroup's mainloop of tile j - 1.
                           if (j >= 1) {
                             const uint32_t completion = c == 1 ? n : n - 1;
                             ptx::mbar_wait(&mainloop_done[1 - c], completion & 1u);
                           }
                           int m_tile, n_tile;
                           walk.coords(unit, m_tile, n_tile);
                           const int64_t row0 = p.row_begin + int64_t{m_tile} * Cfg::kTileRows;
                           const int64_t row_limit = min(p.row_end, row0 + Cfg::kTileRows);
                           const int64_t col0 = int64_t{n_tile} * Cfg::kBlockN;
                           // The rows' temperature and target load while the K walk runs.
                           FragmentRows rows[Cfg::kFragments];
#pragma unroll
                           for (int f = 0; f < Cfg::kFragments; ++f)
                             rows[f] = load_fragment_rows(p, row0 + 64 * f, row_limit);
                           float acc[Cfg::kFragments][Cfg::kAccRegs];
                           const uint32_t it0 = static_cast<uint32_t>(j) * p.k_blocks;
                           pingpong_consume_issue<Cfg>(acc, ring.a, ring.b, ring.full, ring.empty, p.k_blocks, it0);
                           // Hand the tensor cores over while this tile's last wgmma still runs.
                           if (lane == 0) ptx::mbar_arrive(&mainloop_done[c]);
                           pingpong_consume_tail<Cfg>(acc, ring.empty, p.k_blocks, it0);
#pragma unroll
                           for (int f = 0; f < Cfg::kFragments; ++f)
                             epilogue_tile_summaries<Cfg::kBlockN, kPlain>(acc[f], p, rows[f], row0 + 64 * f, row_limit,
                                                                           col0, logits_vec2 != 0);
                         }
                       });
#endif
}

// Persistent cooperative: warpgroup 0 produces 128-row tiles, warpgroups 1 and 2 each run the
// mainloop of 64 of its rows on every stage (a stage is free once both have released it), then
// their epilogue; no overlap of epilogue and tensor-core work within the CTA.
template <class Cfg, bool kPlain>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fused_linear_logp_sm90_coop_persistent_kernel(const __grid_constant__ CUtensorMap map_hidden,
                                                  const __grid_constant__ CUtensorMap map_weight, const FusedParams p,
                                                  const int logits_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.validate_in_kernel == 0 && p.status->code != kStatusOk) return;
  asm volatile("griddepcontrol.launch_dependents;");  // the combine may launch now and wait for us

  extern __shared__ uint8_t smem_raw[];
  // Every consuming warp of both warpgroups, of every cluster CTA, releases each stage.
  const auto ring = persistent_prologue<Cfg>(smem_raw, &map_hidden, &map_weight, 8 * Cfg::kClusterM);
  warp_specialize<Cfg>(
      [&] { produce_persistent<Cfg>(p, &map_hidden, &map_weight, ring); },
      [&](int c) {
        const TileWalk walk = make_tile_walk<Cfg>(p.m_tiles, p.n_tiles, p.group_m);
        // A tile's coordinates and its rows' temperature and target are taken one tile ahead, while
        // the previous tile's last wgmma group runs: the walk's integer divisions issue where the
        // warps would wait anyway, and the loads' latency hides behind that tile's epilogue.
        auto tile_rows = [&](int unit, int& m_tile, int& n_tile, FragmentRows& rows) {
          walk.coords(unit, m_tile, n_tile);
          const int64_t row0 = p.row_begin + int64_t{m_tile} * Cfg::kTileRows;
          rows = load_fragment_rows(p, row0 + 64 * c, min(p.row_end, row0 + Cfg::kTileRows));
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
            wide_rows = prepare_wide_rows<Cfg::kBlockN>(p, rows, frag0, row_limit, col0);
            if (unit + walk.stride < walk.count) tile_rows(unit + walk.stride, next_m, next_n, next_rows);
          };
          const uint8_t* smem_a = ring.a + c * Cfg::kAHalfBytes;  // this warpgroup's 64 rows; B is shared
          coop_consume<Cfg>(acc, smem_a, ring.b, ring.full, ring.empty, p.k_blocks, it0, before_wait);
          it0 += static_cast<uint32_t>(p.k_blocks);
          const bool vec2 = logits_vec2 != 0;
          epilogue_tile_summaries<Cfg::kBlockN, kPlain, true>(acc, p, rows, frag0, row_limit, col0, vec2, &wide_rows);
          m_tile = next_m;
          n_tile = next_n;
          rows = next_rows;
        }
      });
#endif
}

namespace {

using DecodeCfg = PingpongConfig<64, 128, 8>;           // few rows: HBM-bound, deep ring, epilogue hidden
using Decode192Cfg = PingpongConfig<64, 192, 7>;        // 3 vocab tiles a tile: V = 151936 fills 132 SMs evenly
using Decode8x128Cfg = PingpongConfig<64, 128, 13, 8>;  // N <= 8: 8-row tiles, the ring holds weight bytes
using Decode8x192Cfg = PingpongConfig<64, 192, 9, 8>;
using Decode8x256Cfg = PingpongConfig<64, 256, 6, 8>;
using PrefillCfg = PingpongConfig<64, 256, 5>;  // many rows: one m64n256 wgmma per k16 step
using PrefillC2Cfg = PingpongConfig<64, 256, 5, 64, 2>;
using CoopOverlapCfg = CoopOverlapConfig<192, 5, 1>;  // 128 x 192 CTA tile, epilogue in slices (forced only)
using CoopOverlapC2Cfg = CoopOverlapConfig<192, 5, 2>;
using Coop256PersistentCfg = CoopPersistentConfig<256, 4>;  // the default above N = 64 at D >= 4096
using Coop256PersistentC2Cfg = CoopPersistentConfig<256, 4, 2>;
using Pingpong128Cfg = PingpongConfig<128, 128, 6>;  // alternative: two m64n128 fragments per warpgroup
using Coop64Cfg = FusedConfig<64, 128, 4, 2>;        // non-persistent variants: free-axis alternatives
using Coop128Cfg = FusedConfig<128, 128, 6, 1>;
using Coop256Cfg = FusedConfig<128, 256, 4, 1>;

template <class Cfg>
BucketInfo coop_info(const char* name) {
  return {name,          Cfg::kBlockM,    Cfg::kBlockN, Cfg::kStages, Cfg::kMinCtasPerSm,
          Cfg::kThreads, Cfg::kSmemBytes, false,        256};
}
template <class Cfg>
BucketInfo pingpong_info(const char* name, int weight_promotion = 0) {
  return {name,          Cfg::kTileRows,  Cfg::kBlockN, Cfg::kStages,     1,
          Cfg::kThreads, Cfg::kSmemBytes, true,         weight_promotion, Cfg::kClusterM};
}

void check_grid(int64_t blocks) {
  DETLOGP_CHECK(blocks > 0 && blocks < (int64_t{1} << 31), "fused kernel grid of " << blocks << " CTAs out of range");
}

template <class Cfg>
void launch_coop(const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2, cudaStream_t stream) {
  auto kernel = fused_linear_logp_sm90_kernel<Cfg>;
  allow_smem_once<fused_linear_logp_sm90_kernel<Cfg>>(Cfg::kSmemBytes);
  const int64_t blocks = int64_t{p.m_tiles} * p.n_tiles;
  check_grid(blocks);
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(mh, mw, p, vec2 ? 1 : 0);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

template <class Cfg>
void launch_pingpong(const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2, int sms,
                     cudaStream_t stream) {
  const int64_t m_units = (int64_t{p.m_tiles} + Cfg::kClusterM - 1) / Cfg::kClusterM;
  if (p.bias == nullptr && p.logits == nullptr)
    launch_persistent<fused_linear_logp_sm90_pingpong_kernel<Cfg, true>, Cfg>(m_units * p.n_tiles, sms, stream, mh, mw,
                                                                              p, vec2 ? 1 : 0);
  else
    launch_persistent<fused_linear_logp_sm90_pingpong_kernel<Cfg, false>, Cfg>(m_units * p.n_tiles, sms, stream, mh, mw,
                                                                               p, vec2 ? 1 : 0);
}

template <class Cfg>
void launch_coop_persistent(const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2, int sms,
                            cudaStream_t stream) {
  const int64_t m_units = (int64_t{p.m_tiles} + Cfg::kClusterM - 1) / Cfg::kClusterM;
  if (p.bias == nullptr && p.logits == nullptr)
    launch_persistent<fused_linear_logp_sm90_coop_persistent_kernel<Cfg, true>, Cfg>(m_units * p.n_tiles, sms, stream,
                                                                                     mh, mw, p, vec2 ? 1 : 0);
  else
    launch_persistent<fused_linear_logp_sm90_coop_persistent_kernel<Cfg, false>, Cfg>(m_units * p.n_tiles, sms, stream,
                                                                                      mh, mw, p, vec2 ? 1 : 0);
}

template <class Cfg>
void launch_coop_overlap(const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2, int sms,
                         cudaStream_t stream) {
  const int64_t m_units = (int64_t{p.m_tiles} + Cfg::kClusterM - 1) / Cfg::kClusterM;
  launch_persistent<fused_linear_logp_sm90_coop_overlap_kernel<Cfg>, Cfg>(m_units * p.n_tiles, sms, stream, mh, mw, p,
                                                                          vec2 ? 1 : 0);
}

// Per-SM share of the weight columns a persistent launch streams: whole waves of tiles times the
// tile width (the last wave's idle SMs are the waste this measures).
int64_t columns_per_sm(const BucketInfo& bi, int64_t rows, int64_t vocab_local, int sms) {
  const int64_t tiles = ((rows + bi.block_m - 1) / bi.block_m) * ((vocab_local + bi.block_n - 1) / bi.block_n);
  return (tiles + sms - 1) / sms * bi.block_n;
}

// The candidate that streams the fewest columns per SM; ties go to the narrower tile (on the H200
// at V = 151936, n128 and n192 tie and n128 measured 1-2 % faster at N = 1, 8 and 64).
Bucket most_even(std::initializer_list<Bucket> candidates, int64_t rows, int64_t vocab_local, int sms) {
  Bucket best = *candidates.begin();
  int64_t best_cost = -1;
  int best_n = 0;
  for (Bucket b : candidates) {
    const BucketInfo bi = bucket_info(b);
    const int64_t cost = columns_per_sm(bi, rows, vocab_local, std::max(sms, 1));
    if (best_cost < 0 || cost < best_cost || (cost == best_cost && bi.block_n < best_n)) {
      best = b;
      best_cost = cost;
      best_n = bi.block_n;
    }
  }
  return best;
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
    case Bucket::decode_n192:
      return pingpong_info<Decode192Cfg>("decode_n192");
    // Weight loads carry no L2 promotion (pingpong_info's default): interleaved H200 runs measured
    // the 256-byte promotion 2.5 % slower at N = 1 and 8, 1 % at N = 64 and 1024, 7 % at 4096.
    case Bucket::decode8_n128:
      return pingpong_info<Decode8x128Cfg>("decode8_n128");
    case Bucket::decode8_n192:
      return pingpong_info<Decode8x192Cfg>("decode8_n192");
    case Bucket::decode8_n256:
      return pingpong_info<Decode8x256Cfg>("decode8_n256");
    case Bucket::decode8_n128_promote256:
      return pingpong_info<Decode8x128Cfg>("decode8_n128_promote256", 256);
    case Bucket::decode_promote256:
      return pingpong_info<DecodeCfg>("decode_promote256", 256);
    case Bucket::prefill_promote256:
      return pingpong_info<PrefillCfg>("prefill_promote256", 256);
    case Bucket::prefill_c2:
      return pingpong_info<PrefillC2Cfg>("prefill_c2");
    case Bucket::coop_overlap_n192:
      return pingpong_info<CoopOverlapCfg>("coop_overlap_n192");
    case Bucket::coop_overlap_n192_c2:
      return pingpong_info<CoopOverlapC2Cfg>("coop_overlap_n192_c2");
    case Bucket::coop256_persistent:
      return pingpong_info<Coop256PersistentCfg>("coop256_persistent");
    case Bucket::coop256_persistent_c2:
      return pingpong_info<Coop256PersistentC2Cfg>("coop256_persistent_c2");
  }
  DETLOGP_FAIL("unknown SM90 bucket " << static_cast<int>(b));
}

Bucket select_bucket(int64_t rows, int64_t vocab_local, int64_t dim, bool stores_logits, int sms) {
  if (const char* v = std::getenv(bucket_env_name()); v != nullptr && *v != '\0' && std::strcmp(v, "auto") != 0) {
    std::string names;
    for (int i = 0; i < kBucketCount; ++i) {
      const char* name = bucket_info(static_cast<Bucket>(i)).name;
      if (std::strcmp(v, name) == 0) return static_cast<Bucket>(i);
      names += std::string(", ") + name;
    }
    DETLOGP_FAIL(bucket_env_name() << "=" << v << " is not a launch bucket; use auto" << names);
  }
  if (rows <= 8)
    return most_even({Bucket::decode8_n128, Bucket::decode8_n192, Bucket::decode8_n256}, rows, vocab_local, sms);
  if (rows <= 64) return most_even({Bucket::decode, Bucket::decode_n192, Bucket::prefill}, rows, vocab_local, sms);
  // Without a logits output, cooperative 128 x 256 tiles with a non-overlapped epilogue: at D >= 4096
  // above 64 rows (docs/perf-notes.md, runs 39-40), at D = 1024 and 2048 above 128 rows (run 91: 7-8 %
  // faster than the ping-pong from N = 256 to 8192, 3-4 % slower at N = 65 and 128). Launches that
  // store the logits (the stores would be exposed too) and shorter K walks keep the ping-pong overlap.
  if (!stores_logits && (dim >= 4096 || (dim >= 1024 && rows > 128))) return Bucket::coop256_persistent;
  return Bucket::prefill_c2;
}

void launch_fused(Bucket b, const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2, int sms,
                  cudaStream_t stream) {
  switch (b) {
    case Bucket::decode:
      return launch_pingpong<DecodeCfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::prefill:
      return launch_pingpong<PrefillCfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::pingpong128x128:
      return launch_pingpong<Pingpong128Cfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::coop64x128:
      return launch_coop<Coop64Cfg>(mh, mw, p, vec2, stream);
    case Bucket::coop128x128:
      return launch_coop<Coop128Cfg>(mh, mw, p, vec2, stream);
    case Bucket::coop128x256:
      return launch_coop<Coop256Cfg>(mh, mw, p, vec2, stream);
    case Bucket::decode_n192:
      return launch_pingpong<Decode192Cfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::decode8_n128:
      return launch_pingpong<Decode8x128Cfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::decode8_n192:
      return launch_pingpong<Decode8x192Cfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::decode8_n256:
      return launch_pingpong<Decode8x256Cfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::decode8_n128_promote256:
      return launch_pingpong<Decode8x128Cfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::decode_promote256:
      return launch_pingpong<DecodeCfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::prefill_promote256:
      return launch_pingpong<PrefillCfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::prefill_c2:
      return launch_pingpong<PrefillC2Cfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::coop_overlap_n192:
      return launch_coop_overlap<CoopOverlapCfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::coop_overlap_n192_c2:
      return launch_coop_overlap<CoopOverlapC2Cfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::coop256_persistent:
      return launch_coop_persistent<Coop256PersistentCfg>(mh, mw, p, vec2, sms, stream);
    case Bucket::coop256_persistent_c2:
      return launch_coop_persistent<Coop256PersistentC2Cfg>(mh, mw, p, vec2, sms, stream);
  }
  DETLOGP_FAIL("unknown SM90 bucket " << static_cast<int>(b));
}

}  // namespace detlogp::sm90

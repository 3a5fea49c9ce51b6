// The SM90 launch table: one row per launch bucket, each a tile configuration of one of the two
// fused schedules (kernels.cuh). Buckets vary free axes only (tile rows, BLOCK_N, stages, cluster
// size, schedule), so every bucket produces identical bytes; the heuristics (heuristics.cpp) pick
// one by size, DETLOGP_SM90_BUCKET forces one, and the tests run each on the same inputs. The
// bucket enum, bucket_info and launch_fused all come from this one table: a bucket is one row.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sm90/params.hpp"

// ROW(name, schedule, tile configuration of device/configs.cuh)
#define DETLOGP_SM90_LAUNCH_TABLE(ROW)                                                                        \
  /* N <= 8: 8-row tiles, the ring holds weight bytes in flight, not replicated rows */                       \
  ROW(decode8_n128, pingpong, PingpongConfig<64, 128, 13, 8>)                                                 \
  ROW(decode8_n192, pingpong, PingpongConfig<64, 192, 9, 8>)                                                  \
  ROW(decode8_n256, pingpong, PingpongConfig<64, 256, 6, 8>)                                                  \
  /* N <= 64: 64-row tiles, HBM-bound, deep ring, the epilogue hidden behind the other warpgroup */           \
  ROW(decode, pingpong, PingpongConfig<64, 128, 8>)                                                           \
  ROW(decode_n192, pingpong, PingpongConfig<64, 192, 7>) /* 3 vocab tiles: V = 151936 fills 132 SMs evenly */ \
  ROW(prefill, pingpong, PingpongConfig<64, 256, 5>)     /* one m64n256 wgmma per k16 step */                 \
  /* larger N: prefill's tile in clusters of 2 CTAs along M, the weight stage multicast */                    \
  ROW(prefill_c2, pingpong, PingpongConfig<64, 256, 5, 64, 2>)                                                \
  /* larger N without a logits output: 128 x 256 cooperative tiles, epilogue after each tile */               \
  ROW(coop256_persistent, cooperative, CoopPersistentConfig<256, 4>)

namespace detlogp::sm90 {

enum class Bucket : int {
#define DETLOGP_SM90_BUCKET_ENUM(name, ...) name,
  DETLOGP_SM90_LAUNCH_TABLE(DETLOGP_SM90_BUCKET_ENUM)
#undef DETLOGP_SM90_BUCKET_ENUM
};
#define DETLOGP_SM90_BUCKET_COUNT(...) +1
inline constexpr int kBucketCount = 0 DETLOGP_SM90_LAUNCH_TABLE(DETLOGP_SM90_BUCKET_COUNT);
#undef DETLOGP_SM90_BUCKET_COUNT

// What the host needs of a bucket's configuration.
struct BucketInfo {
  const char* name;
  int block_m;  // hidden rows per tile (the TMA box of the hidden map)
  int block_n;
  int cluster_m;  // CTAs per cluster along M; each loads block_n / cluster_m weight rows
  int weight_box_rows() const { return block_n / cluster_m; }
};

BucketInfo bucket_info(Bucket b);

// Launches the fused kernel of bucket b over p's row chunk, persistently over `sms` SMs. The tensor
// maps must have been encoded with box rows = block_m (hidden) and weight_box_rows() (weight).
void launch_fused(Bucket b, const CUtensorMap& map_hidden, const CUtensorMap& map_weight, const FusedParams& p,
                  bool logits_vec2, int sms, cudaStream_t stream);

}  // namespace detlogp::sm90

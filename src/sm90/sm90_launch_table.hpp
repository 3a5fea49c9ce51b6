// The SM90 launch table: M buckets that vary free axes only (BLOCK_M, BLOCK_N, stages, CTAs per
// SM). Every bucket produces identical bytes; DETLOGP_SM90_BUCKET forces one (tests prove it).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "sm90/sm90_common.hpp"

namespace detlogp::sm90 {

// decode / prefill: persistent ping-pong (auto picks by rows); pingpong128x128: another ping-pong
// tile shape; coop*: non-persistent cooperative
// variants, reachable only through the knob, kept as further free-axis points the tests cover.
enum class Bucket : int {
  decode = 0,
  prefill = 1,
  pingpong128x128 = 2,
  coop64x128 = 3,
  coop128x128 = 4,
  coop128x256 = 5
};
inline constexpr int kBucketCount = 6;

struct BucketInfo {
  const char* name;
  int block_m;
  int block_n;
  int stages;
  int min_ctas_per_sm;
  int threads;
  int smem_bytes;
  bool persistent;
};

BucketInfo bucket_info(Bucket b);
// Bucket for a launch of `rows` rows: DETLOGP_SM90_BUCKET (auto|decode|prefill|pingpong128x128|
// coop64x128|coop128x128|coop128x256) if set,
// else by size. Throws on an unknown value.
Bucket select_bucket(int64_t rows);
const char* bucket_env_name();

// Launches the fused kernel of bucket b over p's row chunk. The tensor maps must have been
// encoded with box rows = block_m (hidden) and block_n (weight).
void launch_fused(Bucket b, const CUtensorMap& map_hidden, const CUtensorMap& map_weight, const FusedParams& p,
                  bool logits_vec2, cudaStream_t stream);

}  // namespace detlogp::sm90

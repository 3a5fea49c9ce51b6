// The SM90 launch table: one row per launch bucket, each a tile configuration of one of the two
// fused schedules (kernels.cuh). Buckets vary free axes only (tile rows, BLOCK_N, stages, cluster
// size, schedule), so every bucket produces identical bytes; the heuristics (heuristics.cpp) pick
// one by size, DETLOGP_SM90_BUCKET forces one, and the tests run each on the same inputs. The
// table, the bucket enum and the names are plain C++ (launch_buckets.hpp); bucket_info and
// launch_fused come from the same table: a bucket is one row.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sm90/launch_buckets.hpp"
#include "sm90/params.hpp"

namespace detlogp::sm90 {

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

// The SM90 launch table: M buckets that vary free axes only (BLOCK_M, BLOCK_N, stages, CTAs per
// SM). Every bucket produces identical bytes; DETLOGP_SM90_BUCKET forces one (tests prove it).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "sm90/sm90_common.hpp"

namespace detlogp::sm90 {

// Persistent ping-pong buckets, picked by rows and by how evenly the weight tiles fill the SMs:
//   decode8_n{128,192,256}: N <= 8, 8-row tiles (the ring holds weight, not replicated rows);
//   decode (n128), decode_n192, prefill (n256): N <= 64;
//   coop256_persistent (128 x 256 cooperative tiles, epilogue after each tile): larger N at
//   D >= 4096 without a logits output;
//   prefill_c2 (prefill's tile, 2-CTA clusters sharing the weight stage): every other larger N.
// pingpong128x128 and coop*: further free-axis points reachable only through the knob; every
// bucket runs any N (the tests run each one).
enum class Bucket : int {
  decode = 0,
  prefill = 1,
  pingpong128x128 = 2,
  coop64x128 = 3,
  coop128x128 = 4,
  coop128x256 = 5,
  decode_n192 = 6,
  decode8_n128 = 7,
  decode8_n192 = 8,
  decode8_n256 = 9,
  // Same kernels, weight loads with 256-byte L2 promotion (the default is none; benchmark points):
  decode8_n128_promote256 = 10,
  decode_promote256 = 11,
  prefill_promote256 = 12,
  // prefill's tile in clusters of 2 CTAs along M, the weight stage multicast (one L2 read a
  // cluster): the default above N = 64 for D < 4096 or a logits output
  prefill_c2 = 13,
  // Forced only, slower than prefill_c2 so far (docs/sm90-coop-overlap.md): 128 x 192 CTA tiles, both consumer
  // warpgroups on one weight stage, the previous tile's epilogue in slices between the next tile's wgmma groups.
  coop_overlap_n192 = 14,
  coop_overlap_n192_c2 = 15,
  // Persistent 128 x 256 CTA tiles, both consumer warpgroups on every stage (64 rows each), the
  // epilogue after each tile's last wgmma, not overlapped, so it pays no fp32 tax on the tensor
  // cores: the default above N = 64 for D >= 4096 without logits output; _c2 multicasts the
  // weight stage (forced only).
  coop256_persistent = 16,
  coop256_persistent_c2 = 17
};
inline constexpr int kBucketCount = 18;

struct BucketInfo {
  const char* name;
  int block_m;  // hidden rows per tile (the TMA box of the hidden map)
  int block_n;
  int stages;
  int min_ctas_per_sm;
  int threads;
  int smem_bytes;
  bool persistent;
  int weight_promotion;  // L2 promotion of the weight map's TMA loads: 0, 128 or 256 bytes
  int cluster_m = 1;     // CTAs per cluster along M; each loads block_n / cluster_m weight rows
  int weight_box_rows() const { return block_n / cluster_m; }
};

BucketInfo bucket_info(Bucket b);
// Bucket for a launch of `rows` rows over V_local = vocab_local with hidden size `dim` (and fp32
// logits stored or not) on a GPU of `sms` SMs: DETLOGP_SM90_BUCKET (auto or a bucket name) if set,
// else by size. Throws on an unknown value.
Bucket select_bucket(int64_t rows, int64_t vocab_local, int64_t dim, bool stores_logits, int sms);
const char* bucket_env_name();

// Launches the fused kernel of bucket b over p's row chunk. The tensor maps must have been
// encoded with box rows = block_m (hidden) and weight_box_rows() (weight).
// `sms`: the persistent grid size.
void launch_fused(Bucket b, const CUtensorMap& map_hidden, const CUtensorMap& map_weight, const FusedParams& p,
                  bool logits_vec2, int sms, cudaStream_t stream);

}  // namespace detlogp::sm90

// The SM90 launch buckets without CUDA: the launch table itself (the X-macro every bucket is one row
// of), the bucket enum and the bucket names. Plain C++, so a build without CUDA knows the names
// DETLOGP_SM90_BUCKET accepts (core/env.hpp's sm90_bucket_names) from the same table as the
// launches (launch_table.hpp, launch_table.cu).
#pragma once

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

// The names in table order (bucket_info(b).name is the same string).
inline constexpr const char* kBucketNames[] = {
#define DETLOGP_SM90_BUCKET_NAME(name, ...) #name,
    DETLOGP_SM90_LAUNCH_TABLE(DETLOGP_SM90_BUCKET_NAME)
#undef DETLOGP_SM90_BUCKET_NAME
};
static_assert(sizeof(kBucketNames) / sizeof(kBucketNames[0]) == kBucketCount);

}  // namespace detlogp::sm90

// The launch table's rows instantiated: each bucket's kernels (with and without bias/logits, with
// and without the entropy sums, one target a row or [N, K], and the top-k candidate form) and its
// host-side description, both
// from DETLOGP_SM90_LAUNCH_TABLE.
#include "sm90/device/configs.cuh"
#include "sm90/kernels.cuh"
#include "sm90/launch_persistent.cuh"
#include "sm90/launch_table.hpp"

namespace detlogp::sm90 {
namespace {

template <template <class, bool, bool, bool, bool> class Kernel>
struct Schedule {
  template <class Cfg, bool kEntropy>
  static void launch_features(const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, int64_t units, int v,
                              int sms, cudaStream_t stream) {
    // The plain instantiation (neither bias nor logits output) is the trainer entry's. [N, K]
    // targets take the kMulti forms: the single-target kernels stay as they are.
    const bool plain = p.bias == nullptr && p.logits == nullptr;
    if (p.targets_per_row > 1) {
      if (plain)
        launch_persistent<Kernel<Cfg, true, kEntropy, true, false>::value, Cfg>(units, sms, stream, mh, mw, p, v);
      else
        launch_persistent<Kernel<Cfg, false, kEntropy, true, false>::value, Cfg>(units, sms, stream, mh, mw, p, v);
    } else if (plain) {
      launch_persistent<Kernel<Cfg, true, kEntropy, false, false>::value, Cfg>(units, sms, stream, mh, mw, p, v);
    } else {
      launch_persistent<Kernel<Cfg, false, kEntropy, false, false>::value, Cfg>(units, sms, stream, mh, mw, p, v);
    }
  }
  template <class Cfg>
  static void launch(const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2, int sms,
                     cudaStream_t stream) {
    const int64_t m_units = (int64_t{p.m_tiles} + Cfg::kClusterM - 1) / Cfg::kClusterM;
    const int64_t units = m_units * p.n_tiles;
    const int v = vec2 ? 1 : 0;
    // The top-k candidate path: one form (bias at run time, no logits, entropy or [N, K] targets).
    if (p.cand_max != nullptr)
      return launch_persistent<Kernel<Cfg, false, false, false, true>::value, Cfg>(units, sms, stream, mh, mw, p, v);
    if (p.usums != nullptr)
      launch_features<Cfg, true>(mh, mw, p, units, v, sms, stream);
    else
      launch_features<Cfg, false>(mh, mw, p, units, v, sms, stream);
  }
};

template <class Cfg, bool kPlain, bool kEntropy, bool kMulti, bool kCandidates>
struct PingpongKernel {
  static constexpr auto value = fused_pingpong_kernel<Cfg, kPlain, kEntropy, kMulti, kCandidates>;
};
template <class Cfg, bool kPlain, bool kEntropy, bool kMulti, bool kCandidates>
struct CooperativeKernel {
  static constexpr auto value = fused_cooperative_kernel<Cfg, kPlain, kEntropy, kMulti, kCandidates>;
};
using pingpong = Schedule<PingpongKernel>;
using cooperative = Schedule<CooperativeKernel>;

template <class Cfg>
constexpr BucketInfo info_of(const char* name) {
  return {name, Cfg::kTileRows, Cfg::kBlockN, Cfg::kClusterM};
}

}  // namespace

BucketInfo bucket_info(Bucket b) {
  switch (b) {
#define DETLOGP_SM90_INFO_CASE(name, schedule, ...) \
  case Bucket::name:                                \
    return info_of<__VA_ARGS__>(#name);
    DETLOGP_SM90_LAUNCH_TABLE(DETLOGP_SM90_INFO_CASE)
#undef DETLOGP_SM90_INFO_CASE
  }
  DETLOGP_FAIL("unknown SM90 bucket " << static_cast<int>(b));
}

void launch_fused(Bucket b, const CUtensorMap& mh, const CUtensorMap& mw, const FusedParams& p, bool vec2, int sms,
                  cudaStream_t stream) {
  switch (b) {
#define DETLOGP_SM90_LAUNCH_CASE(name, schedule, ...) \
  case Bucket::name:                                  \
    return schedule::launch<__VA_ARGS__>(mh, mw, p, vec2, sms, stream);
    DETLOGP_SM90_LAUNCH_TABLE(DETLOGP_SM90_LAUNCH_CASE)
#undef DETLOGP_SM90_LAUNCH_CASE
  }
  DETLOGP_FAIL("unknown SM90 bucket " << static_cast<int>(b));
}

}  // namespace detlogp::sm90

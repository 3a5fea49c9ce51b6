// The launch heuristics, as measured on an H200 (docs/perf.md): by rows, then by how evenly the
// weight tiles fill the SMs, then by the K walk's length and whether logits are stored.
#include "sm90/heuristics.hpp"

#include <algorithm>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "detlogp/error.hpp"

namespace detlogp::sm90 {
namespace {

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

Bucket select_bucket(int64_t rows, int64_t vocab_local, int64_t dim, bool stores_logits, int sms) {
  if (const auto v = detail::env_checked(kBucketEnv); v && *v != "auto") {
    for (int i = 0; i < kBucketCount; ++i)
      if (*v == kBucketNames[i]) return static_cast<Bucket>(i);
    DETLOGP_FAIL("internal error: " << kBucketEnv << "=" << *v << " passed the environment check");
  }
  if (rows <= 8)
    return most_even({Bucket::decode8_n128, Bucket::decode8_n192, Bucket::decode8_n256}, rows, vocab_local, sms);
  if (rows <= 64) return most_even({Bucket::decode, Bucket::decode_n192, Bucket::prefill}, rows, vocab_local, sms);
  // Without a logits output, cooperative 128 x 256 tiles with a non-overlapped epilogue: at D >= 4096
  // above 64 rows, and at D = 1024 and 2048 above 128 rows (measured 7-8 % faster than the ping-pong
  // from N = 256 to 8192 there, 3-4 % slower at N = 65 and 128). Launches that store the logits (the
  // stores would be exposed too) and shorter K walks keep the ping-pong overlap.
  if (!stores_logits && (dim >= 4096 || (dim >= 1024 && rows > 128))) return Bucket::coop256_persistent;
  return Bucket::prefill_c2;
}

Bucket select_edge_bucket(int64_t rows, int64_t cols, int64_t dim, int sms) {
  const auto forced = detail::env_checked(kBucketEnv);
  if ((forced && *forced != "auto") || rows <= 64) return select_bucket(rows, cols, dim, true, sms);
  return Bucket::decode;
}

}  // namespace detlogp::sm90

namespace detlogp::detail {

const std::vector<std::string>& sm90_bucket_names() {
  static const std::vector<std::string> names(std::begin(sm90::kBucketNames), std::end(sm90::kBucketNames));
  return names;
}

}  // namespace detlogp::detail

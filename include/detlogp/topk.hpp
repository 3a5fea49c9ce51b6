// The top-k output (docs/contract.md §12): the K real ids of a row with the largest scaled logits
// y (§3.3), in one total order, and their logp. One definition of the order and of the bounded
// list every backend and the merge keep, host and device.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/fpops.hpp"
#include "detlogp/rank.hpp"

namespace detlogp {

// The largest K of the top-k output.
inline constexpr int kMaxTopk = 128;

struct TopkEntry {
  float y;     // the scaled logit
  int64_t id;  // global vocabulary id; -1: no entry (a list that holds fewer than K)
};

// a comes before b: the larger y first, NaN before every number; equal y (+0 and -0 are equal),
// and two NaNs, the lower id first. A total order on (y, id) pairs of distinct ids, so the K first
// of any set of entries do not depend on the order in which they were offered.
DETLOGP_HD bool topk_before(TopkEntry a, TopkEntry b) {
  const bool an = fp::is_nan(a.y), bn = fp::is_nan(b.y);
  if (an || bn) return an && bn ? a.id < b.id : an;
  if (a.y != b.y) return a.y > b.y;
  return a.id < b.id;
}

// The 64-bit key of an entry (global id < 2^32): topk_key(a) > topk_key(b) exactly when
// topk_before(a, b). A number's key is its rank_key (the same order: larger y, then lower id); every
// NaN takes the largest image, above +inf's, so NaNs come first, by id.
DETLOGP_HD uint64_t topk_key(float y, int64_t id) {
  return fp::is_nan(y) ? (uint64_t{0xFFFFFFFFu} << 32) | (0xFFFFFFFFull - static_cast<uint64_t>(id)) : rank_key(y, id);
}

// Offers e to the list `list` of `count` entries (sorted by topk_before) of at most k: kept, in
// its place, if the list is not full or e comes before its last entry (which then leaves).
DETLOGP_HD void topk_offer(TopkEntry* list, int k, int& count, TopkEntry e) {
  if (count == k && !topk_before(e, list[k - 1])) return;
  int i = count < k ? count++ : k - 1;
  while (i > 0 && topk_before(e, list[i - 1])) {
    list[i] = list[i - 1];
    --i;
  }
  list[i] = e;
}

// Offers the lanes y[0, n), global ids first_id + c, to the list.
DETLOGP_HD void topk_offer_lanes(TopkEntry* list, int k, int& count, const float* y, int64_t n, int64_t first_id) {
  for (int64_t c = 0; c < n; ++c) topk_offer(list, k, count, {y[c], first_id + c});
}

// Offers a shard's list of k entries (y[j], ids[j]; id -1 where it holds fewer) to the list: a
// tensor-parallel merge offers the ranks' lists in rank order.
DETLOGP_HD void topk_offer_list(TopkEntry* list, int k, int& count, const float* y, const int64_t* ids) {
  for (int j = 0; j < k; ++j)
    if (ids[j] >= 0) topk_offer(list, k, count, {y[j], ids[j]});
}

// A shard's list of k as it travels: the count entries held, then id -1 and y -inf.
DETLOGP_HD void topk_store_list(const TopkEntry* list, int k, int count, float* y, int64_t* ids) {
  for (int j = 0; j < k; ++j) {
    y[j] = j < count ? list[j].y : fp::neg_inf();
    ids[j] = j < count ? list[j].id : -1;
  }
}

}  // namespace detlogp

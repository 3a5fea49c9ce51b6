// The rank order of the sampling program (docs/contract.md §11.2) and its 64-bit integer keys, which
// the GPU selections (the sampling cut, the top-k output) sort and compare instead of (y, id) pairs.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/fpops.hpp"
#include "detlogp/reduce.hpp"

namespace detlogp {

// Lane a comes before lane b: the larger y (IEEE comparison, -0 == +0), then the lower global id.
DETLOGP_HD bool rank_precedes(float y_a, int64_t id_a, float y_b, int64_t id_b) {
  return y_a > y_b || (y_a == y_b && id_a < id_b);
}

// The order-preserving integer image of a non-NaN y, with -0 and +0 one value.
DETLOGP_HD uint32_t rank_ord(float y) {
  const uint32_t b = fp::bits(normalize_zero(y));
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

// The 64-bit key of a lane (global id < 2^32): rank_key(a) > rank_key(b) exactly when a precedes b.
DETLOGP_HD uint64_t rank_key(float y, int64_t id) {
  return (static_cast<uint64_t>(rank_ord(y)) << 32) | (0xFFFFFFFFull - static_cast<uint64_t>(id));
}

// The id and the logit of a lane from its key (the logit as fl(y + 0): a -0 comes back as +0).
DETLOGP_HD int64_t rank_key_id(uint64_t key) { return static_cast<int64_t>(0xFFFFFFFFull - (key & 0xFFFFFFFFull)); }
DETLOGP_HD float rank_key_logit(uint64_t key) {
  const uint32_t o = static_cast<uint32_t>(key >> 32);
  return fp::from_bits((o & 0x80000000u) != 0 ? (o & 0x7FFFFFFFu) : ~o);
}

}  // namespace detlogp

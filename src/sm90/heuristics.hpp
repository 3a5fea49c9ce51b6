// Which launch bucket serves a launch: DETLOGP_SM90_BUCKET (a free axis) if set, else by size.
#pragma once

#include <cstdint>

#include "sm90/launch_table.hpp"

namespace detlogp::sm90 {

inline constexpr const char* kBucketEnv = "DETLOGP_SM90_BUCKET";

// Bucket for a launch of `rows` rows over V_local = vocab_local with hidden size `dim` (and fp32
// logits stored or not) on a GPU of `sms` SMs. DETLOGP_SM90_BUCKET (checked by core/env.cpp's knob
// table against the launch table's names) overrides the choice.
Bucket select_bucket(int64_t rows, int64_t vocab_local, int64_t dim, bool stores_logits, int sms);

// Bucket for the launch of a shard's edge columns (at most 126, their logits stored): above 64 rows
// the narrowest tile, 64 x 128 (`decode`), not prefill's 64 x 256, whose K walk takes twice as long
// for the same few real columns; every bucket gives the same bits (a free axis), and
// DETLOGP_SM90_BUCKET still overrides it.
Bucket select_edge_bucket(int64_t rows, int64_t cols, int64_t dim, int sms);

}  // namespace detlogp::sm90

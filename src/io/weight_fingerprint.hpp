// The weight-version fingerprint (docs/validation.md, section 3): one line of text naming the bytes of
// an lm_head, the same for every tensor-parallel split of it.
#pragma once

#include <string>
#include <vector>

#include "detlogp/tensor.hpp"

namespace detlogp::io {

// SHA-256 over the ASCII header "detlogp-weight-v1 bf16 rows=<R> cols=<D>\n" followed by the row-major
// bf16 bytes of the rank-ordered shards. The concatenation of the shards is the whole head, so any TP
// degree gives the value of TP = 1. Host memory (copy a device shard to the host first).
std::string weight_fingerprint(const std::vector<TensorView>& shards_in_rank_order);

}  // namespace detlogp::io

// The owned merge over rank-ordered partials. No floating-point reduction happens in transit:
// partials are placed side by side in rank order, which is ascending global tile order, and the
// same chain runs as for one shard.
#pragma once

#include <cstdint>
#include <vector>

#include "detlogp/detlogp.hpp"

namespace detlogp::tp {

// merge_partials (include/detlogp/detlogp.hpp): host memory on the CPU, CUDA memory with the
// device merge on `stream`.
void merge_owned(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets, int64_t ignore_index,
                 const MutableTensorView& logp, const MutableTensorView& lse, void* stream);

}  // namespace detlogp::tp

// The tile summary of docs/contract.md §5 for the CPU backends' epilogues: the same bits as
// detlogp::tile_summary, with the common case (a whole tile of finite logits) vectorized where the
// CPU has AVX-512. Everything else (a partial tile, a NaN or an infinity) takes the scalar
// definition itself.
#pragma once

#include <cstdint>

#include "detlogp/reduce.hpp"

namespace detlogp::cpu {

TileSummary fast_tile_summary(const float* y, int real_lanes);

// The vectorized path alone, for the tests: false (nothing written) where it does not apply (no
// AVX-512, or a lane that is not finite).
bool vector_tile_summary(const float* y, TileSummary& out);
// The vectorized expc on n lanes (n a multiple of 16), for the tests; false where there is none.
bool vector_expc(const float* x, float* e, int64_t n);

}  // namespace detlogp::cpu

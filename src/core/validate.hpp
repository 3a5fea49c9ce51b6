// Input validation shared by every entry point: every bad input gets a clear error naming the
// argument and its value, before anything is written.
#pragma once

#include "core/problem.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp::detail {

enum class EntryMode { full, partials };

// Checks shapes, dtypes, memory, strides and (for host memory) target and temperature values;
// returns the backend params struct. Output pointers are filled from `out` (full mode).
LogpProblem make_problem(const LinearLogpInputs& in, const LinearLogpOutputs* out, const ShardPartials* partials);

// Host-side value checks, also used by reduce_logits.
void check_targets_host(const void* targets, bool is_i64, int64_t rows, int64_t real_vocab, int64_t ignore_index);
void check_temperature_value(float t, const char* what, int64_t row);
void check_temperatures_host(const float* temps, int64_t rows);

}  // namespace detlogp::detail

// The validated problem of reduce_logits (the contract reducer over fp32 logits given from
// anywhere) and its implementation on the host (src/cpu/cpu_reduce.cpp).
#pragma once

#include <cstdint>

#include "detlogp/detlogp.hpp"

namespace detlogp::detail {

struct ReduceLogitsProblem {
  int64_t rows = 0;        // N
  int64_t vocab = 0;       // V: logits columns
  int64_t real_vocab = 0;  // columns >= real_vocab are padding
  int64_t ignore_index = kDefaultIgnoreIndex;

  const float* logits = nullptr;  // unscaled z [rows][logits_stride], host memory
  int64_t logits_stride = 0;
  const void* targets = nullptr;  // [rows][targets_per_row]
  bool targets_i64 = false;
  int64_t targets_per_row = 1;
  bool targets_2d = false;
  float temperature = 1.0f;
  const float* temperature_rows = nullptr;  // [rows] or null

  float* logp = nullptr;     // [rows][targets_per_row]
  float* lse = nullptr;      // [rows]
  float* entropy = nullptr;  // [rows] or null
};

// Shapes, dtypes, host memory, target and temperature values.
ReduceLogitsProblem make_reduce_logits_problem(const ReduceLogitsInputs& in, const MutableTensorView& logp,
                                               const MutableTensorView& lse, const MutableTensorView& entropy);

// logp and lse (and entropy) of every row: tile summaries of the scaled logits, the ascending chain.
void cpu_reduce_logits(const ReduceLogitsProblem& p);

}  // namespace detlogp::detail

// Input validation shared by every entry point: every bad input gets a clear error naming the
// argument and its value, before anything is written.
#pragma once

#include <initializer_list>
#include <string>

#include "core/problem.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp::detail {

enum class EntryMode { full, partials };

// Checks shapes, dtypes, memory, strides and (for host memory) target and temperature values;
// returns the backend params struct. Output pointers are filled from `out` (full mode).
LogpProblem make_problem(const LinearLogpInputs& in, const LinearLogpOutputs* out, const ShardPartials* partials);

// Tensor checks every entry point shares (messages name the argument and its value).
// `t` must live in hidden's memory (`expected`, `device`).
void check_memory(const TensorView& t, const char* name, Memory expected, int device);
// 2-D, of `dtype`, non-negative extents, rows not overlapping.
void check_matrix(const TensorView& t, const char* name, DType dtype);
// 1-D of `n` elements and one of `dtypes`, non-null data when n > 0.
void check_vector(const TensorView& t, const char* name, int64_t n, std::initializer_list<DType> dtypes);

// The serving entry's logits: [rows, vocab_local] f32, contiguous, in memory `mem` (device `dev`).
float* checked_logits(const MutableTensorView& logits, int64_t rows, int64_t vocab_local, Memory mem, int dev);

// hidden [N, D] and weight [rows, D], both bf16, in one memory: the checks every entry starts with.
// `vocab_name` / `vocab_role` name the weight's rows in messages ("V_local" / "shard").
struct HeadShape {
  int64_t rows;
  int64_t dim;
  int64_t vocab;
  Memory memory;
  int device;
};
HeadShape check_head(const LinearLogpInputs& in, const char* vocab_name, const char* vocab_role);

// The checks every entry on LinearLogpInputs starts with, in this order: check_head, targets,
// bias, temperature, temperature_rows, vocab_start >= 0. Fills the operands of `p` (all but
// real_vocab) and returns the weight's row count.
int64_t check_operands(const LinearLogpInputs& in, const char* vocab_name, const char* vocab_role, HeadOperands& p);
// in.real_vocab (> 0), or for -1 the end of a weight of `vocab` rows starting at in.vocab_start.
int64_t checked_real_vocab(const LinearLogpInputs& in, int64_t vocab, const char* vocab_name);
// Host memory: every target in [0, real_vocab) or ignore_index, every row temperature valid.
void check_host_values(const HeadOperands& p);

// The shortest decimal that reads back as t (nan, inf, -0 spelled so): how messages show a float.
std::string shortest(float t);

// Host-side value checks, also used by reduce_logits: rows * per_row targets, each in [0, real_vocab)
// or ignore_index; messages name targets[n] ([N] targets) or targets[n, k] (two_d: [N, K]).
void check_targets_host(const void* targets, bool is_i64, int64_t rows, int64_t real_vocab, int64_t ignore_index,
                        int64_t per_row = 1, bool two_d = false);
// The top-k outputs: both absent (returns 0) or topk_ids [N, K] i64 and topk_logp [N, K] f32,
// contiguous, 1 <= K <= min(kMaxTopk, real_vocab), in `memory`: returns K.
int64_t check_topk_outputs(const TensorView& ids, const TensorView& logp, int64_t rows, int64_t real_vocab,
                           Memory memory, int device);
// targets [N] or [N, K] (K in [1, kMaxTargetsPerRow], contiguous), i32 or i64: returns K (1 for [N]).
int64_t check_targets_tensor(const TensorView& targets, int64_t rows);
// logp shaped like the targets: [N] for [N] targets, [N, K] f32 contiguous for [N, K].
void check_logp_tensor(const TensorView& logp, const TensorView& targets, int64_t rows, int64_t per_row);
// The error for a temperature outside [kMinTemperature, kMaxTemperature], naming `what` (with
// [row] when row >= 0) and the value; the host checks and the device status both raise it.
std::string temperature_range_message(const char* what, int64_t row, float t);
void check_temperature_value(float t, const char* what, int64_t row);
void check_temperatures_host(const float* temps, int64_t rows);

}  // namespace detlogp::detail

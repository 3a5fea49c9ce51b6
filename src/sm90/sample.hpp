// The sampling program's kernel over a chunk of the serving logits (sample.cu): one CTA per row;
// the host check of the program's device-resident rows (backend.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/sample.hpp"

namespace detlogp::sm90 {

struct SampleRowsParams {
  detail::SampleProblem problem;  // device pointers: the program, keys, targets and outputs of every row
  int64_t row_begin = 0;          // the chunk's first row
  int64_t rows = 0;               // rows in the chunk
  const float* logits = nullptr;  // the chunk's z, [rows][problem.vocab_local]
  const float* lse = nullptr;     // the chunk's lse at each row's temperature (1 for T = 0), [rows]
  int64_t tiles_per_row = 0;      // ceil(real_vocab / 64)
  TileSummary* tiles = nullptr;   // scratch [rows][tiles_per_row]
  float* factors = nullptr;       // scratch [rows][tiles_per_row]
  uint8_t* outside = nullptr;     // [problem.rows] or null: 1 where a replayed target is outside the support
  // Few rows with a top-k cut: each row's slices' lists of their slice_k largest keys, [rows][slices][slice_k]
  // (launch_topk_slice_lists), merged by the row kernel for the rows whose k' <= slice_k; null: none.
  const uint64_t* slice_keys = nullptr;
  int32_t slices = 0;
  int32_t slice_k = 0;
  bool radix_only = false;  // every cut by radix selection (DETLOGP_SM90_SAMPLE_RADIX=1): a free axis
};

void launch_sample_rows(const SampleRowsParams& p, cudaStream_t stream);

// out[n] = temperature[n], or 1 where it is 0 (a greedy row): the fused kernel's temperatures for
// the program's rows, whose lse the row kernel takes.
void launch_program_temperatures(const float* temperature, float* out, int64_t rows, cudaStream_t stream);

// A device array the host reads back: its first `bytes`, or nothing when null.
struct DeviceArray {
  const void* device = nullptr;
  size_t bytes = 0;
};

// The program's per-row values held in device memory, read back after the work already on `stream`
// (one wait, `also` with them) and checked on the host (detail::check_program_rows): a bad value is
// refused, naming the argument, the row and the value, before the caller launches anything that
// writes. Returns also's host copy (empty for a null array).
// The program's device-resident rows read back (with `also`, one host wait) and checked; a bad value
// throws before anything is written.
struct ProgramReadBack {
  std::vector<uint8_t> also;  // the copy of `also`
  // The largest k' <= kMaxTopk of the rows with a top-k cut (real_vocab: the rows' lanes), 0 if none.
  int64_t largest_small_keep = 0;
};
ProgramReadBack check_device_program(const detail::ProgramOperands& program, int64_t rows, int64_t real_vocab,
                                     cudaStream_t stream, DeviceArray also);

}  // namespace detlogp::sm90

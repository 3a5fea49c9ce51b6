// The top-k output on the GPU (docs/contract.md §12): one CTA per row over a chunk of the serving
// logits (topk.cu); the SM90 backend runs the fused serving entry into those logits first.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace detlogp::sm90 {

// With few rows, one CTA a row leaves most multiprocessors idle and each row waits on one CTA's
// loads: the row's lanes are then split into slices of whole rounds of the row reads, each slice's
// top K found by its own CTA into a scratch list, and a second kernel merges a row's slice lists
// (an exact selection over distinct keys: the same ids and bits as one CTA a row).
inline constexpr int kMaxTopkSlices = 16;
struct TopkSplit {
  int32_t slices = 1;
  int64_t slice_lanes = 0;  // lanes of every slice but the last (a multiple of the row-read round)
};
TopkSplit topk_split(int64_t rows, int64_t lanes, int sms);

struct TopkRowsParams {
  const float* logits = nullptr;  // the chunk's z [rows][logits_stride]; column c is global id vocab_start + c
  int64_t logits_stride = 0;
  int64_t rows = 0;              // rows in the chunk
  int64_t row_begin = 0;         // the chunk's first row of the call: row n of the chunk is call row row_begin + n
  int64_t lanes = 0;             // the shard's real lanes: columns [0, lanes) (ids below real_vocab)
  int64_t vocab_start = 0;       // global id of column 0
  float inv_temperature = 1.0f;  // fl(1 / T) without temperature_rows
  const float* temperature_rows = nullptr;  // [call rows] or null
  int32_t k = 0;                            // K, 1..kMaxTopk
  // Full mode: lse [call rows] and the outputs ids, logp [call rows][k]. Partial mode (lse null): the
  // shard's list, ids and logit [call rows][k], id -1 and logit -inf past the shard's real lanes.
  const float* lse = nullptr;
  int64_t* ids = nullptr;
  float* logp = nullptr;
  float* logit = nullptr;
  // The split (topk_split): slice_keys [rows][slices][k] of scratch when slices > 1.
  int32_t slices = 1;
  int64_t slice_lanes = 0;
  uint64_t* slice_keys = nullptr;
};

void launch_topk_rows(const TopkRowsParams& p, cudaStream_t stream);

}  // namespace detlogp::sm90

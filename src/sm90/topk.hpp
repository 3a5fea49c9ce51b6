// The top-k output on the GPU (docs/contract.md §12): one CTA per row over a chunk of the serving
// logits (topk.cu); the SM90 backend runs the fused serving entry into those logits first.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace detlogp::sm90 {

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
};

void launch_topk_rows(const TopkRowsParams& p, cudaStream_t stream);

}  // namespace detlogp::sm90

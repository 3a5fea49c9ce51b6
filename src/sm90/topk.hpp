// The top-k output on the GPU (docs/contract.md §12): one CTA per row over a chunk of the serving
// logits (topk.cu), the SM90 backend running the fused serving entry into those logits first; or,
// with many rows, one CTA per row over the fused trainer run's lane-group candidates.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace detlogp::sm90 {

// With few rows, one CTA a row leaves most multiprocessors idle and each row waits on one CTA's
// loads: the row's lanes are then split into slices of whole rounds of the row reads, each slice's
// top K found by its own CTA into a scratch list, and a second kernel merges a row's slice lists
// (an exact selection over distinct keys: the same ids and bits as one CTA a row).
// A row's slices hold at most kMaxSliceKeys keys together (slices * K), merged in shared memory: so
// up to 16 slices at K = 128 and more at smaller K, each at least one round of the row reads.
inline constexpr int kMaxSliceKeys = 2048;
struct TopkSplit {
  int32_t slices = 1;
  int64_t slice_lanes = 0;  // lanes of every slice but the last (a multiple of the row-read round)
};
TopkSplit topk_split(int64_t rows, int64_t lanes, int sms, int64_t k);

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
// The split's first kernel alone (p.slices > 1): the slices' lists into p.slice_keys, for a row
// kernel that merges them itself (the sampling program's top-k cut).
void launch_topk_slice_lists(const TopkRowsParams& p, cudaStream_t stream);

// The candidate path (full mode, many rows): the fused trainer run keeps no logits, only each
// lane group's max, second and first-max column (FusedParams::cand_*); a row's top K are then the
// top K of its groups' maxima, except in groups whose second could reach the K-th of them (or whose
// max is NaN, or zero, whose sign the key does not keep): those groups' lanes are recomputed
// exactly (wgmma_lane.cuh) and take their maxima's place. The same ids and bits as the logits path.
// The rows [kTopkCandidateRows, kTopkCandidateMaxRows) for which a full-mode call takes the
// candidate path: below them the split row kernel over the serving logits (topk_split) keeps the
// multiprocessors busy, and the logits are small; from 1024 rows on the logits path measured as
// fast or faster on the H200 (docs/perf.md), its row kernel a smaller share of the call.
inline constexpr int64_t kTopkCandidateRows = 128;
inline constexpr int64_t kTopkCandidateMaxRows = 1024;

struct TopkCandidatesParams {
  const float* cand_max = nullptr;  // [rows][groups] of the chunk
  const float* cand_second = nullptr;
  const uint8_t* cand_lane = nullptr;
  int64_t groups = 0;     // local tiles * kGroupsPerTile
  int64_t rows = 0;       // rows in the chunk
  int64_t row_begin = 0;  // the chunk's first row of the call
  int64_t lanes = 0;      // real lanes: columns [0, lanes), global ids from 0
  // The lanes' recomputation: hidden [call rows][hidden_stride] and weight [V][weight_stride], bf16.
  const uint16_t* hidden = nullptr;
  int64_t hidden_stride = 0;
  const uint16_t* weight = nullptr;
  int64_t weight_stride = 0;
  int64_t dim = 0;
  const float* bias = nullptr;  // [V] or null
  float inv_temperature = 1.0f;
  const float* temperature_rows = nullptr;  // [call rows] or null
  int32_t k = 0;
  const float* lse = nullptr;  // [call rows]
  int64_t* ids = nullptr;      // [call rows][k]
  float* logp = nullptr;       // [call rows][k]
  // [rows] scratch: a row the warp kernel could not decide (a lane's list may have dropped one of
  // its K largest group keys, or a group is flagged), left to the CTA kernel with the recomputation.
  uint8_t* undecided = nullptr;
};

void launch_topk_candidates(const TopkCandidatesParams& p, cudaStream_t stream);

}  // namespace detlogp::sm90

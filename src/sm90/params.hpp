// The parameter blocks of the SM90 kernels, framework-free plain structs that the host fills and
// the kernels take by value: the fused forward, the combine after it, the tensor-parallel merge,
// the partial mode's ownership flags and the logit gradient (plain, or the sampling replay's).
#pragma once

#include <cstdint>

#include "core/grad_logits.hpp"
#include "core/straddle.hpp"
#include "cuda/status.hpp"
#include "detlogp/reduce.hpp"

namespace detlogp::sm90 {

using cuda::DeviceStatus;
using cuda::kStatusOk;
using cuda::load_target;
using cuda::ValidateParams;

// One launch of the fused kernel covers rows [row_begin, row_end) (a chunk of N).
struct FusedParams {
  int64_t row_begin;
  int64_t row_end;
  int64_t vocab_local;
  int64_t vocab_start;
  int64_t real_vocab;
  int64_t ignore_index;
  int32_t k_blocks;   // ceil(D / 64)
  int32_t m_tiles;    // ceil((row_end - row_begin) / BLOCK_M)
  int32_t n_tiles;    // ceil(V_local / BLOCK_N)
  int32_t group_m;    // rasterization: M tiles walked together for L2 reuse of the weight
  const float* bias;  // [V_local] or null
  const void* targets;
  int32_t targets_i64;
  float temperature;
  float inv_temperature;          // inverse_temperature(temperature), computed on the host
  const float* temperature_rows;  // [N] or null
  float* logits;                  // [N][logits_stride] unscaled z of columns [0, V_local), or null (trainer entry)
  int64_t logits_stride;          // V_local, or more where the launch covers part of a shard's columns
  TileSummary* summaries;         // [row - row_begin][local_tiles]
  float* usums;                   // [row - row_begin][local_tiles] entropy sums u_g (entropy launches), or null
  int64_t local_tiles;
  int64_t whole_tiles;  // local tiles [0, whole_tiles) have all 64 lanes real (whole_local_tiles)
  float* target_logit;  // [row - row_begin][targets_per_row]: y_t written by its single owner
  const DeviceStatus* status;
  // Trainer entry: the kernel validates the inputs itself (one idle producer warp of CTA 0) and
  // writes the status the combine reads, instead of a separate validation kernel; it writes only
  // workspace, so it need not wait for the verdict.
  int32_t validate_in_kernel;
  // K of [N, K] targets (the kernels' kMulti form, K > 1): targets [N][K], target_logit
  // [row - row_begin][K]. In validate_in_kernel's padding, so the single-target kernels' parameter
  // layout (and their SASS) stays as it is.
  int32_t targets_per_row = 1;
  ValidateParams validate;
  // The top-k output's candidate path (the kernels' kCandidates form, full mode): per row and lane
  // group g = local tile * kGroupsPerTile + q (the 16 lanes 8 j + 2 q + e of the tile, one thread's
  // of the accumulator fragment), [row - row_begin][local_tiles * kGroupsPerTile] each: the group's
  // largest y, its second largest y, and the column (0..63) in the tile of its first lane equal to
  // the largest (kNoCandidateLane: no real lane). Null otherwise.
  float* cand_max = nullptr;
  float* cand_second = nullptr;
  uint8_t* cand_lane = nullptr;
};

inline constexpr int kGroupsPerTile = 4;
inline constexpr uint8_t kNoCandidateLane = 0xFF;

struct CombineParams {
  int64_t row_begin;
  int64_t rows;  // rows of this chunk
  int64_t tiles;
  const TileSummary* summaries;  // [rows][tiles]
  const float* target_logit;     // [rows][targets_per_row]
  const void* targets;
  int32_t targets_i64;
  int64_t ignore_index;
  float* logp;         // [N]
  float* lse;          // [N]
  const float* usums;  // [rows][tiles] entropy sums, with entropy
  float* entropy;      // [N] or null
  const DeviceStatus* status;
  int32_t targets_per_row = 1;  // K: targets, target_logit and logp are [.][K]
};

// A run of consecutive global tiles of every row: [rows][tiles] summaries, y_t ([rows][K]) and, for a
// tensor-parallel rank, its ownership flags (null: owns every non-ignored row). A rank whose
// shard completes a tile straddling its start has that tile's summary
// (and entropy sum) as `head` [rows], chained right before its own tiles.
struct MergeSegment {
  const TileSummary* summaries;
  int64_t tiles;
  const float* target_logit;
  const uint8_t* owned;
  const float* usums;  // [rows][tiles] entropy sums: set on every segment when the merge writes entropy
  const TileSummary* head;
  const float* head_usum;
};

// The owned merge over rank-ordered partials, segments in ascending tile order. They travel in
// the kernel parameters (no allocation, no copy: the merge can be captured in a CUDA graph).
inline constexpr int kMaxMergeSegments = 64;
struct MergeParams {
  int64_t rows;
  MergeSegment segments[kMaxMergeSegments];
  int32_t count;
  const void* targets;  // [rows][targets_per_row]
  int32_t targets_i64;
  int64_t ignore_index;
  float* logp;                  // [rows][targets_per_row]
  float* lse;                   // [rows]
  float* entropy;               // [rows] or null
  int32_t targets_per_row = 1;  // K: targets, the segments' target_logit and owned, and logp are [rows][K]
};

// The straddling tiles of a merge (core/straddle.hpp's plan, in the kernel parameters): tile k's
// summary for row r goes to summaries[k * rows + r] (and its entropy sum to usums, when non-null).
inline constexpr int kMaxStraddleRuns = 2 * kMaxMergeSegments;
struct StraddleParams {
  int64_t rows;
  int32_t count;  // straddling tiles
  detail::StraddleTile tiles[kMaxMergeSegments];
  detail::EdgeRun runs[kMaxStraddleRuns];
  TileSummary* summaries;  // [count][rows]
  float* usums;            // [count][rows] or null
};

// Partial mode of a shard off the tile grid: the fused launch over its edge columns wrote their z
// to edge_z [rows][edge_cols] (head columns, then tail columns); this adds the bias, stores the
// serving logits, scales, exports the real lanes' y as the edge lanes and sets y_t where the target
// is one of those columns.
struct EdgeLanesParams {
  int64_t rows;
  int64_t vocab_start;
  int64_t vocab_local;
  int32_t head_cols;   // edge columns [0, head_cols): local columns [0, head_cols)
  int32_t head_lanes;  // the real ones among them (a prefix)
  int32_t tail_lanes;  // edge columns [head_cols, head_cols + tail_lanes): the shard's last columns
  const float* edge_z;
  const float* bias;   // [V_local] or null
  float* logits;       // [rows][V_local] or null
  float* edge_logits;  // [rows][head_lanes + tail_lanes]
  const void* targets;
  int32_t targets_i64;
  int64_t ignore_index;
  float inv_temperature;
  const float* temperature_rows;
  float* target_logit;  // [rows][targets_per_row]
  const DeviceStatus* status;
  int32_t targets_per_row = 1;
};

struct PartialOwnerParams {
  int64_t rows;
  const void* targets;
  int32_t targets_i64;
  int64_t ignore_index;
  int64_t vocab_start;
  int64_t vocab_local;
  float* target_logit;    // [rows][targets_per_row]
  uint8_t* target_owned;  // [rows][targets_per_row]
  const DeviceStatus* status;
  int32_t targets_per_row = 1;
};

// One launch covers the whole problem (no workspace, so no chunking of N).
struct GradLogitsParams {
  int64_t rows;          // N
  int64_t cols;          // C: columns of the chunk
  int64_t real_cols;     // chunk columns [0, real_cols) have global ids < real_vocab
  int64_t vocab_start;   // global id of chunk column 0
  int64_t ignore_index;  //
  int32_t k_blocks;      // ceil(D / 64)
  int32_t m_tiles;       // ceil(N / WgM)
  int32_t n_tiles;       // ceil(C / BLOCK_N)
  int32_t group_m;       // rasterization: M tiles walked together for L2 reuse of the weight
  const float* bias;     // [C] or null
  const void* targets;   // [N] global ids
  int32_t targets_i64;
  float temperature;
  const float* temperature_rows;  // [N] or null
  const float* lse;               // [N]
  const float* g_logp;            // [N] or null (zeros)
  const float* g_lse;             // [N] or null (zeros)
  const float* entropy;           // [N]: the forward's H, read where g_entropy is set
  const float* g_entropy;         // [N] or null: no entropy term
  uint16_t* dz;                   // bf16 bits [N][dz_stride]
  int64_t dz_stride;
  const DeviceStatus* status;
  // The sampling replay's gradient (sampled_grad_logit; the kernel's kSampled instantiation): the
  // program (its temperature replaces temperature above) and the replay's per-row outputs.
  int64_t real_vocab;
  detail::SampledGradOperands replay;
};

// The kernels' parameters of a validated problem (the launch fields, k_blocks and the tile counts,
// are the recomputing kernel's to fill).
inline GradLogitsParams grad_params(const detail::GradLogitsProblem& p, const DeviceStatus* status) {
  GradLogitsParams g{};
  g.rows = p.rows;
  g.cols = p.cols;
  g.real_cols = p.real_cols();
  g.vocab_start = p.vocab_start;
  g.ignore_index = p.ignore_index;
  g.bias = p.bias;
  g.targets = p.targets;
  g.targets_i64 = p.targets_i64 ? 1 : 0;
  g.temperature = p.temperature;
  g.temperature_rows = p.temperature_rows;
  g.lse = p.lse;
  g.g_logp = p.g_logp;
  g.g_lse = p.g_lse;
  g.entropy = p.entropy;
  g.g_entropy = p.g_entropy;
  g.dz = p.dz;
  g.dz_stride = p.dz_stride;
  g.status = status;
  g.real_vocab = p.real_vocab;
  g.replay = p.replay;
  return g;
}

}  // namespace detlogp::sm90

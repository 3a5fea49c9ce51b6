// Shared host/device definitions of the SM90 backend: CUDA error checks, the device status word
// of input validation, and the parameter blocks of the three kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "detlogp/error.hpp"
#include "detlogp/reduce.hpp"
#include "sm90/sm90_tile_schedule.hpp"

// Every CUDA runtime call and launch goes through this: throws detlogp::Error with file:line and
// the CUDA error name. Sticky errors (a faulted context) cannot be recovered and say so.
#define DETLOGP_CUDA_CHECK(expr)                                                                  \
  do {                                                                                            \
    const cudaError_t detlogp_err_ = (expr);                                                      \
    if (detlogp_err_ != cudaSuccess) {                                                            \
      DETLOGP_FAIL("CUDA call failed: " #expr " -> " << cudaGetErrorName(detlogp_err_) << " ("    \
                                                     << cudaGetErrorString(detlogp_err_) << ")"); \
    }                                                                                             \
  } while (0)

// Checks the launch itself (bad configuration, too much shared memory): kernels never assert.
#define DETLOGP_CUDA_CHECK_LAUNCH() DETLOGP_CUDA_CHECK(cudaGetLastError())

namespace detlogp::sm90 {

// Written by the validation kernel (always, code 0 when every row is valid) and read by every
// later kernel of the call: a non-zero code makes them exit before writing anything.
struct DeviceStatus {
  int32_t code = 0;  // kStatusOk, kStatusBadTarget, kStatusBadTemperature
  int32_t pad = 0;
  int64_t row = -1;       // first offending row
  int64_t target = 0;     // its target (kStatusBadTarget)
  float temperature = 0;  // its temperature (kStatusBadTemperature)
  float pad2 = 0;
};
inline constexpr int32_t kStatusOk = 0;
inline constexpr int32_t kStatusBadTarget = 1;
inline constexpr int32_t kStatusBadTemperature = 2;

// A host-mapped copy of the status word: the validation kernel writes the status, then (after a
// system-scope fence) the call's sequence number, so the host learns the verdict as soon as the
// validation has run, without waiting for the rest of the call.
struct HostStatusSlot {
  DeviceStatus status;
  uint64_t seq = 0;
};

struct ValidateParams {
  int64_t rows;
  const void* targets;
  int targets_i64;
  int64_t real_vocab;
  int64_t ignore_index;
  const float* temperature_rows;  // may be null
  DeviceStatus* status;
  HostStatusSlot* host_slot = nullptr;  // device pointer of mapped host memory, or null
  uint64_t seq = 0;
};

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
  float* logits;                  // [N][V_local] unscaled z, or null (trainer entry)
  TileSummary* summaries;         // [row - row_begin][local_tiles]
  int64_t local_tiles;
  int64_t whole_tiles;  // local tiles [0, whole_tiles) have all 64 lanes real (whole_local_tiles)
  float* target_logit;  // [row - row_begin]: y_t written by its single owner
  const DeviceStatus* status;
  // Trainer entry: the kernel validates the inputs itself (one idle producer warp of CTA 0) and
  // writes the status the combine reads, instead of a separate validation kernel; it writes only
  // workspace, so it need not wait for the verdict.
  int32_t validate_in_kernel;
  ValidateParams validate;
};

struct CombineParams {
  int64_t row_begin;
  int64_t rows;  // rows of this chunk
  int64_t tiles;
  const TileSummary* summaries;  // [rows][tiles]
  const float* target_logit;     // [rows]
  const void* targets;
  int32_t targets_i64;
  int64_t ignore_index;
  float* logp;  // [N]
  float* lse;   // [N]
  const DeviceStatus* status;
};

// A run of consecutive global tiles of every row: [rows][tiles] summaries, y_t and, for a
// tensor-parallel rank, its ownership flags (null: owns every non-ignored row).
struct MergeSegment {
  const TileSummary* summaries;
  int64_t tiles;
  const float* target_logit;
  const uint8_t* owned;
};

// The owned merge over rank-ordered partials, segments in ascending tile order. They travel in
// the kernel parameters (no allocation, no copy: the merge can be captured in a CUDA graph).
inline constexpr int kMaxMergeSegments = 64;
struct MergeParams {
  int64_t rows;
  MergeSegment segments[kMaxMergeSegments];
  int32_t count;
  const void* targets;  // [rows]
  int32_t targets_i64;
  int64_t ignore_index;
  float* logp;  // [rows]
  float* lse;   // [rows]
};

struct PartialOwnerParams {
  int64_t rows;
  const void* targets;
  int32_t targets_i64;
  int64_t ignore_index;
  int64_t vocab_start;
  int64_t vocab_local;
  float* target_logit;
  uint8_t* target_owned;
  const DeviceStatus* status;
};

__host__ __device__ inline int64_t load_target(const void* targets, int is_i64, int64_t row) {
  return is_i64 ? static_cast<const int64_t*>(targets)[row] : static_cast<const int32_t*>(targets)[row];
}

// Host-side launchers (sm90_combine_chain.cu).
void launch_validate(const ValidateParams& p, cudaStream_t stream);
// programmatic: a programmatic dependent launch (its launch overlaps the fused kernel's tail).
void launch_combine(const CombineParams& p, cudaStream_t stream, bool programmatic = false);
void launch_partial_owner(const PartialOwnerParams& p, cudaStream_t stream);
void launch_merge(const MergeParams& p, cudaStream_t stream);

}  // namespace detlogp::sm90

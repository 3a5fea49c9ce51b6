// The per-row kernels around the fused kernel: input validation (device-resident targets and
// temperatures, no device asserts), the contract chain over a row's tile summaries (full mode),
// and target ownership flags (partial mode). No atomics anywhere.
#include <cfloat>
#include <climits>

#include "sm90/sm90_common.hpp"
#include "sm90/sm90_validate.cuh"

namespace detlogp::sm90 {
namespace {

constexpr int kValidateThreads = 1024;
// The chain: one warp per row, 8 rows per CTA. With one 256-thread CTA per row the combine took
// 84 us at N = 4096 and 26 us at N = 1024 (torch profiler, H200; docs/perf-notes.md run 46),
// against ~2-3 k cycles of serial fma chain per row.
constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = 32 * kCombineWarps;
constexpr int kWarpChunk = 512;  // tiles staged in shared memory per warp per chain step
static_assert(kWarpChunk % 32 == 0 && kWarpChunk % 4 == 0, "a chunk is whole lane rounds and float4 groups");

// One CTA: finds the first invalid row of each kind with a block min (deterministic, no atomics)
// and always writes the status word.
__global__ void __launch_bounds__(kValidateThreads) validate_inputs_kernel(const ValidateParams p) {
  __shared__ int64_t bad_target[kValidateThreads];
  __shared__ int64_t bad_temp[kValidateThreads];
  scan_rows(p, threadIdx.x, kValidateThreads, bad_target[threadIdx.x], bad_temp[threadIdx.x]);
  __syncthreads();
  for (int width = kValidateThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      bad_target[threadIdx.x] = min(bad_target[threadIdx.x], bad_target[threadIdx.x + width]);
      bad_temp[threadIdx.x] = min(bad_temp[threadIdx.x], bad_temp[threadIdx.x + width]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) publish_status(p, bad_target[0], bad_temp[0]);
}

// One warp per row. M = max over all tile maxima (exact, so the parallel order is free). Then the
// ascending chain S <- fma(s_g, expc(m_g - M), S) over g = 0, 1, ... (reduce.hpp chain_step):
// the lanes compute the factors expc(m_g - M) of a chunk of tiles in parallel into the warp's
// shared memory and lane 0 runs the sequential fma chain over them in ascending g; then
// finalize_row. The row's tiles are the concatenation of `count` segments in ascending global
// tile order (one segment in full mode, one per tensor-parallel rank in the merge); y_t comes from
// the segment that owns the target (owned == null: the segment owns every non-ignored row).
__device__ void chain_row_warp(const MergeSegment* segments, int count, int64_t r, int64_t row, const void* targets,
                               int targets_i64, int64_t ignore_index, float* logp, float* lse) {
  __shared__ float4 stage_sum[kCombineWarps][kWarpChunk / 4];
  __shared__ float4 stage_scale[kCombineWarps][kWarpChunk / 4];
  const int lane = threadIdx.x % 32;
  float* const sums = reinterpret_cast<float*>(stage_sum[threadIdx.x / 32]);
  float* const scales = reinterpret_cast<float*>(stage_scale[threadIdx.x / 32]);

  float global_max = fp::neg_inf();
  for (int s = 0; s < count; ++s) {
    const TileSummary* tiles = segments[s].summaries + r * segments[s].tiles;
#pragma unroll 4
    for (int64_t g = lane; g < segments[s].tiles; g += 32) global_max = chain_max(global_max, tiles[g].max);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2)
    global_max = chain_max(global_max, __shfl_xor_sync(0xFFFFFFFFu, global_max, off));

  float sum = 0.0f;
  for (int s = 0; s < count; ++s) {
    const TileSummary* tiles = segments[s].summaries + r * segments[s].tiles;
    for (int64_t base = 0; base < segments[s].tiles; base += kWarpChunk) {
      const int64_t left = segments[s].tiles - base;
      const int n = static_cast<int>(left < kWarpChunk ? left : kWarpChunk);
#pragma unroll 4
      for (int i = lane; i < n; i += 32) {
        const TileSummary ts = tiles[base + i];
        sums[i] = ts.sum;
        scales[i] = chain_factor_or_skip(ts, global_max);  // off the serial path
      }
      __syncwarp();
      if (lane == 0) {  // the serial path: one dependent fma per tile, operands loaded a round ahead
        const float4* s4 = stage_sum[threadIdx.x / 32];
        const float4* f4 = stage_scale[threadIdx.x / 32];
        constexpr int kRound = 8;  // float4 groups per round: 32 fmas (~128 cycles) cover a load
        const int rounds = n / (4 * kRound);
        float4 a[kRound], b[kRound];
#pragma unroll
        for (int k = 0; k < kRound; ++k) {
          a[k] = rounds > 0 ? s4[k] : float4{};
          b[k] = rounds > 0 ? f4[k] : float4{};
        }
        for (int q = 0; q < rounds; ++q) {
          float4 next_a[kRound], next_b[kRound];
          const int next = q + 1 < rounds ? (q + 1) * kRound : q * kRound;  // the last round reloads itself
#pragma unroll
          for (int k = 0; k < kRound; ++k) {
            next_a[k] = s4[next + k];
            next_b[k] = f4[next + k];
          }
#pragma unroll
          for (int k = 0; k < kRound; ++k) {
            sum = chain_fma(sum, a[k].x, b[k].x);
            sum = chain_fma(sum, a[k].y, b[k].y);
            sum = chain_fma(sum, a[k].z, b[k].z);
            sum = chain_fma(sum, a[k].w, b[k].w);
          }
#pragma unroll
          for (int k = 0; k < kRound; ++k) {
            a[k] = next_a[k];
            b[k] = next_b[k];
          }
        }
        for (int i = 4 * kRound * rounds; i < n; ++i) sum = chain_fma(sum, sums[i], scales[i]);
      }
      __syncwarp();  // the stage is rewritten by the next chunk
    }
  }
  if (lane != 0) return;
  const int64_t t = load_target(targets, targets_i64, row);
  const bool ignored = t == ignore_index;
  float y_t = 0.0f;  // no read for an ignored row
  if (!ignored) {
    for (int s = 0; s < count; ++s)
      if (segments[s].owned == nullptr || segments[s].owned[r] != 0) y_t = segments[s].target_logit[r];
  }
  const RowResult res = finalize_row(global_max, sum, y_t, ignored);
  logp[row] = res.logp;
  lse[row] = res.lse;
}

__global__ void __launch_bounds__(kCombineThreads) combine_rows_kernel(const CombineParams p) {
  // When launched as a programmatic dependent of the fused kernel (decode sizes), its launch
  // overlaps the fused kernel's tail; this waits for the whole fused grid and its memory (a
  // no-op for a plain launch).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (p.status->code != kStatusOk) return;
  const int64_t r = int64_t{blockIdx.x} * kCombineWarps + threadIdx.x / 32;
  if (r >= p.rows) return;  // whole warps: no block barrier follows
  const MergeSegment whole{p.summaries, p.tiles, p.target_logit, nullptr};
  chain_row_warp(&whole, 1, r, p.row_begin + r, p.targets, p.targets_i64, p.ignore_index, p.logp, p.lse);
}

static_assert(sizeof(MergeParams) <= 4096, "merge parameters must fit the 4 KiB kernel parameter space");
__global__ void __launch_bounds__(kCombineThreads) merge_rows_kernel(const __grid_constant__ MergeParams p) {
  const int64_t r = int64_t{blockIdx.x} * kCombineWarps + threadIdx.x / 32;
  if (r >= p.rows) return;  // whole warps: no block barrier follows
  chain_row_warp(p.segments, p.count, r, r, p.targets, p.targets_i64, p.ignore_index, p.logp, p.lse);
}

// Partial mode: ownership flags for every row, +0 target logits for rows this shard does not own
// (the owner's y_t is written by the fused kernel, disjoint rows).
__global__ void partial_owner_kernel(const PartialOwnerParams p) {
  if (p.status->code != kStatusOk) return;
  const int64_t row = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (row >= p.rows) return;
  const int64_t t = load_target(p.targets, p.targets_i64, row);
  const bool owned = t != p.ignore_index && t >= p.vocab_start && t < p.vocab_start + p.vocab_local;
  p.target_owned[row] = owned ? 1 : 0;
  if (!owned) p.target_logit[row] = 0.0f;
}

}  // namespace

void launch_validate(const ValidateParams& p, cudaStream_t stream) {
  validate_inputs_kernel<<<1, kValidateThreads, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_combine(const CombineParams& p, cudaStream_t stream, bool programmatic) {
  DETLOGP_CHECK(p.rows < (int64_t{1} << 31), "combine grid of " << p.rows << " rows out of range");
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>((p.rows + kCombineWarps - 1) / kCombineWarps));
  config.blockDim = dim3(kCombineThreads);
  config.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = programmatic ? 1 : 0;
  DETLOGP_CUDA_CHECK(cudaLaunchKernelEx(&config, combine_rows_kernel, p));
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_merge(const MergeParams& p, cudaStream_t stream) {
  DETLOGP_CHECK(p.rows < (int64_t{1} << 31), "merge grid of " << p.rows << " rows out of range");
  DETLOGP_CHECK(p.count >= 1 && p.count <= kMaxMergeSegments,
                "the device merge takes 1.." << kMaxMergeSegments << " ranks, got " << p.count);
  if (p.rows == 0) return;
  merge_rows_kernel<<<static_cast<unsigned>((p.rows + kCombineWarps - 1) / kCombineWarps), kCombineThreads, 0,
                      stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_partial_owner(const PartialOwnerParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.rows + 255) / 256;
  partial_owner_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace detlogp::sm90

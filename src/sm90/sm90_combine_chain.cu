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
constexpr int kCombineThreads = 256;  // one CTA per row
constexpr int kChainChunk = 2048;     // tiles staged in shared memory per chain step

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

// One CTA per row. M = max over all tile maxima (exact, so the parallel order is free). Then the
// ascending chain S <- fma(s_g, expc(m_g - M), S) over g = 0, 1, ... (reduce.hpp chain_step):
// the CTA computes the factors expc(m_g - M) of a chunk of tiles in parallel into shared memory
// and one thread runs the sequential fma chain over them in ascending g; then finalize_row.
// The row's tiles are the concatenation of `count` segments in ascending global tile order (one
// segment in full mode, one per tensor-parallel rank in the merge); y_t comes from the segment
// that owns the target (owned == null: the segment owns every non-ignored row).
__device__ void chain_row(const MergeSegment* segments, int count, int64_t r, int64_t row, const void* targets,
                          int targets_i64, int64_t ignore_index, float* logp, float* lse) {
  __shared__ float warp_max[kCombineThreads / 32];
  __shared__ float chunk_sum[kChainChunk];
  __shared__ float chunk_scale[kChainChunk];
  const int tid = threadIdx.x;

  float global_max = fp::neg_inf();
  for (int s = 0; s < count; ++s) {
    const TileSummary* tiles = segments[s].summaries + r * segments[s].tiles;
#pragma unroll 4
    for (int64_t g = tid; g < segments[s].tiles; g += kCombineThreads) global_max = chain_max(global_max, tiles[g].max);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2)
    global_max = chain_max(global_max, __shfl_xor_sync(0xFFFFFFFFu, global_max, off));
  if (tid % 32 == 0) warp_max[tid / 32] = global_max;
  __syncthreads();
  global_max = warp_max[0];
#pragma unroll
  for (int w = 1; w < kCombineThreads / 32; ++w) global_max = chain_max(global_max, warp_max[w]);

  float sum = 0.0f;
  for (int s = 0; s < count; ++s) {
    const TileSummary* tiles = segments[s].summaries + r * segments[s].tiles;
    for (int64_t base = 0; base < segments[s].tiles; base += kChainChunk) {
      const int64_t left = segments[s].tiles - base;
      const int n = static_cast<int>(left < kChainChunk ? left : kChainChunk);
      for (int i = tid; i < n; i += kCombineThreads) {
        const TileSummary ts = tiles[base + i];
        chunk_sum[i] = ts.sum;
        chunk_scale[i] = chain_factor_or_skip(ts, global_max);  // off the serial path
      }
      __syncthreads();
      if (tid == 0) {  // the serial path: one dependent fma per tile, operands loaded ahead
#pragma unroll 16
        for (int i = 0; i < n; ++i) sum = chain_fma(sum, chunk_sum[i], chunk_scale[i]);
      }
      __syncthreads();
    }
  }
  if (tid != 0) return;
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
  const MergeSegment whole{p.summaries, p.tiles, p.target_logit, nullptr};
  chain_row(&whole, 1, blockIdx.x, p.row_begin + blockIdx.x, p.targets, p.targets_i64, p.ignore_index, p.logp, p.lse);
}

static_assert(sizeof(MergeParams) <= 4096, "merge parameters must fit the 4 KiB kernel parameter space");
__global__ void __launch_bounds__(kCombineThreads) merge_rows_kernel(const __grid_constant__ MergeParams p) {
  chain_row(p.segments, p.count, blockIdx.x, blockIdx.x, p.targets, p.targets_i64, p.ignore_index, p.logp, p.lse);
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
  config.gridDim = dim3(static_cast<unsigned>(p.rows));
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
  merge_rows_kernel<<<static_cast<unsigned>(p.rows), kCombineThreads, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_partial_owner(const PartialOwnerParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.rows + 255) / 256;
  partial_owner_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace detlogp::sm90

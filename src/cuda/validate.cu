// The validation kernel of every CUDA lane: device-resident targets and temperatures checked
// before anything the caller sees is written (no device asserts: the status word carries the
// first bad row to the host, which raises the error).
#include "cuda/check.hpp"
#include "cuda/validate.cuh"

namespace detlogp::cuda {
namespace {

constexpr int kValidateThreads = 1024;

// One CTA: finds the first invalid row of each kind with a block min (deterministic, no atomics)
// and always writes the status word. kMulti: [N, K] targets (K = p.targets_per_row > 1).
template <bool kMulti>
__global__ void __launch_bounds__(kValidateThreads) validate_inputs_kernel(const ValidateParams p) {
  __shared__ int64_t bad_target[kValidateThreads];
  __shared__ int64_t bad_temp[kValidateThreads];
  scan_rows<kMulti>(p, threadIdx.x, kValidateThreads, bad_target[threadIdx.x], bad_temp[threadIdx.x]);
  __syncthreads();
  for (int width = kValidateThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      bad_target[threadIdx.x] = min(bad_target[threadIdx.x], bad_target[threadIdx.x + width]);
      bad_temp[threadIdx.x] = min(bad_temp[threadIdx.x], bad_temp[threadIdx.x + width]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) publish_status<kMulti>(p, bad_target[0], bad_temp[0]);
}

}  // namespace

void launch_validate(const ValidateParams& p, cudaStream_t stream) {
  if (p.targets_per_row > 1)
    validate_inputs_kernel<true><<<1, kValidateThreads, 0, stream>>>(p);
  else
    validate_inputs_kernel<false><<<1, kValidateThreads, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace detlogp::cuda

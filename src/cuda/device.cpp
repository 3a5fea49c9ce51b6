// Device memory of the CUDA lanes, and the tensor-parallel layer's device operations
// (core/device_ops.hpp) other than the merge itself, which the SM90 combine implements.
#include "cuda/device.hpp"

#include <map>
#include <mutex>
#include <utility>

#include "core/device_ops.hpp"

namespace detlogp::cuda {

cudaMemPool_t workspace_pool(int device) {
  static std::mutex mu;
  static std::map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = pools.find(device); it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  DETLOGP_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  uint64_t keep = ~uint64_t{0};
  DETLOGP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  pools[device] = pool;
  return pool;
}

StreamBuffer::StreamBuffer(size_t bytes, cudaStream_t stream, int device, const char* what, const char* hint)
    : stream_(stream) {
  if (bytes == 0) return;  // null, and no pool call
  const cudaError_t e = cudaMallocFromPoolAsync(&ptr_, bytes, workspace_pool(device), stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ptr_ = nullptr;
    DETLOGP_FAIL("could not allocate " << bytes << " bytes of device memory for the " << what << ": "
                                       << cudaGetErrorName(e) << (hint != nullptr ? " (" : "")
                                       << (hint != nullptr ? hint : "") << (hint != nullptr ? ")" : ""));
  }
}

}  // namespace detlogp::cuda

namespace detlogp::detail {

DeviceAllocation::DeviceAllocation(size_t bytes, int device, const char* what) : device_(device) {
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device);
  const cudaError_t e = cudaMalloc(&ptr_, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ptr_ = nullptr;
    DETLOGP_FAIL("could not allocate " << bytes << " bytes on CUDA device " << device << " for " << what << ": "
                                       << cudaGetErrorName(e));
  }
}

DeviceAllocation::~DeviceAllocation() {
  if (ptr_ == nullptr) return;
  cuda::DeviceGuard guard(device_);
  (void)cudaFree(ptr_);
}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& o) noexcept {
  std::swap(ptr_, o.ptr_);
  std::swap(device_, o.device_);
  return *this;
}

void device_copy_async(void* dst, const void* src, size_t bytes, int device, void* stream) {
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device);
  DETLOGP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

void device_stream_sync(int device, void* stream) {
  cuda::DeviceGuard guard(device);
  DETLOGP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

}  // namespace detlogp::detail

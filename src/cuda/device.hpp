// Device memory and device selection for every CUDA lane: the device guard, the stream-ordered
// workspace pool and its buffers. The tensor-parallel layer's device operations
// (core/device_ops.hpp) are implemented on these in device.cpp.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "cuda/check.hpp"

namespace detlogp::cuda {

// Makes `device` current for the scope, restoring the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DETLOGP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) DETLOGP_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// The library's own stream-ordered memory pool per device. Its release threshold keeps freed
// workspace mapped, so a call does not pay to map the pages again (the default pool returns them
// at every synchronization). The pool holds at most the largest workspace of a call.
cudaMemPool_t workspace_pool(int device);

// Stream-ordered workspace from that pool, freed on the same stream even when a launch throws.
// `hint` (may be null) ends the out-of-memory message.
class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, cudaStream_t stream, int device, const char* what, const char* hint = nullptr);
  ~StreamBuffer() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// Several stream-ordered buffers of one call in one allocation from the pool, each part at a
// 256-byte boundary (a part of 0 bytes is null): one pool call and one free, where a buffer each
// costs the host a few microseconds apiece on every call.
class StreamBuffers {
 public:
  static constexpr size_t kMaxParts = 16;
  StreamBuffers(std::initializer_list<size_t> bytes, cudaStream_t stream, int device, const char* what,
                const char* hint = nullptr)
      : all_(layout(bytes), stream, device, what, hint) {}
  uint8_t* get(size_t part) const { return bytes_[part] == 0 ? nullptr : all_.get() + offset_[part]; }

 private:
  size_t layout(std::initializer_list<size_t> bytes) {
    DETLOGP_CHECK(bytes.size() <= kMaxParts, "internal error: " << bytes.size() << " workspace parts");
    size_t at = 0, i = 0;
    for (const size_t b : bytes) {
      offset_[i] = at;
      bytes_[i++] = b;
      at += (b + 255) / 256 * 256;
    }
    return at;
  }
  std::array<size_t, kMaxParts> offset_{}, bytes_{};
  StreamBuffer all_;
};

}  // namespace detlogp::cuda

// Host-side pieces every SM90 entry point shares (the forward backend and the logit gradient):
// TMA tensor maps and their operand checks, the device guard, the stream-ordered workspace pool,
// and the validation verdict a call waits for.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "sm90/sm90_common.hpp"

namespace detlogp::sm90 {

// Row-major bf16 matrix [rows][cols] with a row stride in elements, tiled into boxes of
// 64 columns (one 128-byte swizzle row) x box_rows rows. Out-of-range elements read as zero.
// promotion: L2 promotion of the loads, 0, 128 or 256 bytes.
CUtensorMap encode_bf16_map(const uint16_t* base, int64_t rows, int64_t cols, int64_t stride, int box_rows,
                            const char* name, int promotion = 256);
// What TMA needs of a bf16 operand: 16-byte aligned base, row stride a multiple of 16 bytes.
void check_tma_operand(const void* ptr, int64_t stride_elems, const char* name);
void check_alignment(const void* ptr, size_t align, const char* name);
// What every SM90 entry needs of the head beyond the API's checks: TMA-ready hidden and weight,
// extents below 2^31 (`vocab_name` names the weight's rows), aligned targets, bias, temperatures.
void check_head_operands(const uint16_t* hidden, int64_t hidden_stride, const uint16_t* weight, int64_t weight_stride,
                         int64_t rows, int64_t vocab, const char* vocab_name, int64_t dim, const void* targets,
                         bool targets_i64, const float* bias, const float* temperature_rows);
// Throws unless `device` has compute capability 9.0.
void check_sm90_device(int device);

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

// The backend's own stream-ordered memory pool per device. Its release threshold keeps freed
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

// The validation verdict of one call: the host-mapped slot the validation writes (status, then
// the call's sequence number) and the device pointer to pass in ValidateParams. All null under
// stream capture, where no host wait is possible.
struct Verdict {
  HostStatusSlot* host = nullptr;
  HostStatusSlot* device = nullptr;
  uint64_t seq = 0;
};
// The next slot of this host thread's ring (none while `stream` is capturing).
Verdict prepare_verdict(cudaStream_t stream);
// Waits until the validation of the call has reported (polling the stream, so a fault of earlier
// work surfaces as its CUDA error instead of a hang) and returns its status. The call's other
// kernels keep running: this is the only wait of a call.
DeviceStatus await_verdict(const Verdict& v, cudaStream_t stream);

}  // namespace detlogp::sm90

// The host side of device validation: this host thread's ring of host-mapped status slots, the
// wait for a call's verdict, and the error each status code becomes.
#include "cuda/status.hpp"

#include <atomic>
#include <cstring>
#include <new>
#include <thread>

#include "core/validate.hpp"
#include "cuda/check.hpp"

namespace detlogp::cuda {
namespace {

// Host-mapped status slots of this host thread (pinned, portable, mapped), a ring indexed by the
// call's sequence number, so a late write of an abandoned call never lands in a live slot.
struct MappedStatus {
  static constexpr uint64_t kSlots = 16;
  HostStatusSlot* host = nullptr;
  uint64_t next_seq = 0;
  ~MappedStatus() {
    if (host != nullptr) (void)cudaFreeHost(host);
  }
};

MappedStatus& mapped_status() {
  thread_local MappedStatus slots;
  if (slots.host == nullptr) {
    void* ptr = nullptr;
    DETLOGP_CUDA_CHECK(cudaHostAlloc(&ptr, sizeof(HostStatusSlot) * MappedStatus::kSlots,
                                     cudaHostAllocPortable | cudaHostAllocMapped));
    slots.host = static_cast<HostStatusSlot*>(ptr);
    for (uint64_t i = 0; i < MappedStatus::kSlots; ++i) new (&slots.host[i]) HostStatusSlot{};
  }
  return slots;
}

DeviceStatus wait_for_validation(HostStatusSlot* slot, uint64_t seq, cudaStream_t stream) {
  const volatile uint64_t* flag = &slot->seq;
  for (uint32_t spin = 1;; ++spin) {
    if (*flag == seq) break;
    if (spin % 256 == 0) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e != cudaSuccess && e != cudaErrorNotReady) DETLOGP_CUDA_CHECK(e);
      DETLOGP_CHECK(e != cudaSuccess || *flag == seq,
                    "internal error: the validation kernel finished without reporting its status");
      std::this_thread::yield();
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  DeviceStatus status;
  std::memcpy(&status, const_cast<const DeviceStatus*>(&static_cast<volatile HostStatusSlot*>(slot)->status),
              sizeof status);
  return status;
}

}  // namespace

Verdict prepare_verdict(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DETLOGP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  Verdict v;
  if (capture != cudaStreamCaptureStatusNone) return v;
  MappedStatus& slots = mapped_status();
  v.seq = ++slots.next_seq;
  v.host = &slots.host[v.seq % MappedStatus::kSlots];
  void* device_ptr = nullptr;
  DETLOGP_CUDA_CHECK(cudaHostGetDevicePointer(&device_ptr, v.host, 0));
  v.device = static_cast<HostStatusSlot*>(device_ptr);
  return v;
}

DeviceStatus await_verdict(const Verdict& v, cudaStream_t stream) {
  DETLOGP_CHECK(v.host != nullptr, "internal error: no validation verdict to wait for (stream capture)");
  return wait_for_validation(v.host, v.seq, stream);
}

void throw_status(const DeviceStatus& s, const detail::LogpProblem& p) {
  if (s.code == kStatusBadTarget) {
    if (s.target < 0)
      DETLOGP_FAIL("targets[" << s.row << "]=" << s.target << " is negative and not ignore_index=" << p.ignore_index
                              << " (checked on the device; nothing was written)");
    DETLOGP_FAIL("targets[" << s.row << "]=" << s.target << " is >= real_vocab=" << p.real_vocab
                            << " (checked on the device; nothing was written)");
  }
  if (s.code == kStatusBadTemperature)
    DETLOGP_FAIL(detail::temperature_range_message("temperature_rows", s.row, s.temperature)
                 << " (checked on the device; nothing was written)");
  DETLOGP_FAIL("device validation returned an unknown status code " << s.code);
}

}  // namespace detlogp::cuda

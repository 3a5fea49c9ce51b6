// The host side of device validation: this host thread's ring of host-mapped status slots, the
// wait for a call's verdict, and the error each status code becomes.
#include "cuda/status.hpp"

#include <atomic>
#include <cstring>
#include <deque>
#include <new>
#include <sstream>
#include <string>
#include <thread>

#include "core/device_ops.hpp"
#include "core/validate.hpp"
#include "cuda/check.hpp"

namespace detlogp::cuda {
namespace {

// A call made with defer_errors whose verdict nobody has read yet.
struct PendingVerdict {
  uint64_t seq = 0;
  HostStatusSlot* slot = nullptr;
  cudaEvent_t done = nullptr;  // recorded after the call's kernels
  int64_t real_vocab = 0;
  int64_t ignore_index = 0;
  const char* entry = "";
};

// Host-mapped status slots of this host thread (pinned, portable, mapped), a ring indexed by the
// call's sequence number, so a late write of an abandoned call never lands in a live slot; the
// deferred calls still holding a slot, oldest first, and one reusable event per slot.
struct MappedStatus {
  static constexpr uint64_t kSlots = 16;
  HostStatusSlot* host = nullptr;
  uint64_t next_seq = 0;
  std::deque<PendingVerdict> pending;
  cudaEvent_t events[kSlots] = {};
  ~MappedStatus() {
    for (cudaEvent_t e : events)
      if (e != nullptr) (void)cudaEventDestroy(e);
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

// What a non-zero status code says, naming the row and its value.
std::string status_message(const DeviceStatus& s, int64_t real_vocab, int64_t ignore_index) {
  std::ostringstream os;
  const std::string at =
      "targets[" + std::to_string(s.row) + (s.column > 0 ? ", " + std::to_string(s.column - 1) : "") + "]";
  if (s.code == kStatusBadTarget && s.target < 0)
    os << at << "=" << s.target << " is negative and not ignore_index=" << ignore_index;
  else if (s.code == kStatusBadTarget)
    os << at << "=" << s.target << " is >= real_vocab=" << real_vocab;
  else if (s.code == kStatusBadTemperature)
    os << detail::temperature_range_message("temperature_rows", s.row, s.temperature);
  else
    os << "device validation returned an unknown status code " << s.code;
  return os.str();
}

DeviceStatus read_status(HostStatusSlot* slot) {
  std::atomic_thread_fence(std::memory_order_acquire);
  DeviceStatus status;
  std::memcpy(&status, const_cast<const DeviceStatus*>(&static_cast<volatile HostStatusSlot*>(slot)->status),
              sizeof status);
  return status;
}

// Spins on the slot's sequence number; every 256 spins `query` (cudaStreamQuery or
// cudaEventQuery of work enqueued after the validation) tells a fault of earlier work (its CUDA
// error) or a finished call that never reported from one still queued.
template <class Query>
DeviceStatus wait_for_validation(HostStatusSlot* slot, uint64_t seq, Query query) {
  const volatile uint64_t* flag = &slot->seq;
  for (uint32_t spin = 1;; ++spin) {
    if (*flag == seq) break;
    if (spin % 256 == 0) {
      const cudaError_t e = query();
      if (e != cudaSuccess && e != cudaErrorNotReady) DETLOGP_CUDA_CHECK(e);
      DETLOGP_CHECK(e != cudaSuccess || *flag == seq,
                    "internal error: the validation kernel finished without reporting its status");
      std::this_thread::yield();
    }
  }
  return read_status(slot);
}

DeviceStatus wait_pending(const PendingVerdict& v) {
  return wait_for_validation(v.slot, v.seq, [&] { return cudaEventQuery(v.done); });
}

// Pops the oldest pending verdict once read. On an error, every later pending verdict is waited
// for too (none is left behind to raise again), and the first error is thrown, named as a
// deferred one: the caller sees it at a later call.
void settle_oldest(MappedStatus& slots, bool wait) {
  const PendingVerdict v = slots.pending.front();
  const DeviceStatus s = wait ? wait_pending(v) : read_status(v.slot);
  slots.pending.pop_front();
  if (s.code == kStatusOk) return;
  int64_t later = 0;
  while (!slots.pending.empty()) {
    if (wait_pending(slots.pending.front()).code != kStatusOk) ++later;
    slots.pending.pop_front();
  }
  DETLOGP_FAIL(status_message(s, v.real_vocab, v.ignore_index)
               << " (checked on the device for an earlier " << v.entry
               << " call of this host thread, whose error was deferred; that call wrote nothing"
               << (later > 0 ? "; " + std::to_string(later) + " later deferred calls had invalid input too" : "")
               << ")");
}

// Reads the pending verdicts that have reported, oldest first, without waiting for the others.
void settle_reported(MappedStatus& slots) {
  while (!slots.pending.empty()) {
    const PendingVerdict& v = slots.pending.front();
    if (static_cast<volatile HostStatusSlot*>(v.slot)->seq != v.seq) break;
    settle_oldest(slots, false);
  }
}

}  // namespace

Verdict prepare_verdict(cudaStream_t stream) {
  MappedStatus& slots = mapped_status();
  settle_reported(slots);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DETLOGP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  Verdict v;
  if (capture != cudaStreamCaptureStatusNone) return v;
  // The slot of seq is that of seq - kSlots: a deferred call still holding it is waited for.
  while (!slots.pending.empty() && slots.pending.front().seq + MappedStatus::kSlots <= slots.next_seq + 1)
    settle_oldest(slots, true);
  v.seq = ++slots.next_seq;
  v.host = &slots.host[v.seq % MappedStatus::kSlots];
  void* device_ptr = nullptr;
  DETLOGP_CUDA_CHECK(cudaHostGetDevicePointer(&device_ptr, v.host, 0));
  v.device = static_cast<HostStatusSlot*>(device_ptr);
  return v;
}

DeviceStatus await_verdict(const Verdict& v, cudaStream_t stream) {
  DETLOGP_CHECK(v.host != nullptr, "internal error: no validation verdict to wait for (stream capture)");
  return wait_for_validation(v.host, v.seq, [&] { return cudaStreamQuery(stream); });
}

void defer_verdict(const Verdict& v, cudaStream_t stream, const detail::HeadOperands& p, const char* entry) {
  MappedStatus& slots = mapped_status();
  cudaEvent_t& done = slots.events[v.seq % MappedStatus::kSlots];
  if (done == nullptr) DETLOGP_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  DETLOGP_CUDA_CHECK(cudaEventRecord(done, stream));
  slots.pending.push_back(PendingVerdict{v.seq, v.host, done, p.real_vocab, p.ignore_index, entry});
}

void settle_verdict(const Verdict& v, cudaStream_t stream, const detail::HeadOperands& p, const char* entry) {
  if (v.host == nullptr) return;  // capturing
  if (p.defer_errors) {
    defer_verdict(v, stream, p, entry);
    return;
  }
  const DeviceStatus seen = await_verdict(v, stream);
  if (seen.code != kStatusOk) throw_status(seen, p);
}

void throw_status(const DeviceStatus& s, const detail::HeadOperands& p) {
  DETLOGP_FAIL(status_message(s, p.real_vocab, p.ignore_index) << " (checked on the device; nothing was written)");
}

}  // namespace detlogp::cuda

namespace detlogp::detail {

void drain_deferred_device_errors() {
  cuda::MappedStatus& slots = cuda::mapped_status();
  while (!slots.pending.empty()) cuda::settle_oldest(slots, true);
}

}  // namespace detlogp::detail

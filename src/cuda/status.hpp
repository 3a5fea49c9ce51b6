// Input validation on the device, shared by every CUDA lane: the status word the validation writes
// and every later kernel of a call reads (a non-zero code makes them exit before writing anything),
// its host-mapped copy (the verdict the host waits for), and the error each code becomes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/problem.hpp"
#include "detlogp/config.hpp"

namespace detlogp::cuda {

// Written by the validation (always, code 0 when every row is valid).
struct DeviceStatus {
  int32_t code = 0;       // kStatusOk, kStatusBadTarget, kStatusBadTemperature
  int32_t column = 0;     // [N, K] targets (K > 1): k + 1 of the bad targets[row, k]; 0 for one target a row
  int64_t row = -1;       // first offending row
  int64_t target = 0;     // its target (kStatusBadTarget)
  float temperature = 0;  // its temperature (kStatusBadTemperature)
  float pad2 = 0;
};
inline constexpr int32_t kStatusOk = 0;
inline constexpr int32_t kStatusBadTarget = 1;
inline constexpr int32_t kStatusBadTemperature = 2;

// A host-mapped copy of the status word: the validation writes the status, then (after a
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
  int32_t targets_per_row;  // K: targets [rows][K] (temperatures stay [rows]); in targets_i64's padding
  int64_t real_vocab;
  int64_t ignore_index;
  const float* temperature_rows;  // may be null
  DeviceStatus* status;
  HostStatusSlot* host_slot = nullptr;  // device pointer of mapped host memory, or null
  uint64_t seq = 0;
};

DETLOGP_HD int64_t load_target(const void* targets, int is_i64, int64_t row) {
  return is_i64 ? static_cast<const int64_t*>(targets)[row] : static_cast<const int32_t*>(targets)[row];
}

// The validation kernel: one CTA scans every row (validate.cu).
void launch_validate(const ValidateParams& p, cudaStream_t stream);

// Throws the error the status word describes (code != kStatusOk), naming the row and value.
[[noreturn]] void throw_status(const DeviceStatus& s, const detail::HeadOperands& p);

// The validation verdict of one call: the host-mapped slot the validation writes (status, then
// the call's sequence number) and the device pointer to pass in ValidateParams. All null under
// stream capture, where no host wait is possible.
struct Verdict {
  HostStatusSlot* host = nullptr;
  HostStatusSlot* device = nullptr;
  uint64_t seq = 0;
};
// The next slot of this host thread's ring (none while `stream` is capturing). First throws the
// error of any earlier deferred call whose validation has reported one (without waiting), and
// waits for the deferred call that still holds the slot, if any.
Verdict prepare_verdict(cudaStream_t stream);
// Leaves the verdict outstanding (CallOptions::defer_errors): an event recorded on `stream` after
// the call's kernels lets a later wait tell a finished call from one still queued; `entry` (a
// literal) and p's real_vocab and ignore_index name the error when it is thrown.
void defer_verdict(const Verdict& v, cudaStream_t stream, const detail::HeadOperands& p, const char* entry);
// The verdict of the call: waits for it (await_verdict) and throws its error, or leaves it
// outstanding with p.defer_errors. Nothing to do under stream capture (v.host null).
void settle_verdict(const Verdict& v, cudaStream_t stream, const detail::HeadOperands& p, const char* entry);
// Waits until the validation of the call has reported (polling the stream, so a fault of earlier
// work surfaces as its CUDA error instead of a hang) and returns its status. The call's other
// kernels keep running: this is the only wait of a call.
DeviceStatus await_verdict(const Verdict& v, cudaStream_t stream);

}  // namespace detlogp::cuda

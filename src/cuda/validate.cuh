// Input validation on the device, shared by the validation kernel (validate.cu) and the SM90 fused
// kernel's in-kernel validation (trainer entry): the first invalid row of each kind (deterministic:
// a min over rows, no atomics), the status word, and its host-mapped copy.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/status.hpp"
#include "detlogp/config.hpp"

namespace detlogp::cuda {

// This thread's first invalid rows among rows first, first + stride, ... (LLONG_MAX: none).
// kMulti ([N, K] targets, K = p.targets_per_row > 1): first_target is the flat index row * K + k of
// the first bad entry of those rows instead (rows ascending, k ascending within a row).
template <bool kMulti = false>
__device__ __forceinline__ void scan_rows(const ValidateParams& p, int64_t first, int64_t stride, int64_t& first_target,
                                          int64_t& first_temp) {
  first_target = LLONG_MAX;
  first_temp = LLONG_MAX;
  for (int64_t row = first; row < p.rows; row += stride) {
    if constexpr (kMulti) {
      for (int64_t k = 0; k < p.targets_per_row && first_target == LLONG_MAX; ++k) {
        const int64_t i = row * p.targets_per_row + k;
        const int64_t t = load_target(p.targets, p.targets_i64, i);
        if (t != p.ignore_index && (t < 0 || t >= p.real_vocab)) first_target = i;
      }
    } else {
      const int64_t t = load_target(p.targets, p.targets_i64, row);
      if (t != p.ignore_index && (t < 0 || t >= p.real_vocab) && first_target == LLONG_MAX) first_target = row;
    }
    if (p.temperature_rows != nullptr && !temperature_in_range(p.temperature_rows[row]) && first_temp == LLONG_MAX)
      first_temp = row;
  }
}

// One thread: writes the verdict for the first invalid rows, then its host-mapped copy (status
// first, then the call's sequence number, so the host never reads a stale status).
// kMulti: bad_target is a flat index of [N, K] targets (scan_rows<true>).
template <bool kMulti = false>
__device__ __forceinline__ void publish_status(const ValidateParams& p, int64_t bad_target, int64_t bad_temp) {
  DeviceStatus s;
  if constexpr (kMulti) {
    // The row of the first bad target decides against the first bad temperature, as for [N].
    const int64_t target_row = bad_target == LLONG_MAX ? LLONG_MAX : bad_target / p.targets_per_row;
    if (target_row != LLONG_MAX && target_row <= bad_temp) {
      s.code = kStatusBadTarget;
      s.row = target_row;
      s.column = static_cast<int32_t>(bad_target - target_row * p.targets_per_row) + 1;
      s.target = load_target(p.targets, p.targets_i64, bad_target);
    } else if (bad_temp != LLONG_MAX) {
      s.code = kStatusBadTemperature;
      s.row = bad_temp;
      s.temperature = p.temperature_rows[s.row];
    }
  } else if (bad_target != LLONG_MAX && bad_target <= bad_temp) {
    s.code = kStatusBadTarget;
    s.row = bad_target;
    s.target = load_target(p.targets, p.targets_i64, s.row);
  } else if (bad_temp != LLONG_MAX) {
    s.code = kStatusBadTemperature;
    s.row = bad_temp;
    s.temperature = p.temperature_rows[s.row];
  }
  *p.status = s;
  if (p.host_slot != nullptr) {
    p.host_slot->status = s;
    __threadfence_system();  // the status reaches the host before the sequence number does
    *reinterpret_cast<volatile uint64_t*>(&p.host_slot->seq) = p.seq;
  }
}

// One warp validates every row (the fused kernel's idle producer warp on the trainer entry).
template <bool kMulti = false>
__device__ __forceinline__ void validate_rows_warp(const ValidateParams& p) {
  const int lane = threadIdx.x % 32;
  int64_t bad_target, bad_temp;
  scan_rows<kMulti>(p, lane, 32, bad_target, bad_temp);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    bad_target = min(bad_target, static_cast<int64_t>(__shfl_xor_sync(0xFFFFFFFFu, bad_target, offset)));
    bad_temp = min(bad_temp, static_cast<int64_t>(__shfl_xor_sync(0xFFFFFFFFu, bad_temp, offset)));
  }
  if (lane == 0) publish_status<kMulti>(p, bad_target, bad_temp);
}

}  // namespace detlogp::cuda

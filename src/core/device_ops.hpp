// The few device operations the tensor-parallel layer needs, implemented by the SM90 layer
// (src/sm90/sm90_backend.cu) so that src/tp stays free of CUDA headers. Builds without CUDA
// link src/sm90/sm90_unavailable.cpp, whose versions throw and say why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/straddle.hpp"
#include "detlogp/reduce.hpp"

namespace detlogp::detail {

// One rank's partials of a row chunk in device memory: [rows][tiles] summaries of its whole tiles,
// y_t and owned flags ([rows][K]; both null for a rank that holds no real lane: it owns no target).
struct DeviceMergeRank {
  const TileSummary* summaries = nullptr;
  int64_t tiles = 0;
  const float* target_logit = nullptr;
  const uint8_t* owned = nullptr;
  const float* usums = nullptr;  // [rows][tiles] entropy sums u_g: set on every rank when the merge writes entropy
};

// The owned merge on the device (the SM90 combine chain over rank-ordered segments), enqueued on
// `stream`. Writes logp[0..rows) and lse[0..rows), and entropy[0..rows) when non-null (then every
// rank's usums is set). `straddles` (ranks_in_order's straddling tiles, their runs reading the
// ranks' edge lanes in device memory) may be null or empty: 64-aligned shards. Each straddling tile
// is summarized on the device (straddle_summary) into a stream-ordered scratch buffer and chained
// right before the whole tiles of the rank that completes it.
// targets_per_row = K > 1: [rows][K] targets, each rank's target_logit and owned [rows][K], logp
// [rows][K] (each entry finalized as a single-target merge for its id).
void device_merge(const std::vector<DeviceMergeRank>& ranks_in_order, int64_t rows, const void* targets,
                  bool targets_i64, int64_t ignore_index, float* logp, float* lse, int device, void* stream,
                  float* entropy = nullptr, const StraddlePlan* straddles = nullptr, int64_t targets_per_row = 1);

// One rank's top-k list of a row chunk in device memory (docs/contract.md §12.4): [rows][k] logits
// and global ids, id -1 past the rank's real lanes.
struct DeviceTopkList {
  const float* logit = nullptr;
  const int64_t* ids = nullptr;
};

// The top-k merge on the device, enqueued on `stream` after device_merge wrote lse: per row the
// ranks' lists offered in rank order (topk_offer) to one list of k, each entry finalized with the
// merged lse (target_logp), into ids and logp [rows][k]. A row whose lists hold fewer than k ids
// cannot occur for checked layouts (the shards cover real_vocab >= k).
void device_merge_topk(const std::vector<DeviceTopkList>& ranks_in_order, int64_t rows, int64_t k, const float* lse,
                       int64_t* ids, float* logp, int device, void* stream);

// Owning device allocation (cudaMalloc on `device`); throws naming `what` on failure.
class DeviceAllocation {
 public:
  DeviceAllocation() = default;
  DeviceAllocation(size_t bytes, int device, const char* what);
  ~DeviceAllocation();
  DeviceAllocation(DeviceAllocation&& o) noexcept : ptr_(o.ptr_), device_(o.device_) { o.ptr_ = nullptr; }
  DeviceAllocation& operator=(DeviceAllocation&& o) noexcept;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  int device_ = 0;
};

// cudaMemcpyAsync(cudaMemcpyDefault) on `stream`, on `device`.
void device_copy_async(void* dst, const void* src, size_t bytes, int device, void* stream);
// cudaStreamSynchronize.
void device_stream_sync(int device, void* stream);
// check_deferred_errors: waits for this host thread's deferred device validations and throws the
// first error (a no-op without CUDA).
void drain_deferred_device_errors();

}  // namespace detlogp::detail

#include "tp/tp_merge.hpp"

#include "core/device_ops.hpp"

namespace detlogp::tp {

void merge_owned(const std::vector<ShardPartials>& ranks, const TensorView& targets, int64_t ignore_index,
                 const MutableTensorView& logp, const MutableTensorView& lse, void* stream) {
  DETLOGP_CHECK(!ranks.empty(), "merge_partials needs at least one rank's partials");
  const int64_t rows = ranks.front().rows;
  const Memory memory = ranks.front().memory;
  const int device = ranks.front().device;
  for (size_t r = 0; r < ranks.size(); ++r) {
    DETLOGP_CHECK(ranks[r].memory == memory && (memory == Memory::host || ranks[r].device == device),
                  "rank " << r << " partials are not in the same memory as rank 0's");
    DETLOGP_CHECK(ranks[r].rows == rows, "rank " << r << " has " << ranks[r].rows << " rows, rank 0 has " << rows);
    DETLOGP_CHECK(
        rows == 0 || ranks[r].tiles == 0 || (ranks[r].summaries && ranks[r].target_logit && ranks[r].target_owned),
        "rank " << r << " partials have a null buffer");
  }
  DETLOGP_CHECK(
      targets.ndim == 1 && targets.rows == rows && (targets.dtype == DType::i32 || targets.dtype == DType::i64),
      "targets must be [N=" << rows << "] i32 or i64");
  DETLOGP_CHECK(logp.ndim == 1 && logp.rows == rows && logp.dtype == DType::f32, "logp must be [N=" << rows << "] f32");
  DETLOGP_CHECK(lse.ndim == 1 && lse.rows == rows && lse.dtype == DType::f32, "lse must be [N=" << rows << "] f32");
  for (const TensorView* t : {&targets, static_cast<const TensorView*>(&logp), static_cast<const TensorView*>(&lse)})
    DETLOGP_CHECK(t->memory == memory && (memory == Memory::host || t->device == device),
                  "targets, logp and lse must be in the partials' memory");
  if (rows == 0) return;
  const bool i64 = targets.dtype == DType::i64;
  if (memory == Memory::cuda) {
    // Ownership lives on the device; the tensor-parallel operator guarantees it by construction
    // (contiguous shards), here the caller does: exactly one rank's target_owned is 1 per row.
    std::vector<detail::DeviceMergeRank> views;
    for (const auto& r : ranks)
      if (r.tiles > 0) views.push_back({r.summaries, r.tiles, r.target_logit, r.target_owned});
    detail::device_merge(views, rows, targets.data, i64, ignore_index, static_cast<float*>(logp.mutable_data()),
                         static_cast<float*>(lse.mutable_data()), device, stream);
    return;
  }
  auto target_of = [&](int64_t n) {
    return i64 ? static_cast<const int64_t*>(targets.data)[n] : static_cast<const int32_t*>(targets.data)[n];
  };
  // Validate ownership before writing anything.
  for (int64_t n = 0; n < rows; ++n) {
    if (target_of(n) == ignore_index) continue;
    int owners = 0;
    for (const auto& r : ranks) owners += r.tiles > 0 && r.target_owned[n] ? 1 : 0;
    DETLOGP_CHECK(owners == 1, "targets[" << n << "]=" << target_of(n) << " is owned by " << owners
                                          << " shards; exactly one shard must own each non-ignored target");
  }
  float* logp_out = static_cast<float*>(logp.mutable_data());
  float* lse_out = static_cast<float*>(lse.mutable_data());
  for (int64_t n = 0; n < rows; ++n) {
    float global_max = fp::neg_inf();
    for (const auto& r : ranks)
      for (int64_t g = 0; g < r.tiles; ++g) global_max = chain_max(global_max, r.summaries[n * r.tiles + g].max);
    float sum = 0.0f, y_t = 0.0f;
    for (const auto& r : ranks) {
      for (int64_t g = 0; g < r.tiles; ++g) sum = chain_step(sum, r.summaries[n * r.tiles + g], global_max);
      if (r.tiles > 0 && r.target_owned[n]) y_t = r.target_logit[n];
    }
    const RowResult res = finalize_row(global_max, sum, y_t, target_of(n) == ignore_index);
    logp_out[n] = res.logp;
    lse_out[n] = res.lse;
  }
}

}  // namespace detlogp::tp

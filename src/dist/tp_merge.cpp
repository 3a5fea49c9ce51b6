// Tensor parallel on the host: the owned merge over rank-ordered partials, and an in-process
// simulation of R ranks. No floating-point reduction happens in transit: partials are placed
// side by side in rank order, which is ascending global tile order, and the same chain runs.
#include <algorithm>
#include <vector>

#include "core/device_ops.hpp"
#include "cpu/cpu_parallel.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp {

void merge_partials(const std::vector<ShardPartials>& ranks, const TensorView& targets, int64_t ignore_index,
                    const MutableTensorView& logp, const MutableTensorView& lse, const CallOptions& opt) {
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
                         static_cast<float*>(lse.mutable_data()), device, opt.cuda_stream);
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

CallReport simulate_tensor_parallel(const LinearLogpInputs& in, int ranks, const LinearLogpOutputs& out,
                                    const CallOptions& opt) {
  DETLOGP_CHECK(ranks >= 1, "ranks=" << ranks << " must be >= 1");
  DETLOGP_CHECK(in.hidden.memory == Memory::host, "simulate_tensor_parallel runs on host tensors");
  DETLOGP_CHECK(in.weight.ndim == 2 && in.weight.dtype == DType::bf16, "weight must be a 2-D bf16 tensor");
  DETLOGP_CHECK(in.vocab_start == 0,
                "simulate_tensor_parallel shards the whole vocabulary; vocab_start=" << in.vocab_start);
  const int64_t vocab = in.weight.rows;
  const int64_t rows = in.hidden.rows;
  const int64_t per_rank = (vocab + ranks - 1) / ranks;
  const int64_t shard = std::max<int64_t>(kVocabTile, (per_rank + kVocabTile - 1) / kVocabTile * kVocabTile);
  const int64_t real_vocab = in.real_vocab < 0 ? vocab : in.real_vocab;

  struct RankBuffers {
    std::vector<TileSummary> summaries;
    std::vector<float> target_logit;
    std::vector<uint8_t> owned;
  };
  std::vector<RankBuffers> buffers(static_cast<size_t>(ranks));
  std::vector<ShardPartials> partials;
  CallReport report;
  for (int r = 0; r < ranks; ++r) {
    const int64_t start = std::min<int64_t>(vocab, r * shard);
    const int64_t count = std::min<int64_t>(shard, vocab - start);
    ShardPartials p;
    p.rows = rows;
    p.memory = Memory::host;
    if (count > 0) {
      LinearLogpInputs shard_in = in;
      shard_in.weight = TensorView::matrix(static_cast<const uint16_t*>(in.weight.data) + start * in.weight.row_stride,
                                           DType::bf16, count, in.weight.cols, Memory::host, in.weight.row_stride);
      if (in.bias.present())
        shard_in.bias = TensorView::vector(static_cast<const float*>(in.bias.data) + start, DType::f32, count);
      shard_in.vocab_start = start;
      shard_in.real_vocab = real_vocab;
      RankBuffers& b = buffers[static_cast<size_t>(r)];
      p.tiles = shard_tiles(count);
      b.summaries.resize(static_cast<size_t>(rows * p.tiles));
      b.target_logit.resize(static_cast<size_t>(rows));
      b.owned.resize(static_cast<size_t>(rows));
      p.summaries = b.summaries.data();
      p.target_logit = b.target_logit.data();
      p.target_owned = b.owned.data();
      report = linear_logp_partials(shard_in, p, opt);
    }
    partials.push_back(p);
  }
  // Validate the outputs like linear_logp would, then merge.
  DETLOGP_CHECK(out.logp.ndim == 1 && out.logp.rows == rows && out.lse.ndim == 1 && out.lse.rows == rows,
                "logp and lse must be [N=" << rows << "]");
  DETLOGP_CHECK(!out.logits.present(),
                "simulate_tensor_parallel serves the trainer entry only (logits must be absent)");
  if (rows > 0) merge_partials(partials, in.targets, in.ignore_index, out.logp, out.lse);
  return report;
}

}  // namespace detlogp

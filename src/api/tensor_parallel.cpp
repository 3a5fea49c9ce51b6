// The tensor-parallel entry points: the operator over a communicator (src/tp's protocol, served
// by the registry's backend), one shard's partials with their layout, the checked owned merge,
// and the in-process simulation of ranks.
#include <algorithm>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "core/validate.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/dist.hpp"
#include "registry/registry.hpp"
#include "tp/tp_merge.hpp"
#include "tp/tp_operator.hpp"
#include "tp/tp_sample.hpp"

namespace detlogp {
namespace {

// The registry's backend for this rank's partials, chosen from the call's options.
class RegistryPartials final : public tp::PartialsBackend {
 public:
  explicit RegistryPartials(const CallOptions& opt) : opt_(opt) {}
  void select(Memory memory, bool entropy, int64_t targets_per_row, int64_t topk, CallReport& report) override {
    backend_ = &detail::select_backend(opt_, memory, true, entropy, report, targets_per_row, topk);
  }
  void run(const detail::LogpProblem& problem) const override { detail::dispatch(*backend_, problem); }

 private:
  const CallOptions& opt_;
  const detail::Backend* backend_ = nullptr;
};

// The registry's backend that runs the sampling program (the CPU backend on host tensors, SM90 on
// CUDA tensors), for this rank's partials and logits.
class RegistrySampling final : public tp::SamplingBackend {
 public:
  explicit RegistrySampling(const CallOptions& opt) : opt_(opt) {}
  void select(Memory memory, CallReport& report) override {
    backend_ = &detail::select_backend(opt_, memory, true, false, report, 1, 0, true);
  }
  void run(const detail::LogpProblem& problem) const override { detail::dispatch(*backend_, problem); }

 private:
  const CallOptions& opt_;
  const detail::Backend* backend_ = nullptr;
};

}  // namespace

CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const LinearLogpOutputs& out, Communicator& comm,
                                       const CallOptions& opt) {
  RegistryPartials backend(opt);
  return tp::run_tensor_parallel(in, out, comm, opt.cuda_stream, backend);
}

CallReport sample_tensor_parallel(const SampleInputs& in, const SampleOutputs& out, Communicator& comm,
                                  const CallOptions& opt) {
  RegistrySampling backend(opt);
  return tp::run_sample_tensor_parallel(in, out, comm, opt.cuda_stream, backend);
}

CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const SamplingProgram& program,
                                       const SampledLogpOutputs& out, Communicator& comm, const CallOptions& opt) {
  RegistrySampling backend(opt);
  return tp::run_replay_tensor_parallel(in, program, out, comm, opt.cuda_stream, backend);
}

CallReport linear_logp_partials(const LinearLogpInputs& in, ShardPartials& out, const CallOptions& opt) {
  CallReport report;
  const detail::Backend& backend = detail::select_backend(opt, in.hidden.memory, true, out.usums != nullptr, report,
                                                          in.targets.ndim == 2 ? in.targets.cols : 1, out.topk);
  detail::LogpProblem problem = detail::make_problem(in, nullptr, &out);
  problem.stream = opt.cuda_stream;
  // The digests read the values the backend reads. In CUDA memory that is one copy to the host,
  // queued before the partials' kernels (the backend waits for its validation verdict anyway, so
  // the host already waits for the work ahead of it on the stream).
  const tp::HostRows rows =
      tp::read_rows(problem.targets, problem.targets_i64, problem.targets_per_row, problem.temperature_rows,
                    problem.rows, problem.memory, problem.device, problem.stream);
  if (problem.rows > 0) detail::dispatch(backend, problem);
  PartialsLayout& layout = out.layout;
  layout.vocab_start = problem.vocab_start;
  layout.vocab_local = problem.vocab_local;
  layout.real_vocab = problem.real_vocab;
  layout.ignore_index = problem.ignore_index;
  layout.targets_digest = tp::targets_digest(rows.targets, problem.targets_per_row);
  layout.temperature_digest = tp::temperature_digest(problem.temperature, rows.temperatures);
  layout.backend_digest = tp::backend_digest(report.provenance);
  return report;
}

void merge_partials(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets, int64_t ignore_index,
                    const MutableTensorView& logp, const MutableTensorView& lse, const CallOptions& opt) {
  merge_partials(ranks_in_order, targets, ignore_index, logp, lse, MutableTensorView{}, opt);
}

void merge_partials(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets, int64_t ignore_index,
                    const MutableTensorView& logp, const MutableTensorView& lse, const MutableTensorView& entropy,
                    const CallOptions& opt) {
  detail::check_environment();
  tp::merge_partials_checked(ranks_in_order, targets, ignore_index, logp, lse, entropy, opt.cuda_stream);
}

void merge_partials(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets, int64_t ignore_index,
                    const LinearLogpOutputs& out, const CallOptions& opt) {
  detail::check_environment();
  DETLOGP_CHECK(!out.logits.present(), "merge_partials writes no logits (each rank keeps its logits shard)");
  tp::merge_partials_checked(ranks_in_order, targets, ignore_index, out.logp, out.lse, out.entropy, opt.cuda_stream,
                             out.topk_ids, out.topk_logp);
}

CallReport simulate_tensor_parallel(const LinearLogpInputs& in, int ranks, const LinearLogpOutputs& out,
                                    const CallOptions& opt) {
  DETLOGP_CHECK(ranks >= 1, "ranks=" << ranks << " must be >= 1");
  DETLOGP_CHECK(in.weight.ndim == 2 && in.weight.dtype == DType::bf16, "weight must be a 2-D bf16 tensor");
  const int64_t vocab = in.weight.rows;
  const int64_t per_rank = (vocab + ranks - 1) / ranks;
  const int64_t shard = std::max<int64_t>(kVocabTile, (per_rank + kVocabTile - 1) / kVocabTile * kVocabTile);
  std::vector<int64_t> bounds{0};
  for (int r = 0; r < ranks && bounds.back() < vocab; ++r) bounds.push_back(std::min(vocab, bounds.back() + shard));
  if (vocab == 0) bounds.push_back(0);  // the partials' own checks name the empty weight
  return simulate_tensor_parallel(in, bounds, out, opt);
}

CallReport simulate_tensor_parallel(const LinearLogpInputs& in, const std::vector<int64_t>& bounds,
                                    const LinearLogpOutputs& out, const CallOptions& opt) {
  DETLOGP_CHECK(in.hidden.memory == Memory::host, "simulate_tensor_parallel runs on host tensors");
  DETLOGP_CHECK(in.weight.ndim == 2 && in.weight.dtype == DType::bf16, "weight must be a 2-D bf16 tensor");
  DETLOGP_CHECK(in.vocab_start == 0,
                "simulate_tensor_parallel shards the whole vocabulary; vocab_start=" << in.vocab_start);
  const int64_t vocab = in.weight.rows;
  const int64_t rows = in.hidden.rows;
  DETLOGP_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == vocab,
                "shard bounds must run from 0 to the weight's V_local=" << vocab << " (R + 1 ascending ids)");
  for (size_t r = 0; r + 1 < bounds.size(); ++r)
    DETLOGP_CHECK(bounds[r + 1] > bounds[r] || vocab == 0,
                  "shard bounds[" << r + 1 << "]=" << bounds[r + 1] << " must exceed bounds[" << r << "]=" << bounds[r]
                                  << ": every shard holds rows");
  const int64_t real_vocab = in.real_vocab < 0 ? vocab : in.real_vocab;
  const int64_t per_row = in.targets.ndim == 2 ? in.targets.cols : 1;

  struct RankBuffers {
    std::vector<TileSummary> summaries;
    std::vector<float> target_logit;
    std::vector<uint8_t> owned;
    std::vector<float> usums;  // with the entropy output only
    std::vector<float> edge_logits;
    std::vector<float> topk_logit;  // with the top-k output only
    std::vector<int64_t> topk_ids;
  };
  const int64_t topk = out.topk_ids.present() && out.topk_ids.ndim == 2 ? out.topk_ids.cols : 0;
  const bool entropy = out.entropy.present();
  const int ranks = static_cast<int>(bounds.size()) - 1;
  std::vector<RankBuffers> buffers(static_cast<size_t>(ranks));
  std::vector<ShardPartials> partials;
  CallReport report;
  for (int r = 0; r < ranks; ++r) {
    const int64_t start = bounds[r];
    const int64_t count = bounds[r + 1] - start;
    LinearLogpInputs shard_in = in;
    shard_in.weight = TensorView::matrix(static_cast<const uint16_t*>(in.weight.data) + start * in.weight.row_stride,
                                         DType::bf16, count, in.weight.cols, Memory::host, in.weight.row_stride);
    if (in.bias.present())
      shard_in.bias = TensorView::vector(static_cast<const float*>(in.bias.data) + start, DType::f32, count);
    shard_in.vocab_start = start;
    shard_in.real_vocab = real_vocab;
    const ShardGeometry g = count > 0 && real_vocab > 0 ? shard_geometry(start, count, real_vocab) : ShardGeometry{};
    RankBuffers& b = buffers[static_cast<size_t>(r)];
    ShardPartials p;
    p.rows = rows;
    p.memory = Memory::host;
    p.tiles = g.tiles;
    p.edge_lanes = g.edge_lanes();
    p.targets_per_row = per_row;
    b.summaries.resize(static_cast<size_t>(rows * p.tiles));
    b.target_logit.resize(static_cast<size_t>(rows * per_row));
    b.owned.resize(static_cast<size_t>(rows * per_row));
    b.edge_logits.resize(static_cast<size_t>(rows * p.edge_lanes));
    p.summaries = b.summaries.data();
    p.target_logit = b.target_logit.data();
    p.target_owned = b.owned.data();
    p.edge_logits = b.edge_logits.data();
    if (entropy) {
      b.usums.resize(static_cast<size_t>(rows * p.tiles));
      p.usums = b.usums.data();
    }
    if (topk > 0) {
      b.topk_logit.resize(static_cast<size_t>(rows * topk));
      b.topk_ids.resize(static_cast<size_t>(rows * topk));
      p.topk = topk;
      p.topk_logit = b.topk_logit.data();
      p.topk_ids = b.topk_ids.data();
    }
    report = linear_logp_partials(shard_in, p, opt);
    partials.push_back(p);
  }
  // Validate the outputs like linear_logp would, then merge.
  DETLOGP_CHECK(out.logp.rows == rows && out.lse.ndim == 1 && out.lse.rows == rows,
                "logp and lse must have N=" << rows << " rows");
  DETLOGP_CHECK(!out.logits.present(),
                "simulate_tensor_parallel serves the trainer entry only (logits must be absent)");
  LinearLogpOutputs merged = out;
  merge_partials(partials, in.targets, in.ignore_index, merged);
  return report;
}

}  // namespace detlogp

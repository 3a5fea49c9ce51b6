#include "cli/compute.hpp"

#include <sstream>

#include "cli/options.hpp"
#include "io/sha256.hpp"

namespace detlogp::cli {

namespace {

using io::ElementType;
using io::HostTensor;

HostTensor f32_tensor(std::vector<int64_t> shape) { return HostTensor::zeros(ElementType::f32, std::move(shape)); }

RunOutputs compute_partials(const HostProblem& p, const LinearLogpInputs& in, const CallOptions& opt) {
  RunOutputs out;
  out.partials = true;
  const int64_t tiles = shard_tiles(p.vocab_local);
  std::vector<TileSummary> summaries(static_cast<size_t>(p.rows * tiles));
  HostTensor target_logit = f32_tensor({p.rows});
  HostTensor owned = HostTensor::zeros(ElementType::u8, {p.rows});
  ShardPartials partials;
  partials.rows = p.rows;
  partials.tiles = tiles;
  partials.summaries = summaries.data();
  partials.target_logit = static_cast<float*>(target_logit.data());
  partials.target_owned = static_cast<uint8_t*>(owned.data());
  out.report = linear_logp_partials(in, partials, opt);
  HostTensor tile_max = f32_tensor({p.rows, tiles});
  HostTensor tile_sum = f32_tensor({p.rows, tiles});
  auto* max_out = static_cast<float*>(tile_max.data());
  auto* sum_out = static_cast<float*>(tile_sum.data());
  for (size_t i = 0; i < summaries.size(); ++i) {
    max_out[i] = summaries[i].max;
    sum_out[i] = summaries[i].sum;
  }
  out.tensors = {{"tile_max", std::move(tile_max)},
                 {"tile_sum", std::move(tile_sum)},
                 {"target_logit", std::move(target_logit)},
                 {"target_owned", std::move(owned)}};
  return out;
}

}  // namespace

RunOutputs compute(const HostProblem& p, bool return_logits, const CallOptions& opt) {
  const LinearLogpInputs in = p.inputs();
  const int64_t real_vocab = p.effective_real_vocab();
  if (p.vocab_start > 0 || p.vocab_start + p.vocab_local < real_vocab) {
    if (return_logits) {
      throw UsageError("--return-logits needs the whole vocabulary in one shard; this shard [" +
                       std::to_string(p.vocab_start) + ", " + std::to_string(p.vocab_start + p.vocab_local) +
                       ") of real_vocab=" + std::to_string(real_vocab) + " produces partials");
    }
    return compute_partials(p, in, opt);
  }
  RunOutputs out;
  HostTensor logp = f32_tensor({p.rows});
  HostTensor lse = f32_tensor({p.rows});
  HostTensor logits;
  LinearLogpOutputs o{
      mutable_vector(logp.data(), DType::f32, p.rows), mutable_vector(lse.data(), DType::f32, p.rows), {}};
  if (return_logits) {
    logits = f32_tensor({p.rows, p.vocab_local});
    o.logits = mutable_matrix(logits.data(), DType::f32, p.rows, p.vocab_local);
  }
  out.report = linear_logp(in, o, opt);
  out.logits = return_logits;
  out.tensors = {{"logp", std::move(logp)}, {"lse", std::move(lse)}};
  if (return_logits) out.tensors.emplace_back("logits", std::move(logits));
  return out;
}

std::string output_sha256(const RunOutputs& out) {
  io::Sha256 h;
  for (const auto& [name, t] : out.tensors) h.update(t.bytes.data(), t.bytes.size());
  return io::Sha256::hex(h.finish());
}

std::string sha_scope(const RunOutputs& out) {
  std::string s;
  for (const auto& [name, t] : out.tensors) s += (s.empty() ? "" : "|") + name;
  return s;
}

std::string describe_report(const CallReport& r) {
  std::ostringstream os;
  os << r.provenance.backend_id << " (requested " << r.requested_backend << ", strict " << (r.strict ? "on" : "off")
     << ", fallback " << (r.fallback ? "yes: " + r.fallback_reason : std::string("no")) << ")";
  return os.str();
}

}  // namespace detlogp::cli

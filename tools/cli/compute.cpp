#include "cli/compute.hpp"

#include <iomanip>
#include <sstream>

#include "io/sha256.hpp"

namespace detlogp::cli {

namespace {

using io::ElementType;
using io::HostTensor;

HostTensor f32_tensor(std::vector<int64_t> shape) { return HostTensor::zeros(ElementType::f32, std::move(shape)); }

// [N] f32, or [N, K] for [N, K] targets: what is shaped like the targets.
// Rows of the [N, K] top-k buffers: none for a K beyond kMaxTopk, which the library refuses (naming
// K) before it reads a row, so that a huge --topk gets that message instead of an allocation failure.
int64_t topk_buffer_rows(const HostProblem& p, int64_t topk) { return topk <= kMaxTopk ? p.rows : 0; }

HostTensor per_target_f32(const HostProblem& p) {
  return p.targets.ndim == 2 ? f32_tensor({p.rows, p.targets.cols}) : f32_tensor({p.rows});
}

RunOutputs compute_partials(const HostProblem& p, const LinearLogpInputs& in, const CallOptions& opt, bool entropy,
                            int64_t topk) {
  RunOutputs out;
  out.entry = Entry::partials;
  // The shard's whole tiles and edge lanes; a shard the library refuses sizes nothing (it names the reason).
  const int64_t real_vocab = p.effective_real_vocab();
  const ShardGeometry g = p.vocab_local > 0 && p.vocab_start >= 0 && real_vocab > 0
                              ? shard_geometry(p.vocab_start, p.vocab_local, real_vocab)
                              : ShardGeometry{};
  const int64_t tiles = g.tiles;
  std::vector<TileSummary> summaries(static_cast<size_t>(p.rows * tiles));
  const int64_t per_row = p.targets.ndim == 2 ? p.targets.cols : 1;
  HostTensor target_logit = per_target_f32(p);
  HostTensor owned = p.targets.ndim == 2 ? HostTensor::zeros(ElementType::u8, {p.rows, per_row})
                                         : HostTensor::zeros(ElementType::u8, {p.rows});
  HostTensor edge_logits = f32_tensor({p.rows, g.edge_lanes()});
  HostTensor topk_logit = f32_tensor({topk_buffer_rows(p, topk), topk});
  HostTensor topk_ids = HostTensor::zeros(ElementType::i64, {topk_buffer_rows(p, topk), topk});
  ShardPartials partials;
  partials.rows = p.rows;
  partials.targets_per_row = per_row;
  partials.topk = topk;
  partials.topk_logit = static_cast<float*>(topk_logit.data());
  partials.topk_ids = static_cast<int64_t*>(topk_ids.data());
  partials.tiles = tiles;
  partials.summaries = summaries.data();
  partials.target_logit = static_cast<float*>(target_logit.data());
  partials.target_owned = static_cast<uint8_t*>(owned.data());
  partials.edge_lanes = g.edge_lanes();
  partials.edge_logits = static_cast<float*>(edge_logits.data());
  HostTensor usums;
  if (entropy) {
    usums = f32_tensor({p.rows, tiles});
    partials.usums = static_cast<float*>(usums.data());
  }
  out.report = linear_logp_partials(in, partials, opt);
  out.layout = partials.layout;
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
  if (entropy) out.tensors.emplace_back("usums", std::move(usums));
  if (g.edge_lanes() > 0) out.tensors.emplace_back("edge_logits", std::move(edge_logits));
  if (topk > 0) {
    out.tensors.emplace_back("topk_logit", std::move(topk_logit));
    out.tensors.emplace_back("topk_ids", std::move(topk_ids));
  }
  return out;
}

// A weight that is not the whole vocabulary from id 0 gives partials, never logp/lse.
bool is_vocab_shard(const HostProblem& p) {
  return p.vocab_start != 0 || p.vocab_start + p.vocab_local < p.effective_real_vocab();
}

}  // namespace

RunOutputs compute(const HostProblem& p, Entry entry, const CallOptions& opt, bool entropy, int64_t topk) {
  const LinearLogpInputs in = p.inputs();
  if (entry == Entry::partials) return compute_partials(p, in, opt, entropy, topk);
  DETLOGP_CHECK(!is_vocab_shard(p), "real_vocab=" << p.effective_real_vocab() << " but the weight has V_local="
                                                  << p.vocab_local << " rows from vocab_start=" << p.vocab_start
                                                  << " (ids [" << p.vocab_start << ", " << p.vocab_start + p.vocab_local
                                                  << ")): a vocabulary shard gives tensor-parallel partials, not "
                                                     "logp/lse; pass --partials (with --vocab-start and "
                                                     "--real-vocab) to write them");
  const bool return_logits = entry == Entry::serving;
  RunOutputs out;
  out.entry = entry;
  HostTensor logp = per_target_f32(p);
  HostTensor lse = f32_tensor({p.rows});
  HostTensor logits;
  LinearLogpOutputs o{p.targets.ndim == 2 ? mutable_matrix(logp.data(), DType::f32, p.rows, p.targets.cols)
                                          : mutable_vector(logp.data(), DType::f32, p.rows),
                      mutable_vector(lse.data(), DType::f32, p.rows),
                      {}};
  if (return_logits) {
    logits = f32_tensor({p.rows, p.vocab_local});
    o.logits = mutable_matrix(logits.data(), DType::f32, p.rows, p.vocab_local);
  }
  HostTensor entropy_rows;
  if (entropy) {
    entropy_rows = f32_tensor({p.rows});
    o.entropy = mutable_vector(entropy_rows.data(), DType::f32, p.rows);
  }
  HostTensor topk_ids, topk_logp;
  if (topk > 0) {
    topk_ids = HostTensor::zeros(ElementType::i64, {topk_buffer_rows(p, topk), topk});
    topk_logp = f32_tensor({topk_buffer_rows(p, topk), topk});
    o.topk_ids = mutable_matrix(topk_ids.data(), DType::i64, p.rows, topk);
    o.topk_logp = mutable_matrix(topk_logp.data(), DType::f32, p.rows, topk);
  }
  out.report = linear_logp(in, o, opt);
  out.tensors = {{"logp", std::move(logp)}, {"lse", std::move(lse)}};
  if (return_logits) out.tensors.emplace_back("logits", std::move(logits));
  if (entropy) out.tensors.emplace_back("entropy", std::move(entropy_rows));
  if (topk > 0) {
    out.tensors.emplace_back("topk_ids", std::move(topk_ids));
    out.tensors.emplace_back("topk_logp", std::move(topk_logp));
  }
  return out;
}

namespace {

std::string hex64(uint64_t v) {
  std::ostringstream s;
  s << std::hex << std::setw(16) << std::setfill('0') << v;
  return s.str();
}

}  // namespace

std::map<std::string, std::string> partials_metadata(const HostProblem& p, const RunOutputs& out) {
  const Provenance& prov = out.report.provenance;
  const PartialsLayout& l = out.layout;
  const ShardGeometry g = shard_geometry(l.vocab_start, l.vocab_local, l.real_vocab);
  return {
      {"rows", std::to_string(p.rows)},
      {"tiles", std::to_string(g.tiles)},
      {"first_tile", std::to_string(g.first_tile)},
      {"head_lanes", std::to_string(g.head_lanes)},
      {"tail_lanes", std::to_string(g.tail_lanes)},
      {"vocab_start", std::to_string(l.vocab_start)},
      {"vocab_local", std::to_string(l.vocab_local)},
      {"real_vocab", std::to_string(l.real_vocab)},
      {"ignore_index", std::to_string(l.ignore_index)},
      {"backend", prov.backend_id},
      {"contract", prov.contract_name + " v" + std::to_string(prov.contract_version)},
      {"targets_digest", hex64(l.targets_digest)},
      {"temperature_digest", hex64(l.temperature_digest)},
      {"backend_digest", hex64(l.backend_digest)},
  };
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

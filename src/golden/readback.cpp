#include "golden/readback.hpp"

namespace detlogp::golden {

void SideReadback::add(const CallReport& r) {
  const std::string p = to_string(r.provenance);
  if (calls == 0) {
    backend = r.provenance.backend_id;
    provenance = p;
    entropy_id = r.provenance.entropy_id;
  }
  DETLOGP_CHECK(p == provenance, "one side was served by two backends: " << provenance << " and " << p);
  ++calls;
  if (r.fallback) {
    ++fallbacks;
    fallback_reason = r.fallback_reason;
  }
}

void run_tensor_parallel(const LinearLogpInputs& in, const std::vector<Shard>& shards, float* logp, float* lse,
                         const CallOptions& opt, SideReadback& rb, const TpPlacement& placement, float* logits) {
  std::vector<Shard> used;
  for (const Shard& s : shards)
    if (s.weight.rows > 0) used.push_back(s);
  DETLOGP_CHECK(logits == nullptr || used.size() == shards.size(),
                "a serving call needs every shard non-empty (the logits columns are the shards')");
  std::vector<CallReport> reports;
  tensor_parallel_logp(in, used, logp, lse, opt, &reports, placement, logits);
  for (const CallReport& r : reports) rb.add(r);
}

}  // namespace detlogp::golden

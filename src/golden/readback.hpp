// What one side of a two-engine check observed: the backend of every call and whether any call
// fell back; and the tensor-parallel call both the L3 trainer side and the harness's engines
// make through it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "golden/goldens.hpp"

namespace detlogp::golden {

struct SideReadback {
  std::string backend, provenance;
  std::string entropy_id;  // the serving backend's (empty: it serves no entropy output)
  int64_t calls = 0, fallbacks = 0;
  std::string fallback_reason;
  // Records one call; fails when the side was served by two backends.
  void add(const CallReport& r);
};

// Vocabulary parallel, through the tensor-parallel operator (one thread per rank); empty shards
// (a head smaller than the TP degree's tiles) are left out. With `logits` (the serving entry)
// every shard must be non-empty, since the logits columns are the shards'.
void run_tensor_parallel(const LinearLogpInputs& in, const std::vector<Shard>& shards, float* logp, float* lse,
                         const CallOptions& opt, SideReadback& rb, const TpPlacement& placement = {},
                         float* logits = nullptr);

}  // namespace detlogp::golden

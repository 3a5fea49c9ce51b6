// One problem through the library: the trainer or serving entry for a whole vocabulary, the
// tensor-parallel partials for a vocabulary shard, and the digest `detlogp run` prints.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "cli/problem.hpp"
#include "detlogp/detlogp.hpp"
#include "io/host_tensor.hpp"

namespace detlogp::cli {

struct RunOutputs {
  std::vector<std::pair<std::string, io::HostTensor>> tensors;  // in SHA order
  CallReport report;
  bool partials = false;
  bool logits = false;
};

// logp, lse [N] f32 (and logits [N, V_local] with return_logits); for a vocabulary shard
// (vocab_start > 0 or V_local short of the real vocabulary) tile_max, tile_sum [N, tiles] f32,
// target_logit [N] f32 and target_owned [N] u8. Throws UsageError for logits of a shard.
RunOutputs compute(const HostProblem& p, bool return_logits, const CallOptions& opt);

// SHA-256 of the output tensors' raw bytes concatenated in order, and the order as "a|b|c".
std::string output_sha256(const RunOutputs& out);
std::string sha_scope(const RunOutputs& out);

// "<backend> (requested <id>, strict on|off, fallback no|yes: <reason>)".
std::string describe_report(const CallReport& r);

}  // namespace detlogp::cli

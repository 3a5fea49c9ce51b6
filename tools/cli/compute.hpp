// One problem through the library: the trainer or serving entry for a whole vocabulary, the
// tensor-parallel partials of a vocabulary shard, and the digest `detlogp run` prints.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cli/problem.hpp"
#include "detlogp/detlogp.hpp"
#include "io/host_tensor.hpp"

namespace detlogp::cli {

enum class Entry {
  trainer,   // logp, lse [N] f32
  serving,   // logp, lse and logits [N, V_local] f32
  partials,  // tile_max, tile_sum [N, tiles] f32, target_logit [N] f32, target_owned [N] u8 (, usums [N, tiles] f32)
};

struct RunOutputs {
  std::vector<std::pair<std::string, io::HostTensor>> tensors;  // in SHA order
  CallReport report;
  Entry entry = Entry::trainer;
  PartialsLayout layout;  // Entry::partials: what linear_logp_partials recorded
};

// The outputs of `entry`. The trainer and serving entries refuse a vocabulary shard (a weight
// whose rows are not the whole vocabulary from id 0: vocab_start != 0 or vocab_start + V_local <
// real_vocab) with an error naming real_vocab, V_local and vocab_start that says to ask for
// --partials.
// entropy: also the rows' entropy [N] f32, after the other outputs (docs/contract.md §10); for
// partials, the tiles' entropy sums usums [N, tiles] f32 after the four partials tensors, which a
// merge with entropy needs from every shard.
// topk > 0: also topk_ids [N, K] i64 and topk_logp [N, K] f32 after them (docs/contract.md §12);
// for partials the shard's lists, topk_logit [N, K] f32 and topk_ids [N, K] i64, last.
RunOutputs compute(const HostProblem& p, Entry entry, const CallOptions& opt, bool entropy = false, int64_t topk = 0);

// The layout a partials file carries so shards can be checked before a merge (docs/cli.md): rows,
// tiles, backend, contract and the library's PartialsLayout (vocab_start, vocab_local, real_vocab,
// ignore_index, targets/temperature/backend digests as 16 hex digits), from which a reader rebuilds
// the PartialsLayout that merge_partials checks.
std::map<std::string, std::string> partials_metadata(const HostProblem& p, const RunOutputs& out);

// SHA-256 of the output tensors' raw bytes concatenated in order, and the order as "a|b|c".
std::string output_sha256(const RunOutputs& out);
std::string sha_scope(const RunOutputs& out);

// "<backend> (requested <id>, strict on|off, fallback no|yes: <reason>)".
std::string describe_report(const CallReport& r);

}  // namespace detlogp::cli

// The rollout-vs-trainer harness's report: what the run observed, rendered as report.json, as
// report.md and as the summary lines of the log.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "golden/harness.hpp"
#include "golden/readback.hpp"

namespace detlogp::golden {

// Everything the harness observed that the report states.
struct HarnessRun {
  int64_t real_vocab = 0;
  SideReadback rollout, trainer;
  std::string rollout_fingerprint, trainer_fingerprint;
  // The rollout's continuous batching.
  int64_t steps = 0, batch_calls = 0, max_active = 0, distinct_batch_sizes = 0;
  int64_t membership_changes = 0;     // steps whose set of sequences differs from the step before
  int64_t lse_readback_mismatch = 0;  // tokens whose serving lse differs from the reducer's
  // The serving call's own entropy against the reducer's, on the tokens where the serving call
  // gave one (a TP = 1 engine whose backend serves the entropy output).
  int64_t entropy_readback_checked = 0, entropy_readback_mismatch = 0;
  // The trainer's packed batch, one entry per token.
  std::vector<std::pair<int64_t, int64_t>> where;  // (sequence, position)
  std::vector<int64_t> tokens;
  std::vector<float> temperatures, rollout_logp, trainer_logp, control_logp;
  // Rollout: the reducer's entropy over the served logits (as its logp). Trainer: its own entropy
  // output (filled when the trainer's backend serves it, `trainer_entropy_how` says through what).
  std::vector<float> rollout_entropy, trainer_entropy;
  std::string trainer_entropy_how;
  std::vector<double> k3, control_k3;  // filled when the logprobs were compared
  // With the sampling program: the raw logp of each token on both sides (logp above is the processed
  // one), each token's program, the tokens the replay found outside its support (must be 0) and those
  // the engine sampler's control filtered out (its logp is then -inf).
  std::vector<float> rollout_logp_raw, trainer_logp_raw;
  std::vector<int64_t> top_k;
  std::vector<float> top_p, min_p;
  int64_t replay_outside_support = 0, control_filtered = 0;

  int64_t total() const { return static_cast<int64_t>(tokens.size()); }
  bool same_weights() const { return trainer_fingerprint == rollout_fingerprint; }
  bool fallback_free() const { return rollout.fallbacks == 0 && trainer.fallbacks == 0; }
};

std::string report_json(const HarnessConfig& cfg, const HarnessRun& run, const HarnessResult& res);
std::string report_markdown(const HarnessConfig& cfg, const HarnessRun& run, const HarnessResult& res);
void log_summary(const HarnessConfig& cfg, const HarnessRun& run, const HarnessResult& res, std::ostream& log);

}  // namespace detlogp::golden

// Validation ladder L3-L5 on one host (docs/validation.md).
//
// L3: the golden inputs through a trainer-shaped call (packed batch, vocabulary-parallel, trainer
//     entry) and a rollout-shaped call (one row at a time, serving entry), each side in its own
//     process writing a result file; a checker compares the bytes.
// L4/L5: a synthetic rollout loop with continuous batching and a sampler, then a trainer
//     recomputation (packed, tensor parallel) at the same weight fingerprint; exact-zero metrics
//     of logp and of the entropy, a materializing bf16-logits negative control, and a JSON +
//     markdown report.
//
// L3 lives in l3.cpp, L4/L5 in rollout_harness.cpp and its report in report.cpp; both share the
// side readback of readback.hpp.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "detlogp/detlogp.hpp"

namespace detlogp::golden {

// ---- L3 ----------------------------------------------------------------------------------------

enum class L3Side { trainer, rollout };

// Runs the named golden cases (all when empty) as one side and writes FILE.safetensors:
// tensors "<case>/logp", "<case>/lse" (F32 [N]); metadata format=detlogp-l3-v1, side, pid,
// backend, provenance, fallback ("no" or the reason), and per case "<case>/inputs_sha256",
// "<case>/weight_fingerprint". The trainer side uses `tp` vocabulary shards (partials + merge).
void l3_run_side(L3Side side, const std::vector<std::string>& cases, int tp, const CallOptions& opt,
                 const std::string& out_path, std::ostream& log);

// Compares two side files case by case; returns true when every case present in both has equal
// inputs and weight fingerprints and identical logp and lse bytes, and both sides cover the same
// cases. Prints one line per case and the provenance of both sides.
bool l3_check(const std::string& a_path, const std::string& b_path, std::ostream& log);

// Writes each case's inputs as DIR/<case>.safetensors in the `detlogp run --input` format
// (hidden, weight, targets, optional bias, temperature) for an external rollout side (Python).
// DIR and its missing parents are created (mkdir -p).
void l3_export_inputs(const std::vector<std::string>& cases, const std::string& dir, std::ostream& log);

// ---- L4/L5 -------------------------------------------------------------------------------------

struct HarnessConfig {
  int64_t seqs = 16;
  int64_t max_len = 12;
  int64_t max_batch = 8;  // continuous batching: at most this many sequences per step
  int64_t dim = 1024;
  int64_t weight_rows = 2053;  // the whole head, padding included
  int64_t real_vocab = -1;     // -1: weight_rows
  int tp = 2;                  // trainer tensor-parallel degree
  int cp = 1;                  // trainer context-parallel degree: the packed rows split into cp groups
  int rollout_tp = 1;          // rollout engine tensor-parallel degree (serving entry, logits gathered)
  std::vector<int> devices;    // empty: in-process host ranks; else CUDA devices + NCCL (see TpPlacement)
  uint64_t seed = 0;
  CallOptions rollout_opt, trainer_opt;
  bool perturb_trainer_weight = false;  // flip one weight bit on the trainer side (fingerprint check)
  // The rollout draws each token with the sampling program (sample/v1, docs/contract.md §11) at
  // per-sequence T, top-k, top-p and min-p, and records its processed and raw logp; the trainer
  // replays the program (linear_logp with a SamplingProgram); the negative control is an engine's
  // own sampler (bf16 logits, divide by T, sort-based top-k/top-p, min-p, softmax renormalization).
  // In-process host ranks only (no devices).
  bool sampling = false;
};

struct Metrics {
  int64_t total = 0;
  int64_t mismatch_count = 0;                       // logp bit patterns that differ
  double train_rollout_logprob_abs_diff = 0;        // mean |logp_train - logp_rollout|
  double current_rollout_logprob_max_abs_diff = 0;  // max |logp_train - logp_rollout|
  double k3_max = 0, k3_mean = 0;                   // K3 = rho - 1 - log(rho), rho = exp(logp_train - logp_rollout)
  int64_t k3_nonzero = 0;
};

// Rollout entropy vs trainer entropy (docs/contract.md §10), token by token: exactly zero expected.
struct EntropyMetrics {
  int64_t total = 0;
  int64_t mismatch_count = 0;  // entropy bit patterns that differ
  double mean_abs_diff = 0;    // mean |H_train - H_rollout|
  double max_abs_diff = 0;     // max |H_train - H_rollout|
};

struct HarnessResult {
  bool compared = false;  // false when the weight fingerprints differ
  bool exact = false;     // compared and every logp metric exactly zero
  bool control_drift = false;
  // The entropy row: compared when the logprobs are and the trainer's backend serves the entropy
  // output (its provenance names an entropy_id; else entropy_note says why not); exact when every
  // entropy metric is zero and the rollout's serving entropy (where it gave one) equals the
  // reducer's.
  bool entropy_compared = false;
  bool entropy_exact = false;
  std::string entropy_note;
  std::string json, markdown;
  // With cfg.sampling: metrics compares the processed logp, raw the raw logp (both must be exactly
  // zero for `exact`), control the engine sampler's processed logp against the trainer's.
  Metrics metrics, control, raw;
  EntropyMetrics entropy;
};

HarnessResult run_rollout_vs_trainer(const HarnessConfig& cfg, std::ostream& log);

}  // namespace detlogp::golden

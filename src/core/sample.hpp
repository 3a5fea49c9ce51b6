// The validated problem of the sampling program's two entries (docs/contract.md §11): `sample`
// (the rollout draws a token per row) and linear_logp with a SamplingProgram (the trainer replays
// it for given targets). Host-resident parameter values are checked here, before anything is written.
#pragma once

#include <cstdint>

#include "core/problem.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/sample.hpp"

namespace detlogp::detail {

// The program's parameters as a backend reads them: a scalar, or a per-row array.
struct ProgramOperands {
  float temperature = 1.0f;
  const float* temperature_rows = nullptr;
  int64_t top_k = 0;
  const void* top_k_rows = nullptr;
  bool top_k_i64 = false;
  float top_p = 1.0f;
  const float* top_p_rows = nullptr;
  float min_p = 0.0f;
  const float* min_p_rows = nullptr;

  DETLOGP_HD float temperature_of(int64_t n) const { return temperature_rows ? temperature_rows[n] : temperature; }
  DETLOGP_HD int64_t top_k_of(int64_t n) const {
    if (!top_k_rows) return top_k;
    return top_k_i64 ? static_cast<const int64_t*>(top_k_rows)[n] : static_cast<const int32_t*>(top_k_rows)[n];
  }
  DETLOGP_HD float top_p_of(int64_t n) const { return top_p_rows ? top_p_rows[n] : top_p; }
  DETLOGP_HD float min_p_of(int64_t n) const { return min_p_rows ? min_p_rows[n] : min_p; }
  DETLOGP_HD SampleRowParams row(int64_t n, int64_t real_vocab) const {
    return sample_row_params(temperature_of(n), top_k_of(n), top_p_of(n), min_p_of(n), real_vocab);
  }
};

struct SampleProblem : HeadOperands {
  int64_t vocab_local = 0;
  ProgramOperands program;
  bool replay = false;  // linear_logp with a program: targets given, no draw

  // sample: the rows' random keys.
  uint64_t seed = 0;
  const int64_t* seed_rows = nullptr;  // [rows] uint64 bits, or null
  const int64_t* key = nullptr;        // [rows]

  // Outputs, [rows] each unless said; optional ones may be null.
  float* logp = nullptr;
  float* logp_raw = nullptr;
  float* lse = nullptr;
  int64_t* support_size = nullptr;
  int64_t* token = nullptr;      // sample
  float* logits = nullptr;       // sample: [rows][vocab_local], or null
  float* lse_support = nullptr;  // replay
  float* support_max = nullptr;  // replay
  float* cut_logit = nullptr;    // replay
  int64_t* cut_id = nullptr;     // replay
  int64_t topk = 0;              // sample: K of topk_ids / topk_logp [rows][K], 0 without them
  int64_t* topk_ids = nullptr;
  float* topk_logp = nullptr;

  DETLOGP_HD uint64_t row_stream(int64_t n) const {
    return sample_stream(seed_rows ? static_cast<uint64_t>(seed_rows[n]) : seed, key[n]);
  }

  // Writes row n's outputs from what its passes found (§11.7-§11.10), on the host or the device: the
  // raw statistics, the support, the support pass (its draw for `sample`; {0, 0, kNoToken, 0} for a row
  // without a processed distribution) and, for the replay, the scaled target logit (0 when ignored).
  // Returns whether a replayed target lies outside the support.
  DETLOGP_HD bool write_row(int64_t n, const RowStats& st, const SupportRow& support, const SupportPass& pass,
                            float target_logit) const {
    const bool samplable = row_samplable(st);
    lse[n] = st.lse;
    if (support_size) support_size[n] = pass.size;
    if (!replay) {
      token[n] = pass.token;
      logp[n] = samplable ? target_logp(pass.token_logit, support_lse(st, support, pass.sum)) : fp::canonical_nan();
      logp_raw[n] = samplable ? target_logp(pass.token_logit, st.lse) : fp::canonical_nan();
      return false;
    }
    const int64_t t = target(n);
    const bool ignored = t == ignore_index;
    logp_raw[n] = ignored ? 0.0f : target_logp(target_logit, st.lse);
    const RowResult processed =
        samplable ? RowResult{0.0f, support_lse(st, support, pass.sum)} : RowResult{fp::canonical_nan(), st.lse};
    if (lse_support) lse_support[n] = processed.lse;
    if (support_max) support_max[n] = st.max;
    if (cut_logit) cut_logit[n] = support.cut.logit;
    if (cut_id) cut_id[n] = support.cut.id;
    if (ignored) {
      logp[n] = 0.0f;
      return false;
    }
    const bool outside = samplable && !in_support(target_logit, t, support);
    logp[n] = outside ? fp::neg_inf() : (samplable ? target_logp(target_logit, processed.lse) : processed.logp);
    return outside;
  }
};

// The rollout entry's problem: head checks as linear_logp's (the whole vocabulary, or with `shard`
// one rank's shard of a tensor-parallel call), the program, seed and key, the outputs.
SampleProblem make_sample_problem(const SampleInputs& in, const SampleOutputs& out, bool shard = false);
// The replay's problem: linear_logp's checks (targets, ignore_index), the program, the outputs.
SampleProblem make_sampled_logp_problem(const LinearLogpInputs& in, const SamplingProgram& program,
                                        const SampledLogpOutputs& out, bool shard = false);

// With a program the temperature is the program's: in.temperature must be 1, temperature_rows absent.
void check_program_temperature_only(const LinearLogpInputs& in);

// The program's checks alone, for `rows` rows in memory `mem` (row values read here for host memory):
// fills `p`; every bad value names the argument, the row and the value.
void check_program(const SamplingProgram& program, int64_t rows, Memory mem, int device, ProgramOperands& p);
// The per-row values of a program in host memory (a device backend checks a host copy of its rows).
void check_program_rows(const ProgramOperands& p, int64_t rows);

}  // namespace detlogp::detail

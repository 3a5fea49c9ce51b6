// The validated problem of linear_logp_grad_logits and the implementations that take it: the CPU
// one (src/cpu/cpu_grad_logits.cpp), the SM90 one (src/sm90/sm90_grad_logits.cu, or a stub that
// throws in builds without CUDA), and the host epilogue over given logits that tests use as the
// bitwise reference of either.
#pragma once

#include <cstdint>

#include "core/problem.hpp"
#include "core/sample.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/grad.hpp"

namespace detlogp::detail {

// The sampling replay's per-row operands of its logit gradient, host or device pointers ([rows]
// each): the program and the replay forward's outputs, which fix the support (docs/contract.md
// §11.10). One definition of a row's SampledGradRow for the CPU loop and the SM90 epilogue.
struct SampledGradOperands {
  ProgramOperands program;
  const float* forward_logp = nullptr;  // the replay's logp: -inf for a target outside the support
  const float* lse_support = nullptr;
  const float* support_max = nullptr;
  const float* cut_logit = nullptr;
  const int64_t* cut_id = nullptr;
  const float* g_logp_raw = nullptr;  // or null (zeros)

  // Row n's operands: lse the forward's, g_logp and g_lse the upstream gradients (or null), ignored
  // whether its target is ignore_index. A target outside the support has the constant logp -inf, so
  // its g_logp does not enter.
  DETLOGP_HD SampledGradRow row(int64_t n, int64_t real_vocab, bool ignored, const float* lse, const float* g_logp,
                                const float* g_lse) const {
    const SampleRowParams prm = program.row(n, real_vocab);
    SampledGradRow r;
    r.inv_t = prm.inv_temperature;
    r.lse = lse[n];
    r.lse_support = lse_support[n];
    r.support = {support_max[n], {cut_logit[n], cut_id[n]}, prm.min_p};
    const bool outside = forward_logp[n] == fp::neg_inf();
    r.gl = (ignored || outside || g_logp == nullptr) ? 0.0f : g_logp[n];
    r.gs = g_lse == nullptr ? 0.0f : g_lse[n];
    r.glr = (ignored || g_logp_raw == nullptr) ? 0.0f : g_logp_raw[n];
    return r;
  }
};

// A row's target entries in the chunk: the columns of its non-ignored entries that fall in it,
// with their dL/dlogp, in entry order (a repeated id appears once per entry).
struct GradEntries {
  int count = 0;
  int64_t col[kMaxTargetsPerRow];
  float g[kMaxTargetsPerRow];
};

struct GradLogitsProblem : HeadOperands {
  int64_t cols = 0;  // C: columns of the chunk (weight rows)

  const float* lse = nullptr;        // [rows]
  const float* g_logp = nullptr;     // [rows][targets_per_row] or null (zeros)
  const float* g_lse = nullptr;      // [rows] or null (zeros)
  const float* entropy = nullptr;    // [rows]: the forward's H (set exactly when g_entropy is)
  const float* g_entropy = nullptr;  // [rows] or null: no entropy term

  uint16_t* dz = nullptr;  // bf16 bits [rows][dz_stride]
  int64_t dz_stride = 0;

  // linear_logp_grad_from_logits: z is read from these logits [rows][logits_stride] (bias
  // included), hidden, weight and bias are not read. dz may be the same bytes (in place: dz ==
  // logits and dz_stride == 2 * logits_stride, so row n's dz element c overwrites logit c / 2,
  // already read by a pass that reads each row's columns in ascending order before it writes them).
  const float* logits = nullptr;
  int64_t logits_stride = 0;

  // The sampling replay's gradient (sampled_grad_logit) instead of the plain one: the program and
  // the replay's per-row outputs (all [rows]).
  bool sampled = false;
  SampledGradOperands replay;

  // Chunk columns [0, real_cols()) have global ids < real_vocab.
  int64_t real_cols() const {
    const int64_t n = real_vocab - vocab_start;
    return n <= 0 ? 0 : (n >= cols ? cols : n);
  }
  // Host memory only: the row's operands and its target entries in the chunk.
  GradRow grad_row(int64_t row, GradEntries* entries) const {
    const int64_t k = targets_per_row;
    bool ignored[kMaxTargetsPerRow];
    float g[kMaxTargetsPerRow];
    entries->count = 0;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t t = target(row, i);
      ignored[i] = t == ignore_index;
      g[i] = g_logp == nullptr ? 0.0f : g_logp[row * k + i];
      const int64_t col = target_column(t, ignored[i]);
      if (col >= 0) {
        entries->col[entries->count] = col;
        entries->g[entries->count++] = g[i];
      }
    }
    GradRow r;
    r.inv_t = inverse_temperature(temperature_rows ? temperature_rows[row] : temperature);
    r.lse = lse[row];
    r.gl = g_logp == nullptr ? 0.0f : entry_gradient_sum(g, ignored, static_cast<int>(k));
    r.gs = g_lse == nullptr ? 0.0f : g_lse[row];
    if (g_entropy != nullptr) {
      r.entropy_term = true;
      r.gh = g_entropy[row];
      r.h = entropy[row];
    }
    return r;
  }
  // The sampled form of grad_row (host memory; one target a row).
  SampledGradRow sampled_grad_row(int64_t row, int64_t* target_col) const {
    const int64_t t = target(row);
    const bool ignored = t == ignore_index;
    *target_col = target_column(t, ignored);
    return replay.row(row, real_vocab, ignored, lse, g_logp, g_lse);
  }
  int64_t target_column(int64_t t, bool ignored) const {
    const int64_t local = t - vocab_start;
    return (!ignored && local >= 0 && local < cols) ? local : -1;
  }
};

// Shapes, dtypes, memory, strides and (host memory) target and temperature values.
GradLogitsProblem make_grad_logits_problem(const LinearLogpInputs& in, const GradLogitsArgs& args,
                                           const MutableTensorView& dz);
// The sampled form: the same checks, the program's and the replay outputs'.
GradLogitsProblem make_sampled_grad_logits_problem(const LinearLogpInputs& in, const SamplingProgram& program,
                                                   const SampledGradArgs& args, const MutableTensorView& dz);

// Rewrites the columns [col0, col0 + cols) of dz row `out` (out[0] is column col0) that the row's
// target entries name, with their terms in entry order (grad_logit_entries_bf16); the other
// columns hold grad_logit_bf16(..., false) already. z_of_entry(i) is the logit of entry i's column.
template <class ZOfEntry>
void write_target_columns(const GradEntries& e, const GradRow& r, int64_t real_cols, int64_t col0, int64_t cols,
                          ZOfEntry&& z_of_entry, uint16_t* out) {
  float adds[kMaxTargetsPerRow];
  for (int i = 0; i < e.count; ++i) {
    const int64_t c = e.col[i] - col0;
    if (c < 0 || c >= cols) continue;
    bool first = true;  // a repeated id: written once, at its first entry, with every entry's term
    for (int j = 0; j < i; ++j) first = first && e.col[j] != e.col[i];
    if (!first) continue;
    int n_adds = 0;
    for (int j = i; j < e.count; ++j)
      if (e.col[j] == e.col[i]) adds[n_adds++] = e.g[j];
    out[c] = grad_logit_entries_bf16(z_of_entry(i), r, e.col[i] < real_cols, adds, n_adds);
  }
}

// Host: recomputes z on the CPU contract GEMM and writes dz.
void cpu_grad_logits(const GradLogitsProblem& p);
// CUDA memory: the SM90 kernel on p.stream (throws where CUDA or an SM90 device is missing).
void sm90_grad_logits(const GradLogitsProblem& p);

// The checks of linear_logp_grad_from_logits: the logits, targets, temperatures, the forward's
// outputs and upstream gradients as linear_logp_grad_logits checks them, dz, and any overlap of
// dz with the logits other than the in-place layout.
GradLogitsProblem make_grad_from_logits_problem(const GradFromLogitsInputs& in, const GradLogitsArgs& args,
                                                const MutableTensorView& dz);

// Host: dz from given logits z [rows][z_stride] f32 that already include the bias (the serving
// entry's logits of the chunk's columns); p.bias, p.hidden and p.weight are not read. Applying it
// to an arch's own serving logits gives that arch's linear_logp_grad_logits bits (the sampled form
// too, with p.sampled). One row: every column read before the row's dz is written over it, so dz
// may be the logits' bytes in place (the layout of GradLogitsProblem::logits).
void grad_row_from_logits(const GradLogitsProblem& p, const float* z, int64_t z_stride, int64_t row);
void grad_logits_from_logits(const GradLogitsProblem& p, const float* z, int64_t z_stride);
// linear_logp_grad_from_logits on the host (rows in parallel) and on the SM90 backend's stream.
void cpu_grad_from_logits(const GradLogitsProblem& p);
void sm90_grad_from_logits(const GradLogitsProblem& p);

}  // namespace detlogp::detail

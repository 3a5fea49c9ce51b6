// The logit gradient's validated problem, and its host epilogue over given logits.
#include "core/grad_logits.hpp"

#include <utility>

#include "core/validate.hpp"

namespace detlogp::detail {
namespace {

// An [n] f32 vector with hidden's memory.
const float* checked_vector(const TensorView& t, const char* name, int64_t n, Memory mem, int device) {
  check_vector(t, name, n, {DType::f32});
  check_memory(t, name, mem, device);
  return static_cast<const float*>(t.data);
}

}  // namespace

void write_target_columns(const GradEntries& e, const GradRow& r, int64_t real_cols, int64_t col0, int64_t cols,
                          const float* z, uint16_t* out) {
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
    out[c] = grad_logit_entries_bf16(z[c], r, e.col[i] < real_cols, adds, n_adds);
  }
}

GradLogitsProblem make_grad_logits_problem(const LinearLogpInputs& in, const GradLogitsArgs& args,
                                           const MutableTensorView& dz) {
  GradLogitsProblem p;
  p.cols = check_operands(in, "C", "chunk", p);
  const Memory mem = p.memory;
  const int dev = p.device;
  p.real_vocab = checked_real_vocab(in, p.cols, "C");

  DETLOGP_CHECK(args.lse.present(), "lse is required (the forward's [N] f32 lse)");
  p.lse = checked_vector(args.lse, "lse", p.rows, mem, dev);
  if (args.g_logp.present() && !p.targets_2d) p.g_logp = checked_vector(args.g_logp, "g_logp", p.rows, mem, dev);
  if (args.g_logp.present() && p.targets_2d) {  // one dL/dlogp per target entry, like logp [N, K]
    const TensorView& g = args.g_logp;
    DETLOGP_CHECK(g.ndim == 2 && g.dtype == DType::f32 && g.rows == p.rows && g.cols == p.targets_per_row &&
                      g.row_stride == p.targets_per_row,
                  "g_logp must be [N=" << p.rows << ", K=" << p.targets_per_row
                                       << "] f32, contiguous (one entry per target, like logp), got ndim=" << g.ndim
                                       << " " << dtype_name(g.dtype) << " [" << g.rows << ", " << g.cols << "]");
    DETLOGP_CHECK(p.rows == 0 || g.data != nullptr, "g_logp data pointer is null");
    check_memory(g, "g_logp", mem, dev);
    p.g_logp = static_cast<const float*>(g.data);
  }
  if (args.g_lse.present()) p.g_lse = checked_vector(args.g_lse, "g_lse", p.rows, mem, dev);
  if (args.g_entropy.present()) {
    DETLOGP_CHECK(args.entropy.present(), "g_entropy needs entropy (the forward's [N] f32 entropy)");
    p.g_entropy = checked_vector(args.g_entropy, "g_entropy", p.rows, mem, dev);
    p.entropy = checked_vector(args.entropy, "entropy", p.rows, mem, dev);
  }

  check_matrix(dz, "dz", DType::bf16);
  DETLOGP_CHECK(dz.rows == p.rows && dz.cols == p.cols,
                "dz must be [N=" << p.rows << ", C=" << p.cols << "], got [" << dz.rows << ", " << dz.cols << "]");
  check_memory(dz, "dz", mem, dev);
  DETLOGP_CHECK(p.rows == 0 || dz.data != nullptr, "dz data pointer is null");
  p.dz = static_cast<uint16_t*>(dz.mutable_data());
  p.dz_stride = dz.row_stride;

  check_host_values(p);
  return p;
}

GradLogitsProblem make_sampled_grad_logits_problem(const LinearLogpInputs& in, const SamplingProgram& program,
                                                   const SampledGradArgs& args, const MutableTensorView& dz) {
  check_program_temperature_only(in);
  DETLOGP_CHECK(in.targets.ndim != 2,
                "the sampling replay's logit gradient takes one target per row ([N] targets), "
                "but targets is [N, K] (K="
                    << in.targets.cols << ")");
  GradLogitsArgs plain;
  plain.lse = args.lse;
  plain.g_logp = args.g_logp;
  plain.g_lse = args.g_lse;
  GradLogitsProblem p = make_grad_logits_problem(in, plain, dz);
  const Memory mem = p.memory;
  const int dev = p.device;
  p.sampled = true;
  SampledGradOperands& r = p.replay;
  check_program(program, p.rows, mem, dev, r.program);
  for (const auto& [t, name] : {std::pair{&args.logp, "logp"}, std::pair{&args.lse_support, "lse_support"},
                                std::pair{&args.support_max, "support_max"}, std::pair{&args.cut_logit, "cut_logit"}})
    DETLOGP_CHECK(t->present(), name << " is required (the replay's [N] f32 " << name << ")");
  DETLOGP_CHECK(args.cut_id.present(), "cut_id is required (the replay's [N] i64 cut_id)");
  r.forward_logp = checked_vector(args.logp, "logp", p.rows, mem, dev);
  r.lse_support = checked_vector(args.lse_support, "lse_support", p.rows, mem, dev);
  r.support_max = checked_vector(args.support_max, "support_max", p.rows, mem, dev);
  r.cut_logit = checked_vector(args.cut_logit, "cut_logit", p.rows, mem, dev);
  check_vector(args.cut_id, "cut_id", p.rows, {DType::i64});
  check_memory(args.cut_id, "cut_id", mem, dev);
  r.cut_id = static_cast<const int64_t*>(args.cut_id.data);
  if (args.g_logp_raw.present()) r.g_logp_raw = checked_vector(args.g_logp_raw, "g_logp_raw", p.rows, mem, dev);
  return p;
}

void grad_logits_from_logits(const GradLogitsProblem& p, const float* z, int64_t z_stride) {
  const int64_t real = p.real_cols();
  GradEntries e;
  for (int64_t n = 0; n < p.rows; ++n) {
    const float* zr = z + n * z_stride;
    uint16_t* out = p.dz + n * p.dz_stride;
    if (p.sampled) {
      int64_t target_col = -1;
      const SampledGradRow r = p.sampled_grad_row(n, &target_col);
      for (int64_t c = 0; c < p.cols; ++c)
        out[c] = bf16_round(sampled_grad_logit(zr[c], p.vocab_start + c, r, c < real, c == target_col));
      continue;
    }
    const GradRow r = p.grad_row(n, &e);
    for (int64_t c = 0; c < p.cols; ++c) out[c] = grad_logit_bf16(zr[c], r, c < real, false);
    write_target_columns(e, r, real, 0, p.cols, zr, out);
  }
}

}  // namespace detlogp::detail

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

// The forward's outputs and upstream gradients (args) and dz, for the problem's rows and columns.
void check_args_and_dz(GradLogitsProblem& p, const GradLogitsArgs& args, const MutableTensorView& dz) {
  const Memory mem = p.memory;
  const int dev = p.device;
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
}

}  // namespace

GradLogitsProblem make_grad_logits_problem(const LinearLogpInputs& in, const GradLogitsArgs& args,
                                           const MutableTensorView& dz) {
  GradLogitsProblem p;
  p.cols = check_operands(in, "C", "chunk", p);
  p.real_vocab = checked_real_vocab(in, p.cols, "C");

  check_args_and_dz(p, args, dz);
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

GradLogitsProblem make_grad_from_logits_problem(const GradFromLogitsInputs& in, const GradLogitsArgs& args,
                                                const MutableTensorView& dz) {
  GradLogitsProblem p;
  const TensorView& z = in.logits;
  check_matrix(z, "logits", DType::f32);
  p.rows = z.rows;
  p.cols = z.cols;
  p.memory = z.memory;
  p.device = z.device;
  DETLOGP_CHECK(p.cols > 0, "logits has C=0 columns; the vocabulary chunk must be non-empty");
  DETLOGP_CHECK(p.rows == 0 || z.data != nullptr, "logits data pointer is null");
  p.logits = static_cast<const float*>(z.data);
  p.logits_stride = z.row_stride;

  p.targets_per_row = check_targets_tensor(in.targets, p.rows);
  p.targets_2d = in.targets.ndim == 2;
  check_memory(in.targets, "targets", p.memory, p.device);
  p.targets = in.targets.data;
  p.targets_i64 = in.targets.dtype == DType::i64;
  check_temperature_value(in.temperature, "temperature", -1);
  p.temperature = in.temperature;
  if (in.temperature_rows.present()) {
    check_vector(in.temperature_rows, "temperature_rows", p.rows, {DType::f32});
    check_memory(in.temperature_rows, "temperature_rows", p.memory, p.device);
    p.temperature_rows = static_cast<const float*>(in.temperature_rows.data);
  }
  DETLOGP_CHECK(in.vocab_start >= 0, "vocab_start=" << in.vocab_start << " must be >= 0");
  p.vocab_start = in.vocab_start;
  p.ignore_index = in.ignore_index;
  DETLOGP_CHECK(in.real_vocab == -1 || in.real_vocab > 0,
                "real_vocab=" << in.real_vocab << " must be > 0 (or -1 for vocab_start + C)");
  p.real_vocab = in.real_vocab < 0 ? in.vocab_start + p.cols : in.real_vocab;

  check_args_and_dz(p, args, dz);
  if (p.rows > 0) {  // dz over the logits only in the in-place layout
    const auto* z0 = static_cast<const uint8_t*>(z.data);
    const auto* z1 = z0 + ((p.rows - 1) * p.logits_stride + p.cols) * 4;
    const auto* d0 = reinterpret_cast<const uint8_t*>(p.dz);
    const auto* d1 = d0 + ((p.rows - 1) * p.dz_stride + p.cols) * 2;
    const bool overlap = d0 < z1 && z0 < d1;
    DETLOGP_CHECK(!overlap || (d0 == z0 && p.dz_stride == 2 * p.logits_stride),
                  "dz overlaps logits but is not their in-place layout (dz.data == logits.data and dz.row_stride "
                  "== 2 * logits.row_stride = "
                      << 2 * p.logits_stride << "; got dz.row_stride=" << p.dz_stride << ")");
  }
  check_host_values(p);
  return p;
}

void grad_row_from_logits(const GradLogitsProblem& p, const float* z, int64_t z_stride, int64_t n) {
  const int64_t real = p.real_cols();
  const float* zr = z + n * z_stride;
  uint16_t* out = p.dz + n * p.dz_stride;
  if (p.sampled) {
    int64_t target_col = -1;
    const SampledGradRow r = p.sampled_grad_row(n, &target_col);
    const float z_target = target_col >= 0 ? zr[target_col] : 0.0f;
    for (int64_t c = 0; c < p.cols; ++c) {
      const float zc = c == target_col ? z_target : zr[c];
      out[c] = bf16_round(sampled_grad_logit(zc, p.vocab_start + c, r, c < real, c == target_col));
    }
    return;
  }
  GradEntries e;
  const GradRow r = p.grad_row(n, &e);
  float z_entry[kMaxTargetsPerRow];  // read before the sweep writes dz over them (in place)
  for (int i = 0; i < e.count; ++i) z_entry[i] = zr[e.col[i]];
  for (int64_t c = 0; c < p.cols; ++c) out[c] = grad_logit_bf16(zr[c], r, c < real, false);
  write_target_columns(
      e, r, real, 0, p.cols, [&](int i) { return z_entry[i]; }, out);
}

void grad_logits_from_logits(const GradLogitsProblem& p, const float* z, int64_t z_stride) {
  for (int64_t n = 0; n < p.rows; ++n) grad_row_from_logits(p, z, z_stride, n);
}

}  // namespace detlogp::detail

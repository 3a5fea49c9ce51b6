// linear_logp_grad_logits: validation, dispatch on memory (host -> CPU, CUDA -> SM90), report.
#include "core/grad_logits.hpp"

#include <initializer_list>

#include "core/backend.hpp"
#include "core/validate.hpp"
#include "registry/env.hpp"

namespace detlogp::detail {
namespace {

// An [n] vector of one of `dtypes`, with hidden's memory.
const void* checked_vector(const TensorView& t, const char* name, int64_t n, std::initializer_list<DType> dtypes,
                           Memory mem, int device) {
  check_vector(t, name, n, dtypes);
  check_memory(t, name, mem, device);
  return t.data;
}

}  // namespace

GradLogitsProblem make_grad_logits_problem(const LinearLogpInputs& in, const GradLogitsArgs& args,
                                           const MutableTensorView& dz) {
  GradLogitsProblem p;
  const HeadShape head = check_head(in, "C", "chunk");
  const Memory mem = head.memory;
  const int dev = head.device;
  p.rows = head.rows;
  p.dim = head.dim;
  p.cols = head.vocab;

  const void* targets = checked_vector(in.targets, "targets", p.rows, {DType::i32, DType::i64}, mem, dev);
  if (in.bias.present())
    p.bias = static_cast<const float*>(checked_vector(in.bias, "bias", p.cols, {DType::f32}, mem, dev));
  check_temperature_value(in.temperature, "temperature", -1);
  if (in.temperature_rows.present())
    p.temperature_rows = static_cast<const float*>(
        checked_vector(in.temperature_rows, "temperature_rows", p.rows, {DType::f32}, mem, dev));
  DETLOGP_CHECK(in.vocab_start >= 0, "vocab_start=" << in.vocab_start << " must be >= 0");
  DETLOGP_CHECK(in.real_vocab == -1 || in.real_vocab > 0,
                "real_vocab=" << in.real_vocab << " must be > 0 (or -1 for vocab_start + C)");
  p.vocab_start = in.vocab_start;
  p.real_vocab = in.real_vocab < 0 ? in.vocab_start + p.cols : in.real_vocab;
  p.ignore_index = in.ignore_index;
  p.temperature = in.temperature;

  DETLOGP_CHECK(args.lse.present(), "lse is required (the forward's [N] f32 lse)");
  p.lse = static_cast<const float*>(checked_vector(args.lse, "lse", p.rows, {DType::f32}, mem, dev));
  if (args.g_logp.present())
    p.g_logp = static_cast<const float*>(checked_vector(args.g_logp, "g_logp", p.rows, {DType::f32}, mem, dev));
  if (args.g_lse.present())
    p.g_lse = static_cast<const float*>(checked_vector(args.g_lse, "g_lse", p.rows, {DType::f32}, mem, dev));

  check_matrix(dz, "dz", DType::bf16);
  DETLOGP_CHECK(dz.rows == p.rows && dz.cols == p.cols,
                "dz must be [N=" << p.rows << ", C=" << p.cols << "], got [" << dz.rows << ", " << dz.cols << "]");
  check_memory(dz, "dz", mem, dev);
  DETLOGP_CHECK(p.rows == 0 || dz.data != nullptr, "dz data pointer is null");

  p.hidden = static_cast<const uint16_t*>(in.hidden.data);
  p.hidden_stride = in.hidden.row_stride;
  p.weight = static_cast<const uint16_t*>(in.weight.data);
  p.weight_stride = in.weight.row_stride;
  p.targets = targets;
  p.targets_i64 = in.targets.dtype == DType::i64;
  p.dz = static_cast<uint16_t*>(dz.mutable_data());
  p.dz_stride = dz.row_stride;
  p.memory = mem;
  p.device = dev;

  if (mem == Memory::host && p.rows > 0) {
    check_targets_host(p.targets, p.targets_i64, p.rows, p.real_vocab, p.ignore_index);
    if (p.temperature_rows) check_temperatures_host(p.temperature_rows, p.rows);
  }
  return p;
}

void grad_logits_from_logits(const GradLogitsProblem& p, const float* z, int64_t z_stride) {
  const int64_t real = p.real_cols();
  for (int64_t n = 0; n < p.rows; ++n) {
    int64_t target_col = -1;
    const GradRow r = p.grad_row(n, &target_col);
    const float* zr = z + n * z_stride;
    uint16_t* out = p.dz + n * p.dz_stride;
    for (int64_t c = 0; c < p.cols; ++c) out[c] = grad_logit_bf16(zr[c], r, c < real, c == target_col);
  }
}

}  // namespace detlogp::detail

namespace detlogp {

CallReport linear_logp_grad_logits(const LinearLogpInputs& in, const GradLogitsArgs& args, const MutableTensorView& dz,
                                   const CallOptions& opt) {
  check_environment();
  CallReport report;
  report.requested_backend = "auto";
  report.strict = opt.strict || detail::env_strict();
  detail::GradLogitsProblem p = detail::make_grad_logits_problem(in, args, dz);
  p.stream = opt.cuda_stream;
  if (p.memory == Memory::host) {
    report.provenance = detail::cpu_contract_backend().provenance();
    if (p.rows > 0) detail::cpu_grad_logits(p);
  } else {
    const detail::Backend& sm90 = detail::sm90_contract_backend();
    std::string why;
    DETLOGP_CHECK(sm90.available(&why),
                  "tensors are in CUDA memory but the SM90 backend is unavailable for the logit gradient: " << why);
    report.provenance = sm90.provenance();
    if (p.rows > 0) detail::sm90_grad_logits(p);
  }
  return report;
}

}  // namespace detlogp

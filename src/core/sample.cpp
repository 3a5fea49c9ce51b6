#include "core/sample.hpp"

#include <sstream>

#include "core/validate.hpp"

namespace detlogp::detail {
namespace {

// "<name>=<v>" or "<name>_rows[<n>]=<v>": how a message names one value of a parameter.
std::string named(const char* name, int64_t row) {
  std::ostringstream os;
  os << name;
  if (row >= 0) os << "_rows[" << row << "]";
  return os.str();
}

void check_temperature(float t, int64_t row) {
  DETLOGP_CHECK(sampling_temperature_in_range(t),
                named("temperature", row)
                    << "=" << shortest(t) << " is outside the sampling temperature range: 0 (greedy) or ["
                    << shortest(kMinTemperature) << ", " << shortest(kMaxTemperature) << "] (docs/contract.md 11.1)");
}
void check_top_k(int64_t k, int64_t row) {
  DETLOGP_CHECK(k >= 0, named("top_k", row) << "=" << k << " must be >= 0 (0: off; docs/contract.md 11.4)");
}
void check_top_p(float p, int64_t row) {
  DETLOGP_CHECK(top_p_in_range(p), named("top_p", row)
                                       << "=" << shortest(p) << " is outside (0, 1] (1: off; docs/contract.md 11.5)");
}
void check_min_p(float p, int64_t row) {
  DETLOGP_CHECK(min_p_in_range(p), named("min_p", row)
                                       << "=" << shortest(p) << " is outside [0, 1) (0: off; docs/contract.md 11.6)");
}

// An optional per-row parameter: [rows] of one of `dtypes`, in the call's memory.
const void* row_values(const TensorView& t, const char* name, int64_t rows, std::initializer_list<DType> dtypes,
                       Memory mem, int device) {
  if (!t.present()) return nullptr;
  check_vector(t, name, rows, dtypes);
  check_memory(t, name, mem, device);
  return t.data;
}

void check_real_vocab_limit(int64_t real_vocab) {
  DETLOGP_CHECK(real_vocab <= kSampleMaxVocab,
                "real_vocab=" << real_vocab << " is larger than the sampling program's limit 2^24 = " << kSampleMaxVocab
                              << " (docs/contract.md 11.1)");
}

// A required [rows] output of `dtype` in the call's memory.
template <class T>
T* output(const MutableTensorView& v, const char* name, int64_t rows, DType dtype, Memory mem, int device) {
  check_vector(v, name, rows, {dtype});
  check_memory(v, name, mem, device);
  return static_cast<T*>(v.mutable_data());
}
template <class T>
T* optional_output(const MutableTensorView& v, const char* name, int64_t rows, DType dtype, Memory mem, int device) {
  return v.present() ? output<T>(v, name, rows, dtype, mem, device) : nullptr;
}

// The whole vocabulary in one call (a shard goes through the tensor-parallel entries).
void check_whole_vocabulary(const char* entry, int64_t vocab_start, int64_t vocab_local, int64_t real_vocab) {
  DETLOGP_CHECK(vocab_start == 0 && vocab_start + vocab_local >= real_vocab,
                entry << " needs the whole real vocabulary (vocab_start=0, V_local >= real_vocab); got shard ["
                      << vocab_start << ", " << vocab_start + vocab_local << ") of real_vocab=" << real_vocab
                      << " (a vocabulary shard: the tensor-parallel entry, docs/tensor-parallel.md)");
}

}  // namespace

void check_program(const SamplingProgram& program, int64_t rows, Memory mem, int device, ProgramOperands& p) {
  check_temperature(program.temperature, -1);
  check_top_k(program.top_k, -1);
  check_top_p(program.top_p, -1);
  check_min_p(program.min_p, -1);
  p.temperature = program.temperature;
  p.top_k = program.top_k;
  p.top_p = program.top_p;
  p.min_p = program.min_p;
  p.temperature_rows = static_cast<const float*>(
      row_values(program.temperature_rows, "temperature_rows", rows, {DType::f32}, mem, device));
  p.top_k_rows = row_values(program.top_k_rows, "top_k_rows", rows, {DType::i32, DType::i64}, mem, device);
  p.top_k_i64 = program.top_k_rows.dtype == DType::i64;
  p.top_p_rows =
      static_cast<const float*>(row_values(program.top_p_rows, "top_p_rows", rows, {DType::f32}, mem, device));
  p.min_p_rows =
      static_cast<const float*>(row_values(program.min_p_rows, "min_p_rows", rows, {DType::f32}, mem, device));
  if (mem == Memory::host) check_program_rows(p, rows);  // device rows: the backend's (it reads them back)
}

void check_program_rows(const ProgramOperands& p, int64_t rows) {
  for (int64_t n = 0; n < rows; ++n) {
    if (p.temperature_rows) check_temperature(p.temperature_rows[n], n);
    if (p.top_k_rows) check_top_k(p.top_k_of(n), n);
    if (p.top_p_rows) check_top_p(p.top_p_rows[n], n);
    if (p.min_p_rows) check_min_p(p.min_p_rows[n], n);
  }
}

SampleProblem make_sample_problem(const SampleInputs& in, const SampleOutputs& out, bool shard) {
  LinearLogpInputs head;
  head.hidden = in.hidden;
  head.weight = in.weight;
  const HeadShape h = check_head(head, "V_local", "shard");
  SampleProblem p;
  p.rows = h.rows;
  p.dim = h.dim;
  p.memory = h.memory;
  p.device = h.device;
  p.vocab_local = h.vocab;
  if (in.bias.present()) {
    check_vector(in.bias, "bias", h.vocab, {DType::f32});
    check_memory(in.bias, "bias", h.memory, h.device);
    p.bias = static_cast<const float*>(in.bias.data);
  }
  DETLOGP_CHECK(in.vocab_start >= 0, "vocab_start=" << in.vocab_start << " must be >= 0");
  head.vocab_start = in.vocab_start;
  head.real_vocab = in.real_vocab;
  p.real_vocab = checked_real_vocab(head, h.vocab, "V_local");
  p.vocab_start = in.vocab_start;
  check_real_vocab_limit(p.real_vocab);
  if (!shard) check_whole_vocabulary("sample", p.vocab_start, p.vocab_local, p.real_vocab);
  p.hidden = static_cast<const uint16_t*>(in.hidden.data);
  p.hidden_stride = in.hidden.row_stride;
  p.weight = static_cast<const uint16_t*>(in.weight.data);
  p.weight_stride = in.weight.row_stride;

  check_program(in.program, p.rows, p.memory, p.device, p.program);
  p.seed = in.seed;
  p.seed_rows =
      static_cast<const int64_t*>(row_values(in.seed_rows, "seed_rows", p.rows, {DType::i64}, p.memory, p.device));
  check_vector(in.key, "key", p.rows, {DType::i64});
  check_memory(in.key, "key", p.memory, p.device);
  p.key = static_cast<const int64_t*>(in.key.data);

  p.token = output<int64_t>(out.token, "token", p.rows, DType::i64, p.memory, p.device);
  p.logp = output<float>(out.logp, "logp", p.rows, DType::f32, p.memory, p.device);
  p.logp_raw = output<float>(out.logp_raw, "logp_raw", p.rows, DType::f32, p.memory, p.device);
  p.lse = output<float>(out.lse, "lse", p.rows, DType::f32, p.memory, p.device);
  p.support_size = optional_output<int64_t>(out.support_size, "support_size", p.rows, DType::i64, p.memory, p.device);
  if (out.logits.present()) p.logits = checked_logits(out.logits, p.rows, p.vocab_local, p.memory, p.device);
  p.topk = check_topk_outputs(out.topk_ids, out.topk_logp, p.rows, p.real_vocab, p.memory, p.device);
  if (p.topk > 0) {
    p.topk_ids = static_cast<int64_t*>(out.topk_ids.mutable_data());
    p.topk_logp = static_cast<float*>(out.topk_logp.mutable_data());
  }
  return p;
}

void check_program_temperature_only(const LinearLogpInputs& in) {
  DETLOGP_CHECK(in.temperature == 1.0f && !in.temperature_rows.present(),
                "temperature=" << shortest(in.temperature)
                               << (in.temperature_rows.present() ? " with temperature_rows" : "")
                               << ": with a sampling program the temperature is the program's "
                                  "(SamplingProgram::temperature); leave LinearLogpInputs::temperature at 1 and "
                                  "temperature_rows absent");
}

SampleProblem make_sampled_logp_problem(const LinearLogpInputs& in, const SamplingProgram& program,
                                        const SampledLogpOutputs& out, bool shard) {
  check_program_temperature_only(in);
  SampleProblem p;
  p.replay = true;
  p.vocab_local = check_operands(in, "V_local", "shard", p);
  p.real_vocab = checked_real_vocab(in, p.vocab_local, "V_local");
  check_real_vocab_limit(p.real_vocab);
  if (!shard) check_whole_vocabulary("linear_logp", p.vocab_start, p.vocab_local, p.real_vocab);
  check_program(program, p.rows, p.memory, p.device, p.program);
  p.logp = output<float>(out.logp, "logp", p.rows, DType::f32, p.memory, p.device);
  p.logp_raw = output<float>(out.logp_raw, "logp_raw", p.rows, DType::f32, p.memory, p.device);
  p.lse = output<float>(out.lse, "lse", p.rows, DType::f32, p.memory, p.device);
  p.lse_support = optional_output<float>(out.lse_support, "lse_support", p.rows, DType::f32, p.memory, p.device);
  p.support_size = optional_output<int64_t>(out.support_size, "support_size", p.rows, DType::i64, p.memory, p.device);
  p.support_max = optional_output<float>(out.support_max, "support_max", p.rows, DType::f32, p.memory, p.device);
  p.cut_logit = optional_output<float>(out.cut_logit, "cut_logit", p.rows, DType::f32, p.memory, p.device);
  p.cut_id = optional_output<int64_t>(out.cut_id, "cut_id", p.rows, DType::i64, p.memory, p.device);
  check_host_values(p);
  return p;
}

}  // namespace detlogp::detail

#include "cli/problem.hpp"

#include <cstring>
#include <initializer_list>
#include <set>

#include "detlogp/fpops.hpp"
#include "io/safetensors.hpp"

namespace detlogp::cli {

using io::ElementType;
using io::HostTensor;

float ProblemRng::bell() {
  const uint64_t r = next();
  const int64_t sum = static_cast<int64_t>((r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48));
  return static_cast<float>(sum - 2 * 65535) * (1.0f / 37837.0f);  // exact int->float, one rounding
}

std::vector<uint16_t> random_bf16(uint64_t seed, uint64_t stream, int64_t count, float scale) {
  ProblemRng rng(seed, stream);
  std::vector<uint16_t> out(static_cast<size_t>(count));
  for (auto& v : out) v = fp::bf16_round(rng.bell() * scale);
  return out;
}

LinearLogpInputs HostProblem::inputs() const {
  LinearLogpInputs in;
  in.hidden = TensorView::matrix(hidden.data(), DType::bf16, rows, dim);
  in.weight = TensorView::matrix(weight.data(), DType::bf16, vocab_local, dim);
  in.targets = TensorView::vector(targets.data(), DType::i64, rows);
  if (!bias.empty()) in.bias = TensorView::vector(bias.data(), DType::f32, vocab_local);
  if (!temperature_rows.empty()) in.temperature_rows = TensorView::vector(temperature_rows.data(), DType::f32, rows);
  in.temperature = temperature;
  in.real_vocab = real_vocab;
  in.vocab_start = vocab_start;
  in.ignore_index = ignore_index;
  return in;
}

HostProblem synthetic_problem(uint64_t seed, int64_t rows, int64_t dim, int64_t vocab, int64_t real_vocab,
                              int64_t ignore_index, bool with_bias) {
  HostProblem p;
  p.rows = rows;
  p.dim = dim;
  p.vocab_local = vocab;
  p.real_vocab = real_vocab;
  p.ignore_index = ignore_index;
  p.hidden = random_bf16(seed, kStreamHidden, rows * dim, 1.0f);
  p.weight = random_bf16(seed, kStreamWeight, vocab * dim, 0.1f);
  const int64_t target_range = real_vocab < 0 ? vocab : real_vocab;
  ProblemRng rng(seed, kStreamTargets);
  p.targets.resize(static_cast<size_t>(rows));
  for (int64_t n = 0; n < rows; ++n) {
    const uint64_t r = rng.next();
    p.targets[static_cast<size_t>(n)] =
        n % 16 == 15 ? ignore_index : static_cast<int64_t>(r % static_cast<uint64_t>(target_range));
  }
  if (with_bias) {
    ProblemRng bias_rng(seed, kStreamBias);
    p.bias.resize(static_cast<size_t>(vocab));
    for (float& b : p.bias) b = bias_rng.bell() * 0.5f;
  }
  return p;
}

namespace {

std::vector<int64_t> widen_targets(const HostTensor& t) {
  std::vector<int64_t> out(static_cast<size_t>(t.element_count()));
  if (t.dtype == ElementType::i64) {
    std::memcpy(out.data(), t.data(), out.size() * sizeof(int64_t));
  } else {
    const auto* p = static_cast<const int32_t*>(t.data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  }
  return out;
}

template <class T>
std::vector<T> copy_elements(const HostTensor& t) {
  std::vector<T> out(static_cast<size_t>(t.element_count()));
  if (!out.empty()) std::memcpy(out.data(), t.data(), out.size() * sizeof(T));
  return out;
}

void require_dtype(const std::string& file, const std::string& name, const HostTensor& t,
                   std::initializer_list<ElementType> allowed) {
  std::string list;
  for (ElementType a : allowed) {
    if (t.dtype == a) return;
    list += std::string(list.empty() ? "" : " or ") + io::element_type_name(a);
  }
  DETLOGP_FAIL("'" << file << "': tensor '" << name << "' must be " << list << ", got "
                   << io::element_type_name(t.dtype));
}

}  // namespace

HostProblem problem_from_inputs(const NamedInputs& in) {
  for (const auto& [name, entry] : in.tensors) {
    static const std::set<std::string> kKnown = {"hidden", "weight", "targets", "bias", "temperature"};
    DETLOGP_CHECK(kKnown.count(name), "'" << entry.first << "': unexpected tensor '" << name
                                          << "' (expected hidden, weight, targets, optional bias, temperature)");
  }
  for (const char* required : {"hidden", "weight", "targets"}) {
    DETLOGP_CHECK(in.tensors.count(required), "input lacks the required tensor '" << required << "'");
  }
  const auto& [hidden_file, hidden] = in.tensors.at("hidden");
  const auto& [weight_file, weight] = in.tensors.at("weight");
  const auto& [targets_file, targets] = in.tensors.at("targets");
  using io::shape_to_string;

  require_dtype(hidden_file, "hidden", hidden, {ElementType::bf16});
  DETLOGP_CHECK(hidden.shape.size() == 2,
                "'" << hidden_file << "': tensor 'hidden' must be [N, D], got shape " << shape_to_string(hidden.shape));
  require_dtype(weight_file, "weight", weight, {ElementType::bf16});
  DETLOGP_CHECK(weight.shape.size() == 2, "'" << weight_file << "': tensor 'weight' must be [V_local, D], got shape "
                                              << shape_to_string(weight.shape));
  DETLOGP_CHECK(weight.shape[1] == hidden.shape[1], "'" << weight_file << "': tensor 'weight' has D=" << weight.shape[1]
                                                        << " columns but 'hidden' has D=" << hidden.shape[1]);
  require_dtype(targets_file, "targets", targets, {ElementType::i32, ElementType::i64});
  DETLOGP_CHECK(targets.shape.size() == 1 && targets.shape[0] == hidden.shape[0],
                "'" << targets_file << "': tensor 'targets' must be [N=" << hidden.shape[0] << "], got shape "
                    << shape_to_string(targets.shape));

  HostProblem p;
  p.rows = hidden.shape[0];
  p.dim = hidden.shape[1];
  p.vocab_local = weight.shape[0];
  p.hidden = copy_elements<uint16_t>(hidden);
  p.weight = copy_elements<uint16_t>(weight);
  p.targets = widen_targets(targets);
  if (auto it = in.tensors.find("bias"); it != in.tensors.end()) {
    const auto& [file, bias] = it->second;
    require_dtype(file, "bias", bias, {ElementType::f32});
    DETLOGP_CHECK(bias.shape.size() == 1 && bias.shape[0] == p.vocab_local,
                  "'" << file << "': tensor 'bias' must be [V_local=" << p.vocab_local << "], got shape "
                      << shape_to_string(bias.shape));
    p.bias = copy_elements<float>(bias);
  }
  if (auto it = in.tensors.find("temperature"); it != in.tensors.end()) {
    const auto& [file, temp] = it->second;
    require_dtype(file, "temperature", temp, {ElementType::f32});
    const bool scalar = temp.shape.empty() || (temp.shape.size() == 1 && temp.shape[0] == 1 && p.rows != 1);
    const bool per_row = temp.shape.size() == 1 && temp.shape[0] == p.rows;
    DETLOGP_CHECK(scalar || per_row, "'" << file << "': tensor 'temperature' must be a scalar [] or [N=" << p.rows
                                         << "], got shape " << shape_to_string(temp.shape));
    if (per_row)
      p.temperature_rows = copy_elements<float>(temp);
    else
      p.temperature = copy_elements<float>(temp)[0];
    p.temperature_from_input = true;
  }
  return p;
}

NamedInputs inputs_from_safetensors(const std::string& path) {
  NamedInputs in;
  io::SafetensorsContents contents = io::read_safetensors(path);
  for (auto& t : contents.tensors) in.tensors[t.name] = {path, std::move(t.tensor)};
  return in;
}

}  // namespace detlogp::cli

#include "cli/problem.hpp"

#include <cctype>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <set>

#include "detlogp/fpops.hpp"
#include "io/npy.hpp"
#include "io/safetensors.hpp"

namespace detlogp::cli {

using io::ElementType;

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
  in.hidden = hidden;
  in.weight = weight;
  in.targets = targets;
  in.bias = bias;
  in.temperature_rows = temperature_rows;
  in.temperature = temperature;
  in.real_vocab = real_vocab;
  in.vocab_start = vocab_start;
  in.ignore_index = ignore_index;
  return in;
}

SyntheticTensors synthetic_tensors(uint64_t seed, int64_t rows, int64_t dim, int64_t vocab, int64_t real_vocab,
                                   int64_t ignore_index, bool with_bias) {
  SyntheticTensors t;
  t.hidden = random_bf16(seed, kStreamHidden, rows * dim, 1.0f);
  t.weight = random_bf16(seed, kStreamWeight, vocab * dim, 0.1f);
  const int64_t target_range = real_vocab < 0 ? vocab : real_vocab;
  ProblemRng rng(seed, kStreamTargets);
  t.targets.resize(static_cast<size_t>(rows));
  for (int64_t n = 0; n < rows; ++n) {
    const uint64_t r = rng.next();
    t.targets[static_cast<size_t>(n)] =
        n % 16 == 15 ? ignore_index : static_cast<int64_t>(r % static_cast<uint64_t>(target_range));
  }
  if (with_bias) {
    ProblemRng bias_rng(seed, kStreamBias);
    t.bias.resize(static_cast<size_t>(vocab));
    for (float& b : t.bias) b = bias_rng.bell() * 0.5f;
  }
  return t;
}

HostProblem synthetic_problem(uint64_t seed, int64_t rows, int64_t dim, int64_t vocab, int64_t real_vocab,
                              int64_t ignore_index, bool with_bias) {
  auto t = std::make_shared<const SyntheticTensors>(
      synthetic_tensors(seed, rows, dim, vocab, real_vocab, ignore_index, with_bias));
  HostProblem p;
  p.rows = rows;
  p.dim = dim;
  p.vocab_local = vocab;
  p.real_vocab = real_vocab;
  p.ignore_index = ignore_index;
  p.hidden = TensorView::matrix(t->hidden.data(), DType::bf16, rows, dim);
  p.weight = TensorView::matrix(t->weight.data(), DType::bf16, vocab, dim);
  p.targets = TensorView::vector(t->targets.data(), DType::i64, rows);
  if (!t->bias.empty()) p.bias = TensorView::vector(t->bias.data(), DType::f32, vocab);
  p.storage.push_back(t);
  return p;
}

namespace {

void require_dtype(const std::string& file, const std::string& name, const io::TensorRef& t,
                   std::initializer_list<ElementType> allowed) {
  std::string list;
  for (ElementType a : allowed) {
    if (t.dtype == a) return;
    list += std::string(list.empty() ? "" : " or ") + io::element_type_name(a);
  }
  DETLOGP_FAIL("'" << file << "': tensor '" << name << "' must be " << list << ", got "
                   << io::element_type_name(t.dtype));
}

// The library's element type of a file's, where it has one (U8 it has not).
std::optional<DType> library_dtype(ElementType t) {
  switch (t) {
    case ElementType::bf16:
      return DType::bf16;
    case ElementType::f32:
      return DType::f32;
    case ElementType::i32:
      return DType::i32;
    case ElementType::i64:
      return DType::i64;
    case ElementType::u8:
      return std::nullopt;
  }
  return std::nullopt;
}

// The bytes of `t` where the library may read them: in place when the data is aligned to its
// element size (the writers of the format align it), else one aligned copy kept in p.storage.
const void* library_bytes(const io::TensorRef& t, HostProblem& p) {
  const auto align = static_cast<uintptr_t>(io::element_size(t.dtype));
  if (reinterpret_cast<uintptr_t>(t.data()) % align == 0) return t.data();
  auto copy = std::make_shared<std::vector<uint64_t>>((t.bytes.size() + 7) / 8);
  std::memcpy(copy->data(), t.bytes.data(), t.bytes.size());
  p.storage.push_back(copy);
  return copy->data();
}

// A temperature tensor of any shape but []: per-row temperatures. The library checks them as it
// checks temperature_rows from every face ([N] f32, no broadcast of a [1] tensor), so the
// messages are its own; what a TensorView cannot carry is refused here in the same words.
void set_temperature_rows(const io::TensorRef& t, HostProblem& p) {
  DETLOGP_CHECK(t.shape.size() == 1, "temperature_rows must be 1-D, got ndim=" << t.shape.size());
  const std::optional<DType> dtype = library_dtype(t.dtype);
  if (!dtype) {
    std::string name = io::element_type_name(t.dtype);  // in the library's spelling: lower case
    for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    DETLOGP_FAIL("temperature_rows must be " << dtype_name(DType::f32) << ", got " << name);
  }
  p.temperature_rows = TensorView::vector(library_bytes(t, p), *dtype, t.shape[0]);
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
  p.storage.assign(in.files.begin(), in.files.end());
  p.rows = hidden.shape[0];
  p.dim = hidden.shape[1];
  p.vocab_local = weight.shape[0];
  p.hidden = TensorView::matrix(library_bytes(hidden, p), DType::bf16, p.rows, p.dim);
  p.weight = TensorView::matrix(library_bytes(weight, p), DType::bf16, p.vocab_local, p.dim);
  p.targets = TensorView::vector(library_bytes(targets, p), *library_dtype(targets.dtype), p.rows);
  if (auto it = in.tensors.find("bias"); it != in.tensors.end()) {
    const auto& [file, bias] = it->second;
    require_dtype(file, "bias", bias, {ElementType::f32});
    DETLOGP_CHECK(bias.shape.size() == 1 && bias.shape[0] == p.vocab_local,
                  "'" << file << "': tensor 'bias' must be [V_local=" << p.vocab_local << "], got shape "
                      << shape_to_string(bias.shape));
    p.bias = TensorView::vector(library_bytes(bias, p), DType::f32, p.vocab_local);
  }
  if (auto it = in.tensors.find("temperature"); it != in.tensors.end()) {
    const auto& [file, temp] = it->second;
    if (temp.shape.empty()) {
      require_dtype(file, "temperature", temp, {ElementType::f32});
      std::memcpy(&p.temperature, temp.data(), sizeof(float));
    } else {
      set_temperature_rows(temp, p);
    }
    p.temperature_from_input = true;
  }
  return p;
}

NamedInputs inputs_from_safetensors(const std::string& path) {
  NamedInputs in;
  io::MappedSafetensors mapped = io::map_safetensors(path);
  for (auto& t : mapped.contents.tensors) in.tensors[t.name] = {path, std::move(t.tensor)};
  in.files.push_back(std::move(mapped.file));
  return in;
}

NamedInputs inputs_from_npy(const std::map<std::string, std::string>& paths) {
  NamedInputs in;
  for (const auto& [name, path] : paths) {
    io::MappedNpy mapped = io::map_npy(path);
    in.tensors[name] = {path, std::move(mapped.tensor)};
    in.files.push_back(std::move(mapped.file));
  }
  return in;
}

}  // namespace detlogp::cli

#include "cli/problem.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
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

// |T| <= 2^-150 rounds to 0 and |T| >= 2^128 - 2^103 to inf; every other value is the library's
// range check's to judge, nan and inf included (exit 3 either way).
float float32_temperature(double t) {
  const auto f = static_cast<float>(t);
  if ((f == 0 && t != 0) || (std::isinf(f) && std::isfinite(t))) {
    char shown[32];
    const auto res = std::to_chars(shown, shown + sizeof(shown), t);  // shortest, as Python's repr
    DETLOGP_FAIL("temperature=" << std::string_view(shown, static_cast<size_t>(res.ptr - shown))
                                << " is not representable as float32 (it would round to " << (f == 0 ? "0" : "inf")
                                << ")");
  }
  return f;
}

namespace {

// The library's element type of a file's, where it has one (U8, F16, F64 and BOOL it has not).
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
    case ElementType::f16:
    case ElementType::f64:
    case ElementType::boolean:
      return std::nullopt;
  }
  return std::nullopt;
}

// The dtype `name` goes to the library with: its own, for the library's check to refuse a wrong one
// in its words (`hidden must be bf16, got f32`); one the library has no DType for is refused here in
// the same words, the file's name lower-cased as the library spells its own (f16, f64, bool, u8).
DType checked_library_dtype(const char* name, ElementType t, std::initializer_list<DType> allowed) {
  if (const std::optional<DType> d = library_dtype(t)) return *d;
  std::string list;
  for (DType a : allowed) list += std::string(list.empty() ? "" : " or ") + dtype_name(a);
  std::string got = io::element_type_name(t);
  for (char& ch : got) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  DETLOGP_FAIL(name << " must be " << list << ", got " << got);
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

// IEEE half-precision bits widened to float32 (exact: every half is a float).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return fp::from_bits(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return fp::from_bits(sign | (static_cast<uint32_t>(exponent - 15 + 127) << 23) | (mantissa << 13));
}

// A file's temperature tensor by the Python faces' rules and in their words (_split_temperature
// in python/detlogp/__init__.py), dtypes named as they name them: shape [] F32 is the scalar, [N]
// F32 is temperature_rows; [1] for N != 1 is never broadcast and no dtype is cast. The values are
// the library's to check. A 0-d tensor of any floating dtype is the scalar (F16/BF16 widened
// exactly, F64 rounded to float32 as --temperature is).
void set_temperature(const io::TensorRef& t, HostProblem& p) {
  const std::string shape_n = io::shape_to_string({p.rows});
  const std::string forms = "a float, a 0-d floating array or a float32 array of shape " + shape_n;
  const char* dtype = io::element_type_array_name(t.dtype);
  const std::string given = "shape " + io::shape_to_string(t.shape) + " dtype " + dtype;
  if (t.shape.empty()) {  // any floating dtype, as the Python faces read a 0-d floating array
    switch (t.dtype) {
      case ElementType::f32:
        std::memcpy(&p.temperature, t.data(), sizeof(float));
        return;
      case ElementType::bf16:
      case ElementType::f16: {
        uint16_t b = 0;
        std::memcpy(&b, t.data(), sizeof(b));
        p.temperature = t.dtype == ElementType::bf16 ? fp::bf16_to_float(b) : half_to_float(b);
        return;
      }
      case ElementType::f64: {
        double d = 0;
        std::memcpy(&d, t.data(), sizeof(d));
        p.temperature = float32_temperature(d);
        return;
      }
      default:
        DETLOGP_FAIL("temperature must be " << forms << ", got " << given);
    }
  }
  if (t.shape != std::vector<int64_t>{p.rows}) {
    const char* hint = t.element_count() == 1
                           ? " (one value per row, no broadcast: pass a float for one temperature of every row)"
                           : "";
    DETLOGP_FAIL("temperature must be " << forms << ", got " << given << hint);
  }
  DETLOGP_CHECK(t.dtype == ElementType::f32,
                "temperature of shape " << shape_n << " must be float32, got " << dtype << " (no silent cast)");
  p.temperature_rows = TensorView::vector(library_bytes(t, p), DType::f32, p.rows);
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

  DETLOGP_CHECK(hidden.shape.size() == 2,
                "'" << hidden_file << "': tensor 'hidden' must be [N, D], got shape " << shape_to_string(hidden.shape));
  DETLOGP_CHECK(weight.shape.size() == 2, "'" << weight_file << "': tensor 'weight' must be [V_local, D], got shape "
                                              << shape_to_string(weight.shape));
  DETLOGP_CHECK(weight.shape[1] == hidden.shape[1], "'" << weight_file << "': tensor 'weight' has D=" << weight.shape[1]
                                                        << " columns but 'hidden' has D=" << hidden.shape[1]);
  DETLOGP_CHECK((targets.shape.size() == 1 || targets.shape.size() == 2) && targets.shape[0] == hidden.shape[0],
                "'" << targets_file << "': tensor 'targets' must be [N=" << hidden.shape[0] << "] or [N="
                    << hidden.shape[0] << ", K] (K ids a row), got shape " << shape_to_string(targets.shape));

  HostProblem p;
  p.storage.assign(in.files.begin(), in.files.end());
  p.rows = hidden.shape[0];
  p.dim = hidden.shape[1];
  p.vocab_local = weight.shape[0];
  const DType hidden_dtype = checked_library_dtype("hidden", hidden.dtype, {DType::bf16});
  const DType weight_dtype = checked_library_dtype("weight", weight.dtype, {DType::bf16});
  const DType targets_dtype = checked_library_dtype("targets", targets.dtype, {DType::i32, DType::i64});
  p.hidden = TensorView::matrix(library_bytes(hidden, p), hidden_dtype, p.rows, p.dim);
  p.weight = TensorView::matrix(library_bytes(weight, p), weight_dtype, p.vocab_local, p.dim);
  p.targets = targets.shape.size() == 2
                  ? TensorView::matrix(library_bytes(targets, p), targets_dtype, p.rows, targets.shape[1])
                  : TensorView::vector(library_bytes(targets, p), targets_dtype, p.rows);
  if (auto it = in.tensors.find("bias"); it != in.tensors.end()) {
    const auto& [file, bias] = it->second;
    DETLOGP_CHECK(bias.shape.size() == 1 && bias.shape[0] == p.vocab_local,
                  "'" << file << "': tensor 'bias' must be [V_local=" << p.vocab_local << "], got shape "
                      << shape_to_string(bias.shape));
    p.bias = TensorView::vector(library_bytes(bias, p), checked_library_dtype("bias", bias.dtype, {DType::f32}),
                                p.vocab_local);
  }
  if (auto it = in.tensors.find("temperature"); it != in.tensors.end()) {
    set_temperature(it->second.second, p);
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

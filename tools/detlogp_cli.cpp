// The `detlogp` command line tool: info, run, verify (docs/cli.md).
//
// Exit codes: 0 success; 1 a check failed (verify, or run --repeat saw differing bits);
// 2 usage error (unknown command or option, bad option value); 3 error (invalid input file or
// values, a backend refused by strict mode, a rejected DETLOGP_* variable, a failed write).
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "detlogp/dist.hpp"
#include "golden/goldens.hpp"
#include "golden/harness.hpp"
#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "io/sha256.hpp"

namespace {

using detlogp::io::ElementType;
using detlogp::io::HostTensor;

constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitError = 3;

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------
// Options: "--name value", "--name=value" and boolean "--flag". Each command declares what it
// accepts, so a misspelled option is an error instead of being ignored.

struct OptionSpec {
  std::string name;
  bool takes_value;
  std::string help;
};

class Options {
 public:
  Options(const std::vector<std::string>& args, const std::vector<OptionSpec>& specs) {
    for (size_t i = 0; i < args.size(); ++i) {
      std::string arg = args[i];
      if (arg == "-h") arg = "--help";
      if (arg.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + arg + "'");
      std::string name = arg.substr(2);
      std::optional<std::string> inline_value;
      if (const size_t eq = name.find('='); eq != std::string::npos) {
        inline_value = name.substr(eq + 1);
        name = name.substr(0, eq);
      }
      const OptionSpec* spec = nullptr;
      for (const OptionSpec& s : specs)
        if (s.name == name) spec = &s;
      if (spec == nullptr) throw UsageError("unknown option '--" + name + "'");
      if (values_.count(name) || flags_.count(name)) throw UsageError("option '--" + name + "' given twice");
      if (spec->takes_value) {
        if (inline_value) {
          values_[name] = *inline_value;
        } else {
          if (i + 1 >= args.size()) throw UsageError("option '--" + name + "' needs a value");
          values_[name] = args[++i];
        }
      } else {
        if (inline_value) throw UsageError("option '--" + name + "' takes no value");
        flags_.insert(name);
      }
    }
  }

  bool flag(const std::string& name) const { return flags_.count(name) > 0; }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string text(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }

  int64_t integer(const std::string& name, int64_t fallback, int64_t min_value, int64_t max_value) const {
    auto it = values_.find(name);
    if (it == values_.end()) return fallback;
    const std::string& v = it->second;
    int64_t out = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc() || end != v.data() + v.size() || v.empty())
      throw UsageError("--" + name + "=" + v + " is not an integer");
    if (out < min_value || out > max_value)
      throw UsageError("--" + name + "=" + v + " is out of range [" + std::to_string(min_value) + ", " +
                       std::to_string(max_value) + "]");
    return out;
  }

  float real(const std::string& name, float fallback) const {
    auto it = values_.find(name);
    if (it == values_.end()) return fallback;
    const std::string& v = it->second;
    float out = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc() || end != v.data() + v.size() || v.empty())
      throw UsageError("--" + name + "=" + v + " is not a number");
    return out;
  }

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> flags_;
};

void print_option_help(std::ostream& os, const std::vector<OptionSpec>& specs) {
  for (const OptionSpec& s : specs) {
    std::string left = "  --" + s.name + (s.takes_value ? " VALUE" : "");
    if (left.size() < 26) left.append(26 - left.size(), ' ');
    os << left << " " << s.help << "\n";
  }
}

// ---------------------------------------------------------------------------------------------
// Bit patterns: comparisons are on the bits, so -0.0 vs +0.0 and NaN payloads count as different.

uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

std::string hex32(uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", u);
  return buf;
}

std::string describe_float(float x) {
  std::ostringstream os;
  os.precision(9);  // enough digits to tell any two floats apart
  os << hex32(float_bits(x)) << " (" << x << ")";
  return os.str();
}

// "" when equal; otherwise the first mismatch. b_index maps a's index to b's (identity if empty).
std::string compare_bits(const std::string& what, const std::vector<float>& a, const std::vector<float>& b,
                         const std::vector<int64_t>& b_index = {}) {
  const size_t n = a.size();
  if (b_index.empty() && a.size() != b.size())
    return what + ": sizes differ (" + std::to_string(a.size()) + " vs " + std::to_string(b.size()) + ")";
  for (size_t i = 0; i < n; ++i) {
    const size_t j = b_index.empty() ? i : static_cast<size_t>(b_index[i]);
    if (float_bits(a[i]) != float_bits(b[j])) {
      std::ostringstream os;
      os << what << "[" << i << "] = " << describe_float(a[i]) << " but reference[" << j
         << "] = " << describe_float(b[j]);
      return os.str();
    }
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// A fixed-seed generator whose output is identical on every platform: SplitMix64 (integer ops
// only) and bf16 values made by integer sums, one fp32 multiply and round-to-nearest-even on
// the bits. No std::*_distribution, whose algorithms differ between standard libraries.

class SplitMix64 {
 public:
  SplitMix64(uint64_t seed, uint64_t stream) : state_(seed * 0x9E3779B97F4A7C15ull ^ stream) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Bell-shaped value with standard deviation ~1: the sum of four 16-bit uniforms, centered.
  float bell() {
    const uint64_t r = next();
    const int64_t sum = static_cast<int64_t>((r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48));
    return static_cast<float>(sum - 2 * 65535) * (1.0f / 37837.0f);  // exact int->float, one rounding
  }

 private:
  uint64_t state_;
};

// Stream tags keep tensors independent: the first V rows of the weight are the same whatever V.
constexpr uint64_t kStreamHidden = 1, kStreamWeight = 2, kStreamTargets = 3, kStreamBias = 4, kStreamTemperature = 5,
                   kStreamVerify = 6;

uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even (finite inputs)
  return static_cast<uint16_t>(u >> 16);
}

std::vector<uint16_t> random_bf16(uint64_t seed, uint64_t stream, int64_t count, float scale) {
  SplitMix64 rng(seed, stream);
  std::vector<uint16_t> out(static_cast<size_t>(count));
  for (auto& v : out) v = float_to_bf16(rng.bell() * scale);
  return out;
}

// ---------------------------------------------------------------------------------------------
// A problem in host memory, from a file or generated.

struct HostProblem {
  std::string source;  // for the summary
  int64_t rows = 0, dim = 0, vocab_local = 0;
  std::vector<uint16_t> hidden, weight;
  std::vector<int64_t> targets;
  std::vector<float> bias;              // empty: none
  std::vector<float> temperature_rows;  // empty: scalar temperature
  float temperature = 1.0f;
  bool temperature_from_input = false;  // the input file carried a 'temperature' tensor
  int64_t real_vocab = -1;
  int64_t vocab_start = 0;
  int64_t ignore_index = detlogp::kDefaultIgnoreIndex;

  detlogp::LinearLogpInputs inputs() const {
    detlogp::LinearLogpInputs in;
    in.hidden = detlogp::TensorView::matrix(hidden.data(), detlogp::DType::bf16, rows, dim);
    in.weight = detlogp::TensorView::matrix(weight.data(), detlogp::DType::bf16, vocab_local, dim);
    in.targets = detlogp::TensorView::vector(targets.data(), detlogp::DType::i64, rows);
    if (!bias.empty()) in.bias = detlogp::TensorView::vector(bias.data(), detlogp::DType::f32, vocab_local);
    if (!temperature_rows.empty())
      in.temperature_rows = detlogp::TensorView::vector(temperature_rows.data(), detlogp::DType::f32, rows);
    in.temperature = temperature;
    in.real_vocab = real_vocab;
    in.vocab_start = vocab_start;
    in.ignore_index = ignore_index;
    return in;
  }
  int64_t effective_real_vocab() const { return real_vocab < 0 ? vocab_start + vocab_local : real_vocab; }
};

// Synthetic problem: hidden ~ bell * 1, weight ~ bell * 0.1 (logits of standard deviation ~3 at
// D=1024), targets uniform over the real vocabulary, every 16th row (n % 16 == 15) ignored.
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
  SplitMix64 rng(seed, kStreamTargets);
  p.targets.resize(static_cast<size_t>(rows));
  for (int64_t n = 0; n < rows; ++n) {
    const uint64_t r = rng.next();
    p.targets[static_cast<size_t>(n)] =
        n % 16 == 15 ? ignore_index : static_cast<int64_t>(r % static_cast<uint64_t>(target_range));
  }
  if (with_bias) {
    SplitMix64 bias_rng(seed, kStreamBias);
    p.bias.resize(static_cast<size_t>(vocab));
    for (float& b : p.bias) b = bias_rng.bell() * 0.5f;
  }
  return p;
}

// ---- file inputs ----------------------------------------------------------------------------

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

// The named input tensors (from one safetensors file or several .npy files), checked for
// dtype and shape with messages that name the file and the tensor.
struct NamedInputs {
  std::map<std::string, std::pair<std::string, HostTensor>> tensors;  // name -> (file, tensor)
};

void require_dtype(const std::string& file, const std::string& name, const HostTensor& t,
                   std::initializer_list<ElementType> allowed) {
  std::string list;
  for (ElementType a : allowed) {
    if (t.dtype == a) return;
    list += std::string(list.empty() ? "" : " or ") + detlogp::io::element_type_name(a);
  }
  DETLOGP_FAIL("'" << file << "': tensor '" << name << "' must be " << list << ", got "
                   << detlogp::io::element_type_name(t.dtype));
}

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
  using detlogp::io::shape_to_string;

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
  detlogp::io::SafetensorsContents contents = detlogp::io::read_safetensors(path);
  for (auto& t : contents.tensors) in.tensors[t.name] = {path, std::move(t.tensor)};
  return in;
}

// ---------------------------------------------------------------------------------------------
// Running one problem.

struct RunOutputs {
  std::vector<std::pair<std::string, HostTensor>> tensors;  // in SHA order
  detlogp::CallReport report;
  bool partials = false;
  bool logits = false;
};

HostTensor f32_tensor(std::vector<int64_t> shape) { return HostTensor::zeros(ElementType::f32, std::move(shape)); }

RunOutputs compute(const HostProblem& p, bool return_logits, const detlogp::CallOptions& opt) {
  RunOutputs out;
  const detlogp::LinearLogpInputs in = p.inputs();
  const int64_t real_vocab = p.effective_real_vocab();
  out.partials = p.vocab_start > 0 || p.vocab_start + p.vocab_local < real_vocab;
  if (out.partials) {
    if (return_logits) {
      throw UsageError("--return-logits needs the whole vocabulary in one shard; this shard [" +
                       std::to_string(p.vocab_start) + ", " + std::to_string(p.vocab_start + p.vocab_local) +
                       ") of real_vocab=" + std::to_string(real_vocab) + " produces partials");
    }
    const int64_t tiles = detlogp::shard_tiles(p.vocab_local);
    std::vector<detlogp::TileSummary> summaries(static_cast<size_t>(p.rows * tiles));
    HostTensor target_logit = f32_tensor({p.rows});
    HostTensor owned = HostTensor::zeros(ElementType::u8, {p.rows});
    detlogp::ShardPartials partials;
    partials.rows = p.rows;
    partials.tiles = tiles;
    partials.summaries = summaries.data();
    partials.target_logit = static_cast<float*>(target_logit.data());
    partials.target_owned = static_cast<uint8_t*>(owned.data());
    out.report = detlogp::linear_logp_partials(in, partials, opt);
    HostTensor tile_max = f32_tensor({p.rows, tiles});
    HostTensor tile_sum = f32_tensor({p.rows, tiles});
    auto* max_out = static_cast<float*>(tile_max.data());
    auto* sum_out = static_cast<float*>(tile_sum.data());
    for (size_t i = 0; i < summaries.size(); ++i) {
      max_out[i] = summaries[i].max;
      sum_out[i] = summaries[i].sum;
    }
    out.tensors = {{"tile_max", std::move(tile_max)},
                   {"tile_sum", std::move(tile_sum)},
                   {"target_logit", std::move(target_logit)},
                   {"target_owned", std::move(owned)}};
    return out;
  }
  HostTensor logp = f32_tensor({p.rows});
  HostTensor lse = f32_tensor({p.rows});
  HostTensor logits;
  detlogp::LinearLogpOutputs o{detlogp::mutable_vector(logp.data(), detlogp::DType::f32, p.rows),
                               detlogp::mutable_vector(lse.data(), detlogp::DType::f32, p.rows),
                               {}};
  if (return_logits) {
    logits = f32_tensor({p.rows, p.vocab_local});
    o.logits = detlogp::mutable_matrix(logits.data(), detlogp::DType::f32, p.rows, p.vocab_local);
  }
  out.report = detlogp::linear_logp(in, o, opt);
  out.logits = return_logits;
  out.tensors = {{"logp", std::move(logp)}, {"lse", std::move(lse)}};
  if (return_logits) out.tensors.emplace_back("logits", std::move(logits));
  return out;
}

std::string output_sha256(const RunOutputs& out) {
  detlogp::io::Sha256 h;
  for (const auto& [name, t] : out.tensors) h.update(t.bytes.data(), t.bytes.size());
  return detlogp::io::Sha256::hex(h.finish());
}

std::string sha_scope(const RunOutputs& out) {
  std::string s;
  for (const auto& [name, t] : out.tensors) s += (s.empty() ? "" : "|") + name;
  return s;
}

detlogp::CallOptions call_options(const Options& o) {
  detlogp::CallOptions opt;
  opt.backend = o.text("backend");
  opt.strict = o.flag("strict");
  return opt;
}

std::string describe_report(const detlogp::CallReport& r) {
  std::ostringstream os;
  os << r.provenance.backend_id << " (requested " << r.requested_backend << ", strict " << (r.strict ? "on" : "off")
     << ", fallback " << (r.fallback ? "yes: " + r.fallback_reason : std::string("no")) << ")";
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// detlogp info

const std::vector<OptionSpec> kInfoOptions = {
    {"backend", true, "show which backend this id resolves to (default: env DETLOGP_BACKEND, else auto)"},
    {"strict", false, "resolve in strict mode (contract-bearing backends only)"},
    {"help", false, "this text"},
};

void info_help(std::ostream& os) {
  os << "usage: detlogp info [--backend ID] [--strict]\n\n"
        "Prints the version, the contract and its frozen constants, the backends of this build\n"
        "(contract-bearing or not, available here or why not) and the provenance of the backend a\n"
        "call with these options is served by (found by running a 1x1x1 problem).\n\n";
  print_option_help(os, kInfoOptions);
}

int command_info(const Options& o) {
  detlogp::check_environment();
  std::cout << "detlogp " << detlogp::version_string() << "\n";
  std::cout << "contract: " << detlogp::kContractName << " v" << detlogp::kContractVersion << "\n";
  std::cout << "frozen constants (bit-relevant; changing one needs a contract version bump):\n";
  const std::vector<std::pair<std::string, std::string>> constants = {
      {"CONTRACT_VERSION", std::to_string(detlogp::kContractVersion)},
      {"VOCAB_TILE", std::to_string(detlogp::kVocabTile)},
      {"TILE_TREE_LEVELS", std::to_string(detlogp::kTileTreeLevels)},
      {"K_SLAB", std::to_string(detlogp::kKSlab)},
      {"TREE_ID", detlogp::kTreeId},
      {"TRANSCENDENTAL_ID", detlogp::kTranscendentalId},
      {"N_SPLIT_POLICY", detlogp::kNSplitPolicy},
      {"TEMPERATURE_ID", detlogp::kTemperatureId},
      {"DEFAULT_IGNORE_INDEX", std::to_string(detlogp::kDefaultIgnoreIndex)},
      {"CANONICAL_NAN", hex32(detlogp::kCanonicalNanBits)},
  };
  for (const auto& [name, value] : constants) {
    std::string left = "  " + name;
    left.append(24 - std::min<size_t>(24, left.size()), ' ');
    std::cout << left << value << "\n";
  }
  std::cout << "backends:\n";
  for (const detlogp::BackendInfo& b : detlogp::list_backends()) {
    std::string left = "  " + b.id;
    left.append(44 - std::min<size_t>(44, left.size()), ' ');
    std::cout << left << (b.contract_bearing ? "contract-bearing  " : "non-contract      ")
              << (b.available ? "available" : "unavailable") << (b.detail.empty() ? "" : ": " + b.detail) << "\n";
  }
  // The readback: what actually serves a call with these options.
  const uint16_t one_bf16 = 0x3F80;
  const int64_t target = 0;
  float logp = 0, lse = 0;
  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(&one_bf16, detlogp::DType::bf16, 1, 1);
  in.weight = detlogp::TensorView::matrix(&one_bf16, detlogp::DType::bf16, 1, 1);
  in.targets = detlogp::TensorView::vector(&target, detlogp::DType::i64, 1);
  const detlogp::CallReport report = detlogp::linear_logp(in,
                                                          {detlogp::mutable_vector(&logp, detlogp::DType::f32, 1),
                                                           detlogp::mutable_vector(&lse, detlogp::DType::f32, 1),
                                                           {}},
                                                          call_options(o));
  std::cout << "served by: " << describe_report(report) << "\n";
  std::cout << "provenance: " << detlogp::to_string(report.provenance) << "\n";
  return kExitOk;
}

// ---------------------------------------------------------------------------------------------
// detlogp run

const std::vector<OptionSpec> kRunOptions = {
    {"input", true, "problem file (.safetensors): hidden, weight, targets, optional bias, temperature"},
    {"hidden", true, ".npy input instead of --input: hidden [N, D] bf16 ('<u2' bit patterns)"},
    {"weight", true, ".npy input: weight [V_local, D] bf16"},
    {"targets", true, ".npy input: targets [N] '<i4' or '<i8'"},
    {"bias", true, ".npy input: optional bias [V_local] '<f4'"},
    {"temperatures", true, ".npy input: optional temperature, scalar or [N] '<f4'"},
    {"rows", true, "synthetic problem: N (default 64)"},
    {"dim", true, "synthetic problem: D (default 1024)"},
    {"vocab", true, "synthetic problem: weight rows V_local (default 32000)"},
    {"seed", true, "synthetic problem: generator seed (default 0)"},
    {"with-bias", false, "synthetic problem: add a random fp32 bias"},
    {"real-vocab", true, "V_real: ids >= V_real are padding (default vocab_start + V_local)"},
    {"vocab-start", true, "global id of weight row 0, a multiple of 64 (default 0)"},
    {"temperature", true, "scalar temperature T > 0 (default 1)"},
    {"ignore-index", true, "target id whose row gets logp = +0.0 (default -100)"},
    {"return-logits", false, "serving entry: also output logits [N, V_local] f32"},
    {"backend", true, "backend id (default: env DETLOGP_BACKEND, else auto); see `detlogp info`"},
    {"strict", false, "contract-bearing backends only, no fallback (also env DETLOGP_STRICT=1)"},
    {"repeat", true, "run K times, check every run gives the same bits, report the best time (default 1)"},
    {"out", true, "write the outputs to FILE.safetensors (atomically: nothing on error)"},
    {"help", false, "this text"},
};

void run_help(std::ostream& os) {
  os << "usage: detlogp run [--input FILE.safetensors | --hidden A.npy --weight B.npy --targets C.npy]\n"
        "                   [options] [--out FILE.safetensors]\n\n"
        "Computes logp and lse per row (and logits with --return-logits). Without an input it runs a\n"
        "built-in synthetic problem (N=64, D=1024, V=32000 unless changed) from a fixed-seed generator,\n"
        "so the same command prints the same SHA-256 on every machine with the same backend. When the\n"
        "weight is a vocabulary shard (vocab_start > 0 or V_local < real vocab) it outputs the\n"
        "tensor-parallel partials instead: tile_max, tile_sum [N, tiles] f32, target_logit [N] f32,\n"
        "target_owned [N] u8. The SHA-256 covers the raw little-endian bytes of the output tensors\n"
        "concatenated in the order printed (logp|lse[|logits], or the partials).\n\n";
  print_option_help(os, kRunOptions);
  os << "\nexit codes: 0 ok, 1 --repeat saw differing bits, 2 usage error, 3 error (bad input, refused)\n";
}

HostProblem load_problem(const Options& o) {
  const bool from_npy =
      o.has("hidden") || o.has("weight") || o.has("targets") || o.has("bias") || o.has("temperatures");
  const bool synthetic_shape = o.has("rows") || o.has("dim") || o.has("vocab") || o.has("seed") || o.flag("with-bias");
  if (o.has("input") && from_npy) throw UsageError("--input and the .npy inputs (--hidden ...) exclude each other");
  if ((o.has("input") || from_npy) && synthetic_shape)
    throw UsageError("--rows/--dim/--vocab/--seed/--with-bias describe the synthetic problem; not with an input file");
  if (from_npy && !(o.has("hidden") && o.has("weight") && o.has("targets")))
    throw UsageError(".npy input needs --hidden, --weight and --targets");

  HostProblem p;
  if (o.has("input")) {
    const std::string path = o.text("input");
    if (path.size() >= 4 && path.substr(path.size() - 4) == ".npy")
      throw UsageError("--input takes a .safetensors file; for .npy use --hidden/--weight/--targets");
    p = problem_from_inputs(inputs_from_safetensors(path));
    p.source = path;
  } else if (from_npy) {
    NamedInputs in;
    for (const char* name : {"hidden", "weight", "targets", "bias", "temperatures"}) {
      if (!o.has(name)) continue;
      const std::string path = o.text(name);
      const std::string tensor_name = std::string(name) == "temperatures" ? "temperature" : name;
      in.tensors[tensor_name] = {path, detlogp::io::read_npy(path)};
    }
    p = problem_from_inputs(in);
    p.source = "npy files";
  } else {
    const int64_t rows = o.integer("rows", 64, 0, int64_t{1} << 24);
    const int64_t dim = o.integer("dim", 1024, 1, int64_t{1} << 20);
    const int64_t vocab = o.integer("vocab", 32000, 1, int64_t{1} << 24);
    const int64_t seed = o.integer("seed", 0, 0, INT64_MAX);
    if (rows * dim > (int64_t{1} << 30) || vocab * dim > (int64_t{1} << 31))
      throw UsageError("synthetic problem too large (N*D <= 2^30 and V*D <= 2^31)");
    const int64_t real_vocab = o.integer("real-vocab", -1, 1, INT64_MAX);
    const int64_t ignore_index = o.integer("ignore-index", detlogp::kDefaultIgnoreIndex, INT64_MIN, INT64_MAX);
    p = synthetic_problem(static_cast<uint64_t>(seed), rows, dim, vocab, real_vocab, ignore_index, o.flag("with-bias"));
    std::ostringstream src;
    src << "synthetic (seed " << seed << (o.flag("with-bias") ? ", with bias" : "") << ")";
    p.source = src.str();
  }
  if (o.has("real-vocab")) p.real_vocab = o.integer("real-vocab", -1, 1, INT64_MAX);
  p.vocab_start = o.integer("vocab-start", 0, 0, INT64_MAX);
  p.ignore_index = o.integer("ignore-index", p.ignore_index, INT64_MIN, INT64_MAX);
  if (o.has("temperature")) {
    if (p.temperature_from_input)
      throw UsageError("--temperature given but the input already has a 'temperature' tensor");
    p.temperature = o.real("temperature", 1.0f);
  }
  return p;
}

int command_run(const Options& o) {
  detlogp::check_environment();
  const int64_t repeat = o.integer("repeat", 1, 1, 1000);
  std::filesystem::path out_path;
  if (o.has("out")) {
    out_path = o.text("out");
    if (out_path.extension() != ".safetensors") throw UsageError("--out must name a .safetensors file");
    const std::filesystem::path dir = out_path.has_parent_path() ? out_path.parent_path() : ".";
    DETLOGP_CHECK(std::filesystem::is_directory(dir),
                  "--out " << out_path.string() << ": directory '" << dir.string() << "' does not exist");
  }
  const HostProblem p = load_problem(o);
  const detlogp::CallOptions opt = call_options(o);

  RunOutputs out;
  double best_seconds = 0;
  std::string first_sha;
  for (int64_t r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    RunOutputs current = compute(p, o.flag("return-logits"), opt);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string sha = output_sha256(current);
    if (r == 0) {
      first_sha = sha;
      best_seconds = seconds;
      out = std::move(current);
    } else {
      best_seconds = std::min(best_seconds, seconds);
      if (sha != first_sha) {
        std::cerr << "detlogp run: repeat " << r << " gave different bits: sha256 " << sha << " vs " << first_sha
                  << "\n";
        return kExitCheckFailed;
      }
    }
  }

  std::ostringstream temperature;
  if (p.temperature_rows.empty())
    temperature << p.temperature;
  else
    temperature << "per-row";
  std::cout << "problem: " << p.source << ": N=" << p.rows << " D=" << p.dim << " V_local=" << p.vocab_local
            << " real_vocab=" << p.effective_real_vocab() << " vocab_start=" << p.vocab_start
            << " ignore_index=" << p.ignore_index << " temperature=" << temperature.str()
            << " bias=" << (p.bias.empty() ? "no" : "yes") << "\n";
  std::cout << "backend: " << describe_report(out.report) << "\n";
  std::cout << "entry: "
            << (out.partials ? "partials (vocab shard)"
                : out.logits ? "serving (logits)"
                             : "trainer")
            << "\n";
  std::ostringstream timing;
  timing.setf(std::ios::fixed);
  timing.precision(3);
  timing << "time: " << best_seconds * 1e3 << " ms" << (repeat > 1 ? " (best of " + std::to_string(repeat) + ")" : "");
  timing.precision(0);
  timing << ", " << (best_seconds > 0 ? static_cast<double>(p.rows) / best_seconds : 0.0) << " rows/s";
  std::cout << timing.str() << "\n";
  std::cout << "sha256(" << sha_scope(out) << "): " << first_sha << "\n";

  if (!out_path.empty()) {
    detlogp::io::SafetensorsContents file;
    for (auto& [name, t] : out.tensors) file.add(name, std::move(t));
    file.metadata["format"] = "detlogp-output-v1";
    file.metadata["detlogp_version"] = detlogp::version_string();
    file.metadata["provenance"] = detlogp::to_string(out.report.provenance);
    file.metadata["sha256"] = first_sha;
    detlogp::io::write_safetensors(out_path, file);
    std::cout << "wrote: " << out_path.string() << "\n";
  }
  return kExitOk;
}

// ---------------------------------------------------------------------------------------------
// detlogp verify: the validation ladder on one backend.

const std::vector<OptionSpec> kVerifyOptions = {
    {"backend", true, "backend id to verify (default: env DETLOGP_BACKEND, else auto)"},
    {"strict", false, "contract-bearing backends only, no fallback (also env DETLOGP_STRICT=1)"},
    {"seed", true, "generator seed of the built-in problem (default 0)"},
    {"dim", true, "D of the built-in problem (default 256)"},
    {"vocab", true, "real vocabulary of the built-in problem (default 2053, not a multiple of 64)"},
    {"golden", false, "replay the golden cases against the fingerprints file instead of the ladder"},
    {"golden-file", true, "fingerprints file (default: the source tree's tests/golden/fingerprints.tsv)"},
    {"record", false, "with --golden: append the fingerprints not yet recorded for this (arch, cc)"},
    {"case", true, "with --golden: only these cases (comma-separated names)"},
    {"help", false, "this text"},
};

void verify_help(std::ostream& os) {
  os << "usage: detlogp verify [--backend ID] [--strict] [--seed S] [--dim D] [--vocab V]\n"
        "       detlogp verify --golden [--backend ID] [--strict] [--record] [--case A,B] [--golden-file F]\n\n"
        "--golden replays the golden cases (docs/validation.md) and compares the SHA-256 of their output\n"
        "bytes with the fingerprints recorded for this backend's (contract version, arch, cc): PASS, FAIL,\n"
        "or NOT RECORDED (exit 1); --record appends the missing ones to the file and prints them.\n\n"
        "Runs the validation ladder on one backend with a built-in problem (a pool of 1000 rows, bias,\n"
        "temperature 0.7, some ignored rows) and prints one line per check. Every comparison is on\n"
        "bit patterns (so -0.0 vs +0.0 and NaN payloads differ):\n"
        "  L1 repeat          the same batch three times gives identical logp, lse and logits\n"
        "  L2 N=...           rows drawn from the pool (with duplicates) at random positions in batches of\n"
        "                     N in {1,2,3,7,63,64,65,127,128,1000} match the pool's own result\n"
        "  L2 permuted / duplicated / strided   the pool permuted, one row 65 times, rows with a gap\n"
        "  serving == trainer logp and lse do not change when logits are returned\n"
        "  TP R=1,2,4,8       simulate_tensor_parallel equals the single-shard result\n"
        "  padded vocab       extra weight rows beyond real_vocab (random, and huge) change nothing\n"
        "  temperature rows   per-row temperatures equal to the scalar give the scalar's bits\n"
        "  ignore_index       ignored rows have logp = +0.0 exactly\n"
        "  reduce_logits      the backend's logits re-reduced by reduce_logits give identical bits\n\n";
  print_option_help(os, kVerifyOptions);
  os << "\nexit codes: 0 every check passed, 1 a check failed, 2 usage error, 3 error (refused, ...)\n";
}

struct VerifyPool {
  int64_t rows = 0, dim = 0, vocab = 0;
  std::vector<uint16_t> hidden, weight;
  std::vector<float> bias;
  std::vector<int64_t> targets;
  float temperature = 0.7f;
  int64_t ignore_index = detlogp::kDefaultIgnoreIndex;
};

struct Result {
  std::vector<float> logp, lse, logits;
};

struct Batch {
  std::vector<int64_t> pool_rows;  // batch row i is pool row pool_rows[i]
  int64_t hidden_stride_pad = 0;   // extra elements between hidden rows
};

class Verifier {
 public:
  Verifier(VerifyPool pool, detlogp::CallOptions opt) : pool_(std::move(pool)), opt_(std::move(opt)) {}

  // Runs a batch through linear_logp. weight_rows > vocab pads the weight with extra rows
  // (huge_padding: values near the bf16 maximum) while real_vocab stays the pool's vocabulary.
  Result run(const Batch& batch, bool logits, int64_t weight_rows = -1, bool huge_padding = false,
             bool temperature_rows = false, int tp_ranks = 0) {
    const int64_t n = static_cast<int64_t>(batch.pool_rows.size());
    const int64_t stride = pool_.dim + batch.hidden_stride_pad;
    std::vector<uint16_t> hidden(static_cast<size_t>(std::max<int64_t>(1, n * stride)), 0xFFC1);  // NaN filler
    std::vector<int64_t> targets(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t src = batch.pool_rows[static_cast<size_t>(i)];
      std::copy_n(pool_.hidden.begin() + src * pool_.dim, pool_.dim, hidden.begin() + i * stride);
      targets[static_cast<size_t>(i)] = pool_.targets[static_cast<size_t>(src)];
    }
    const int64_t v_local = weight_rows < 0 ? pool_.vocab : weight_rows;
    const std::vector<uint16_t>& weight = weight_rows < 0 ? pool_.weight : padded_weight(v_local, huge_padding);
    std::vector<float> bias = pool_.bias;
    bias.resize(static_cast<size_t>(v_local), huge_padding ? 1e30f : 0.25f);
    std::vector<float> temps(static_cast<size_t>(n), pool_.temperature);

    detlogp::LinearLogpInputs in;
    in.hidden =
        detlogp::TensorView::matrix(hidden.data(), detlogp::DType::bf16, n, pool_.dim, detlogp::Memory::host, stride);
    in.weight = detlogp::TensorView::matrix(weight.data(), detlogp::DType::bf16, v_local, pool_.dim);
    in.bias = detlogp::TensorView::vector(bias.data(), detlogp::DType::f32, v_local);
    in.targets = detlogp::TensorView::vector(targets.data(), detlogp::DType::i64, n);
    in.temperature = pool_.temperature;
    if (temperature_rows) in.temperature_rows = detlogp::TensorView::vector(temps.data(), detlogp::DType::f32, n);
    in.real_vocab = pool_.vocab;
    in.ignore_index = pool_.ignore_index;

    Result r;
    r.logp.assign(static_cast<size_t>(n), 0.0f);
    r.lse.assign(static_cast<size_t>(n), 0.0f);
    detlogp::LinearLogpOutputs out{detlogp::mutable_vector(r.logp.data(), detlogp::DType::f32, n),
                                   detlogp::mutable_vector(r.lse.data(), detlogp::DType::f32, n),
                                   {}};
    if (logits) {
      r.logits.assign(static_cast<size_t>(n * v_local), 0.0f);
      out.logits = detlogp::mutable_matrix(r.logits.data(), detlogp::DType::f32, n, v_local);
    }
    const detlogp::CallReport report =
        tp_ranks > 0 ? detlogp::simulate_tensor_parallel(in, tp_ranks, out, opt_) : detlogp::linear_logp(in, out, opt_);
    if (served_by_.empty()) served_by_ = describe_report(report);
    return r;
  }

  const VerifyPool& pool() const { return pool_; }
  const std::string& served_by() const { return served_by_; }

 private:
  const std::vector<uint16_t>& padded_weight(int64_t rows, bool huge) {
    auto& cached = padded_[{rows, huge}];
    if (cached.empty()) {
      cached = pool_.weight;
      SplitMix64 rng(7, static_cast<uint64_t>(rows));
      cached.resize(static_cast<size_t>(rows * pool_.dim));
      for (size_t i = pool_.weight.size(); i < cached.size(); ++i)
        cached[i] = huge ? static_cast<uint16_t>((rng.next() & 1 ? 0xFF00 : 0x7F00) | (rng.next() & 0x7F))
                         : float_to_bf16(rng.bell() * 0.1f);
    }
    return cached;
  }

  VerifyPool pool_;
  detlogp::CallOptions opt_;
  std::string served_by_;
  std::map<std::pair<int64_t, bool>, std::vector<uint16_t>> padded_;
};

struct Verdict {
  std::string name;
  bool pass;
  std::string detail;
};

// The first non-empty mismatch description, or "".
std::string first_of(std::initializer_list<std::string> mismatches) {
  for (const std::string& m : mismatches)
    if (!m.empty()) return m;
  return "";
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// detlogp verify --golden: every golden case's fingerprints against the file, keyed by
// (contract version, arch, cc) of the backend that served; "inputs" rows are keyed (any, -).
int command_verify_golden(const Options& o) {
  namespace g = detlogp::golden;
  detlogp::check_environment();
  if (o.has("seed") || o.has("dim") || o.has("vocab"))
    throw UsageError("--seed/--dim/--vocab shape the ladder's problem; the golden cases are fixed");
  const std::string path = o.text("golden-file", DETLOGP_GOLDEN_FILE);
  const auto table = g::read_fingerprints(path);
  const detlogp::CallOptions opt = call_options(o);
  const std::vector<std::string> only = split_commas(o.text("case"));
  for (const std::string& name : only) {
    bool known = false;
    for (const g::GoldenCase& c : g::golden_cases()) known |= c.name == name;
    if (!known) throw UsageError("--case: unknown golden case '" + name + "'");
  }
  std::cout << "detlogp verify --golden: " << path << " (" << table.size() << " entries)\n";
  int pass = 0, fail = 0, missing = 0;
  std::vector<std::string> new_lines;
  std::string served;
  for (const g::GoldenCase& c : g::golden_cases()) {
    if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
    g::CaseResult r;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      r = g::run_case(g::make_inputs(c), opt);
    } catch (const detlogp::Error& e) {
      std::cout << "  " << c.name << "  FAIL  error: " << e.what() << "\n";
      ++fail;
      continue;
    }
    const double ms = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
    if (served.empty()) {
      served = describe_report(r.report);
      std::cout << "served by: " << served << "\nprovenance: " << detlogp::to_string(r.report.provenance) << "\n";
    }
    const detlogp::Provenance& p = r.report.provenance;
    for (const g::Fingerprint& f : r.fingerprints) {
      const bool any = f.scope == "inputs";
      const g::FingerprintKey key{p.contract_version, any ? "any" : p.arch, any ? "-" : std::to_string(p.cc), c.name,
                                  f.scope};
      const auto it = table.find(key);
      std::string status;
      if (it == table.end()) {
        status = "NOT RECORDED  " + f.sha256;
        ++missing;
        new_lines.push_back(g::fingerprint_line(key, f.sha256));
      } else if (it->second == f.sha256) {
        status = "PASS  " + f.sha256;
        ++pass;
      } else {
        status = "FAIL  got " + f.sha256 + ", recorded " + it->second;
        ++fail;
      }
      std::string name = c.name + " " + f.scope + " [" + key.arch + "/" + key.cc + "]";
      name.append(name.size() < 64 ? 64 - name.size() : 1, ' ');
      std::cout << "  " << name << status << "\n";
    }
    std::ostringstream timing;
    timing.setf(std::ios::fixed);
    timing.precision(0);
    timing << "    (" << c.name << ": N=" << c.rows << " D=" << c.dim << " V=" << c.weight_rows << " TP=" << c.tp
           << ", " << ms << " ms)";
    std::cout << timing.str() << "\n";
  }
  if (o.flag("record") && !new_lines.empty()) {
    const bool fresh = !std::filesystem::exists(path);
    std::ofstream f(path, std::ios::app);
    DETLOGP_CHECK(f, "cannot append to '" << path << "'");
    if (fresh) f << "# contract_version\tarch\tcc\tcase\tscope\tsha256 (docs/validation.md)\n";
    for (const std::string& line : new_lines) {
      f << line << "\n";
      std::cout << "recorded: " << line << "\n";
    }
    DETLOGP_CHECK(f.good(), "failed writing '" << path << "'");
  }
  const bool recorded = o.flag("record");
  std::cout << "verdict: "
            << (fail > 0                   ? "FAIL"
                : missing > 0 && !recorded ? "NOT RECORDED"
                                           : "PASS")
            << " (" << pass << " pass, " << fail << " fail, " << missing
            << (recorded ? " newly recorded" : " not recorded") << ")\n";
  return fail > 0 || (missing > 0 && !recorded) ? kExitCheckFailed : kExitOk;
}

int command_verify(const Options& o) {
  if (o.flag("golden")) return command_verify_golden(o);
  if (o.flag("record") || o.has("case") || o.has("golden-file"))
    throw UsageError("--record, --case and --golden-file go with --golden");
  detlogp::check_environment();
  VerifyPool pool;
  const uint64_t seed = static_cast<uint64_t>(o.integer("seed", 0, 0, INT64_MAX));
  pool.rows = 1000;
  pool.dim = o.integer("dim", 256, 1, 1 << 16);
  pool.vocab = o.integer("vocab", 2053, 1, 1 << 20);
  {
    HostProblem p = synthetic_problem(seed, pool.rows, pool.dim, pool.vocab, pool.vocab, pool.ignore_index, true);
    pool.hidden = std::move(p.hidden);
    pool.weight = std::move(p.weight);
    pool.bias = std::move(p.bias);
    pool.targets = std::move(p.targets);
  }
  Verifier v(std::move(pool), call_options(o));
  const VerifyPool& P = v.pool();

  std::vector<Verdict> verdicts;
  auto check = [&](const std::string& name, const std::function<std::string(std::string*)>& body) {
    std::string detail;
    try {
      const std::string mismatch = body(&detail);
      verdicts.push_back({name, mismatch.empty(), mismatch.empty() ? detail : mismatch});
    } catch (const std::exception& e) {
      verdicts.push_back({name, false, std::string("error: ") + e.what()});
    }
  };

  std::vector<int64_t> all_rows(static_cast<size_t>(P.rows));
  std::iota(all_rows.begin(), all_rows.end(), 0);
  const Batch first128{{all_rows.begin(), all_rows.begin() + std::min<int64_t>(128, P.rows)}, 0};

  // The reference: the whole pool as one batch, served with logits.
  Result reference;
  try {
    reference = v.run({all_rows, 0}, true);
  } catch (const detlogp::Error& e) {
    std::cerr << "detlogp verify: the backend cannot run the built-in problem: " << e.what() << "\n";
    return kExitError;
  }
  auto compare_rows = [&](const Result& r, const std::vector<int64_t>& pool_rows) {
    return first_of({compare_bits("logp", r.logp, reference.logp, pool_rows),
                     compare_bits("lse", r.lse, reference.lse, pool_rows)});
  };
  auto compare_first128 = [&](const Result& r) {
    return first_of({compare_bits("logp", r.logp, {reference.logp.begin(), reference.logp.begin() + 128}),
                     compare_bits("lse", r.lse, {reference.lse.begin(), reference.lse.begin() + 128})});
  };

  check("L1 repeat", [&](std::string* detail) {
    const Result a = v.run(first128, true), b = v.run(first128, true), c = v.run(first128, true);
    *detail = "3 runs x 128 rows: logp, lse, logits identical";
    return first_of({compare_bits("logp", b.logp, a.logp), compare_bits("lse", b.lse, a.lse),
                     compare_bits("logits", b.logits, a.logits), compare_bits("logp", c.logp, a.logp),
                     compare_bits("lse", c.lse, a.lse), compare_bits("logits", c.logits, a.logits)});
  });

  SplitMix64 rng(seed, kStreamVerify);
  for (int64_t n : {1, 2, 3, 7, 63, 64, 65, 127, 128, 1000}) {
    check("L2 N=" + std::to_string(n), [&](std::string* detail) {
      Batch batch;
      for (int64_t i = 0; i < n; ++i) batch.pool_rows.push_back(static_cast<int64_t>(rng.next() % P.rows));
      const std::set<int64_t> distinct(batch.pool_rows.begin(), batch.pool_rows.end());
      *detail = std::to_string(n) + " random pool rows (" + std::to_string(distinct.size()) +
                " distinct) match the N=1000 reference";
      return compare_rows(v.run(batch, false), batch.pool_rows);
    });
  }
  check("L2 permuted", [&](std::string* detail) {
    Batch batch{all_rows, 0};
    for (size_t i = batch.pool_rows.size(); i > 1; --i)  // Fisher-Yates with our own generator
      std::swap(batch.pool_rows[i - 1], batch.pool_rows[static_cast<size_t>(rng.next() % i)]);
    *detail = "the pool in a random order";
    return compare_rows(v.run(batch, false), batch.pool_rows);
  });
  check("L2 duplicated", [&](std::string* detail) {
    Batch batch{std::vector<int64_t>(65, 17), 0};
    *detail = "pool row 17 repeated 65 times";
    return compare_rows(v.run(batch, false), batch.pool_rows);
  });
  check("L2 strided", [&](std::string* detail) {
    Batch batch = first128;
    batch.hidden_stride_pad = 64;
    *detail = "hidden rows 64 elements apart (NaN filler between them)";
    return compare_rows(v.run(batch, false), batch.pool_rows);
  });
  check("serving == trainer", [&](std::string* detail) {
    const Result trainer = v.run(first128, false), serving = v.run(first128, true);
    *detail = "128 rows: logp and lse identical with and without logits";
    return first_of({compare_bits("logp", serving.logp, trainer.logp), compare_bits("lse", serving.lse, trainer.lse),
                     compare_first128(trainer)});
  });
  for (int ranks : {1, 2, 4, 8}) {
    check("TP R=" + std::to_string(ranks), [&](std::string* detail) {
      const Result tp = v.run(first128, false, -1, false, false, ranks);
      *detail = "simulate_tensor_parallel over " + std::to_string(ranks) + " shards == TP=1";
      return compare_first128(tp);
    });
  }
  const int64_t tile_padded = (P.vocab + 63) / 64 * 64 + 64;
  for (auto [rows, huge] : {std::pair<int64_t, bool>{tile_padded, false}, {P.vocab + 2048, true}}) {
    check("padded vocab " + std::to_string(rows) + (huge ? " huge" : ""),
          [&, rows = rows, huge = huge](std::string* d) {
            const Result r = v.run(first128, true, rows, huge);
            *d = std::to_string(rows - P.vocab) + (huge ? " rows of near-max bf16 and 1e30 bias" : " random rows") +
                 " beyond real_vocab: logp, lse and the real logits identical";
            std::vector<float> real_logits;
            for (int64_t i = 0; i < 128; ++i)
              real_logits.insert(real_logits.end(), r.logits.begin() + i * rows, r.logits.begin() + i * rows + P.vocab);
            const std::vector<float> ref_logits(reference.logits.begin(), reference.logits.begin() + 128 * P.vocab);
            return first_of({compare_first128(r), compare_bits("logits", real_logits, ref_logits)});
          });
  }
  check("temperature rows", [&](std::string* detail) {
    *detail = "temperature_rows all 0.7 == scalar 0.7";
    return compare_first128(v.run(first128, false, -1, false, true));
  });
  check("ignore_index", [&](std::string* detail) {
    int64_t ignored = 0;
    for (int64_t i = 0; i < P.rows; ++i) {
      if (P.targets[static_cast<size_t>(i)] != P.ignore_index) continue;
      ++ignored;
      if (float_bits(reference.logp[static_cast<size_t>(i)]) != 0u)
        return "logp[" + std::to_string(i) + "] = " + describe_float(reference.logp[static_cast<size_t>(i)]) +
               " for an ignored row, expected +0.0 (0x00000000)";
    }
    *detail = std::to_string(ignored) + " ignored rows have logp = +0.0 exactly";
    return std::string();
  });
  check("reduce_logits", [&](std::string* detail) {
    std::vector<float> logp(static_cast<size_t>(P.rows)), lse(static_cast<size_t>(P.rows));
    detlogp::ReduceLogitsInputs in;
    in.logits = detlogp::TensorView::matrix(reference.logits.data(), detlogp::DType::f32, P.rows, P.vocab);
    in.targets = detlogp::TensorView::vector(P.targets.data(), detlogp::DType::i64, P.rows);
    in.temperature = P.temperature;
    in.real_vocab = P.vocab;
    in.ignore_index = P.ignore_index;
    detlogp::reduce_logits(in, detlogp::mutable_vector(logp.data(), detlogp::DType::f32, P.rows),
                           detlogp::mutable_vector(lse.data(), detlogp::DType::f32, P.rows));
    *detail = "the backend's logits [1000, " + std::to_string(P.vocab) + "] re-reduced: identical logp, lse";
    return first_of({compare_bits("logp", logp, reference.logp), compare_bits("lse", lse, reference.lse)});
  });

  std::cout << "detlogp verify: " << v.served_by() << "\n";
  std::cout << "problem: pool of " << P.rows << " rows, D=" << P.dim << ", real_vocab=" << P.vocab
            << ", bias, temperature " << P.temperature << ", seed " << seed << "\n";
  int failures = 0;
  for (const Verdict& verdict : verdicts) {
    std::string name = verdict.name;
    name.append(28 - std::min<size_t>(28, name.size()), ' ');
    std::cout << "  " << name << (verdict.pass ? "PASS  " : "FAIL  ") << verdict.detail << "\n";
    failures += verdict.pass ? 0 : 1;
  }
  std::cout << (failures == 0 ? "verdict: PASS (" + std::to_string(verdicts.size()) + " checks)"
                              : "verdict: FAIL (" + std::to_string(failures) + " of " +
                                    std::to_string(verdicts.size()) + " checks failed)")
            << "\n";
  return failures == 0 ? kExitOk : kExitCheckFailed;
}

// ---------------------------------------------------------------------------------------------
// detlogp harness: validation ladder L3 (two engines, two processes) and L4/L5 (rollout vs trainer).

const std::vector<OptionSpec> kHarnessRvtOptions = {
    {"seqs", true, "sequences (default 16)"},
    {"max-len", true, "longest sequence, tokens (default 12); lengths are 1..max-len"},
    {"max-batch", true, "continuous batching: most sequences per step (default 8)"},
    {"d", true, "hidden size D (default 1024)"},
    {"v", true, "lm_head rows, padding included (default 2053)"},
    {"real-vocab", true, "real vocabulary, ids >= it are padding (default --v)"},
    {"tp", true, "trainer tensor-parallel degree (default 2)"},
    {"cp", true, "trainer context-parallel degree: packed rows split into CP groups (default 1)"},
    {"rollout-tp", true, "rollout engine tensor-parallel degree, serving entry (default 1)"},
    {"devices", true, "CUDA devices for the TP ranks, e.g. 0,1 (real NCCL); default: in-process host ranks"},
    {"seed", true, "generator seed (default 0)"},
    {"backend", true, "backend of both sides (default: env DETLOGP_BACKEND, else auto)"},
    {"strict", false, "contract-bearing backends only, no fallback"},
    {"perturb-trainer-weight", false, "flip one bit of the trainer's weight: the fingerprints must differ"},
    {"out", true, "directory for report.json and report.md (created if missing)"},
    {"help", false, "this text"},
};

const std::vector<OptionSpec> kHarnessL3Options = {
    {"side", true, "trainer (packed, vocab-parallel, trainer entry) or rollout (one row, serving entry)"},
    {"out", true, "result file FILE.safetensors (format detlogp-l3-v1)"},
    {"tp", true, "trainer side: vocabulary shards (default 2)"},
    {"case", true, "only these golden cases (comma-separated; default all)"},
    {"backend", true, "backend id (default: env DETLOGP_BACKEND, else auto)"},
    {"strict", false, "contract-bearing backends only, no fallback"},
    {"help", false, "this text"},
};

const std::vector<OptionSpec> kHarnessL3CheckOptions = {
    {"a", true, "one side's result file"},
    {"b", true, "the other side's result file"},
    {"help", false, "this text"},
};

const std::vector<OptionSpec> kHarnessL3ExportOptions = {
    {"dir", true, "directory for <case>.safetensors (the `detlogp run --input` format)"},
    {"case", true, "only these golden cases (comma-separated; default all)"},
    {"help", false, "this text"},
};

void harness_help(std::ostream& os) {
  os << "usage: detlogp harness rollout-vs-trainer [--seqs S] [--max-len L] [--max-batch B] [--d D] [--v V]\n"
        "                          [--real-vocab R] [--tp P] [--cp C] [--rollout-tp P] [--devices 0,1,..]\n"
        "                          [--seed S] [--strict] [--backend ID] --out DIR\n"
        "       detlogp harness l3 --side trainer|rollout --out FILE.safetensors [--tp P] [--case A,B]\n"
        "       detlogp harness l3-check --a FILE --b FILE\n"
        "       detlogp harness l3-export --dir DIR [--case A,B]\n\n"
        "rollout-vs-trainer (L4/L5): a synthetic rollout with continuous batching and a sampler on the\n"
        "serving entry's fp32 logits, then a packed TP trainer recomputation at the same weight\n"
        "fingerprint; writes DIR/report.json and DIR/report.md. Exit 0 when every logp metric is exactly\n"
        "zero with no fallback and the bf16-logits negative control drifts; 1 otherwise (also when the\n"
        "weight fingerprints differ, which is reported and never compared).\n"
        "l3 / l3-check (L3): each side runs the golden inputs in its own process and writes a file; the\n"
        "check compares logp and lse bytes case by case. l3-export writes the inputs for an external side.\n\n"
        "rollout-vs-trainer options:\n";
  print_option_help(os, kHarnessRvtOptions);
  os << "\nl3 options:\n";
  print_option_help(os, kHarnessL3Options);
  os << "\nexit codes: 0 ok, 1 a check failed, 2 usage error, 3 error\n";
}

int command_harness(const std::string& sub, const std::vector<std::string>& args) {
  namespace g = detlogp::golden;
  if (sub == "rollout-vs-trainer") {
    const Options o(args, kHarnessRvtOptions);
    if (o.flag("help")) return harness_help(std::cout), kExitOk;
    detlogp::check_environment();
    if (!o.has("out")) throw UsageError("--out DIR is required");
    g::HarnessConfig cfg;
    cfg.seqs = o.integer("seqs", 16, 1, 4096);
    cfg.max_len = o.integer("max-len", 12, 1, 1 << 16);
    cfg.max_batch = o.integer("max-batch", 8, 1, 4096);
    cfg.dim = o.integer("d", 1024, 1, 1 << 16);
    cfg.weight_rows = o.integer("v", 2053, 1, 1 << 22);
    cfg.real_vocab = o.integer("real-vocab", cfg.weight_rows, 1, cfg.weight_rows);
    cfg.tp = static_cast<int>(o.integer("tp", 2, 1, detlogp::kMaxTensorParallelRanks));
    cfg.cp = static_cast<int>(o.integer("cp", 1, 1, 1024));
    cfg.rollout_tp = static_cast<int>(o.integer("rollout-tp", 1, 1, detlogp::kMaxTensorParallelRanks));
    if (o.has("devices")) {
      std::stringstream list(o.text("devices"));
      for (std::string item; std::getline(list, item, ',');) {
        char* end = nullptr;
        const long d = std::strtol(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || d < 0 || d > 1023)
          throw UsageError("--devices takes CUDA device numbers separated by commas, got '" + o.text("devices") + "'");
        cfg.devices.push_back(static_cast<int>(d));
      }
      const size_t need = static_cast<size_t>(std::max(cfg.tp, cfg.rollout_tp));
      if (cfg.devices.size() < need)
        throw UsageError("--devices lists " + std::to_string(cfg.devices.size()) +
                         " devices; TP=" + std::to_string(need) + " needs one per rank");
    }
    cfg.seed = static_cast<uint64_t>(o.integer("seed", 0, 0, INT64_MAX));
    cfg.perturb_trainer_weight = o.flag("perturb-trainer-weight");
    cfg.rollout_opt = cfg.trainer_opt = call_options(o);
    const std::filesystem::path dir = o.text("out");
    std::filesystem::create_directories(dir);
    const g::HarnessResult r = g::run_rollout_vs_trainer(cfg, std::cout);
    for (const auto& [name, text] : {std::pair{"report.json", &r.json}, {"report.md", &r.markdown}}) {
      std::ofstream f(dir / name, std::ios::binary);
      f << *text;
      DETLOGP_CHECK(f.good(), "failed writing '" << (dir / name).string() << "'");
      std::cout << "wrote: " << (dir / name).string() << "\n";
    }
    std::cout << "verdict: "
              << (!r.compared                  ? "FAIL (weight fingerprints differ: not compared)"
                  : r.exact && r.control_drift ? "PASS (logp exact zero; negative control drifts)"
                  : !r.exact                   ? "FAIL (logp not exactly zero, or a fallback was observed)"
                                               : "FAIL (the negative control showed no drift)")
              << "\n";
    return r.compared && r.exact && r.control_drift ? kExitOk : kExitCheckFailed;
  }
  if (sub == "l3") {
    const Options o(args, kHarnessL3Options);
    if (o.flag("help")) return harness_help(std::cout), kExitOk;
    detlogp::check_environment();
    const std::string side = o.text("side");
    if (side != "trainer" && side != "rollout") throw UsageError("--side must be trainer or rollout");
    if (!o.has("out") || std::filesystem::path(o.text("out")).extension() != ".safetensors")
      throw UsageError("--out FILE.safetensors is required");
    g::l3_run_side(side == "trainer" ? g::L3Side::trainer : g::L3Side::rollout, split_commas(o.text("case")),
                   static_cast<int>(o.integer("tp", 2, 1, detlogp::kMaxTensorParallelRanks)), call_options(o),
                   o.text("out"), std::cout);
    return kExitOk;
  }
  if (sub == "l3-check") {
    const Options o(args, kHarnessL3CheckOptions);
    if (o.flag("help")) return harness_help(std::cout), kExitOk;
    if (!o.has("a") || !o.has("b")) throw UsageError("--a FILE and --b FILE are required");
    return g::l3_check(o.text("a"), o.text("b"), std::cout) ? kExitOk : kExitCheckFailed;
  }
  if (sub == "l3-export") {
    const Options o(args, kHarnessL3ExportOptions);
    if (o.flag("help")) return harness_help(std::cout), kExitOk;
    if (!o.has("dir")) throw UsageError("--dir DIR is required");
    g::l3_export_inputs(split_commas(o.text("case")), o.text("dir"), std::cout);
    return kExitOk;
  }
  if (sub == "--help" || sub == "-h" || sub == "help") return harness_help(std::cout), kExitOk;
  throw UsageError("unknown harness '" + sub + "' (rollout-vs-trainer, l3, l3-check, l3-export)");
}

// ---------------------------------------------------------------------------------------------

void main_help(std::ostream& os) {
  os << "usage: detlogp <command> [options]\n\n"
        "commands:\n"
        "  info      version, contract and frozen constants, backends, provenance\n"
        "  run       compute logp/lse (and logits) for a built-in problem or a file; prints a SHA-256\n"
        "  verify    run the validation ladder (L1, L2, serving/trainer, TP, padding) on one backend;\n"
        "            --golden replays the golden fingerprints\n"
        "  harness   L3 two-engine check and the L4/L5 rollout-vs-trainer harness (docs/validation.md)\n"
        "  help      this text; `detlogp <command> --help` for a command's options\n\n"
        "exit codes: 0 ok, 1 a check failed, 2 usage error, 3 error (bad input, refused backend or env)\n";
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> all_args(argv + 1, argv + argc);
  if (all_args.empty()) {
    main_help(std::cerr);
    return kExitUsage;
  }
  const std::string command = all_args[0];
  const std::vector<std::string> args(all_args.begin() + 1, all_args.end());
  try {
    if (command == "help" || command == "--help" || command == "-h") {
      main_help(std::cout);
      return kExitOk;
    }
    if (command == "--version") {
      std::cout << "detlogp " << detlogp::version_string() << "\n";
      return kExitOk;
    }
    struct Command {
      const std::vector<OptionSpec>* specs;
      void (*help)(std::ostream&);
      int (*body)(const Options&);
    };
    const std::map<std::string, Command> commands = {
        {"info", {&kInfoOptions, info_help, command_info}},
        {"run", {&kRunOptions, run_help, command_run}},
        {"verify", {&kVerifyOptions, verify_help, command_verify}},
    };
    if (command == "harness") {
      try {
        if (args.empty()) throw UsageError("harness needs a subcommand (rollout-vs-trainer, l3, l3-check, l3-export)");
        return command_harness(args[0], {args.begin() + 1, args.end()});
      } catch (const UsageError& e) {
        std::cerr << "detlogp harness: usage error: " << e.what() << "\n(see `detlogp harness --help`)\n";
        return kExitUsage;
      }
    }
    const auto it = commands.find(command);
    if (it == commands.end()) throw UsageError("unknown command '" + command + "'");
    try {
      const Options options(args, *it->second.specs);
      if (options.flag("help")) {
        it->second.help(std::cout);
        return kExitOk;
      }
      return it->second.body(options);
    } catch (const UsageError& e) {
      std::cerr << "detlogp " << command << ": usage error: " << e.what() << "\n(see `detlogp " << command
                << " --help`)\n";
      return kExitUsage;
    }
  } catch (const UsageError& e) {
    std::cerr << "detlogp: usage error: " << e.what() << "\n";
    main_help(std::cerr);
    return kExitUsage;
  } catch (const detlogp::Error& e) {
    std::cerr << "detlogp " << command << ": error: " << e.what() << "\n";
    return kExitError;
  } catch (const std::exception& e) {
    std::cerr << "detlogp " << command << ": error: " << e.what() << "\n";
    return kExitError;
  }
}

#include "cli/options.hpp"

#include <charconv>
#include <cstdlib>
#include <optional>
#include <sstream>

namespace detlogp::cli {

Options::Options(const std::vector<std::string>& args, const std::vector<OptionSpec>& specs) {
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

std::string Options::text(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

namespace {

// The whole of `v` as a T, or a UsageError naming the option and what it should be.
template <class T>
T parse_value(const std::string& name, const std::string& v, const char* should_be) {
  T out{};
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || v.empty())
    throw UsageError("--" + name + "=" + v + " is not " + should_be);
  return out;
}

}  // namespace

int64_t Options::integer(const std::string& name, int64_t fallback, int64_t min_value, int64_t max_value) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const int64_t out = parse_value<int64_t>(name, it->second, "an integer");
  if (out < min_value || out > max_value)
    throw UsageError("--" + name + "=" + it->second + " is out of range [" + std::to_string(min_value) + ", " +
                     std::to_string(max_value) + "]");
  return out;
}

double Options::real(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& v = it->second;
  double out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec == std::errc::result_out_of_range && end == v.data() + v.size())
    return std::strtod(v.c_str(), nullptr);  // the same text, well-formed: +-HUGE_VAL or a tiny value
  return parse_value<double>(name, v, "a number");
}

namespace {

struct OptionRow {
  const char* command;
  OptionSpec spec;
};

// Every command's options, in the order its --help lists them.
const OptionRow kOptionRows[] = {
    {"info", "backend", true, "show which backend this id resolves to (default: env DETLOGP_BACKEND, else auto)"},
    {"info", "strict", false, "resolve in strict mode (contract-bearing backends only)"},
    {"run", "input", true, "problem file (.safetensors): hidden, weight, targets, optional bias, temperature"},
    {"run", "hidden", true, ".npy input instead of --input: hidden [N, D] bf16 ('<u2' bit patterns)"},
    {"run", "weight", true, ".npy input: weight [V_local, D] bf16"},
    {"run", "targets", true, ".npy input: targets [N] (or [N, K]: K ids a row, logp [N, K]) '<i4' or '<i8'"},
    {"run", "bias", true, ".npy input: optional bias [V_local] '<f4'"},
    {"run", "temperatures", true, ".npy input: optional temperature, scalar () or [N] '<f4'"},
    {"run", "rows", true, "synthetic problem: N (default 64)"},
    {"run", "dim", true, "synthetic problem: D (default 1024)"},
    {"run", "vocab", true, "synthetic problem: weight rows V_local (default 32000)"},
    {"run", "seed", true, "synthetic problem: generator seed (default 0)"},
    {"run", "with-bias", false, "synthetic problem: add a random fp32 bias"},
    {"run", "real-vocab", true, "V_real: ids >= V_real are padding (default vocab_start + V_local)"},
    {"run", "vocab-start", true, "global id of weight row 0, any id >= 0 (default 0)"},
    {"run", "partials", false,
     "the weight is a vocabulary shard: output its tensor-parallel partials (needs --vocab-start, --real-vocab)"},
    {"run", "temperature", true, "scalar temperature T (default 1; docs/contract.md gives the valid range)"},
    {"run", "ignore-index", true, "target id whose row gets logp = +0.0 (default -100)"},
    {"run", "return-logits", false, "serving entry: also output logits [N, V_local] f32"},
    {"run", "entropy", false,
     "also output each row's entropy [N] f32 (docs/contract.md section 10; backends without it refuse it)"},
    {"run", "topk", true,
     "also output the K real ids of the largest logits and their logp: topk_ids [N, K] i64, topk_logp [N, K] f32 "
     "(1 <= K <= 128; docs/contract.md section 11)"},
    {"run", "backend", true, "backend id (default: env DETLOGP_BACKEND, else auto); see `detlogp info`"},
    {"run", "strict", false, "contract-bearing backends only, no fallback (also env DETLOGP_STRICT=1)"},
    {"run", "repeat", true, "run K times, check every run gives the same bits, report the best time (default 1)"},
    {"run", "out", true,
     "write the outputs to FILE.safetensors (atomically: nothing on error; missing directories are created)"},
    {"verify", "backend", true, "backend id to verify (default: env DETLOGP_BACKEND, else auto)"},
    {"verify", "strict", false, "contract-bearing backends only, no fallback (also env DETLOGP_STRICT=1)"},
    {"verify", "seed", true, "generator seed of the built-in problem (default 0)"},
    {"verify", "dim", true, "D of the built-in problem (default 256)"},
    {"verify", "vocab", true, "real vocabulary of the built-in problem (default 2053, not a multiple of 64)"},
    {"verify", "golden", false, "replay the golden cases against the fingerprints file instead of the ladder"},
    {"verify", "golden-file", true, "fingerprints file (default: the source tree's tests/golden/fingerprints.tsv)"},
    {"verify", "record", false,
     "with --golden: append the fingerprints not yet recorded for this (arch, cc); creates the file if missing"},
    {"verify", "case", true, "with --golden: only these cases (comma-separated names)"},
    {"harness rollout-vs-trainer", "seqs", true, "sequences (default 16)"},
    {"harness rollout-vs-trainer", "max-len", true, "longest sequence, tokens (default 12); lengths are 1..max-len"},
    {"harness rollout-vs-trainer", "max-batch", true, "continuous batching: most sequences per step (default 8)"},
    {"harness rollout-vs-trainer", "d", true, "hidden size D (default 1024)"},
    {"harness rollout-vs-trainer", "v", true, "lm_head rows, padding included (default 2053)"},
    {"harness rollout-vs-trainer", "real-vocab", true, "real vocabulary, ids >= it are padding (default --v)"},
    {"harness rollout-vs-trainer", "tp", true, "trainer tensor-parallel degree (default 2)"},
    {"harness rollout-vs-trainer", "cp", true,
     "trainer context-parallel degree: packed rows split into CP groups (default 1)"},
    {"harness rollout-vs-trainer", "rollout-tp", true,
     "rollout engine tensor-parallel degree, serving entry (default 1)"},
    {"harness rollout-vs-trainer", "devices", true,
     "CUDA devices for the TP ranks, e.g. 0,1 (real NCCL); default: in-process host ranks"},
    {"harness rollout-vs-trainer", "seed", true, "generator seed (default 0)"},
    {"harness rollout-vs-trainer", "backend", true, "backend of both sides (default: env DETLOGP_BACKEND, else auto)"},
    {"harness rollout-vs-trainer", "strict", false, "contract-bearing backends only, no fallback"},
    {"harness rollout-vs-trainer", "sampling", false,
     "sample with the program sample/v1 (per-sequence T, top-k, top-p, min-p); the trainer replays it"},
    {"harness rollout-vs-trainer", "perturb-trainer-weight", false,
     "flip one bit of the trainer's weight: the fingerprints must differ"},
    {"harness rollout-vs-trainer", "out", true, "directory for report.json and report.md (created if missing)"},
    {"harness l3", "side", true, "trainer (packed, vocab-parallel, trainer entry) or rollout (one row, serving entry)"},
    {"harness l3", "out", true, "result file FILE.safetensors (format detlogp-l3-v1; missing directories are created)"},
    {"harness l3", "tp", true, "trainer side: vocabulary shards (default 2)"},
    {"harness l3", "case", true, "only these golden cases (comma-separated; default all)"},
    {"harness l3", "backend", true, "backend id (default: env DETLOGP_BACKEND, else auto)"},
    {"harness l3", "strict", false, "contract-bearing backends only, no fallback"},
    {"harness l3-check", "a", true, "one side's result file"},
    {"harness l3-check", "b", true, "the other side's result file"},
    {"harness l3-export", "dir", true,
     "directory for <case>.safetensors (the `detlogp run --input` format; created if missing)"},
    {"harness l3-export", "case", true, "only these golden cases (comma-separated; default all)"},
};

}  // namespace

const std::vector<OptionSpec>& command_options(const std::string& command) {
  static const std::map<std::string, std::vector<OptionSpec>> kByCommand = [] {
    std::map<std::string, std::vector<OptionSpec>> by_command;
    for (const OptionRow& row : kOptionRows) by_command[row.command].push_back(row.spec);
    for (auto& [name, specs] : by_command) specs.push_back({"help", false, "this text"});
    return by_command;
  }();
  const auto it = kByCommand.find(command);
  if (it == kByCommand.end()) throw std::logic_error("no option table for the command '" + command + "'");
  return it->second;
}

void print_option_help(std::ostream& os, const std::vector<OptionSpec>& specs) {
  for (const OptionSpec& s : specs) {
    std::string left = "  --" + s.name + (s.takes_value ? " VALUE" : "");
    if (left.size() < 26) left.append(26 - left.size(), ' ');
    os << left << " " << s.help << "\n";
  }
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

CallOptions call_options(const Options& o) {
  CallOptions opt;
  opt.backend = o.text("backend");
  opt.strict = o.flag("strict");
  return opt;
}

}  // namespace detlogp::cli

#include "cli/options.hpp"

#include <charconv>
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

float Options::real(const std::string& name, float fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : parse_value<float>(name, it->second, "a number");
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

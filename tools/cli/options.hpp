// Command-line options of the `detlogp` tool: "--name value", "--name=value" and boolean "--flag".
// One table (options.cpp) lists what each command accepts, so a misspelled option is an error
// instead of being ignored. Also the exit codes and the usage error every command reports through.
#pragma once

#include <cstdint>
#include <map>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "detlogp/detlogp.hpp"

namespace detlogp::cli {

// 0 success; 1 a check failed (verify, or run --repeat saw differing bits); 2 usage error (unknown
// command or option, bad option value); 3 error (invalid input file or values, a backend refused
// by strict mode, a rejected DETLOGP_* variable, a failed write).
constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitError = 3;

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct OptionSpec {
  std::string name;
  bool takes_value;
  std::string help;
};

class Options {
 public:
  // Throws UsageError for an unknown, repeated or malformed option.
  Options(const std::vector<std::string>& args, const std::vector<OptionSpec>& specs);

  bool flag(const std::string& name) const { return flags_.count(name) > 0; }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string text(const std::string& name, const std::string& fallback = "") const;
  // The value as an integer in [min_value, max_value], or `fallback` when the option is absent.
  int64_t integer(const std::string& name, int64_t fallback, int64_t min_value, int64_t max_value) const;
  // A decimal number as a double; one beyond the double range is +-inf or 0 (as Python's float()
  // reads it), for the caller's range check to name.
  double real(const std::string& name, double fallback) const;

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> flags_;
};

// The options of `command` ("info", "run", "verify", "harness l3", ...) in the order its --help
// lists them, --help last.
const std::vector<OptionSpec>& command_options(const std::string& command);

// One line per option: "  --name VALUE" padded to 26 columns, then the help text.
void print_option_help(std::ostream& os, const std::vector<OptionSpec>& specs);

// The non-empty items of a comma-separated list.
std::vector<std::string> split_commas(const std::string& s);

// --backend and --strict as the library's call options.
CallOptions call_options(const Options& o);

}  // namespace detlogp::cli

// The `detlogp` command line tool: info, run, verify, harness (docs/cli.md). Exit codes in
// options.hpp.
#include <iostream>
#include <map>

#include "cli/commands.hpp"

namespace {

using namespace detlogp::cli;

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

int harness(const std::vector<std::string>& args) {
  try {
    if (args.empty()) throw UsageError("harness needs a subcommand (rollout-vs-trainer, l3, l3-check, l3-export)");
    return command_harness(args[0], {args.begin() + 1, args.end()});
  } catch (const UsageError& e) {
    std::cerr << "detlogp harness: usage error: " << e.what() << "\n(see `detlogp harness --help`)\n";
    return kExitUsage;
  }
}

int dispatch(const std::string& command, const std::vector<std::string>& args) {
  if (command == "help" || command == "--help" || command == "-h") {
    main_help(std::cout);
    return kExitOk;
  }
  if (command == "--version") {
    std::cout << "detlogp " << detlogp::version_string() << "\n";
    return kExitOk;
  }
  if (command == "harness") return harness(args);
  const std::map<std::string, const Command*> commands = {
      {"info", &kInfoCommand},
      {"run", &kRunCommand},
      {"verify", &kVerifyCommand},
  };
  const auto it = commands.find(command);
  if (it == commands.end()) throw UsageError("unknown command '" + command + "'");
  const Command& c = *it->second;
  try {
    const Options options(args, command_options(command));
    if (options.flag("help")) {
      c.help(std::cout);
      return kExitOk;
    }
    return c.body(options);
  } catch (const UsageError& e) {
    std::cerr << "detlogp " << command << ": usage error: " << e.what() << "\n(see `detlogp " << command
              << " --help`)\n";
    return kExitUsage;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> all_args(argv + 1, argv + argc);
  if (all_args.empty()) {
    main_help(std::cerr);
    return kExitUsage;
  }
  const std::string command = all_args[0];
  try {
    return dispatch(command, {all_args.begin() + 1, all_args.end()});
  } catch (const UsageError& e) {
    std::cerr << "detlogp: usage error: " << e.what() << "\n";
    main_help(std::cerr);
    return kExitUsage;
  } catch (const std::exception& e) {  // detlogp::Error (invalid input, refused backend) and the rest
    std::cerr << "detlogp " << command << ": error: " << e.what() << "\n";
    return kExitError;
  }
}

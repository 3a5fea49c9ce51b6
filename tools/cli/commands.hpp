// The `detlogp` tool's commands (docs/cli.md). main.cpp dispatches to these.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "cli/options.hpp"

namespace detlogp::cli {

// A command that takes options (command_options(its name)): its --help text and its body.
struct Command {
  void (*help)(std::ostream&);
  int (*body)(const Options&);
};

extern const Command kInfoCommand;    // detlogp info
extern const Command kRunCommand;     // detlogp run
extern const Command kVerifyCommand;  // detlogp verify, and verify --golden

// detlogp verify --golden: the golden cases against the fingerprints file.
int command_verify_golden(const Options& o);

// detlogp harness <sub> [options]: rollout-vs-trainer, l3, l3-check, l3-export.
int command_harness(const std::string& sub, const std::vector<std::string>& args);

}  // namespace detlogp::cli

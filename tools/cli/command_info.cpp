// detlogp info: version, contract and frozen constants, backends, and what serves a call.
#include <algorithm>
#include <iostream>

#include "cli/bits.hpp"
#include "cli/commands.hpp"
#include "cli/compute.hpp"

namespace detlogp::cli {

namespace {

void info_help(std::ostream& os) {
  os << "usage: detlogp info [--backend ID] [--strict]\n\n"
        "Prints the version, the contract and its frozen constants, the backends of this build\n"
        "(contract-bearing or not, available here or why not) and the provenance of the backend a\n"
        "call with these options is served by (found by running a 1x1x1 problem).\n\n";
  print_option_help(os, command_options("info"));
}

int command_info(const Options& o) {
  check_environment();
  std::cout << "detlogp " << version_string() << "\n";
  std::cout << "contract: " << kContractName << " v" << kContractVersion << "\n";
  std::cout << "frozen constants (bit-relevant; changing one needs a contract version bump):\n";
  const std::vector<std::pair<std::string, std::string>> constants = {
      {"CONTRACT_VERSION", std::to_string(kContractVersion)},
      {"VOCAB_TILE", std::to_string(kVocabTile)},
      {"TILE_TREE_LEVELS", std::to_string(kTileTreeLevels)},
      {"K_SLAB", std::to_string(kKSlab)},
      {"TREE_ID", kTreeId},
      {"TRANSCENDENTAL_ID", kTranscendentalId},
      {"N_SPLIT_POLICY", kNSplitPolicy},
      {"TEMPERATURE_ID", kTemperatureId},
      {"ENTROPY_ID", kEntropyId},
      {"DEFAULT_IGNORE_INDEX", std::to_string(kDefaultIgnoreIndex)},
      {"CANONICAL_NAN", hex32(kCanonicalNanBits)},
  };
  for (const auto& [name, value] : constants) {
    std::string left = "  " + name;
    left.append(24 - std::min<size_t>(24, left.size()), ' ');
    std::cout << left << value << "\n";
  }
  std::cout << "backends:\n";
  for (const BackendInfo& b : list_backends()) {
    std::string left = "  " + b.id;
    left.append(44 - std::min<size_t>(44, left.size()), ' ');
    std::cout << left << (b.contract_bearing ? "contract-bearing  " : "non-contract      ")
              << (b.available ? "available" : "unavailable") << (b.detail.empty() ? "" : ": " + b.detail) << "\n";
  }
  // The readback: what actually serves a call with these options.
  const uint16_t one_bf16 = 0x3F80;
  const int64_t target = 0;
  float logp = 0, lse = 0;
  LinearLogpInputs in;
  in.hidden = TensorView::matrix(&one_bf16, DType::bf16, 1, 1);
  in.weight = TensorView::matrix(&one_bf16, DType::bf16, 1, 1);
  in.targets = TensorView::vector(&target, DType::i64, 1);
  const CallReport report =
      linear_logp(in, {mutable_vector(&logp, DType::f32, 1), mutable_vector(&lse, DType::f32, 1), {}}, call_options(o));
  std::cout << "served by: " << describe_report(report) << "\n";
  std::cout << "provenance: " << to_string(report.provenance) << "\n";
  return kExitOk;
}

}  // namespace

const Command kInfoCommand{info_help, command_info};

}  // namespace detlogp::cli

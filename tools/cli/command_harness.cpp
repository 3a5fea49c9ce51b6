// detlogp harness: validation ladder L3 (two engines, two processes) and L4/L5 (rollout vs trainer).
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <span>
#include <sstream>

#include "cli/commands.hpp"
#include "detlogp/dist.hpp"
#include "golden/harness.hpp"
#include "io/file.hpp"

namespace detlogp::cli {

namespace {

namespace g = golden;

void harness_help(std::ostream& os) {
  os << "usage: detlogp harness rollout-vs-trainer [--seqs S] [--max-len L] [--max-batch B] [--d D] [--v V]\n"
        "                          [--real-vocab R] [--tp P] [--cp C] [--rollout-tp P] [--devices 0,1,..]\n"
        "                          [--seed S] [--sampling] [--strict] [--backend ID] --out DIR\n"
        "       detlogp harness l3 --side trainer|rollout --out FILE.safetensors [--tp P] [--case A,B]\n"
        "       detlogp harness l3-check --a FILE --b FILE\n"
        "       detlogp harness l3-export --dir DIR [--case A,B]\n\n"
        "rollout-vs-trainer (L4/L5): a synthetic rollout with continuous batching and a sampler on the\n"
        "serving entry's fp32 logits, then a packed TP trainer recomputation at the same weight\n"
        "fingerprint (--sampling: the rollout draws with the sampling program sample/v1 at per-sequence T,\n"
        "top-k, top-p and min-p, the trainer replays it, the control is an engine's own sampler); writes\n"
        "DIR/report.json and DIR/report.md. Exit 0 when every logp metric is exactly\n"
        "zero with no fallback, so is every entropy metric (where the trainer's backend serves the\n"
        "entropy output; the report says when not), and the bf16-logits negative control drifts; 1\n"
        "otherwise (also when the weight fingerprints differ, which is reported and never compared).\n"
        "l3 / l3-check (L3): each side runs the golden inputs in its own process and writes a file; the\n"
        "check compares logp and lse bytes case by case. l3-export writes the inputs for an external side.\n\n"
        "rollout-vs-trainer options:\n";
  print_option_help(os, command_options("harness rollout-vs-trainer"));
  os << "\nl3 options:\n";
  print_option_help(os, command_options("harness l3"));
  os << "\nexit codes: 0 ok, 1 a check failed, 2 usage error, 3 error\n";
}

// --devices 0,1,..: one CUDA device per rank of the larger TP degree.
std::vector<int> device_list(const Options& o, size_t ranks) {
  std::vector<int> devices;
  std::stringstream list(o.text("devices"));
  for (std::string item; std::getline(list, item, ',');) {
    char* end = nullptr;
    const long d = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || d < 0 || d > 1023)
      throw UsageError("--devices takes CUDA device numbers separated by commas, got '" + o.text("devices") + "'");
    devices.push_back(static_cast<int>(d));
  }
  if (devices.size() < ranks)
    throw UsageError("--devices lists " + std::to_string(devices.size()) + " devices; TP=" + std::to_string(ranks) +
                     " needs one per rank");
  return devices;
}

int rollout_vs_trainer(const Options& o) {
  check_environment();
  if (!o.has("out")) throw UsageError("--out DIR is required");
  g::HarnessConfig cfg;
  cfg.seqs = o.integer("seqs", 16, 1, 4096);
  cfg.max_len = o.integer("max-len", 12, 1, 1 << 16);
  cfg.max_batch = o.integer("max-batch", 8, 1, 4096);
  cfg.dim = o.integer("d", 1024, 1, 1 << 16);
  cfg.weight_rows = o.integer("v", 2053, 1, 1 << 22);
  cfg.real_vocab = o.integer("real-vocab", cfg.weight_rows, 1, cfg.weight_rows);
  cfg.tp = static_cast<int>(o.integer("tp", 2, 1, kMaxTensorParallelRanks));
  cfg.cp = static_cast<int>(o.integer("cp", 1, 1, 1024));
  cfg.rollout_tp = static_cast<int>(o.integer("rollout-tp", 1, 1, kMaxTensorParallelRanks));
  if (o.has("devices")) cfg.devices = device_list(o, static_cast<size_t>(std::max(cfg.tp, cfg.rollout_tp)));
  cfg.seed = static_cast<uint64_t>(o.integer("seed", 0, 0, INT64_MAX));
  cfg.perturb_trainer_weight = o.flag("perturb-trainer-weight");
  cfg.sampling = o.flag("sampling");
  cfg.rollout_opt = cfg.trainer_opt = call_options(o);
  const std::filesystem::path dir = o.text("out");
  for (const char* name : {"report.json", "report.md"}) io::check_output_file(dir / name);
  const g::HarnessResult r = g::run_rollout_vs_trainer(cfg, std::cout);
  for (const auto& [name, text] : {std::pair{"report.json", &r.json}, {"report.md", &r.markdown}}) {
    io::write_file_atomically(dir / name, std::span(reinterpret_cast<const uint8_t*>(text->data()), text->size()));
    std::cout << "wrote: " << (dir / name).string() << "\n";
  }
  // The entropy row counts like the logp row where it was compared; where the trainer's backend
  // serves no entropy output the verdict says so.
  const bool entropy_ok = !r.entropy_compared || r.entropy_exact;
  const std::string entropy = r.entropy_compared ? "entropy exact zero" : "entropy not compared: " + r.entropy_note;
  std::cout << "verdict: "
            << (!r.compared ? "FAIL (weight fingerprints differ: not compared)"
                : r.exact && entropy_ok && r.control_drift
                    ? "PASS (logp exact zero; " + entropy + "; negative control drifts)"
                : !r.exact    ? "FAIL (logp not exactly zero, or a fallback was observed)"
                : !entropy_ok ? "FAIL (entropy not exactly zero, or a fallback was observed)"
                              : "FAIL (the negative control showed no drift)")
            << "\n";
  return r.compared && r.exact && entropy_ok && r.control_drift ? kExitOk : kExitCheckFailed;
}

int l3_side(const Options& o) {
  check_environment();
  const std::string side = o.text("side");
  if (side != "trainer" && side != "rollout") throw UsageError("--side must be trainer or rollout");
  if (!o.has("out") || std::filesystem::path(o.text("out")).extension() != ".safetensors")
    throw UsageError("--out FILE.safetensors is required");
  io::check_output_file(o.text("out"));
  g::l3_run_side(side == "trainer" ? g::L3Side::trainer : g::L3Side::rollout, split_commas(o.text("case")),
                 static_cast<int>(o.integer("tp", 2, 1, kMaxTensorParallelRanks)), call_options(o), o.text("out"),
                 std::cout);
  return kExitOk;
}

int l3_check(const Options& o) {
  if (!o.has("a") || !o.has("b")) throw UsageError("--a FILE and --b FILE are required");
  return g::l3_check(o.text("a"), o.text("b"), std::cout) ? kExitOk : kExitCheckFailed;
}

int l3_export(const Options& o) {
  if (!o.has("dir")) throw UsageError("--dir DIR is required");
  g::l3_export_inputs(split_commas(o.text("case")), o.text("dir"), std::cout);
  return kExitOk;
}

}  // namespace

int command_harness(const std::string& sub, const std::vector<std::string>& args) {
  struct Harness {
    const char* name;
    int (*body)(const Options&);
  };
  static const Harness kHarnesses[] = {
      {"rollout-vs-trainer", rollout_vs_trainer},
      {"l3", l3_side},
      {"l3-check", l3_check},
      {"l3-export", l3_export},
  };
  for (const Harness& h : kHarnesses) {
    if (sub != h.name) continue;
    const Options o(args, command_options(std::string("harness ") + h.name));
    if (o.flag("help")) return harness_help(std::cout), kExitOk;
    return h.body(o);
  }
  if (sub == "--help" || sub == "-h" || sub == "help") return harness_help(std::cout), kExitOk;
  throw UsageError("unknown harness '" + sub + "' (rollout-vs-trainer, l3, l3-check, l3-export)");
}

}  // namespace detlogp::cli

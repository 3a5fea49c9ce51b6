// detlogp verify --golden: every golden case's fingerprints against the file, keyed by
// (contract version, arch, cc) of the backend that served; "inputs" rows are keyed (any, -).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <system_error>

#include "cli/commands.hpp"
#include "cli/compute.hpp"
#include "golden/goldens.hpp"
#include "io/file.hpp"

namespace detlogp::cli {

namespace {

namespace g = golden;

// The case names --case lists, each checked against the golden cases.
std::vector<std::string> selected_cases(const Options& o) {
  const std::vector<std::string> only = split_commas(o.text("case"));
  for (const std::string& name : only) {
    bool known = false;
    for (const g::GoldenCase& c : g::golden_cases()) known |= c.name == name;
    if (!known) throw UsageError("--case: unknown golden case '" + name + "'");
  }
  return only;
}

void append_records(const std::string& path, const std::vector<std::string>& new_lines) {
  const bool fresh = !std::filesystem::exists(path);
  if (fresh) io::ensure_directory(std::filesystem::absolute(path).parent_path());
  std::ofstream f(path, std::ios::app);
  DETLOGP_CHECK(f, "cannot append to '" << path << "'");
  if (fresh) f << "# contract_version\tarch\tcc\tcase\tscope\tsha256 (docs/validation.md)\n";
  for (const std::string& line : new_lines) {
    f << line << "\n";
    std::cout << "recorded: " << line << "\n";
  }
  DETLOGP_CHECK(f.good(), "failed writing '" << path << "'");
}

}  // namespace

int command_verify_golden(const Options& o) {
  check_environment();
  if (o.has("seed") || o.has("dim") || o.has("vocab"))
    throw UsageError("--seed/--dim/--vocab shape the ladder's problem; the golden cases are fixed");
  const std::string path = o.text("golden-file", DETLOGP_GOLDEN_FILE);
  // A file that is not there yet is an empty table (--record starts it); anything else must read.
  std::error_code ec;
  const bool present = std::filesystem::exists(std::filesystem::symlink_status(path, ec));
  if (present) io::check_input_file(path);
  if (o.flag("record")) io::check_output_file(path);
  const auto table = g::read_fingerprints(path);
  const CallOptions opt = call_options(o);
  const std::vector<std::string> only = selected_cases(o);
  std::cout << "detlogp verify --golden: " << path << " ("
            << (present ? std::to_string(table.size()) + " entries" : std::string("no such file: 0 entries")) << ")\n";
  int pass = 0, fail = 0, missing = 0, missing_entropy = 0;
  std::vector<std::string> new_lines;
  std::string served;
  for (const g::GoldenCase& c : g::golden_cases()) {
    if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
    g::CaseResult r;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      r = g::run_case(g::make_inputs(c), opt);
    } catch (const Error& e) {
      std::cout << "  " << c.name << "  FAIL  error: " << e.what() << "\n";
      ++fail;
      continue;
    }
    const double ms = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
    if (served.empty()) {
      served = describe_report(r.report);
      std::cout << "served by: " << served << "\nprovenance: " << to_string(r.report.provenance) << "\n";
      const Provenance& p = r.report.provenance;
      int64_t recorded_entropy = 0;
      for (const auto& [k, sha] : table)
        recorded_entropy += k.scope == "entropy" && k.contract_version == p.contract_version && k.arch == p.arch &&
                            k.cc == std::to_string(p.cc);
      // A backend without the entropy output has no entropy fingerprint to replay: said here, so
      // that recorded entropy rows are never passed over in silence.
      if (p.entropy_id.empty())
        std::cout << "entropy: NOT CHECKED: " << p.backend_id << " serves no entropy output (no entropy_id); "
                  << recorded_entropy << " entropy rows recorded for " << p.arch << "/" << p.cc << "\n";
      else
        std::cout << "entropy: checked (entropy_id " << p.entropy_id << "); " << recorded_entropy
                  << " entropy rows recorded for " << p.arch << "/" << p.cc << "\n";
    }
    const Provenance& p = r.report.provenance;
    for (const g::Fingerprint& f : r.fingerprints) {
      const bool any = f.scope == "inputs";
      const g::FingerprintKey key{p.contract_version, any ? "any" : p.arch, any ? "-" : std::to_string(p.cc), c.name,
                                  f.scope};
      const auto it = table.find(key);
      std::string status;
      if (it == table.end()) {
        status = "NOT RECORDED  " + f.sha256;
        ++missing;
        missing_entropy += f.scope == "entropy";
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
  const bool recorded = o.flag("record");
  if (recorded && !new_lines.empty()) append_records(path, new_lines);
  if (!recorded && missing > 0)
    std::cout << "not recorded: " << missing << " fingerprints (" << missing_entropy
              << " of them entropy); --record appends them to " << path << "\n";
  std::cout << "verdict: "
            << (fail > 0                   ? "FAIL"
                : missing > 0 && !recorded ? "NOT RECORDED"
                                           : "PASS")
            << " (" << pass << " pass, " << fail << " fail, " << missing
            << (recorded ? " newly recorded" : " not recorded") << ")\n";
  return fail > 0 || (missing > 0 && !recorded) ? kExitCheckFailed : kExitOk;
}

}  // namespace detlogp::cli

// The DETLOGP_* knob table (free axes accepted, frozen constants refused) and its readers.
#include "core/env.hpp"

#include <cstdlib>
#include <cstring>
#include <string_view>

#include "detlogp/error.hpp"

extern char** environ;

namespace detlogp::detail {
namespace {

// A DETLOGP_* name and what it stands for: a free knob's meaning, or the frozen constant a
// refused name would change.
struct Knob {
  const char* name;
  const char* what;
};
// Free axes only (docs/contract.md §2): they change speed or selection, never bytes.
constexpr Knob kFreeKnobs[] = {
    {"DETLOGP_STRICT", "1: only contract-bearing backends, no fallback"},
    {"DETLOGP_BACKEND", "backend id to use (auto by default)"},
    {"DETLOGP_CPU_THREADS", "worker threads of the CPU backend"},
    {"DETLOGP_SM90_BUCKET", "force an SM90 launch bucket (free axis)"},
    {"DETLOGP_SM90_WORKSPACE_MB", "cap of the SM90 summary workspace in MiB (chunks N)"},
    {"DETLOGP_SM90_GRAD_CLUSTER", "1 or 2: CTAs per cluster of the SM90 grad-logits kernel (free axis)"},
    {"DETLOGP_TP_WORKSPACE_MB", "cap of the tensor-parallel gather buffer in MiB (chunks N)"},
    {"DETLOGP_TORCH_FUSED_BACKWARD", "0: detlogp.torch's backward keeps the torch chunk loop (no fused grad kernel)"},
};

// Names someone may try in order to change a frozen constant; each is refused with the reason.
constexpr Knob kFrozenKnobs[] = {
    {"DETLOGP_VOCAB_TILE", "VOCAB_TILE=64"},
    {"DETLOGP_K_SLAB", "K_SLAB=32"},
    {"DETLOGP_BLOCK_K", "the ascending K walk (K_SLAB=32)"},
    {"DETLOGP_SPLIT_K", "the ascending K walk (no split-K)"},
    {"DETLOGP_N_SPLIT", "the n_split policy (per-tile summaries, no cross-split fold)"},
    {"DETLOGP_TREE", "the in-tile tree (adjacent-pairwise over 64 lanes)"},
    {"DETLOGP_TREE_ID", "the in-tile tree (adjacent-pairwise over 64 lanes)"},
    {"DETLOGP_TRANSCENDENTAL", "the transcendentals expc/logc"},
    {"DETLOGP_TEMPERATURE_MODE", "the temperature formulation y = fl(z * fl(1/T))"},
    {"DETLOGP_CLAMP", "the output clamp logp = min(y_t - lse, 0)"},
    {"DETLOGP_CONTRACT_VERSION", "the contract version 1"},
};

std::string_view name_of(const char* entry) {
  const char* eq = std::strchr(entry, '=');
  return eq ? std::string_view(entry, static_cast<size_t>(eq - entry)) : std::string_view(entry);
}

}  // namespace

void check_environment() {
  for (char** e = environ; e && *e; ++e) {
    const std::string_view name = name_of(*e);
    if (name.substr(0, 8) != "DETLOGP_") continue;
    bool known = false;
    for (const auto& k : kFreeKnobs) known = known || name == k.name;
    if (known) continue;
    for (const auto& f : kFrozenKnobs)
      DETLOGP_CHECK(name != f.name, "environment variable "
                                        << *e << " tries to change a frozen contract constant (" << f.what
                                        << "); frozen constants change only with a contract version bump");
    std::string free_list;
    for (const auto& k : kFreeKnobs) free_list += std::string(free_list.empty() ? "" : ", ") + k.name;
    DETLOGP_FAIL("unknown detlogp environment variable " << *e << "; the settable knobs are: " << free_list);
  }
  if (auto v = env_value("DETLOGP_STRICT"))
    DETLOGP_CHECK(*v == "0" || *v == "1", "DETLOGP_STRICT=" << *v << " must be 0 or 1");
  if (auto v = env_value("DETLOGP_TORCH_FUSED_BACKWARD"))
    DETLOGP_CHECK(*v == "0" || *v == "1", "DETLOGP_TORCH_FUSED_BACKWARD=" << *v << " must be 0 or 1");
  if (auto v = env_value("DETLOGP_CPU_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(v->c_str(), &end, 10);
    DETLOGP_CHECK(!v->empty() && *end == '\0' && n >= 1 && n <= 4096,
                  "DETLOGP_CPU_THREADS=" << *v << " must be an integer in [1, 4096]");
  }
  (void)env_tp_workspace_mib();
}

int64_t env_tp_workspace_mib() {
  const auto v = env_value("DETLOGP_TP_WORKSPACE_MB");
  if (!v || v->empty()) return 256;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  DETLOGP_CHECK(*end == '\0' && n >= 1 && n <= (1 << 20),
                "DETLOGP_TP_WORKSPACE_MB=" << *v << " must be an integer in [1, 1048576] (MiB)");
  return n;
}

std::optional<std::string> env_value(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

bool env_strict() { return env_value("DETLOGP_STRICT").value_or("0") == "1"; }

std::string env_backend() { return env_value("DETLOGP_BACKEND").value_or(""); }

}  // namespace detlogp::detail

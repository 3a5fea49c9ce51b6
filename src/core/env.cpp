// The DETLOGP_* knob table (free axes accepted with their values checked, frozen constants
// refused) and its readers.
#include "core/env.hpp"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "core/backend.hpp"
#include "detlogp/error.hpp"

extern char** environ;

namespace detlogp::detail {
namespace {

// The lane only detlogp.torch serves (python/detlogp/__init__.py, TORCH_BACKEND_ID): a valid
// DETLOGP_BACKEND for the torch face, which the C++ registry then refuses as not served here.
constexpr const char* kTorchBackendId = "torch-materialized-noncontract";

std::vector<std::string> backend_ids() {
  std::vector<std::string> ids{"auto"};
  for (const Backend* b : all_backends()) ids.push_back(b->id());
  ids.emplace_back(kTorchBackendId);
  return ids;
}

std::vector<std::string> bucket_names() {
  std::vector<std::string> names{"auto"};
  names.insert(names.end(), sm90_bucket_names().begin(), sm90_bucket_names().end());
  return names;
}

// What values a free knob takes: 0 or 1, a decimal integer in [lo, hi], or one of a list.
enum class Kind { flag, integer, choice };

// A free knob: its name, what it sets, and its values.
struct Knob {
  const char* name;
  const char* what;
  Kind kind;
  int64_t lo = 0, hi = 0;  // integer: the accepted range
  const char* unit = "";   // integer: appended to the message
  const char* noun = "";   // choice: what a value names
  std::vector<std::string> (*choices)() = nullptr;
};

// Free axes only (docs/contract.md §2): they change speed or selection, never bytes.
const Knob kFreeKnobs[] = {
    {.name = "DETLOGP_STRICT", .what = "1: only contract-bearing backends, no fallback", .kind = Kind::flag},
    {.name = "DETLOGP_BACKEND",
     .what = "backend id to use (auto by default)",
     .kind = Kind::choice,
     .noun = "a backend id",
     .choices = backend_ids},
    {.name = "DETLOGP_CPU_THREADS",
     .what = "worker threads of the CPU backend",
     .kind = Kind::integer,
     .lo = 1,
     .hi = 4096},
    {.name = "DETLOGP_SM90_BUCKET",
     .what = "force an SM90 launch bucket (free axis)",
     .kind = Kind::choice,
     .noun = "an SM90 launch bucket",
     .choices = bucket_names},
    {.name = "DETLOGP_SM90_WORKSPACE_MB",
     .what = "cap of the SM90 summary workspace in MiB (chunks N)",
     .kind = Kind::integer,
     .lo = 1,
     .hi = 1 << 20,
     .unit = " (MiB)"},
    {.name = "DETLOGP_SM90_GRAD_CLUSTER",
     .what = "1 or 2: CTAs per cluster of the SM90 grad-logits kernel (free axis)",
     .kind = Kind::integer,
     .lo = 1,
     .hi = 2},
    {.name = "DETLOGP_SM90_SAMPLE_RADIX",
     .what = "1: the SM90 sampling kernel finds every cut by radix selection, not from gathered candidates "
             "(free axis)",
     .kind = Kind::flag},
    {.name = "DETLOGP_SM90_TOPK_LOGITS",
     .what = "1: the SM90 top-k output always selects from the serving logits, never from the fused run's "
             "lane-group candidates (free axis)",
     .kind = Kind::flag},
    {.name = "DETLOGP_TP_WORKSPACE_MB",
     .what = "cap of the tensor-parallel gather buffer in MiB (chunks N)",
     .kind = Kind::integer,
     .lo = 1,
     .hi = 1 << 20,
     .unit = " (MiB)"},
    {.name = "DETLOGP_TORCH_FUSED_BACKWARD",
     .what = "0: detlogp.torch's backward keeps the torch chunk loop (no fused grad kernel)",
     .kind = Kind::flag},
    // Read by detlogp.torch.linear_logp_loss; checked here so that garbage is refused by every entry.
    {.name = "DETLOGP_TORCH_LOSS_CHUNK_BYTES",
     .what = "bytes of fp32 logits per row chunk of detlogp.torch.linear_logp_loss (its gradients' rounding "
             "points, never a logp / lse bit)",
     .kind = Kind::integer,
     .lo = 1,
     .hi = int64_t{1} << 40,
     .unit = " (bytes)"},
};

// Names someone may try in order to change a frozen constant; each is refused with the reason.
struct FrozenName {
  const char* name;
  const char* what;
};
constexpr FrozenName kFrozenKnobs[] = {
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

const Knob& knob(std::string_view name) {
  for (const Knob& k : kFreeKnobs)
    if (name == k.name) return k;
  DETLOGP_FAIL("internal error: " << name << " is not a free knob");
}

// A decimal integer (optional '-', no spaces, no '+'), or nullopt.
std::optional<int64_t> parse_integer(const std::string& v) {
  int64_t n = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size()) return std::nullopt;
  return n;
}

// Throws, naming the knob and its value, unless `v` is one of the knob's values.
void check_value(const Knob& k, const std::string& v) {
  switch (k.kind) {
    case Kind::flag:
      DETLOGP_CHECK(v == "0" || v == "1", k.name << "=" << v << " must be 0 or 1");
      return;
    case Kind::integer: {
      const auto n = parse_integer(v);
      DETLOGP_CHECK(n && *n >= k.lo && *n <= k.hi,
                    k.name << "=" << v << " must be an integer in [" << k.lo << ", " << k.hi << "]" << k.unit);
      return;
    }
    case Kind::choice: {
      const std::vector<std::string> values = k.choices();
      for (const std::string& c : values)
        if (v == c) return;
      std::string list;
      for (const std::string& c : values) list += (list.empty() ? "" : ", ") + c;
      DETLOGP_FAIL(k.name << "=" << v << " is not " << k.noun << "; use one of: " << list);
    }
  }
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
  for (const Knob& k : kFreeKnobs) (void)env_checked(k.name);
}

std::optional<std::string> env_value(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

std::optional<std::string> env_checked(const char* name) {
  const Knob& k = knob(name);
  auto v = env_value(name);
  if (v) check_value(k, *v);
  return v;
}

int64_t env_integer(const char* name, int64_t fallback) {
  DETLOGP_CHECK(knob(name).kind == Kind::integer, "internal error: " << name << " is not an integer knob");
  const auto v = env_checked(name);
  return v ? *parse_integer(*v) : fallback;
}

bool env_strict() { return env_checked("DETLOGP_STRICT").value_or("0") == "1"; }

std::string env_backend() { return env_checked("DETLOGP_BACKEND").value_or(""); }

int64_t env_tp_workspace_mib() { return env_integer("DETLOGP_TP_WORKSPACE_MB", 256); }

}  // namespace detlogp::detail

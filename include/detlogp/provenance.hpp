// What served a call, in the terms of the contract (docs/contract.md §1 "Identity and provenance").
#pragma once

#include <cstdint>
#include <string>

namespace detlogp {

struct Provenance {
  std::string contract_name;  // kContractName, or "none" for a non-contract lane
  int contract_version = 0;   // kContractVersion, 0 for a non-contract lane
  std::string backend_id;     // e.g. "cpu-linear-logp-contract-v1"
  std::string arch;           // "cpu" or "sm90a"
  int cc = 0;                 // compute capability (90 on H100/H200); 0 on the CPU
  int vocab_tile = 0;
  int k_slab = 0;
  std::string n_split_policy;
  std::string tree_id;
  std::string transcendental_id;
  std::string temperature_id;
  std::string entropy_id;  // kEntropyId where the backend computes the entropy output, else ""
  std::string sample_id;   // kSampleId where the backend runs the sampling program (§11), else ""
};

// What a call with a sampling program found (docs/contract.md §11.10): the replay's targets that lie
// outside their row's support (their logp is -inf), never silently finite.
struct SamplingReport {
  int64_t outside_support = 0;         // rows (not ignored) whose target is outside the support
  int64_t first_outside_support = -1;  // the first such row, -1 if none
};

// What a call reports back (the "readback" of validation reports).
struct CallReport {
  std::string requested_backend;  // what the caller (or DETLOGP_BACKEND) asked for
  bool strict = false;
  bool fallback = false;  // true when the requested backend could not serve
  std::string fallback_reason;
  Provenance provenance;    // of the backend that served
  SamplingReport sampling;  // calls with a sampling program; zeros otherwise
};

std::string to_string(const Provenance& p);

}  // namespace detlogp

// What served a call, in the terms of the contract (docs/contract.md §1 "Identity and provenance").
#pragma once

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
};

// What a call reports back (the "readback" of validation reports).
struct CallReport {
  std::string requested_backend;  // what the caller (or DETLOGP_BACKEND) asked for
  bool strict = false;
  bool fallback = false;  // true when the requested backend could not serve
  std::string fallback_reason;
  Provenance provenance;  // of the backend that served
};

std::string to_string(const Provenance& p);

}  // namespace detlogp

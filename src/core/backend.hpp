// The interface every backend implements; the registry (src/registry) selects among them.
#pragma once

#include <array>
#include <string>

#include "core/problem.hpp"
#include "core/sample.hpp"
#include "detlogp/config.hpp"
#include "detlogp/error.hpp"
#include "detlogp/provenance.hpp"

namespace detlogp::detail {

// Provenance of a backend bearing contract v1: the frozen ids plus its own arch and cc, the
// entropy id where the backend computes the entropy output, the sample id where it runs the
// sampling program.
inline Provenance contract_provenance(const char* backend_id, const char* arch, int cc, bool entropy,
                                      bool sample = false) {
  return {kContractName,
          kContractVersion,
          backend_id,
          arch,
          cc,
          kVocabTile,
          kKSlab,
          kNSplitPolicy,
          kTreeId,
          kTranscendentalId,
          kTemperatureId,
          entropy ? kEntropyId : "",
          sample ? kSampleId : ""};
}

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const Provenance& provenance() const = 0;
  const std::string& id() const { return provenance().backend_id; }
  virtual bool contract_bearing() const = 0;
  // Where the problem's tensors must live.
  virtual Memory memory() const = 0;
  // False with a reason when it cannot run here (no GPU, built without CUDA, ...).
  virtual bool available(std::string* why) const = 0;
  virtual bool supports_partials() const { return contract_bearing(); }
  // Whether run() fills LogpProblem::entropy (docs/contract.md §10): its provenance names the id.
  bool supports_entropy() const { return !provenance().entropy_id.empty(); }
  // Whether run_sample runs the sampling program (docs/contract.md §11): its provenance names the id.
  bool supports_sampling() const { return !provenance().sample_id.empty(); }
  // Runs a validated sampling problem (rollout or replay); returns what the replay found.
  virtual SamplingReport run_sample(const SampleProblem& /*problem*/) const {
    DETLOGP_FAIL("backend '" << id() << "' does not run the sampling program");
  }
  // Whether run() takes [N, K] targets with K > 1 (one pass, K logp per row).
  virtual bool supports_multi_targets() const { return false; }
  // Whether run() fills the top-k output (LogpProblem::topk, docs/contract.md §12).
  virtual bool supports_topk() const { return false; }
  // Runs a validated problem. Throws detlogp::Error on failure; writes nothing on bad inputs.
  virtual void run(const LogpProblem& problem) const = 0;
  // Runs a validated problem whose tensors are all in host memory. A device backend stages
  // them to its device and back (used by the CLI and host-side callers); the default runs in place.
  virtual void run_from_host(const LogpProblem& problem) const { run(problem); }
};

// Each backend translation unit defines its accessor; the SM90 one exists in every build and
// reports itself unavailable where CUDA was not compiled in or no SM90 device is present.
const Backend& cpu_contract_backend();
// The SM90 backend's logits on the host (the wgmma model, docs/contract.md §3.1.1); never chosen by
// auto or as a fallback.
const Backend& cpu_sm90_emulated_backend();
const Backend& reference_materialized_backend();
const Backend& sm90_contract_backend();
// Non-contract CUDA lane (cuBLAS GEMM + log-softmax); reports itself unavailable without CUDA.
const Backend& cublas_materialized_backend();

// Every backend, in the order list_backends reports them: the registry selects among them, the
// environment check takes DETLOGP_BACKEND's values from them.
inline std::array<const Backend*, 5> all_backends() {
  return {&sm90_contract_backend(), &cpu_contract_backend(), &cpu_sm90_emulated_backend(),
          &cublas_materialized_backend(), &reference_materialized_backend()};
}

}  // namespace detlogp::detail

#include "registry/registry.hpp"

#include "core/env.hpp"
#include "core/grad_logits.hpp"

namespace detlogp::detail {
namespace {

std::string backend_ids(bool contract_bearing_only = false) {
  std::string ids;
  for (const Backend* b : all_backends())
    if (!contract_bearing_only || b->contract_bearing()) ids += (ids.empty() ? "" : ", ") + b->id();
  return contract_bearing_only ? ids : ids + ", auto";
}

}  // namespace

const Backend& select_backend(const CallOptions& opt, Memory memory, bool partials, bool entropy, CallReport& report,
                              int64_t targets_per_row, int64_t topk, bool sampling) {
  check_environment();
  report.strict = opt.strict || env_strict();
  std::string requested = opt.backend.empty() ? env_backend() : opt.backend;
  if (requested.empty()) requested = "auto";
  report.requested_backend = requested;

  const Backend* chosen = nullptr;
  if (requested == "auto") {
    std::string why;
    const Backend& sm90 = sm90_contract_backend();
    // Host tensors go to the SM90 backend only for what it computes from host memory: the sampling
    // program (CUDA tensors only there) runs on the CPU backend, and so does the top-k output, so
    // that a host-tensor rollout's sample and its top-k logprobs come from the same logits.
    const bool host_served = !sampling && topk == 0;
    if (sm90.available(&why) && (memory == Memory::cuda || host_served)) {
      chosen = &sm90;
    } else {
      DETLOGP_CHECK(memory == Memory::host, "tensors are in CUDA memory but the SM90 backend is unavailable: " << why);
      chosen = &cpu_contract_backend();
    }
  } else {
    for (const Backend* b : all_backends())
      if (b->id() == requested) chosen = b;
    DETLOGP_CHECK(chosen != nullptr, "unknown backend '" << requested << "'; known: " << backend_ids());
    DETLOGP_CHECK(!report.strict || chosen->contract_bearing(),
                  "strict mode refuses backend '"
                      << requested
                      << "': it does not bear the detlogp contract (contract-bearing: " << backend_ids(true) << ")");
    std::string why;
    if (!chosen->available(&why)) {
      DETLOGP_CHECK(!report.strict,
                    "strict mode forbids fallback: requested backend '" << requested << "' is unavailable: " << why);
      DETLOGP_CHECK(memory == Memory::host, "requested backend '" << requested << "' is unavailable (" << why
                                                                  << ") and the tensors are in CUDA memory");
      report.fallback = true;
      report.fallback_reason = "'" + requested + "' unavailable: " + why;
      chosen = &cpu_contract_backend();
    }
  }
  DETLOGP_CHECK(!partials || chosen->supports_partials(),
                "backend '" << chosen->id() << "' cannot produce tensor-parallel partials");
  DETLOGP_CHECK(!entropy || chosen->supports_entropy(),
                "backend '" << chosen->id() << "' does not compute the entropy output (docs/contract.md §10); "
                            << cpu_contract_backend().id() << " does, on host memory");
  DETLOGP_CHECK(!sampling || chosen->supports_sampling(),
                "backend '" << chosen->id()
                            << "' does not run the sampling program (docs/contract.md §11) yet: it is not implemented "
                               "for "
                            << (chosen->memory() == Memory::cuda ? "CUDA tensors" : "this backend") << "; "
                            << cpu_contract_backend().id() << " runs it, on host memory");
  DETLOGP_CHECK(targets_per_row <= 1 || chosen->supports_multi_targets(),
                "backend '" << chosen->id() << "' takes one target per row, but targets has K=" << targets_per_row
                            << " ids per row; " << cpu_contract_backend().id()
                            << " takes [N, K] targets, on host memory (or call once per target column)");
  DETLOGP_CHECK(topk == 0 || chosen->supports_topk(),
                "backend '" << chosen->id() << "' does not compute the top-k output (docs/contract.md §12); "
                            << cpu_contract_backend().id() << " does, on host memory");
  DETLOGP_CHECK(memory == Memory::host || chosen->memory() == memory,
                "backend '" << chosen->id() << "' needs host memory but the tensors are in CUDA memory");
  report.provenance = chosen->provenance();
  return *chosen;
}

void dispatch(const Backend& backend, const LogpProblem& problem) {
  if (backend.memory() == problem.memory)
    backend.run(problem);
  else
    backend.run_from_host(problem);
}

namespace {

// Host memory: the CPU implementation. CUDA memory: the SM90 backend's kernel, one target a row.
template <class Cpu, class Sm90>
void dispatch_grad(const GradLogitsProblem& p, CallReport& report, Cpu&& cpu, Sm90&& sm90_kernel) {
  if (p.memory == Memory::host) {
    report.provenance = cpu_contract_backend().provenance();
    if (p.rows > 0) cpu(p);
    return;
  }
  DETLOGP_CHECK(p.targets_per_row <= 1, "the SM90 logit gradient takes one target per row, but targets has K="
                                            << p.targets_per_row << " ids per row; " << cpu_contract_backend().id()
                                            << " computes it for [N, K] targets, on host memory");
  const Backend& sm90 = sm90_contract_backend();
  std::string why;
  DETLOGP_CHECK(sm90.available(&why),
                "tensors are in CUDA memory but the SM90 backend is unavailable for the logit gradient: " << why);
  report.provenance = sm90.provenance();
  if (p.rows > 0) sm90_kernel(p);
}

}  // namespace

void dispatch_grad_logits(const GradLogitsProblem& p, CallReport& report) {
  dispatch_grad(p, report, cpu_grad_logits, sm90_grad_logits);
}

void dispatch_grad_from_logits(const GradLogitsProblem& p, CallReport& report) {
  dispatch_grad(p, report, cpu_grad_from_logits, sm90_grad_from_logits);
}

}  // namespace detlogp::detail

// Golden cases and their fingerprints (docs/validation.md): a fixed set of problems built by the
// generator, the SHA-256 of each case's output bytes per (contract version, arch, cc), and the
// fingerprints file tests/golden/fingerprints.tsv that `detlogp verify --golden` replays.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "detlogp/detlogp.hpp"

namespace detlogp::golden {

struct GoldenCase {
  std::string name;
  int64_t rows = 0, dim = 0;
  int64_t weight_rows = 0;  // the whole head, padding rows included
  int64_t real_vocab = 0;
  int tp = 1;  // > 1: vocabulary shards of weight_rows / tp rows, partials + owned merge
  bool bias = false;
  float temperature = 1.0f;
  bool temperature_rows = false;
  int64_t ignore_index = kDefaultIgnoreIndex;
  bool targets_i32 = false;
  bool serving = false;  // the serving entry: logits are part of the fingerprint
  float gain = 1.0f;     // RMS-norm gain of the hidden rows
  uint64_t seed = 0;
};

// The checked-in set (CPU: a few seconds on two cores; the Qwen3-8B TP=2 case dominates).
const std::vector<GoldenCase>& golden_cases();

// A case's inputs in host memory. Row kinds: n % 8 == 3 has a dominant target logit (logp near
// 0); n % 16 == 15 carries ignore_index; the others a uniform target over the real vocabulary.
struct CaseInputs {
  GoldenCase c;
  std::vector<uint16_t> hidden;  // [rows, dim]
  std::vector<uint16_t> weight;  // [weight_rows, dim]
  std::vector<float> bias;       // [weight_rows] or empty
  std::vector<int64_t> targets;  // [rows]
  std::vector<int32_t> targets32;
  std::vector<float> temperatures;  // [rows] or empty
  std::string weight_fingerprint;

  // Inputs of the rows [0, rows) against weight rows [row_begin, row_begin + count).
  LinearLogpInputs view(int64_t row_begin, int64_t count) const;
  LinearLogpInputs view() const { return view(0, c.weight_rows); }
  // SHA-256 over hidden | targets (as i64) | bias | temperatures | weight fingerprint (hex):
  // platform-independent, so it is recorded once with arch "any".
  std::string inputs_sha256() const;
};
CaseInputs make_inputs(const GoldenCase& c);

// Shard boundaries of a TP degree: ceil(V / tp) rounded up to 64 rows per rank.
std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t weight_rows, int tp);

// Trainer entry through the tensor-parallel operator (linear_logp_tensor_parallel) with one
// in-process rank per thread over host-memory local communicators. `base` carries hidden,
// targets, temperatures, real_vocab and ignore_index; shards (non-empty, ascending) the weight.
// Every rank's logp/lse must come out bit-identical (checked); rank 0's are returned. The reports
// of all ranks are appended to `reports`.
struct Shard {
  int64_t vocab_start = 0;
  TensorView weight, bias;
};
// Where the ranks run. No devices: in-process host ranks (threads, local communicators). With
// devices: rank r runs on CUDA device devices[r] with its inputs copied there and a real NCCL
// communicator over those devices (needs a build with NCCL; at least as many devices as ranks).
struct TpPlacement {
  std::vector<int> devices;
};
// `logits`, when non-null, receives the serving entry's logits: [rows][sum of the shards' V_local]
// row-major, each rank's shard in its columns (what a TP engine gathers for its sampler).
void tensor_parallel_logp(const LinearLogpInputs& base, const std::vector<Shard>& shards, float* logp, float* lse,
                          const CallOptions& opt, std::vector<CallReport>* reports, const TpPlacement& placement = {},
                          float* logits = nullptr);

// One rank's work on its CUDA device with an NCCL communicator (src/golden/tp_devices.cpp; builds
// without NCCL throw). Outputs are host buffers; `logits` (optional) is this rank's [rows][V_local].
void tensor_parallel_rank_on_device(const LinearLogpInputs& in, int device, void* nccl_comm, float* logp, float* lse,
                                    float* logits, const CallOptions& opt, CallReport* report);
// ncclCommInitAll over `devices` (one communicator per device, rank order = device order);
// destroy_nccl_comms releases them.
std::vector<void*> make_nccl_comms(const std::vector<int>& devices);
void destroy_nccl_comms(const std::vector<void*>& comms);

struct Fingerprint {
  // "inputs", "logp|lse", "logp|lse|logits", "rank<r>:tile_max|tile_sum|target_logit|target_owned",
  // "tp-operator:logp|lse" (TP cases: the tensor-parallel operator; same digest as logp|lse),
  // "entropy" (the [N] f32 entropy bits, docs/contract.md §10: only where the serving backend's
  // provenance names an entropy_id; a TP case's is its rows over the whole head at TP = 1, the
  // digest of the same case at TP = 1)
  std::string scope;
  std::string sha256;
};
struct CaseResult {
  std::vector<Fingerprint> fingerprints;
  CallReport report;
  std::vector<float> logp, lse;
  std::vector<float> entropy;  // empty where the backend serves no entropy output
};
// The case through its entry (TP cases: partials + merge, then the tensor-parallel operator) and,
// where the backend serves the entropy output, once more with it (the "entropy" fingerprint; that
// call must give the same logp/lse bits).
CaseResult run_case(const CaseInputs& in, const CallOptions& opt);

// tests/golden/fingerprints.tsv: lines "contract_version<TAB>arch<TAB>cc<TAB>case<TAB>scope<TAB>sha256",
// '#' comments. arch "any", cc "-" for the platform-independent "inputs" rows.
struct FingerprintKey {
  int contract_version = 0;
  std::string arch, cc, case_name, scope;
  auto operator<=>(const FingerprintKey&) const = default;
};
std::map<FingerprintKey, std::string> read_fingerprints(const std::string& path);  // missing file: empty
std::string fingerprint_line(const FingerprintKey& k, const std::string& sha);

}  // namespace detlogp::golden

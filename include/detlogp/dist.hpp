// Tensor-parallel linear_logp (vocab-parallel lm_head, as Megatron and vLLM shard it).
//
// Every rank holds one contiguous shard [vocab_start, vocab_start + V_local) of the vocabulary,
// ranks in ascending shard order. One call:
//   1. validates locally without throwing, then all-gathers a small header from every rank
//      (shape, flags, the rank's PartialsLayout with its digests, the local error if any), so
//      every rank takes the same decision: either all ranks throw the same error, naming the
//      rank and the value, before any data moves, or all go on (no rank is left in a collective);
//   2. computes this rank's partials (tile summaries, owned y_t; logits on the serving entry);
//   3. all-gathers the partials in rank order = ascending global tile order (bytes only, no
//      floating-point reduction in transit, no all-reduce anywhere);
//   4. runs the owned merge on every rank: every rank ends with the same logp/lse bits, which are
//      the bits of TP = 1 for the same rows.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "detlogp/detlogp.hpp"

namespace detlogp {

// The one collective the operator needs: a rank-ordered all-gather of raw bytes.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where all_gather's buffers live (host or CUDA), and the CUDA device for Memory::cuda.
  virtual Memory memory() const = 0;
  virtual int device() const { return 0; }
  // recv holds size() * bytes; rank r's `bytes` land at recv + r * bytes. For CUDA memory the
  // gather is ordered on `stream` (a cudaStream_t); for host memory it has completed on return.
  virtual void all_gather(const void* send, void* recv, size_t bytes, void* stream) = 0;
  virtual const char* name() const = 0;
};

// In-process ranks (one thread per rank calls the operator with its own communicator): the
// CPU backend's tensor parallelism and a one-GPU simulation of ranks (memory == cuda: every rank
// on `device`). The communicators share state; keep the vector alive until every rank is done.
std::vector<std::unique_ptr<Communicator>> make_local_communicators(int ranks, Memory memory, int device = 0);

// Tensor-parallel operator. `in` is this rank's shard (weight [V_local, D], bias [V_local],
// vocab_start, real_vocab = the global real vocabulary); hidden, targets and temperatures are
// the same on every rank. `out.logp`/`out.lse` are [N] (identical on every rank); `out.logits`,
// when present, is this rank's [N, V_local] shard of the logits (the serving entry).
// Tensors live where comm.memory() says. Rows are processed in chunks bounded by the workspace
// (DETLOGP_SM90_WORKSPACE_MB on CUDA, same default on the host); bit-neutral.
CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const LinearLogpOutputs& out, Communicator& comm,
                                       const CallOptions& opt = {});

// The sampling program over vocabulary shards (docs/contract.md §11.9, docs/tensor-parallel.md):
// `in` is this rank's shard as for linear_logp_tensor_parallel (weight [V_local, D], bias, vocab_start,
// real_vocab the global real vocabulary, at most 2^24); hidden, the program, seeds and keys the same
// on every rank. Every rank gets the same token, logp, logp_raw, lse and support_size, the bits of
// sample() at TP = 1 for any shard boundaries; out.logits, when present, is this rank's [N, V_local]
// shard. Only integers, maxima, tile summaries and rank-ordered candidates are exchanged (all-gathers of
// bytes, no floating-point reduction in transit). Bad or inconsistent inputs throw the same error on
// every rank before any data moves. Tensors live where comm.memory() says (a host communicator, or
// CUDA memory on comm.device(): NCCL, in-process CUDA ranks); on CUDA the shard's partials and logits
// run on the device and the protocol's small per-row steps on the host (docs/tensor-parallel.md), the
// work ordered on opt.cuda_stream and complete on return.
CallReport sample_tensor_parallel(const SampleInputs& in, const SampleOutputs& out, Communicator& comm,
                                  const CallOptions& opt = {});
// The replay over vocabulary shards: linear_logp(in, program, out) at TP = 1's bits on every rank,
// `in` this rank's shard (targets global ids, the same on every rank). Memory as for
// sample_tensor_parallel.
CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const SamplingProgram& program,
                                       const SampledLogpOutputs& out, Communicator& comm, const CallOptions& opt = {});

// The largest tensor-parallel degree (the device merge takes the ranks' segments as kernel
// parameters).
inline constexpr int kMaxTensorParallelRanks = 64;

}  // namespace detlogp

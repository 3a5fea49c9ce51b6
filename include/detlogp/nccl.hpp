// Tensor-parallel linear_logp and the sampling program over NCCL (available when detlogp was built with NCCL found:
// DETLOGP_WITH_NCCL). The communicator's ranks must be ordered like the vocabulary shards.
#pragma once

#include <nccl.h>

#include <memory>

#include "detlogp/dist.hpp"

namespace detlogp {

// Wraps an existing communicator (not owned; the caller destroys it). The rank, size and CUDA
// device come from NCCL. all_gather is one ncclAllGather of bytes on the given stream.
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm);

// Convenience: linear_logp_tensor_parallel over `comm`. Tensors in CUDA memory on the
// communicator's device; work runs on opt.cuda_stream.
CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const LinearLogpOutputs& out, ncclComm_t comm,
                                       const CallOptions& opt = {});

// Convenience: the sampling program over `comm` (sample_tensor_parallel and the replay's
// linear_logp_tensor_parallel of detlogp/dist.hpp). Tensors in CUDA memory on the communicator's
// device; work and gathers run on opt.cuda_stream, and the call has completed on return.
CallReport sample_tensor_parallel(const SampleInputs& in, const SampleOutputs& out, ncclComm_t comm,
                                  const CallOptions& opt = {});
CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const SamplingProgram& program,
                                       const SampledLogpOutputs& out, ncclComm_t comm, const CallOptions& opt = {});

}  // namespace detlogp

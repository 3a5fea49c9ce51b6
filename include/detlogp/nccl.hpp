// Tensor-parallel linear_logp over NCCL (available when detlogp was built with NCCL found:
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

}  // namespace detlogp

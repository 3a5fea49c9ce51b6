// linear_logp_tensor_parallel over an NCCL communicator (built where NCCL was found).
#include <memory>

#include "detlogp/nccl.hpp"

namespace detlogp {

CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const LinearLogpOutputs& out, ncclComm_t comm,
                                       const CallOptions& opt) {
  const std::unique_ptr<Communicator> communicator = make_nccl_communicator(comm);
  return linear_logp_tensor_parallel(in, out, *communicator, opt);
}

}  // namespace detlogp

// The tensor-parallel entries over an NCCL communicator (built where NCCL was found).
#include <memory>

#include "detlogp/nccl.hpp"

namespace detlogp {

CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const LinearLogpOutputs& out, ncclComm_t comm,
                                       const CallOptions& opt) {
  const std::unique_ptr<Communicator> communicator = make_nccl_communicator(comm);
  return linear_logp_tensor_parallel(in, out, *communicator, opt);
}

CallReport sample_tensor_parallel(const SampleInputs& in, const SampleOutputs& out, ncclComm_t comm,
                                  const CallOptions& opt) {
  const std::unique_ptr<Communicator> communicator = make_nccl_communicator(comm);
  return sample_tensor_parallel(in, out, *communicator, opt);
}

CallReport linear_logp_tensor_parallel(const LinearLogpInputs& in, const SamplingProgram& program,
                                       const SampledLogpOutputs& out, ncclComm_t comm, const CallOptions& opt) {
  const std::unique_ptr<Communicator> communicator = make_nccl_communicator(comm);
  return linear_logp_tensor_parallel(in, program, out, *communicator, opt);
}

}  // namespace detlogp

// Builds without NCCL: the harness's multi-GPU placement says why it cannot run.
#include "golden/goldens.hpp"

namespace detlogp::golden {

namespace {
constexpr const char* kWhy =
    "tensor-parallel ranks on CUDA devices need detlogp built with CUDA and NCCL (CMake prints 'NCCL "
    "communicator ON'); without --devices the ranks run in-process on the host";
}

void tensor_parallel_rank_on_device(const LinearLogpInputs&, int, void*, float*, float*, float*, const CallOptions&,
                                    CallReport*) {
  DETLOGP_FAIL(kWhy);
}
std::vector<void*> make_nccl_comms(const std::vector<int>&) { DETLOGP_FAIL(kWhy); }
void destroy_nccl_comms(const std::vector<void*>&) {}

}  // namespace detlogp::golden

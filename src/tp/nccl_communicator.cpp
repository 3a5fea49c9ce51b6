// The NCCL communicator: one ncclAllGather of bytes per exchange. NCCL's all-gather places rank
// r's bytes at offset r, with no arithmetic in transit, which is all the operator needs.
#include <cuda_runtime.h>

#include "detlogp/nccl.hpp"

#define DETLOGP_NCCL_CHECK(expr)                                                                 \
  do {                                                                                           \
    const ncclResult_t detlogp_nccl_ = (expr);                                                   \
    DETLOGP_CHECK(detlogp_nccl_ == ncclSuccess, "NCCL call failed: " #expr " -> "                \
                                                    << ncclGetErrorString(detlogp_nccl_) << " (" \
                                                    << static_cast<int>(detlogp_nccl_) << ")");  \
  } while (0)

namespace detlogp {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(ncclComm_t comm) : comm_(comm) {
    DETLOGP_CHECK(comm != nullptr, "ncclComm_t is null");
    DETLOGP_NCCL_CHECK(ncclCommUserRank(comm, &rank_));
    DETLOGP_NCCL_CHECK(ncclCommCount(comm, &size_));
    DETLOGP_NCCL_CHECK(ncclCommCuDevice(comm, &device_));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::cuda; }
  int device() const override { return device_; }
  const char* name() const override { return "NCCL"; }
  void all_gather(const void* send, void* recv, size_t bytes, void* stream) override {
    int previous = 0;
    DETLOGP_CHECK(cudaGetDevice(&previous) == cudaSuccess, "cudaGetDevice failed");
    if (previous != device_) DETLOGP_CHECK(cudaSetDevice(device_) == cudaSuccess, "cudaSetDevice failed");
    const ncclResult_t r = ncclAllGather(send, recv, bytes, ncclUint8, comm_, static_cast<cudaStream_t>(stream));
    if (previous != device_) (void)cudaSetDevice(previous);
    DETLOGP_NCCL_CHECK(r);
  }

 private:
  ncclComm_t comm_;
  int rank_ = 0, size_ = 0, device_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm) {
  return std::make_unique<NcclCommunicator>(comm);
}

}  // namespace detlogp

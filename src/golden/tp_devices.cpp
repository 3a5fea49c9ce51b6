// Tensor-parallel ranks on real GPUs for the validation harness: each rank copies its inputs to
// its own CUDA device and runs linear_logp_tensor_parallel over an NCCL communicator; results come
// back to the host. Compiled with NCCL only (src/golden/tp_devices_unavailable.cpp otherwise).
#include <cuda_runtime.h>

#include <vector>

#include "detlogp/nccl.hpp"
#include "golden/goldens.hpp"

namespace detlogp::golden {
namespace {

#define GOLDEN_CUDA(expr)                                                                                      \
  do {                                                                                                         \
    const cudaError_t golden_e_ = (expr);                                                                      \
    DETLOGP_CHECK(golden_e_ == cudaSuccess, "CUDA call failed: " #expr " -> " << cudaGetErrorName(golden_e_)); \
  } while (0)

// An owning device copy of a host buffer (or an output buffer when src is null).
class DeviceCopy {
 public:
  DeviceCopy(const void* src, size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    GOLDEN_CUDA(cudaMalloc(&ptr_, bytes));
    if (src != nullptr) GOLDEN_CUDA(cudaMemcpy(ptr_, src, bytes, cudaMemcpyHostToDevice));
  }
  ~DeviceCopy() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  void* get() const { return ptr_; }
  void to_host(void* dst) const {
    if (bytes_) GOLDEN_CUDA(cudaMemcpy(dst, ptr_, bytes_, cudaMemcpyDeviceToHost));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A contiguous device copy of a host tensor view (rows x cols, any row stride).
struct DeviceTensor {
  DeviceTensor(const TensorView& t, int device)
      : copy(nullptr, static_cast<size_t>(t.rows * t.cols * dtype_size(t.dtype))), view(t) {
    if (!t.present()) return;
    const size_t row_bytes = static_cast<size_t>(t.cols * dtype_size(t.dtype));
    if (t.rows > 0)
      GOLDEN_CUDA(cudaMemcpy2D(copy.get(), row_bytes, t.data, static_cast<size_t>(t.row_stride * dtype_size(t.dtype)),
                               row_bytes, static_cast<size_t>(t.rows), cudaMemcpyHostToDevice));
    view.data = copy.get();
    view.row_stride = t.ndim == 2 ? t.cols : 1;
    view.memory = Memory::cuda;
    view.device = device;
  }
  DeviceCopy copy;
  TensorView view;
};

MutableTensorView device_out(void* p, int64_t rows, int64_t cols, int device) {
  MutableTensorView v = cols > 0 ? mutable_matrix(p, DType::f32, rows, cols, Memory::cuda)
                                 : mutable_vector(p, DType::f32, rows, Memory::cuda);
  v.device = device;
  return v;
}

}  // namespace

void tensor_parallel_rank_on_device(const LinearLogpInputs& in, int device, void* nccl_comm, float* logp, float* lse,
                                    float* logits, const CallOptions& opt, CallReport* report) {
  GOLDEN_CUDA(cudaSetDevice(device));
  const int64_t rows = in.hidden.rows, vocab_local = in.weight.rows;
  DeviceTensor hidden(in.hidden, device), weight(in.weight, device), bias(in.bias, device), targets(in.targets, device),
      temps(in.temperature_rows, device);
  DeviceCopy d_logp(nullptr, static_cast<size_t>(rows) * 4), d_lse(nullptr, static_cast<size_t>(rows) * 4);
  DeviceCopy d_logits(nullptr, logits ? static_cast<size_t>(rows * vocab_local) * 4 : 0);
  LinearLogpInputs din = in;
  din.hidden = hidden.view;
  din.weight = weight.view;
  din.bias = bias.view;
  din.targets = targets.view;
  din.temperature_rows = temps.view;
  LinearLogpOutputs dout{device_out(d_logp.get(), rows, 0, device), device_out(d_lse.get(), rows, 0, device), {}};
  if (logits) dout.logits = device_out(d_logits.get(), rows, vocab_local, device);
  cudaStream_t stream = nullptr;
  GOLDEN_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CallOptions o = opt;
  o.cuda_stream = stream;
  try {
    *report = linear_logp_tensor_parallel(din, dout, static_cast<ncclComm_t>(nccl_comm), o);
    GOLDEN_CUDA(cudaStreamSynchronize(stream));
  } catch (...) {
    (void)cudaStreamDestroy(stream);
    throw;
  }
  GOLDEN_CUDA(cudaStreamDestroy(stream));
  d_logp.to_host(logp);
  d_lse.to_host(lse);
  if (logits) d_logits.to_host(logits);
}

std::vector<void*> make_nccl_comms(const std::vector<int>& devices) {
  std::vector<ncclComm_t> comms(devices.size());
  const ncclResult_t r = ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data());
  DETLOGP_CHECK(r == ncclSuccess,
                "ncclCommInitAll over " << devices.size() << " devices failed: " << ncclGetErrorString(r));
  return std::vector<void*>(comms.begin(), comms.end());
}

void destroy_nccl_comms(const std::vector<void*>& comms) {
  for (void* c : comms) (void)ncclCommDestroy(static_cast<ncclComm_t>(c));
}

}  // namespace detlogp::golden

// cuda-cublas-materialized: NOT contract-bearing. The throughput lane for callers who do not need
// bitwise reproducibility: cuBLAS bf16 x bf16 -> fp32 GEMM into [rows, V_local] logits (the
// caller's buffer on the serving entry, a workspace chunk otherwise), then one CTA per row adds
// the bias and runs a plain log-softmax (y = z / T, max, sum of expf, logf). Its bits depend on
// cuBLAS's kernel choice; strict mode refuses it. Inputs are validated like the contract lanes
// (device-side target check, nothing written on a bad target).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <string>

#include "core/backend.hpp"
#include "cuda/check.hpp"
#include "cuda/device.hpp"
#include "cuda/lane_backend.hpp"
#include "cuda/status.hpp"

namespace detlogp::detail {
namespace {

constexpr const char* kId = kCublasLaneId;
constexpr int kThreads = 512;

#define DETLOGP_CUBLAS_CHECK(expr)                                                                         \
  do {                                                                                                     \
    const cublasStatus_t detlogp_cb_ = (expr);                                                             \
    DETLOGP_CHECK(detlogp_cb_ == CUBLAS_STATUS_SUCCESS, "cuBLAS call failed: " #expr " -> "                \
                                                            << cublasGetStatusName(detlogp_cb_) << " ("    \
                                                            << cublasGetStatusString(detlogp_cb_) << ")"); \
  } while (0)

struct SoftmaxParams {
  int64_t row_begin;
  float* logits;  // [rows of the chunk][vocab_local]
  int64_t vocab_local, real_local;
  const float* bias;
  const void* targets;
  int32_t targets_i64;
  int64_t vocab_start, ignore_index;
  float temperature;
  const float* temperature_rows;
  float* logp;
  float* lse;
  const cuda::DeviceStatus* status;
};

__device__ float block_reduce(float v, bool is_max, float* scratch) {
  for (int off = 16; off > 0; off /= 2) {
    const float o = __shfl_xor_sync(0xFFFFFFFFu, v, off);
    v = is_max ? fmaxf(v, o) : v + o;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) v = is_max ? fmaxf(v, scratch[w]) : v + scratch[w];
  __syncthreads();
  return v;
}

__global__ void __launch_bounds__(kThreads) log_softmax_rows_kernel(const SoftmaxParams p) {
  if (p.status->code != cuda::kStatusOk) return;
  __shared__ float scratch[kThreads / 32];
  const int64_t r = blockIdx.x, row = p.row_begin + r;
  float* z = p.logits + r * p.vocab_local;
  const float t = p.temperature_rows ? p.temperature_rows[row] : p.temperature;
  float m = -FLT_MAX;
  for (int64_t v = threadIdx.x; v < p.vocab_local; v += kThreads) {
    const float zv = z[v] + (p.bias ? p.bias[v] : 0.0f);
    if (p.bias) z[v] = zv;
    if (v < p.real_local) m = fmaxf(m, zv / t);
  }
  m = block_reduce(m, true, scratch);
  float s = 0.0f;
  for (int64_t v = threadIdx.x; v < p.real_local; v += kThreads) s += expf(z[v] / t - m);
  s = block_reduce(s, false, scratch);
  if (threadIdx.x != 0) return;
  const float lse = m + logf(s);
  const int64_t target = cuda::load_target(p.targets, p.targets_i64, row);
  p.lse[row] = lse;
  p.logp[row] = target == p.ignore_index ? 0.0f : z[target - p.vocab_start] / t - lse;
}

class CublasMaterializedBackend final : public CudaLaneBackend {
 public:
  CublasMaterializedBackend() : CudaLaneBackend(cublas_lane_provenance(), false) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      set_availability(false, "no CUDA device present");
      return;
    }
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess) {
      mutable_provenance().cc = major * 10 + minor;
      const bool sm90 = major == 9 && minor == 0;  // the library's kernels are built for sm_90a only
      set_availability(sm90,
                       sm90 ? "CUDA device " + std::to_string(dev) + " (cuBLAS bf16 GEMM, fp32 logits)"
                            : "CUDA device " + std::to_string(dev) + " is not sm_90 (this build's kernels are sm_90a)");
    } else {
      (void)cudaGetLastError();
      set_availability(false, "could not query the current CUDA device");
    }
  }
  bool supports_partials() const override { return false; }

  void run(const LogpProblem& p) const override {
    DETLOGP_CHECK(available(nullptr), "backend " << kId << " unavailable: " << reason());
    DETLOGP_CHECK(p.memory == Memory::cuda, kId << " needs tensors in CUDA memory");
    if (p.rows == 0) return;
    DETLOGP_CHECK(p.rows < (int64_t{1} << 31) && p.vocab_local < (int64_t{1} << 31) && p.dim < (int64_t{1} << 31),
                  kId << " takes N, V_local and D below 2^31 (cuBLAS int dimensions)");
    const cuda::DeviceGuard guard(p.device);
    cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
    cublasHandle_t handle = handle_for(p.device);
    DETLOGP_CUBLAS_CHECK(cublasSetStream(handle, stream));

    cuda::DeviceStatus* status = nullptr;
    DETLOGP_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&status), sizeof(cuda::DeviceStatus), stream));
    cuda::launch_validate(cuda::ValidateParams{p.rows, p.targets, p.targets_i64 ? 1 : 0, 1, p.real_vocab,
                                               p.ignore_index, p.temperature_rows, status},
                          stream);
    // Trainer entry: logits of a row chunk in a workspace of at most ~1 GiB.
    const int64_t chunk =
        p.logits ? p.rows : std::max<int64_t>(1, std::min<int64_t>(p.rows, (int64_t{1} << 28) / p.vocab_local));
    float* workspace = nullptr;
    if (!p.logits)
      DETLOGP_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&workspace),
                                         static_cast<size_t>(chunk * p.vocab_local) * sizeof(float), stream));
    const float one = 1.0f, zero = 0.0f;
    const int64_t real_local = std::max<int64_t>(0, std::min(p.vocab_local, p.real_vocab - p.vocab_start));
    for (int64_t row0 = 0; row0 < p.rows; row0 += chunk) {
      const int64_t rows = std::min(chunk, p.rows - row0);
      float* logits = p.logits ? p.logits + row0 * p.vocab_local : workspace;
      // Column-major view: logits^T [V, rows] = W [V, D] (row-major = col-major D x V, transposed) x h^T.
      DETLOGP_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(p.vocab_local),
                                        static_cast<int>(rows), static_cast<int>(p.dim), &one, p.weight, CUDA_R_16BF,
                                        static_cast<int>(p.weight_stride), p.hidden + row0 * p.hidden_stride,
                                        CUDA_R_16BF, static_cast<int>(p.hidden_stride), &zero, logits, CUDA_R_32F,
                                        static_cast<int>(p.vocab_local), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      SoftmaxParams sp{
          row0,          logits,         p.vocab_local, real_local,         p.bias, p.targets, p.targets_i64,
          p.vocab_start, p.ignore_index, p.temperature, p.temperature_rows, p.logp, p.lse,     status};
      log_softmax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(sp);
      DETLOGP_CUDA_CHECK_LAUNCH();
    }
    cuda::DeviceStatus host_status;
    DETLOGP_CUDA_CHECK(cudaMemcpyAsync(&host_status, status, sizeof host_status, cudaMemcpyDeviceToHost, stream));
    if (workspace) DETLOGP_CUDA_CHECK(cudaFreeAsync(workspace, stream));
    DETLOGP_CUDA_CHECK(cudaFreeAsync(status, stream));
    DETLOGP_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (host_status.code != cuda::kStatusOk) cuda::throw_status(host_status, p);
  }

  void run_from_host(const LogpProblem&) const override {
    DETLOGP_FAIL(kId << " runs on CUDA tensors only; pass device memory (or use reference-materialized on the host)");
  }

 private:
  // One handle per (thread, device): cuBLAS handles must not be shared by concurrent threads.
  static cublasHandle_t handle_for(int device) {
    struct Handles {
      cublasHandle_t h[64] = {};
      ~Handles() {
        for (cublasHandle_t x : h)
          if (x != nullptr) (void)cublasDestroy(x);
      }
    };
    thread_local Handles handles;
    DETLOGP_CHECK(device >= 0 && device < 64, "CUDA device " << device << " out of range");
    if (handles.h[device] == nullptr) DETLOGP_CUBLAS_CHECK(cublasCreate(&handles.h[device]));
    return handles.h[device];
  }
};

}  // namespace

const Backend& cublas_materialized_backend() {
  static const CublasMaterializedBackend backend;
  return backend;
}

}  // namespace detlogp::detail

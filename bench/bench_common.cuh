// Shared pieces of the SM90 benchmarks (bench_sm90, bench_sm90_mainloop): CUDA/cuBLAS checks,
// random and "realistic" bf16 inputs, cuBLAS called as torch calls it, the NVML clock probe and the
// round-robin timer (CUDA events, median of many, L2 flushed before every timed launch).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "detlogp/fpops.hpp"
#include "detlogp/hash.hpp"

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorName(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)
#define CB(x)                                                                                       \
  do {                                                                                              \
    cublasStatus_t s_ = (x);                                                                        \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                              \
      std::fprintf(stderr, "cuBLAS error %d at %s:%d\n", static_cast<int>(s_), __FILE__, __LINE__); \
      std::exit(2);                                                                                 \
    }                                                                                               \
  } while (0)

namespace detlogp_bench {

__global__ void fill_bf16(uint16_t* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t z = detlogp::mix64(seed * detlogp::kSplitMixGamma + static_cast<uint64_t>(i));
    const float u = static_cast<float>(z >> 40) * 0x1p-24f * 2.0f - 1.0f;
    p[i] = detlogp::fp::bf16_round(u * scale);
  }
}

// A standard normal draw per index (Box-Muller on two 24-bit uniforms of one hash): the
// "realistic" inputs below need Gaussian values, and a counter hash keeps them the same in every run.
__device__ inline float normal_at(uint64_t seed, int64_t i) {
  const uint64_t z = detlogp::mix64(seed * detlogp::kSplitMixGamma + static_cast<uint64_t>(i));
  const float u1 = (static_cast<float>(z >> 40) + 1.0f) * 0x1p-24f;  // (0, 1]: log(u1) is finite
  const float u2 = static_cast<float>((z >> 16) & 0xFFFFFF) * 0x1p-24f;
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__global__ void fill_normal_bf16(uint16_t* p, int64_t n, uint64_t seed, float stddev) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    p[i] = detlogp::fp::bf16_round(stddev * normal_at(seed, i));
}

// Sum over a block of 256 threads (every thread gets it).
__device__ inline float block_sum256(float x, float* red) {
  for (int o = 16; o; o /= 2) x += __shfl_xor_sync(~0u, x, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += red[i];
  return s;
}

// The hidden states of python/detlogp/bench/data.py (what `python -m detlogp.bench` feeds every
// method), drawn from this file's hash instead of torch's generator: N(0, 1) rows; every third row
// (row % 3 == 0) pulled towards its target's weight row, h + k * sqrt(D) * w_t / |w_t| with
// k = beta / (1 - beta), beta uniform in [0.1, 0.4]; then every row RMS-normalized
// (h * rsqrt(mean(h^2) + 1e-6)) and rounded to bf16. One block of 256 threads a row, d <= 8192.
__global__ void __launch_bounds__(256)
    realistic_hidden(uint16_t* h, const uint16_t* w, const int32_t* targets, int64_t d, uint64_t seed) {
  constexpr int kMaxPerThread = 32;
  __shared__ float red[8];
  const int64_t row = blockIdx.x;
  float x[kMaxPerThread];
  const bool peaked = row % 3 == 0;
  const uint16_t* wt = w + static_cast<int64_t>(targets[row]) * d;
  float wsq = 0.0f;
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t c = threadIdx.x + int64_t{j} * 256;
    if (c >= d) break;
    x[j] = normal_at(seed, row * d + c);
    const float wv = detlogp::fp::bf16_to_float(wt[c]);
    wsq += wv * wv;
  }
  if (peaked) {
    const float norm = fmaxf(sqrtf(block_sum256(wsq, red)), 1e-12f);
    const uint64_t z = detlogp::mix64((seed + 1) * detlogp::kSplitMixGamma + static_cast<uint64_t>(row));
    const float beta = 0.1f + 0.3f * static_cast<float>(z >> 40) * 0x1p-24f;
    const float k = beta / (1.0f - beta) * sqrtf(static_cast<float>(d)) / norm;
    for (int j = 0; j < kMaxPerThread; ++j) {
      const int64_t c = threadIdx.x + int64_t{j} * 256;
      if (c >= d) break;
      x[j] += k * detlogp::fp::bf16_to_float(wt[c]);
    }
  }
  float sq = 0.0f;
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t c = threadIdx.x + int64_t{j} * 256;
    if (c >= d) break;
    sq += x[j] * x[j];
  }
  const float scale = rsqrtf(block_sum256(sq, red) / static_cast<float>(d) + 1e-6f);
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int64_t c = threadIdx.x + int64_t{j} * 256;
    if (c >= d) break;
    h[row * d + c] = detlogp::fp::bf16_round(x[j] * scale);
  }
}

// cuBLAS's bf16 GEMM called the way torch calls it for F.linear(h, w) with bf16 tensors and no
// bias (torch 2.11; docs/perf.md, "Method", names the torch functions): its own handle with an
// explicit workspace of torch's size, stream, workspace and math mode set before every call,
// cublasGemmEx with the legacy CUDA_R_32F compute type (the C++ overload maps it to
// CUBLAS_COMPUTE_32F under the default math mode) and CUBLAS_GEMM_DEFAULT_TENSOR_OP, the math mode
// reset after the call.
class TorchStyleGemm {
 public:
  TorchStyleGemm() {
    CB(cublasCreate(&handle_));
    bytes_ = workspace_bytes();
    CK(cudaMalloc(&workspace_, bytes_));
  }
  ~TorchStyleGemm() {
    cublasDestroy(handle_);
    cudaFree(workspace_);
  }
  TorchStyleGemm(const TorchStyleGemm&) = delete;
  TorchStyleGemm& operator=(const TorchStyleGemm&) = delete;
  size_t workspace_size() const { return bytes_; }
  // torch's getChosenWorkspaceSize(): CUBLAS_WORKSPACE_CONFIG's ":SIZE_KiB:COUNT" pairs summed, else
  // 32 MiB on SM 9.0 and 4096 KiB * 2 + 16 KiB * 8 elsewhere.
  static size_t workspace_bytes() {
    cudaDeviceProp prop{};
    int dev = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    const size_t fallback =
        prop.major == 9 && prop.minor == 0 ? size_t{4096} * 8 * 1024 : size_t{4096} * 1024 * 2 + 16 * 1024 * 8;
    const char* cfg = std::getenv("CUBLAS_WORKSPACE_CONFIG");
    if (cfg == nullptr) return fallback;
    size_t total = 0;
    bool any = false;
    for (const char* p = cfg; (p = std::strchr(p, ':')) != nullptr;) {
      char* end = nullptr;
      const unsigned long long size = std::strtoull(p + 1, &end, 10);
      if (end == p + 1 || *end != ':') break;
      const char* q = end + 1;
      const unsigned long long count = std::strtoull(q, &end, 10);
      if (end == q) break;
      total += size * 1024 * count;
      any = true;
      p = end;
    }
    return any ? total : fallback;
  }
  // C[n, v] (column-major [v, n], ldc = v) = h[n, d] w[v, d]^T, as torch's addmm_out_cuda_impl lays
  // out mm(h, w.t()): transa = T, transb = N, m = v, n = n, k = d, lda = ldb = d.
  void operator()(const uint16_t* w, const uint16_t* h, void* c, cudaDataType c_type, int64_t v, int64_t n, int64_t d,
                  cudaStream_t stream = nullptr) {
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasSetStream(handle_, stream));
    CB(cublasSetWorkspace(handle_, workspace_, bytes_));
    CB(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));  // getCurrentCUDABlasHandle, fp32 matmul not TF32
    // allow_bf16_reduced_precision_reduction defaults to true: no DISALLOW_REDUCED_PRECISION flag.
    CB(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
    CB(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(v), static_cast<int>(n), static_cast<int>(d),
                    &alpha, w, CUDA_R_16BF, static_cast<int>(d), h, CUDA_R_16BF, static_cast<int>(d), &beta, c, c_type,
                    static_cast<int>(v), CUDA_R_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP));
    CB(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
  }

 private:
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t bytes_ = 0;
};

inline std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  for (const char* p = s; *p;) {
    v.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return v;
}

// SM clock and board power read through NVML (dlopen'ed: the driver ships it, the toolkit need
// not), sampled while a timed launch runs. Lets a run tell a slower kernel from a slower clock:
// under a power cap the clock follows each kernel's energy per cycle.
class ClockProbe {
 public:
  ClockProbe() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) return;
    auto init = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    clock_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(dlsym(lib_, "nvmlDeviceGetClockInfo"));
    power_ = reinterpret_cast<int (*)(void*, unsigned*)>(dlsym(lib_, "nvmlDeviceGetPowerUsage"));
    reasons_ =
        reinterpret_cast<int (*)(void*, unsigned long long*)>(dlsym(lib_, "nvmlDeviceGetCurrentClocksEventReasons"));
    if (reasons_ == nullptr)
      reasons_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(
          dlsym(lib_, "nvmlDeviceGetCurrentClocksThrottleReasons"));
    char bus[32] = {};
    if (init == nullptr || by_bus == nullptr || clock_ == nullptr || init() != 0 ||
        cudaDeviceGetPCIBusId(bus, sizeof bus, 0) != cudaSuccess || by_bus(bus, &dev_) != 0)
      dev_ = nullptr;
  }
  bool ok() const { return dev_ != nullptr; }
  // One sample: SM clock (MHz), power (W), clock-event reasons (bit mask, NVML's definition).
  void sample() {
    if (!ok()) return;
    unsigned mhz = 0, mw = 0;
    unsigned long long why = 0;
    if (clock_(dev_, 1 /* NVML_CLOCK_SM */, &mhz) == 0) mhz_.push_back(mhz);
    if (power_ != nullptr && power_(dev_, &mw) == 0) watts_.push_back(mw / 1000.0);
    if (reasons_ != nullptr && reasons_(dev_, &why) == 0) reasons_seen_ |= why;
  }
  void reset() {
    mhz_.clear();
    watts_.clear();
    reasons_seen_ = 0;
  }
  double mean_mhz() const { return mean(mhz_); }
  double mean_watts() const { return mean(watts_); }
  unsigned long long reasons() const { return reasons_seen_; }

 private:
  template <class T>
  static double mean(const std::vector<T>& v) {
    if (v.empty()) return std::nan("");
    double s = 0;
    for (auto x : v) s += x;
    return s / v.size();
  }
  void* lib_ = nullptr;
  void* dev_ = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
  int (*power_)(void*, unsigned*) = nullptr;
  int (*reasons_)(void*, unsigned long long*) = nullptr;
  std::vector<unsigned> mhz_;
  std::vector<double> watts_;
  unsigned long long reasons_seen_ = 0;
};

struct Timer {
  cudaEvent_t a, b;
  void* flush = nullptr;
  size_t flush_bytes = size_t{256} << 20;  // > 60 MB L2
  bool flush_l2 = true;                    // false: time with whatever the L2 holds (warm)
  Timer() {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaMalloc(&flush, flush_bytes));
  }
  // Median milliseconds of fn over reps runs after warmup runs, L2 flushed before each.
  double median_ms(const std::function<void()>& fn, int reps, int warmup = 2) {
    for (int i = 0; i < warmup; ++i) fn();
    CK(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      if (flush_l2) CK(cudaMemsetAsync(flush, i & 0xFF, flush_bytes));
      CK(cudaEventRecord(a));
      fn();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
  // Medians of several methods timed round-robin, each repetition in a fresh random order (fixed
  // seed): clock or temperature drift reaches every method alike, and no method always follows
  // the same predecessor (a rotation would keep each one's predecessor fixed, and on an H200 the
  // predecessor moves a large-N result by up to ~6 %: docs/perf.md, "Method").
  // Also per method: the mean SM clock and power sampled (NVML) while its launches ran, the
  // union of clock-event reasons seen (empty vectors without NVML).
  ClockProbe probe;
  std::vector<double> mhz, watts;
  std::vector<unsigned long long> reasons;
  std::vector<double> interleaved_medians(const std::vector<std::function<void()>>& fns, int reps, int warmup = 2) {
    const size_t k = fns.size();
    std::vector<double> mhz_sum(k, 0.0), watt_sum(k, 0.0);
    std::vector<int> samples(k, 0);
    reasons.assign(k, 0);
    for (const auto& fn : fns)
      for (int i = 0; i < warmup; ++i) fn();
    CK(cudaDeviceSynchronize());
    std::vector<std::vector<double>> t(k);
    std::vector<size_t> order(k);
    for (size_t j = 0; j < k; ++j) order[j] = j;
    std::mt19937_64 rng(12345);
    for (int r = 0; r < reps; ++r) {
      std::shuffle(order.begin(), order.end(), rng);
      for (size_t j = 0; j < k; ++j) {
        const size_t m = order[j];
        if (flush_l2) CK(cudaMemsetAsync(flush, (r + static_cast<int>(j)) & 0xFF, flush_bytes));
        CK(cudaEventRecord(a));
        fns[m]();
        CK(cudaEventRecord(b));
        probe.reset();
        // Sample while the launches run (the host returns before they finish), then once more.
        while (cudaEventQuery(b) == cudaErrorNotReady) probe.sample();
        if (probe.ok() && std::isnan(probe.mean_mhz())) probe.sample();
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t[m].push_back(ms);
        if (probe.ok()) {
          mhz_sum[m] += probe.mean_mhz();
          watt_sum[m] += std::isnan(probe.mean_watts()) ? 0.0 : probe.mean_watts();
          ++samples[m];
          reasons[m] |= probe.reasons();
        }
      }
    }
    mhz.assign(k, std::nan(""));
    watts.assign(k, std::nan(""));
    for (size_t m = 0; m < k; ++m)
      if (samples[m] > 0) {
        mhz[m] = mhz_sum[m] / samples[m];
        watts[m] = watt_sum[m] / samples[m];
      }
    times = t;  // per method, in repetition order
    std::vector<double> med(k);
    for (size_t m = 0; m < k; ++m) {
      std::sort(t[m].begin(), t[m].end());
      med[m] = t[m][t[m].size() / 2];
    }
    return med;
  }
  // The last interleaved_medians call's times, per method in repetition order.
  std::vector<std::vector<double>> times;
  // Median over the repetitions of method m's time over method ref's in the same repetition: the
  // two ran within one shuffled round, so slow drifts of clock and temperature cancel in the ratio.
  double paired_ratio_median(size_t m, size_t ref) const {
    std::vector<double> q;
    for (size_t r = 0; r < times[m].size() && r < times[ref].size(); ++r) q.push_back(times[m][r] / times[ref][r]);
    if (q.empty()) return std::nan("");
    std::sort(q.begin(), q.end());
    return q[q.size() / 2];
  }
};

}  // namespace detlogp_bench

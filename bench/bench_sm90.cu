// SM90 benchmark: detlogp trainer and serving entries against cuBLAS bf16 GEMM alone (fp32 and
// bf16 output) and cuBLAS GEMM + an fp32 log-softmax kernel (the materializing path), in one run.
// CUDA-event timing, median of many, L2 flushed before every timed launch, random data; at each N
// all methods are timed round-robin in a shuffled order per repetition.
// Writes CSV rows (GPU, versions, date, reproduce command) and prints a summary table.
//
//   bench_sm90 [--n 1,64,1024,4096,16384] [--d 4096] [--v 151936] [--csv out.csv] [--reps K]
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "sm90/sm90_backend.hpp"
#include "sm90/sm90_launch_table.hpp"

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

namespace {

__global__ void fill_bf16(uint16_t* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * 0x1p-24f * 2.0f - 1.0f;
    uint32_t b = __float_as_uint(u * scale);
    b += 0x7FFFu + ((b >> 16) & 1u);
    p[i] = static_cast<uint16_t>(b >> 16);
  }
}

// Baseline log-softmax over materialized fp32 logits: one CTA per row, max pass, sum-exp pass.
__global__ void log_softmax_rows(const float* z, int64_t v, const int32_t* targets, float* logp, float* lse) {
  const float* row = z + blockIdx.x * v;
  __shared__ float red[32];
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) m = fmaxf(m, row[i]);
  for (int o = 16; o; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  m = -INFINITY;
  for (int i = 0; i < blockDim.x / 32; ++i) m = fmaxf(m, red[i]);
  __syncthreads();
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) s += expf(row[i] - m);
  for (int o = 16; o; o /= 2) s += __shfl_xor_sync(~0u, s, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int i = 0; i < blockDim.x / 32; ++i) t += red[i];
    const float l = m + logf(t);
    lse[blockIdx.x] = l;
    logp[blockIdx.x] = row[targets[blockIdx.x]] - l;
  }
}

std::vector<int64_t> parse_list(const char* s) {
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
      CK(cudaMemsetAsync(flush, i & 0xFF, flush_bytes));
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
  // the same predecessor (a rotation would keep each one's predecessor fixed; run 17-18 of
  // docs/perf-notes.md showed the predecessor moving a large-N result by ~6 %).
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
        CK(cudaMemsetAsync(flush, (r + static_cast<int>(j)) & 0xFF, flush_bytes));
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
    std::vector<double> med(k);
    for (size_t m = 0; m < k; ++m) {
      std::sort(t[m].begin(), t[m].end());
      med[m] = t[m][t[m].size() / 2];
    }
    return med;
  }
};

struct Row {
  int64_t n;
  std::string method;
  double ms, tflops, gbps;
  int64_t extra_bytes;
  double ratio_bf16, ratio_f32;
  double sm_mhz, watts;
  unsigned long long clock_reasons;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ns = {1, 64, 1024, 4096, 16384};
  int64_t d = 4096, v = 151936;
  std::string csv = "bench_sm90.csv";
  int reps_override = 0;
  std::string command;
  // Reproduce command without machine-specific paths: program and file names only.
  auto base = [](const char* a) {
    const char* slash = std::strrchr(a, '/');
    return std::string(slash ? slash + 1 : a);
  };
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + base(argv[i]);
  command += " (built by scripts/gpu_check.sh)";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--n")
      ns = parse_list(next());
    else if (a == "--d")
      d = std::atoll(next());
    else if (a == "--v")
      v = std::atoll(next());
    else if (a == "--csv")
      csv = next();
    else if (a == "--reps")
      reps_override = std::atoi(next());
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  const auto& backend = detlogp::detail::sm90_contract_backend();
  std::string why;
  if (!backend.available(&why)) {
    std::printf("SKIP bench_sm90: %s\n", why.c_str());
    return 0;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  int rt = 0, drv = 0;
  CK(cudaRuntimeGetVersion(&rt));
  CK(cudaDriverGetVersion(&drv));
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::printf("bench_sm90 on %s (%d SMs), CUDA runtime %d, driver %d, %s\n", prop.name, prop.multiProcessorCount, rt,
              drv, date);

  const int64_t nmax = *std::max_element(ns.begin(), ns.end());
  Timer timer;
  // Copy bandwidth (device to device), counting bytes read + written.
  double copy_gbps = 0;
  {
    const size_t bytes = size_t{2} << 30;
    void *x, *y;
    CK(cudaMalloc(&x, bytes));
    CK(cudaMalloc(&y, bytes));
    CK(cudaMemset(x, 1, bytes));
    const double ms = timer.median_ms([&] { CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice)); }, 10);
    copy_gbps = 2.0 * bytes / (ms * 1e-3) / 1e9;
    CK(cudaFree(x));
    CK(cudaFree(y));
  }
  const double weight_bytes = 2.0 * v * d;
  const double floor_ms = weight_bytes / (copy_gbps * 1e9) * 1e3;
  std::printf("device-to-device copy: %.0f GB/s (read+write); HBM floor for the weight (%.3f GB): %.4f ms\n", copy_gbps,
              weight_bytes / 1e9, floor_ms);

  uint16_t *w, *h;
  CK(cudaMalloc(&w, static_cast<size_t>(v * d) * 2));
  CK(cudaMalloc(&h, static_cast<size_t>(nmax * d) * 2));
  fill_bf16<<<2048, 256>>>(w, v * d, 1, static_cast<float>(9.0 / std::sqrt(double(d))));
  fill_bf16<<<2048, 256>>>(h, nmax * d, 2, 1.0f);
  CK(cudaGetLastError());
  std::vector<int32_t> ht(static_cast<size_t>(nmax));
  for (int64_t i = 0; i < nmax; ++i) ht[i] = static_cast<int32_t>((i * 7919 + 13) % v);
  int32_t* targets;
  CK(cudaMalloc(&targets, ht.size() * 4));
  CK(cudaMemcpy(targets, ht.data(), ht.size() * 4, cudaMemcpyHostToDevice));
  float *logp, *lse, *logits;
  uint16_t* logits_bf16;
  CK(cudaMalloc(&logp, nmax * 4));
  CK(cudaMalloc(&lse, nmax * 4));
  CK(cudaMalloc(&logits, static_cast<size_t>(nmax * v) * 4));
  CK(cudaMalloc(&logits_bf16, static_cast<size_t>(nmax * v) * 2));
  cublasHandle_t cublas;
  CB(cublasCreate(&cublas));
  // cuBLAS may use a workspace; give it the default stream like every other launch here.

  std::vector<Row> rows;
  for (int64_t n : ns) {
    const int reps = reps_override ? reps_override : (n >= 4096 ? 10 : 30);
    const double flops = 2.0 * n * v * d;
    const double in_bytes = weight_bytes + 2.0 * n * d;
    detlogp::detail::LogpProblem p;
    p.rows = n;
    p.dim = d;
    p.vocab_local = v;
    p.real_vocab = v;
    p.hidden = h;
    p.hidden_stride = d;
    p.weight = w;
    p.weight_stride = d;
    p.targets = targets;
    p.memory = detlogp::Memory::cuda;
    p.logp = logp;
    p.lse = lse;
    auto gemm = [&](void* c, cudaDataType ct) {
      const float alpha = 1.0f, beta = 0.0f;
      CB(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(v), static_cast<int>(n), static_cast<int>(d),
                      &alpha, w, CUDA_R_16BF, static_cast<int>(d), h, CUDA_R_16BF, static_cast<int>(d), &beta, c, ct,
                      static_cast<int>(v), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    detlogp::detail::LogpProblem ps = p;
    ps.logits = logits;
    const int64_t ws = detlogp::sm90::workspace_bytes(p);
    const double logit_bytes = 4.0 * n * v;
    struct Method {
      std::string name;
      std::function<void()> fn;
      double bytes;
      int64_t extra;
    };
    std::vector<Method> methods = {
        {"cublas_gemm_bf16out", [&] { gemm(logits_bf16, CUDA_R_16BF); }, in_bytes + 2.0 * n * v,
         static_cast<int64_t>(2.0 * n * v)},
        {"cublas_gemm_f32out", [&] { gemm(logits, CUDA_R_32F); }, in_bytes + logit_bytes,
         static_cast<int64_t>(logit_bytes)},
        {"cublas_f32+log_softmax",
         [&] {
           gemm(logits, CUDA_R_32F);
           log_softmax_rows<<<static_cast<unsigned>(n), 512>>>(logits, v, targets, logp, lse);
         },
         in_bytes + 2 * logit_bytes + 8.0 * n, static_cast<int64_t>(logit_bytes)},
        {"detlogp_trainer", [&] { backend.run(p); }, in_bytes + 8.0 * n, ws},
        {"detlogp_serving", [&] { backend.run(ps); }, in_bytes + logit_bytes + 8.0 * n, ws},
    };
    if (n <= 64 || n == 1024 || n == 4096 || n == 16384) {
      for (int bi = 0; bi < detlogp::sm90::kBucketCount; ++bi) {
        const char* b = detlogp::sm90::bucket_info(static_cast<detlogp::sm90::Bucket>(bi)).name;
        // The 8-row decode tiles stream the weight once per 8 rows: forced only where that is sane.
        if (std::strncmp(b, "decode8", 7) == 0 && n > 64) continue;
        methods.push_back({std::string("detlogp_trainer[") + b + "]",
                           [&, b] {
                             setenv("DETLOGP_SM90_BUCKET", b, 1);
                             backend.run(p);
                             unsetenv("DETLOGP_SM90_BUCKET");
                           },
                           in_bytes + 8.0 * n, ws});
      }
    }
    std::vector<std::function<void()>> fns;
    for (const auto& m : methods) fns.push_back(m.fn);
    const std::vector<double> med = timer.interleaved_medians(fns, reps);
    CK(cudaGetLastError());
    const double t_bf16 = med[0], t_f32 = med[1];
    for (size_t i = 0; i < methods.size(); ++i) {
      const double ms = med[i];
      rows.push_back({n, methods[i].name, ms, flops / (ms * 1e-3) / 1e12, methods[i].bytes / (ms * 1e-3) / 1e9,
                      methods[i].extra, ms / t_bf16, ms / t_f32, timer.mhz[i], timer.watts[i], timer.reasons[i]});
    }
    std::printf("N=%lld done\n", (long long)n);
    std::fflush(stdout);
  }

  FILE* f = std::fopen(csv.c_str(), "w");
  if (f) {
    std::fprintf(
        f,
        "gpu,cuda_runtime,driver,git_sha,date,command,N,D,V,method,ms_median,tflops,gbps,extra_bytes,ratio_vs_"
        "cublas_bf16out,ratio_vs_cublas_f32out,copy_gbps,hbm_floor_ms,sm_mhz_mean,power_w_mean,clock_event_reasons\n");
    for (const auto& r : rows)
      std::fprintf(
          f, "\"%s\",%d,%d,%s,%s,\"%s\",%lld,%lld,%lld,%s,%.5f,%.2f,%.1f,%lld,%.3f,%.3f,%.0f,%.5f,%.0f,%.0f,0x%llx\n",
          prop.name, rt, drv, DETLOGP_GIT_SHA, date, command.c_str(), (long long)r.n, (long long)d, (long long)v,
          r.method.c_str(), r.ms, r.tflops, r.gbps, (long long)r.extra_bytes, r.ratio_bf16, r.ratio_f32, copy_gbps,
          floor_ms, r.sm_mhz, r.watts, r.clock_reasons);
    std::fclose(f);
  }
  std::printf("\n%-7s %-36s %10s %9s %9s %12s %10s %10s %7s %6s %8s\n", "N", "method", "ms", "TFLOP/s", "GB/s",
              "extra_MB", "vs_bf16", "vs_f32", "SM_MHz", "W", "reasons");
  for (const auto& r : rows)
    std::printf("%-7lld %-36s %10.4f %9.1f %9.0f %12.1f %10.3f %10.3f %7.0f %6.0f %8llx\n", (long long)r.n,
                r.method.c_str(), r.ms, r.tflops, r.gbps, r.extra_bytes / 1048576.0, r.ratio_bf16, r.ratio_f32,
                r.sm_mhz, r.watts, r.clock_reasons);
  for (const auto& r : rows)
    if (r.n == 1 && r.method == "detlogp_trainer")
      std::printf("N=1 trainer vs HBM floor (%.4f ms at %.0f GB/s copy): %.3fx\n", floor_ms, copy_gbps,
                  r.ms / floor_ms);
  std::printf("csv: %s\n", csv.c_str());
  return 0;
}

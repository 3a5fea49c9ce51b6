// Helpers for the SM90 GPU tests: skip logic (exit code 77 with a printed reason), a failure
// counter with real assertions, RAII device buffers, device-side random data and gathers, problem
// construction for the backend, output poisoning, and a float64 reference.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.hpp"
#include "core/problem.hpp"
#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"

namespace gput {

inline int& failures() {
  static int n = 0;
  return n;
}

#define GPU_EXPECT(cond, msg)                                                                  \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::ostringstream gpu_os_;                                                              \
      gpu_os_ << msg;                                                                          \
      std::printf("FAIL %s:%d: %s\n  %s\n", __FILE__, __LINE__, #cond, gpu_os_.str().c_str()); \
      ++::gput::failures();                                                                    \
    }                                                                                          \
  } while (0)

// Test infrastructure errors abort the test (they are not what is under test).
#define GPU_CUDA(expr)                                                                              \
  do {                                                                                              \
    const cudaError_t e_ = (expr);                                                                  \
    if (e_ != cudaSuccess) {                                                                        \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                                 \
    }                                                                                               \
  } while (0)

// 0 when an SM90 device and backend are usable; otherwise prints why and returns 77 (ctest skip).
int skip_unless_sm90(const char* test);
int finish(const char* test);  // prints PASS/FAIL summary, returns 0 or 1

template <class T>
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t n) : n_(n) {
    if (n) GPU_CUDA(cudaMalloc(&p_, n * sizeof(T)));
  }
  ~DevBuf() {
    if (p_) cudaFree(p_);
  }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  std::vector<T> to_host() const {
    std::vector<T> h(n_);
    if (n_) GPU_CUDA(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void from_host(const std::vector<T>& h) {
    if (h.size() != n_) {
      std::printf("from_host size mismatch\n");
      std::exit(2);
    }
    if (n_) GPU_CUDA(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  void poison() {  // 0xFFFFFFFF: a NaN the kernels never write (they write the canonical 0x7FC00000)
    if (n_) GPU_CUDA(cudaMemset(p_, 0xFF, n_ * sizeof(T)));
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// Device-side generators (gpu_test_util.cu). Uniform in [-scale, scale), rounded to bf16.
void fill_bf16_uniform(uint16_t* p, int64_t n, uint64_t seed, float scale);
void fill_f32_uniform(float* p, int64_t n, uint64_t seed, float lo, float hi);
// dst[i][:] = src[idx[i]][:] for bf16 rows of `cols`, and for i32 scalars.
void gather_rows_bf16(uint16_t* dst, const uint16_t* src, const int64_t* idx, int64_t rows, int64_t cols);
// Counts rows i where logits[i][:] differs bitwise from base[idx[i]][:]; first mismatch reported.
struct RowMismatch {
  unsigned long long count = 0;
  long long first_flat = -1;  // i * cols + c
};
RowMismatch compare_logit_rows(const float* logits, const float* base, const int64_t* idx, int64_t rows, int64_t cols);
// Number of elements equal to the poison pattern 0xFFFFFFFF.
long long count_poison(const float* p, int64_t n);

// A device problem with owned inputs. hidden [pool][dim], weight [vocab][dim] (row stride = dim).
struct DeviceModel {
  int64_t dim = 0, vocab = 0;
  DevBuf<uint16_t> weight;
  DevBuf<float> bias;  // empty unless made
  void make(int64_t d, int64_t v, uint64_t seed, bool with_bias);
};

struct Outputs {
  DevBuf<float> logp, lse, logits;
  void make(int64_t n, int64_t v, bool serving) {
    logp = DevBuf<float>(n);
    lse = DevBuf<float>(n);
    logits = serving ? DevBuf<float>(n * v) : DevBuf<float>();
    logp.poison();
    lse.poison();
    if (serving) logits.poison();
  }
};

detlogp::detail::LogpProblem device_problem(const DeviceModel& m, const uint16_t* hidden, int64_t rows,
                                            const int32_t* targets, Outputs& out);

const detlogp::detail::Backend& sm90();
// Every SM90 launch bucket's DETLOGP_SM90_BUCKET name, in the launch table's order.
std::vector<std::string> sm90_bucket_names();

// Scoped environment variable.
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) {
      had_ = true;
      old_ = v;
    }
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~EnvGuard() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

inline float bf16f(uint16_t b) { return detlogp::bitcmp::float_from_bits(static_cast<uint32_t>(b) << 16); }

// float64 reference of one row: z (with bias), lse and logp at temperature T.
struct RefRow {
  std::vector<double> z;
  double lse = 0, logp = 0;
  std::vector<double> abs_dot;  // sum_k |h_k w_k| per column (error scale)
};
RefRow reference_row(const uint16_t* h, const std::vector<uint16_t>& w, const std::vector<float>* bias, int64_t dim,
                     int64_t vocab, int64_t real_vocab, double temperature, int64_t target);

inline bool same_bits(float a, float b) { return detlogp::bitcmp::float_bits(a) == detlogp::bitcmp::float_bits(b); }

// Runs fn over [0, n) on all hardware threads.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace gput

// Helpers for the SM90 GPU tests: the fixture that skips where no SM90 GPU is present, the
// command-line options of the tests' shared main, RAII device buffers, device-side random data and
// gathers, problem construction for the backend, output poisoning, and a float64 reference.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/problem.hpp"
#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/fpops.hpp"
#include "scoped_env.hpp"

namespace gput {

using detlogp_test::ScopedEnv;

// Test infrastructure errors end the test with the CUDA error named (they are not what is under
// test; gtest reports the exception as the test's failure).
#define GPU_CUDA(expr)                                                                                       \
  do {                                                                                                       \
    const cudaError_t e_ = (expr);                                                                           \
    if (e_ != cudaSuccess)                                                                                   \
      throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e_) + " at " + __FILE__ + ":" + \
                               std::to_string(__LINE__) + ": " + #expr);                                     \
  } while (0)

// Empty when an SM90 device and backend are usable; otherwise why not (no CUDA device, the
// device's compute capability, or the backend's own reason). Probed once.
const std::string& sm90_skip_reason();
// The device the tests run on, in words (the backend's description), or the skip reason.
std::string sm90_device_description();

// Base of every GPU test: skipped, with the reason, where no SM90 GPU is present.
class Sm90Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!sm90_skip_reason().empty()) GTEST_SKIP() << sm90_skip_reason();
  }
};

// The options of the GPU tests' shared main (gpu_test_main.cpp), after gtest's own flags.
struct Options {
  bool small = false;  // --small: shapes fast enough for compute-sanitizer
  bool nccl = true;    // --no-nccl: leave out the multi-GPU NCCL part
};
Options& options();

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
    if (h.size() != n_) throw std::length_error("DevBuf::from_host: size mismatch");
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

// A vocabulary shard [start, start + count) of a DeviceModel's head with its own copy of the weight
// rows (and bias), as a tensor-parallel rank holds them.
struct DeviceShard {
  DevBuf<uint16_t> weight;
  DevBuf<float> bias;  // empty unless the model has one
  int64_t start = 0, count = 0;
};

// The shards [bounds[r], bounds[r + 1]) of m's head.
std::vector<DeviceShard> make_shards(const DeviceModel& m, const std::vector<int64_t>& bounds);

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

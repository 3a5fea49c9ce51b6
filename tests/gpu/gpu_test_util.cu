#include <algorithm>
#include <atomic>
#include <thread>

#include "gpu_test_util.hpp"
#include "sm90/launch_table.hpp"
#include "test_random.hpp"

namespace gput {
namespace {

__global__ void fill_bf16_kernel(uint16_t* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    p[i] = detlogp::fp::bf16_round((detlogp_test::unit_float_at(seed, i) * 2.0f - 1.0f) * scale);
}

__global__ void fill_f32_kernel(float* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    p[i] = lo + (hi - lo) * detlogp_test::unit_float_at(seed, i);
}

__global__ void gather_kernel(uint16_t* dst, const uint16_t* src, const int64_t* idx, int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[r * cols + c] = src[idx[r] * cols + c];
}

__global__ void compare_rows_kernel(const float* a, const float* base, const int64_t* idx, int64_t rows, int64_t cols,
                                    unsigned long long* count, unsigned long long* first) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      if (__float_as_uint(a[r * cols + c]) != __float_as_uint(base[idx[r] * cols + c])) {
        atomicAdd(count, 1ull);
        atomicMin(first, static_cast<unsigned long long>(r * cols + c));
      }
    }
}

__global__ void count_poison_kernel(const float* p, int64_t n, unsigned long long* count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    if (__float_as_uint(p[i]) == 0xFFFFFFFFu) atomicAdd(count, 1ull);
}

}  // namespace

const std::string& sm90_skip_reason() {
  static const std::string reason = [] {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      return std::string("no CUDA device (") + (e == cudaSuccess ? "device count 0" : cudaGetErrorName(e)) + ")";
    }
    int dev = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return std::string("could not query the current CUDA device");
    }
    if (prop.major * 10 + prop.minor != 90)
      return "CUDA device " + std::to_string(dev) + " (" + prop.name + ") has compute capability " +
             std::to_string(prop.major) + "." + std::to_string(prop.minor) + "; these tests need 9.0 (SM90)";
    std::string why;
    if (!sm90().available(&why)) return "SM90 backend unavailable: " + why;
    return std::string();
  }();
  return reason;
}

std::string sm90_device_description() {
  if (!sm90_skip_reason().empty()) return "skipped: " + sm90_skip_reason();
  std::string device;
  sm90().available(&device);
  return device;
}

Options& options() {
  static Options o;
  return o;
}

void fill_bf16_uniform(uint16_t* p, int64_t n, uint64_t seed, float scale) {
  fill_bf16_kernel<<<1024, 256>>>(p, n, seed, scale);
  GPU_CUDA(cudaGetLastError());
}
void fill_f32_uniform(float* p, int64_t n, uint64_t seed, float lo, float hi) {
  fill_f32_kernel<<<1024, 256>>>(p, n, seed, lo, hi);
  GPU_CUDA(cudaGetLastError());
}
void gather_rows_bf16(uint16_t* dst, const uint16_t* src, const int64_t* idx, int64_t rows, int64_t cols) {
  if (rows == 0) return;
  gather_kernel<<<static_cast<unsigned>(std::min<int64_t>(rows, 65535)), 256>>>(dst, src, idx, rows, cols);
  GPU_CUDA(cudaGetLastError());
}

RowMismatch compare_logit_rows(const float* logits, const float* base, const int64_t* idx, int64_t rows, int64_t cols) {
  DevBuf<unsigned long long> c(2);
  std::vector<unsigned long long> init = {0ull, ~0ull};
  c.from_host(init);
  compare_rows_kernel<<<static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), 65535)), 256>>>(
      logits, base, idx, rows, cols, c.get(), c.get() + 1);
  GPU_CUDA(cudaGetLastError());
  auto h = c.to_host();
  RowMismatch m;
  m.count = h[0];
  m.first_flat = h[0] ? static_cast<long long>(h[1]) : -1;
  return m;
}

long long count_poison(const float* p, int64_t n) {
  DevBuf<unsigned long long> c(1);
  GPU_CUDA(cudaMemset(c.get(), 0, sizeof(unsigned long long)));
  count_poison_kernel<<<1024, 256>>>(p, n, c.get());
  GPU_CUDA(cudaGetLastError());
  return static_cast<long long>(c.to_host()[0]);
}

void DeviceModel::make(int64_t d, int64_t v, uint64_t seed, bool with_bias) {
  dim = d;
  vocab = v;
  weight = DevBuf<uint16_t>(static_cast<size_t>(v * d));
  // |z| ~ 3 for |h| <= 1: w uniform with scale 9 / sqrt(D) (variance D * (1/3) * (s^2/3) = 9).
  fill_bf16_uniform(weight.get(), v * d, seed, static_cast<float>(9.0 / std::sqrt(static_cast<double>(d))));
  if (with_bias) {
    bias = DevBuf<float>(static_cast<size_t>(v));
    fill_f32_uniform(bias.get(), v, seed ^ 0xB1A5ull, -2.0f, 2.0f);
  } else {
    bias = DevBuf<float>();
  }
}

std::vector<DeviceShard> make_shards(const DeviceModel& m, const std::vector<int64_t>& bounds) {
  std::vector<DeviceShard> shards(bounds.size() - 1);
  for (size_t r = 0; r + 1 < bounds.size(); ++r) {
    DeviceShard& s = shards[r];
    s.start = bounds[r];
    s.count = bounds[r + 1] - bounds[r];
    s.weight = DevBuf<uint16_t>(static_cast<size_t>(s.count * m.dim));
    GPU_CUDA(cudaMemcpy(s.weight.get(), m.weight.get() + s.start * m.dim, static_cast<size_t>(s.count * m.dim) * 2,
                        cudaMemcpyDeviceToDevice));
    if (m.bias.size()) {
      s.bias = DevBuf<float>(static_cast<size_t>(s.count));
      GPU_CUDA(
          cudaMemcpy(s.bias.get(), m.bias.get() + s.start, static_cast<size_t>(s.count) * 4, cudaMemcpyDeviceToDevice));
    }
  }
  return shards;
}

detlogp::detail::LogpProblem device_problem(const DeviceModel& m, const uint16_t* hidden, int64_t rows,
                                            const int32_t* targets, Outputs& out) {
  detlogp::detail::LogpProblem p;
  p.rows = rows;
  p.dim = m.dim;
  p.vocab_local = m.vocab;
  p.real_vocab = m.vocab;
  p.vocab_start = 0;
  p.hidden = hidden;
  p.hidden_stride = m.dim;
  p.weight = m.weight.get();
  p.weight_stride = m.dim;
  p.bias = m.bias.size() ? m.bias.get() : nullptr;
  p.targets = targets;
  p.targets_i64 = false;
  p.memory = detlogp::Memory::cuda;
  p.logp = out.logp.get();
  p.lse = out.lse.get();
  p.logits = out.logits.size() ? out.logits.get() : nullptr;
  return p;
}

const detlogp::detail::Backend& sm90() { return detlogp::detail::sm90_contract_backend(); }

std::vector<std::string> sm90_bucket_names() {
  std::vector<std::string> names;
  for (int i = 0; i < detlogp::sm90::kBucketCount; ++i)
    names.emplace_back(detlogp::sm90::bucket_info(static_cast<detlogp::sm90::Bucket>(i)).name);
  return names;
}

RefRow reference_row(const uint16_t* h, const std::vector<uint16_t>& w, const std::vector<float>* bias, int64_t dim,
                     int64_t vocab, int64_t real_vocab, double temperature, int64_t target) {
  RefRow r;
  r.z.resize(static_cast<size_t>(vocab));
  r.abs_dot.resize(static_cast<size_t>(vocab));
  std::vector<double> hd(static_cast<size_t>(dim));
  for (int64_t k = 0; k < dim; ++k) hd[k] = detlogp::fp::bf16_to_float(h[k]);
  parallel_for(vocab, [&](int64_t v) {
    const uint16_t* wr = w.data() + v * dim;
    double s = 0, a = 0;
    for (int64_t k = 0; k < dim; ++k) {
      const double prod = hd[k] * static_cast<double>(detlogp::fp::bf16_to_float(wr[k]));
      s += prod;
      a += std::fabs(prod);
    }
    if (bias) s += (*bias)[v];
    r.z[v] = s;
    r.abs_dot[v] = a;
  });
  double mx = -INFINITY;
  for (int64_t v = 0; v < real_vocab; ++v) mx = std::max(mx, r.z[v] / temperature);
  double sum = 0;
  for (int64_t v = 0; v < real_vocab; ++v) sum += std::exp(r.z[v] / temperature - mx);
  r.lse = mx + std::log(sum);
  r.logp = target >= 0 ? std::min(0.0, r.z[target] / temperature - r.lse) : 0.0;
  return r;
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  const int64_t grain = std::max<int64_t>(1, n / (threads * 16));
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (;;) {
        const int64_t b = next.fetch_add(grain);
        if (b >= n) break;
        for (int64_t i = b; i < std::min(n, b + grain); ++i) fn(i);
      }
    });
  for (auto& th : pool) th.join();
}

}  // namespace gput

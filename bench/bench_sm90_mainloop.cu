// SM90 mainloop ceilings: the persistent TMA -> wgmma mainloops of the fused kernels with the
// epilogue left out, against cuBLAS's bf16 GEMM in the same run. It answers one question: which
// CTA tile can run the tensor cores as fast as cuBLAS once its epilogue is hidden? The shared-memory
// traffic count in docs/perf-notes.md ("What the numbers say") predicts 64 x 256 ping-pong tiles
// at most ~80 % of the tensor peak, 128 x 192 cooperative tiles ~93 %, 128 x 256 ~100 %.
//
// Kernels, all persistent with one CTA per SM, the production producer (pingpong_produce) and ring:
//   pingpong_64x256[_c2]  the forward's `prefill` / `prefill_c2` consumers (two warpgroups take
//                         alternate tiles, mainloops in tile order), no epilogue
//   coop_128xN[_c2]       both consumer warpgroups on every stage (64 rows each), as
//                         sm90_mainloop_coop_overlap.cuh without the slices, N = 192 or 256
// The accumulators are fenced and only compared with a sentinel after each tile (nothing is
// written), so every wgmma stays. Data: random bf16, as bench_sm90.
//
//   bench_sm90_mainloop [--n 4096] [--d 4096] [--v 151936] [--reps 20] [--csv out.csv]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "sm90/sm90_host.hpp"
#include "sm90/sm90_launch_persistent.cuh"
#include "sm90/sm90_mainloop_coop_overlap.cuh"
#include "sm90/sm90_mainloop_pingpong_tma_wgmma.cuh"

#ifndef DETLOGP_GIT_SHA
#define DETLOGP_GIT_SHA "unknown"
#endif

namespace {

using namespace detlogp_bench;
using namespace detlogp::sm90;

struct MainloopParams {
  int32_t k_blocks, m_tiles, n_tiles, group_m;
  float* sink;  // written only if an accumulator equals the sentinel (never, for finite data)
};

constexpr float kSentinel = -3.0e38f;

// The cooperative tile's configuration without the second accumulator set: member names as
// PingpongConfig, so pingpong_produce, RingSmem and the coop-overlap issue/retire helpers serve.
template <int BlockN, int Stages, int ClusterM>
struct CoopMainloopConfig {
  static constexpr int kTileRows = 128;
  static constexpr int kBlockN = BlockN;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = Stages;
  static constexpr int kThreads = 384;
  static constexpr int kAccRegs = BlockN / 2;
  static constexpr uint32_t kABytes = uint32_t(kTileRows) * kBlockK * 2;
  static constexpr uint32_t kBBytes = uint32_t(BlockN) * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr int kClusterM = ClusterM;
  static constexpr int kBSliceRows = BlockN / ClusterM;
  static constexpr uint32_t kBSliceBytes = uint32_t(kBSliceRows) * kBlockK * 2;
  static constexpr int kSmemBytes = int(Stages * kStageBytes) + 2 * Stages * 8 + 1024;
  static constexpr int kEntryRegs = 168;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kAccRegs <= 128 && BlockN % 64 == 0, "one m64nN accumulator set per consumer warpgroup");
  static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory limit of SM90");
  static_assert(kBSliceBytes % 1024 == 0, "whole swizzle atoms per weight slice");
  static_assert(kProducerRegs * 128 + 2 * kConsumerRegs * 128 <= kEntryRegs * kThreads, "setmaxnreg budget");
};

template <int N>
__device__ __forceinline__ void sink_tile(const float (&acc)[N], const MainloopParams& p) {
  if (acc[0] == kSentinel && acc[N - 1] == kSentinel) p.sink[threadIdx.x] = acc[1];
}

// The producer of both kernels: every tile of this CTA's walk, from row 0.
template <class Cfg>
__device__ __forceinline__ void produce_all(const RingSmem<Cfg>& ring, const CUtensorMap* map_hidden,
                                            const CUtensorMap* map_weight, const MainloopParams& p) {
  if (threadIdx.x == 0)
    pingpong_produce<Cfg>(map_hidden, map_weight, ring.a, ring.b, ring.full, ring.empty, p.k_blocks, 0, p.m_tiles,
                          p.n_tiles, p.group_m);
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    pingpong_mainloop_kernel(const __grid_constant__ CUtensorMap map_hidden,
                             const __grid_constant__ CUtensorMap map_weight, const MainloopParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  const auto ring = persistent_prologue<Cfg>(smem_raw, &map_hidden, &map_weight, 4 * Cfg::kClusterM, 2);
  uint64_t* mainloop_done = ring.empty + Cfg::kStages;
  warp_specialize<Cfg>([&] { produce_all<Cfg>(ring, &map_hidden, &map_weight, p); },
                       [&](int c) {
                         const TileWalk walk = make_tile_walk<Cfg>(p.m_tiles, p.n_tiles, p.group_m);
                         uint32_t n = 0;
                         for (int j = c, unit = walk.first + c * walk.stride; unit < walk.count;
                              j += 2, unit += 2 * walk.stride, ++n) {
                           if (j >= 1) ptx::mbar_wait(&mainloop_done[1 - c], (c == 1 ? n : n - 1) & 1u);
                           float acc[Cfg::kFragments][Cfg::kAccRegs];
                           const uint32_t it0 = static_cast<uint32_t>(j) * p.k_blocks;
                           pingpong_consume_issue<Cfg>(acc, ring.a, ring.b, ring.full, ring.empty, p.k_blocks, it0);
                           if (threadIdx.x % 32 == 0) ptx::mbar_arrive(&mainloop_done[c]);
                           pingpong_consume_tail<Cfg>(acc, ring.empty, p.k_blocks, it0);
                           sink_tile(acc[0], p);
                         }
                       });
#endif
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    coop_mainloop_kernel(const __grid_constant__ CUtensorMap map_hidden, const __grid_constant__ CUtensorMap map_weight,
                         const MainloopParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  // Both consumer warpgroups release each stage.
  const auto ring = persistent_prologue<Cfg>(smem_raw, &map_hidden, &map_weight, 8 * Cfg::kClusterM);
  warp_specialize<Cfg>([&] { produce_all<Cfg>(ring, &map_hidden, &map_weight, p); },
                       [&](int c) {
                         const TileWalk walk = make_tile_walk<Cfg>(p.m_tiles, p.n_tiles, p.group_m);
                         const OverlapRing r{ring.a, c};
                         float acc[Cfg::kAccRegs];
                         uint32_t it = 0;
                         for (int unit = walk.first; unit < walk.count; unit += walk.stride) {
                           // K block 0 apart (the overwriting first k16 step), so every K block is one wgmma group.
                           overlap_issue<Cfg, 1>(acc, r, it, true);
                           overlap_retire<Cfg>(acc, r, it, 0);
                           ++it;
                           for (int kb = 1; kb < p.k_blocks; ++kb, ++it) {
                             overlap_issue<Cfg, 0>(acc, r, it, false);
                             overlap_retire<Cfg>(acc, r, it, kb);
                           }
                           ptx::wgmma_wait<0>();
#pragma unroll
                           for (int i = 0; i < Cfg::kAccRegs; ++i) ptx::fence_operand(acc[i]);
                           release_stage<Cfg>(r.empty<Cfg>(), (it - 1) % Cfg::kStages, threadIdx.x % 32);
                           sink_tile(acc, p);
                         }
                       });
#endif
}

struct Problem {
  int64_t n, d, v;
  const uint16_t* hidden;
  const uint16_t* weight;
  float* sink;
  int sms;
};

// Launches Kernel (configuration Cfg) over the whole [n, v] output.
template <auto Kernel, class Cfg>
void launch_mainloop(const Problem& pr, const CUtensorMap& mh, const CUtensorMap& mw) {
  MainloopParams p{};
  p.k_blocks = static_cast<int32_t>((pr.d + 63) / 64);
  p.m_tiles = static_cast<int32_t>((pr.n + Cfg::kTileRows - 1) / Cfg::kTileRows);
  p.n_tiles = static_cast<int32_t>((pr.v + Cfg::kBlockN - 1) / Cfg::kBlockN);
  p.group_m = std::max(1, 2048 / Cfg::kTileRows);  // as the library: ~2048 rows of hidden per weight pass
  p.sink = pr.sink;
  const int64_t units = (int64_t{p.m_tiles} + Cfg::kClusterM - 1) / Cfg::kClusterM * p.n_tiles;
  launch_persistent<Kernel, Cfg>(units, pr.sms, nullptr, mh, mw, p);
}

struct Method {
  std::string name;
  std::function<void()> fn;
};

template <auto Kernel, class Cfg>
Method mainloop_method(const char* name, const Problem& pr) {
  const CUtensorMap mh = encode_bf16_map(pr.hidden, pr.n, pr.d, pr.d, Cfg::kTileRows, "hidden");
  // Promotion as the library's ping-pong buckets: 256 B for hidden (the default), none for weight.
  const CUtensorMap mw = encode_bf16_map(pr.weight, pr.v, pr.d, pr.d, Cfg::kBlockN / Cfg::kClusterM, "weight", 0);
  return {name, [pr, mh, mw] { launch_mainloop<Kernel, Cfg>(pr, mh, mw); }};
}

using Pingpong = PingpongConfig<64, 256, 5>;
using PingpongC2 = PingpongConfig<64, 256, 5, 64, 2>;
using Coop192 = CoopMainloopConfig<192, 5, 1>;
using Coop192C2 = CoopMainloopConfig<192, 5, 2>;
using Coop256 = CoopMainloopConfig<256, 4, 1>;
using Coop256C2 = CoopMainloopConfig<256, 4, 2>;

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 4096, d = 4096, v = 151936;
  int reps = 20;
  std::string csv;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--n")
      n = std::strtoll(next(), nullptr, 10);
    else if (a == "--d")
      d = std::strtoll(next(), nullptr, 10);
    else if (a == "--v")
      v = std::strtoll(next(), nullptr, 10);
    else if (a == "--reps")
      reps = std::atoi(next());
    else if (a == "--csv")
      csv = next();
    else {
      std::fprintf(stderr, "usage: %s [--n N] [--d D] [--v V] [--reps K] [--csv out.csv]\n", argv[0]);
      return 2;
    }
  }
  if (n <= 0 || d <= 0 || d % 8 != 0 || v <= 0 || reps <= 0) {
    std::fprintf(stderr, "bench_sm90_mainloop: need N, V > 0, D > 0 a multiple of 8 (TMA rows), reps > 0\n");
    return 2;
  }
  int dev = 0, major = 0, minor = 0, count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    std::printf("SKIP bench_sm90_mainloop: no usable CUDA device (%s)\n",
                e != cudaSuccess ? cudaGetErrorName(e) : "no device");
    return 0;
  }
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9) {
    std::printf("SKIP bench_sm90_mainloop: needs an SM90 GPU (this device is sm_%d%d)\n", major, minor);
    return 0;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));

  uint16_t *hidden = nullptr, *weight = nullptr, *out_bf16 = nullptr;
  float* sink = nullptr;
  CK(cudaMalloc(&hidden, n * d * 2));
  CK(cudaMalloc(&weight, v * d * 2));
  CK(cudaMalloc(&out_bf16, n * v * 2));
  CK(cudaMalloc(&sink, 4096));
  fill_bf16<<<1024, 256>>>(hidden, n * d, 1, 1.0f);
  fill_bf16<<<1024, 256>>>(weight, v * d, 2, 0.05f);
  CK(cudaGetLastError());
  cublasHandle_t cublas;
  CB(cublasCreate(&cublas));
  const Problem pr{n, d, v, hidden, weight, sink, prop.multiProcessorCount};

  std::vector<Method> methods;
  methods.push_back({"cublas_gemm_bf16out", [&] {
                       const float alpha = 1.0f, beta = 0.0f;
                       CB(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(v), static_cast<int>(n),
                                       static_cast<int>(d), &alpha, weight, CUDA_R_16BF, static_cast<int>(d), hidden,
                                       CUDA_R_16BF, static_cast<int>(d), &beta, out_bf16, CUDA_R_16BF,
                                       static_cast<int>(v), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                     }});
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong>, Pingpong>("mainloop_pingpong_64x256", pr));
  methods.push_back(
      mainloop_method<pingpong_mainloop_kernel<PingpongC2>, PingpongC2>("mainloop_pingpong_64x256_c2", pr));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop192>, Coop192>("mainloop_coop_128x192", pr));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop192C2>, Coop192C2>("mainloop_coop_128x192_c2", pr));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256>, Coop256>("mainloop_coop_128x256", pr));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256C2>, Coop256C2>("mainloop_coop_128x256_c2", pr));

  Timer timer;
  std::vector<std::function<void()>> fns;
  for (const auto& m : methods) fns.push_back(m.fn);
  const std::vector<double> med = timer.interleaved_medians(fns, reps);
  CK(cudaDeviceSynchronize());

  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const double flops = 2.0 * n * v * d;
  std::printf("bench_sm90_mainloop on %s (%d SMs), N=%lld D=%lld V=%lld, %d reps, git %s, %s\n", prop.name,
              prop.multiProcessorCount, (long long)n, (long long)d, (long long)v, reps, DETLOGP_GIT_SHA, date);
  std::printf("%-30s %10s %9s %10s %8s %6s %s\n", "method", "ms", "TFLOP/s", "vs_cublas", "SM_MHz", "W", "reasons");
  FILE* f = csv.empty() ? nullptr : std::fopen(csv.c_str(), "w");
  if (!csv.empty() && f == nullptr) std::fprintf(stderr, "cannot write %s\n", csv.c_str());
  if (f != nullptr)
    std::fprintf(f,
                 "gpu,cuda_runtime,driver,git_sha,date,command,N,D,V,method,ms_median,tflops,ratio_vs_cublas_bf16out,"
                 "sm_mhz_mean,power_w_mean,clock_event_reasons\n");
  for (size_t i = 0; i < methods.size(); ++i) {
    const double ratio = med[i] / med[0];
    std::printf("%-30s %10.4f %9.1f %10.3f %8.0f %6.0f 0x%llx\n", methods[i].name.c_str(), med[i],
                flops / (med[i] * 1e-3) / 1e12, ratio, timer.mhz[i], timer.watts[i], timer.reasons[i]);
    if (f != nullptr)
      std::fprintf(f,
                   "\"%s\",%d,%d,%s,%s,\"bench_sm90_mainloop --n %lld --d %lld --v %lld --reps %d\",%lld,%lld,%lld,%s,"
                   "%.5f,%.2f,%.4f,%.0f,%.0f,0x%llx\n",
                   prop.name, runtime, driver, DETLOGP_GIT_SHA, date, (long long)n, (long long)d, (long long)v, reps,
                   (long long)n, (long long)d, (long long)v, methods[i].name.c_str(), med[i],
                   flops / (med[i] * 1e-3) / 1e12, ratio, timer.mhz[i], timer.watts[i], timer.reasons[i]);
  }
  if (f != nullptr) std::fclose(f);
  CB(cublasDestroy(cublas));
  CK(cudaFree(hidden));
  CK(cudaFree(weight));
  CK(cudaFree(out_bf16));
  CK(cudaFree(sink));
  return 0;
}

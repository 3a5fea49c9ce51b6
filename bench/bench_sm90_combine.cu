// The full-mode combine alone (the contract chain over each row's tile summaries), its schedules
// side by side on synthetic summaries: one CTA per row (chain_row_cta, and chain_row_cta_held with
// the row's tiles held in registers) and 1 / 2 / 4 / 8 rows per CTA with one chain per lane
// (chain_rows_lanes). Every schedule's logp / lse must match
// the CTA schedule's bits (else it exits 1). Times: CUDA events, median of --reps, L2 flushed
// before each launch (--l2 warm: not flushed, so a shape's summaries come from L2 wherever they fit,
// as they would if the fused kernel left them there), all schedules of a shape timed round-robin.
//   bench_sm90_combine [--n 1,64,1024,4096,16384] [--tiles 594,1187,2374] [--reps 30] [--l2 cold|warm]
//                      [--trace on|off]  (on: the lanes schedule's phases per CTA, once per shape)
// (a row has V / 64 tiles: 2374 for Qwen3-8B's head, 1188 for its TP = 2 shard).
// Prints one line per (N, tiles, schedule): ms, us per row and CTAs resident per SM.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "detlogp/hash.hpp"
#include "sm90/device/combine_chain.cuh"

namespace {

using namespace detlogp;
using namespace detlogp::sm90;
using detlogp_bench::Timer;

__global__ void __launch_bounds__(kCombineCtaThreads) cta_kernel(const CombineParams p) {
  if (p.status->code != kStatusOk) return;
  const MergeSegment whole{p.summaries, p.tiles, p.target_logit, nullptr};
  chain_row_cta(&whole, 1, blockIdx.x, p.row_begin + blockIdx.x, p.targets, p.targets_i64, p.ignore_index,
                p.targets_per_row, p.logp, p.lse);
}

// One CTA per row with the row's tiles held in registers (chain_row_cta_held).
__global__ void __launch_bounds__(kCombineCtaThreads) cta_held_kernel(const CombineParams p) {
  if (p.status->code != kStatusOk) return;
  const MergeSegment whole{p.summaries, p.tiles, p.target_logit, nullptr};
  chain_row_cta_held(&whole, 1, blockIdx.x, p.row_begin + blockIdx.x, p.targets, p.targets_i64, p.ignore_index,
                     p.targets_per_row, p.logp, p.lse);
}

template <int kRows>
__global__ void __launch_bounds__(kLanesThreads) lanes_kernel(const CombineParams p) {
  chain_rows_lanes<kRows>(p);
}

// The lanes schedule with its phase trace (--trace): per CTA, clock64 at the probe points of
// chain_rows_lanes (slot 0: the CTA's start), and %globaltimer at its start and at its chain's end.
inline constexpr int kTraceSlots = 136;
inline constexpr int kTraceStartNs = 134, kTraceEndNs = 135;
struct TraceProbe {
  long long* out;
  __device__ __forceinline__ void operator()(int slot, float dep = 0.0f) const {
    asm volatile("" ::"f"(dep));
    out[blockIdx.x * kTraceSlots + slot] = clock64();
    if (slot == kProbeChainEnd) out[blockIdx.x * kTraceSlots + kTraceEndNs] = static_cast<long long>(globaltimer_ns());
  }
  __device__ __forceinline__ static unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
  }
};
template <int kRows>
__global__ void __launch_bounds__(kLanesThreads) lanes_traced_kernel(const CombineParams p, long long* trace) {
  if (threadIdx.x == 0) {
    trace[blockIdx.x * kTraceSlots + kTraceStartNs] = static_cast<long long>(TraceProbe::globaltimer_ns());
    trace[blockIdx.x * kTraceSlots] = clock64();
  }
  chain_rows_lanes<kRows>(p, TraceProbe{trace});
}

// Percentiles over CTAs of each traced phase, in us from the CTA's start (cycles at the clock that
// the CTA's own start-to-end globaltimer span implies).
template <int kRows>
void print_trace(const CombineParams& p, int64_t tiles, Timer& timer) {
  const int64_t ctas = (p.rows + kRows - 1) / kRows;
  const int chunks = static_cast<int>((tiles + kLanesChunk - 1) / kLanesChunk);
  long long* trace = nullptr;
  CK(cudaMalloc(&trace, ctas * kTraceSlots * sizeof(long long)));
  CK(cudaMemset(trace, 0, ctas * kTraceSlots * sizeof(long long)));
  if (timer.flush_l2) CK(cudaMemsetAsync(timer.flush, 0x5A, timer.flush_bytes));
  lanes_traced_kernel<kRows><<<static_cast<unsigned>(ctas), kLanesThreads>>>(p, trace);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<long long> t(ctas * kTraceSlots);
  CK(cudaMemcpy(t.data(), trace, t.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  CK(cudaFree(trace));
  long long first_ns = t[kTraceStartNs];
  for (int64_t c = 0; c < ctas; ++c) first_ns = std::min(first_ns, t[c * kTraceSlots + kTraceStartNs]);
  auto pct = [](std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
  };
  std::vector<double> ghz, start_us, end_us;
  for (int64_t c = 0; c < ctas; ++c) {
    const long long* r = &t[c * kTraceSlots];
    const double ns = static_cast<double>(r[kTraceEndNs] - r[kTraceStartNs]);
    ghz.push_back(ns > 0 ? static_cast<double>(r[kProbeChainEnd] - r[0]) / ns : 0.0);
    start_us.push_back(static_cast<double>(r[kTraceStartNs] - first_ns) * 1e-3);
    end_us.push_back(static_cast<double>(r[kTraceEndNs] - first_ns) * 1e-3);
  }
  const double clock_ghz = pct(ghz, 0.5);
  auto phase = [&](int slot) {
    std::vector<double> v;
    for (int64_t c = 0; c < ctas; ++c)
      v.push_back(static_cast<double>(t[c * kTraceSlots + slot] - t[c * kTraceSlots]) / clock_ghz * 1e-3);
    return v;
  };
  std::printf("  trace lanes%d, N = %lld, %lld CTAs, clock %.2f GHz; us, p10 / p50 / p90 over CTAs\n", kRows,
              static_cast<long long>(p.rows), static_cast<long long>(ctas), clock_ghz);
  auto line = [&](const char* what, const std::vector<double>& v) {
    std::printf("    %-34s %8.2f %8.2f %8.2f\n", what, pct(v, 0.1), pct(v, 0.5), pct(v, 0.9));
  };
  line("CTA start (from the first CTA's)", start_us);
  line("CTA chain end (from the first start)", end_us);
  line("max pass done", phase(kProbeMaxDone));
  const int shown = std::min(chunks, 32);
  for (int c = 0; c < shown; ++c) {
    if (c > 2 && c + 2 < shown && c % 4 != 0) continue;
    char what[64];
    std::snprintf(what, sizeof what, "stage %d: factors handed over", c);
    line(what, phase(kProbeFactorChunk + c));
    std::snprintf(what, sizeof what, "stage %d: factor thread 0 may write", c);
    line(what, phase(kProbeFactorWoke + c));
    std::snprintf(what, sizeof what, "stage %d: chain has it", c);
    line(what, phase(kProbeChainChunk + c));
    std::snprintf(what, sizeof what, "stage %d: chain done with it", c);
    line(what, phase(kProbeChainDone + c));
  }
  line("chain done", phase(kProbeChainEnd));
}

// Summaries like the fused kernel's: maxima around 12 with a spread, sums in [1, 64], some tiles
// all -inf (sum 0), targets with some ignored rows.
__global__ void make_inputs(TileSummary* s, int64_t count, float* y_t, int32_t* targets, int64_t rows, int64_t tiles) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t z = detlogp::mix64(detlogp::kSplitMixGamma * static_cast<uint64_t>(i + 1));
    const float u = static_cast<float>(z >> 40) * 0x1p-24f;
    const float w = static_cast<float>((z >> 8) & 0xFFFF) * 0x1p-16f;
    if ((z & 0x3FF) == 7) {
      s[i] = TileSummary{-INFINITY, 0.0f};
    } else {
      s[i] = TileSummary{12.0f + 6.0f * (u - 0.5f), 1.0f + 63.0f * w};
    }
    if (i < rows) {
      y_t[i] = 10.0f + u;
      targets[i] = (i % 16 == 5) ? -100 : static_cast<int32_t>(z % static_cast<uint64_t>(tiles * 256));
    }
  }
}

struct Schedule {
  const char* name;
  const void* kernel;
  int threads;
  int rows_per_cta;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ns = {1, 64, 1024, 4096, 16384};
  std::vector<int64_t> tile_counts = {594, 1187, 2374};
  int reps = 30;
  bool warm = false;
  bool trace = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--n"))
      ns = detlogp_bench::parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tiles"))
      tile_counts = detlogp_bench::parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps"))
      reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--trace") && (!std::strcmp(argv[i + 1], "on") || !std::strcmp(argv[i + 1], "off")))
      trace = !std::strcmp(argv[i + 1], "on");
    else if (!std::strcmp(argv[i], "--l2") && (!std::strcmp(argv[i + 1], "cold") || !std::strcmp(argv[i + 1], "warm")))
      warm = !std::strcmp(argv[i + 1], "warm");
    else {
      std::fprintf(stderr, "bench_sm90_combine: unknown option '%s %s'\n", argv[i], argv[i + 1]);
      return 2;
    }
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const std::vector<Schedule> schedules = {
      {"cta_per_row", reinterpret_cast<const void*>(cta_kernel), kCombineCtaThreads, 1},
      {"cta_held", reinterpret_cast<const void*>(cta_held_kernel), kCombineCtaThreads, 1},
      {"lanes1", reinterpret_cast<const void*>(lanes_kernel<1>), kLanesThreads, 1},
      {"lanes2", reinterpret_cast<const void*>(lanes_kernel<2>), kLanesThreads, 2},
      {"lanes4", reinterpret_cast<const void*>(lanes_kernel<4>), kLanesThreads, 4},
      {"lanes8", reinterpret_cast<const void*>(lanes_kernel<8>), kLanesThreads, 8},
  };
  Timer timer;
  timer.flush_l2 = !warm;
  std::printf("L2 %s before each launch\n", warm ? "not flushed (warm)" : "flushed (cold)");
  bool all_identical = true;
  std::printf("%-7s %-6s %-24s %10s %10s %8s %5s %s\n", "N", "tiles", "schedule", "ms", "us/row", "CTA/SM", "regs",
              "bits vs cta_per_row");
  for (int64_t tiles : tile_counts) {
    for (int64_t n : ns) {
      const int64_t count = n * tiles;
      TileSummary* sums = nullptr;
      float *y_t = nullptr, *logp = nullptr, *lse = nullptr;
      int32_t* targets = nullptr;
      DeviceStatus* status = nullptr;
      CK(cudaMalloc(&sums, count * sizeof(TileSummary)));
      CK(cudaMalloc(&y_t, n * 4));
      CK(cudaMalloc(&targets, n * 4));
      CK(cudaMalloc(&logp, n * 4 * schedules.size()));
      CK(cudaMalloc(&lse, n * 4 * schedules.size()));
      CK(cudaMalloc(&status, sizeof(DeviceStatus)));
      CK(cudaMemset(status, 0, sizeof(DeviceStatus)));  // kStatusOk
      make_inputs<<<1024, 256>>>(sums, count, y_t, targets, n, tiles);
      CK(cudaGetLastError());
      std::vector<std::function<void()>> fns;
      std::vector<CombineParams> params(schedules.size());
      for (size_t k = 0; k < schedules.size(); ++k) {
        CombineParams& p = params[k];
        p = CombineParams{0,           n,       tiles,   sums,  y_t, targets, 0, -100, logp + k * n,
                          lse + k * n, nullptr, nullptr, status};
        const Schedule& s = schedules[k];
        const unsigned grid = static_cast<unsigned>((n + s.rows_per_cta - 1) / s.rows_per_cta);
        fns.push_back([&, k, grid] {
          void* args[] = {&params[k]};
          CK(cudaLaunchKernel(schedules[k].kernel, dim3(grid), dim3(schedules[k].threads), args, 0, nullptr));
        });
      }
      const std::vector<double> ms = timer.interleaved_medians(fns, reps);
      std::vector<float> ref_logp(n), ref_lse(n), got_logp(n), got_lse(n);
      CK(cudaMemcpy(ref_logp.data(), logp, n * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ref_lse.data(), lse, n * 4, cudaMemcpyDeviceToHost));
      for (size_t k = 0; k < schedules.size(); ++k) {
        CK(cudaMemcpy(got_logp.data(), logp + k * n, n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(got_lse.data(), lse + k * n, n * 4, cudaMemcpyDeviceToHost));
        int64_t first = -1;
        for (int64_t i = 0; i < n && first < 0; ++i)
          if (std::memcmp(&got_logp[i], &ref_logp[i], 4) || std::memcmp(&got_lse[i], &ref_lse[i], 4)) first = i;
        all_identical = all_identical && first < 0;
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, schedules[k].kernel, schedules[k].threads, 0));
        cudaFuncAttributes fa{};
        CK(cudaFuncGetAttributes(&fa, schedules[k].kernel));
        char bits[96];
        if (first < 0)
          std::snprintf(bits, sizeof bits, "identical (%lld rows)", static_cast<long long>(n));
        else
          std::snprintf(bits, sizeof bits, "DIFFER first at row %lld: lse %a vs %a", static_cast<long long>(first),
                        got_lse[first], ref_lse[first]);
        std::printf("%-7lld %-6lld %-24s %10.4f %10.4f %8d %5d %s\n", static_cast<long long>(n),
                    static_cast<long long>(tiles), schedules[k].name, ms[k], ms[k] * 1e3 / static_cast<double>(n),
                    per_sm, fa.numRegs, bits);
      }
      if (trace) {
        CombineParams tp = params[0];
        tp.logp = logp;  // the reference schedule's outputs: same bits
        tp.lse = lse;
        print_trace<4>(tp, tiles, timer);
        print_trace<8>(tp, tiles, timer);
      }
      CK(cudaFree(sums));
      CK(cudaFree(y_t));
      CK(cudaFree(targets));
      CK(cudaFree(logp));
      CK(cudaFree(lse));
      CK(cudaFree(status));
    }
  }
  std::printf("%s (%d SMs)\n", all_identical ? "Passed: every schedule matches the CTA schedule's bits" : "FAILED",
              sms);
  return all_identical ? 0 : 1;
}

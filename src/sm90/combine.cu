// The per-row kernels around the fused kernel and their launches: the contract chain over a
// row's tile summaries (the full-mode combine, and the tensor-parallel merge over rank-ordered
// partials, device_merge of core/device_ops.hpp) and target ownership flags (partial mode).
// No atomics anywhere.
#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "core/device_ops.hpp"
#include "cuda/check.hpp"
#include "cuda/device.hpp"
#include "detlogp/detlogp.hpp"
#include "sm90/combine.hpp"
#include "sm90/device/combine_chain.cuh"
#include "sm90/device/ptx.cuh"
#include "sm90/launch_dependent.cuh"

namespace detlogp::sm90 {
namespace {

// Up to this many rows a CTA per row with the tiles held in registers (latency-bound); above, the
// schedules that keep more rows in flight per SM (bench_sm90_combine, 1024 rows: 45 us against the
// lanes schedule's 26).
constexpr int64_t kCombineHeldMaxRows = 256;

// Before a combine CTA waits for the fused grid: its `rows` rows of summaries (consecutive in
// memory) into L2. A CTA that starts on a multiprocessor the fused kernel's tail has freed then
// finds them there after the wait; the fused kernel's later stores to those lines land in L2 too,
// so the hint changes no value read.
__device__ __forceinline__ void prefetch_rows_l2(const CombineParams& p, int64_t first_row, int64_t rows) {
  if (threadIdx.x != 0 || rows <= 0) return;
  const TileSummary* begin = p.summaries + first_row * p.tiles;
  const int64_t bytes = rows * p.tiles * int64_t{sizeof(TileSummary)};
  if (reinterpret_cast<uintptr_t>(begin) % 16 == 0 && bytes < (int64_t{1} << 32))
    ptx::prefetch_l2_bulk(begin, static_cast<uint32_t>(bytes) & ~15u);
}

// The full-mode combine, kRows rows per CTA, one chain per lane (device/combine_chain.cuh). When
// launched as a programmatic dependent of the fused kernel its CTAs may start during the fused
// kernel's tail; this waits for the whole fused grid and its memory (a no-op for a plain launch).
// kEntropy: with the entropy chains beside.
template <int kRows, bool kEntropy>
__global__ void __launch_bounds__(kLanesThreads) combine_rows_lanes_kernel(const CombineParams p) {
  const int64_t first_row = int64_t{blockIdx.x} * kRows;
  prefetch_rows_l2(p, first_row, p.rows - first_row < kRows ? p.rows - first_row : kRows);
  ptx::grid_dependency_wait();
  ptx::launch_dependents();  // a row kernel after it may start now and wait for it
  chain_rows_lanes<kRows, kEntropy>(p);
}

// The full-mode combine one CTA per row, the row's tiles held in registers (few rows: latency;
// kEntropy: with the entropy chains beside).
template <bool kEntropy>
__global__ void __launch_bounds__(kCombineCtaThreads) combine_rows_cta_kernel(const CombineParams p) {
  prefetch_rows_l2(p, blockIdx.x, 1);
  ptx::grid_dependency_wait();
  ptx::launch_dependents();  // a row kernel after it may start now and wait for it
  if (p.status->code != kStatusOk) return;
  const MergeSegment whole{p.summaries, p.tiles, p.target_logit, nullptr, p.usums, nullptr, nullptr};
  chain_row_cta_held<kHeldTiles, 16, kEntropy>(&whole, 1, blockIdx.x, p.row_begin + blockIdx.x, p.targets,
                                               p.targets_i64, p.ignore_index, p.targets_per_row, p.logp, p.lse,
                                               p.entropy);
}

// The tensor-parallel merge one CTA per row: tiles held in registers for few rows (latency), the
// 32-register chunked form for many (more CTAs resident). kHeads: some rank completes a tile that
// straddles its start (a shard boundary off the tile grid).
static_assert(sizeof(MergeParams) <= 4096, "merge parameters must fit the 4 KiB kernel parameter space");
template <bool kEntropy, bool kHeads>
__global__ void __launch_bounds__(kCombineCtaThreads) merge_rows_held_kernel(const __grid_constant__ MergeParams p) {
  chain_row_cta_held<kHeldTiles, 16, kEntropy, kHeads>(p.segments, p.count, blockIdx.x, blockIdx.x, p.targets,
                                                       p.targets_i64, p.ignore_index, p.targets_per_row, p.logp, p.lse,
                                                       p.entropy);
}
template <bool kEntropy, bool kHeads>
__global__ void __launch_bounds__(kCombineCtaThreads) merge_rows_kernel(const __grid_constant__ MergeParams p) {
  chain_row_cta<kEntropy, kHeads>(p.segments, p.count, blockIdx.x, blockIdx.x, p.targets, p.targets_i64, p.ignore_index,
                                  p.targets_per_row, p.logp, p.lse, p.entropy);
}

// The straddling tiles' summaries, one thread per (row, tile): the lanes gathered from the ranks'
// edge lanes and summarized by the contract's tile functions (straddle_summary, as on the host).
static_assert(sizeof(StraddleParams) <= 4096, "straddle parameters must fit the 4 KiB kernel parameter space");
template <bool kEntropy>
__global__ void straddle_summaries_kernel(const __grid_constant__ StraddleParams p) {
  const int64_t row = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int k = static_cast<int>(blockIdx.y);
  if (row >= p.rows) return;
  const TileEntropySummary s = detail::straddle_summary<kEntropy>(p.tiles[k], p.runs, row);
  p.summaries[k * p.rows + row] = s.summary;
  if constexpr (kEntropy) p.usums[k * p.rows + row] = s.usum;
}

// Partial mode off the tile grid: the edge columns' z to bias, serving logits, y, edge lanes and
// y_t (EdgeLanesParams), one thread per (row, edge column); the same add_bias and scale_logit as
// the fused epilogue, so the same bits as its logits and y_t.
__global__ void edge_lanes_kernel(const EdgeLanesParams p) {
  if (p.status->code != kStatusOk) return;
  const int cols = p.head_cols + p.tail_lanes;
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= p.rows * cols) return;
  const int64_t row = i / cols;
  const int c = static_cast<int>(i - row * cols);
  const int64_t col = c < p.head_cols ? c : p.vocab_local - p.tail_lanes + (c - p.head_cols);
  float z = p.edge_z[i];
  if (p.bias != nullptr) z = add_bias(z, p.bias[col]);
  if (p.logits != nullptr) p.logits[row * p.vocab_local + col] = z;
  const float inv_t = p.temperature_rows ? inverse_temperature(p.temperature_rows[row]) : p.inv_temperature;
  const float y = scale_logit(z, inv_t);
  const int lanes = p.head_lanes + p.tail_lanes;
  if (c < p.head_lanes) p.edge_logits[row * lanes + c] = y;
  if (c >= p.head_cols) p.edge_logits[row * lanes + p.head_lanes + (c - p.head_cols)] = y;
  for (int k = 0; k < p.targets_per_row; ++k) {  // each target's single owner
    const int64_t i = row * p.targets_per_row + k;
    const int64_t t = load_target(p.targets, p.targets_i64, i);
    if (t != p.ignore_index && t == p.vocab_start + col) p.target_logit[i] = y;
  }
}

// Partial mode: ownership flags for every target entry ([rows][K]), +0 target logits for the
// entries this shard does not own (the owner's y_t is written by the fused kernel, disjoint entries).
__global__ void partial_owner_kernel(const PartialOwnerParams p) {
  if (p.status->code != kStatusOk) return;
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= p.rows * p.targets_per_row) return;
  const int64_t t = load_target(p.targets, p.targets_i64, i);
  const bool owned = t != p.ignore_index && t >= p.vocab_start && t < p.vocab_start + p.vocab_local;
  p.target_owned[i] = owned ? 1 : 0;
  if (!owned) p.target_logit[i] = 0.0f;
}

}  // namespace

namespace {

// What spread_dynamic_smem reads of a (kernel, device): the device's multiprocessors and shared
// memory limits, the kernel's static shared memory, and the dynamic size last set on it. Queried
// once per pair (cudaFuncGetAttributes alone cost ~3 us a call), under a lock: launches from several
// threads share them.
struct SpreadFacts {
  const void* kernel = nullptr;
  int device = -1;
  int64_t sms = 0, smem_per_sm = 0, reserved = 0, smem_optin = 0, static_smem = 0;
  int set_bytes = -1;  // the cudaFuncAttributeMaxDynamicSharedMemorySize this library last set (-1: none)
};
std::mutex spread_mutex;
std::vector<SpreadFacts> spread_facts;

SpreadFacts& spread_facts_of(const void* kernel, int device) {
  for (SpreadFacts& f : spread_facts)
    if (f.kernel == kernel && f.device == device) return f;
  int sms = 0, smem_per_sm = 0, reserved = 0, smem_optin = 0;
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attrs{};
  DETLOGP_CUDA_CHECK(cudaFuncGetAttributes(&attrs, kernel));
  spread_facts.push_back(SpreadFacts{kernel, device, sms, smem_per_sm, reserved, smem_optin,
                                     static_cast<int64_t>(attrs.sharedSizeBytes), -1});
  return spread_facts.back();
}

// The dynamic shared memory that lets at most `per_sm` CTAs of `kernel` share a multiprocessor
// (0 where its own footprint already does). A programmatic dependent's CTAs become resident as the
// fused kernel's CTAs leave their multiprocessors, and without a cap the first multiprocessors the
// fused kernel's tail frees take as many combine CTAs as fit (nine of the 40-register lanes CTA):
// the combine then runs on a fraction of the GPU.
size_t spread_dynamic_smem(const void* kernel, int64_t grid) {
  int device = 0;
  DETLOGP_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(spread_mutex);
  SpreadFacts& f = spread_facts_of(kernel, device);
  const int64_t per_sm = (grid + f.sms - 1) / f.sms;
  const int64_t own = f.static_smem + f.reserved;
  if ((per_sm + 1) * own > f.smem_per_sm) return 0;                  // its own footprint caps it already
  const int64_t footprint = (f.smem_per_sm / per_sm) / 1024 * 1024;  // (per_sm + 1) of them do not fit
  const int64_t limit = f.smem_optin - f.static_smem;
  const int64_t dynamic = footprint - own < limit ? footprint - own : limit;
  if (dynamic <= 0) return 0;
  const size_t bytes = static_cast<size_t>(dynamic);
  // The attribute is set to exactly the launch's size, as on every call before; only an unchanged
  // value is not set again.
  if (f.set_bytes != static_cast<int>(bytes)) {
    DETLOGP_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    f.set_bytes = static_cast<int>(bytes);
  }
  return bytes;
}

}  // namespace

void launch_combine(const CombineParams& p, cudaStream_t stream, bool programmatic) {
  DETLOGP_CHECK(p.rows < (int64_t{1} << 31), "combine grid of " << p.rows << " rows out of range");
  cudaLaunchConfig_t config{};
  config.stream = stream;
  cudaLaunchAttribute attr = programmatic_dependent_attribute();
  config.attrs = &attr;
  config.numAttrs = programmatic ? 1 : 0;
  // Schedules as measured by bench_sm90_combine (H200, 2374 tiles, cold L2): above kCombineHeldMaxRows rows, chains on
  // the lanes of a warp fed through shared memory, 4 rows per CTA up to 2048 rows (N = 1024: 22.6 us against 28.4 for a
  // CTA per row), 8 above (N = 4096: 52.8 us); up to kCombineHeldMaxRows a CTA per row with the tiles held in registers
  // (N = 1: 12.9 us against the lanes schedule's 16.8). As a programmatic dependent, each is capped at the CTAs per
  // multiprocessor that spread its grid over the GPU (spread_dynamic_smem: measured trainer N = 1024 1.052x -> 1.042x
  // of cuBLAS).
  auto launch = [&](auto kernel, int64_t grid, int threads) {
    config.gridDim = dim3(static_cast<unsigned>(grid));
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = programmatic ? spread_dynamic_smem(reinterpret_cast<const void*>(kernel), grid) : 0;
    DETLOGP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  };
  // The same schedules with the entropy output, each lane or thread running the chains of S, U and C.
  const bool entropy = p.entropy != nullptr;
  if (p.rows > 2048)
    launch(entropy ? combine_rows_lanes_kernel<8, true> : combine_rows_lanes_kernel<8, false>, (p.rows + 7) / 8,
           kLanesThreads);
  else if (p.rows > kCombineHeldMaxRows)
    launch(entropy ? combine_rows_lanes_kernel<4, true> : combine_rows_lanes_kernel<4, false>, (p.rows + 3) / 4,
           kLanesThreads);
  else
    launch(entropy ? combine_rows_cta_kernel<true> : combine_rows_cta_kernel<false>, p.rows, kCombineCtaThreads);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_merge(const MergeParams& p, cudaStream_t stream) {
  DETLOGP_CHECK(p.rows < (int64_t{1} << 31), "merge grid of " << p.rows << " rows out of range");
  DETLOGP_CHECK(p.count >= 1 && p.count <= kMaxMergeSegments,
                "the device merge takes 1.." << kMaxMergeSegments << " ranks, got " << p.count);
  if (p.rows == 0) return;
  const dim3 grid(static_cast<unsigned>(p.rows));
  const bool held = p.rows <= kCombineHeldMaxRows;
  bool heads = false;
  for (int s = 0; s < p.count; ++s) heads = heads || p.segments[s].head != nullptr;
  auto run = [&](auto held_kernel, auto chunked_kernel) {
    if (held)
      held_kernel<<<grid, kCombineCtaThreads, 0, stream>>>(p);
    else
      chunked_kernel<<<grid, kCombineCtaThreads, 0, stream>>>(p);
  };
  // 64-aligned shards (no heads) keep the kernels without the head test.
  if (p.entropy != nullptr) {
    if (heads)
      run(merge_rows_held_kernel<true, true>, merge_rows_kernel<true, true>);
    else
      run(merge_rows_held_kernel<true, false>, merge_rows_kernel<true, false>);
  } else if (heads) {
    run(merge_rows_held_kernel<false, true>, merge_rows_kernel<false, true>);
  } else {
    run(merge_rows_held_kernel<false, false>, merge_rows_kernel<false, false>);
  }
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_straddle_summaries(const StraddleParams& p, cudaStream_t stream) {
  DETLOGP_CHECK(p.rows < (int64_t{1} << 31), "straddle grid of " << p.rows << " rows out of range");
  if (p.rows == 0 || p.count == 0) return;
  const dim3 grid(static_cast<unsigned>((p.rows + 127) / 128), static_cast<unsigned>(p.count));
  if (p.usums != nullptr)
    straddle_summaries_kernel<true><<<grid, 128, 0, stream>>>(p);
  else
    straddle_summaries_kernel<false><<<grid, 128, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_edge_lanes(const EdgeLanesParams& p, cudaStream_t stream) {
  const int64_t n = p.rows * (p.head_cols + p.tail_lanes);
  if (n == 0) return;
  edge_lanes_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_partial_owner(const PartialOwnerParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.rows * p.targets_per_row + 255) / 256;
  if (blocks == 0) return;
  partial_owner_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace detlogp::sm90

namespace detlogp::detail {

void device_merge(const std::vector<DeviceMergeRank>& ranks, int64_t rows, const void* targets, bool targets_i64,
                  int64_t ignore_index, float* logp, float* lse, int device, void* stream, float* entropy,
                  const StraddlePlan* straddles, int64_t targets_per_row) {
  DETLOGP_CHECK(targets_per_row >= 1 && targets_per_row <= kMaxTargetsPerRow,
                "the device merge takes 1.." << kMaxTargetsPerRow << " targets a row, got " << targets_per_row);
  DETLOGP_CHECK(!ranks.empty() && ranks.size() <= static_cast<size_t>(sm90::kMaxMergeSegments),
                "the device merge takes 1.." << sm90::kMaxMergeSegments << " ranks, got " << ranks.size());
  if (rows == 0) return;
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  sm90::MergeParams p{};
  p.rows = rows;
  p.count = static_cast<int32_t>(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    DETLOGP_CHECK(entropy == nullptr || ranks[r].tiles == 0 || ranks[r].usums != nullptr,
                  "the entropy merge needs every rank's entropy sums; rank " << r << " has none");
    p.segments[r] = sm90::MergeSegment{
        ranks[r].summaries, ranks[r].tiles, ranks[r].target_logit, ranks[r].owned, ranks[r].usums, nullptr, nullptr};
  }
  // The straddling tiles first, into a stream-ordered scratch buffer that lives until the merge
  // has read it (freed on the stream after the merge's launch).
  const size_t count = straddles ? straddles->tiles.size() : 0;
  std::unique_ptr<cuda::StreamBuffer> scratch;
  if (count > 0) {
    DETLOGP_CHECK(count <= static_cast<size_t>(sm90::kMaxMergeSegments) &&
                      straddles->runs.size() <= static_cast<size_t>(sm90::kMaxStraddleRuns),
                  "the device merge takes at most " << sm90::kMaxMergeSegments << " straddling tiles and "
                                                    << sm90::kMaxStraddleRuns << " edge runs, got " << count << " and "
                                                    << straddles->runs.size());
    const size_t summary_bytes = (count * static_cast<size_t>(rows) * sizeof(TileSummary) + 255) / 256 * 256;
    const size_t usum_bytes = entropy ? count * static_cast<size_t>(rows) * sizeof(float) : 0;
    scratch = std::make_unique<cuda::StreamBuffer>(summary_bytes + usum_bytes, s, device, "the straddling tiles");
    sm90::StraddleParams sp{};
    sp.rows = rows;
    sp.count = static_cast<int32_t>(count);
    std::copy(straddles->tiles.begin(), straddles->tiles.end(), sp.tiles);
    std::copy(straddles->runs.begin(), straddles->runs.end(), sp.runs);
    sp.summaries = reinterpret_cast<TileSummary*>(scratch->get());
    sp.usums = entropy ? reinterpret_cast<float*>(scratch->get() + summary_bytes) : nullptr;
    sm90::launch_straddle_summaries(sp, s);
    for (size_t k = 0; k < count; ++k) {
      sm90::MergeSegment& seg = p.segments[straddles->tiles[k].completed_by];
      seg.head = sp.summaries + k * static_cast<size_t>(rows);
      seg.head_usum = sp.usums ? sp.usums + k * static_cast<size_t>(rows) : nullptr;
    }
  }
  p.targets = targets;
  p.targets_i64 = targets_i64 ? 1 : 0;
  p.ignore_index = ignore_index;
  p.logp = logp;
  p.lse = lse;
  p.entropy = entropy;
  p.targets_per_row = static_cast<int32_t>(targets_per_row);
  sm90::launch_merge(p, s);
}

}  // namespace detlogp::detail

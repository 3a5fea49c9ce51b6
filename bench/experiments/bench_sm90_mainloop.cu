// SM90 mainloop ceilings: the persistent TMA -> wgmma mainloops of the fused kernels with the
// epilogue left out, against cuBLAS's bf16 GEMM in the same run. It answers one question: which
// CTA tile can run the tensor cores as fast as cuBLAS once its epilogue is hidden? (Measured on
// the H200: docs/perf.md, "Where the time goes"; the dated measurements in
// docs/history/perf-notes.md.)
//
// Kernels, all persistent with one CTA per SM, the production producer (pingpong_produce) and ring:
//   pingpong_64x256[_c2]  the forward's `prefill` / `prefill_c2` consumers (two warpgroups take
//                         alternate tiles, mainloops in tile order), no epilogue
//   coop_128xN[_c2]       both consumer warpgroups on every stage (64 rows each), as
//                         coop_overlap_mainloop.cuh without the slices, N = 192 or 256
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
#include "coop_overlap_mainloop.cuh"
#include "sm90/device/configs.cuh"
#include "sm90/device/epilogue_tile_summary.cuh"
#include "sm90/device/mainloop.cuh"
#include "sm90/launch_persistent.cuh"
#include "sm90/tma.hpp"

#ifndef DETLOGP_GIT_SHA
#define DETLOGP_GIT_SHA "unknown"
#endif

namespace {

using namespace detlogp_bench;
using namespace detlogp;
using namespace detlogp::sm90;

struct MainloopParams {
  int32_t k_blocks, m_tiles, n_tiles, group_m;
  float* sink;        // written only if an accumulator equals the sentinel (never, for finite data)
  uint64_t* stamps;   // null, or the phase timeline of the first kStampCtas CTAs (see Stamp)
  FusedParams fused;  // the epilogue kernels' output (trainer entry: summaries and y_t)
};

// Phase timeline (clock64 of the SM) of a consumer warpgroup's tile: before the ordering wait,
// after it, after the last K block's issue (hand-over), after the last wgmma, after the epilogue.
constexpr int kStampCtas = 8;
constexpr int kStampTiles = 512;
constexpr int kStampPoints = 5;
__host__ __device__ constexpr int64_t stamp_index(int cta, int wg, int tile, int point) {
  return ((int64_t{cta} * 2 + wg) * kStampTiles + tile) * kStampPoints + point;
}

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

// What a ping-pong consumer does with a finished tile: nothing (sink_tile), the production trainer
// epilogue (epilogue_tile_summaries, general or plain as the library launches it for the trainer
// entry; kPlainPerTile: the plain epilogue one vocab tile at a time, to compare with the
// whole-fragment form), or one ingredient of it alone, to tell which part slows the other
// warpgroup's mainloop: its shuffles (the plain epilogue's 18 per 16 values), its ALU work (16 FFMA
// per value), its summary stores (one 8-byte store per row and vocab tile).
enum class TileWork {
  kNone,
  kEpilogue,
  kPlainEpilogue,
  kPlainPerTile,
  kShufflesOnly,
  kAluOnly,
  kStoresOnly,
  kAlu512,
  kAlu1024,
  kAlu4096,
  kIntOnly,
  kAluLoop
};

// One whole vocab tile (all 64 lanes real) of the plain epilogue, row half h: the operations of
// epilogue_tile_summaries in the same order, with the per-lane tests that are constant over a
// whole tile hoisted out: no real-lane test, no logits store or bias (the caller has neither), and
// the target logit picked out of the 16 values only by the thread that owns it (one tile in V / 64
// per row), instead of a compare and a select on every value.
template <int BlockN>
__device__ __forceinline__ void plain_whole_tile_summary(const float (&acc)[BlockN / 2], int tt, int h,
                                                         const FusedParams& p, int64_t row, bool row_ok, float inv_t,
                                                         int64_t target_col, int64_t tile_col0, int64_t local_tile,
                                                         float& y_target, bool& owns) {
  const int q = (threadIdx.x % 32) % 4;
  float y[16];
  float m = fp::neg_inf();
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    y[i] = scale_logit(acc[(tt * 8 + i / 2) * 4 + 2 * h + i % 2], inv_t);
    m = fp::max_nan(m, y[i]);
  }
  // Column 8 jj + 2 q + e of the tile is value 2 jj + e of thread q.
  const int64_t rel = target_col - tile_col0;
  if (target_col >= 0 && rel >= 0 && rel < kVocabTile && ((rel >> 1) & 3) == q) {
    const int idx = static_cast<int>((rel >> 3) * 2 + (rel & 1));
    float v = y[0];
#pragma unroll
    for (int i = 1; i < 16; ++i) v = i == idx ? y[i] : v;
    y_target = v;
    owns = true;
  }
  float level[8];
  float x[16];
  bool normal = true;
  m = quad_max_and_offsets(y, m, x, normal);
  if (__all_sync(0xFFFFFFFFu, normal)) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) level[jj] = tree_add(expc_normal(x[2 * jj]), expc_normal(x[2 * jj + 1]));
  } else {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) level[jj] = tree_add(expc(x[2 * jj]), expc(x[2 * jj + 1]));
  }
  finish_tile_summary(level, m, p, row, row_ok, local_tile, q);
}

// The plain epilogue one (vocab tile, row half) at a time (plain_whole_tile_summary), the form the
// whole-fragment epilogue replaced: kept here to compare the two in one run.
template <int BlockN>
__device__ __forceinline__ void plain_per_tile_epilogue(float (&acc)[BlockN / 2], const FusedParams& p,
                                                        int64_t row_tile0, int64_t row_limit, int64_t col0) {
  const int t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  if (row_tile0 + 16 * warp >= row_limit) return;
  int64_t row[2], target_col[2];
  bool row_ok[2], owns[2] = {false, false};
  float inv_t[2], y_target[2] = {0.0f, 0.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = row_tile0 + 16 * warp + lane / 4 + 8 * h;
    row_ok[h] = row[h] < row_limit;
    inv_t[h] = 1.0f;
    target_col[h] = -1;
    if (row_ok[h]) {
      inv_t[h] = detlogp::inverse_temperature(p.temperature);
      const int64_t tgt = load_target(p.targets, p.targets_i64, row[h]);
      if (tgt != p.ignore_index) target_col[h] = tgt - p.vocab_start;
    }
  }
#pragma unroll
  for (int tt = 0; tt < BlockN / 64; ++tt) {
    const int64_t tile_col0 = col0 + 64 * tt, local_tile = tile_col0 / 64;
    if (local_tile >= p.local_tiles) break;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      plain_whole_tile_summary<BlockN>(acc, tt, h, p, row[h], row_ok[h], inv_t[h], target_col[h], tile_col0, local_tile,
                                       y_target[h], owns[h]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (owns[h]) p.target_logit[row[h] - p.row_begin] = y_target[h];
}

template <int N>
__device__ __forceinline__ void synthetic_work(TileWork w, const float (&acc)[N], const MainloopParams& p, int64_t row0,
                                               int64_t col0) {
  float r = 0.0f;
  if (w == TileWork::kShufflesOnly) {
#pragma unroll
    for (int slice = 0; slice < N / 16; ++slice) {
      float m = acc[16 * slice];
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v = acc[16 * slice + 2 * j] - m;
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
        r += v;
      }
    }
  } else if (w == TileWork::kAluOnly || w == TileWork::kAlu512 || w == TileWork::kAlu1024 || w == TileWork::kAlu4096) {
    // 16 (kAluOnly), 4, 8 or 32 dependent FFMA per accumulator: 2048, 512, 1024 or 4096 per thread.
    const int chain = w == TileWork::kAlu512 ? 4 : w == TileWork::kAlu1024 ? 8 : w == TileWork::kAlu4096 ? 32 : 16;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float v = acc[i];
#pragma unroll
      for (int k = 0; k < 32; ++k)
        if (k < chain) v = fmaf(v, 0.999f, 0.001f);
      r += v;
    }
  } else if (w == TileWork::kAluLoop) {
    // The 2048 FFMA of kAluOnly as a rolled loop of 16 steps of 128 (2 KB of code instead of 32 KB):
    // the same work, so any difference to kAluOnly is instruction fetch.
    float v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = acc[i];
#pragma unroll 1
    for (int k = 0; k < 16; ++k)
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = fmaf(v[i], 0.999f, 0.001f);
#pragma unroll
    for (int i = 0; i < N; ++i) r += v[i];
  } else if (w == TileWork::kIntOnly) {
    // ~3300 integer instructions per thread (8 xor-shift-multiply steps per accumulator): the
    // integer pipe instead of the fp32 one.
    uint32_t acc_bits = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      uint32_t v = __float_as_uint(acc[i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) v = (v ^ (v >> 7)) * 2654435761u;
      acc_bits ^= v;
    }
    r = __uint_as_float(acc_bits);
  } else if (w == TileWork::kStoresOnly) {
    const int t = threadIdx.x % 128;
    if (t % 4 == 0) {
#pragma unroll
      for (int slice = 0; slice < N / 16; ++slice) {
        const int64_t row = row0 + 16 * (t / 32) + (t % 32) / 4 + 8 * (slice % 2);
        const int64_t tile = col0 / 64 + slice / 2;
        if (row < p.fused.row_end && tile < p.fused.local_tiles)
          p.fused.summaries[row * p.fused.local_tiles + tile] =
              detlogp::TileSummary{acc[16 * slice], acc[16 * slice + 1]};
      }
    }
    return;
  }
  if (r == kSentinel) p.sink[threadIdx.x] = r;
}

template <class Cfg, TileWork kWork = TileWork::kNone>
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
                         const bool stamp = p.stamps != nullptr && blockIdx.x < kStampCtas && threadIdx.x % 128 == 0;
                         uint32_t n = 0;
                         for (int j = c, unit = walk.first + c * walk.stride; unit < walk.count;
                              j += 2, unit += 2 * walk.stride, ++n) {
                           uint64_t t[kStampPoints];
                           t[0] = clock64();
                           if (j >= 1) ptx::mbar_wait(&mainloop_done[1 - c], (c == 1 ? n : n - 1) & 1u);
                           t[1] = clock64();
                           float acc[Cfg::kFragments][Cfg::kAccRegs];
                           const uint32_t it0 = static_cast<uint32_t>(j) * p.k_blocks;
                           pingpong_consume_issue<Cfg>(acc, ring.a, ring.b, ring.full, ring.empty, p.k_blocks, it0);
                           if (threadIdx.x % 32 == 0) ptx::mbar_arrive(&mainloop_done[c]);
                           t[2] = clock64();
                           pingpong_consume_tail<Cfg>(acc, ring.empty, p.k_blocks, it0);
                           t[3] = clock64();
                           int m_tile, n_tile;
                           walk.coords(unit, m_tile, n_tile);
                           const int64_t row0 = int64_t{m_tile} * Cfg::kTileRows;
                           const int64_t col0 = int64_t{n_tile} * Cfg::kBlockN;
                           if constexpr (kWork == TileWork::kEpilogue || kWork == TileWork::kPlainEpilogue) {
                             const int64_t row_limit = min(p.fused.row_end, row0 + Cfg::kTileRows);
#pragma unroll
                             for (int f = 0; f < Cfg::kFragments; ++f)
                               epilogue_tile_summaries<Cfg::kBlockN, kWork == TileWork::kPlainEpilogue>(
                                   acc[f], p.fused, load_fragment_rows(p.fused, row0 + 64 * f, row_limit),
                                   row0 + 64 * f, row_limit, col0, false);
                           } else if constexpr (kWork == TileWork::kPlainPerTile) {
                             const int64_t row_limit = min(p.fused.row_end, row0 + Cfg::kTileRows);
#pragma unroll
                             for (int f = 0; f < Cfg::kFragments; ++f)
                               plain_per_tile_epilogue<Cfg::kBlockN>(acc[f], p.fused, row0 + 64 * f, row_limit, col0);
                           } else if constexpr (kWork == TileWork::kNone) {
                             sink_tile(acc[0], p);
                           } else {
                             synthetic_work(kWork, acc[0], p, row0, col0);
                           }
                           t[4] = clock64();
                           if (stamp && n < kStampTiles)
#pragma unroll
                             for (int k = 0; k < kStampPoints; ++k)
                               p.stamps[stamp_index(static_cast<int>(blockIdx.x), c, static_cast<int>(n), k)] = t[k];
                         }
                       });
#endif
}

// kWork: kNone (sink_tile) or kPlainEpilogue (each warpgroup runs the plain trainer epilogue of its
// 64 rows after the tile's last wgmma: not overlapped with tensor-core work, so it pays no fp32
// tax, but its whole latency is exposed).
template <class Cfg, TileWork kWork = TileWork::kNone>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    coop_mainloop_kernel(const __grid_constant__ CUtensorMap map_hidden, const __grid_constant__ CUtensorMap map_weight,
                         const MainloopParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kWork == TileWork::kNone || kWork == TileWork::kPlainEpilogue || kWork == TileWork::kAluOnly ||
                    kWork == TileWork::kAluLoop,
                "cooperative tile work");
  extern __shared__ uint8_t smem_raw[];
  // Both consumer warpgroups release each stage.
  const auto ring = persistent_prologue<Cfg>(smem_raw, &map_hidden, &map_weight, 8 * Cfg::kClusterM);
  warp_specialize<Cfg>([&] { produce_all<Cfg>(ring, &map_hidden, &map_weight, p); },
                       [&](int c) {
                         const TileWalk walk = make_tile_walk<Cfg>(p.m_tiles, p.n_tiles, p.group_m);
                         const bool stamp = p.stamps != nullptr && blockIdx.x < kStampCtas && threadIdx.x % 128 == 0;
                         const OverlapRing r{ring.a, c};
                         float acc[Cfg::kAccRegs];
                         uint32_t it = 0;
                         uint32_t n = 0;
                         for (int unit = walk.first; unit < walk.count; unit += walk.stride, ++n) {
                           int m_tile, n_tile;
                           walk.coords(unit, m_tile, n_tile);
                           const int64_t tile_row0 = int64_t{m_tile} * Cfg::kTileRows;
                           const int64_t row_limit = min(p.fused.row_end, tile_row0 + Cfg::kTileRows);
                           // As the library's kernel: the rows' inputs load before the K walk.
                           FragmentRows rows{};
                           if constexpr (kWork == TileWork::kPlainEpilogue)
                             rows = load_fragment_rows(p.fused, tile_row0 + 64 * c, row_limit);
                           const uint64_t t0 = clock64();
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
                           const uint64_t t1 = clock64();
                           if constexpr (kWork == TileWork::kPlainEpilogue) {
                             epilogue_tile_summaries<Cfg::kBlockN, true>(acc, p.fused, rows, tile_row0 + 64 * c,
                                                                         row_limit, int64_t{n_tile} * Cfg::kBlockN,
                                                                         false);
                           } else if constexpr (kWork == TileWork::kAluOnly || kWork == TileWork::kAluLoop) {
                             synthetic_work(kWork, acc, p, tile_row0 + 64 * c, int64_t{n_tile} * Cfg::kBlockN);
                           } else {
                             sink_tile(acc, p);
                           }
                           const uint64_t t2 = clock64();
                           if (stamp && n < kStampTiles) {
                             p.stamps[stamp_index(static_cast<int>(blockIdx.x), c, static_cast<int>(n), 0)] = t0;
                             p.stamps[stamp_index(static_cast<int>(blockIdx.x), c, static_cast<int>(n), 1)] = t1;
                             p.stamps[stamp_index(static_cast<int>(blockIdx.x), c, static_cast<int>(n), 4)] = t2;
                           }
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
  FusedParams fused;  // trainer-entry outputs for the epilogue kernels
};

// Launches Kernel (configuration Cfg) over the whole [n, v] output.
template <auto Kernel, class Cfg>
void launch_mainloop(const Problem& pr, const CUtensorMap& mh, const CUtensorMap& mw, uint64_t* stamps = nullptr) {
  MainloopParams p{};
  p.k_blocks = static_cast<int32_t>((pr.d + 63) / 64);
  p.m_tiles = static_cast<int32_t>((pr.n + Cfg::kTileRows - 1) / Cfg::kTileRows);
  p.n_tiles = static_cast<int32_t>((pr.v + Cfg::kBlockN - 1) / Cfg::kBlockN);
  p.group_m = std::max(1, 2048 / Cfg::kTileRows);  // as the library: ~2048 rows of hidden per weight pass
  p.sink = pr.sink;
  p.stamps = stamps;
  p.fused = pr.fused;
  p.fused.k_blocks = p.k_blocks;
  p.fused.m_tiles = p.m_tiles;
  p.fused.n_tiles = p.n_tiles;
  p.fused.group_m = p.group_m;
  const int64_t units = (int64_t{p.m_tiles} + Cfg::kClusterM - 1) / Cfg::kClusterM * p.n_tiles;
  launch_persistent<Kernel, Cfg>(units, pr.sms, nullptr, mh, mw, p);
}

struct Method {
  std::string name;
  std::function<void()> fn;
  std::function<void(uint64_t*)> stamped;  // one launch recording the phase timeline
  bool coop = false;                       // the cooperative timeline (both warpgroups on every tile)
};

template <auto Kernel, class Cfg>
Method mainloop_method(const char* name, const Problem& pr, bool timeline = false, bool coop = false) {
  const CUtensorMap mh = encode_bf16_map(pr.hidden, pr.n, pr.d, pr.d, Cfg::kTileRows, "hidden");
  // Promotion as the library's ping-pong buckets: 256 B for hidden (the default), none for weight.
  const CUtensorMap mw = encode_bf16_map(pr.weight, pr.v, pr.d, pr.d, Cfg::kBlockN / Cfg::kClusterM, "weight", 0);
  Method m{name, [pr, mh, mw] { launch_mainloop<Kernel, Cfg>(pr, mh, mw); }, {}, coop};
  if (timeline) m.stamped = [pr, mh, mw](uint64_t* stamps) { launch_mainloop<Kernel, Cfg>(pr, mh, mw, stamps); };
  return m;
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Cooperative kernels: medians over warpgroup 0's steady-state tiles of the stamped CTAs: the K walk
// (first issue to last wgmma done), the tile work after it, and the period per tile.
// Also warpgroup 1's tile work and the skew between the two: warpgroup 1's end of tile work minus
// warpgroup 0's (both warpgroups' warps share the four schedulers, so one can finish first and
// start the next K walk alone).
void print_coop_timeline(const char* name, const std::vector<uint64_t>& st, int tiles_per_cta) {
  std::vector<double> walk, work, work1, skew, period;
  const int local = std::min(tiles_per_cta, kStampTiles);
  for (int cta = 0; cta < kStampCtas; ++cta)
    for (int j = 1; j + 2 < local; ++j) {
      auto at = [&](int wg, int tile, int point) { return static_cast<double>(st[stamp_index(cta, wg, tile, point)]); };
      walk.push_back(at(0, j, 1) - at(0, j, 0));
      work.push_back(at(0, j, 4) - at(0, j, 1));
      work1.push_back(at(1, j, 4) - at(1, j, 1));
      skew.push_back(at(1, j, 4) - at(0, j, 4));
      period.push_back(at(0, j + 1, 0) - at(0, j, 0));
    }
  std::printf(
      "timeline %-28s K walk %7.0f tile work %7.0f period %7.0f (128-row tiles); warpgroup 1 tile work %7.0f, "
      "end skew %6.0f\n",
      name, median(walk), median(work), median(period), median(work1), median(skew));
}

// Medians (cycles) over the steady-state tiles of the stamped CTAs: the ordering wait, the issue
// of the K blocks, the last wgmma's drain, the epilogue, the hand-over (from one warpgroup's
// arrival to the other's first issue: the tensor cores idle for whatever of it exceeds the last
// K block's drain) and the period per tile of the CTA.
void print_timeline(const char* name, const std::vector<uint64_t>& st, int tiles_per_cta) {
  std::vector<double> wait, issue, tail, epi, handover, period;
  const int local = std::min(tiles_per_cta, 2 * kStampTiles);
  for (int cta = 0; cta < kStampCtas; ++cta)
    for (int j = 2; j + 2 < local; ++j) {
      const int c = j % 2, nn = j / 2;
      auto at = [&](int wg, int tile, int point) { return static_cast<double>(st[stamp_index(cta, wg, tile, point)]); };
      wait.push_back(at(c, nn, 1) - at(c, nn, 0));
      issue.push_back(at(c, nn, 2) - at(c, nn, 1));
      tail.push_back(at(c, nn, 3) - at(c, nn, 2));
      epi.push_back(at(c, nn, 4) - at(c, nn, 3));
      handover.push_back(at(c, nn, 1) - at(1 - c, (j - 1) / 2, 2));
      period.push_back((at(c, nn + 1, 1) - at(c, nn, 1)) / 2);
    }
  std::printf("timeline %-28s wait %7.0f issue %7.0f drain %6.0f epilogue %7.0f handover %6.0f period %7.0f\n", name,
              median(wait), median(issue), median(tail), median(epi), median(handover), median(period));
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
  // Trainer-entry outputs of the epilogue kernels: per-tile summaries and y_t, targets spread over V.
  const int64_t local_tiles = (v + detlogp::kVocabTile - 1) / detlogp::kVocabTile;
  std::vector<int32_t> targets_host(n);
  for (int64_t i = 0; i < n; ++i) targets_host[i] = static_cast<int32_t>((i * 7919) % v);
  int32_t* targets = nullptr;
  detlogp::TileSummary* summaries = nullptr;
  float* target_logit = nullptr;
  DeviceStatus* status = nullptr;
  uint64_t* stamps = nullptr;
  const int64_t stamp_count = stamp_index(kStampCtas, 0, 0, 0);
  CK(cudaMalloc(&targets, n * sizeof(int32_t)));
  CK(cudaMalloc(&summaries, n * local_tiles * sizeof(detlogp::TileSummary)));
  CK(cudaMalloc(&target_logit, n * sizeof(float)));
  CK(cudaMalloc(&status, sizeof(DeviceStatus)));
  CK(cudaMalloc(&stamps, stamp_count * sizeof(uint64_t)));
  CK(cudaMemcpy(targets, targets_host.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice));
  CK(cudaMemset(status, 0, sizeof(DeviceStatus)));
  FusedParams fused{};
  fused.row_begin = 0;
  fused.row_end = n;
  fused.vocab_local = v;
  fused.vocab_start = 0;
  fused.real_vocab = v;
  fused.ignore_index = -100;
  fused.targets = targets;
  fused.temperature = 1.0f;
  fused.inv_temperature = 1.0f;
  fused.summaries = summaries;
  fused.local_tiles = local_tiles;
  fused.whole_tiles = whole_local_tiles(v, 0, v);
  fused.target_logit = target_logit;
  fused.status = status;
  const Problem pr{n, d, v, hidden, weight, sink, prop.multiProcessorCount, fused};

  std::vector<Method> methods;
  methods.push_back({"cublas_gemm_bf16out", [&] {
                       const float alpha = 1.0f, beta = 0.0f;
                       CB(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(v), static_cast<int>(n),
                                       static_cast<int>(d), &alpha, weight, CUDA_R_16BF, static_cast<int>(d), hidden,
                                       CUDA_R_16BF, static_cast<int>(d), &beta, out_bf16, CUDA_R_16BF,
                                       static_cast<int>(v), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                     }});
  methods.push_back(
      mainloop_method<pingpong_mainloop_kernel<Pingpong>, Pingpong>("mainloop_pingpong_64x256", pr, true));
  methods.push_back(
      mainloop_method<pingpong_mainloop_kernel<PingpongC2>, PingpongC2>("mainloop_pingpong_64x256_c2", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kEpilogue>, Pingpong>(
      "pingpong_64x256+epilogue", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<PingpongC2, TileWork::kEpilogue>, PingpongC2>(
      "pingpong_64x256_c2+epilogue", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kPlainPerTile>, Pingpong>(
      "pingpong_64x256+plain_per_tile", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kPlainEpilogue>, Pingpong>(
      "pingpong_64x256+plain_epilogue", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<PingpongC2, TileWork::kPlainEpilogue>, PingpongC2>(
      "pingpong_64x256_c2+plain_epilogue", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kShufflesOnly>, Pingpong>(
      "pingpong_64x256+shuffles_only", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kAluOnly>, Pingpong>(
      "pingpong_64x256+ffma2048", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kStoresOnly>, Pingpong>(
      "pingpong_64x256+stores_only", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kAlu512>, Pingpong>(
      "pingpong_64x256+ffma512", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kAlu1024>, Pingpong>(
      "pingpong_64x256+ffma1024", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kAlu4096>, Pingpong>(
      "pingpong_64x256+ffma4096", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kIntOnly>, Pingpong>(
      "pingpong_64x256+int3300", pr, true));
  methods.push_back(mainloop_method<pingpong_mainloop_kernel<Pingpong, TileWork::kAluLoop>, Pingpong>(
      "pingpong_64x256+ffma2048_loop", pr, true));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop192>, Coop192>("mainloop_coop_128x192", pr));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop192C2>, Coop192C2>("mainloop_coop_128x192_c2", pr));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256>, Coop256>("mainloop_coop_128x256", pr));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256C2>, Coop256C2>("mainloop_coop_128x256_c2", pr));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256, TileWork::kNone>, Coop256>("coop_128x256 (timeline)",
                                                                                             pr, true, true));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256, TileWork::kPlainEpilogue>, Coop256>(
      "coop_128x256+plain_epilogue", pr, true, true));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256C2, TileWork::kPlainEpilogue>, Coop256C2>(
      "coop_128x256_c2+plain_epilogue", pr, true, true));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256, TileWork::kAluOnly>, Coop256>("coop_128x256+ffma2048",
                                                                                                pr, true, true));
  methods.push_back(mainloop_method<coop_mainloop_kernel<Coop256, TileWork::kAluLoop>, Coop256>(
      "coop_128x256+ffma2048_loop", pr, true, true));

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

  // One stamped launch per ping-pong kernel: where a tile's cycles go on the first CTAs' SMs.
  std::printf("timeline: cycles (SM clock), medians over the steady-state tiles of CTAs 0..%d\n", kStampCtas - 1);
  for (const auto& m : methods) {
    if (!m.stamped) continue;
    CK(cudaMemset(stamps, 0, stamp_count * sizeof(uint64_t)));
    m.stamped(stamps);
    CK(cudaDeviceSynchronize());
    std::vector<uint64_t> st(stamp_count);
    CK(cudaMemcpy(st.data(), stamps, stamp_count * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    // Tiles per CTA: the walk gives CTA 0 ceil(units / grid) work units; count its stamped tiles.
    int local = 0;
    if (m.coop) {
      while (local < kStampTiles && st[stamp_index(0, 0, local, 4)] != 0) ++local;
      print_coop_timeline(m.name.c_str(), st, local);
      continue;
    }
    while (local < 2 * kStampTiles && st[stamp_index(0, local % 2, local / 2, 4)] != 0) ++local;
    print_timeline(m.name.c_str(), st, local);
  }
  CB(cublasDestroy(cublas));
  CK(cudaFree(hidden));
  CK(cudaFree(weight));
  CK(cudaFree(out_bf16));
  CK(cudaFree(sink));
  CK(cudaFree(targets));
  CK(cudaFree(summaries));
  CK(cudaFree(target_logit));
  CK(cudaFree(status));
  CK(cudaFree(stamps));
  return 0;
}

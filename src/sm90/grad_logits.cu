// linear_logp_grad_logits on SM90: validate (device-resident targets and temperatures, the
// forward's status word and verdict) -> one persistent ping-pong kernel that recomputes each logit
// tile with the forward's TMA + wgmma mainloop (pingpong_produce / pingpong_consume) and writes
// the bf16 logit gradient from the accumulators (device/epilogue_grad_logits.cuh). No workspace
// besides the status word, no atomics; every dz element is written by exactly one thread. The
// sampling replay's gradient is the same kernel with its sampled epilogue (kSampled); the
// program's per-row values are read back and checked on the host first, as the replay forward does.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "core/env.hpp"
#include "core/grad_logits.hpp"
#include "cuda/device.hpp"
#include "cuda/status.hpp"
#include "sm90/device/configs.cuh"
#include "sm90/device/epilogue_grad_logits.cuh"
#include "sm90/device/grad_from_logits.cuh"
#include "sm90/device/mainloop.cuh"
#include "sm90/launch_persistent.cuh"
#include "sm90/sample.hpp"
#include "sm90/tma.hpp"

namespace detlogp::sm90 {
namespace {

// One m64n256 wgmma per k16 step, 5-stage ring: the forward's prefill shape, by default in clusters
// of two CTAs along M that share (multicast) each weight stage, as the forward's prefill_c2.
using GradCfg = PingpongConfig<64, 256, 5>;
using GradC2Cfg = PingpongConfig<64, 256, 5, 64, 2>;

// Persistent ping-pong: warpgroup 0 produces (one TMA thread), warpgroups 1 and 2 take alternate
// tiles of this CTA (local tile j is work unit walk.first + j * walk.stride, see TileWalk);
// mainloops run in local tile order, so one consumer's epilogue overlaps the other's mainloop.
template <class Cfg, bool kSampled>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    grad_logits_sm90_pingpong_kernel(const __grid_constant__ CUtensorMap map_hidden,
                                     const __grid_constant__ CUtensorMap map_weight, const GradLogitsParams p,
                                     const int dz_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.status->code != kStatusOk) return;  // invalid input: write nothing (uniform over the grid)

  extern __shared__ uint8_t smem_raw[];
  // Each consuming warp of every cluster CTA releases each stage; two more barriers, one phase per
  // finished mainloop of each consumer warpgroup.
  const auto ring = persistent_prologue<Cfg>(smem_raw, &map_hidden, &map_weight, 4 * Cfg::kClusterM, 2);
  uint64_t* mainloop_done = ring.empty + Cfg::kStages;
  warp_specialize<Cfg>(
      [&] {
        if (threadIdx.x == 0)
          pingpong_produce<Cfg>(&map_hidden, &map_weight, ring.a, ring.b, ring.full, ring.empty, p.k_blocks, 0,
                                p.m_tiles, p.n_tiles, p.group_m);
      },
      [&](int c) {
        pingpong_walk<Cfg>(p.m_tiles, p.n_tiles, p.group_m, c, mainloop_done, [&](int j, int m_tile, int n_tile) {
          const int64_t row0 = int64_t{m_tile} * Cfg::kWgM;
          const int64_t col0 = int64_t{n_tile} * Cfg::kBlockN;
          float acc[Cfg::kFragments][Cfg::kAccRegs];
          pingpong_consume<Cfg>(acc, ring.a, ring.b, ring.full, ring.empty, p.k_blocks,
                                static_cast<uint32_t>(j) * p.k_blocks);
          if (threadIdx.x % 32 == 0) ptx::mbar_arrive(&mainloop_done[c]);
#pragma unroll
          for (int f = 0; f < Cfg::kFragments; ++f)
            epilogue_grad_logits<Cfg::kBlockN, kSampled>(acc[f], p, row0 + 64 * f, col0, dz_vec2 != 0);
        });
      });
#endif
}

// dz from given logits, one CTA a row (device/grad_from_logits.cuh).
__global__ void __launch_bounds__(kFromLogitsThreads)
    grad_from_logits_kernel(const GradLogitsParams p, const float* logits, const int64_t logits_stride,
                            const int vec4) {
  if (p.status->code != kStatusOk) return;  // invalid input: write nothing (uniform over the grid)
  grad_from_logits_row(p, logits, logits_stride, vec4 != 0, blockIdx.x);
}

// The per-row operands both logit-gradient kernels read, and dz, at their element alignment.
void check_row_operand_alignment(const detail::GradLogitsProblem& p) {
  check_alignment(p.lse, 4, "lse");
  if (p.g_logp) check_alignment(p.g_logp, 4, "g_logp");
  if (p.g_lse) check_alignment(p.g_lse, 4, "g_lse");
  if (p.g_entropy) {
    check_alignment(p.g_entropy, 4, "g_entropy");
    check_alignment(p.entropy, 4, "entropy");
  }
  check_alignment(p.dz, 2, "dz");
}

// The device validation of the targets and row temperatures into the call's status word.
void launch_row_validation(const detail::GradLogitsProblem& p, DeviceStatus* status, const cuda::Verdict& verdict,
                           cudaStream_t stream) {
  cuda::launch_validate(ValidateParams{p.rows, p.targets, p.targets_i64 ? 1 : 0, 1, p.real_vocab, p.ignore_index,
                                       p.temperature_rows, status, verdict.device, verdict.seq},
                        stream);
}

// Cluster size of the grad-logits kernel: DETLOGP_SM90_GRAD_CLUSTER=1 or 2 (default 2).
int grad_cluster_m() { return static_cast<int>(detail::env_integer("DETLOGP_SM90_GRAD_CLUSTER", 2)); }

template <class Cfg>
void launch_grad_logits(const detail::GradLogitsProblem& p, GradLogitsParams g, bool vec2, cudaStream_t stream) {
  const int64_t m_tiles = (p.rows + Cfg::kWgM - 1) / Cfg::kWgM;
  const int64_t n_tiles = (p.cols + Cfg::kBlockN - 1) / Cfg::kBlockN;
  g.k_blocks = static_cast<int32_t>((p.dim + Cfg::kBlockK - 1) / Cfg::kBlockK);
  g.m_tiles = static_cast<int32_t>(m_tiles);
  g.n_tiles = static_cast<int32_t>(n_tiles);
  g.group_m = std::max(1, 2048 / Cfg::kWgM);  // ~2048 rows of hidden stay in L2 per weight pass
  const CUtensorMap map_h = encode_bf16_map(p.hidden, p.rows, p.dim, p.hidden_stride, Cfg::kWgM, "hidden");
  const CUtensorMap map_w = encode_bf16_map(p.weight, p.cols, p.dim, p.weight_stride, Cfg::kBSliceRows, "weight");
  int sms = 0;
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device));
  const int64_t units = (m_tiles + Cfg::kClusterM - 1) / Cfg::kClusterM * n_tiles;
  if (p.sampled)
    launch_persistent<grad_logits_sm90_pingpong_kernel<Cfg, true>, Cfg>(units, sms, stream, map_h, map_w, g,
                                                                        vec2 ? 1 : 0);
  else
    launch_persistent<grad_logits_sm90_pingpong_kernel<Cfg, false>, Cfg>(units, sms, stream, map_h, map_w, g,
                                                                         vec2 ? 1 : 0);
}

}  // namespace
}  // namespace detlogp::sm90

namespace detlogp::detail {

void sm90_grad_logits(const GradLogitsProblem& p) {
  using namespace detlogp::sm90;
  using cuda::DeviceGuard;
  using cuda::StreamBuffer;
  using cuda::Verdict;
  using Cfg = GradCfg;  // the tile shape (GradC2Cfg has the same)
  DETLOGP_CHECK(p.memory == Memory::cuda, "the SM90 logit gradient needs tensors in CUDA memory");
  if (p.rows == 0) return;
  DeviceGuard guard(p.device);
  check_sm90_device(p.device);
  check_head_operands(p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.rows, p.cols, "C", p.dim, p.targets,
                      p.targets_i64, p.bias, p.temperature_rows);
  check_row_operand_alignment(p);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  if (p.sampled) {
    const SampledGradOperands& r = p.replay;
    for (const auto& [ptr, name] : {std::pair<const void*, const char*>{r.forward_logp, "logp"},
                                    {r.lse_support, "lse_support"},
                                    {r.support_max, "support_max"},
                                    {r.cut_logit, "cut_logit"},
                                    {r.g_logp_raw, "g_logp_raw"}})
      if (ptr) check_alignment(ptr, 4, name);
    check_alignment(r.cut_id, 8, "cut_id");
    check_device_program(r.program, p.rows, p.real_vocab, stream, {});  // a bad value writes nothing
  }
  const int64_t m_tiles = (p.rows + Cfg::kWgM - 1) / Cfg::kWgM;
  const int64_t n_tiles = (p.cols + Cfg::kBlockN - 1) / Cfg::kBlockN;
  DETLOGP_CHECK(m_tiles * n_tiles < (int64_t{1} << 31),
                "the grad-logits grid of " << m_tiles << " x " << n_tiles << " tiles is out of range");
  const int cluster_m = grad_cluster_m();

  const Verdict verdict = cuda::prepare_verdict(stream);  // none under stream capture
  StreamBuffer status_word(sizeof(DeviceStatus), stream, p.device, "SM90 grad-logits status word");
  auto* status = reinterpret_cast<DeviceStatus*>(status_word.get());
  launch_row_validation(p, status, verdict, stream);

  const GradLogitsParams g = grad_params(p, status);
  const bool vec2 = reinterpret_cast<uintptr_t>(p.dz) % 4 == 0 && p.dz_stride % 2 == 0;
  if (cluster_m == 2)
    launch_grad_logits<GradC2Cfg>(p, g, vec2, stream);
  else
    launch_grad_logits<GradCfg>(p, g, vec2, stream);

  // The verdict (the call returns while the kernel runs, in stream order). Under stream capture
  // no host wait is possible: the kernel still writes nothing on invalid input, but the error
  // cannot be raised from here.
  cuda::settle_verdict(verdict, stream, p, "linear_logp_grad_logits");
}

void sm90_grad_from_logits(const GradLogitsProblem& p) {
  using namespace detlogp::sm90;
  DETLOGP_CHECK(p.memory == Memory::cuda, "the SM90 logit gradient needs tensors in CUDA memory");
  if (p.rows == 0) return;
  cuda::DeviceGuard guard(p.device);
  check_sm90_device(p.device);
  DETLOGP_CHECK(p.rows < (int64_t{1} << 31), "N=" << p.rows << " rows exceed the kernel's grid (2^31 - 1 rows)");
  check_alignment(p.logits, 4, "logits");
  check_row_operand_alignment(p);
  check_alignment(p.targets, p.targets_i64 ? 8 : 4, "targets");
  if (p.temperature_rows) check_alignment(p.temperature_rows, 4, "temperature_rows");
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);

  const cuda::Verdict verdict = cuda::prepare_verdict(stream);  // none under stream capture
  cuda::StreamBuffer status_word(sizeof(DeviceStatus), stream, p.device, "SM90 grad-from-logits status word");
  auto* status = reinterpret_cast<DeviceStatus*>(status_word.get());
  launch_row_validation(p, status, verdict, stream);
  const GradLogitsParams g = grad_params(p, status);
  const bool vec4 = reinterpret_cast<uintptr_t>(p.logits) % 16 == 0 && p.logits_stride % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(p.dz) % 8 == 0 && p.dz_stride % 4 == 0;
  grad_from_logits_kernel<<<static_cast<unsigned>(p.rows), kFromLogitsThreads, 0, stream>>>(g, p.logits,
                                                                                            p.logits_stride, vec4);
  DETLOGP_CUDA_CHECK(cudaGetLastError());
  cuda::settle_verdict(verdict, stream, p, "linear_logp_grad_from_logits");
}

}  // namespace detlogp::detail

// cuda-fused-linear-logp-sm90-contract-v1: the host side of the SM90 backend. Checks what TMA
// needs, stages host problems to the device, plans the row chunks (workspace.hpp), picks each
// chunk's launch bucket (heuristics.hpp), encodes the tensor maps, and enqueues
// validate -> fused -> combine (full mode) or owner flags + fused (partial mode, one tensor-parallel
// rank's summaries), then waits for the validation's verdict.
#include "core/backend.hpp"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/device_ops.hpp"
#include "core/env.hpp"
#include "core/validate.hpp"
#include "cuda/device.hpp"
#include "cuda/lane_backend.hpp"
#include "cuda/status.hpp"
#include "detlogp/config.hpp"
#include "detlogp/topk.hpp"
#include "sm90/backend.hpp"
#include "sm90/combine.hpp"
#include "sm90/device/tile_schedule.hpp"
#include "sm90/heuristics.hpp"
#include "sm90/launch_table.hpp"
#include "sm90/sample.hpp"
#include "sm90/tma.hpp"
#include "sm90/topk.hpp"
#include "sm90/workspace.hpp"

namespace detlogp::sm90 {
namespace {

using cuda::DeviceGuard;
using cuda::StreamBuffer;
using cuda::StreamBuffers;
using cuda::Verdict;
using detail::DeviceAllocation;

class Sm90Backend final : public detail::CudaLaneBackend {
 public:
  Sm90Backend() : CudaLaneBackend(detail::contract_provenance(kBackendId, "sm90a", 0, true, true), true) { probe(); }

  // [N, K] targets: the fused kernels' kMulti forms pick each row's K target logits in the tile
  // epilogue and the combine (or the merge) finalizes each one as a single target.
  bool supports_multi_targets() const override { return true; }
  // The top-k output: the serving entry's z per row chunk, then the top-k row kernel over it.
  bool supports_topk() const override { return true; }
  void run(const detail::LogpProblem& p) const override;
  void run_from_host(const detail::LogpProblem& p) const override;
  SamplingReport run_sample(const detail::SampleProblem& p) const override;

 private:
  // The top-k output's candidate buffers of a row chunk (FusedParams::cand_*), [rows][groups] each.
  struct Candidates {
    float* max;
    float* second;
    uint8_t* lane;
    int64_t groups;
  };
  // run() without its top-k dispatch; with `candidates`, the fused launches also write the lane
  // groups' top-k candidates (the kCandidates kernels; full mode, no logits, entropy or [N, K]).
  void run_fused(const detail::LogpProblem& p, const Candidates* candidates) const;
  void run_topk(const detail::LogpProblem& p) const;
  void run_topk_candidates(const detail::LogpProblem& p) const;
  void probe() {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      set_availability(false, e != cudaSuccess ? std::string("no usable CUDA device (") + cudaGetErrorName(e) + ": " +
                                                     cudaGetErrorString(e) + ")"
                                               : std::string("no CUDA device present"));
      return;
    }
    int dev = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      set_availability(false, "could not query the current CUDA device");
      return;
    }
    mutable_provenance().cc = prop.major * 10 + prop.minor;
    if (prop.major != 9 || prop.minor != 0) {
      set_availability(false, "CUDA device " + std::to_string(dev) + " (" + prop.name + ") has compute capability " +
                                  std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                                  "; this backend is built for sm_90a (H100/H200, compute capability 9.0)");
      return;
    }
    set_availability(true, "CUDA device " + std::to_string(dev) + ": " + prop.name + " (sm_90a)");
  }
};

// Partial mode off the tile grid: the shard's edge columns (head columns, then tail lanes; at most
// 126) through the fused kernel's serving entry on a copy of their weight rows, which gives their z
// with the fused kernel's K walk (the bits of every other launch: §3.1, the tile shape is free),
// then edge_lanes_kernel for the bias, the serving logits, y, the edge lanes and y_t. `f` is the
// call's fused parameters (temperatures, targets).
void launch_edge_columns(const detail::LogpProblem& p, const ShardGeometry& g, const FusedParams& f,
                         const DeviceStatus* status, int sms, cudaStream_t stream) {
  const int64_t cols = g.head_cols + g.tail_lanes;
  const int64_t ds = (p.dim + 7) / 8 * 8;  // a TMA row stride: a multiple of 16 bytes
  const int64_t tiles = (cols + kVocabTile - 1) / kVocabTile;
  auto aligned = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t weight_bytes = aligned(static_cast<size_t>(cols * ds) * 2);
  const size_t z_bytes = aligned(static_cast<size_t>(p.rows * cols) * 4);
  const size_t summary_bytes = aligned(static_cast<size_t>(p.rows * tiles) * sizeof(TileSummary));
  const size_t target_bytes = aligned(static_cast<size_t>(p.rows * p.targets_per_row) * 4);
  StreamBuffer ws(weight_bytes + z_bytes + summary_bytes + target_bytes, stream, p.device,
                  "the edge columns of a shard off the tile grid");
  auto* weight = reinterpret_cast<uint16_t*>(ws.get());
  auto* z = reinterpret_cast<float*>(ws.get() + weight_bytes);
  const size_t row_bytes = static_cast<size_t>(p.dim) * 2, pitch = static_cast<size_t>(ds) * 2,
               src_pitch = static_cast<size_t>(p.weight_stride) * 2;
  if (g.head_cols > 0)
    DETLOGP_CUDA_CHECK(cudaMemcpy2DAsync(weight, pitch, p.weight, src_pitch, row_bytes,
                                         static_cast<size_t>(g.head_cols), cudaMemcpyDeviceToDevice, stream));
  if (g.tail_lanes > 0)
    DETLOGP_CUDA_CHECK(
        cudaMemcpy2DAsync(weight + g.head_cols * ds, pitch, p.weight + (p.vocab_local - g.tail_lanes) * p.weight_stride,
                          src_pitch, row_bytes, static_cast<size_t>(g.tail_lanes), cudaMemcpyDeviceToDevice, stream));
  const Bucket b = select_edge_bucket(p.rows, cols, p.dim, sms);
  const BucketInfo bi = bucket_info(b);
  FusedParams e = f;
  e.row_begin = 0;
  e.row_end = p.rows;
  e.vocab_start = 0;  // its own ids: no target of the call is among them (y_t is set below)
  e.vocab_local = cols;
  e.real_vocab = cols;
  e.bias = nullptr;  // added by edge_lanes_kernel, as the epilogue adds it
  e.logits = z;
  e.logits_stride = cols;
  e.summaries = reinterpret_cast<TileSummary*>(ws.get() + weight_bytes + z_bytes);  // not read
  e.usums = nullptr;
  e.local_tiles = tiles;
  e.whole_tiles = whole_local_tiles(cols, 0, cols);
  e.target_logit = reinterpret_cast<float*>(ws.get() + weight_bytes + z_bytes + summary_bytes);  // not read
  e.ignore_index = f.ignore_index;
  e.status = status;
  e.validate_in_kernel = 0;
  e.m_tiles = static_cast<int32_t>((p.rows + bi.block_m - 1) / bi.block_m);
  e.n_tiles = static_cast<int32_t>((cols + bi.block_n - 1) / bi.block_n);
  e.group_m = std::max(1, 2048 / bi.block_m);
  const CUtensorMap map_h = encode_bf16_map(p.hidden, p.rows, p.dim, p.hidden_stride, bi.block_m, "hidden");
  const CUtensorMap map_w = encode_bf16_map(weight, cols, p.dim, ds, bi.weight_box_rows(), "weight", 0);
  launch_fused(b, map_h, map_w, e, /*logits_vec2=*/false, sms, stream);
  launch_edge_lanes(
      EdgeLanesParams{p.rows, p.vocab_start, p.vocab_local, static_cast<int32_t>(g.head_cols),
                      static_cast<int32_t>(g.head_lanes), static_cast<int32_t>(g.tail_lanes), z, p.bias, p.logits,
                      p.edge_logits, p.targets, p.targets_i64 ? 1 : 0, p.ignore_index, f.inv_temperature,
                      p.temperature_rows, p.target_logit, status, static_cast<int32_t>(p.targets_per_row)},
      stream);
}

void Sm90Backend::run(const detail::LogpProblem& p) const {
  DETLOGP_CHECK(available(nullptr), "SM90 backend unavailable: " << reason());
  DETLOGP_CHECK(p.memory == Memory::cuda, "the SM90 backend's run() needs tensors in CUDA memory (use run_from_host)");
  if (p.rows == 0) return;
  if (p.topk > 0) return run_topk(p);
  run_fused(p, nullptr);
}

void Sm90Backend::run_fused(const detail::LogpProblem& p, const Candidates* candidates) const {
  DeviceGuard guard(p.device);
  check_sm90_device(p.device);
  // What TMA and the kernels need beyond the API's checks.
  check_head_operands(p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.rows, p.vocab_local, "V_local", p.dim,
                      p.targets, p.targets_i64, p.bias, p.temperature_rows);
  if (p.logits) check_alignment(p.logits, 4, "logits");
  if (p.partial_mode()) {
    check_alignment(p.summaries, 8, "summaries");
    check_alignment(p.target_logit, 4, "target_logit");
    if (p.usums) check_alignment(p.usums, 4, "usums");
    if (p.edge_logits) check_alignment(p.edge_logits, 4, "edge_logits");
  } else {
    DETLOGP_CHECK(p.vocab_start == 0 && p.vocab_local >= p.real_vocab,
                  "full mode needs the whole real vocabulary (vocab_start="
                      << p.vocab_start << ", V_local=" << p.vocab_local << ", real_vocab=" << p.real_vocab << ")");
    check_alignment(p.logp, 4, "logp");
    check_alignment(p.lse, 4, "lse");
    if (p.entropy) check_alignment(p.entropy, 4, "entropy");
  }

  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const WorkspaceLayout lay = workspace_layout(p);
  int sms = 0;
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device));

  FusedParams f{};
  f.vocab_local = p.vocab_local;
  f.vocab_start = p.vocab_start;
  f.real_vocab = p.real_vocab;
  f.ignore_index = p.ignore_index;
  f.k_blocks = static_cast<int32_t>((p.dim + 63) / 64);
  f.bias = p.bias;
  f.targets = p.targets;
  f.targets_i64 = p.targets_i64 ? 1 : 0;
  f.targets_per_row = static_cast<int32_t>(p.targets_per_row);
  f.temperature = p.temperature;
  f.inv_temperature = inverse_temperature(p.temperature);  // IEEE fl(1 / T), as on the device
  f.temperature_rows = p.temperature_rows;
  f.logits = p.logits;  // partial mode too: a tensor-parallel rank's serving entry keeps its shard
  f.logits_stride = p.vocab_local;
  f.local_tiles = p.local_tiles();
  f.whole_tiles = whole_local_tiles(p.vocab_local, p.vocab_start, p.real_vocab);
  // A shard off the tile grid (partial mode): the fused launch covers its whole tiles only, columns
  // [head_cols, head_cols + whole_cols) as a shard of their own that starts on the grid; its edge
  // columns go through a launch of their own below. An aligned shard is its whole tiles.
  const ShardGeometry geo = p.partial_mode() ? p.geometry() : ShardGeometry{};
  const int64_t edge_cols = geo.head_cols + geo.tail_lanes;
  const uint16_t* main_weight = p.weight;
  if (edge_cols > 0) {
    main_weight = p.weight + geo.head_cols * p.weight_stride;
    f.vocab_local = geo.whole_cols;
    f.vocab_start = p.vocab_start + geo.head_cols;
    if (f.bias) f.bias += geo.head_cols;
    if (f.logits) f.logits += geo.head_cols;
    f.local_tiles = geo.tiles;
    f.whole_tiles = whole_local_tiles(f.vocab_local, f.vocab_start, p.real_vocab);
  }
  const bool vec2 = f.logits != nullptr && reinterpret_cast<uintptr_t>(f.logits) % 8 == 0 && p.vocab_local % 2 == 0;

  // Every host-side step (bucket choice, tensor-map encoding) happens before the first launch, so
  // the kernels of the call reach the GPU back to back instead of waiting on host work.
  struct ChunkLaunch {
    Bucket bucket;
    CUtensorMap map_h, map_w;
    FusedParams params;
  };
  std::vector<ChunkLaunch> launches;
  auto plan_rows = [&](int64_t row_begin, int64_t rows) {
    const Bucket b = select_bucket(rows, f.vocab_local, p.dim, f.logits != nullptr, sms);
    const BucketInfo bi = bucket_info(b);
    if (launches.empty() || launches.back().bucket != b) {
      launches.push_back(
          {b, encode_bf16_map(p.hidden, p.rows, p.dim, p.hidden_stride, bi.block_m, "hidden"),
           encode_bf16_map(main_weight, f.vocab_local, p.dim, p.weight_stride, bi.weight_box_rows(), "weight", 0), f});
    } else {
      const ChunkLaunch same_maps = launches.back();
      launches.push_back(same_maps);
    }
    FusedParams& q = launches.back().params;
    q = f;
    q.row_begin = row_begin;
    q.row_end = row_begin + rows;
    q.m_tiles = static_cast<int32_t>((rows + bi.block_m - 1) / bi.block_m);
    q.n_tiles = static_cast<int32_t>((f.vocab_local + bi.block_n - 1) / bi.block_n);
    q.group_m = std::max(1, 2048 / bi.block_m);  // ~2048 rows of hidden stay in L2 per weight pass
  };
  if (p.partial_mode()) {
    if (f.vocab_local > 0) plan_rows(0, p.rows);  // no whole tile: edge columns only
  } else {
    for (int64_t row0 = 0; row0 < p.rows; row0 += lay.chunk) plan_rows(row0, std::min(lay.chunk, p.rows - row0));
  }

  // Under stream capture no host wait is possible (and replays must not touch a live slot): the
  // kernels still write nothing on invalid input, but the error cannot be raised from here.
  const Verdict verdict = cuda::prepare_verdict(stream);

  StreamBuffer ws(lay.bytes, stream, p.device, "SM90 workspace",
                  "lower DETLOGP_SM90_WORKSPACE_MB to chunk N into smaller pieces");
  auto* status = reinterpret_cast<DeviceStatus*>(ws.get());
  const ValidateParams validate{
      p.rows,         p.targets,      p.targets_i64 ? 1 : 0, static_cast<int32_t>(p.targets_per_row),
      p.real_vocab,   p.ignore_index, p.temperature_rows,    status,
      verdict.device, verdict.seq};
  // The trainer entry (full mode, no logits) writes nothing the caller sees before the combine, so
  // its first fused launch can validate the inputs itself (an idle producer warp of CTA 0): a
  // separate validation kernel cost ~4 us plus a ~20-26 us gap before the fused kernel started
  // (torch profiler, H200, N = 1024 and 4096). One warp scans the rows
  // with about 1/32 of a load latency per row, hidden behind the fused kernel when every row
  // carries >= 2^26 FLOPs (Qwen3-0.6B's head: 3e8) and at decode sizes; tiny heads with many rows
  // keep the 1024-thread validation kernel. The other entries validate first: they write what the
  // caller sees. The combine is a programmatic dependent launch (it waits for the whole grid).
  const bool validation_hides = p.rows <= 64 || 2.0 * double(p.vocab_local) * double(p.dim) >= double(1 << 26);
  const bool validate_in_kernel = !p.partial_mode() && p.logits == nullptr && validation_hides;
  if (!validate_in_kernel) cuda::launch_validate(validate, stream);

  if (p.partial_mode()) {
    launch_partial_owner(
        PartialOwnerParams{p.rows, p.targets, p.targets_i64 ? 1 : 0, p.ignore_index, p.vocab_start, p.vocab_local,
                           p.target_logit, p.target_owned, status, static_cast<int32_t>(p.targets_per_row)},
        stream);
    if (!launches.empty()) {
      FusedParams& q = launches[0].params;
      q.summaries = p.summaries;
      q.usums = p.usums;
      q.target_logit = p.target_logit;
      q.status = status;
      launch_fused(launches[0].bucket, launches[0].map_h, launches[0].map_w, q, vec2, sms, stream);
    }
    // After the whole tiles' launch: a target in the tail columns may lie in its last fragment past
    // its columns (zero-filled), where it stores +0; the edge lanes' y_t is stored after it.
    if (edge_cols > 0) launch_edge_columns(p, geo, f, status, sms, stream);
  } else {
    auto* summaries = reinterpret_cast<TileSummary*>(ws.get() + lay.summaries_offset);
    auto* target_logit = reinterpret_cast<float*>(ws.get() + lay.target_offset);
    auto* usums = p.entropy ? reinterpret_cast<float*>(ws.get() + lay.usums_offset) : nullptr;
    for (size_t i = 0; i < launches.size(); ++i) {
      ChunkLaunch& l = launches[i];
      FusedParams& q = l.params;
      q.summaries = summaries;
      q.usums = usums;
      q.target_logit = target_logit;
      q.status = status;
      q.validate_in_kernel = validate_in_kernel && i == 0 ? 1 : 0;
      q.validate = validate;
      if (candidates) {
        DETLOGP_CHECK(!p.entropy && p.targets_per_row == 1 && !p.logits,
                      "internal error: top-k candidates with entropy, [N, K] targets or logits");
        const int64_t at = q.row_begin * candidates->groups;
        q.cand_max = candidates->max + at;
        q.cand_second = candidates->second + at;
        q.cand_lane = candidates->lane + at;
      }
      launch_fused(l.bucket, l.map_h, l.map_w, q, vec2, sms, stream);
      launch_combine(CombineParams{q.row_begin, q.row_end - q.row_begin, p.local_tiles(), summaries, target_logit,
                                   p.targets, p.targets_i64 ? 1 : 0, p.ignore_index, p.logp, p.lse, usums, p.entropy,
                                   status, static_cast<int32_t>(p.targets_per_row)},
                     stream, /*programmatic=*/true);
    }
  }

  cuda::settle_verdict(verdict, stream, p, "linear_logp");
}

void Sm90Backend::run_from_host(const detail::LogpProblem& hp) const {
  DETLOGP_CHECK(available(nullptr), "SM90 backend unavailable: " << reason());
  DETLOGP_CHECK(hp.memory == Memory::host, "run_from_host needs a problem in host memory");
  if (hp.rows == 0) return;
  int device = 0;
  DETLOGP_CUDA_CHECK(cudaGetDevice(&device));
  const int64_t n = hp.rows, d = hp.dim, v = hp.vocab_local;
  int64_t tiles = hp.local_tiles(), edge_lanes = 0;
  // Contiguous device copies (row stride D, padded to a multiple of 8 elements for TMA).
  const int64_t ds = (d + 7) / 8 * 8;
  DeviceAllocation hidden(static_cast<size_t>(n * ds) * 2, device, "hidden"),
      weight(static_cast<size_t>(v * ds) * 2, device, "weight");
  DETLOGP_CUDA_CHECK(cudaMemset(hidden.get(), 0, static_cast<size_t>(n * ds) * 2));
  DETLOGP_CUDA_CHECK(cudaMemset(weight.get(), 0, static_cast<size_t>(v * ds) * 2));
  DETLOGP_CUDA_CHECK(
      cudaMemcpy2D(hidden.get(), ds * 2, hp.hidden, hp.hidden_stride * 2, d * 2, n, cudaMemcpyHostToDevice));
  DETLOGP_CUDA_CHECK(
      cudaMemcpy2D(weight.get(), ds * 2, hp.weight, hp.weight_stride * 2, d * 2, v, cudaMemcpyHostToDevice));
  const int64_t k = hp.targets_per_row;  // [N, K] targets: target_logit, owned and logp are [N][K]
  const size_t tbytes = static_cast<size_t>(n * k) * (hp.targets_i64 ? 8 : 4);
  DeviceAllocation targets(tbytes, device, "targets");
  DETLOGP_CUDA_CHECK(cudaMemcpy(targets.get(), hp.targets, tbytes, cudaMemcpyHostToDevice));
  DeviceAllocation bias, temps;
  detail::LogpProblem p = hp;
  p.memory = Memory::cuda;
  p.device = device;
  p.stream = nullptr;
  p.defer_errors = false;  // the results are copied to the caller's host memory below
  p.hidden = static_cast<uint16_t*>(hidden.get());
  p.hidden_stride = ds;
  p.weight = static_cast<uint16_t*>(weight.get());
  p.weight_stride = ds;
  p.targets = targets.get();
  if (hp.bias) {
    bias = DeviceAllocation(static_cast<size_t>(v) * 4, device, "bias");
    DETLOGP_CUDA_CHECK(cudaMemcpy(bias.get(), hp.bias, static_cast<size_t>(v) * 4, cudaMemcpyHostToDevice));
    p.bias = static_cast<float*>(bias.get());
  }
  if (hp.temperature_rows) {
    temps = DeviceAllocation(static_cast<size_t>(n) * 4, device, "temperature_rows");
    DETLOGP_CUDA_CHECK(
        cudaMemcpy(temps.get(), hp.temperature_rows, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice));
    p.temperature_rows = static_cast<float*>(temps.get());
  }
  DeviceAllocation logp, lse, logits, summaries, target_logit, owned, usums, entropy, edge, topk_ids, topk_values;
  if (hp.topk > 0) {
    topk_ids = DeviceAllocation(static_cast<size_t>(n * hp.topk) * 8, device, "topk_ids");
    topk_values = DeviceAllocation(static_cast<size_t>(n * hp.topk) * 4, device, "topk values");
    p.topk_ids = static_cast<int64_t*>(topk_ids.get());
    (hp.partial_mode() ? p.topk_logit : p.topk_logp) = static_cast<float*>(topk_values.get());
  }
  if (hp.partial_mode()) {
    const ShardGeometry g = hp.geometry();
    tiles = g.tiles;
    edge_lanes = g.edge_lanes();
    summaries = DeviceAllocation(static_cast<size_t>(std::max<int64_t>(1, n * tiles)) * sizeof(TileSummary), device,
                                 "summaries");
    if (edge_lanes > 0) {
      edge = DeviceAllocation(static_cast<size_t>(n * edge_lanes) * 4, device, "edge_logits");
      p.edge_logits = static_cast<float*>(edge.get());
    }
    target_logit = DeviceAllocation(static_cast<size_t>(n * k) * 4, device, "target_logit");
    owned = DeviceAllocation(static_cast<size_t>(n * k), device, "target_owned");
    p.summaries = static_cast<TileSummary*>(summaries.get());
    p.target_logit = static_cast<float*>(target_logit.get());
    p.target_owned = static_cast<uint8_t*>(owned.get());
    if (hp.usums) {
      usums = DeviceAllocation(static_cast<size_t>(std::max<int64_t>(1, n * tiles)) * 4, device, "usums");
      p.usums = static_cast<float*>(usums.get());
    }
    if (hp.logits) {
      logits = DeviceAllocation(static_cast<size_t>(n * v) * 4, device, "logits");
      p.logits = static_cast<float*>(logits.get());
    }
  } else {
    logp = DeviceAllocation(static_cast<size_t>(n * k) * 4, device, "logp");
    lse = DeviceAllocation(static_cast<size_t>(n) * 4, device, "lse");
    p.logp = static_cast<float*>(logp.get());
    p.lse = static_cast<float*>(lse.get());
    if (hp.entropy) {
      entropy = DeviceAllocation(static_cast<size_t>(n) * 4, device, "entropy");
      p.entropy = static_cast<float*>(entropy.get());
    }
    if (hp.logits) {
      logits = DeviceAllocation(static_cast<size_t>(n * v) * 4, device, "logits");
      p.logits = static_cast<float*>(logits.get());
    }
  }
  run(p);
  if (hp.topk > 0) {
    DETLOGP_CUDA_CHECK(
        cudaMemcpy(hp.topk_ids, p.topk_ids, static_cast<size_t>(n * hp.topk) * 8, cudaMemcpyDeviceToHost));
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.partial_mode() ? hp.topk_logit : hp.topk_logp, topk_values.get(),
                                  static_cast<size_t>(n * hp.topk) * 4, cudaMemcpyDeviceToHost));
  }
  if (hp.partial_mode()) {
    if (tiles > 0)
      DETLOGP_CUDA_CHECK(cudaMemcpy(hp.summaries, p.summaries, static_cast<size_t>(n * tiles) * sizeof(TileSummary),
                                    cudaMemcpyDeviceToHost));
    if (edge_lanes > 0)
      DETLOGP_CUDA_CHECK(
          cudaMemcpy(hp.edge_logits, p.edge_logits, static_cast<size_t>(n * edge_lanes) * 4, cudaMemcpyDeviceToHost));
    DETLOGP_CUDA_CHECK(
        cudaMemcpy(hp.target_logit, p.target_logit, static_cast<size_t>(n * k) * 4, cudaMemcpyDeviceToHost));
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.target_owned, p.target_owned, static_cast<size_t>(n * k), cudaMemcpyDeviceToHost));
    if (hp.usums && tiles > 0)
      DETLOGP_CUDA_CHECK(cudaMemcpy(hp.usums, p.usums, static_cast<size_t>(n * tiles) * 4, cudaMemcpyDeviceToHost));
    if (hp.logits)
      DETLOGP_CUDA_CHECK(cudaMemcpy(hp.logits, p.logits, static_cast<size_t>(n * v) * 4, cudaMemcpyDeviceToHost));
  } else {
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.logp, p.logp, static_cast<size_t>(n * k) * 4, cudaMemcpyDeviceToHost));
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.lse, p.lse, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost));
    if (hp.entropy)
      DETLOGP_CUDA_CHECK(cudaMemcpy(hp.entropy, p.entropy, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost));
    if (hp.logits)
      DETLOGP_CUDA_CHECK(cudaMemcpy(hp.logits, p.logits, static_cast<size_t>(n * v) * 4, cudaMemcpyDeviceToHost));
  }
}

// Host copies of device arrays after the work already on `stream`, with one wait for all of them:
// each is queued into pinned staging (kept per thread, grown as needed, so the copies run
// asynchronously; a pageable destination makes every copy a wait of its own), then one
// synchronization. A null array gives an empty copy.
std::vector<std::vector<uint8_t>> read_back(std::initializer_list<DeviceArray> arrays, cudaStream_t stream) {
  struct PinnedStaging {
    void* host = nullptr;
    size_t capacity = 0;
    ~PinnedStaging() {
      if (host) (void)cudaFreeHost(host);  // at thread exit the context may be gone: nothing to report
    }
  };
  thread_local PinnedStaging staging;
  const auto slot_bytes = [](const DeviceArray& a) { return a.device ? (a.bytes + 15) / 16 * 16 : size_t{0}; };
  size_t total = 0;
  for (const DeviceArray& a : arrays) total += slot_bytes(a);
  std::vector<std::vector<uint8_t>> out;
  if (total == 0) {
    out.resize(arrays.size());
    return out;
  }
  if (total > staging.capacity) {
    if (staging.host) DETLOGP_CUDA_CHECK(cudaFreeHost(staging.host));
    staging.host = nullptr;
    staging.capacity = 0;
    DETLOGP_CUDA_CHECK(cudaMallocHost(&staging.host, total));
    staging.capacity = total;
  }
  auto* base = static_cast<uint8_t*>(staging.host);
  size_t at = 0;
  for (const DeviceArray& a : arrays) {
    if (!a.device || a.bytes == 0) continue;
    DETLOGP_CUDA_CHECK(cudaMemcpyAsync(base + at, a.device, a.bytes, cudaMemcpyDeviceToHost, stream));
    at += slot_bytes(a);
  }
  DETLOGP_CUDA_CHECK(cudaStreamSynchronize(stream));
  at = 0;
  for (const DeviceArray& a : arrays) {
    if (!a.device) {
      out.emplace_back();
      continue;
    }
    out.emplace_back(base + at, base + at + a.bytes);
    at += slot_bytes(a);
  }
  return out;
}

// Rows per chunk of a row-kernel entry (top-k, sampling): the workspace budget over row_bytes, the
// chunk's logits and scratch a row. Each chunk streams the whole weight again, so without
// DETLOGP_SM90_WORKSPACE_MB set a chunk takes at least kRowKernelChunkRows rows (622 MB of logits at
// V = 151936): below that the weight's re-reads, not the logits, bound the call.
int64_t row_kernel_chunk(int64_t rows, int64_t row_bytes) {
  const int64_t budget = detail::env_integer(kWorkspaceEnv, kDefaultWorkspaceMiB) << 20;
  const int64_t fewest = detail::env_checked(kWorkspaceEnv) ? 1 : kRowKernelChunkRows;
  return std::clamp<int64_t>(std::max(budget / row_bytes, fewest), 1, rows);
}

// The sampling program on CUDA tensors (docs/contract.md §11): per row chunk, the fused serving entry
// writes the logits z and each row's lse (at the row's T, 1 for a greedy row; every target ignored),
// then the row program's kernel (sample.cu) reads them. The program's rows and the replay's targets are read back
// and checked on the host first (one copy and a wait), so a bad value writes nothing.
SamplingReport Sm90Backend::run_sample(const detail::SampleProblem& p) const {
  DETLOGP_CHECK(available(nullptr), "SM90 backend unavailable: " << reason());
  DETLOGP_CHECK(p.memory == Memory::cuda,
                "the SM90 backend runs the sampling program on CUDA tensors; host tensors "
                "run it on cpu-linear-logp-contract-v1");
  SamplingReport report;
  if (p.rows == 0) return report;
  DeviceGuard guard(p.device);
  check_sm90_device(p.device);
  check_head_operands(p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.rows, p.vocab_local, "V_local", p.dim,
                      p.replay ? p.targets : nullptr, p.targets_i64, p.bias, p.program.temperature_rows);
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{p.logp, "logp"},
                                  {p.logp_raw, "logp_raw"},
                                  {p.lse, "lse"},
                                  {p.lse_support, "lse_support"},
                                  {p.support_max, "support_max"},
                                  {p.cut_logit, "cut_logit"},
                                  {p.logits, "logits"}})
    if (ptr) check_alignment(ptr, 4, name);
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{p.token, "token"},
                                  {p.support_size, "support_size"},
                                  {p.cut_id, "cut_id"},
                                  {p.seed_rows, "seed_rows"},
                                  {p.key, "key"}})
    if (ptr) check_alignment(ptr, 8, name);

  // The device-resident values, checked on the host.
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const ProgramReadBack back =
      check_device_program(p.program, p.rows, p.real_vocab, stream,
                           {p.replay ? p.targets : nullptr, static_cast<size_t>(p.rows) * (p.targets_i64 ? 8 : 4)});
  const std::vector<uint8_t>& targets = back.also;
  if (p.replay) detail::check_targets_host(targets.data(), p.targets_i64, p.rows, p.real_vocab, p.ignore_index);

  const int64_t v = p.vocab_local;
  const int64_t tiles = (p.real_vocab + kVocabTile - 1) / kVocabTile;
  // Rows per chunk (a free axis): a row's logits (unless the caller's), scratch summaries and
  // factors, the fused entry's ignored target and its logp/lse.
  const int64_t row_bytes = (p.logits ? 0 : v * 4) + tiles * int64_t{sizeof(TileSummary) + 4} + 16;
  const int64_t chunk = row_kernel_chunk(p.rows, row_bytes);
  const char* hint = "lower DETLOGP_SM90_WORKSPACE_MB to chunk N into smaller pieces";
  const bool radix_only = detail::env_checked("DETLOGP_SM90_SAMPLE_RADIX").value_or("0") == "1";
  // Few rows with a top-k cut of k' <= kMaxTopk: a row's lanes split over slices, each slice's CTA
  // lists its k largest keys (k the rows' largest such k') and the row kernel merges them for the
  // rows with k' <= k (a row's top k' are the top k' of its slices' top k), as the top-k output's
  // split; the other rows take the pass over their lanes.
  TopkSplit split;
  const int64_t list_k = back.largest_small_keep;
  if (!radix_only && list_k >= 1) {
    int sms = 0;
    DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device));
    split = topk_split(chunk, p.real_vocab, sms, list_k);  // valid for the last, shorter chunk too
  }
  // One workspace: the chunk's logits (unless the caller's), scratch summaries and factors, the
  // fused entry's ignored targets and logp/lse, the replay's outside flags, the fused kernel's
  // temperatures (each row's, 1 for a greedy row, so its lse is the program's), the slice lists.
  enum Part { kLogits, kSummaries, kFactors, kIgnored, kFusedOut, kOutside, kTemperatures, kSliceKeys };
  const StreamBuffers work(
      {p.logits ? 0 : static_cast<size_t>(chunk * v) * 4, static_cast<size_t>(chunk * tiles) * sizeof(TileSummary),
       static_cast<size_t>(chunk * tiles) * 4, static_cast<size_t>(chunk) * 8, static_cast<size_t>(chunk) * 8,
       p.replay ? static_cast<size_t>(p.rows) : 0, p.program.temperature_rows ? static_cast<size_t>(p.rows) * 4 : 0,
       split.slices > 1 ? static_cast<size_t>(chunk * split.slices * list_k) * 8 : 0},
      stream, p.device, "sampling workspace", hint);
  const float* temperatures = reinterpret_cast<const float*>(work.get(kTemperatures));
  if (p.program.temperature_rows)
    launch_program_temperatures(p.program.temperature_rows, reinterpret_cast<float*>(work.get(kTemperatures)), p.rows,
                                stream);
  DETLOGP_CUDA_CHECK(cudaMemsetAsync(work.get(kIgnored), 0xFF, static_cast<size_t>(chunk) * 8, stream));  // int64 -1

  for (int64_t row0 = 0; row0 < p.rows; row0 += chunk) {
    const int64_t rows = std::min(chunk, p.rows - row0);
    detail::LogpProblem q;
    static_cast<detail::HeadOperands&>(q) = p;
    q.rows = rows;
    q.hidden = p.hidden + row0 * p.hidden_stride;
    q.targets = work.get(kIgnored);
    q.targets_i64 = true;
    q.targets_per_row = 1;
    q.targets_2d = false;
    q.ignore_index = -1;
    q.temperature = p.program.temperature == 0.0f ? 1.0f : p.program.temperature;
    q.temperature_rows = p.program.temperature_rows ? temperatures + row0 : nullptr;
    q.stream = stream;
    q.vocab_local = v;
    q.logits = p.logits ? p.logits + row0 * v : reinterpret_cast<float*>(work.get(kLogits));
    q.logp = reinterpret_cast<float*>(work.get(kFusedOut));
    q.lse = q.logp + chunk;
    // Its inputs cannot fail the device validation (every target ignored, the temperatures
    // checked on the host above), so the host does not wait for its verdict before the row kernel.
    q.defer_errors = true;
    run(q);  // the serving entry's z
    if (split.slices > 1) {
      TopkRowsParams t;
      t.logits = q.logits;
      t.logits_stride = v;
      t.rows = rows;
      t.row_begin = row0;
      t.lanes = p.real_vocab;
      t.inv_temperature = inverse_temperature(q.temperature);
      t.temperature_rows = p.program.temperature_rows ? temperatures : nullptr;
      t.k = static_cast<int32_t>(list_k);
      t.slices = split.slices;
      t.slice_lanes = split.slice_lanes;
      t.slice_keys = reinterpret_cast<uint64_t*>(work.get(kSliceKeys));
      launch_topk_slice_lists(t, stream);
    }
    SampleRowsParams s;
    s.problem = p;
    if (split.slices > 1) {
      s.slice_keys = reinterpret_cast<const uint64_t*>(work.get(kSliceKeys));
      s.slices = split.slices;
      s.slice_k = static_cast<int32_t>(list_k);
    }
    s.row_begin = row0;
    s.rows = rows;
    s.logits = q.logits;
    s.lse = q.lse;
    s.tiles_per_row = tiles;
    s.tiles = reinterpret_cast<TileSummary*>(work.get(kSummaries));
    s.factors = reinterpret_cast<float*>(work.get(kFactors));
    s.outside = work.get(kOutside);
    s.radix_only = radix_only;
    launch_sample_rows(s, stream);
    if (p.topk > 0) {  // beside the draw: the top-k row kernel over the same z, at the fused run's T
      TopkRowsParams t;
      t.logits = q.logits;
      t.logits_stride = v;
      t.rows = rows;
      t.row_begin = row0;
      t.lanes = p.real_vocab;
      t.vocab_start = 0;
      t.inv_temperature = inverse_temperature(q.temperature);
      t.temperature_rows =  // the program's per-row T with 1 for T = 0, [call rows]
          p.program.temperature_rows ? temperatures : nullptr;
      t.k = static_cast<int32_t>(p.topk);
      t.lse = p.lse;  // the call's rows, written by the row kernel above: the fused run's lse
      t.ids = p.topk_ids;
      t.logp = p.topk_logp;
      launch_topk_rows(t, stream);
    }
  }
  if (p.replay) {
    std::vector<uint8_t> flags(static_cast<size_t>(p.rows));
    DETLOGP_CUDA_CHECK(cudaMemcpyAsync(flags.data(), work.get(kOutside), flags.size(), cudaMemcpyDeviceToHost, stream));
    DETLOGP_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int64_t n = 0; n < p.rows; ++n) {
      if (!flags[static_cast<size_t>(n)]) continue;
      if (report.outside_support == 0) report.first_outside_support = n;
      ++report.outside_support;
    }
  }
  return report;
}

// The top-k output on CUDA tensors (docs/contract.md §12): per row chunk, run() computes every
// output the call asks for and the chunk's z (into the caller's logits when asked for; the
// workspace budget bounds a chunk otherwise), then the top-k row kernel (topk.cu) reads z. The
// targets and row temperatures are read back and checked on the host first (one copy and a wait),
// so a bad value writes nothing in any chunk, and the chunks need no further wait.
void Sm90Backend::run_topk(const detail::LogpProblem& p) const {
  DeviceGuard guard(p.device);
  check_sm90_device(p.device);
  DETLOGP_CHECK(p.topk >= 1 && p.topk <= kMaxTopk, "topk=" << p.topk << " must be in [1, " << kMaxTopk << "]");
  DETLOGP_CHECK(p.real_vocab <= int64_t{0xFFFFFFFF},
                "the top-k output takes real_vocab below 2^32 (its keys hold 32-bit ids); real_vocab=" << p.real_vocab);
  check_alignment(p.topk_ids, 8, "topk_ids");
  const bool partial = p.partial_mode();
  check_alignment(partial ? p.topk_logit : p.topk_logp, 4, partial ? "topk_logit" : "topk_logp");
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  {
    const auto copies =
        read_back({{p.targets, static_cast<size_t>(p.rows * p.targets_per_row) * (p.targets_i64 ? 8 : 4)},
                   {p.temperature_rows, static_cast<size_t>(p.rows) * 4}},
                  stream);
    const std::vector<uint8_t>& targets = copies[0];
    const std::vector<uint8_t>& temps = copies[1];
    detail::HeadOperands host = p;
    host.memory = Memory::host;
    host.targets = targets.data();
    host.temperature_rows = p.temperature_rows ? reinterpret_cast<const float*>(temps.data()) : nullptr;
    detail::check_host_values(host);
  }
  // A few hundred rows in full mode without logits: the fused trainer run's lane-group candidates
  // instead of the serving logits (topk.hpp); fewer and more rows keep the row kernel over the logits.
  if (!partial && !p.logits && !p.entropy && p.targets_per_row == 1 && p.rows >= kTopkCandidateRows &&
      p.rows < kTopkCandidateMaxRows && detail::env_checked("DETLOGP_SM90_TOPK_LOGITS").value_or("0") != "1")
    return run_topk_candidates(p);

  // Rows per chunk: a row's fp32 logits, unless the caller's are the buffer.
  const int64_t v = p.vocab_local;
  const int64_t chunk = p.logits ? p.rows : row_kernel_chunk(p.rows, v * 4);
  const ShardGeometry g = partial ? p.geometry() : ShardGeometry{};
  const int64_t per_row = p.targets_per_row;
  const size_t target_bytes = p.targets_i64 ? 8 : 4;
  const int64_t lanes = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, v);
  int sms = 0;
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device));
  const TopkSplit split = topk_split(chunk, lanes, sms, p.topk);  // valid for the last, shorter chunk too
  // One workspace: the chunk's logits (unless the caller's) and the split's slice lists.
  const StreamBuffers work({p.logits ? 0 : static_cast<size_t>(chunk * v) * 4,
                            split.slices > 1 ? static_cast<size_t>(chunk * split.slices * p.topk) * 8 : 0},
                           stream, p.device, "top-k workspace",
                           "lower DETLOGP_SM90_WORKSPACE_MB to chunk N into smaller pieces");
  for (int64_t row0 = 0; row0 < p.rows; row0 += chunk) {
    const int64_t rows = std::min(chunk, p.rows - row0);
    detail::LogpProblem q = p;
    q.rows = rows;
    q.hidden = p.hidden + row0 * p.hidden_stride;
    q.targets = static_cast<const uint8_t*>(p.targets) + static_cast<size_t>(row0 * per_row) * target_bytes;
    if (p.temperature_rows) q.temperature_rows = p.temperature_rows + row0;
    q.logits = p.logits ? p.logits + row0 * v : reinterpret_cast<float*>(work.get(0));
    q.topk = 0;
    q.topk_ids = nullptr;
    q.topk_logp = nullptr;
    q.topk_logit = nullptr;
    q.defer_errors = true;  // checked on the host above: the device validation passes
    if (partial) {
      if (p.summaries) q.summaries = p.summaries + row0 * g.tiles;
      if (p.usums) q.usums = p.usums + row0 * g.tiles;
      if (p.edge_logits) q.edge_logits = p.edge_logits + row0 * g.edge_lanes();
      q.target_logit = p.target_logit + row0 * per_row;
      q.target_owned = p.target_owned + row0 * per_row;
    } else {
      q.logp = p.logp + row0 * per_row;
      q.lse = p.lse + row0;
      if (p.entropy) q.entropy = p.entropy + row0;
    }
    run(q);
    TopkRowsParams t;
    t.logits = q.logits;
    t.logits_stride = v;
    t.rows = rows;
    t.row_begin = row0;
    t.lanes = lanes;
    t.vocab_start = p.vocab_start;
    t.inv_temperature = inverse_temperature(p.temperature);
    t.temperature_rows = p.temperature_rows;
    t.k = static_cast<int32_t>(p.topk);
    t.ids = p.topk_ids;
    if (partial) {
      t.logit = p.topk_logit;
    } else {
      t.lse = p.lse;
      t.logp = p.topk_logp;
    }
    t.slices = split.slices;
    t.slice_lanes = split.slice_lanes;
    t.slice_keys = reinterpret_cast<uint64_t*>(work.get(1));
    launch_topk_rows(t, stream);
  }
}

// The top-k output from the fused trainer run's lane-group candidates (full mode; run_topk has
// checked the call and its values): per row chunk, run_fused with the candidate buffers (logp,
// lse and, from the summaries' combine, every output of the plain call), then the candidate row
// kernel (topk.cu), which recomputes the few lane groups it cannot decide from their maxima.
void Sm90Backend::run_topk_candidates(const detail::LogpProblem& p) const {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int64_t groups = p.local_tiles() * kGroupsPerTile;
  // Chunks of equal size: a short last chunk's fused run is the least efficient one.
  const int64_t budget_chunk = row_kernel_chunk(p.rows, groups * 9);
  const int64_t chunks = (p.rows + budget_chunk - 1) / budget_chunk;
  const int64_t chunk = (p.rows + chunks - 1) / chunks;
  const char* hint = "lower DETLOGP_SM90_WORKSPACE_MB to chunk N into smaller pieces";
  // The groups' max, second and first-max column, and the rows' undecided flags, in one workspace.
  const StreamBuffers work({static_cast<size_t>(chunk * groups) * 4, static_cast<size_t>(chunk * groups) * 4,
                            static_cast<size_t>(chunk * groups), static_cast<size_t>(chunk)},
                           stream, p.device, "top-k candidates", hint);
  const Candidates c{reinterpret_cast<float*>(work.get(0)), reinterpret_cast<float*>(work.get(1)), work.get(2), groups};
  const size_t target_bytes = p.targets_i64 ? 8 : 4;
  for (int64_t row0 = 0; row0 < p.rows; row0 += chunk) {
    const int64_t rows = std::min(chunk, p.rows - row0);
    detail::LogpProblem q = p;
    q.rows = rows;
    q.hidden = p.hidden + row0 * p.hidden_stride;
    q.targets = static_cast<const uint8_t*>(p.targets) + static_cast<size_t>(row0) * target_bytes;
    if (p.temperature_rows) q.temperature_rows = p.temperature_rows + row0;
    q.topk = 0;
    q.topk_ids = nullptr;
    q.topk_logp = nullptr;
    q.defer_errors = true;  // checked on the host: the device validation passes
    q.logp = p.logp + row0;
    q.lse = p.lse + row0;
    run_fused(q, &c);
    TopkCandidatesParams t;
    t.cand_max = c.max;
    t.cand_second = c.second;
    t.cand_lane = c.lane;
    t.groups = groups;
    t.rows = rows;
    t.row_begin = row0;
    t.lanes = std::min(p.real_vocab, p.vocab_local);
    t.hidden = p.hidden;
    t.hidden_stride = p.hidden_stride;
    t.weight = p.weight;
    t.weight_stride = p.weight_stride;
    t.dim = p.dim;
    t.bias = p.bias;
    t.inv_temperature = inverse_temperature(p.temperature);
    t.temperature_rows = p.temperature_rows;
    t.k = static_cast<int32_t>(p.topk);
    t.lse = p.lse;
    t.ids = p.topk_ids;
    t.logp = p.topk_logp;
    t.undecided = work.get(3);
    launch_topk_candidates(t, stream);
  }
}

}  // namespace

ProgramReadBack check_device_program(const detail::ProgramOperands& program, int64_t rows, int64_t real_vocab,
                                     cudaStream_t stream, DeviceArray also) {
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{program.temperature_rows, "temperature_rows"},
                                  {program.top_p_rows, "top_p_rows"},
                                  {program.min_p_rows, "min_p_rows"}})
    if (ptr) check_alignment(ptr, 4, name);
  if (program.top_k_rows) check_alignment(program.top_k_rows, program.top_k_i64 ? 8 : 4, "top_k_rows");
  const size_t n = static_cast<size_t>(rows);
  auto copies = read_back({{program.temperature_rows, n * 4},
                           {program.top_k_rows, n * (program.top_k_i64 ? 8 : 4)},
                           {program.top_p_rows, n * 4},
                           {program.min_p_rows, n * 4},
                           also},
                          stream);
  const std::vector<uint8_t>& temps = copies[0];
  const std::vector<uint8_t>& top_k = copies[1];
  const std::vector<uint8_t>& top_p = copies[2];
  const std::vector<uint8_t>& min_p = copies[3];
  detail::ProgramOperands host = program;
  host.temperature_rows = program.temperature_rows ? reinterpret_cast<const float*>(temps.data()) : nullptr;
  host.top_k_rows = program.top_k_rows ? top_k.data() : nullptr;
  host.top_p_rows = program.top_p_rows ? reinterpret_cast<const float*>(top_p.data()) : nullptr;
  host.min_p_rows = program.min_p_rows ? reinterpret_cast<const float*>(min_p.data()) : nullptr;
  detail::check_program_rows(host, rows);
  ProgramReadBack back;
  back.also = std::move(copies[4]);
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t keep = host.row(n, real_vocab).keep;
    if (keep < real_vocab && keep <= kMaxTopk) back.largest_small_keep = std::max(back.largest_small_keep, keep);
  }
  return back;
}

}  // namespace detlogp::sm90

namespace detlogp::detail {

const Backend& sm90_contract_backend() {
  static const sm90::Sm90Backend backend;
  return backend;
}

}  // namespace detlogp::detail

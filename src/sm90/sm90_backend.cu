// cuda-fused-linear-logp-sm90-contract-v1: host side of the SM90 backend. Validates what TMA
// needs, stages host problems to the device, sizes the workspace (chunking N), encodes the tensor
// maps and enqueues validate -> fused -> combine (full) or fused + owner flags (partial mode).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.hpp"
#include "core/device_ops.hpp"
#include "detlogp/config.hpp"
#include "sm90/sm90_backend.hpp"
#include "sm90/sm90_common.hpp"
#include "sm90/sm90_host.hpp"
#include "sm90/sm90_launch_table.hpp"

namespace detlogp::sm90 {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point: no link against libcuda.
EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    DETLOGP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q));
    DETLOGP_CHECK(q == cudaDriverEntryPointSuccess && ptr != nullptr,
                  "the CUDA driver does not provide cuTensorMapEncodeTiled (driver too old for TMA)");
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

}  // namespace

CUtensorMap encode_bf16_map(const uint16_t* base, int64_t rows, int64_t cols, int64_t stride, int box_rows,
                            const char* name, int promotion) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      encode_tiled_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(base), dims, strides, box,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        promotion == 0     ? CU_TENSOR_MAP_L2_PROMOTION_NONE
                        : promotion == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                           : CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DETLOGP_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed for " << name << " [" << rows << ", " << cols
                                                                        << "] stride " << stride << ": CUresult " << r);
  return map;
}

void check_tma_operand(const void* ptr, int64_t stride_elems, const char* name) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  DETLOGP_CHECK(addr % 16 == 0, name << " base pointer 0x" << std::hex << addr << std::dec
                                     << " is not 16-byte aligned (TMA requirement of the SM90 backend)");
  DETLOGP_CHECK((stride_elems * 2) % 16 == 0,
                name << " row stride of " << stride_elems << " bf16 elements (" << stride_elems * 2
                     << " bytes) is not a multiple of 16 bytes (TMA requirement of the SM90 backend; pad D to a "
                        "multiple of 8)");
  DETLOGP_CHECK(stride_elems * 2 < (int64_t{1} << 40),
                name << " row stride " << stride_elems << " exceeds the TMA limit");
}

void check_alignment(const void* ptr, size_t align, const char* name) {
  DETLOGP_CHECK(reinterpret_cast<uintptr_t>(ptr) % align == 0,
                name << " pointer " << ptr << " is not " << align << "-byte aligned");
}

void check_head_operands(const uint16_t* hidden, int64_t hidden_stride, const uint16_t* weight, int64_t weight_stride,
                         int64_t rows, int64_t vocab, const char* vocab_name, int64_t dim, const void* targets,
                         bool targets_i64, const float* bias, const float* temperature_rows) {
  check_tma_operand(hidden, hidden_stride, "hidden");
  check_tma_operand(weight, weight_stride, "weight");
  DETLOGP_CHECK(rows < (int64_t{1} << 31) - 256, "N=" << rows << " rows exceeds the SM90 backend's 2^31 limit");
  DETLOGP_CHECK(vocab < (int64_t{1} << 31) - 256, vocab_name << "=" << vocab << " exceeds 2^31");
  DETLOGP_CHECK(dim >= 1 && dim < (int64_t{1} << 31), "D=" << dim << " out of range");
  check_alignment(targets, targets_i64 ? 8 : 4, "targets");
  if (bias) check_alignment(bias, 4, "bias");
  if (temperature_rows) check_alignment(temperature_rows, 4, "temperature_rows");
}

void check_sm90_device(int device) {
  // Attribute queries are cheap; cudaGetDeviceProperties is not (it showed in N=1 latency).
  int major = 0, minor = 0;
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  DETLOGP_CHECK(major == 9 && minor == 0, "CUDA device " << device << " has compute capability " << major << "."
                                                         << minor << "; the SM90 backend needs 9.0");
}

cudaMemPool_t workspace_pool(int device) {
  static std::mutex mu;
  static std::map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = pools.find(device); it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  DETLOGP_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  uint64_t keep = ~uint64_t{0};
  DETLOGP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  pools[device] = pool;
  return pool;
}

StreamBuffer::StreamBuffer(size_t bytes, cudaStream_t stream, int device, const char* what, const char* hint)
    : stream_(stream) {
  const cudaError_t e = cudaMallocFromPoolAsync(&ptr_, bytes, workspace_pool(device), stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ptr_ = nullptr;
    DETLOGP_FAIL("could not allocate " << bytes << " bytes of device memory for the SM90 " << what << ": "
                                       << cudaGetErrorName(e) << (hint != nullptr ? " (" : "")
                                       << (hint != nullptr ? hint : "") << (hint != nullptr ? ")" : ""));
  }
}

namespace {
// Host-mapped status slots of this host thread (pinned, portable, mapped), a ring indexed by the
// call's sequence number, so a late write of an abandoned call never lands in a live slot.
struct MappedStatus {
  static constexpr uint64_t kSlots = 16;
  HostStatusSlot* host = nullptr;
  uint64_t next_seq = 0;
  ~MappedStatus() {
    if (host != nullptr) (void)cudaFreeHost(host);
  }
};

MappedStatus& mapped_status() {
  thread_local MappedStatus slots;
  if (slots.host == nullptr) {
    void* ptr = nullptr;
    DETLOGP_CUDA_CHECK(cudaHostAlloc(&ptr, sizeof(HostStatusSlot) * MappedStatus::kSlots,
                                     cudaHostAllocPortable | cudaHostAllocMapped));
    slots.host = static_cast<HostStatusSlot*>(ptr);
    for (uint64_t i = 0; i < MappedStatus::kSlots; ++i) new (&slots.host[i]) HostStatusSlot{};
  }
  return slots;
}

DeviceStatus wait_for_validation(HostStatusSlot* slot, uint64_t seq, cudaStream_t stream) {
  const volatile uint64_t* flag = &slot->seq;
  for (uint32_t spin = 1;; ++spin) {
    if (*flag == seq) break;
    if (spin % 256 == 0) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e != cudaSuccess && e != cudaErrorNotReady) DETLOGP_CUDA_CHECK(e);
      DETLOGP_CHECK(e != cudaSuccess || *flag == seq,
                    "internal error: the SM90 validation kernel finished without reporting its status");
      std::this_thread::yield();
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  DeviceStatus status;
  std::memcpy(&status, const_cast<const DeviceStatus*>(&static_cast<volatile HostStatusSlot*>(slot)->status),
              sizeof status);
  return status;
}

}  // namespace

Verdict prepare_verdict(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DETLOGP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  Verdict v;
  if (capture != cudaStreamCaptureStatusNone) return v;
  MappedStatus& slots = mapped_status();
  v.seq = ++slots.next_seq;
  v.host = &slots.host[v.seq % MappedStatus::kSlots];
  void* device_ptr = nullptr;
  DETLOGP_CUDA_CHECK(cudaHostGetDevicePointer(&device_ptr, v.host, 0));
  v.device = static_cast<HostStatusSlot*>(device_ptr);
  return v;
}

DeviceStatus await_verdict(const Verdict& v, cudaStream_t stream) {
  DETLOGP_CHECK(v.host != nullptr, "internal error: no validation verdict to wait for (stream capture)");
  return wait_for_validation(v.host, v.seq, stream);
}

namespace {

int64_t workspace_mib() {
  const char* v = std::getenv(kWorkspaceEnv);
  if (v == nullptr || *v == '\0') return kDefaultWorkspaceMiB;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  DETLOGP_CHECK(*end == '\0' && n >= 1 && n <= (1 << 20),
                kWorkspaceEnv << "=" << v << " must be an integer in [1, 1048576] (MiB)");
  return n;
}

// Plain device buffer of the host-staging path.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, const char* what) {
    if (bytes == 0) return;
    const cudaError_t e = cudaMalloc(&ptr_, bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      DETLOGP_FAIL("could not allocate " << bytes << " bytes of device memory for " << what << ": "
                                         << cudaGetErrorName(e));
    }
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    return *this;
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

constexpr size_t kStatusBytes = 256;  // keeps the arrays after it 256-byte aligned

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct WorkspaceLayout {
  int64_t chunk = 0;
  size_t summaries_offset = 0;
  size_t target_offset = 0;
  size_t bytes = 0;
};

WorkspaceLayout layout_for(const detail::LogpProblem& p) {
  WorkspaceLayout w;
  w.bytes = kStatusBytes;
  if (p.partial_mode()) return w;  // summaries and y_t go straight to the caller's buffers
  w.chunk = chunk_rows(p.rows, p.local_tiles());
  w.summaries_offset = w.bytes;
  w.bytes += round_up(static_cast<size_t>(w.chunk * p.local_tiles()) * sizeof(TileSummary), 256);
  w.target_offset = w.bytes;
  w.bytes += round_up(static_cast<size_t>(w.chunk) * sizeof(float), 256);
  return w;
}

class Sm90Backend final : public detail::Backend {
 public:
  Sm90Backend() {
    prov_ = detail::contract_provenance(kBackendId, "sm90a", 0);
    probe();
  }
  const Provenance& provenance() const override { return prov_; }
  bool contract_bearing() const override { return true; }
  Memory memory() const override { return Memory::cuda; }
  // why: the reason it cannot run, or the device it would use.
  bool available(std::string* why) const override {
    if (why != nullptr) *why = reason_;
    return available_;
  }

  void run(const detail::LogpProblem& p) const override;
  void run_from_host(const detail::LogpProblem& p) const override;

 private:
  void probe() {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      reason_ = e != cudaSuccess
                    ? std::string("no usable CUDA device (") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")"
                    : std::string("no CUDA device present");
      return;
    }
    int dev = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      reason_ = "could not query the current CUDA device";
      return;
    }
    prov_.cc = prop.major * 10 + prop.minor;
    if (prop.major != 9 || prop.minor != 0) {
      reason_ = "CUDA device " + std::to_string(dev) + " (" + prop.name + ") has compute capability " +
                std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                "; this backend is built for sm_90a (H100/H200, compute capability 9.0)";
      return;
    }
    available_ = true;
    reason_ = "CUDA device " + std::to_string(dev) + ": " + prop.name + " (sm_90a)";
  }

  Provenance prov_;
  bool available_ = false;
  std::string reason_;
};

void Sm90Backend::run(const detail::LogpProblem& p) const {
  DETLOGP_CHECK(available_, "SM90 backend unavailable: " << reason_);
  DETLOGP_CHECK(p.memory == Memory::cuda, "the SM90 backend's run() needs tensors in CUDA memory (use run_from_host)");
  if (p.rows == 0) return;
  DeviceGuard guard(p.device);
  check_sm90_device(p.device);
  // What TMA and the kernels need beyond the API's checks.
  check_head_operands(p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.rows, p.vocab_local, "V_local", p.dim,
                      p.targets, p.targets_i64, p.bias, p.temperature_rows);
  if (p.logits) check_alignment(p.logits, 4, "logits");
  if (p.partial_mode()) {
    check_alignment(p.summaries, 8, "summaries");
    check_alignment(p.target_logit, 4, "target_logit");
  } else {
    DETLOGP_CHECK(p.vocab_start == 0 && p.vocab_local >= p.real_vocab,
                  "full mode needs the whole real vocabulary (vocab_start="
                      << p.vocab_start << ", V_local=" << p.vocab_local << ", real_vocab=" << p.real_vocab << ")");
    check_alignment(p.logp, 4, "logp");
    check_alignment(p.lse, 4, "lse");
  }

  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const WorkspaceLayout lay = layout_for(p);
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
  f.temperature = p.temperature;
  f.inv_temperature = inverse_temperature(p.temperature);  // IEEE fl(1 / T), as on the device
  f.temperature_rows = p.temperature_rows;
  f.logits = p.logits;  // partial mode too: a tensor-parallel rank's serving entry keeps its shard
  f.local_tiles = p.local_tiles();
  f.whole_tiles = whole_local_tiles(p.vocab_local, p.vocab_start, p.real_vocab);
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
    const Bucket b = select_bucket(rows, p.vocab_local, p.dim, f.logits != nullptr, sms);
    const BucketInfo bi = bucket_info(b);
    if (launches.empty() || launches.back().bucket != b) {
      launches.push_back({b, encode_bf16_map(p.hidden, p.rows, p.dim, p.hidden_stride, bi.block_m, "hidden"),
                          encode_bf16_map(p.weight, p.vocab_local, p.dim, p.weight_stride, bi.weight_box_rows(),
                                          "weight", bi.weight_promotion),
                          f});
    } else {
      const ChunkLaunch same_maps = launches.back();
      launches.push_back(same_maps);
    }
    FusedParams& q = launches.back().params;
    q = f;
    q.row_begin = row_begin;
    q.row_end = row_begin + rows;
    q.m_tiles = static_cast<int32_t>((rows + bi.block_m - 1) / bi.block_m);
    q.n_tiles = static_cast<int32_t>((p.vocab_local + bi.block_n - 1) / bi.block_n);
    q.group_m = std::max(1, 2048 / bi.block_m);  // ~2048 rows of hidden stay in L2 per weight pass
  };
  if (p.partial_mode()) {
    plan_rows(0, p.rows);
  } else {
    for (int64_t row0 = 0; row0 < p.rows; row0 += lay.chunk) plan_rows(row0, std::min(lay.chunk, p.rows - row0));
  }

  // Under stream capture no host wait is possible (and replays must not touch a live slot): the
  // kernels still write nothing on invalid input, but the error cannot be raised from here.
  const Verdict verdict = prepare_verdict(stream);

  StreamBuffer ws(lay.bytes, stream, p.device, "workspace",
                  "lower DETLOGP_SM90_WORKSPACE_MB to chunk N into smaller pieces");
  auto* status = reinterpret_cast<DeviceStatus*>(ws.get());
  const ValidateParams validate{p.rows,       p.targets,      p.targets_i64 ? 1 : 0,
                                p.real_vocab, p.ignore_index, p.temperature_rows,
                                status,       verdict.device, verdict.seq};
  // The trainer entry (full mode, no logits) writes nothing the caller sees before the combine, so
  // its first fused launch can validate the inputs itself (an idle producer warp of CTA 0): a
  // separate validation kernel cost ~4 us plus a ~20-26 us gap before the fused kernel started
  // (torch profiler, H200, N = 1024 and 4096; docs/perf-notes.md run 46). One warp scans the rows
  // with about 1/32 of a load latency per row, hidden behind the fused kernel when every row
  // carries >= 2^26 FLOPs (Qwen3-0.6B's head: 3e8) and at decode sizes; tiny heads with many rows
  // keep the 1024-thread validation kernel. The other entries validate first: they write what the
  // caller sees. The combine is a programmatic dependent launch (it waits for the whole grid).
  const bool validation_hides = p.rows <= 64 || 2.0 * double(p.vocab_local) * double(p.dim) >= double(1 << 26);
  const bool validate_in_kernel = !p.partial_mode() && p.logits == nullptr && validation_hides;
  if (!validate_in_kernel) launch_validate(validate, stream);

  if (p.partial_mode()) {
    launch_partial_owner(PartialOwnerParams{p.rows, p.targets, p.targets_i64 ? 1 : 0, p.ignore_index, p.vocab_start,
                                            p.vocab_local, p.target_logit, p.target_owned, status},
                         stream);
    FusedParams& q = launches[0].params;
    q.summaries = p.summaries;
    q.target_logit = p.target_logit;
    q.status = status;
    launch_fused(launches[0].bucket, launches[0].map_h, launches[0].map_w, q, vec2, sms, stream);
  } else {
    auto* summaries = reinterpret_cast<TileSummary*>(ws.get() + lay.summaries_offset);
    auto* target_logit = reinterpret_cast<float*>(ws.get() + lay.target_offset);
    for (size_t i = 0; i < launches.size(); ++i) {
      ChunkLaunch& l = launches[i];
      FusedParams& q = l.params;
      q.summaries = summaries;
      q.target_logit = target_logit;
      q.status = status;
      q.validate_in_kernel = validate_in_kernel && i == 0 ? 1 : 0;
      q.validate = validate;
      launch_fused(l.bucket, l.map_h, l.map_w, q, vec2, sms, stream);
      launch_combine(CombineParams{q.row_begin, q.row_end - q.row_begin, p.local_tiles(), summaries, target_logit,
                                   p.targets, p.targets_i64 ? 1 : 0, p.ignore_index, p.logp, p.lse, status},
                     stream, /*programmatic=*/true);
    }
  }

  if (verdict.host == nullptr) return;  // capturing
  const DeviceStatus status_seen = await_verdict(verdict, stream);
  if (status_seen.code != kStatusOk) throw_status(status_seen, p);
}

void Sm90Backend::run_from_host(const detail::LogpProblem& hp) const {
  DETLOGP_CHECK(available_, "SM90 backend unavailable: " << reason_);
  DETLOGP_CHECK(hp.memory == Memory::host, "run_from_host needs a problem in host memory");
  if (hp.rows == 0) return;
  int device = 0;
  DETLOGP_CUDA_CHECK(cudaGetDevice(&device));
  const int64_t n = hp.rows, d = hp.dim, v = hp.vocab_local, tiles = hp.local_tiles();
  // Contiguous device copies (row stride D, padded to a multiple of 8 elements for TMA).
  const int64_t ds = (d + 7) / 8 * 8;
  DeviceBuffer hidden(static_cast<size_t>(n * ds) * 2, "hidden"), weight(static_cast<size_t>(v * ds) * 2, "weight");
  DETLOGP_CUDA_CHECK(cudaMemset(hidden.as<void>(), 0, static_cast<size_t>(n * ds) * 2));
  DETLOGP_CUDA_CHECK(cudaMemset(weight.as<void>(), 0, static_cast<size_t>(v * ds) * 2));
  DETLOGP_CUDA_CHECK(
      cudaMemcpy2D(hidden.as<void>(), ds * 2, hp.hidden, hp.hidden_stride * 2, d * 2, n, cudaMemcpyHostToDevice));
  DETLOGP_CUDA_CHECK(
      cudaMemcpy2D(weight.as<void>(), ds * 2, hp.weight, hp.weight_stride * 2, d * 2, v, cudaMemcpyHostToDevice));
  const size_t tbytes = static_cast<size_t>(n) * (hp.targets_i64 ? 8 : 4);
  DeviceBuffer targets(tbytes, "targets");
  DETLOGP_CUDA_CHECK(cudaMemcpy(targets.as<void>(), hp.targets, tbytes, cudaMemcpyHostToDevice));
  DeviceBuffer bias, temps;
  detail::LogpProblem p = hp;
  p.memory = Memory::cuda;
  p.device = device;
  p.stream = nullptr;
  p.hidden = hidden.as<uint16_t>();
  p.hidden_stride = ds;
  p.weight = weight.as<uint16_t>();
  p.weight_stride = ds;
  p.targets = targets.as<void>();
  if (hp.bias) {
    bias = DeviceBuffer(static_cast<size_t>(v) * 4, "bias");
    DETLOGP_CUDA_CHECK(cudaMemcpy(bias.as<void>(), hp.bias, static_cast<size_t>(v) * 4, cudaMemcpyHostToDevice));
    p.bias = bias.as<float>();
  }
  if (hp.temperature_rows) {
    temps = DeviceBuffer(static_cast<size_t>(n) * 4, "temperature_rows");
    DETLOGP_CUDA_CHECK(
        cudaMemcpy(temps.as<void>(), hp.temperature_rows, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice));
    p.temperature_rows = temps.as<float>();
  }
  DeviceBuffer logp, lse, logits, summaries, target_logit, owned;
  if (hp.partial_mode()) {
    summaries = DeviceBuffer(static_cast<size_t>(n * tiles) * sizeof(TileSummary), "summaries");
    target_logit = DeviceBuffer(static_cast<size_t>(n) * 4, "target_logit");
    owned = DeviceBuffer(static_cast<size_t>(n), "target_owned");
    p.summaries = summaries.as<TileSummary>();
    p.target_logit = target_logit.as<float>();
    p.target_owned = owned.as<uint8_t>();
    if (hp.logits) {
      logits = DeviceBuffer(static_cast<size_t>(n * v) * 4, "logits");
      p.logits = logits.as<float>();
    }
  } else {
    logp = DeviceBuffer(static_cast<size_t>(n) * 4, "logp");
    lse = DeviceBuffer(static_cast<size_t>(n) * 4, "lse");
    p.logp = logp.as<float>();
    p.lse = lse.as<float>();
    if (hp.logits) {
      logits = DeviceBuffer(static_cast<size_t>(n * v) * 4, "logits");
      p.logits = logits.as<float>();
    }
  }
  run(p);
  if (hp.partial_mode()) {
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.summaries, p.summaries, static_cast<size_t>(n * tiles) * sizeof(TileSummary),
                                  cudaMemcpyDeviceToHost));
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.target_logit, p.target_logit, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost));
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.target_owned, p.target_owned, static_cast<size_t>(n), cudaMemcpyDeviceToHost));
    if (hp.logits)
      DETLOGP_CUDA_CHECK(cudaMemcpy(hp.logits, p.logits, static_cast<size_t>(n * v) * 4, cudaMemcpyDeviceToHost));
  } else {
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.logp, p.logp, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost));
    DETLOGP_CUDA_CHECK(cudaMemcpy(hp.lse, p.lse, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost));
    if (hp.logits)
      DETLOGP_CUDA_CHECK(cudaMemcpy(hp.logits, p.logits, static_cast<size_t>(n * v) * 4, cudaMemcpyDeviceToHost));
  }
}

}  // namespace

void throw_status(const DeviceStatus& s, const detail::LogpProblem& p) {
  if (s.code == kStatusBadTarget) {
    if (s.target < 0)
      DETLOGP_FAIL("targets[" << s.row << "]=" << s.target << " is negative and not ignore_index=" << p.ignore_index
                              << " (checked on the device; nothing was written)");
    DETLOGP_FAIL("targets[" << s.row << "]=" << s.target << " is >= real_vocab=" << p.real_vocab
                            << " (checked on the device; nothing was written)");
  }
  if (s.code == kStatusBadTemperature)
    DETLOGP_FAIL("temperature_rows[" << s.row << "]=" << s.temperature
                                     << " must be finite and > 0 (checked on the device; nothing was written)");
  DETLOGP_FAIL("SM90 validation returned an unknown status code " << s.code);
}

int64_t chunk_rows(int64_t rows, int64_t local_tiles) {
  const int64_t per_row = local_tiles * static_cast<int64_t>(sizeof(TileSummary)) + static_cast<int64_t>(sizeof(float));
  int64_t chunk = (workspace_mib() << 20) / per_row;
  chunk = std::max<int64_t>(128, chunk / 128 * 128);
  return std::min(chunk, rows);
}

int64_t workspace_bytes(const detail::LogpProblem& p) { return static_cast<int64_t>(layout_for(p).bytes); }

}  // namespace detlogp::sm90

namespace detlogp::detail {

void device_merge(const std::vector<DeviceMergeRank>& ranks, int64_t rows, const void* targets, bool targets_i64,
                  int64_t ignore_index, float* logp, float* lse, int device, void* stream) {
  DETLOGP_CHECK(!ranks.empty() && ranks.size() <= static_cast<size_t>(sm90::kMaxMergeSegments),
                "the device merge takes 1.." << sm90::kMaxMergeSegments << " ranks, got " << ranks.size());
  if (rows == 0) return;
  sm90::DeviceGuard guard(device);
  sm90::MergeParams p{};
  p.rows = rows;
  p.count = static_cast<int32_t>(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r)
    p.segments[r] = sm90::MergeSegment{ranks[r].summaries, ranks[r].tiles, ranks[r].target_logit, ranks[r].owned};
  p.targets = targets;
  p.targets_i64 = targets_i64 ? 1 : 0;
  p.ignore_index = ignore_index;
  p.logp = logp;
  p.lse = lse;
  sm90::launch_merge(p, static_cast<cudaStream_t>(stream));
}

DeviceAllocation::DeviceAllocation(size_t bytes, int device, const char* what) : device_(device) {
  if (bytes == 0) return;
  sm90::DeviceGuard guard(device);
  const cudaError_t e = cudaMalloc(&ptr_, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ptr_ = nullptr;
    DETLOGP_FAIL("could not allocate " << bytes << " bytes on CUDA device " << device << " for " << what << ": "
                                       << cudaGetErrorName(e));
  }
}

DeviceAllocation::~DeviceAllocation() {
  if (ptr_ == nullptr) return;
  sm90::DeviceGuard guard(device_);
  (void)cudaFree(ptr_);
}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& o) noexcept {
  std::swap(ptr_, o.ptr_);
  std::swap(device_, o.device_);
  return *this;
}

void device_copy_async(void* dst, const void* src, size_t bytes, int device, void* stream) {
  if (bytes == 0) return;
  sm90::DeviceGuard guard(device);
  DETLOGP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

void device_stream_sync(int device, void* stream) {
  sm90::DeviceGuard guard(device);
  DETLOGP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

const Backend& sm90_contract_backend() {
  static const sm90::Sm90Backend backend;
  return backend;
}

}  // namespace detlogp::detail

// linear_logp_grad_logits on SM90: validate (device-resident targets and temperatures, the
// forward's status-word pattern) -> one persistent ping-pong kernel that recomputes each logit
// tile with the forward's TMA + wgmma mainloop (pingpong_produce / pingpong_consume) and writes
// the bf16 logit gradient from the accumulators (sm90_epilogue_grad_logits.cuh). No workspace
// besides the status word, no atomics; every dz element is written by exactly one thread.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "core/grad_logits.hpp"
#include "sm90/sm90_backend.hpp"
#include "sm90/sm90_common.hpp"
#include "sm90/sm90_epilogue_grad_logits.cuh"
#include "sm90/sm90_mainloop_pingpong_tma_wgmma.cuh"

namespace detlogp::sm90 {
namespace {

// One m64n256 wgmma per k16 step, 5-stage ring: the forward's prefill shape.
using GradCfg = PingpongConfig<64, 256, 5>;

// Dynamic shared memory: kStages A tiles, kStages B tiles, then the full/empty barrier ring and
// the two mainloop-done barriers; 1024-byte aligned for the 128-byte swizzle (the forward's layout).
template <class Cfg>
struct GradRingSmem {
  uint8_t* a;
  uint8_t* b;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* mainloop_done;

  __device__ static GradRingSmem carve(uint8_t* raw) {
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    GradRingSmem r;
    r.a = base;
    r.b = base + Cfg::kStages * Cfg::kABytes;
    r.full = reinterpret_cast<uint64_t*>(r.b + Cfg::kStages * Cfg::kBBytes);
    r.empty = r.full + Cfg::kStages;
    r.mainloop_done = r.empty + Cfg::kStages;
    return r;
  }
};

// Persistent ping-pong: warpgroup 0 produces (one TMA thread), warpgroups 1 and 2 take alternate
// tiles of this CTA (local tile j is tile blockIdx.x + j * gridDim.x); mainloops run in local tile
// order, so one consumer's epilogue overlaps the other's mainloop.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    grad_logits_sm90_pingpong_kernel(const __grid_constant__ CUtensorMap map_hidden,
                                     const __grid_constant__ CUtensorMap map_weight, const GradLogitsParams p,
                                     const int dz_vec2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.status->code != kStatusOk) return;  // invalid input: write nothing (uniform over the grid)

  extern __shared__ uint8_t smem_raw[];
  const auto ring = GradRingSmem<Cfg>::carve(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&map_hidden);
    ptx::prefetch_tensormap(&map_weight);
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbar_init(&ring.full[s], 1);
      ptx::mbar_init(&ring.empty[s], 4);  // one arrival per warp of the consuming warpgroup
    }
    ptx::mbar_init(&ring.mainloop_done[0], 4);
    ptx::mbar_init(&ring.mainloop_done[1], 4);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0)
      pingpong_produce<Cfg>(&map_hidden, &map_weight, ring.a, ring.b, ring.full, ring.empty, p.k_blocks, 0, p.m_tiles,
                            p.n_tiles, p.group_m);
  } else {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int c = warpgroup - 1;
    const int lane = threadIdx.x % 32;
    const int total = p.m_tiles * p.n_tiles;
    uint32_t n = 0;  // tiles this warpgroup has taken so far
    for (int j = c, tile = blockIdx.x + c * gridDim.x; tile < total; j += 2, tile += 2 * gridDim.x, ++n) {
      if (j >= 1) {  // wait for the other warpgroup's mainloop of local tile j - 1
        const uint32_t completion = c == 1 ? n : n - 1;
        ptx::mbar_wait(&ring.mainloop_done[1 - c], completion & 1u);
      }
      int m_tile, n_tile;
      raster_tile(tile, p.m_tiles, p.n_tiles, p.group_m, m_tile, n_tile);
      const int64_t row0 = int64_t{m_tile} * Cfg::kWgM;
      const int64_t col0 = int64_t{n_tile} * Cfg::kBlockN;
      float acc[Cfg::kFragments][Cfg::kAccRegs];
      pingpong_consume<Cfg>(acc, ring.a, ring.b, ring.full, ring.empty, p.k_blocks,
                            static_cast<uint32_t>(j) * p.k_blocks);
      if (lane == 0) ptx::mbar_arrive(&ring.mainloop_done[c]);
#pragma unroll
      for (int f = 0; f < Cfg::kFragments; ++f)
        epilogue_grad_logits<Cfg::kBlockN>(acc[f], p, row0 + 64 * f, col0, dz_vec2 != 0);
    }
  }
#endif
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
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

// Row-major bf16 [rows][cols] with a row stride in elements, boxes of 64 columns (one 128-byte
// swizzle row) x box_rows rows; out-of-range elements read as zero (the forward's maps).
CUtensorMap encode_bf16_map(const uint16_t* base, int64_t rows, int64_t cols, int64_t stride, int box_rows,
                            const char* name) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      encode_tiled_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(base), dims, strides, box,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
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

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DETLOGP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) DETLOGP_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// A per-device stream-ordered pool that keeps its pages mapped (the status word is allocated on
// every call; the default pool would return and re-map its pages at every synchronization).
cudaMemPool_t status_pool(int device) {
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

// The status word, freed on the same stream even when a launch throws.
class StatusBuffer {
 public:
  StatusBuffer(cudaStream_t stream, int device) : stream_(stream) {
    const cudaError_t e = cudaMallocFromPoolAsync(&ptr_, 256, status_pool(device), stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      DETLOGP_FAIL("could not allocate the SM90 grad-logits status word: " << cudaGetErrorName(e));
    }
  }
  ~StatusBuffer() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  StatusBuffer(const StatusBuffer&) = delete;
  StatusBuffer& operator=(const StatusBuffer&) = delete;
  DeviceStatus* get() const { return static_cast<DeviceStatus*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace
}  // namespace detlogp::sm90

namespace detlogp::detail {

void sm90_grad_logits(const GradLogitsProblem& p) {
  using namespace detlogp::sm90;
  using Cfg = GradCfg;
  DETLOGP_CHECK(p.memory == Memory::cuda, "the SM90 logit gradient needs tensors in CUDA memory");
  if (p.rows == 0) return;
  DeviceGuard guard(p.device);
  {
    int major = 0, minor = 0;
    DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, p.device));
    DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, p.device));
    DETLOGP_CHECK(major == 9 && minor == 0, "CUDA device " << p.device << " has compute capability " << major << "."
                                                           << minor << "; the SM90 backend needs 9.0");
  }
  check_tma_operand(p.hidden, p.hidden_stride, "hidden");
  check_tma_operand(p.weight, p.weight_stride, "weight");
  DETLOGP_CHECK(p.rows < (int64_t{1} << 31) - 256, "N=" << p.rows << " rows exceeds the SM90 backend's 2^31 limit");
  DETLOGP_CHECK(p.cols < (int64_t{1} << 31) - 256, "C=" << p.cols << " exceeds 2^31");
  DETLOGP_CHECK(p.dim >= 1 && p.dim < (int64_t{1} << 31), "D=" << p.dim << " out of range");
  check_alignment(p.targets, p.targets_i64 ? 8 : 4, "targets");
  if (p.bias) check_alignment(p.bias, 4, "bias");
  if (p.temperature_rows) check_alignment(p.temperature_rows, 4, "temperature_rows");
  check_alignment(p.lse, 4, "lse");
  if (p.g_logp) check_alignment(p.g_logp, 4, "g_logp");
  if (p.g_lse) check_alignment(p.g_lse, 4, "g_lse");
  check_alignment(p.dz, 2, "dz");
  const int64_t m_tiles = (p.rows + Cfg::kWgM - 1) / Cfg::kWgM;
  const int64_t n_tiles = (p.cols + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int64_t tiles = m_tiles * n_tiles;
  DETLOGP_CHECK(tiles < (int64_t{1} << 31),
                "the grad-logits grid of " << m_tiles << " x " << n_tiles << " tiles is out of range");

  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  StatusBuffer status(stream, p.device);
  launch_validate(ValidateParams{p.rows, p.targets, p.targets_i64 ? 1 : 0, p.real_vocab, p.ignore_index,
                                 p.temperature_rows, status.get()},
                  stream);

  GradLogitsParams g{};
  g.rows = p.rows;
  g.cols = p.cols;
  g.real_cols = p.real_cols();
  g.vocab_start = p.vocab_start;
  g.ignore_index = p.ignore_index;
  g.k_blocks = static_cast<int32_t>((p.dim + Cfg::kBlockK - 1) / Cfg::kBlockK);
  g.m_tiles = static_cast<int32_t>(m_tiles);
  g.n_tiles = static_cast<int32_t>(n_tiles);
  g.group_m = std::max(1, 2048 / Cfg::kWgM);  // ~2048 rows of hidden stay in L2 per weight pass
  g.bias = p.bias;
  g.targets = p.targets;
  g.targets_i64 = p.targets_i64 ? 1 : 0;
  g.temperature = p.temperature;
  g.temperature_rows = p.temperature_rows;
  g.lse = p.lse;
  g.g_logp = p.g_logp;
  g.g_lse = p.g_lse;
  g.dz = p.dz;
  g.dz_stride = p.dz_stride;
  g.status = status.get();
  const bool vec2 = reinterpret_cast<uintptr_t>(p.dz) % 4 == 0 && p.dz_stride % 2 == 0;

  const CUtensorMap map_h = encode_bf16_map(p.hidden, p.rows, p.dim, p.hidden_stride, Cfg::kWgM, "hidden");
  const CUtensorMap map_w = encode_bf16_map(p.weight, p.cols, p.dim, p.weight_stride, Cfg::kBlockN, "weight");
  auto kernel = grad_logits_sm90_pingpong_kernel<Cfg>;
  DETLOGP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  int sms = 0;
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device));
  const int64_t blocks = std::min<int64_t>(tiles, sms);  // persistent: one CTA per SM
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(map_h, map_w, g, vec2 ? 1 : 0);
  DETLOGP_CUDA_CHECK_LAUNCH();

  // The validation status. Under stream capture a host read is impossible: the kernel still
  // writes nothing on invalid input, but the error cannot be raised from here.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DETLOGP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  DeviceStatus host_status;
  DETLOGP_CUDA_CHECK(cudaMemcpyAsync(&host_status, status.get(), sizeof host_status, cudaMemcpyDeviceToHost, stream));
  DETLOGP_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (host_status.code != kStatusOk) {
    LogpProblem named;  // throw_status names real_vocab and ignore_index
    named.real_vocab = p.real_vocab;
    named.ignore_index = p.ignore_index;
    throw_status(host_status, named);
  }
}

}  // namespace detlogp::detail

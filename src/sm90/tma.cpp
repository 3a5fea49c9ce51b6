// TMA tensor maps and the operand checks of the SM90 entry points. The driver's encoder is reached
// through the runtime's driver entry point, so the library never links libcuda.
#include "sm90/tma.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>

#include "cuda/check.hpp"

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

// A tensor map is a pure function of its arguments (the device does not enter: it encodes a virtual
// address), so the last few encodings are kept: a decode loop calls the same head with the same
// buffers, and the driver's encoder then runs only when a pointer, extent, stride or box changes.
// A hit returns the bytes the encoder returned for the same arguments.
struct MapKey {
  const uint16_t* base;
  int64_t rows, cols, stride;
  int box_rows, promotion;
  bool operator==(const MapKey&) const = default;
};
struct MapEntry {
  MapKey key;
  CUtensorMap map;
};
constexpr size_t kMapCacheEntries = 16;
std::mutex map_mutex;
std::array<MapEntry, kMapCacheEntries> map_cache;
size_t map_count = 0, map_next = 0;

CUtensorMap encode_uncached(const uint16_t* base, int64_t rows, int64_t cols, int64_t stride, int box_rows,
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

}  // namespace

CUtensorMap encode_bf16_map(const uint16_t* base, int64_t rows, int64_t cols, int64_t stride, int box_rows,
                            const char* name, int promotion) {
  const MapKey key{base, rows, cols, stride, box_rows, promotion};
  {
    const std::lock_guard<std::mutex> lock(map_mutex);
    for (size_t i = 0; i < map_count; ++i)
      if (map_cache[i].key == key) return map_cache[i].map;
  }
  const CUtensorMap map = encode_uncached(base, rows, cols, stride, box_rows, name, promotion);  // throws: not kept
  const std::lock_guard<std::mutex> lock(map_mutex);
  map_cache[map_next] = MapEntry{key, map};
  map_next = (map_next + 1) % kMapCacheEntries;
  map_count = std::max(map_count, map_next == 0 ? kMapCacheEntries : map_next);
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
  // Attribute queries are cheap; cudaGetDeviceProperties is not (it showed in N=1 latency). A device
  // found to be 9.0 stays so: later calls skip the queries (a refused one is queried again, to say why).
  static std::atomic<uint64_t> checked{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (checked.load(std::memory_order_acquire) & bit) != 0) return;
  int major = 0, minor = 0;
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  DETLOGP_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  DETLOGP_CHECK(major == 9 && minor == 0, "CUDA device " << device << " has compute capability " << major << "."
                                                         << minor << "; the SM90 backend needs 9.0");
  checked.fetch_or(bit, std::memory_order_acq_rel);
}

}  // namespace detlogp::sm90

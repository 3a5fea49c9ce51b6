// Frozen constants of the detlogp numeric contract v1 (docs/contract.md §2) and the
// host/device qualifiers every contract-core function is compiled with.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DETLOGP_HD __host__ __device__ __forceinline__
#else
#define DETLOGP_HD inline
#endif

// Full unrolling of the fixed-size tile loops (the tree has compile-time shape).
#if defined(__CUDACC__)
#define DETLOGP_UNROLL _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__clang__)
#define DETLOGP_UNROLL _Pragma("GCC unroll 64")
#else
#define DETLOGP_UNROLL
#endif

#if defined(__CUDA_ARCH__)
#define DETLOGP_DEVICE_PASS 1
#else
#define DETLOGP_DEVICE_PASS 0
#endif

namespace detlogp {

// Bit-relevant. Changing any of these needs a contract version bump (docs/contract.md §9).
inline constexpr int kContractVersion = 1;
inline constexpr const char* kContractName = "detlogp-linear-logp-contract";
inline constexpr int kVocabTile = 64;      // global vocab tile: ids [64g, 64g + 64)
inline constexpr int kTileTreeLevels = 6;  // adjacent-pairwise tree over the 64 lanes
inline constexpr int kKSlab = 32;          // documented slab of the ascending K walk
inline constexpr const char* kTreeId = "adjpair64-nanmax-ascchain-fma-v1";
inline constexpr const char* kTranscendentalId = "expc-cw2-poly6-v1+logc-atanh-poly4-v1";
inline constexpr const char* kNSplitPolicy = "none: per-64-lane tile summaries, chain over global tiles";
inline constexpr const char* kTemperatureId = "y=fl(z*fl(1/T))";
// The entropy output (docs/contract.md §10): added beside logp/lse, no logp/lse bit depends on it.
inline constexpr const char* kEntropyId = "H=logc(S)-(U-C)/S;u=adjpair64(e*x);U=fma(fma(s,d,u),f,U);C=sum(err(S))-v1";
// The sampling program (docs/contract.md §11): added beside logp/lse, no logp/lse bit depends on it.
inline constexpr const char* kSampleId = "sample/v1";
inline constexpr int64_t kDefaultIgnoreIndex = -100;
// Canonical quiet NaN written to lse/logp of any row whose statistics saw a NaN.
inline constexpr uint32_t kCanonicalNanBits = 0x7FC00000u;
// Its bf16 form (the upper half), written for any NaN rounded to bf16 (fp::bf16_round).
inline constexpr uint16_t kCanonicalNanBf16 = 0x7FC0u;

// The temperature range (docs/contract.md §3.3): T and inv_T = fl(1 / T) are both finite normal
// fp32 numbers, so no backend overflows 1 / T to inf, and no subnormal T or inv_T exists that a
// flush-to-zero division, multiply or comparison would read as 0. fl(1 / T) falls as T grows, so
// the range is one interval, [2^-126, 2^126], mapped by fl(1 / T) onto [2^-126, 2^126] exactly.
// Its neighbours: fl(1 / T) is finite from the subnormal T = 0x1.000008p-128 up, and T =
// 0x1.000002p+126 (the next float after 2^126) gives the subnormal fl(1 / T) = 0x1.fffffcp-127.
// The range only decides what is refused: no bit of an accepted call depends on it.
inline constexpr float kMinTemperature = 0x1p-126f;  // FLT_MIN
inline constexpr float kMaxTemperature = 0x1p+126f;
inline constexpr uint32_t kMinTemperatureBits = 0x00800000u;
inline constexpr uint32_t kMaxTemperatureBits = 0x7E800000u;

// T in [kMinTemperature, kMaxTemperature]: false for NaN, +-inf, +-0, negatives and subnormals. The
// one predicate of every temperature check, host and device.
DETLOGP_HD bool temperature_in_range(float t) { return t >= kMinTemperature && t <= kMaxTemperature; }

static_assert(kVocabTile == 64, "contract v1 pins VOCAB_TILE = 64");
static_assert((1 << kTileTreeLevels) == kVocabTile, "the in-tile tree covers exactly one vocab tile");
static_assert(kKSlab == 32, "contract v1 pins K_SLAB = 32");
static_assert(kKSlab % 16 == 0, "K_SLAB must be a whole number of wgmma k16 steps");
static_assert(1.0f / kMinTemperature == kMaxTemperature && 1.0f / kMaxTemperature == kMinTemperature,
              "the temperature range maps onto itself under 1 / T");

}  // namespace detlogp

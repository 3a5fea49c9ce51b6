// Host side of the persistent ping-pong kernels (forward and grad-logits): the shared-memory
// opt-in once per (kernel, device), and the launch of one CTA per SM, or with Cfg::kClusterM > 1
// one cluster per co-resident cluster slot (a cluster's CTAs must sit in one GPC, so fewer than
// SMs / kClusterM clusters may fit; the occupancy API says how many).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/check.hpp"
#include "detlogp/error.hpp"

namespace detlogp::sm90 {

// The shared-memory opt-in is a host-side attribute of (kernel, device): set once per device.
// Keyed by the kernel itself (a template argument), not by its type, which kernels share.
template <auto Kernel>
void allow_smem_once(int smem_bytes) {
  static std::atomic<uint64_t> done{0};
  int device = 0;
  DETLOGP_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  DETLOGP_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

// The launch attribute of a Cfg::kClusterM x 1 x 1 cluster.
template <class Cfg>
cudaLaunchAttribute cluster_attribute() {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = Cfg::kClusterM;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

// Co-resident clusters of Cfg::kClusterM CTAs of Kernel on the current device (cached per device).
template <auto Kernel, class Cfg>
int max_active_clusters() {
  static std::atomic<int> cached[64] = {};
  int device = 0;
  DETLOGP_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64) {
    if (const int n = cached[device].load(std::memory_order_acquire); n > 0) return n;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(Cfg::kClusterM, 1, 1);
  cfg.blockDim = dim3(Cfg::kThreads, 1, 1);
  cfg.dynamicSmemBytes = Cfg::kSmemBytes;
  cudaLaunchAttribute attr = cluster_attribute<Cfg>();
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  DETLOGP_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, Kernel, &cfg));
  DETLOGP_CHECK(n > 0, "no cluster of " << Cfg::kClusterM << " CTAs with " << Cfg::kSmemBytes
                                        << " bytes of shared memory fits this device");
  if (device < 64) cached[device].store(n, std::memory_order_release);
  return n;
}

// Launches Kernel persistently over `units` work units (TileWalk's: tiles, or cluster tiles):
// min(units, slots) CTAs or clusters, where slots = `sms` CTAs (ClusterM = 1) or the co-resident
// cluster count (ClusterM > 1).
template <auto Kernel, class Cfg, class... Args>
void launch_persistent(int64_t units, int sms, cudaStream_t stream, Args... args) {
  allow_smem_once<Kernel>(Cfg::kSmemBytes);
  DETLOGP_CHECK(units > 0 && units * Cfg::kClusterM < (int64_t{1} << 31),
                "persistent grid over " << units << " work units out of range");
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(Cfg::kThreads, 1, 1);
  cfg.dynamicSmemBytes = Cfg::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  if constexpr (Cfg::kClusterM == 1) {
    cfg.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(units, std::max(sms, 1))), 1, 1);
  } else {
    const int64_t clusters = std::min<int64_t>(units, max_active_clusters<Kernel, Cfg>());
    cfg.gridDim = dim3(static_cast<unsigned>(clusters * Cfg::kClusterM), 1, 1);
    attr = cluster_attribute<Cfg>();
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  DETLOGP_CUDA_CHECK(cudaLaunchKernelEx(&cfg, Kernel, args...));
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace detlogp::sm90

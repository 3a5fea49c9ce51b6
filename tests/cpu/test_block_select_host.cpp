// The SM90 row kernels' listing pass (list_largest of src/sm90/device/block_select.cuh, the device
// code itself) run on the host, one std::thread a CUDA thread of a 256-thread block
// (emulated_cuda/cuda_runtime.h), then the selection the kernels make after it (sort_listed's bound,
// the listed K-th, the certainty test, else the gather of the lanes at or above it): the top K must
// be a full sort's, and also() must see every lane once with its scaled logit. Rows: Gaussian, tied,
// with NaN lanes, signed zeros, and the top lanes in three threads; 16-byte aligned and one float
// off; from fewer lanes than threads to the Qwen3 vocabulary; K from 1 past the block's threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"  // the emulation (this directory), before the device code
#include "detlogp/rank.hpp"
#include "detlogp/reduce.hpp"
#include "sm90/device/block_select.cuh"

thread_local EmulatedThreadIndex threadIdx;
EmulatedBlock emulated_block;

namespace {

constexpr int kThreads = 256;
constexpr int kListed = 8;

struct Pass {
  std::vector<detlogp::sm90::ListedKeys<kListed>> lists;
  std::vector<int> seen;  // also() calls a lane
  bool scaled = true;     // every also() y was the lane's fl(z * inv_t)
};

Pass run_pass(const float* z, int64_t lanes, float inv_t, int k) {
  Pass out;
  out.lists.resize(kThreads);
  std::vector<std::atomic<int>> seen(static_cast<size_t>(lanes));
  std::atomic<bool> scaled{true};
  std::vector<uint64_t> scratch(kThreads);
  std::barrier<> barrier(kThreads);
  emulated_block.barrier = &barrier;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      threadIdx.x = static_cast<unsigned>(t);
      detlogp::sm90::ListedKeys<kListed> listed;
      detlogp::sm90::list_largest<kThreads>(
          listed, scratch.data(), z, lanes, inv_t, k, [](float y, int64_t v) { return detlogp::rank_key(y, v); },
          [&](int64_t v, float y) {
            const float want = detlogp::scale_logit(z[v], inv_t);
            if (!(want == y || (want != want && y != y))) scaled = false;
            seen[static_cast<size_t>(v)].fetch_add(1);
          });
      out.lists[static_cast<size_t>(t)] = listed;
    });
  for (auto& th : threads) th.join();
  emulated_block.barrier = nullptr;
  out.seen.resize(static_cast<size_t>(lanes));
  for (int64_t v = 0; v < lanes; ++v) out.seen[static_cast<size_t>(v)] = seen[static_cast<size_t>(v)].load();
  out.scaled = scaled.load();
  return out;
}

// The kernels' selection from the lists (sort_listed, listed_top_k / top_keys): the K largest keys.
std::vector<uint64_t> select_top(const Pass& pass, const std::vector<uint64_t>& keys, int k) {
  std::vector<uint64_t> firsts;
  for (const auto& l : pass.lists)
    if (l.key[0] != 0) firsts.push_back(l.key[0]);
  std::sort(firsts.rbegin(), firsts.rend());
  const uint64_t bound = k <= kThreads && static_cast<int>(firsts.size()) >= k ? firsts[k - 1] : 1;
  std::vector<uint64_t> listed;
  for (const auto& l : pass.lists)
    for (uint64_t x : l.key)
      if (x != 0 && x >= bound) listed.push_back(x);
  std::sort(listed.rbegin(), listed.rend());
  if (static_cast<int>(listed.size()) < k) return {};
  const uint64_t kth = listed[k - 1];
  bool uncertain = false;
  for (const auto& l : pass.lists) uncertain = uncertain || (l.last() != 0 && l.last() >= kth);
  std::vector<uint64_t> top;
  if (!uncertain) {
    top.assign(listed.begin(), listed.begin() + k);
    return top;
  }
  for (uint64_t x : keys)
    if (x >= kth) top.push_back(x);
  std::sort(top.rbegin(), top.rend());
  top.resize(static_cast<size_t>(k));
  return top;
}

TEST(BlockSelectHost, TheListingPassGivesTheTopKOfAFullSortAndSeesEveryLaneOnce) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  int cases = 0;
  for (int64_t lanes : {int64_t{17}, int64_t{300}, int64_t{2053}, int64_t{4480}, int64_t{8192}, int64_t{8193},
                        int64_t{40000}, int64_t{151936}}) {
    for (int kind = 0; kind < 5; ++kind) {
      for (int misaligned = 0; misaligned < 2; ++misaligned) {
        std::vector<float> storage(static_cast<size_t>(lanes + 8));
        float* z = storage.data() + (misaligned ? 1 : 4);  // the vector is 16-byte aligned
        for (int64_t v = 0; v < lanes; ++v) {
          float y = normal(rng);
          if (kind == 1) y = static_cast<float>(v % 7) - 3.0f;                     // ties
          if (kind == 2 && v % 997 == 5) y = NAN;                                  // NaN lanes
          if (kind == 3) y = v % 2 ? -0.0f : 0.0f;                                 // signed zeros
          if (kind == 4 && (v / 4) % kThreads < 3) y = 20.0f + 0.01f * (v % 100);  // three threads hold the top
          z[v] = y;
        }
        for (int k : {1, 50, 256, 300}) {
          if (k > lanes) continue;
          const float inv_t = k % 2 ? 1.0f / 0.9f : 1.0f;
          const std::string what = "lanes=" + std::to_string(lanes) + " kind=" + std::to_string(kind) +
                                   " misaligned=" + std::to_string(misaligned) + " k=" + std::to_string(k);
          const Pass pass = run_pass(z, lanes, inv_t, k);
          ASSERT_TRUE(pass.scaled) << what << ": also() saw a y that is not the lane's scaled logit";
          for (int64_t v = 0; v < lanes; ++v)
            ASSERT_EQ(pass.seen[static_cast<size_t>(v)], 1) << what << ": also() calls for lane " << v;
          std::vector<uint64_t> keys(static_cast<size_t>(lanes));
          for (int64_t v = 0; v < lanes; ++v) keys[v] = detlogp::rank_key(detlogp::scale_logit(z[v], inv_t), v);
          std::vector<uint64_t> want = keys;
          std::sort(want.rbegin(), want.rend());
          want.resize(static_cast<size_t>(k));
          const std::vector<uint64_t> got = select_top(pass, keys, k);
          ASSERT_EQ(got.size(), want.size()) << what << ": fewer listed keys than K";
          for (int j = 0; j < k; ++j)
            ASSERT_EQ(got[j], want[j]) << what << ": place " << j << " id " << detlogp::rank_key_id(got[j])
                                       << ", a full sort gives id " << detlogp::rank_key_id(want[j]);
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, 200);
}

}  // namespace

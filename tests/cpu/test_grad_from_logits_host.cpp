// The SM90 kernel of linear_logp_grad_from_logits (src/sm90/device/grad_from_logits.cuh, the device
// code itself) run on the host, one std::thread a CUDA thread of its 256-thread CTA, through emulated
// CUDA names (emulated_cuda/): on rows of 1 to 12289 columns, vectorized and scalar, to its own dz and
// over its own logits in place, its bits equal the host implementation's (detail::grad_row_from_logits)
// on a copy of the same logits, and nothing past a row's C columns is written. So the in-place
// segment order and the tails are checked before any device time.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <thread>
#include <vector>

#include "core/grad_logits.hpp"
#include "sm90/device/grad_from_logits.cuh"
#include "test_util.hpp"

thread_local EmulatedThreadIndex threadIdx;
EmulatedBlock emulated_block;

namespace {

using detlogp::sm90::kFromLogitsThreads;

constexpr uint16_t kPoison = 0xFFEEu;

// Every row by one emulated CTA.
void run_rows(const detlogp::sm90::GradLogitsParams& g, const float* logits, int64_t stride, bool vec4) {
  for (int64_t row = 0; row < g.rows; ++row) {
    std::barrier<> barrier(kFromLogitsThreads);
    emulated_block.barrier = &barrier;
    std::vector<std::thread> threads;
    for (int t = 0; t < kFromLogitsThreads; ++t)
      threads.emplace_back([&, t] {
        threadIdx.x = static_cast<unsigned>(t);
        detlogp::sm90::grad_from_logits_row(g, logits, stride, vec4, row);
      });
    for (auto& th : threads) th.join();
    emulated_block.barrier = nullptr;
  }
}

struct Case {
  int64_t rows, cols, stride, vocab_start, real_vocab;
  bool temp_rows, entropy;
};

}  // namespace

TEST(GradFromLogitsHost, TheKernelsRowsGiveTheHostBitsOwnBufferAndInPlace) {
  const Case cases[] = {
      {3, 17, 17, 0, 17, false, false},       {4, 4096, 4096, 64, 4000, true, true},
      {5, 4101, 4104, 37, 9000, true, false}, {2, 12289, 12292, 0, 12000, false, true},
      {2, 1027, 1027, 5, 1032, true, true},
  };
  uint64_t seed = 1;
  for (const Case& k : cases) {
    detlogp_test::Rng rng(seed++);
    std::vector<float> logits(static_cast<size_t>(k.rows * k.stride));
    for (auto& z : logits) z = static_cast<float>(rng.normal() * 4.0);
    if (k.cols > 40) logits[7] = -INFINITY, logits[11] = NAN, logits[13] = 1e30f;
    std::vector<int64_t> targets(static_cast<size_t>(k.rows));
    std::vector<float> temps(static_cast<size_t>(k.rows)), lse(targets.size()), gl(targets.size()), gs(targets.size()),
        h(targets.size()), gh(targets.size());
    for (int64_t n = 0; n < k.rows; ++n) {
      targets[n] = n == 1 ? detlogp::kDefaultIgnoreIndex
                          : k.vocab_start + rng.below(std::min(k.cols, k.real_vocab - k.vocab_start));
      temps[n] = 0.5f + 0.25f * static_cast<float>(n);
      lse[n] = static_cast<float>(rng.normal() + 10.0);
      gl[n] = static_cast<float>(rng.uniform() - 0.5);
      gs[n] = static_cast<float>(rng.uniform() - 0.5);
      h[n] = static_cast<float>(rng.uniform() * 3.0);
      gh[n] = static_cast<float>(rng.uniform() - 0.5);
    }
    detlogp::detail::GradLogitsProblem p;
    p.rows = k.rows;
    p.cols = k.cols;
    p.vocab_start = k.vocab_start;
    p.real_vocab = k.real_vocab;
    p.targets = targets.data();
    p.targets_i64 = true;
    p.temperature = 0.7f;
    p.temperature_rows = k.temp_rows ? temps.data() : nullptr;
    p.lse = lse.data();
    p.g_logp = gl.data();
    p.g_lse = gs.data();
    if (k.entropy) p.entropy = h.data(), p.g_entropy = gh.data();
    std::vector<uint16_t> want(static_cast<size_t>(k.rows * k.cols));
    p.dz = want.data();
    p.dz_stride = k.cols;
    detlogp::detail::grad_logits_from_logits(p, logits.data(), k.stride);

    for (bool vec4 : {true, false}) {
      if (vec4 && k.stride % 4 != 0) continue;
      // Its own dz, row stride C + 3 (padding poisoned).
      std::vector<uint16_t> own(static_cast<size_t>(k.rows * (k.cols + 4)), kPoison);
      detlogp::detail::GradLogitsProblem q = p;
      q.dz = own.data();
      q.dz_stride = vec4 ? k.cols + 4 : k.cols + 3;
      if (vec4 && q.dz_stride % 4 != 0) q.dz_stride += 4 - q.dz_stride % 4;
      own.assign(static_cast<size_t>(k.rows * q.dz_stride), kPoison);
      q.dz = own.data();
      run_rows(detlogp::sm90::grad_params(q, nullptr), logits.data(), k.stride, vec4);
      int64_t diff = 0;
      for (int64_t n = 0; n < k.rows; ++n) {
        for (int64_t c = 0; c < k.cols; ++c) diff += own[n * q.dz_stride + c] != want[n * k.cols + c];
        for (int64_t c = k.cols; c < q.dz_stride; ++c) EXPECT_EQ(own[n * q.dz_stride + c], kPoison);
      }
      EXPECT_EQ(diff, 0) << "own dz, C=" << k.cols << " vec4=" << vec4;

      // In place: dz over the logits, row stride twice theirs.
      std::vector<float> copy = logits;
      detlogp::detail::GradLogitsProblem r = p;
      r.dz = reinterpret_cast<uint16_t*>(copy.data());
      r.dz_stride = 2 * k.stride;
      run_rows(detlogp::sm90::grad_params(r, nullptr), copy.data(), k.stride, vec4);
      const auto* bits = reinterpret_cast<const uint16_t*>(copy.data());
      diff = 0;
      for (int64_t n = 0; n < k.rows; ++n)
        for (int64_t c = 0; c < k.cols; ++c) diff += bits[n * 2 * k.stride + c] != want[n * k.cols + c];
      EXPECT_EQ(diff, 0) << "in place, C=" << k.cols << " vec4=" << vec4;
    }
  }
}

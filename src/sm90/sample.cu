// The sampling program on the GPU (docs/contract.md §11): one CTA per row over a chunk of the
// serving logits (fp32 z in device memory, from the fused kernel), the same definitions as the CPU
// row program (detlogp/sample.hpp, detlogp/reduce.hpp, SampleProblem::write_row):
//   1. the raw tile summaries (tile_summary per tile, threads over tiles), M by an exact max, the
//      chain factors in parallel and the ascending fma chain by one thread (§5-§6: linear_logp's bits);
//   2. the cut (§11.4-§11.5) by radix selection over rank_key, 16 passes of 4-bit digits: top-k with
//      digit histograms of counts, top-p with digit histograms of the integer mass q after the exact
//      sum Q over the top-k lanes. Each thread fills its own row of the histograms, which a tree of
//      integer adds then sums: exact in any order, and no atomics (the contract kernels have none);
//   3. one support pass: membership per lane (in_support), the masked tile summaries and their chain
//      factors, the Gumbel scores and a block argmax under score_precedes (a total order, so the
//      reduction order does not matter), the support size by the same integer tree;
//   4. the support chain and write_row by one thread.
// Every rounding is the contract's; the block only chooses the order of exact operations.
#include <cuda_runtime.h>

#include "cuda/check.hpp"
#include "detlogp/sample.hpp"
#include "sm90/sample.hpp"

namespace detlogp::sm90 {
namespace {

constexpr int kThreads = 256;
constexpr int kDigitBits = 4;
constexpr int kDigits = 1 << kDigitBits;

// The y of lane v of the row (the same fl(z * inv_t) every pass).
__device__ __forceinline__ float lane_y(const float* z, int64_t v, float inv_t) { return scale_logit(z[v], inv_t); }

// Tile g's scaled logits into y[0, real) (real lanes of the tile), returns real.
__device__ __forceinline__ int load_tile(const float* z, int64_t g, int64_t lanes, float inv_t, float* y) {
  const int64_t first = g * kVocabTile;
  const int real = lanes - first < kVocabTile ? static_cast<int>(lanes - first) : kVocabTile;
  for (int c = 0; c < real; ++c) y[c] = lane_y(z, first + c, inv_t);
  return real;
}

__device__ __forceinline__ int64_t key_id(uint64_t key) {
  return static_cast<int64_t>(0xFFFFFFFFull - (key & 0xFFFFFFFFull));
}

struct Shared {
  unsigned long long hist[kDigits][kThreads];  // each thread's digit histogram (counts or masses)
  unsigned long long prefix;                   // the selected key's digits so far
  unsigned long long need;                     // what remains to select inside the current prefix
  float max;
  float sum;
  float best_score[kThreads];
  int64_t best_id[kThreads];
  float best_y[kThreads];
};

// Sums every thread's row of the histograms into row 0 (hist[d][0]) by a tree of integer adds.
__device__ void sum_histograms(Shared& sh) {
  for (int stride = kThreads / 2; stride >= 1; stride /= 2) {
    if (threadIdx.x < stride)
      for (int d = 0; d < kDigits; ++d) sh.hist[d][threadIdx.x] += sh.hist[d][threadIdx.x + stride];
    __syncthreads();
  }
}

// The block's sum of one integer per thread; every thread returns it.
__device__ unsigned long long block_sum(Shared& sh, unsigned long long mine) {
  for (int d = 0; d < kDigits; ++d) sh.hist[d][threadIdx.x] = d == 0 ? mine : 0;
  __syncthreads();
  sum_histograms(sh);
  const unsigned long long total = sh.hist[0][0];
  __syncthreads();
  return total;
}

// The key of the lane that ends the prefix: among the lanes with key >= floor (and, with by_mass, a
// positive mass), the one where the running count (or mass) from the largest key first reaches need.
// Exact: the histograms are integer sums. Every thread returns the same key.
__device__ uint64_t radix_select(Shared& sh, const float* z, int64_t lanes, float inv_t, float row_max, uint64_t floor,
                                 bool by_mass, unsigned long long need) {
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.need = need;
  }
  uint64_t mask = 0;
  for (int shift = 64 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int d = 0; d < kDigits; ++d) sh.hist[d][threadIdx.x] = 0;
    __syncthreads();
    const uint64_t prefix = sh.prefix;
    for (int64_t v = threadIdx.x; v < lanes; v += kThreads) {
      const float y = lane_y(z, v, inv_t);
      const uint64_t key = rank_key(y, v);
      if ((key & mask) != prefix || key < floor) continue;
      sh.hist[(key >> shift) & (kDigits - 1)][threadIdx.x] += by_mass ? top_p_mass(relative_weight(y, row_max)) : 1u;
    }
    __syncthreads();
    sum_histograms(sh);
    if (threadIdx.x == 0) {
      unsigned long long above = 0;
      for (int d = kDigits - 1; d >= 0; --d) {
        if (above + sh.hist[d][0] >= sh.need) {
          sh.prefix |= static_cast<uint64_t>(d) << shift;
          sh.need -= above;
          break;
        }
        above += sh.hist[d][0];
      }
    }
    mask |= uint64_t{kDigits - 1} << shift;
    __syncthreads();
  }
  return sh.prefix;
}

__global__ void __launch_bounds__(kThreads) sample_rows_kernel(const SampleRowsParams p) {
  __shared__ Shared sh;
  const detail::SampleProblem& q = p.problem;
  const int64_t n = p.row_begin + blockIdx.x;
  const float* z = p.logits + int64_t{blockIdx.x} * q.vocab_local;
  TileSummary* tiles = p.tiles + int64_t{blockIdx.x} * p.tiles_per_row;
  float* factors = p.factors + int64_t{blockIdx.x} * p.tiles_per_row;
  const int64_t lanes = q.real_vocab;
  const SampleRowParams r = q.program.row(n, lanes);
  const float inv_t = r.inv_temperature;
  float y[kVocabTile];

  // 1. Raw summaries, M, the chain.
  float m = fp::neg_inf();
  for (int64_t g = threadIdx.x; g < p.tiles_per_row; g += kThreads) {
    const int real = load_tile(z, g, lanes, inv_t, y);
    tiles[g] = tile_summary(y, real);
    m = chain_max(m, tiles[g].max);
  }
  sh.best_score[threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float all = fp::neg_inf();
    for (int t = 0; t < kThreads; ++t) all = chain_max(all, sh.best_score[t]);
    sh.max = all;
  }
  __syncthreads();
  const float row_max = sh.max;
  for (int64_t g = threadIdx.x; g < p.tiles_per_row; g += kThreads)
    factors[g] = chain_factor_or_skip(tiles[g], row_max);
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int64_t g = 0; g < p.tiles_per_row; ++g) s = chain_fma(s, tiles[g].sum, factors[g]);
    sh.sum = s;
  }
  __syncthreads();
  const RowStats st{row_max, sh.sum, finalize_row(row_max, sh.sum, 0.0f, true).lse};
  const bool samplable = row_samplable(st);

  // 2. The cut.
  SupportRow support{row_max, no_cut(), r.min_p};
  if (samplable && has_cut(r, lanes)) {
    uint64_t kth = 0;  // every key passes
    if (r.keep < lanes) kth = radix_select(sh, z, lanes, inv_t, row_max, 0, false, static_cast<uint64_t>(r.keep));
    uint64_t cut = kth;
    if (r.top_p != 1.0f) {
      unsigned long long mine = 0;
      for (int64_t v = threadIdx.x; v < lanes; v += kThreads) {
        const float yv = lane_y(z, v, inv_t);
        if (rank_key(yv, v) >= kth) mine += top_p_mass(relative_weight(yv, row_max));
      }
      const unsigned long long total = block_sum(sh, mine);
      cut = radix_select(sh, z, lanes, inv_t, row_max, kth, true, top_p_threshold(total, r.top_p));
    }
    const int64_t id = key_id(cut);
    support.cut = {lane_y(z, id, inv_t), id};
  }

  // 3. The support pass.
  const bool draw = !q.replay;
  const uint64_t stream = draw && samplable ? q.row_stream(n) : 0;
  float best = fp::neg_inf();
  int64_t best_id = kNoToken;
  float best_y = 0.0f;
  int count = 0;
  for (int64_t g = threadIdx.x; g < p.tiles_per_row && samplable; g += kThreads) {
    const int real = load_tile(z, g, lanes, inv_t, y);
    uint64_t mask = 0;
    for (int c = 0; c < real; ++c) {
      const int64_t id = g * kVocabTile + c;
      if (!in_support(y[c], id, support)) continue;
      mask |= uint64_t{1} << c;
      ++count;
      if (!draw) continue;
      const float score = gumbel_score(y[c], stream, id);
      if (best_id == kNoToken || score_precedes(score, id, best, best_id)) {
        best = score;
        best_id = id;
        best_y = y[c];
      }
    }
    tiles[g] = tile_summary_masked(y, mask);
    factors[g] = chain_factor_or_skip(tiles[g], row_max);
  }
  const unsigned long long support_size = block_sum(sh, static_cast<unsigned long long>(count));
  sh.best_score[threadIdx.x] = best;
  sh.best_id[threadIdx.x] = best_id;
  sh.best_y[threadIdx.x] = best_y;
  __syncthreads();

  // 4. The support chain, the token, the outputs.
  if (threadIdx.x != 0) return;
  SupportPass pass{0.0f, 0, kNoToken, 0.0f};
  if (samplable) {
    pass.size = static_cast<int64_t>(support_size);
    for (int t = 0; t < kThreads; ++t) {
      const int64_t id = sh.best_id[t];
      if (id == kNoToken) continue;
      if (pass.token == kNoToken || score_precedes(sh.best_score[t], id, best, pass.token)) {
        best = sh.best_score[t];
        pass.token = id;
        pass.token_logit = sh.best_y[t];
      }
    }
    for (int64_t g = 0; g < p.tiles_per_row; ++g) pass.sum = chain_fma(pass.sum, tiles[g].sum, factors[g]);
  }
  float target_logit = 0.0f;
  if (q.replay) {
    const int64_t t = q.target(n);
    if (t != q.ignore_index) target_logit = lane_y(z, t, inv_t);
  }
  const bool outside = q.write_row(n, st, support, pass, target_logit);
  if (p.outside) p.outside[n] = outside ? 1 : 0;
}

}  // namespace

void launch_sample_rows(const SampleRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  sample_rows_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace detlogp::sm90

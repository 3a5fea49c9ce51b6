// Shared helpers for the detlogp CPU tests: bf16 generation from the tests' RNG (test_random.hpp),
// problem construction with owned buffers, output buffers poisoned with a NaN pattern, and a
// float64 reference of lse/logp computed from the same bf16 values, with a per-row error bound
// for the fp32 contract pipeline.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/fpops.hpp"
#include "scoped_env.hpp"
#include "test_random.hpp"

namespace detlogp_test {

// ---------------------------------------------------------------- randomness and bf16

// bf16 <-> fp32: the library's one rounding (round to nearest even, every NaN the canonical
// kCanonicalNanBf16) and its exact widening.
using detlogp::fp::bf16_round;
using detlogp::fp::bf16_to_float;

// n values drawn from N(0, stddev^2), rounded to bf16.
inline std::vector<uint16_t> random_bf16(size_t n, double stddev, Rng& rng) {
  std::vector<uint16_t> out(n);
  for (auto& b : out) b = bf16_round(static_cast<float>(rng.normal() * stddev));
  return out;
}

// ---------------------------------------------------------------- problems and buffers

// Bit pattern the outputs are filled with before a call, to detect writes: a quiet NaN with a
// payload no computation produces.
inline constexpr uint32_t kPoisonBits = 0xFFC0FFEEu;

inline std::vector<float> poisoned(size_t n) {
  return std::vector<float>(n, detlogp::bitcmp::float_from_bits(kPoisonBits));
}

inline int64_t count_unpoisoned(const std::vector<float>& v) {
  int64_t c = 0;
  for (float x : v) c += detlogp::bitcmp::float_bits(x) != kPoisonBits;
  return c;
}

struct ProblemSpec {
  int64_t rows = 4;
  int64_t dim = 64;
  int64_t vocab = 123;      // V_local: rows of the weight
  int64_t real_vocab = -1;  // -1: vocab
  bool bias = false;
  double logit_stddev = 2.0;  // standard deviation of z = h.W
  uint64_t seed = 1;
};

// A problem with owned buffers. Targets are int64 global ids in [0, real_vocab).
struct Problem {
  int64_t rows = 0, dim = 0, vocab = 0, real_vocab = 0;
  std::vector<uint16_t> hidden;  // [rows][dim]
  std::vector<uint16_t> weight;  // [vocab][dim]
  std::vector<float> bias;       // [vocab] or empty
  std::vector<int64_t> targets;  // [rows]
  float temperature = 1.0f;
  std::vector<float> temperature_rows;  // [rows] or empty
  int64_t ignore_index = detlogp::kDefaultIgnoreIndex;

  detlogp::LinearLogpInputs inputs() const {
    detlogp::LinearLogpInputs in;
    in.hidden = detlogp::TensorView::matrix(hidden.data(), detlogp::DType::bf16, rows, dim);
    in.weight = detlogp::TensorView::matrix(weight.data(), detlogp::DType::bf16, vocab, dim);
    if (!bias.empty()) in.bias = detlogp::TensorView::vector(bias.data(), detlogp::DType::f32, vocab);
    in.targets = detlogp::TensorView::vector(targets.data(), detlogp::DType::i64, rows);
    in.temperature = temperature;
    if (!temperature_rows.empty())
      in.temperature_rows = detlogp::TensorView::vector(temperature_rows.data(), detlogp::DType::f32, rows);
    in.real_vocab = real_vocab;
    in.ignore_index = ignore_index;
    return in;
  }

  // The inputs of one vocabulary shard: weight (and bias) rows [start, start + count), vocab_start
  // = start, the whole problem's real_vocab.
  detlogp::LinearLogpInputs shard_inputs(int64_t start, int64_t count) const {
    detlogp::LinearLogpInputs in = inputs();
    in.weight = detlogp::TensorView::matrix(weight.data() + start * dim, detlogp::DType::bf16, count, dim);
    if (!bias.empty()) in.bias = detlogp::TensorView::vector(bias.data() + start, detlogp::DType::f32, count);
    in.vocab_start = start;
    return in;
  }

  float h(int64_t n, int64_t k) const { return bf16_to_float(hidden[n * dim + k]); }
  float w(int64_t v, int64_t k) const { return bf16_to_float(weight[v * dim + k]); }
  float temperature_of(int64_t n) const { return temperature_rows.empty() ? temperature : temperature_rows[n]; }

  // The sub-problem made of the given rows (in that order, duplicates allowed).
  Problem select_rows(const std::vector<int64_t>& picks) const {
    Problem p = *this;
    p.rows = static_cast<int64_t>(picks.size());
    p.hidden.assign(picks.size() * dim, 0);
    p.targets.assign(picks.size(), 0);
    if (!temperature_rows.empty()) p.temperature_rows.assign(picks.size(), 1.0f);
    for (size_t i = 0; i < picks.size(); ++i) {
      std::copy_n(hidden.begin() + picks[i] * dim, dim, p.hidden.begin() + static_cast<int64_t>(i) * dim);
      p.targets[i] = targets[picks[i]];
      if (!temperature_rows.empty()) p.temperature_rows[i] = temperature_rows[picks[i]];
    }
    return p;
  }
};

inline Problem make_problem(const ProblemSpec& s) {
  Rng rng(s.seed * 0x2545F4914F6CDD1Dull + 7);
  Problem p;
  p.rows = s.rows;
  p.dim = s.dim;
  p.vocab = s.vocab;
  p.real_vocab = s.real_vocab < 0 ? s.vocab : s.real_vocab;
  p.hidden = random_bf16(static_cast<size_t>(s.rows * s.dim), 1.0, rng);
  p.weight = random_bf16(static_cast<size_t>(s.vocab * s.dim), s.logit_stddev / std::sqrt(double(s.dim)), rng);
  if (s.bias) {
    p.bias.resize(static_cast<size_t>(s.vocab));
    for (auto& b : p.bias) b = static_cast<float>(rng.normal() * 0.5);
  }
  p.targets.resize(static_cast<size_t>(s.rows));
  for (auto& t : p.targets) t = rng.below(p.real_vocab);
  return p;
}

// A tensor-parallel test problem: bias, per-row temperatures, and targets at the vocabulary's
// edges and around the first tile boundary (0, V_real - 1, ignored, 64, 63). rows >= 5.
inline Problem tp_problem(int64_t vocab, int64_t real_vocab, uint64_t seed, int64_t rows = 33, int64_t dim = 128) {
  Problem p = make_problem({.rows = rows,
                            .dim = dim,
                            .vocab = vocab,
                            .real_vocab = real_vocab,
                            .bias = true,
                            .logit_stddev = 3.0,
                            .seed = seed});
  p.temperature_rows.resize(static_cast<size_t>(p.rows));
  for (int64_t n = 0; n < p.rows; ++n) p.temperature_rows[n] = 0.5f + 0.125f * static_cast<float>(n % 9);
  p.targets[0] = 0;
  p.targets[1] = p.real_vocab - 1;
  p.targets[2] = -100;
  p.targets[3] = 64;
  p.targets[4] = 63;
  return p;
}

struct Outputs {
  std::vector<float> logp, lse, logits;
  int64_t vocab = 0;

  Outputs(int64_t rows, int64_t vocab_local, bool with_logits)
      : logp(poisoned(static_cast<size_t>(rows))),
        lse(poisoned(static_cast<size_t>(rows))),
        logits(with_logits ? poisoned(static_cast<size_t>(rows * vocab_local)) : std::vector<float>{}),
        vocab(vocab_local) {}

  detlogp::LinearLogpOutputs views() {
    detlogp::LinearLogpOutputs o;
    const int64_t rows = static_cast<int64_t>(logp.size());
    o.logp = detlogp::mutable_vector(logp.data(), detlogp::DType::f32, rows);
    o.lse = detlogp::mutable_vector(lse.data(), detlogp::DType::f32, rows);
    if (!logits.empty()) o.logits = detlogp::mutable_matrix(logits.data(), detlogp::DType::f32, rows, vocab);
    return o;
  }
  bool untouched() const {
    return count_unpoisoned(logp) == 0 && count_unpoisoned(lse) == 0 && count_unpoisoned(logits) == 0;
  }
};

// Outputs with an entropy output, poisoned.
struct EntropyOutputs {
  Outputs out;
  std::vector<float> entropy;

  EntropyOutputs(int64_t rows, int64_t vocab_local, bool with_logits)
      : out(rows, vocab_local, with_logits), entropy(poisoned(static_cast<size_t>(rows))) {}
  detlogp::LinearLogpOutputs views() {
    detlogp::LinearLogpOutputs o = out.views();
    o.entropy = detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, static_cast<int64_t>(entropy.size()));
    return o;
  }
  bool untouched() const { return out.untouched() && count_unpoisoned(entropy) == 0; }
};

// These tests exercise the CPU backend, also on a GPU machine where "auto" would pick SM90
// (tests/gpu covers that backend).
inline detlogp::CallOptions cpu_backend_options() {
  detlogp::CallOptions opt;
  opt.backend = "cpu-linear-logp-contract-v1";
  return opt;
}

inline Outputs run_linear_logp(const Problem& p, bool with_logits = false,
                               const detlogp::CallOptions& opt = cpu_backend_options(),
                               detlogp::CallReport* report = nullptr) {
  Outputs out(p.rows, p.vocab, with_logits);
  detlogp::CallReport r = detlogp::linear_logp(p.inputs(), out.views(), opt);
  if (report) *report = r;
  return out;
}

inline Outputs run_tensor_parallel(const Problem& p, int ranks,
                                   const detlogp::CallOptions& opt = cpu_backend_options()) {
  Outputs out(p.rows, p.vocab, false);
  detlogp::simulate_tensor_parallel(p.inputs(), ranks, out.views(), opt);
  return out;
}

// entropy, when given, receives the rows' entropy too (sized and poisoned here).
inline Outputs run_reduce_logits(const Problem& p, const std::vector<float>& logits,
                                 std::vector<float>* entropy = nullptr) {
  Outputs out(p.rows, p.vocab, false);
  detlogp::ReduceLogitsInputs in;
  in.logits = detlogp::TensorView::matrix(logits.data(), detlogp::DType::f32, p.rows, p.vocab);
  in.targets = detlogp::TensorView::vector(p.targets.data(), detlogp::DType::i64, p.rows);
  in.temperature = p.temperature;
  if (!p.temperature_rows.empty())
    in.temperature_rows = detlogp::TensorView::vector(p.temperature_rows.data(), detlogp::DType::f32, p.rows);
  in.real_vocab = p.real_vocab;
  in.ignore_index = p.ignore_index;
  auto logp = detlogp::mutable_vector(out.logp.data(), detlogp::DType::f32, p.rows);
  auto lse = detlogp::mutable_vector(out.lse.data(), detlogp::DType::f32, p.rows);
  detlogp::MutableTensorView entropy_view;
  if (entropy) {
    *entropy = poisoned(static_cast<size_t>(p.rows));
    entropy_view = detlogp::mutable_vector(entropy->data(), detlogp::DType::f32, p.rows);
  }
  detlogp::reduce_logits(in, logp, lse, entropy_view);
  return out;
}

// The K-ascending fp32 walk the contract pins for one logit on the CPU:
// acc = fl(acc + fl(h_k * w_k)) for k = 0..D-1 from acc = +0, then one fl(acc + b).
inline float contract_logit(const Problem& p, int64_t n, int64_t v) {
  float acc = 0.0f;
  for (int64_t k = 0; k < p.dim; ++k) {
    // Separately rounded multiply and add, as docs/contract.md §3.1 pins for the CPU (tests
    // inherit -ffp-contract=off from the detlogp target). The product is exact unless subnormal.
    acc = acc + p.h(n, k) * p.w(v, k);
  }
  if (!p.bias.empty()) acc = acc + p.bias[v];
  return acc;
}

// ---------------------------------------------------------------- float64 reference

inline constexpr double kU = 0x1p-24;  // unit roundoff of fp32 round-to-nearest

// Float64 reference of one row (exact bf16 products, double sums, double log-softmax) and a
// first-order error bound for the contract's fp32 pipeline on that row.
//
// Error model (u = 2^-24, p_v = softmax(y)_v, n_tiles = ceil(V_real / 64)):
//  z_v  GEMM, K ascending in fp32: each add has |err| <= u |s_k| (s_k the k-th partial sum);
//       treating the D rounding errors as independent and zero-mean, the total has standard
//       deviation <= u sqrt(sum_k s_k^2 / 3). dz_v = kGemmSigmas * u sqrt(sum_k s_k^2 / 3)
//       (+ u |z_v| for the bias add).
//  y_v  dy_v = dz_v / T + 2u |y_v| when T != 1 (fl(1/T) and the multiply).
//  S    each term expc(y_v - m_g) * expc(m_g - M): two subtractions (u |y_v - M| together),
//       two expc (<= 1 ulp = 2u each); the 6-level tree and the n_tiles-step fma chain add at
//       most (6 + n_tiles + 1) u relative. rho = u (sum_v p_v |y_v - M| + 4 + 7 + n_tiles).
//  lse  dlse = sum_v p_v dy_v + rho (1 + 2 rho) + 2u |ln S| (logc <= 1 ulp) + u |lse| (the add).
//  logp dlogp = dy_t + dlse + u |logp| (the subtraction); the clamp only shrinks the error.
// Rigorous except for the GEMM term, which is the standard probabilistic bound (Higham & Mary
// 2019) with kGemmSigmas standard deviations.
inline constexpr double kGemmSigmas = 6.0;

struct ReferenceRow {
  double lse = 0, logp = 0;
  double lse_bound = 0, logp_bound = 0;
  bool ignored = false;
};

inline ReferenceRow reference_row(const Problem& p, int64_t n) {
  const int64_t V = p.real_vocab;
  const double T = static_cast<double>(p.temperature_of(n));
  const bool scaled = p.temperature_of(n) != 1.0f;
  std::vector<double> y(static_cast<size_t>(V)), dy(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) {
    double s = 0, sq = 0;
    for (int64_t k = 0; k < p.dim; ++k) {
      s += static_cast<double>(p.h(n, k)) * static_cast<double>(p.w(v, k));
      sq += s * s;
    }
    double dz = kGemmSigmas * kU * std::sqrt(sq / 3.0);
    if (!p.bias.empty()) {
      s += static_cast<double>(p.bias[v]);
      dz += kU * std::fabs(s);
    }
    y[v] = s / T;
    dy[v] = dz / T + (scaled ? 2 * kU * std::fabs(y[v]) : 0.0);
  }
  const double M = *std::max_element(y.begin(), y.end());
  double S = 0;
  for (int64_t v = 0; v < V; ++v) S += std::exp(y[v] - M);
  double mean_dy = 0, mean_gap = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double pv = std::exp(y[v] - M) / S;
    mean_dy += pv * dy[v];
    mean_gap += pv * (M - y[v]);
  }
  const double n_tiles = static_cast<double>((V + 63) / 64);
  const double rho = kU * (mean_gap + 4 + 7 + n_tiles);
  ReferenceRow r;
  r.lse = M + std::log(S);
  r.lse_bound = mean_dy + rho * (1 + 2 * rho) + 2 * kU * std::fabs(std::log(S)) + kU * std::fabs(r.lse);
  const int64_t t = p.targets[n];
  r.ignored = t == p.ignore_index;
  if (!r.ignored) {
    r.logp = y[t] - r.lse;
    r.logp_bound = dy[t] + r.lse_bound + kU * std::fabs(r.logp);
  }
  return r;
}

// Bit-for-bit equality of two runs' logp and lse, and of their logits where both have them.
inline void expect_identical(const Outputs& a, const Outputs& b, const std::string& what) {
  namespace bc = detlogp::bitcmp;
  const bc::Result lp = bc::compare(a.logp, b.logp), ls = bc::compare(a.lse, b.lse);
  EXPECT_TRUE(lp.identical()) << lp.describe(what + " logp");
  EXPECT_TRUE(ls.identical()) << ls.describe(what + " lse");
  if (!a.logits.empty() && !b.logits.empty()) {
    const bc::Result lg = bc::compare(a.logits, b.logits);
    EXPECT_TRUE(lg.identical()) << lg.describe(what + " logits");
  }
}

}  // namespace detlogp_test

// The sampling program's test helpers (test_sample.cpp, test_tp_sample.cpp): a program of scalars
// or per-row values, the rollout's and the replay's outputs poisoned before each call, problems with
// random or exactly given logits, and the bitwise comparison of two rollouts.
#pragma once

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "core/sample.hpp"
#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_sample.hpp"
#include "detlogp/bitcmp.hpp"
#include "test_util.hpp"

namespace sample_test {

using namespace detlogp_test;
using detlogp::DType;
using detlogp::TensorView;

// ---------------------------------------------------------------- the program's parameters

// One test's program: scalars, or per-row arrays where non-empty.
struct Program {
  float temperature = 1.0f;
  int64_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  std::vector<float> temperature_rows, top_p_rows, min_p_rows;
  std::vector<int64_t> top_k_rows;

  detlogp::SamplingProgram view() const {
    detlogp::SamplingProgram s;
    s.temperature = temperature;
    s.top_k = top_k;
    s.top_p = top_p;
    s.min_p = min_p;
    const auto rows = [](const auto& v, DType t) {
      return v.empty() ? TensorView{} : TensorView::vector(v.data(), t, static_cast<int64_t>(v.size()));
    };
    s.temperature_rows = rows(temperature_rows, DType::f32);
    s.top_k_rows = rows(top_k_rows, DType::i64);
    s.top_p_rows = rows(top_p_rows, DType::f32);
    s.min_p_rows = rows(min_p_rows, DType::f32);
    return s;
  }
  Program select_rows(const std::vector<int64_t>& picks) const {
    Program q = *this;
    const auto pick = [&](auto& v) {
      if (v.empty()) return;
      auto old = v;
      v.clear();
      for (int64_t i : picks) v.push_back(old[static_cast<size_t>(i)]);
    };
    pick(q.temperature_rows);
    pick(q.top_k_rows);
    pick(q.top_p_rows);
    pick(q.min_p_rows);
    return q;
  }
};

// Rollout outputs, poisoned before the call.
struct Drawn {
  std::vector<int64_t> token, support_size;
  std::vector<float> logp, logp_raw, lse, logits;
  std::vector<int64_t> topk_ids;  // [N, K] with the top-k output, else empty
  std::vector<float> topk_logp;
  detlogp::CallReport report;
};

struct Keys {
  uint64_t seed = 12345;
  std::vector<int64_t> seed_rows;  // empty: the scalar seed
  std::vector<int64_t> key;
};

inline Keys row_keys(int64_t rows, int64_t first = 0) {
  Keys k;
  k.key.resize(static_cast<size_t>(rows));
  std::iota(k.key.begin(), k.key.end(), first);
  return k;
}

inline detlogp::SampleInputs sample_inputs(const Problem& p, const Program& prog, const Keys& keys) {
  detlogp::SampleInputs in;
  const detlogp::LinearLogpInputs head = p.inputs();
  in.hidden = head.hidden;
  in.weight = head.weight;
  in.bias = head.bias;
  in.real_vocab = p.real_vocab;
  in.program = prog.view();
  in.seed = keys.seed;
  if (!keys.seed_rows.empty()) in.seed_rows = TensorView::vector(keys.seed_rows.data(), DType::i64, p.rows);
  in.key = TensorView::vector(keys.key.data(), DType::i64, static_cast<int64_t>(keys.key.size()));
  return in;
}

inline constexpr int64_t kPoisonToken = -777;

// topk > 0: also the top-k output [rows, topk].
inline detlogp::SampleOutputs sample_views(Drawn& d, int64_t rows, int64_t vocab, bool with_logits, int64_t topk = 0) {
  d.token.assign(static_cast<size_t>(rows), kPoisonToken);
  d.support_size.assign(static_cast<size_t>(rows), kPoisonToken);
  d.logp = poisoned(static_cast<size_t>(rows));
  d.logp_raw = poisoned(static_cast<size_t>(rows));
  d.lse = poisoned(static_cast<size_t>(rows));
  d.logits = with_logits ? poisoned(static_cast<size_t>(rows * vocab)) : std::vector<float>{};
  detlogp::SampleOutputs o;
  o.token = detlogp::mutable_vector(d.token.data(), DType::i64, rows);
  o.logp = detlogp::mutable_vector(d.logp.data(), DType::f32, rows);
  o.logp_raw = detlogp::mutable_vector(d.logp_raw.data(), DType::f32, rows);
  o.lse = detlogp::mutable_vector(d.lse.data(), DType::f32, rows);
  o.support_size = detlogp::mutable_vector(d.support_size.data(), DType::i64, rows);
  if (with_logits) o.logits = detlogp::mutable_matrix(d.logits.data(), DType::f32, rows, vocab);
  d.topk_ids.assign(static_cast<size_t>(rows * topk), kPoisonToken);
  d.topk_logp = poisoned(static_cast<size_t>(rows * topk));
  if (topk > 0) {
    o.topk_ids = detlogp::mutable_matrix(d.topk_ids.data(), DType::i64, rows, topk);
    o.topk_logp = detlogp::mutable_matrix(d.topk_logp.data(), DType::f32, rows, topk);
  }
  return o;
}

inline Drawn draw(const Problem& p, const Program& prog, const Keys& keys, bool with_logits = false, int64_t topk = 0) {
  Drawn d;
  const detlogp::SampleOutputs o = sample_views(d, p.rows, p.vocab, with_logits, topk);
  d.report = detlogp::sample(sample_inputs(p, prog, keys), o, cpu_backend_options());
  return d;
}

// The CPU backend with `chunk_rows` rows of logits per chunk (the free axis the budget sets).
inline Drawn draw_in_chunks(const Problem& p, const Program& prog, const Keys& keys, int64_t chunk_rows) {
  Drawn d;
  const detlogp::SampleOutputs o = sample_views(d, p.rows, p.vocab, false);
  detlogp::detail::cpu_sample<detlogp::cpu::Fp32ChainGemm>(
      detlogp::detail::make_sample_problem(sample_inputs(p, prog, keys), o), chunk_rows);
  return d;
}

inline bool untouched(const Drawn& d) {
  const auto poisoned_ints = [](const std::vector<int64_t>& v) {
    return std::all_of(v.begin(), v.end(), [](int64_t x) { return x == kPoisonToken; });
  };
  return poisoned_ints(d.token) && poisoned_ints(d.support_size) && count_unpoisoned(d.logp) == 0 &&
         count_unpoisoned(d.logp_raw) == 0 && count_unpoisoned(d.lse) == 0 && count_unpoisoned(d.logits) == 0 &&
         poisoned_ints(d.topk_ids) && count_unpoisoned(d.topk_logp) == 0;
}

struct Replayed {
  std::vector<float> logp, logp_raw, lse, lse_support, support_max, cut_logit;
  std::vector<int64_t> support_size, cut_id;
  detlogp::CallReport report;
};

inline Replayed replay(const Problem& p, const Program& prog) {
  Replayed r;
  const size_t n = static_cast<size_t>(p.rows);
  for (auto* v : {&r.logp, &r.logp_raw, &r.lse, &r.lse_support, &r.support_max, &r.cut_logit}) *v = poisoned(n);
  r.support_size.assign(n, kPoisonToken);
  r.cut_id.assign(n, kPoisonToken);
  detlogp::SampledLogpOutputs o;
  o.logp = detlogp::mutable_vector(r.logp.data(), DType::f32, p.rows);
  o.logp_raw = detlogp::mutable_vector(r.logp_raw.data(), DType::f32, p.rows);
  o.lse = detlogp::mutable_vector(r.lse.data(), DType::f32, p.rows);
  o.lse_support = detlogp::mutable_vector(r.lse_support.data(), DType::f32, p.rows);
  o.support_size = detlogp::mutable_vector(r.support_size.data(), DType::i64, p.rows);
  o.support_max = detlogp::mutable_vector(r.support_max.data(), DType::f32, p.rows);
  o.cut_logit = detlogp::mutable_vector(r.cut_logit.data(), DType::f32, p.rows);
  o.cut_id = detlogp::mutable_vector(r.cut_id.data(), DType::i64, p.rows);
  detlogp::LinearLogpInputs in = p.inputs();
  in.temperature = 1.0f;
  in.temperature_rows = {};
  r.report = detlogp::linear_logp(in, prog.view(), o, cpu_backend_options());
  return r;
}

// A problem whose logits are given exactly (bf16-exact values): D = rows, hidden row n one-hot at
// column n, weight column n = row n's logits, so z[n][v] = 1 * w[v][n] is the given value.
inline Problem exact_logits(const std::vector<std::vector<float>>& rows_of_z) {
  Problem p;
  p.rows = static_cast<int64_t>(rows_of_z.size());
  p.vocab = static_cast<int64_t>(rows_of_z[0].size());
  p.real_vocab = p.vocab;
  p.dim = p.rows;
  p.hidden.assign(static_cast<size_t>(p.rows * p.dim), 0);
  p.weight.assign(static_cast<size_t>(p.vocab * p.dim), 0);
  for (int64_t n = 0; n < p.rows; ++n) {
    p.hidden[static_cast<size_t>(n * p.dim + n)] = bf16_round(1.0f);
    for (int64_t v = 0; v < p.vocab; ++v) {
      const float z = rows_of_z[static_cast<size_t>(n)][static_cast<size_t>(v)];
      EXPECT_EQ(bf16_to_float(bf16_round(z)), z) << "test logits must be bf16-exact";
      p.weight[static_cast<size_t>(v * p.dim + n)] = bf16_round(z);
    }
  }
  p.targets.assign(static_cast<size_t>(p.rows), 0);
  return p;
}

inline Problem random_problem(int64_t rows, int64_t vocab, uint64_t seed, double stddev = 3.0) {
  Problem p =
      make_problem({.rows = rows, .dim = 48, .vocab = vocab, .bias = true, .logit_stddev = stddev, .seed = seed});
  return p;
}

// A program with every filter on and per-row values that vary (and a greedy row).
inline Program varied_program(int64_t rows) {
  Program prog;
  for (int64_t n = 0; n < rows; ++n) {
    prog.temperature_rows.push_back(n % 7 == 3 ? 0.0f : 0.5f + 0.25f * static_cast<float>(n % 5));
    prog.top_k_rows.push_back(n % 4 == 0 ? 0 : 1 + (n * 13) % 40);
    prog.top_p_rows.push_back(n % 3 == 0 ? 1.0f : 0.5f + 0.1f * static_cast<float>(n % 5));
    prog.min_p_rows.push_back(n % 5 == 0 ? 0.0f : 0.01f * static_cast<float>(n % 4));
  }
  return prog;
}

inline void expect_same_bits(const Drawn& a, const Drawn& b, const std::string& what) {
  EXPECT_EQ(a.token, b.token) << what;
  EXPECT_EQ(a.support_size, b.support_size) << what;
  EXPECT_TRUE(detlogp::bitcmp::compare(a.logp, b.logp))
      << what << ": " << detlogp::bitcmp::compare(a.logp, b.logp).describe("logp");
  EXPECT_TRUE(detlogp::bitcmp::compare(a.logp_raw, b.logp_raw)) << what;
  EXPECT_TRUE(detlogp::bitcmp::compare(a.lse, b.lse)) << what;
  EXPECT_EQ(a.topk_ids, b.topk_ids) << what << ": topk_ids";
  EXPECT_TRUE(detlogp::bitcmp::compare(a.topk_logp, b.topk_logp))
      << what << ": " << detlogp::bitcmp::compare(a.topk_logp, b.topk_logp).describe("topk_logp");
}

}  // namespace sample_test

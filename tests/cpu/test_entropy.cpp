// The entropy output of the CPU backend through the public API (docs/contract.md §10): logp/lse
// bits unchanged by asking for it, serving == trainer, reduce_logits of the serving logits gives
// the same bits, batch and position invariance, ignored rows, padding, accuracy, errors, and the
// TP = 1 bits under tensor parallelism.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "test_util.hpp"

using namespace detlogp_test;

namespace {

// Poisoned outputs with an entropy output of entropy_rows elements (N unless given).
struct EntropyRun {
  Outputs out;
  std::vector<float> entropy;

  explicit EntropyRun(const Problem& p, bool with_logits = false, int64_t entropy_rows = -1)
      : out(p.rows, p.vocab, with_logits),
        entropy(poisoned(static_cast<size_t>(entropy_rows < 0 ? p.rows : entropy_rows))) {}
  detlogp::LinearLogpOutputs views() {
    detlogp::LinearLogpOutputs o = out.views();
    o.entropy = detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, static_cast<int64_t>(entropy.size()));
    return o;
  }
};

EntropyRun run_with_entropy(const Problem& p, bool with_logits = false) {
  EntropyRun r(p, with_logits);
  detlogp::linear_logp(p.inputs(), r.views(), cpu_backend_options());
  return r;
}

std::vector<float> reduce_entropy(const Problem& p, const std::vector<float>& logits) {
  std::vector<float> entropy;
  run_reduce_logits(p, logits, &entropy);
  return entropy;
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  const auto r = detlogp::bitcmp::compare(a, b);
  EXPECT_TRUE(r.identical()) << what << ": " << r.describe("entropy");
}

Problem entropy_problem(int64_t vocab, int64_t real_vocab, uint64_t seed) {
  Problem p = tp_problem(vocab, real_vocab, seed, 37, 96);
  return p;
}

}  // namespace

TEST(Entropy, AskingForItLeavesLogpAndLseBitIdentical) {
  for (int64_t v : {17, 123, 2053}) {
    Problem p = entropy_problem(v, v, 5);
    for (auto& t : p.targets) t = t < 0 ? t : t % v;
    const Outputs plain = run_linear_logp(p);
    const EntropyRun with = run_with_entropy(p);
    expect_identical(plain, with.out, "logp/lse with and without entropy");
    EXPECT_EQ(count_unpoisoned(with.entropy), p.rows);
  }
}

TEST(Entropy, ServingEqualsTrainerAndReduceLogitsOfTheServingLogits) {
  const Problem p = entropy_problem(2053, 2000, 9);
  const EntropyRun trainer = run_with_entropy(p);
  const EntropyRun serving = run_with_entropy(p, true);
  expect_same_bits(trainer.entropy, serving.entropy, "serving vs trainer");
  expect_same_bits(reduce_entropy(p, serving.out.logits), trainer.entropy, "reduce_logits of the serving logits");
}

TEST(Entropy, DependsOnlyOnTheRowBatchPositionAndDuplicates) {
  const Problem p = entropy_problem(2053, 2053, 21);
  const EntropyRun all = run_with_entropy(p);
  const std::vector<int64_t> picks = {30, 2, 2, 17, 0, 36};
  const EntropyRun sub = run_with_entropy(p.select_rows(picks));
  for (size_t i = 0; i < picks.size(); ++i)
    EXPECT_EQ(detlogp::fp::bits(sub.entropy[i]), detlogp::fp::bits(all.entropy[picks[i]])) << "row " << picks[i];
  const EntropyRun alone = run_with_entropy(p.select_rows({17}));
  EXPECT_EQ(detlogp::fp::bits(alone.entropy[0]), detlogp::fp::bits(all.entropy[17]));
}

TEST(Entropy, IgnoredRowsReportItAndTargetsDoNotChangeIt) {
  Problem p = entropy_problem(123, 123, 4);
  const EntropyRun base = run_with_entropy(p);
  ASSERT_EQ(p.targets[2], -100);  // tp_problem ignores row 2
  EXPECT_TRUE(std::isfinite(base.entropy[2]));
  for (auto& t : p.targets) t = (t < 0) ? 5 : (t + 7) % p.real_vocab;
  expect_same_bits(run_with_entropy(p).entropy, base.entropy, "other targets");
}

TEST(Entropy, PaddingRowsOfTheWeightAreNeutral) {
  const Problem real = entropy_problem(2053, 2053, 13);
  Problem padded = real;
  padded.vocab = 2112;  // padded to a multiple of 64 with arbitrary rows
  padded.weight.resize(static_cast<size_t>(padded.vocab * padded.dim), 0x4480);  // bf16 1024.0
  padded.bias.resize(static_cast<size_t>(padded.vocab), 50.0f);
  expect_same_bits(run_with_entropy(padded).entropy, run_with_entropy(real).entropy, "padded head");
}

TEST(Entropy, MatchesFloat64WithinTheBound) {
  const Problem p = entropy_problem(2053, 2053, 17);
  const EntropyRun r = run_with_entropy(p, true);
  for (int64_t n = 0; n < p.rows; ++n) {
    const double inv_t = 1.0 / p.temperature_of(n);
    double m = -INFINITY;
    for (int64_t v = 0; v < p.vocab; ++v) m = std::max(m, r.out.logits[n * p.vocab + v] * inv_t);
    double s = 0, u = 0;
    for (int64_t v = 0; v < p.vocab; ++v) {
      const double y = r.out.logits[n * p.vocab + v] * inv_t;
      s += std::exp(y - m);
      u += std::exp(y - m) * (y - m);
    }
    const double want = std::log(s) - u / s;
    EXPECT_LE(std::abs(r.entropy[n] - want), 1e-4 * std::max(1.0, want)) << "row " << n;
  }
}

TEST(Entropy, BadOutputIsRefusedAndNothingIsWritten) {
  const Problem p = entropy_problem(123, 123, 3);
  EntropyRun r(p, false, p.rows + 1);
  EXPECT_THROW(detlogp::linear_logp(p.inputs(), r.views(), cpu_backend_options()), detlogp::Error);
  EXPECT_TRUE(r.out.untouched());
  EXPECT_EQ(count_unpoisoned(r.entropy), 0);
}

TEST(Entropy, BackendsWithoutItRefuseIt) {
  const Problem p = entropy_problem(123, 123, 3);
  EntropyRun r(p);
  detlogp::CallOptions opt;
  opt.backend = "reference-materialized";
  try {
    detlogp::linear_logp(p.inputs(), r.views(), opt);
    FAIL() << "the reference lane must refuse the entropy output";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("entropy"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(r.out.untouched());
}

// Under tensor parallelism the entropy keeps the TP = 1 bits (tests/cpu/test_tp_entropy.cpp covers
// the shard layouts, the operator and the refusals).
TEST(Entropy, TensorParallelGivesTheSingleShardBits) {
  const Problem p = entropy_problem(2053, 2053, 8);
  const EntropyRun one = run_with_entropy(p);
  EntropyRun tp(p);
  detlogp::simulate_tensor_parallel(p.inputs(), 2, tp.views(), cpu_backend_options());
  expect_identical(tp.out, one.out, "TP=2");
  expect_same_bits(tp.entropy, one.entropy, "TP=2");
}

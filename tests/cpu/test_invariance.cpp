// L1 (run-to-run) and L2 (batch) invariance of the CPU contract backend: the bytes of a row's
// logp, lse and logits depend only on that row's inputs, never on N, the row's position, the
// other rows, duplicates, the serving/trainer entry, the targets' dtype or the hidden stride.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;

namespace {

// A pool of rows, each also computed alone (N = 1) once: the per-row ground truth.
struct RowPool {
  Problem problem;
  std::vector<float> logp, lse, logits;  // alone results, logits [rows][vocab]

  explicit RowPool(const ProblemSpec& spec, bool per_row_temperature) : problem(make_problem(spec)) {
    if (per_row_temperature) {
      Rng rng(spec.seed + 1);
      problem.temperature_rows.resize(static_cast<size_t>(problem.rows));
      for (auto& t : problem.temperature_rows) t = static_cast<float>(0.25 + 2.0 * rng.uniform());
    }
    for (int64_t n = 0; n < problem.rows; n += 9) problem.targets[n] = -100;  // some ignored rows
    const int64_t V = problem.vocab;
    logp.resize(static_cast<size_t>(problem.rows));
    lse.resize(static_cast<size_t>(problem.rows));
    logits.resize(static_cast<size_t>(problem.rows * V));
    for (int64_t n = 0; n < problem.rows; ++n) {
      const Outputs alone = run_linear_logp(problem.select_rows({n}), true);
      logp[n] = alone.logp[0];
      lse[n] = alone.lse[0];
      std::copy(alone.logits.begin(), alone.logits.end(), logits.begin() + n * V);
    }
  }

  // Runs the batch made of `picks` and compares every row with the row computed alone.
  void check_batch(const std::vector<int64_t>& picks, bool with_logits, const std::string& what) const {
    const Problem batch = problem.select_rows(picks);
    const Outputs out = run_linear_logp(batch, with_logits);
    const int64_t V = problem.vocab;
    int64_t bad = 0;
    for (size_t i = 0; i < picks.size(); ++i) {
      const int64_t n = picks[i];
      const bool ok_logp = bc::float_bits(out.logp[i]) == bc::float_bits(logp[n]);
      const bool ok_lse = bc::float_bits(out.lse[i]) == bc::float_bits(lse[n]);
      bool ok_logits = true;
      if (with_logits) {
        const bc::Result r = bc::compare(&logits[n * V], &out.logits[i * V], V);
        ok_logits = r.identical();
        if (!ok_logits && bad == 0)
          ADD_FAILURE() << what << " position " << i << " (row " << n << "): " << r.describe("logits");
      }
      if ((!ok_logp || !ok_lse) && bad == 0) {
        ADD_FAILURE() << what << " position " << i << " (row " << n << "): logp " << bc::describe_float(out.logp[i])
                      << " alone " << bc::describe_float(logp[n]) << ", lse " << bc::describe_float(out.lse[i])
                      << " alone " << bc::describe_float(lse[n]);
      }
      bad += !(ok_logp && ok_lse && ok_logits);
    }
    EXPECT_EQ(bad, 0) << what << ": rows differing from the row computed alone";
  }
};

const std::vector<int64_t> kBatchSizes = {1, 2, 3, 7, 63, 64, 65, 127, 128, 1000};

void run_l2_ladder(const RowPool& pool, uint64_t seed, bool logits_for_all) {
  Rng rng(seed);
  const int64_t R = pool.problem.rows;
  for (int64_t N : kBatchSizes) {
    const bool with_logits = logits_for_all || (N >= 63 && N <= 128);
    // Random row positions: N distinct rows drawn from the pool, in random order.
    std::vector<int64_t> all(static_cast<size_t>(R));
    std::iota(all.begin(), all.end(), 0);
    for (int64_t i = R - 1; i > 0; --i) std::swap(all[i], all[rng.below(i + 1)]);
    std::vector<int64_t> picks(all.begin(), all.begin() + std::min(N, R));
    pool.check_batch(picks, with_logits, "N=" + std::to_string(N) + " random rows");
    // The same rows permuted.
    std::vector<int64_t> perm = picks;
    for (int64_t i = static_cast<int64_t>(perm.size()) - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
    std::reverse(perm.begin(), perm.end());
    pool.check_batch(perm, with_logits, "N=" + std::to_string(N) + " permuted");
    // Duplicated rows: N rows drawn with repetition from a handful of distinct ones.
    const int64_t distinct = std::max<int64_t>(1, N / 4);
    std::vector<int64_t> dup(static_cast<size_t>(N));
    for (auto& d : dup) d = picks[rng.below(distinct)];
    pool.check_batch(dup, with_logits, "N=" + std::to_string(N) + " duplicated");
  }
}

}  // namespace

TEST(L1, RepeatedCallsGiveIdenticalBits) {
  ProblemSpec s{.rows = 70, .dim = 256, .vocab = 2053, .real_vocab = -1, .bias = true, .logit_stddev = 3.0, .seed = 21};
  const Problem p = make_problem(s);
  const Outputs first = run_linear_logp(p, true);
  for (int rep = 0; rep < 4; ++rep) expect_identical(first, run_linear_logp(p, true), "repeat " + std::to_string(rep));
  const Outputs trainer = run_linear_logp(p, false);
  for (int rep = 0; rep < 2; ++rep) expect_identical(trainer, run_linear_logp(p, false), "trainer repeat");
}

TEST(L2, EveryRowEqualsTheRowAloneSmallDim) {
  // D = 160 (five K_SLABs, not a multiple of 64), V = 517 (not a multiple of 64),
  // bias, per-row temperatures, ignored rows.
  const RowPool pool(
      ProblemSpec{
          .rows = 1000, .dim = 160, .vocab = 517, .real_vocab = -1, .bias = true, .logit_stddev = 3.0, .seed = 22},
      /*per_row_temperature=*/true);
  run_l2_ladder(pool, 2201, /*logits_for_all=*/false);
}

TEST(L2, EveryRowEqualsTheRowAloneLargeDim) {
  // D = 1024: the GEMM's K blocking is exercised; fewer pool rows to stay fast.
  const RowPool pool(
      ProblemSpec{
          .rows = 130, .dim = 1024, .vocab = 300, .real_vocab = 290, .bias = false, .logit_stddev = 3.0, .seed = 23},
      /*per_row_temperature=*/false);
  Rng rng(2301);
  for (int64_t N : {1, 2, 3, 7, 63, 64, 65, 127, 128}) {
    std::vector<int64_t> picks(static_cast<size_t>(N));
    for (auto& p : picks) p = rng.below(pool.problem.rows);
    pool.check_batch(picks, /*with_logits=*/true, "D=1024 N=" + std::to_string(N));
  }
}

TEST(L2, SameRowAtFirstMiddleAndLastPosition) {
  const RowPool pool(
      ProblemSpec{
          .rows = 200, .dim = 64, .vocab = 2053, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 24},
      false);
  for (int64_t N : {2, 65, 129}) {
    std::vector<int64_t> picks(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) picks[i] = 1 + (i * 7) % 199;
    for (int64_t pos : {int64_t{0}, N / 2, N - 1}) {
      std::vector<int64_t> q = picks;
      q[pos] = 0;
      pool.check_batch(q, true, "row 0 at position " + std::to_string(pos) + " of " + std::to_string(N));
    }
  }
}

TEST(ServingVsTrainer, LogpAndLseIdenticalWithOrWithoutLogits) {
  for (int64_t V : {17, 123, 2053, 30522}) {
    ProblemSpec s{.rows = 9,
                  .dim = 64,
                  .vocab = V,
                  .real_vocab = -1,
                  .bias = true,
                  .logit_stddev = 2.0,
                  .seed = static_cast<uint64_t>(V)};
    Problem p = make_problem(s);
    p.temperature = 0.7f;
    p.targets[4] = -100;
    const Outputs trainer = run_linear_logp(p, false);
    const Outputs serving = run_linear_logp(p, true);
    expect_identical(trainer, serving, "V=" + std::to_string(V) + " trainer vs serving");
    EXPECT_EQ(count_unpoisoned(serving.logits), p.rows * V) << "serving entry must write every logit";
  }
}

TEST(InputLayout, Int32AndInt64TargetsGiveIdenticalBits) {
  ProblemSpec s{.rows = 40, .dim = 128, .vocab = 777, .real_vocab = -1, .bias = false, .logit_stddev = 2.0, .seed = 25};
  Problem p = make_problem(s);
  p.targets[3] = -100;
  const Outputs wide = run_linear_logp(p);
  std::vector<int32_t> t32(p.targets.begin(), p.targets.end());
  Outputs narrow(p.rows, p.vocab, false);
  detlogp::LinearLogpInputs in = p.inputs();
  in.targets = detlogp::TensorView::vector(t32.data(), detlogp::DType::i32, p.rows);
  detlogp::linear_logp(in, narrow.views(), cpu_backend_options());
  expect_identical(wide, narrow, "int32 vs int64 targets");
}

TEST(InputLayout, StridedHiddenRowsGiveIdenticalBits) {
  ProblemSpec s{.rows = 33, .dim = 96, .vocab = 700, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 26};
  const Problem p = make_problem(s);
  const Outputs packed = run_linear_logp(p, true);
  const int64_t stride = 96 + 40;
  std::vector<uint16_t> wide(static_cast<size_t>(p.rows * stride), bf16_round(1e30f));  // junk between rows
  for (int64_t n = 0; n < p.rows; ++n) std::copy_n(p.hidden.begin() + n * p.dim, p.dim, wide.begin() + n * stride);
  Outputs strided(p.rows, p.vocab, true);
  detlogp::LinearLogpInputs in = p.inputs();
  in.hidden =
      detlogp::TensorView::matrix(wide.data(), detlogp::DType::bf16, p.rows, p.dim, detlogp::Memory::host, stride);
  detlogp::linear_logp(in, strided.views(), cpu_backend_options());
  expect_identical(packed, strided, "hidden row stride 136 vs packed");
}

TEST(L2, RowsAcrossAWorkspaceChunkBoundary) {
  // A Qwen-like vocabulary (151936 real ids padded to 152064 = 2376 tiles) with N = 3600 rows:
  // 3600 x 2376 tile summaries are ~68 MB, so a backend that bounds its workspace has to run
  // the rows in chunks. D = 8 keeps the GEMM cheap; the epilogue dominates (~8 s on 2 cores).
  ProblemSpec s{
      .rows = 3600, .dim = 8, .vocab = 152064, .real_vocab = 151936, .bias = false, .logit_stddev = 3.0, .seed = 27};
  const Problem p = make_problem(s);
  const Outputs all = run_linear_logp(p);
  std::vector<int64_t> check = {0, 1, 31, 32, 33, 1759, 1760, 3599, 3598, 3567, 3568};
  for (int64_t n = 3488; n < 3552; n += 3) check.push_back(n);  // around 3520 = 110 x 32 rows
  Rng rng(2701);
  for (int i = 0; i < 10; ++i) check.push_back(rng.below(p.rows));
  // The same rows alone, and (for a few) against the unpadded weight.
  for (int64_t n : check) {
    const Outputs alone = run_linear_logp(p.select_rows({n}));
    ASSERT_EQ(bc::float_bits(all.logp[n]), bc::float_bits(alone.logp[0])) << "row " << n;
    ASSERT_EQ(bc::float_bits(all.lse[n]), bc::float_bits(alone.lse[0])) << "row " << n;
  }
  Problem unpadded = p.select_rows({0, 3520, 3599});
  unpadded.vocab = unpadded.real_vocab;
  unpadded.weight.resize(static_cast<size_t>(unpadded.vocab * unpadded.dim));
  const Outputs u = run_linear_logp(unpadded);
  const int64_t rows[3] = {0, 3520, 3599};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(bc::float_bits(u.lse[i]), bc::float_bits(all.lse[rows[i]])) << "unpadded row " << rows[i];
    EXPECT_EQ(bc::float_bits(u.logp[i]), bc::float_bits(all.logp[rows[i]])) << "unpadded row " << rows[i];
  }
}

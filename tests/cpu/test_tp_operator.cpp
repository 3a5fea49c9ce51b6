// linear_logp_tensor_parallel with in-process ranks (one thread each, host memory, CPU backend):
// TP in {1, 2, 3, 4, 8} gives the TP = 1 bits, padded vocabularies are bit-neutral, the serving
// entry keeps each rank's logits shard, CP row splits change nothing, every rank refuses a bad
// call with the same message before data moves, and the usual logsumexp-of-logsumexps merge is
// shown to differ where detlogp does not (the negative control).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <thread>

#include "core/backend.hpp"
#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/dist.hpp"
#include "test_util.hpp"
#include "tp/tp_operator.hpp"

using namespace detlogp_test;

namespace {

// Vocab shard boundaries: rank r owns [bounds[r], bounds[r+1]).
std::vector<int64_t> even_bounds(int64_t vocab, int ranks) {
  const int64_t per = ((vocab + ranks - 1) / ranks + 63) / 64 * 64;
  std::vector<int64_t> b;
  for (int r = 0; r <= ranks; ++r) b.push_back(std::min<int64_t>(vocab, r * per));
  return b;
}

struct RankResult {
  Outputs out;
  std::string error;  // empty when the call succeeded
  detlogp::CallReport report;
};

// Runs every rank in its own thread. `edit` may alter rank r's inputs (for the error cases).
std::vector<RankResult> run_ranks(
    const Problem& p, const std::vector<int64_t>& bounds, bool serving,
    const std::function<void(int, detlogp::LinearLogpInputs&)>& edit = [](int, detlogp::LinearLogpInputs&) {}) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  auto comms = detlogp::make_local_communicators(ranks, detlogp::Memory::host);
  std::vector<RankResult> results;
  for (int r = 0; r < ranks; ++r) results.push_back({Outputs(p.rows, bounds[r + 1] - bounds[r], serving), "", {}});
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      const int64_t start = bounds[r], count = bounds[r + 1] - bounds[r];
      detlogp::LinearLogpInputs in = p.shard_inputs(start, count);
      edit(r, in);
      try {
        results[r].report =
            detlogp::linear_logp_tensor_parallel(in, results[r].out.views(), *comms[r], cpu_backend_options());
      } catch (const detlogp::Error& e) {
        results[r].error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

void expect_every_rank_equals(const std::vector<RankResult>& rs, const Outputs& ref, const std::string& what) {
  for (size_t r = 0; r < rs.size(); ++r) {
    ASSERT_TRUE(rs[r].error.empty()) << what << " rank " << r << ": " << rs[r].error;
    Outputs trainer = rs[r].out;
    trainer.logits.clear();
    expect_identical(trainer, ref, what + " rank " + std::to_string(r));
  }
}

}  // namespace

TEST(TensorParallelOperator, EveryDegreeGivesTheSingleRankBits) {
  for (const auto& [vocab, real] : {std::pair<int64_t, int64_t>{2053, -1}, {2112, 2053}, {4096, 4000}, {123, -1}}) {
    const Problem p = tp_problem(vocab, real, static_cast<uint64_t>(vocab), 37, 96);
    const Outputs ref = run_linear_logp(p);
    for (int ranks : {1, 2, 3, 4, 8}) {
      const auto bounds = even_bounds(p.vocab, ranks);
      if (bounds[ranks - 1] >= bounds[ranks]) continue;  // more ranks than 64-id tiles
      expect_every_rank_equals(run_ranks(p, bounds, false), ref,
                               "V=" + std::to_string(vocab) + " TP=" + std::to_string(ranks));
    }
  }
}

TEST(TensorParallelOperator, UnevenShardsAndPaddedVocabularyAreBitNeutral) {
  // Qwen-like padding at small D: 152064 = 2 x 76032 rows, real vocabulary 151936.
  const Problem padded = tp_problem(152064, 151936, 3, 6, 16);
  Problem real = padded;
  real.vocab = 151936;
  real.weight.resize(static_cast<size_t>(real.vocab * real.dim));
  real.bias.resize(static_cast<size_t>(real.vocab));
  const Outputs ref = run_linear_logp(real);
  expect_every_rank_equals(run_ranks(padded, {0, 76032, 152064}, false), ref, "padded TP=2");
  // Uneven shards, one of them made only of padding.
  expect_every_rank_equals(run_ranks(padded, {0, 64, 100032, 151936, 152064}, false), ref, "uneven TP=4");
}

TEST(TensorParallelOperator, ServingEntryKeepsEachRanksLogitsShard) {
  const Problem p = tp_problem(2053, -1, 11, 19, 64);
  const Outputs ref = run_linear_logp(p, true);
  const auto bounds = even_bounds(p.vocab, 3);
  const auto rs = run_ranks(p, bounds, true);
  Outputs trainer_ref = ref;
  trainer_ref.logits.clear();
  expect_every_rank_equals(rs, trainer_ref, "serving TP=3");
  for (int r = 0; r < 3; ++r) {
    const int64_t count = bounds[r + 1] - bounds[r];
    std::vector<float> expect;
    for (int64_t n = 0; n < p.rows; ++n)
      expect.insert(expect.end(), ref.logits.begin() + n * p.vocab + bounds[r],
                    ref.logits.begin() + n * p.vocab + bounds[r] + count);
    const auto cmp = detlogp::bitcmp::compare(rs[r].out.logits, expect);
    EXPECT_TRUE(cmp.identical()) << cmp.describe("rank " + std::to_string(r) + " logits shard");
  }
}

TEST(TensorParallelOperator, RowChunksOfTheGatherAreBitNeutral) {
  const Problem p = tp_problem(30522, -1, 5, 300, 32);
  const Outputs ref = run_linear_logp(p);
  ScopedEnv small("DETLOGP_TP_WORKSPACE_MB", "1");  // chunks of 256 + 44 rows
  expect_every_rank_equals(run_ranks(p, even_bounds(p.vocab, 4), false), ref, "chunked TP=4");
}

TEST(TensorParallelOperator, ContextParallelRowSplitsChangeNothing) {
  // CP ranks own disjoint rows; no vocabulary statistic crosses CP ranks. Each CP group runs its
  // rows through TP = 2; their concatenation is the CP = 1 result.
  const Problem p = tp_problem(2053, -1, 9, 41, 64);
  const Outputs ref = run_linear_logp(p);
  for (int cp : {2, 3, 4}) {
    Outputs joined(p.rows, p.vocab, false);
    for (int c = 0; c < cp; ++c) {
      std::vector<int64_t> rows;
      for (int64_t n = c; n < p.rows; n += cp) rows.push_back(n);  // strided, as zig-zag CP does
      const Problem part = p.select_rows(rows);
      const auto rs = run_ranks(part, even_bounds(p.vocab, 2), false);
      ASSERT_TRUE(rs[0].error.empty()) << rs[0].error;
      for (size_t i = 0; i < rows.size(); ++i) {
        joined.logp[rows[i]] = rs[0].out.logp[i];
        joined.lse[rows[i]] = rs[0].out.lse[i];
      }
    }
    expect_identical(joined, ref, "CP=" + std::to_string(cp) + " x TP=2");
  }
}

TEST(TensorParallelOperator, EveryRankRefusesTheSameWayBeforeAnyDataMoves) {
  const Problem p = tp_problem(2053, -1, 13, 9, 32);
  auto expect_all_refuse = [&](const std::vector<RankResult>& rs, const std::string& needle) {
    for (size_t r = 0; r < rs.size(); ++r) {
      EXPECT_NE(rs[r].error.find(needle), std::string::npos) << "rank " << r << ": '" << rs[r].error << "'";
      EXPECT_EQ(rs[r].error, rs[0].error) << "rank " << r << " disagrees with rank 0";
      EXPECT_TRUE(rs[r].out.untouched()) << "rank " << r << " wrote outputs";
    }
  };
  // An overlap at a boundary off the tile grid: rank 1 starts at 990, rank 0 ends at 1000.
  expect_all_refuse(run_ranks(p, {0, 1000, 2053}, false,
                              [&](int r, detlogp::LinearLogpInputs& in) {
                                if (r != 1) return;
                                in.vocab_start = 990;
                                in.weight.rows = 2053 - 990;
                                in.weight.data = p.weight.data() + 990 * p.dim;
                                in.bias.rows = 2053 - 990;
                                in.bias.data = p.bias.data() + 990;
                              }),
                    "rank 1 shard starts at vocab_start=990 but rank 0 ends at 1000: vocab ids [990, 1000) are owned "
                    "by two ranks");
  // A real_vocab that disagrees, on one rank of an unaligned split.
  expect_all_refuse(run_ranks(p, {0, 1000, 2053}, false,
                              [](int r, detlogp::LinearLogpInputs& in) {
                                if (r == 1) in.real_vocab = 2060;
                              }),
                    "ranks disagree on real_vocab: rank 0 has 2053, rank 1 has 2060");
  // A gap: ids [1024, 1088) are owned by no rank.
  expect_all_refuse(run_ranks(p, {0, 1024, 2053}, false,
                              [&](int r, detlogp::LinearLogpInputs& in) {
                                if (r != 1) return;
                                in.vocab_start = 1088;
                                in.weight.rows = 2053 - 1088;
                                in.weight.data = p.weight.data() + 1088 * p.dim;
                                in.bias.rows = 2053 - 1088;
                                in.bias.data = p.bias.data() + 1088;
                              }),
                    "owned by no rank");
  // Shards out of rank order: rank 0 holds [1024, 2053), rank 1 [0, 1024).
  expect_all_refuse(run_ranks(p, {0, 1024, 2053}, false,
                              [&](int r, detlogp::LinearLogpInputs& in) {
                                const int64_t start = r == 0 ? 1024 : 0, count = r == 0 ? 2053 - 1024 : 1024;
                                in.vocab_start = start;
                                in.weight.rows = count;
                                in.weight.data = p.weight.data() + start * p.dim;
                                in.bias.rows = count;
                                in.bias.data = p.bias.data() + start;
                              }),
                    "rank 1 shard starts at vocab_start=0, before rank 0's vocab_start=1024");
  // The shards stop before the real vocabulary does.
  expect_all_refuse(
      run_ranks(p, {0, 1024, 2048}, false, [](int, detlogp::LinearLogpInputs& in) { in.real_vocab = 2053; }),
      "are owned by no rank");
  // An invalid target: every rank names it.
  Problem bad = p;
  bad.targets[5] = 5000;
  expect_all_refuse(run_ranks(bad, even_bounds(p.vocab, 2), false), "targets[5]=5000 is >= real_vocab=2053");
  // Ranks that disagree on the targets.
  std::vector<int64_t> other = p.targets;
  other[4] = (other[4] + 1) % p.real_vocab;
  expect_all_refuse(run_ranks(p, even_bounds(p.vocab, 2), false,
                              [&](int r, detlogp::LinearLogpInputs& in) {
                                if (r == 1) in.targets.data = other.data();
                              }),
                    "ranks disagree on targets (rank 0 and rank 1 digest them differently)");
  // Ranks that disagree on the temperatures.
  std::vector<float> hotter = p.temperature_rows;
  hotter[3] *= 2.0f;
  expect_all_refuse(run_ranks(p, even_bounds(p.vocab, 2), false,
                              [&](int r, detlogp::LinearLogpInputs& in) {
                                if (r == 1) in.temperature_rows.data = hotter.data();
                              }),
                    "ranks disagree on temperatures (rank 0 and rank 1 digest them differently)");
  // A wrong output shape on one rank.
  expect_all_refuse(run_ranks(p, even_bounds(p.vocab, 2), false,
                              [](int r, detlogp::LinearLogpInputs& in) {
                                if (r == 0) in.hidden.cols = 16;
                              }),
                    "rank 0: ");
}

TEST(TensorParallelOperator, NegativeControlTheUsualMergeDiffersDetlogpDoesNot) {
  // The usual vocab-parallel log-softmax: each rank reduces its logits to a logsumexp, then the
  // ranks' logsumexps are combined by another logsumexp. Its fp32 result depends on the split.
  const Problem p = tp_problem(30522, -1, 21, 256, 64);
  const Outputs full = run_linear_logp(p, true);
  auto usual_lse = [&](const std::vector<int64_t>& bounds, int64_t n) {
    std::vector<float> rank_lse;
    for (size_t r = 0; r + 1 < bounds.size(); ++r) {
      float m = -INFINITY, s = 0.0f;
      for (int64_t v = bounds[r]; v < bounds[r + 1]; ++v)
        m = std::max(m, full.logits[n * p.vocab + v] / p.temperature_of(n));
      for (int64_t v = bounds[r]; v < bounds[r + 1]; ++v)
        s += std::exp(full.logits[n * p.vocab + v] / p.temperature_of(n) - m);
      rank_lse.push_back(m + std::log(s));
    }
    float m = -INFINITY, s = 0.0f;
    for (float l : rank_lse) m = std::max(m, l);
    for (float l : rank_lse) s += std::exp(l - m);
    return m + std::log(s);
  };
  int usual_differs = 0;
  for (int64_t n = 0; n < p.rows; ++n)
    usual_differs += usual_lse({0, p.vocab}, n) != usual_lse(even_bounds(p.vocab, 2), n) ? 1 : 0;
  EXPECT_GT(usual_differs, 0) << "the usual merge happened to match TP=1 on all " << p.rows << " rows";
  std::printf("negative control: usual merge TP=2 differs from its TP=1 on %d of %lld rows; detlogp on 0\n",
              usual_differs, static_cast<long long>(p.rows));
  Outputs ref = full;
  ref.logits.clear();
  expect_every_rank_equals(run_ranks(p, even_bounds(p.vocab, 2), false), ref, "detlogp TP=2");
}

namespace {

// Serves this rank's partials on the CPU contract backend but reports the provenance `edit` makes
// of it: ranks that would be served under different contracts, archs or frozen choices.
class ReportedAs final : public detlogp::tp::PartialsBackend {
 public:
  explicit ReportedAs(std::function<void(detlogp::Provenance&)> edit) : edit_(std::move(edit)) {}
  void select(detlogp::Memory, bool, int64_t, int64_t, detlogp::CallReport& report) override {
    report.provenance = detlogp::detail::cpu_contract_backend().provenance();
    edit_(report.provenance);
  }
  void run(const detlogp::detail::LogpProblem& problem) const override {
    detlogp::detail::cpu_contract_backend().run(problem);
  }

 private:
  std::function<void(detlogp::Provenance&)> edit_;
};

}  // namespace

TEST(TensorParallelOperator, RanksUnderDifferentContractsOrArchsAreRefusedOnEveryRank) {
  const Problem p = tp_problem(2053, -1, 17, 9, 32);
  const std::vector<int64_t> bounds = even_bounds(p.vocab, 2);
  const std::vector<std::function<void(detlogp::Provenance&)>> differences = {
      [](detlogp::Provenance&) {},  // control: every rank alike
      [](detlogp::Provenance& v) { v.contract_version += 1; },
      [](detlogp::Provenance& v) { v.arch = "sm90a"; },
      [](detlogp::Provenance& v) { v.cc = 90; },
      [](detlogp::Provenance& v) { v.tree_id += "-other"; },
      [](detlogp::Provenance& v) { v.backend_id = "another-backend"; },
  };
  for (size_t d = 0; d < differences.size(); ++d) {
    auto comms = detlogp::make_local_communicators(2, detlogp::Memory::host);
    std::vector<Outputs> outs(2, Outputs(p.rows, 0, false));
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        detlogp::LinearLogpInputs in = p.inputs();
        const int64_t start = bounds[r], count = bounds[r + 1] - bounds[r];
        in.weight = detlogp::TensorView::matrix(p.weight.data() + start * p.dim, detlogp::DType::bf16, count, p.dim);
        in.bias = detlogp::TensorView::vector(p.bias.data() + start, detlogp::DType::f32, count);
        in.vocab_start = start;
        ReportedAs backend(r == 1 ? differences[d] : [](detlogp::Provenance&) {});
        try {
          detlogp::tp::run_tensor_parallel(in, outs[r].views(), *comms[r], nullptr, backend);
        } catch (const detlogp::Error& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      if (d == 0) {
        EXPECT_TRUE(errors[r].empty()) << "control, rank " << r << ": " << errors[r];
        continue;
      }
      EXPECT_NE(errors[r].find("different backends or contracts"), std::string::npos)
          << "difference " << d << ", rank " << r << ": '" << errors[r] << "'";
      EXPECT_EQ(errors[r], errors[0]) << "difference " << d << ": rank " << r << " disagrees with rank 0";
      EXPECT_TRUE(outs[r].untouched()) << "difference " << d << ": rank " << r << " wrote outputs";
    }
  }
}

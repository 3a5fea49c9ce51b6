// The entropy output under tensor parallelism on the CPU (docs/contract.md §10, docs/tensor-parallel.md):
// the tiles' entropy sums u_g travel beside the summaries, and the merge's entropy chain over the
// rank-ordered tiles gives the TP = 1 entropy bits, for the simulated ranks, hand-made shards
// through linear_logp_partials + merge_partials and the operator over in-process communicators;
// with padding, bias, per-row temperatures, ignored rows and a NaN row. logp/lse keep their bits.
// A merge asked for entropy over a rank without usums is refused naming the rank, with nothing
// written; ranks that disagree on asking for it, or a backend that cannot compute it, are refused on
// every rank alike.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.hpp"
#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/dist.hpp"
#include "test_util.hpp"
#include "tp/tp_operator.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;

namespace {

// TP = 1: linear_logp on the whole vocabulary, with the entropy.
EntropyOutputs single(const Problem& p) {
  EntropyOutputs r(p.rows, p.vocab, false);
  detlogp::linear_logp(p.inputs(), r.views(), cpu_backend_options());
  return r;
}

void expect_same_entropy(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const bc::Result r = bc::compare(got, want);
  EXPECT_TRUE(r.identical()) << r.describe(what + " entropy");
}

// logp, lse and entropy all equal TP = 1's bits.
void expect_tp1_bits(const EntropyOutputs& got, const EntropyOutputs& want, const std::string& what) {
  Outputs trainer = got.out;
  trainer.logits.clear();
  expect_identical(trainer, want.out, what);
  expect_same_entropy(got.entropy, want.entropy, what);
}

// A vocab shard [start, start + count) of p's weight with its partials buffers (usums when asked).
struct Shard {
  int64_t start = 0, count = 0;
  std::vector<detlogp::TileSummary> summaries;
  std::vector<float> target_logit, usums;
  std::vector<uint8_t> owned;
  detlogp::ShardPartials partials;

  void run(const Problem& p, bool with_usums) {
    detlogp::LinearLogpInputs in = p.shard_inputs(start, count);
    partials.rows = p.rows;
    partials.tiles = detlogp::shard_tiles(count);
    summaries.assign(static_cast<size_t>(p.rows * partials.tiles), {NAN, NAN});
    target_logit.assign(static_cast<size_t>(p.rows), NAN);
    owned.assign(static_cast<size_t>(p.rows), 77);
    usums.assign(with_usums ? static_cast<size_t>(p.rows * partials.tiles) : 0, NAN);
    partials.summaries = summaries.data();
    partials.target_logit = target_logit.data();
    partials.target_owned = owned.data();
    partials.usums = with_usums ? usums.data() : nullptr;
    detlogp::linear_logp_partials(in, partials, cpu_backend_options());
  }
};

std::vector<Shard> shards_of(const Problem& p, const std::vector<int64_t>& bounds, bool with_usums = true) {
  std::vector<Shard> shards(bounds.size() - 1);
  for (size_t r = 0; r + 1 < bounds.size(); ++r) {
    shards[r].start = bounds[r];
    shards[r].count = bounds[r + 1] - bounds[r];
    shards[r].run(p, with_usums);
  }
  return shards;
}

std::vector<detlogp::ShardPartials> ranks_of(const std::vector<Shard>& shards) {
  std::vector<detlogp::ShardPartials> ranks;
  for (const auto& s : shards) ranks.push_back(s.partials);
  return ranks;
}

detlogp::TensorView targets_of(const Problem& p) {
  return detlogp::TensorView::vector(p.targets.data(), detlogp::DType::i64, p.rows);
}

EntropyOutputs merge_with_entropy(const Problem& p, const std::vector<detlogp::ShardPartials>& ranks) {
  EntropyOutputs r(p.rows, p.vocab, false);
  const detlogp::LinearLogpOutputs v = r.views();
  detlogp::merge_partials(ranks, targets_of(p), p.ignore_index, v.logp, v.lse, v.entropy);
  return r;
}

std::string bounds_name(const std::vector<int64_t>& bounds) {
  std::string name = "shards";
  for (int64_t b : bounds) name.append(" ").append(std::to_string(b));
  return name;
}

// Vocab shard boundaries: rank r owns [bounds[r], bounds[r+1]), ceil(V / R) rounded up to 64.
std::vector<int64_t> even_bounds(int64_t vocab, int ranks) {
  const int64_t per = ((vocab + ranks - 1) / ranks + 63) / 64 * 64;
  std::vector<int64_t> b;
  for (int r = 0; r <= ranks; ++r) b.push_back(std::min<int64_t>(vocab, r * per));
  return b;
}

// p with one row whose hidden state holds a NaN: its logits, lse, logp and entropy are NaN, and
// every other row keeps its bits.
Problem with_nan_row(Problem p, int64_t row) {
  p.hidden[row * p.dim + 3] = 0x7FC0;  // bf16 quiet NaN
  return p;
}

// One problem of each kind the library shards: padded (real_vocab < V, the last real tile partial),
// unpadded with a partial last tile, 64-aligned, a small vocabulary, and a NaN row.
std::vector<Problem> problems() {
  std::vector<Problem> ps;
  ps.push_back(tp_problem(2112, 2053, 41));
  ps.push_back(tp_problem(2053, -1, 42));
  ps.push_back(tp_problem(4096, 4000, 43));
  ps.push_back(tp_problem(123, -1, 44));
  ps.push_back(with_nan_row(tp_problem(2112, 2053, 45), 6));
  return ps;
}

std::string problem_name(const Problem& p) {
  return "V=" + std::to_string(p.vocab) + " real=" + std::to_string(p.real_vocab);
}

}  // namespace

TEST(TensorParallelEntropy, SimulatedRanksGiveTheSingleShardBits) {
  for (const Problem& p : problems()) {
    const EntropyOutputs one = single(p);
    for (int R : {1, 2, 3, 4, 8}) {
      EntropyOutputs tp(p.rows, p.vocab, false);
      detlogp::simulate_tensor_parallel(p.inputs(), R, tp.views(), cpu_backend_options());
      expect_tp1_bits(tp, one, problem_name(p) + " R=" + std::to_string(R));
    }
  }
}

TEST(TensorParallelEntropy, AskingForItLeavesLogpAndLseBitIdentical) {
  const Problem p = tp_problem(2112, 2053, 46);
  for (int R : {2, 3}) {
    const Outputs plain = run_tensor_parallel(p, R);
    EntropyOutputs with(p.rows, p.vocab, false);
    detlogp::simulate_tensor_parallel(p.inputs(), R, with.views(), cpu_backend_options());
    expect_identical(with.out, plain, "R=" + std::to_string(R) + " with and without entropy");
    EXPECT_EQ(count_unpoisoned(with.entropy), p.rows);
  }
}

TEST(TensorParallelEntropy, HandMadeShardsMergeToTheSingleShardBits) {
  const Problem p = tp_problem(2112, 2053, 47);  // 33 tiles, the last one partly padding
  const EntropyOutputs one = single(p);
  const std::vector<std::vector<int64_t>> splits = {{0, 2112},
                                                    {0, 1024, 2112},
                                                    {0, 704, 1408, 2112},
                                                    {0, 128, 1024, 2112},
                                                    {0, 64, 128, 192, 2112},
                                                    {0, 1984, 2048, 2112},
                                                    {0, 2048, 2112}};
  for (const auto& bounds : splits) {
    const std::vector<Shard> shards = shards_of(p, bounds);
    expect_tp1_bits(merge_with_entropy(p, ranks_of(shards)), one, bounds_name(bounds));
  }
  // A last shard that is padding only (every lane of its tiles at or past real_vocab).
  const Problem wide = tp_problem(2176, 2053, 48);
  const std::vector<int64_t> bounds = {0, 1088, 2112, 2176};
  expect_tp1_bits(merge_with_entropy(wide, ranks_of(shards_of(wide, bounds))), single(wide),
                  "padding-only last shard, " + bounds_name(bounds));
}

TEST(TensorParallelEntropy, IgnoredRowsReportItAndTheNanRowKeepsToItself) {
  const Problem p = with_nan_row(tp_problem(2112, 2053, 49), 6);
  ASSERT_EQ(p.targets[2], p.ignore_index);
  const EntropyOutputs one = single(p);
  const EntropyOutputs tp = merge_with_entropy(p, ranks_of(shards_of(p, {0, 704, 1408, 2112})));
  expect_tp1_bits(tp, one, "3 shards");
  EXPECT_TRUE(std::isfinite(tp.entropy[2])) << "an ignored row reports its entropy like its lse";
  EXPECT_EQ(detlogp::fp::bits(tp.entropy[6]), detlogp::fp::bits(detlogp::fp::canonical_nan()));
  for (int64_t n = 0; n < p.rows; ++n)
    if (n != 6) EXPECT_TRUE(std::isfinite(tp.entropy[n])) << "row " << n;
}

TEST(TensorParallelEntropy, PartialsCarryTheGlobalTilesEntropySumsBesideUnchangedSummaries) {
  const Problem p = tp_problem(2112, 2053, 50);
  const Outputs served = run_linear_logp(p, /*with_logits=*/true);  // z, unscaled
  Shard with, without;
  with.start = without.start = 1024;
  with.count = without.count = 1088;  // global tiles 16..32, the last partly padding
  with.run(p, true);
  without.run(p, false);
  ASSERT_EQ(with.partials.tiles, 17);
  for (size_t i = 0; i < with.summaries.size(); ++i) {
    EXPECT_EQ(detlogp::fp::bits(with.summaries[i].max), detlogp::fp::bits(without.summaries[i].max)) << i;
    EXPECT_EQ(detlogp::fp::bits(with.summaries[i].sum), detlogp::fp::bits(without.summaries[i].sum)) << i;
  }
  for (int64_t n = 0; n < p.rows; ++n) {
    EXPECT_EQ(detlogp::fp::bits(with.target_logit[n]), detlogp::fp::bits(without.target_logit[n])) << n;
    EXPECT_EQ(with.owned[n], without.owned[n]) << n;
    const float inv = detlogp::inverse_temperature(p.temperature_rows[n]);
    for (int64_t j = 0; j < with.partials.tiles; ++j) {
      const int64_t g0 = with.start + 64 * j;
      float y[64] = {};
      for (int l = 0; l < 64; ++l) y[l] = detlogp::scale_logit(served.logits[n * p.vocab + g0 + l], inv);
      const int real = static_cast<int>(std::clamp<int64_t>(p.real_vocab - g0, 0, 64));
      const detlogp::TileEntropySummary want = detlogp::tile_entropy_summary(y, real);
      EXPECT_EQ(detlogp::fp::bits(with.usums[n * with.partials.tiles + j]), detlogp::fp::bits(want.usum))
          << "row " << n << " tile " << j;
    }
  }
}

TEST(TensorParallelEntropy, MergeRefusesARankWithoutUsumsNamingItAndWritesNothing) {
  const Problem p = tp_problem(2112, 2053, 51);
  const std::vector<int64_t> bounds = {0, 704, 1408, 2112};
  struct Case {
    std::vector<bool> usums;
    std::string rank;
  };
  for (const Case& c : {Case{{true, false, true}, "rank 1"}, Case{{false, false, false}, "rank 0"},
                        Case{{true, true, false}, "rank 2"}}) {
    std::vector<Shard> shards(3);
    for (int r = 0; r < 3; ++r) {
      shards[r].start = bounds[r];
      shards[r].count = bounds[r + 1] - bounds[r];
      shards[r].run(p, c.usums[r]);
    }
    EntropyOutputs out(p.rows, p.vocab, false);
    const detlogp::LinearLogpOutputs v = out.views();
    try {
      detlogp::merge_partials(ranks_of(shards), targets_of(p), p.ignore_index, v.logp, v.lse, v.entropy);
      ADD_FAILURE() << c.rank << ": merged without an error";
    } catch (const detlogp::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(c.rank + " partials carry none"), std::string::npos) << what;
      EXPECT_NE(what.find("usums"), std::string::npos) << what;
    }
    EXPECT_TRUE(out.untouched()) << c.rank << ": outputs written despite the error";
    // Without the entropy output the same partials merge as before (usums are optional).
    Outputs plain(p.rows, p.vocab, false);
    const detlogp::LinearLogpOutputs pv = plain.views();
    detlogp::merge_partials(ranks_of(shards), targets_of(p), p.ignore_index, pv.logp, pv.lse);
    expect_identical(plain, run_linear_logp(p), c.rank + " merge without entropy");
  }
}

TEST(TensorParallelEntropy, MergeRefusesABadEntropyOutput) {
  const Problem p = tp_problem(2112, 2053, 52);
  const std::vector<Shard> shards = shards_of(p, {0, 1024, 2112});
  Outputs out(p.rows, p.vocab, false);
  std::vector<float> entropy = poisoned(static_cast<size_t>(p.rows + 1));
  const detlogp::LinearLogpOutputs v = out.views();
  const auto bad = detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, p.rows + 1);
  try {
    detlogp::merge_partials(ranks_of(shards), targets_of(p), p.ignore_index, v.logp, v.lse, bad);
    ADD_FAILURE() << "merged into an entropy of N + 1 rows";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("entropy must be [N="), std::string::npos) << e.what();
  }
  EXPECT_TRUE(out.untouched());
  EXPECT_EQ(count_unpoisoned(entropy), 0);
}

namespace {

struct RankResult {
  EntropyOutputs out;
  std::string error;
};

// The operator over in-process communicators, every rank in its own thread. `entropy(r)`: whether
// rank r asks for the entropy; `backend(r)`: rank r's partials backend (null: the registry's).
std::vector<RankResult> run_operator(
    const Problem& p, const std::vector<int64_t>& bounds, bool serving, const std::function<bool(int)>& entropy,
    const std::function<detlogp::tp::PartialsBackend*(int)>& backend = [](int) { return nullptr; }) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  auto comms = detlogp::make_local_communicators(ranks, detlogp::Memory::host);
  std::vector<RankResult> results;
  for (int r = 0; r < ranks; ++r) results.push_back({EntropyOutputs(p.rows, bounds[r + 1] - bounds[r], serving), ""});
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      const int64_t start = bounds[r], count = bounds[r + 1] - bounds[r];
      detlogp::LinearLogpInputs in = p.shard_inputs(start, count);
      detlogp::LinearLogpOutputs out = results[r].out.views();
      if (!entropy(r)) out.entropy = {};
      try {
        if (detlogp::tp::PartialsBackend* b = backend(r))
          detlogp::tp::run_tensor_parallel(in, out, *comms[r], nullptr, *b);
        else
          detlogp::linear_logp_tensor_parallel(in, out, *comms[r], cpu_backend_options());
      } catch (const detlogp::Error& e) {
        results[r].error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// The CPU backend, refusing the entropy sums in the registry's words: a backend that serves
// partials but not the entropy output.
class WithoutEntropy final : public detlogp::tp::PartialsBackend {
 public:
  void select(detlogp::Memory, bool entropy, int64_t, int64_t, detlogp::CallReport& report) override {
    DETLOGP_CHECK(!entropy, "backend 'partials-without-entropy' does not compute the entropy output");
    report.provenance = detlogp::detail::cpu_contract_backend().provenance();
  }
  void run(const detlogp::detail::LogpProblem& problem) const override {
    detlogp::detail::cpu_contract_backend().run(problem);
  }
};

}  // namespace

TEST(TensorParallelEntropy, OperatorGivesTheSingleRankBitsOnEveryRank) {
  for (const Problem& p : problems()) {
    const EntropyOutputs one = single(p);
    for (int R : {1, 2, 3, 4}) {
      const std::vector<int64_t> bounds = even_bounds(p.vocab, R);
      if (bounds[R - 1] == bounds[R]) continue;  // a rank without rows of the weight: not a shard layout
      const std::vector<RankResult> rs = run_operator(p, bounds, R == 3, [](int) { return true; });
      for (int r = 0; r < R; ++r) {
        ASSERT_TRUE(rs[r].error.empty()) << problem_name(p) << " R=" << R << " rank " << r << ": " << rs[r].error;
        expect_tp1_bits(rs[r].out, one, problem_name(p) + " R=" + std::to_string(R) + " rank " + std::to_string(r));
      }
    }
  }
}

TEST(TensorParallelEntropy, OperatorRowChunksAreBitNeutral) {
  const Problem p = tp_problem(30522, -1, 53, 300, 32);
  const EntropyOutputs one = single(p);
  ScopedEnv small("DETLOGP_TP_WORKSPACE_MB", "1");  // with the usums, chunks of 128 + 128 + 44 rows
  const std::vector<RankResult> rs = run_operator(p, even_bounds(p.vocab, 4), false, [](int) { return true; });
  for (size_t r = 0; r < rs.size(); ++r) {
    ASSERT_TRUE(rs[r].error.empty()) << rs[r].error;
    expect_tp1_bits(rs[r].out, one, "chunked rank " + std::to_string(r));
  }
}

TEST(TensorParallelEntropy, RanksThatDisagreeOnAskingForItAreRefusedOnEveryRank) {
  const Problem p = tp_problem(2053, -1, 54);
  const std::vector<RankResult> rs = run_operator(p, even_bounds(p.vocab, 2), false, [](int r) { return r == 1; });
  for (size_t r = 0; r < rs.size(); ++r) {
    EXPECT_NE(rs[r].error.find("ranks disagree on the entropy output"), std::string::npos) << rs[r].error;
    EXPECT_EQ(rs[r].error, rs[0].error) << "rank " << r;
    EXPECT_TRUE(rs[r].out.untouched()) << "rank " << r;
  }
}

TEST(TensorParallelEntropy, ABackendWithoutItIsRefusedOnEveryRank) {
  const Problem p = tp_problem(2053, -1, 55);
  WithoutEntropy without;
  for (const int refusing : {0, 1, 2}) {  // 2: every rank's backend refuses
    const std::vector<RankResult> rs = run_operator(
        p, even_bounds(p.vocab, 2), false, [](int) { return true; },
        [&](int r) -> detlogp::tp::PartialsBackend* { return refusing == 2 || r == refusing ? &without : nullptr; });
    for (size_t r = 0; r < rs.size(); ++r) {
      EXPECT_NE(rs[r].error.find("does not compute the entropy output"), std::string::npos) << rs[r].error;
      EXPECT_NE(rs[r].error.find("refused on every rank"), std::string::npos) << rs[r].error;
      EXPECT_EQ(rs[r].error, rs[0].error) << "rank " << r;
      EXPECT_TRUE(rs[r].out.untouched()) << "rank " << r;
    }
  }
  // Without the entropy the same backend serves.
  const std::vector<RankResult> rs = run_operator(
      p, even_bounds(p.vocab, 2), false, [](int) { return false; }, [&](int) { return &without; });
  for (const RankResult& r : rs) EXPECT_TRUE(r.error.empty()) << r.error;
}

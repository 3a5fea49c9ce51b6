// The top-k output (docs/contract.md §12): topk_ids [N, K] are the K real ids of the largest scaled
// logits (ties to the lower id, NaN first), exactly as a full sort of the contract's logits gives
// them, and topk_logp [N, K] each id's single-target logp bits; from the same pass (no [N, V]);
// invariant in the batch; merged across tensor-parallel ranks (on and off the tile grid, through
// linear_logp_partials + merge_partials and the operator) to the TP = 1 bits; every bad request
// refused by name with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/dist.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;

namespace {

struct TopkRun {
  Outputs out;
  std::vector<int64_t> ids;
  std::vector<float> logp;
  std::string error;
  TopkRun(int64_t rows, int64_t vocab, int64_t k)
      : out(rows, vocab, false),
        ids(static_cast<size_t>(rows * k), -7),
        logp(poisoned(static_cast<size_t>(rows * k))) {}
  detlogp::LinearLogpOutputs views(int64_t rows, int64_t k) {
    detlogp::LinearLogpOutputs o = out.views();
    o.topk_ids = detlogp::mutable_matrix(ids.data(), detlogp::DType::i64, rows, k);
    o.topk_logp = detlogp::mutable_matrix(logp.data(), detlogp::DType::f32, rows, k);
    return o;
  }
  bool untouched() const {
    return out.untouched() && count_unpoisoned(logp) == 0 &&
           std::all_of(ids.begin(), ids.end(), [](int64_t i) { return i == -7; });
  }
};

TopkRun topk_call(const Problem& p, int64_t k) {
  TopkRun r(p.rows, p.vocab, k);
  detlogp::linear_logp(p.inputs(), r.views(p.rows, k), cpu_backend_options());
  return r;
}

// A problem whose logits tie: the weight rows (and bias) of ids 3, 5, 63, 64, 65, 699, 700 and the
// last real id are one row, row 2's hidden state, so their z are the same bits everywhere and the
// largest of row 2 (across tile and shard boundaries); a NaN row.
Problem with_ties(Problem p) {
  for (int64_t v :
       {int64_t{3}, int64_t{5}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{699}, int64_t{700}, p.real_vocab - 1}) {
    if (v >= p.real_vocab) continue;
    std::copy_n(p.hidden.begin() + 2 * p.dim, p.dim, p.weight.begin() + v * p.dim);
    if (!p.bias.empty()) p.bias[v] = 0.25f;
  }
  p.hidden[static_cast<size_t>(4 * p.dim)] = 0x7FC0;  // row 4: a NaN row
  return p;
}

// The full sort of the contract's scaled logits of the real ids (the serving logits scaled as §3.3
// scales them), larger first, ties to the lower id, NaN first; and each id's single-target logp
// (a multi-target call with the ids as targets).
void expect_full_sort(const Problem& p, int64_t k, const TopkRun& got, const std::string& what) {
  ASSERT_TRUE(got.error.empty()) << what << ": " << got.error;
  const Outputs served = run_linear_logp(p, true);
  std::vector<int64_t> want_ids(static_cast<size_t>(p.rows * k));
  for (int64_t n = 0; n < p.rows; ++n) {
    const float inv = detlogp::inverse_temperature(p.temperature_of(n));
    std::vector<float> y(static_cast<size_t>(p.real_vocab));
    for (int64_t v = 0; v < p.real_vocab; ++v) y[v] = detlogp::scale_logit(served.logits[n * p.vocab + v], inv);
    std::vector<int64_t> order(static_cast<size_t>(p.real_vocab));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      if (std::isnan(y[a]) || std::isnan(y[b])) return std::isnan(y[a]) && !std::isnan(y[b]);
      return y[a] > y[b];
    });
    std::copy_n(order.begin(), k, want_ids.begin() + n * k);
  }
  ASSERT_EQ(got.ids, want_ids) << what << ": topk_ids differ from the full sort";
  // Each id's logp: the single-target bits (multi-target calls of at most 64 ids a row).
  std::vector<float> logp(static_cast<size_t>(p.rows * k)), lse = poisoned(static_cast<size_t>(p.rows));
  for (int64_t j0 = 0; j0 < k; j0 += detlogp::kMaxTargetsPerRow) {
    const int64_t w = std::min(k - j0, detlogp::kMaxTargetsPerRow);
    std::vector<int64_t> ids(static_cast<size_t>(p.rows * w));
    std::vector<float> part(static_cast<size_t>(p.rows * w));
    for (int64_t n = 0; n < p.rows; ++n) std::copy_n(want_ids.begin() + n * k + j0, w, ids.begin() + n * w);
    detlogp::LinearLogpInputs in = p.inputs();
    in.targets = detlogp::TensorView::matrix(ids.data(), detlogp::DType::i64, p.rows, w);
    detlogp::LinearLogpOutputs o;
    o.logp = detlogp::mutable_matrix(part.data(), detlogp::DType::f32, p.rows, w);
    o.lse = detlogp::mutable_vector(lse.data(), detlogp::DType::f32, p.rows);
    detlogp::linear_logp(in, o, cpu_backend_options());
    for (int64_t n = 0; n < p.rows; ++n) std::copy_n(part.begin() + n * w, w, logp.begin() + n * k + j0);
  }
  const bc::Result r = bc::compare(got.logp, logp);
  EXPECT_TRUE(r.identical()) << r.describe(what + " topk_logp");
  const bc::Result l = bc::compare(got.out.lse, lse);
  EXPECT_TRUE(l.identical()) << l.describe(what + " lse");
}

std::vector<TopkRun> operator_ranks(const Problem& p, const std::vector<int64_t>& bounds, int64_t k,
                                    const std::function<int64_t(int)>& k_of = nullptr) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  auto comms = detlogp::make_local_communicators(ranks, detlogp::Memory::host);
  std::vector<TopkRun> runs;
  for (int r = 0; r < ranks; ++r) runs.emplace_back(p.rows, bounds[r + 1] - bounds[r], k);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      const int64_t kr = k_of ? k_of(r) : k;
      detlogp::LinearLogpOutputs o = runs[r].views(p.rows, k);
      o.topk_ids.cols = o.topk_ids.row_stride = kr;
      o.topk_logp.cols = o.topk_logp.row_stride = kr;
      try {
        detlogp::linear_logp_tensor_parallel(p.shard_inputs(bounds[r], bounds[r + 1] - bounds[r]), o, *comms[r],
                                             cpu_backend_options());
      } catch (const detlogp::Error& e) {
        runs[r].error = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return runs;
}

}  // namespace

TEST(Topk, IsTheFullSortOfTheContractsLogitsWithSingleTargetLogp) {
  for (const auto& [vocab, real] : {std::pair<int64_t, int64_t>{2053, -1}, {2112, 2053}, {123, -1}}) {
    const Problem p = with_ties(tp_problem(vocab, real, static_cast<uint64_t>(vocab) + 1, 13, 64));
    for (int64_t k : {1, 5, 20, 64, 128}) {
      if (k > p.real_vocab) continue;
      expect_full_sort(p, k, topk_call(p, k), "V=" + std::to_string(vocab) + " K=" + std::to_string(k));
    }
  }
}

TEST(Topk, TiesGoToTheLowerIdAndTheOutputsBesideItKeepTheirBits) {
  Problem p = with_ties(tp_problem(2053, -1, 2, 9, 32));
  // Every logit of row 0 equal (+0: a zero hidden state, no bias): the K first ids are 0..K-1.
  p.bias.clear();
  std::fill(p.hidden.begin(), p.hidden.begin() + p.dim, uint16_t{0});
  const TopkRun r = topk_call(p, 16);
  for (int64_t j = 0; j < 16; ++j) EXPECT_EQ(r.ids[static_cast<size_t>(j)], j);
  const Outputs plain = run_linear_logp(p);
  expect_identical(r.out, plain, "logp/lse beside the top-k");
}

TEST(Topk, RowsDoNotDependOnTheBatch) {
  const Problem p = with_ties(tp_problem(2112, 2053, 3, 17, 32));
  const TopkRun all = topk_call(p, 20);
  const std::vector<int64_t> picks{16, 3, 3, 0, 9};
  const TopkRun some = topk_call(p.select_rows(picks), 20);
  for (size_t i = 0; i < picks.size(); ++i)
    for (int64_t j = 0; j < 20; ++j) {
      EXPECT_EQ(some.ids[i * 20 + j], all.ids[picks[i] * 20 + j]);
      EXPECT_EQ(bc::float_bits(some.logp[i * 20 + j]), bc::float_bits(all.logp[picks[i] * 20 + j]));
    }
}

TEST(Topk, TensorParallelRanksMergeToTheTp1Bits) {
  const Problem p = with_ties(tp_problem(2112, 2053, 4, 15, 32));
  const int64_t k = 40;
  const TopkRun want = topk_call(p, k);
  // Row 2's first ids are the tied ones, in id order, across shards.
  const std::vector<int64_t> tied{3, 5, 63, 64, 65, 699, 700, p.real_vocab - 1};
  EXPECT_EQ(std::vector<int64_t>(want.ids.begin() + 2 * k, want.ids.begin() + 2 * k + 8), tied);
  for (const std::vector<int64_t>& bounds :
       {std::vector<int64_t>{0, 1024, 2112}, std::vector<int64_t>{0, 700, 1401, 2112},
        std::vector<int64_t>{0, 10, 70, 2050, 2060, 2112}}) {
    std::string name = "shards";
    for (int64_t b : bounds) name += " " + std::to_string(b);
    TopkRun sim(p.rows, p.vocab, k);
    detlogp::simulate_tensor_parallel(p.inputs(), bounds, sim.views(p.rows, k), cpu_backend_options());
    EXPECT_EQ(sim.ids, want.ids) << name << " simulated";
    EXPECT_TRUE(bc::compare(sim.logp, want.logp).identical()) << name << " simulated";
    const std::vector<TopkRun> runs = operator_ranks(p, bounds, k);
    for (size_t r = 0; r < runs.size(); ++r) {
      ASSERT_TRUE(runs[r].error.empty()) << name << " rank " << r << ": " << runs[r].error;
      EXPECT_EQ(runs[r].ids, want.ids) << name << " operator rank " << r;
      EXPECT_TRUE(bc::compare(runs[r].logp, want.logp).identical()) << name << " operator rank " << r;
      expect_identical(runs[r].out, want.out, name + " operator rank " + std::to_string(r));
    }
  }
}

TEST(Topk, BadRequestsAreRefusedWithNothingWritten) {
  const Problem p = tp_problem(123, -1, 5, 7, 32);
  auto refused = [&](int64_t k, const std::function<void(detlogp::LinearLogpOutputs&)>& edit, const std::string& needle,
                     const detlogp::CallOptions& opt = cpu_backend_options()) {
    TopkRun r(p.rows, p.vocab, k);
    detlogp::LinearLogpOutputs o = r.views(p.rows, k);
    edit(o);
    try {
      detlogp::linear_logp(p.inputs(), o, opt);
      ADD_FAILURE() << needle << ": accepted";
    } catch (const detlogp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(r.untouched()) << needle << ": written";
  };
  const auto none = [](detlogp::LinearLogpOutputs&) {};
  refused(129, none, "topk=129 (topk_ids has K=129 columns) must be in [1, 128] (kMaxTopk)");
  refused(124, none, "topk=124 exceeds real_vocab=123");
  refused(
      4, [](auto& o) { o.topk_logp = {}; }, "the top-k output needs both topk_ids and topk_logp");
  refused(
      4, [](auto& o) { o.topk_ids.dtype = detlogp::DType::i32; }, "topk_ids must be 2-D i64 [N, K]");
  refused(
      4, [](auto& o) { o.topk_logp.cols = 3; }, "topk_logp must be [N=7, K=4] f32, contiguous");
  refused(
      4, [](auto& o) { o.topk_ids.rows = 6; }, "topk_ids must be [N=7, K=4] contiguous");
  detlogp::CallOptions reference;
  reference.backend = "reference-materialized";
  refused(4, none, "backend 'reference-materialized' does not compute the top-k output", reference);
  // Ranks that disagree on K refuse on every rank alike.
  const std::vector<TopkRun> runs =
      operator_ranks(tp_problem(2053, -1, 6, 7, 32), {0, 1024, 2053}, 8, [](int r) { return r == 0 ? 8 : 5; });
  for (size_t r = 0; r < runs.size(); ++r) {
    EXPECT_NE(runs[r].error.find("ranks disagree on the top-k output (its K; 0: none): rank 0 has 8, rank 1 has 5"),
              std::string::npos)
        << "rank " << r << ": " << runs[r].error;
    EXPECT_TRUE(runs[r].untouched()) << "rank " << r;
  }
}

// topk_key, the integer image the GPU kernel sorts, orders entries exactly as topk_before does:
// every pair of special and ordinary values (NaNs of both signs and payloads, infinities, zeros
// of both signs, subnormals, equal values at different ids).
TEST(Topk, TheIntegerKeyOrdersEntriesAsTopkBefore) {
  const float values[] = {detlogp::fp::from_bits(0x7FC00000u),
                          detlogp::fp::from_bits(0xFFC00001u),
                          detlogp::fp::from_bits(0x7F800001u),
                          INFINITY,
                          -INFINITY,
                          0.0f,
                          -0.0f,
                          1e-45f,
                          -1e-45f,
                          1.0f,
                          -1.0f,
                          3.5f,
                          -3.5f,
                          1e30f};
  const int64_t ids[] = {0, 1, 63, 64, 151935, 0xFFFFFFFEll};
  std::vector<detlogp::TopkEntry> entries;
  for (float y : values)
    for (int64_t id : ids) entries.push_back({y, id});
  for (const auto& a : entries)
    for (const auto& b : entries) {
      if (a.id == b.id) continue;  // the order is over distinct ids
      ASSERT_EQ(detlogp::topk_key(a.y, a.id) > detlogp::topk_key(b.y, b.id), detlogp::topk_before(a, b))
          << "y " << a.y << " id " << a.id << " against y " << b.y << " id " << b.id;
    }
  EXPECT_GT(detlogp::topk_key(-INFINITY, 0xFFFFFFFEll), uint64_t{0}) << "key 0 must stay below every entry";
}

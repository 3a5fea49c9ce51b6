// Multi-id logprobs: targets [N, K] give logp [N, K] from one pass over the vocabulary, each entry
// the bits of a single-target call for that id (same lse, same entropy), ignore_index per entry;
// through linear_logp, reduce_logits, linear_logp_partials + merge_partials, the simulated ranks and
// the operator (each rank owning the y_t of its ids, shards on and off the tile grid); the refusals
// (K out of range, a layout that is not [N, K], logp not shaped like the targets, a target out of
// range named by its row and column, a backend that takes one target a row, ranks or partials that
// disagree on K) with nothing written.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/dist.hpp"
#include "detlogp/grad.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;

namespace {

// K ids per row: p's own target first, then ids across the vocabulary (its edges, tile boundaries,
// repeats of the same id), every 5th entry ignored.
std::vector<int64_t> multi_targets(const Problem& p, int64_t k, uint64_t seed) {
  Rng rng(seed);
  std::vector<int64_t> t(static_cast<size_t>(p.rows * k));
  for (int64_t n = 0; n < p.rows; ++n)
    for (int64_t j = 0; j < k; ++j) {
      int64_t id = j == 0 ? p.targets[n] : rng.below(p.real_vocab);
      if (j == 1) id = p.real_vocab - 1;
      if (j == 2) id = 63;
      if (j == 3) id = 64;
      if (j == 4 && k > 5) id = t[static_cast<size_t>(n * k + 1)];  // the same id twice in a row
      if ((n * k + j) % 5 == 4) id = p.ignore_index;
      t[static_cast<size_t>(n * k + j)] = id;
    }
  return t;
}

// logp [N, K], lse and entropy of one multi-target call, poisoned before it.
struct MultiRun {
  std::vector<float> logp, lse, entropy;
  std::string error;
  MultiRun(int64_t rows, int64_t k)
      : logp(poisoned(static_cast<size_t>(rows * k))),
        lse(poisoned(static_cast<size_t>(rows))),
        entropy(poisoned(static_cast<size_t>(rows))) {}
  detlogp::LinearLogpOutputs views(int64_t rows, int64_t k) {
    detlogp::LinearLogpOutputs o;
    o.logp = detlogp::mutable_matrix(logp.data(), detlogp::DType::f32, rows, k);
    o.lse = detlogp::mutable_vector(lse.data(), detlogp::DType::f32, rows);
    o.entropy = detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, rows);
    return o;
  }
  bool untouched() const {
    return count_unpoisoned(logp) == 0 && count_unpoisoned(lse) == 0 && count_unpoisoned(entropy) == 0;
  }
};

detlogp::TensorView targets_view(const std::vector<int64_t>& t, int64_t rows, int64_t k) {
  return detlogp::TensorView::matrix(t.data(), detlogp::DType::i64, rows, k);
}

MultiRun multi_call(const Problem& p, const std::vector<int64_t>& t, int64_t k) {
  MultiRun r(p.rows, k);
  detlogp::LinearLogpInputs in = p.inputs();
  in.targets = targets_view(t, p.rows, k);
  detlogp::linear_logp(in, r.views(p.rows, k), cpu_backend_options());
  return r;
}

// Column j of every row's K targets as single-target calls: the reference bits.
void expect_single_target_bits(const Problem& p, const std::vector<int64_t>& t, int64_t k, const MultiRun& got,
                               const std::string& what) {
  ASSERT_TRUE(got.error.empty()) << what << ": " << got.error;
  for (int64_t j = 0; j < k; ++j) {
    Problem one = p;
    for (int64_t n = 0; n < p.rows; ++n) one.targets[n] = t[static_cast<size_t>(n * k + j)];
    EntropyOutputs ref(p.rows, p.vocab, false);
    detlogp::linear_logp(one.inputs(), ref.views(), cpu_backend_options());
    std::vector<float> column(static_cast<size_t>(p.rows));
    for (int64_t n = 0; n < p.rows; ++n) column[n] = got.logp[static_cast<size_t>(n * k + j)];
    const bc::Result lp = bc::compare(column, ref.out.logp), ls = bc::compare(got.lse, ref.out.lse),
                     h = bc::compare(got.entropy, ref.entropy);
    EXPECT_TRUE(lp.identical()) << lp.describe(what + " logp column " + std::to_string(j));
    EXPECT_TRUE(ls.identical()) << ls.describe(what + " lse");
    EXPECT_TRUE(h.identical()) << h.describe(what + " entropy");
  }
}

// The operator over the shards [bounds[r], bounds[r + 1]), one thread per rank, rank r given the
// first k_of(r) columns of the [N, K] targets t (K = the largest k_of).
std::vector<MultiRun> operator_ranks(const Problem& p, const std::vector<int64_t>& bounds,
                                     const std::vector<int64_t>& t, const std::function<int64_t(int)>& k_of) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  auto comms = detlogp::make_local_communicators(ranks, detlogp::Memory::host);
  std::vector<MultiRun> runs;
  for (int r = 0; r < ranks; ++r) runs.emplace_back(p.rows, k_of(r));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      detlogp::LinearLogpInputs shard = p.shard_inputs(bounds[r], bounds[r + 1] - bounds[r]);
      shard.targets = targets_view(t, p.rows, k_of(r));
      try {
        detlogp::linear_logp_tensor_parallel(shard, runs[r].views(p.rows, k_of(r)), *comms[r], cpu_backend_options());
      } catch (const detlogp::Error& e) {
        runs[r].error = e.what();
      }
    });
  for (auto& th : threads) th.join();
  return runs;
}

}  // namespace

TEST(MultiTargets, EachEntryHasTheBitsOfASingleTargetCall) {
  for (const auto& [vocab, real] : {std::pair<int64_t, int64_t>{2053, -1}, {2112, 2053}, {123, -1}}) {
    Problem p = tp_problem(vocab, real, static_cast<uint64_t>(vocab), 21, 64);
    p.hidden[static_cast<size_t>(7 * p.dim)] = 0x7FC0;  // a NaN row
    for (int64_t k : {1, 3, 8, 64}) {
      const std::vector<int64_t> t = multi_targets(p, k, static_cast<uint64_t>(k));
      expect_single_target_bits(p, t, k, multi_call(p, t, k), "V=" + std::to_string(vocab) + " K=" + std::to_string(k));
    }
  }
}

TEST(MultiTargets, OneTargetAsAColumnIsTheVectorCall) {
  const Problem p = tp_problem(2053, -1, 3, 17, 32);
  const MultiRun col = multi_call(p, p.targets, 1);
  const Outputs vec = run_linear_logp(p);
  EXPECT_TRUE(bc::compare(col.logp, vec.logp).identical());
  EXPECT_TRUE(bc::compare(col.lse, vec.lse).identical());
  // i32 targets: the same bits.
  const std::vector<int64_t> t = multi_targets(p, 5, 9);
  std::vector<int32_t> t32(t.begin(), t.end());
  MultiRun r(p.rows, 5);
  detlogp::LinearLogpInputs in = p.inputs();
  in.targets = detlogp::TensorView::matrix(t32.data(), detlogp::DType::i32, p.rows, 5);
  detlogp::linear_logp(in, r.views(p.rows, 5), cpu_backend_options());
  EXPECT_TRUE(bc::compare(r.logp, multi_call(p, t, 5).logp).identical());
}

TEST(MultiTargets, ReduceLogitsTakesTheSameTargets) {
  const Problem p = tp_problem(2112, 2053, 4, 19, 32);
  const Outputs served = run_linear_logp(p, true);
  const std::vector<int64_t> t = multi_targets(p, 6, 4);
  const MultiRun want = multi_call(p, t, 6);
  std::vector<float> logp = poisoned(static_cast<size_t>(p.rows * 6)), lse = poisoned(static_cast<size_t>(p.rows));
  detlogp::ReduceLogitsInputs in;
  in.logits = detlogp::TensorView::matrix(served.logits.data(), detlogp::DType::f32, p.rows, p.vocab);
  in.targets = targets_view(t, p.rows, 6);
  in.temperature_rows = detlogp::TensorView::vector(p.temperature_rows.data(), detlogp::DType::f32, p.rows);
  in.real_vocab = p.real_vocab;
  detlogp::reduce_logits(in, detlogp::mutable_matrix(logp.data(), detlogp::DType::f32, p.rows, 6),
                         detlogp::mutable_vector(lse.data(), detlogp::DType::f32, p.rows));
  EXPECT_TRUE(bc::compare(logp, want.logp).identical());
  EXPECT_TRUE(bc::compare(lse, want.lse).identical());
}

TEST(MultiTargets, TensorParallelRanksOwnTheirIdsAndGiveTheTp1Bits) {
  const Problem p = tp_problem(2112, 2053, 5, 23, 32);
  const int64_t k = 8;
  const std::vector<int64_t> t = multi_targets(p, k, 5);
  const MultiRun want = multi_call(p, t, k);
  for (const std::vector<int64_t>& bounds :
       {std::vector<int64_t>{0, 1024, 2112}, std::vector<int64_t>{0, 700, 1401, 2112},
        std::vector<int64_t>{0, 60, 70, 2050, 2112}}) {
    std::string name = "shards";
    for (int64_t b : bounds) name += " " + std::to_string(b);
    // The simulated ranks: linear_logp_partials + merge_partials.
    MultiRun sim(p.rows, k);
    detlogp::LinearLogpInputs in = p.inputs();
    in.targets = targets_view(t, p.rows, k);
    detlogp::simulate_tensor_parallel(in, bounds, sim.views(p.rows, k), cpu_backend_options());
    EXPECT_TRUE(bc::compare(sim.logp, want.logp).identical()) << name << " simulated";
    EXPECT_TRUE(bc::compare(sim.lse, want.lse).identical()) << name << " simulated";
    EXPECT_TRUE(bc::compare(sim.entropy, want.entropy).identical()) << name << " simulated";
    // The operator, one thread per rank.
    const std::vector<MultiRun> runs = operator_ranks(p, bounds, t, [k](int) { return k; });
    for (size_t r = 0; r < runs.size(); ++r) {
      ASSERT_TRUE(runs[r].error.empty()) << name << " rank " << r << ": " << runs[r].error;
      EXPECT_TRUE(bc::compare(runs[r].logp, want.logp).identical()) << name << " operator rank " << r;
      EXPECT_TRUE(bc::compare(runs[r].lse, want.lse).identical()) << name << " operator rank " << r;
      EXPECT_TRUE(bc::compare(runs[r].entropy, want.entropy).identical()) << name << " operator rank " << r;
    }
  }
}

TEST(MultiTargets, BadTargetsAndOutputsAreRefusedWithNothingWritten) {
  const Problem p = tp_problem(2053, -1, 6, 9, 32);
  auto refused = [&](const std::function<void(detlogp::LinearLogpInputs&, detlogp::LinearLogpOutputs&)>& edit,
                     const std::string& needle, const detlogp::CallOptions& opt = cpu_backend_options()) {
    std::vector<int64_t> t = multi_targets(p, 4, 6);
    MultiRun r(p.rows, 4);
    detlogp::LinearLogpInputs in = p.inputs();
    in.targets = targets_view(t, p.rows, 4);
    detlogp::LinearLogpOutputs out = r.views(p.rows, 4);
    edit(in, out);
    try {
      detlogp::linear_logp(in, out, opt);
      ADD_FAILURE() << needle << ": accepted";
    } catch (const detlogp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(r.untouched()) << needle << ": outputs written";
  };
  std::vector<int64_t> wide(static_cast<size_t>(p.rows * 65), 0);
  refused([&](auto& in, auto&) { in.targets = targets_view(wide, p.rows, 65); },
          "targets has K=65 ids per row; K must be in [1, 64]");
  refused([&](auto& in, auto&) { in.targets.row_stride = 5; }, "targets [N, K] must be contiguous");
  refused([&](auto&, auto& out) { out.logp.cols = 3; }, "logp must be [N=9, K=4] f32, contiguous");
  refused(
      [&](auto&, auto& out) { out.logp = detlogp::mutable_vector(out.logp.mutable_data(), detlogp::DType::f32, 9); },
      "logp must be [N=9, K=4] f32");
  std::vector<int64_t> bad = multi_targets(p, 4, 6);
  bad[2 * 4 + 3] = 5000;
  refused([&](auto& in, auto&) { in.targets = targets_view(bad, p.rows, 4); },
          "targets[2, 3]=5000 is >= real_vocab=2053");
  bad[2 * 4 + 3] = -3;
  refused([&](auto& in, auto&) { in.targets = targets_view(bad, p.rows, 4); },
          "targets[2, 3]=-3 is negative and not ignore_index=-100");
  detlogp::CallOptions reference;
  reference.backend = "reference-materialized";
  refused([](auto&, auto& out) { out.entropy = {}; },
          "backend 'reference-materialized' takes one target per row, but targets has K=4", reference);
}

TEST(MultiTargets, PartialsAndRanksThatDisagreeOnKAreRefused) {
  const Problem p = tp_problem(2112, 2053, 7, 11, 32);
  const std::vector<int64_t> t = multi_targets(p, 3, 7);
  // Partials sized for one target a row.
  std::vector<detlogp::TileSummary> s(static_cast<size_t>(p.rows * 17));
  std::vector<float> tl(static_cast<size_t>(p.rows * 3), NAN);
  std::vector<uint8_t> own(static_cast<size_t>(p.rows * 3), 77);
  detlogp::ShardPartials q;
  q.rows = p.rows;
  q.tiles = 17;
  q.summaries = s.data();
  q.target_logit = tl.data();
  q.target_owned = own.data();
  detlogp::LinearLogpInputs in = p.shard_inputs(0, 1088);
  in.targets = targets_view(t, p.rows, 3);
  try {
    detlogp::linear_logp_partials(in, q, cpu_backend_options());
    ADD_FAILURE() << "partials of K=1 accepted for K=3 targets";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("partials.targets_per_row=1 but targets has K=3 ids per row"),
              std::string::npos)
        << e.what();
  }
  for (uint8_t o : own) EXPECT_EQ(o, 77);
  // Ranks that disagree on K refuse on every rank, before any data moves.
  const std::vector<MultiRun> runs =
      operator_ranks(p, {0, 1088, 2112}, t, [](int r) { return int64_t{r == 0 ? 3 : 2}; });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(runs[r].error.find("ranks disagree on K (target ids per row): rank 0 has 3, rank 1 has 2"),
              std::string::npos)
        << "rank " << r << ": " << runs[r].error;
    EXPECT_TRUE(runs[r].untouched()) << "rank " << r;
  }
}

// The logit gradient of [N, K] targets (docs/contract.md appendix A): dz is the pinned order applied
// to the serving logits (gl = entry_gradient_sum of the non-ignored entries, then each entry's term
// at its column in entry order, a repeated id once per entry), on the whole head and on a chunk at
// vocab_start > 0; with every entry but the first ignored it is the [N] call's bits.
TEST(MultiTargets, TheLogitGradientOfSeveralTargetsARow) {
  const Problem p = tp_problem(300, 280, 8, 9, 32);
  const int64_t k = 6;
  const std::vector<int64_t> t = multi_targets(p, k, 8);
  std::vector<float> g_logp(static_cast<size_t>(p.rows * k)), g_lse(static_cast<size_t>(p.rows));
  for (int64_t i = 0; i < p.rows * k; ++i) g_logp[i] = 0.125f * static_cast<float>(i % 7) - 0.375f;
  for (int64_t n = 0; n < p.rows; ++n) g_lse[n] = 0.25f * static_cast<float>(n % 3);
  // The serving logits z (bias included) and the forward lse.
  std::vector<float> z(static_cast<size_t>(p.rows * p.vocab)), logp(static_cast<size_t>(p.rows)),
      lse(static_cast<size_t>(p.rows));
  detlogp::LinearLogpOutputs served{detlogp::mutable_vector(logp.data(), detlogp::DType::f32, p.rows),
                                    detlogp::mutable_vector(lse.data(), detlogp::DType::f32, p.rows),
                                    detlogp::mutable_matrix(z.data(), detlogp::DType::f32, p.rows, p.vocab)};
  detlogp::linear_logp(p.inputs(), served, cpu_backend_options());

  const auto grad = [&](const std::vector<int64_t>& ids, int64_t per_row, const std::vector<float>& g, int64_t start,
                        int64_t cols, bool g_vector = false) {
    detlogp::LinearLogpInputs in = p.shard_inputs(start, cols);
    in.real_vocab = p.real_vocab;
    in.targets = per_row == 0 ? detlogp::TensorView::vector(ids.data(), detlogp::DType::i64, p.rows)
                              : targets_view(ids, p.rows, per_row);
    detlogp::GradLogitsArgs args;
    args.lse = detlogp::TensorView::vector(lse.data(), detlogp::DType::f32, p.rows);
    args.g_logp = per_row == 0 || g_vector
                      ? detlogp::TensorView::vector(g.data(), detlogp::DType::f32, p.rows)
                      : detlogp::TensorView::matrix(g.data(), detlogp::DType::f32, p.rows, per_row);
    args.g_lse = detlogp::TensorView::vector(g_lse.data(), detlogp::DType::f32, p.rows);
    std::vector<uint16_t> dz(static_cast<size_t>(p.rows * cols), 0xABCD);
    detlogp::linear_logp_grad_logits(in, args, detlogp::mutable_matrix(dz.data(), detlogp::DType::bf16, p.rows, cols));
    return dz;
  };
  const std::vector<uint16_t> whole = grad(t, k, g_logp, 0, p.vocab);
  const std::vector<uint16_t> chunk = grad(t, k, g_logp, 100, p.vocab - 100);
  int64_t target_columns = 0, repeated = 0;
  for (int64_t n = 0; n < p.rows; ++n) {
    bool ignored[detlogp::kMaxTargetsPerRow];
    for (int64_t j = 0; j < k; ++j) ignored[j] = t[n * k + j] == p.ignore_index;
    detlogp::GradRow r{};
    r.inv_t = detlogp::inverse_temperature(p.temperature_rows[n]);
    r.lse = lse[n];
    r.gl = detlogp::entry_gradient_sum(&g_logp[n * k], ignored, static_cast<int>(k));
    r.gs = g_lse[n];
    for (int64_t v = 0; v < p.vocab; ++v) {
      float adds[detlogp::kMaxTargetsPerRow];
      int n_adds = 0;
      for (int64_t j = 0; j < k; ++j)
        if (!ignored[j] && t[n * k + j] == v) adds[n_adds++] = g_logp[n * k + j];
      target_columns += n_adds > 0;
      repeated += n_adds > 1;
      const uint16_t want = detlogp::grad_logit_entries_bf16(z[n * p.vocab + v], r, v < p.real_vocab, adds, n_adds);
      ASSERT_EQ(whole[n * p.vocab + v], want) << "row " << n << " column " << v;
      if (v >= 100) ASSERT_EQ(chunk[n * (p.vocab - 100) + v - 100], want) << "chunk: row " << n << " column " << v;
    }
  }
  EXPECT_GT(target_columns, p.rows * 3);
  EXPECT_GT(repeated, 0);  // a repeated id got both of its terms

  // Only the first entry of each row kept: the [N] call's bits.
  std::vector<int64_t> first(static_cast<size_t>(p.rows)), kept(t.size(), p.ignore_index);
  std::vector<float> g_first(static_cast<size_t>(p.rows));
  for (int64_t n = 0; n < p.rows; ++n) {
    first[n] = kept[n * k] = t[n * k];
    g_first[n] = g_logp[n * k];
  }
  EXPECT_EQ(grad(kept, k, g_logp, 0, p.vocab), grad(first, 0, g_first, 0, p.vocab));
  // g_logp must be shaped like the targets.
  try {
    grad(t, k, g_first, 0, p.vocab, true);
    ADD_FAILURE() << "[N] g_logp accepted with [N, K] targets";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("g_logp must be [N=9, K=6] f32, contiguous"), std::string::npos) << e.what();
  }
}

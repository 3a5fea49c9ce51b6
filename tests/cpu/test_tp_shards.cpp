// Vocabulary shards at any boundary (docs/contract.md §7): engines split the vocabulary as V / TP,
// which is not a multiple of 64 (Qwen3 151936 / 4 = 37984, Llama-3 128256 / 8 = 16032). The tiles
// that straddle a boundary are assembled by the merge from the holders' edge lanes, so logp, lse
// and entropy keep the TP = 1 bits: for the simulated ranks (linear_logp_partials +
// merge_partials), the operator over in-process communicators (with gather chunking), unequal
// shards, shards narrower than a tile, shards of padding only, and targets on every boundary. The
// shard geometry itself is pinned case by case, and bad layouts off the tile grid are refused by
// every rank alike with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
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

// logp, lse and entropy of one run, poisoned before it, and the error it threw.
struct TpRun : EntropyOutputs {
  std::string error;
  TpRun(int64_t rows, int64_t vocab_local, bool with_logits = false) : EntropyOutputs(rows, vocab_local, with_logits) {}
};

void expect_tp1_bits(const TpRun& got, const TpRun& want, const std::string& what) {
  ASSERT_TRUE(got.error.empty()) << what << ": " << got.error;
  Outputs trainer = got.out;
  trainer.logits.clear();
  expect_identical(trainer, want.out, what);
  const bc::Result h = bc::compare(got.entropy, want.entropy);
  EXPECT_TRUE(h.identical()) << h.describe(what + " entropy");
}

TpRun single(const Problem& p) {
  TpRun r(p.rows, p.vocab);
  detlogp::linear_logp(p.inputs(), r.views(), cpu_backend_options());
  return r;
}

// An engine's split: V / R rows each, the first V % R ranks one more (no 64 rounding).
std::vector<int64_t> engine_bounds(int64_t vocab, int ranks) {
  std::vector<int64_t> b{0};
  for (int r = 0; r < ranks; ++r) b.push_back(b.back() + vocab / ranks + (r < vocab % ranks ? 1 : 0));
  return b;
}

std::string name_of(const std::vector<int64_t>& bounds) {
  std::string s = "shards";
  for (int64_t b : bounds) s += " " + std::to_string(b);
  return s;
}

// p with targets on every boundary of `bounds` (the ids right before, at and after it, where real),
// so the edge lanes' owners give y_t; one row ignored, one row NaN (its hidden state).
Problem with_boundary_targets(Problem p, const std::vector<int64_t>& bounds) {
  int64_t n = 5;
  for (size_t r = 1; r + 1 < bounds.size() && n + 3 <= p.rows; ++r)
    for (int64_t d : {-1, 0, 1}) {
      const int64_t t = bounds[r] + d;
      if (t >= 0 && t < p.real_vocab) p.targets[n++] = t;
    }
  p.hidden[static_cast<size_t>(p.rows - 1) * p.dim] = 0x7FC0;  // a NaN row
  return p;
}

TpRun simulated(const Problem& p, const std::vector<int64_t>& bounds) {
  TpRun r(p.rows, p.vocab);
  try {
    detlogp::simulate_tensor_parallel(p.inputs(), bounds, r.views(), cpu_backend_options());
  } catch (const detlogp::Error& e) {
    r.error = e.what();
  }
  return r;
}

// The operator, one thread per rank; `edit` may alter rank r's inputs.
std::vector<TpRun> operator_ranks(
    const Problem& p, const std::vector<int64_t>& bounds, bool serving = false,
    const std::function<void(int, detlogp::LinearLogpInputs&)>& edit = [](int, detlogp::LinearLogpInputs&) {}) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  auto comms = detlogp::make_local_communicators(ranks, detlogp::Memory::host);
  std::vector<TpRun> runs;
  for (int r = 0; r < ranks; ++r) runs.emplace_back(p.rows, bounds[r + 1] - bounds[r], serving);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      detlogp::LinearLogpInputs in = p.shard_inputs(bounds[r], bounds[r + 1] - bounds[r]);
      edit(r, in);
      try {
        detlogp::linear_logp_tensor_parallel(in, runs[r].views(), *comms[r], cpu_backend_options());
      } catch (const detlogp::Error& e) {
        runs[r].error = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return runs;
}

// Qwen3's vocabulary at small D: a weight of 151936 rows, every one real.
const Problem& qwen3() {
  static const Problem p = tp_problem(151936, 151936, 3, 24, 32);
  return p;
}

}  // namespace

TEST(ShardGeometry, PinsTheWholeTilesAndTheEdgeLanes) {
  struct Case {
    int64_t start, count, real;
    int64_t first_tile, tiles, head_cols, head_lanes, whole_cols, tail_lanes;
  };
  const Case cases[] = {
      {0, 2053, 2053, 0, 33, 0, 0, 2053, 0},               // TP = 1, the last tile partly padding
      {0, 2112, 2053, 0, 33, 0, 0, 2112, 0},               // the weight padded to whole tiles
      {0, 37984, 151936, 0, 593, 0, 0, 37952, 32},         // Qwen3 / 4, rank 0: its end inside tile 593
      {37984, 37984, 151936, 594, 593, 32, 32, 37952, 0},  // rank 1: tile 593's other 32 lanes
      {113952, 37984, 151936, 1781, 593, 32, 32, 37952, 0},
      {16032, 16032, 128256, 251, 250, 32, 32, 16000, 0},   // Llama-3 / 8, rank 1: its end on the grid
      {32064, 16032, 128256, 501, 250, 0, 0, 16000, 32},    // rank 2: its start on the grid
      {18992, 18992, 151936, 297, 296, 16, 16, 18944, 32},  // Qwen3 / 8, rank 1: both edges
      {2050, 10, 2053, 33, 0, 10, 3, 0, 0},                 // narrower than a tile, past real_vocab at 2053
      {70, 20, 2053, 2, 0, 20, 20, 0, 0},                   // inside one tile (ids 70..89 of tile 1)
      {0, 10, 2053, 0, 0, 0, 0, 0, 10},                     // the tail of tile 0 only
      {151940, 124, 151936, 2375, 1, 60, 0, 64, 0},         // padding only, off the grid
      {151900, 40, 151936, 2374, 1, 36, 36, 4, 0},          // tile 2373's last real lanes, then padding
      {2048, 64, 2053, 32, 1, 0, 0, 64, 0},                 // aligned: a whole last tile, 5 real lanes
      {152000, 64, 151936, 2375, 1, 0, 0, 64, 0},           // aligned padding-only shard
      {1000, 1, 2053, 16, 0, 1, 1, 0, 0},                   // one lane
  };
  for (const Case& c : cases) {
    const detlogp::ShardGeometry g = detlogp::shard_geometry(c.start, c.count, c.real);
    const std::string what = "shard [" + std::to_string(c.start) + ", " + std::to_string(c.start + c.count) +
                             ") of real_vocab " + std::to_string(c.real);
    EXPECT_EQ(g.first_tile, c.first_tile) << what;
    EXPECT_EQ(g.tiles, c.tiles) << what;
    EXPECT_EQ(g.head_cols, c.head_cols) << what;
    EXPECT_EQ(g.head_lanes, c.head_lanes) << what;
    EXPECT_EQ(g.whole_cols, c.whole_cols) << what;
    EXPECT_EQ(g.tail_lanes, c.tail_lanes) << what;
    EXPECT_EQ(g.head_cols + g.whole_cols + g.tail_lanes, c.count) << what;
    if (c.start % 64 == 0 && ((c.start + c.count) % 64 == 0 || c.start + c.count >= c.real)) {
      EXPECT_EQ(g.tiles, detlogp::shard_tiles(c.count)) << what << ": an aligned shard";
      EXPECT_EQ(g.edge_lanes(), 0) << what << ": an aligned shard";
    }
  }
}

TEST(ShardGeometry, EveryRealIdIsAWholeTileLaneOrAnEdgeLaneOfExactlyOneShard) {
  // Random splits of small vocabularies: each real id is covered once, and each straddling tile's
  // real lanes are exactly the edge lanes its shards export.
  Rng rng(29);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t vocab = 1 + rng.below(700);
    const int64_t real = 1 + rng.below(vocab);
    const int ranks = 1 + static_cast<int>(rng.below(9));
    std::vector<int64_t> cuts{0, vocab};
    for (int r = 1; r < ranks; ++r) cuts.push_back(1 + rng.below(vocab));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<int> seen(static_cast<size_t>(real), 0);
    for (size_t r = 0; r + 1 < cuts.size(); ++r) {
      const int64_t a = cuts[r], count = cuts[r + 1] - cuts[r];
      const detlogp::ShardGeometry g = detlogp::shard_geometry(a, count, real);
      for (int64_t j = 0; j < g.tiles; ++j)
        for (int64_t id = (g.first_tile + j) * 64; id < std::min((g.first_tile + j + 1) * 64, real); ++id) {
          ASSERT_GE(id, a) << "tile " << g.first_tile + j;
          ASSERT_LT(id, a + count) << "tile " << g.first_tile + j;
          ++seen[static_cast<size_t>(id)];
        }
      for (int64_t e = 0; e < g.head_lanes; ++e) ++seen[static_cast<size_t>(a + e)];
      for (int64_t e = 0; e < g.tail_lanes; ++e) ++seen[static_cast<size_t>(a + count - g.tail_lanes + e)];
      EXPECT_LE(g.head_lanes, 63);
      EXPECT_LE(g.tail_lanes, 63);
    }
    for (int64_t id = 0; id < real; ++id)
      ASSERT_EQ(seen[static_cast<size_t>(id)], 1)
          << "id " << id << " of real " << real << " V " << vocab << " " << name_of(cuts);
  }
}

TEST(UnalignedShards, Qwen3OverTp2348GivesTheTp1Bits) {
  for (int ranks : {2, 3, 4, 8}) {
    const std::vector<int64_t> bounds = engine_bounds(151936, ranks);
    const Problem p = with_boundary_targets(qwen3(), bounds);
    const TpRun want = single(p);
    expect_tp1_bits(simulated(p, bounds), want, "Qwen3 TP=" + std::to_string(ranks) + " " + name_of(bounds));
  }
  // The unaligned splits really are off the grid (37984 = 593.5 tiles).
  EXPECT_NE(engine_bounds(151936, 4)[1] % 64, 0);
}

TEST(UnalignedShards, Llama3OverTp8GivesTheTp1Bits) {
  const Problem base = tp_problem(128256, 128256, 8, 24, 32);
  const std::vector<int64_t> bounds = engine_bounds(128256, 8);  // 16032 = 250.5 tiles each
  const Problem p = with_boundary_targets(base, bounds);
  expect_tp1_bits(simulated(p, bounds), single(p), "Llama-3 TP=8 " + name_of(bounds));
}

TEST(UnalignedShards, UnequalNarrowAndPaddingOnlyShardsGiveTheTp1Bits) {
  // A weight padded past the real vocabulary (as engines pad), split unevenly at odd ids.
  const Problem base = tp_problem(152064, 151936, 17, 24, 32);
  const std::vector<std::vector<int64_t>> splits = {
      {0, 1, 70, 90, 2050, 2060, 100001, 151936, 152064},       // one lane; inside one tile; unequal
      {0, 37984, 37990, 38000, 75968, 151900, 151990, 152064},  // a 6- and a 10-lane shard; padding only at the end
      {0, 75968, 151940, 152064},                               // padding only, off the grid
      {0, 64, 100032, 151936, 152064},                          // aligned: the former layout
      {0, 151935, 151936, 152064},                              // the last real id alone
  };
  for (const auto& bounds : splits) {
    const Problem p = with_boundary_targets(base, bounds);
    const TpRun want = single(p);
    expect_tp1_bits(simulated(p, bounds), want, name_of(bounds));
  }
  // Many narrow shards in one tile's neighbourhood, at a small vocabulary.
  const Problem small = tp_problem(2112, 2053, 18, 24, 32);
  for (const auto& bounds : std::vector<std::vector<int64_t>>{
           {0, 2040, 2045, 2049, 2050, 2052, 2053, 2112}, {0, 3, 5, 64, 65, 127, 129, 2112}, {0, 2052, 2112}}) {
    const Problem p = with_boundary_targets(small, bounds);
    expect_tp1_bits(simulated(p, bounds), single(p), name_of(bounds));
  }
}

TEST(UnalignedShards, TheOperatorGivesTheTp1BitsOnEveryRank) {
  for (int ranks : {3, 4}) {
    const std::vector<int64_t> bounds = engine_bounds(151936, ranks);
    const Problem p = with_boundary_targets(qwen3(), bounds);
    const TpRun want = single(p);
    const std::vector<TpRun> runs = operator_ranks(p, bounds);
    for (size_t r = 0; r < runs.size(); ++r)
      expect_tp1_bits(runs[r], want, "operator Qwen3 TP=" + std::to_string(ranks) + " rank " + std::to_string(r));
  }
  // Narrow and padding-only shards through the operator.
  const Problem padded = tp_problem(2112, 2053, 19, 24, 32);
  const std::vector<int64_t> bounds{0, 700, 2049, 2052, 2060, 2112};
  const Problem p = with_boundary_targets(padded, bounds);
  const TpRun want = single(p);
  const std::vector<TpRun> runs = operator_ranks(p, bounds);
  for (size_t r = 0; r < runs.size(); ++r)
    expect_tp1_bits(runs[r], want, name_of(bounds) + " rank " + std::to_string(r));
}

TEST(UnalignedShards, TheServingEntryKeepsEachRanksLogitsShard) {
  const Problem base = tp_problem(2053, -1, 20, 19, 64);
  const std::vector<int64_t> bounds = engine_bounds(2053, 3);  // 685, 684, 684
  const Problem p = with_boundary_targets(base, bounds);
  TpRun ref(p.rows, p.vocab, true);
  detlogp::linear_logp(p.inputs(), ref.views(), cpu_backend_options());
  TpRun want = ref;
  want.out.logits.clear();
  const std::vector<TpRun> runs = operator_ranks(p, bounds, /*serving=*/true);
  for (size_t r = 0; r < runs.size(); ++r) {
    expect_tp1_bits(runs[r], want, "serving rank " + std::to_string(r));
    const int64_t count = bounds[r + 1] - bounds[r];
    std::vector<float> expect;
    for (int64_t n = 0; n < p.rows; ++n)
      expect.insert(expect.end(), ref.out.logits.begin() + n * p.vocab + bounds[r],
                    ref.out.logits.begin() + n * p.vocab + bounds[r] + count);
    const bc::Result cmp = bc::compare(runs[r].out.logits, expect);
    EXPECT_TRUE(cmp.identical()) << cmp.describe("rank " + std::to_string(r) + " logits shard");
  }
}

TEST(UnalignedShards, RowChunksOfTheGatherAreBitNeutral) {
  const Problem base = tp_problem(30522, -1, 21, 300, 32);
  const std::vector<int64_t> bounds = engine_bounds(30522, 4);  // 7631, 7631, 7630, 7630
  const Problem p = with_boundary_targets(base, bounds);
  const TpRun want = single(p);
  ScopedEnv small("DETLOGP_TP_WORKSPACE_MB", "1");  // several row chunks
  const std::vector<TpRun> runs = operator_ranks(p, bounds);
  for (size_t r = 0; r < runs.size(); ++r) expect_tp1_bits(runs[r], want, "chunked rank " + std::to_string(r));
}

TEST(UnalignedShards, EveryRankRefusesABadLayoutTheSameWayWithNothingWritten) {
  const Problem p = tp_problem(2053, -1, 22, 9, 32);
  auto expect_all_refuse = [&](const std::vector<TpRun>& runs, const std::string& needle, const std::string& what) {
    for (size_t r = 0; r < runs.size(); ++r) {
      EXPECT_NE(runs[r].error.find(needle), std::string::npos)
          << what << " rank " << r << ": '" << runs[r].error << "'";
      EXPECT_EQ(runs[r].error, runs[0].error) << what << " rank " << r << " disagrees with rank 0";
      EXPECT_TRUE(runs[r].untouched()) << what << " rank " << r << " wrote outputs";
    }
  };
  // Rank r's shard moved to [start, end) of the weight.
  auto moved = [&](int rank, int64_t start, int64_t end) {
    return [&p, rank, start, end](int r, detlogp::LinearLogpInputs& in) {
      if (r != rank) return;
      in = p.shard_inputs(start, end - start);
    };
  };
  const std::vector<int64_t> bounds{0, 700, 1401, 2053};
  expect_all_refuse(operator_ranks(p, bounds, false, moved(1, 710, 1401)),
                    "rank 1 shard starts at vocab_start=710 but rank 0 ends at 700: vocab ids [700, 710) are owned by "
                    "no rank",
                    "gap");
  expect_all_refuse(operator_ranks(p, bounds, false, moved(2, 1390, 2053)),
                    "rank 2 shard starts at vocab_start=1390 but rank 1 ends at 1401: vocab ids [1390, 1401) are owned "
                    "by two ranks",
                    "overlap");
  expect_all_refuse(operator_ranks(p, bounds, false,
                                   [&](int r, detlogp::LinearLogpInputs& in) {
                                     if (r == 0) in = p.shard_inputs(700, 701);
                                     if (r == 1) in = p.shard_inputs(0, 700);
                                   }),
                    "rank 1 shard starts at vocab_start=0, before rank 0's vocab_start=700", "out of order");
  expect_all_refuse(operator_ranks(p, bounds, false,
                                   [](int r, detlogp::LinearLogpInputs& in) {
                                     if (r == 2) in.real_vocab = 2060;
                                   }),
                    "ranks disagree on real_vocab: rank 0 has 2053, rank 2 has 2060", "real_vocab");
  expect_all_refuse(
      operator_ranks(p, {0, 700, 1401, 2040}, false, [](int, detlogp::LinearLogpInputs& in) { in.real_vocab = 2053; }),
      "the shards cover vocab ids [0, 2040) but real_vocab=2053: ids [2040, 2053) are owned by no rank",
      "short of real_vocab");

  // The same refusals from merge_partials over hand-made partials, nothing written.
  auto partials_of = [&](const std::vector<std::pair<int64_t, int64_t>>& shards) {
    struct Buffers {
      std::vector<detlogp::TileSummary> s;
      std::vector<float> t, e;
      std::vector<uint8_t> o;
    };
    auto buffers = std::make_shared<std::vector<Buffers>>(shards.size());
    std::vector<detlogp::ShardPartials> parts;
    for (size_t r = 0; r < shards.size(); ++r) {
      const auto [start, count] = shards[r];
      const detlogp::ShardGeometry g = detlogp::shard_geometry(start, count, p.real_vocab);
      Buffers& b = (*buffers)[r];
      b.s.resize(static_cast<size_t>(p.rows * g.tiles));
      b.t.resize(static_cast<size_t>(p.rows));
      b.o.resize(static_cast<size_t>(p.rows));
      b.e.resize(static_cast<size_t>(p.rows * g.edge_lanes()));
      detlogp::ShardPartials q;
      q.rows = p.rows;
      q.tiles = g.tiles;
      q.edge_lanes = g.edge_lanes();
      q.summaries = b.s.data();
      q.target_logit = b.t.data();
      q.target_owned = b.o.data();
      q.edge_logits = b.e.data();
      detlogp::linear_logp_partials(p.shard_inputs(start, count), q, cpu_backend_options());
      parts.push_back(q);
    }
    return std::make_pair(parts, buffers);
  };
  auto expect_merge_refused = [&](const std::vector<std::pair<int64_t, int64_t>>& shards, const std::string& needle) {
    const auto [parts, keep] = partials_of(shards);
    TpRun r(p.rows, p.vocab);
    auto v = r.views();
    try {
      detlogp::merge_partials(parts, detlogp::TensorView::vector(p.targets.data(), detlogp::DType::i64, p.rows),
                              p.ignore_index, v.logp, v.lse);
      ADD_FAILURE() << needle << ": merged";
    } catch (const detlogp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(r.untouched()) << needle;
  };
  expect_merge_refused({{0, 700}, {710, 1343}}, "vocab ids [700, 710) are owned by no rank");
  expect_merge_refused({{0, 700}, {690, 1363}}, "vocab ids [690, 700) are owned by two ranks");
  expect_merge_refused({{700, 1353}, {0, 700}},
                       "rank 1 shard starts at vocab_start=0, before rank 0's vocab_start=700");
  expect_merge_refused({{0, 700}, {700, 1300}}, "the shards cover vocab ids [0, 2000) but real_vocab=2053");
}

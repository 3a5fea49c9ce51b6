// Tensor parallelism on the CPU: the simulated R-rank run, and hand-made vocab shards through
// linear_logp_partials + merge_partials, give the bits of the single-shard linear_logp; the
// partials themselves are the contract's tile summaries of the global tiles, and they carry the
// layout merge_partials checks: shards out of rank order, gaps, overlaps, other targets, another
// ignore_index, real_vocab, temperature or backend are refused with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;

namespace {

// One hand-made vocab shard [start, start + count) of p's weight, with its partials buffers sized
// by the shard's geometry (whole tiles and edge lanes).
struct Shard {
  int64_t start = 0, count = 0;
  std::vector<detlogp::TileSummary> summaries;
  std::vector<float> target_logit;
  std::vector<uint8_t> owned;
  std::vector<float> edge_logits;
  detlogp::ShardPartials partials;

  detlogp::CallReport run(const Problem& p) { return run(p, p.inputs()); }
  // With `in` made from p (its targets, temperatures, real_vocab may differ from p's).
  detlogp::CallReport run(const Problem& p, detlogp::LinearLogpInputs in) {
    in.weight = detlogp::TensorView::matrix(p.weight.data() + start * p.dim, detlogp::DType::bf16, count, p.dim);
    if (!p.bias.empty()) in.bias = detlogp::TensorView::vector(p.bias.data() + start, detlogp::DType::f32, count);
    in.vocab_start = start;
    const detlogp::ShardGeometry g = detlogp::shard_geometry(start, count, in.real_vocab);
    partials.rows = p.rows;
    partials.tiles = g.tiles;
    partials.edge_lanes = g.edge_lanes();
    summaries.assign(static_cast<size_t>(p.rows * partials.tiles), {NAN, NAN});
    target_logit.assign(static_cast<size_t>(p.rows), NAN);
    owned.assign(static_cast<size_t>(p.rows), 77);
    edge_logits.assign(static_cast<size_t>(p.rows * partials.edge_lanes), NAN);
    partials.summaries = summaries.data();
    partials.target_logit = target_logit.data();
    partials.target_owned = owned.data();
    partials.edge_logits = edge_logits.data();
    return detlogp::linear_logp_partials(in, partials, cpu_backend_options());
  }
};

Outputs merge(const Problem& p, std::vector<Shard>& shards) {
  std::vector<detlogp::ShardPartials> ranks;
  for (auto& s : shards) ranks.push_back(s.partials);
  Outputs out(p.rows, p.vocab, false);
  auto views = out.views();
  detlogp::merge_partials(ranks, detlogp::TensorView::vector(p.targets.data(), detlogp::DType::i64, p.rows),
                          p.ignore_index, views.logp, views.lse);
  return out;
}

// Shards [bounds[r], bounds[r + 1]) of p, each computed with linear_logp_partials.
std::vector<Shard> shards_of(const Problem& p, const std::vector<int64_t>& bounds) {
  std::vector<Shard> shards(bounds.size() - 1);
  for (size_t r = 0; r + 1 < bounds.size(); ++r) {
    shards[r].start = bounds[r];
    shards[r].count = bounds[r + 1] - bounds[r];
    shards[r].run(p);
  }
  return shards;
}

// merge_partials over `ranks` must throw naming every needle, and write nothing.
void expect_merge_refused(const Problem& p, const std::vector<detlogp::ShardPartials>& ranks,
                          const detlogp::TensorView& targets, int64_t ignore_index,
                          const std::vector<std::string>& needles, const std::string& what) {
  Outputs out(p.rows, p.vocab, false);
  auto views = out.views();
  try {
    detlogp::merge_partials(ranks, targets, ignore_index, views.logp, views.lse);
    ADD_FAILURE() << what << ": merged without an error";
  } catch (const detlogp::Error& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << what << ": '" << e.what() << "' lacks '" << n << "'";
  }
  EXPECT_TRUE(out.untouched()) << what << ": outputs written despite the error";
}
void expect_merge_refused(const Problem& p, const std::vector<Shard>& shards, const std::vector<std::string>& needles,
                          const std::string& what) {
  std::vector<detlogp::ShardPartials> ranks;
  for (const auto& s : shards) ranks.push_back(s.partials);
  expect_merge_refused(p, ranks, detlogp::TensorView::vector(p.targets.data(), detlogp::DType::i64, p.rows),
                       p.ignore_index, needles, what);
}

// p with every non-ignored target moved into [0, 64): a merge that misses or doubles tiles
// elsewhere then finds every target owned once (the case where only the layout can tell).
Problem with_low_targets(Problem p) {
  for (int64_t& t : p.targets)
    if (t != p.ignore_index) t %= 64;
  return p;
}

}  // namespace

TEST(TensorParallel, SimulatedRanksGiveTheSingleShardBits) {
  struct Case {
    int64_t vocab, real_vocab;
  };
  for (const Case c : {Case{2053, -1}, Case{2112, 2053}, Case{4096, 4000}, Case{123, -1}, Case{30522, -1}}) {
    const Problem p = tp_problem(c.vocab, c.real_vocab, static_cast<uint64_t>(c.vocab + c.real_vocab));
    const Outputs single = run_linear_logp(p);
    for (int R : {1, 2, 4, 8}) {
      const Outputs tp = run_tensor_parallel(p, R);
      expect_identical(
          single, tp,
          "V_local=" + std::to_string(c.vocab) + " real=" + std::to_string(p.real_vocab) + " R=" + std::to_string(R));
    }
  }
}

TEST(TensorParallel, HandMadeUnevenShardsMergeToTheSingleShardBits) {
  const Problem p = tp_problem(2112, 2053, 31);  // 33 tiles, the last one partly padding
  const Outputs single = run_linear_logp(p);
  const std::vector<std::vector<int64_t>> splits = {
      {0, 2112}, {0, 128, 1024, 2112}, {0, 64, 128, 192, 2112}, {0, 1984, 2048, 2112}, {0, 2048, 2112}};
  for (const auto& bounds : splits) {
    std::vector<Shard> shards(bounds.size() - 1);
    for (size_t r = 0; r + 1 < bounds.size(); ++r) {
      shards[r].start = bounds[r];
      shards[r].count = bounds[r + 1] - bounds[r];
      shards[r].run(p);
    }
    std::string name = "shards";
    for (int64_t b : bounds) name.append(" ").append(std::to_string(b));
    expect_identical(single, merge(p, shards), name);
  }
}

TEST(TensorParallel, PartialsAreTheGlobalTileSummariesAndTheOwnedTargetLogit) {
  const Problem p = tp_problem(2112, 2053, 32);
  const Outputs served = run_linear_logp(p, /*with_logits=*/true);  // z, unscaled
  Shard shard;
  shard.start = 1024;
  shard.count = 1088;  // global tiles 16..32, the last partly padding
  shard.run(p);
  ASSERT_EQ(shard.partials.tiles, 17);
  for (int64_t n = 0; n < p.rows; ++n) {
    const float inv = detlogp::inverse_temperature(p.temperature_rows[n]);
    for (int64_t j = 0; j < shard.partials.tiles; ++j) {
      const int64_t g0 = shard.start + 64 * j;
      float y[64] = {};
      for (int l = 0; l < 64; ++l) y[l] = detlogp::scale_logit(served.logits[n * p.vocab + g0 + l], inv);
      const int real = static_cast<int>(std::clamp<int64_t>(p.real_vocab - g0, 0, 64));
      const detlogp::TileSummary want = detlogp::tile_summary(y, real);
      const detlogp::TileSummary got = shard.summaries[n * shard.partials.tiles + j];
      ASSERT_EQ(bc::float_bits(got.max), bc::float_bits(want.max)) << "row " << n << " local tile " << j;
      ASSERT_EQ(bc::float_bits(got.sum), bc::float_bits(want.sum)) << "row " << n << " local tile " << j;
    }
    const int64_t t = p.targets[n];
    const bool owns = t != p.ignore_index && t >= shard.start && t < shard.start + shard.count;
    EXPECT_EQ(shard.owned[n], owns ? 1 : 0) << "row " << n << " target " << t;
    if (owns) {
      EXPECT_EQ(bc::float_bits(shard.target_logit[n]),
                bc::float_bits(detlogp::scale_logit(served.logits[n * p.vocab + t], inv)))
          << "row " << n;
    }
  }
}

TEST(TensorParallel, PartialsSizedForAnotherGeometryAreRefused) {
  // [100, 1100) of real_vocab 2053: tiles 2..16 whole, 28 head lanes (ids 100..127) and 12 tail
  // lanes (ids 1088..1099). Buffers sized as if the shard were 64-aligned are refused by name.
  const Problem p = tp_problem(2112, 2053, 33);
  Shard shard;
  shard.start = 100;
  shard.count = 1000;
  const detlogp::ShardGeometry g = detlogp::shard_geometry(100, 1000, 2053);
  EXPECT_EQ(g.first_tile, 2);
  EXPECT_EQ(g.tiles, 15);
  EXPECT_EQ(g.head_lanes, 28);
  EXPECT_EQ(g.tail_lanes, 12);
  shard.run(p);  // the geometry's buffers: accepted
  auto refused = [&](const std::function<void(detlogp::ShardPartials&)>& edit, const std::string& needle) {
    Shard s = shard;
    s.partials.summaries = s.summaries.data();
    s.partials.target_logit = s.target_logit.data();
    s.partials.target_owned = s.owned.data();
    s.partials.edge_logits = s.edge_logits.data();
    std::fill(s.target_logit.begin(), s.target_logit.end(), NAN);
    std::fill(s.owned.begin(), s.owned.end(), uint8_t{77});
    edit(s.partials);
    detlogp::LinearLogpInputs in = p.shard_inputs(100, 1000);
    try {
      detlogp::linear_logp_partials(in, s.partials, cpu_backend_options());
      ADD_FAILURE() << needle << ": accepted";
    } catch (const detlogp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    for (float x : s.target_logit) EXPECT_TRUE(std::isnan(x)) << "partials written despite the error";
    for (uint8_t o : s.owned) EXPECT_EQ(o, 77) << "partials written despite the error";
  };
  refused([](detlogp::ShardPartials& q) { q.tiles = detlogp::shard_tiles(1000); },
          "partials.tiles=16 but the shard [100, 1100) has 15 whole tiles");
  refused([](detlogp::ShardPartials& q) { q.edge_lanes = 0; },
          "partials.edge_lanes=0 but the shard [100, 1100) has 40 edge lanes (28 at its start, 12 at its end");
  refused([](detlogp::ShardPartials& q) { q.edge_logits = nullptr; },
          "partials.edge_logits is null but the shard [100, 1100) has 40 edge lanes per row");
}

TEST(TensorParallel, PartialsOfAnUnalignedShardAreItsWholeTilesAndItsEdgeLanes) {
  // The whole tiles' summaries are the global tiles' (tile_summary of the TP = 1 logits), the edge
  // lanes are the TP = 1 scaled logits of those ids, and y_t is owned by the shard holding t.
  const Problem p = tp_problem(2112, 2053, 34);
  const Outputs served = run_linear_logp(p, /*with_logits=*/true);
  for (const auto& [start, count] :
       {std::pair<int64_t, int64_t>{100, 1000}, {0, 1000}, {1000, 1053}, {70, 20}, {2050, 62}, {2040, 72}}) {
    Shard shard;
    shard.start = start;
    shard.count = count;
    shard.run(p);
    const detlogp::ShardGeometry g = detlogp::shard_geometry(start, count, p.real_vocab);
    const std::string what = "shard [" + std::to_string(start) + ", " + std::to_string(start + count) + ")";
    for (int64_t n = 0; n < p.rows; ++n) {
      const float inv = detlogp::inverse_temperature(p.temperature_rows[n]);
      auto y_of = [&](int64_t id) { return detlogp::scale_logit(served.logits[n * p.vocab + id], inv); };
      for (int64_t j = 0; j < g.tiles; ++j) {
        const int64_t g0 = (g.first_tile + j) * 64;
        float y[64] = {};
        for (int l = 0; l < 64 && g0 + l < p.vocab; ++l) y[l] = y_of(g0 + l);
        const int real = static_cast<int>(std::clamp<int64_t>(p.real_vocab - g0, 0, 64));
        const detlogp::TileSummary want = detlogp::tile_summary(y, real);
        const detlogp::TileSummary got = shard.summaries[n * g.tiles + j];
        ASSERT_EQ(bc::float_bits(got.max), bc::float_bits(want.max)) << what << " row " << n << " tile " << j;
        ASSERT_EQ(bc::float_bits(got.sum), bc::float_bits(want.sum)) << what << " row " << n << " tile " << j;
      }
      for (int64_t e = 0; e < g.edge_lanes(); ++e) {
        const int64_t id = e < g.head_lanes ? start + e : start + count - g.tail_lanes + (e - g.head_lanes);
        ASSERT_EQ(bc::float_bits(shard.edge_logits[n * g.edge_lanes() + e]), bc::float_bits(y_of(id)))
            << what << " row " << n << " edge lane " << e << " (id " << id << ")";
      }
      const int64_t t = p.targets[n];
      const bool owns = t != p.ignore_index && t >= start && t < start + count;
      EXPECT_EQ(shard.owned[n], owns ? 1 : 0) << what << " row " << n << " target " << t;
      if (owns) EXPECT_EQ(bc::float_bits(shard.target_logit[n]), bc::float_bits(y_of(t))) << what << " row " << n;
    }
  }
}

TEST(TensorParallel, MergeRefusesATargetOwnedByNoShard) {
  // Only the first two shards of three: targets in the third are owned by nobody.
  const Problem p = tp_problem(2112, 2053, 35);
  std::vector<Shard> shards(2);
  shards[0].start = 0, shards[0].count = 128;
  shards[1].start = 128, shards[1].count = 896;
  for (auto& s : shards) s.run(p);
  expect_merge_refused(p, shards, {"the shards cover vocab ids [0, 1024) but real_vocab=2053"}, "two of three shards");
}

TEST(TensorParallel, PartialsRecordTheirLayout) {
  const Problem p = tp_problem(2112, 2053, 40);
  std::vector<Shard> shards = shards_of(p, {0, 1024, 2112});
  for (size_t r = 0; r < shards.size(); ++r) {
    const detlogp::PartialsLayout& l = shards[r].partials.layout;
    EXPECT_EQ(l.vocab_start, shards[r].start) << "rank " << r;
    EXPECT_EQ(l.vocab_local, shards[r].count) << "rank " << r;
    EXPECT_EQ(l.real_vocab, 2053) << "rank " << r;
    EXPECT_EQ(l.ignore_index, p.ignore_index) << "rank " << r;
    EXPECT_EQ(l.targets_digest, shards[0].partials.layout.targets_digest) << "rank " << r;
    EXPECT_EQ(l.temperature_digest, shards[0].partials.layout.temperature_digest) << "rank " << r;
    EXPECT_EQ(l.backend_digest, shards[0].partials.layout.backend_digest) << "rank " << r;
  }
  // The digests follow the values: one target, one row temperature, the scalar under rows (unused).
  Problem other = p;
  other.targets[7] = (other.targets[7] + 1) % other.real_vocab;
  Shard a;
  a.start = 0, a.count = 1024;
  a.run(other);
  EXPECT_NE(a.partials.layout.targets_digest, shards[0].partials.layout.targets_digest);
  EXPECT_EQ(a.partials.layout.temperature_digest, shards[0].partials.layout.temperature_digest);
  other = p;
  other.temperature_rows[3] = 2.0f;
  a.run(other);
  EXPECT_EQ(a.partials.layout.targets_digest, shards[0].partials.layout.targets_digest);
  EXPECT_NE(a.partials.layout.temperature_digest, shards[0].partials.layout.temperature_digest);
  other = p;
  other.temperature = 0.25f;  // not in effect: temperature_rows is present
  a.run(other);
  EXPECT_EQ(a.partials.layout.temperature_digest, shards[0].partials.layout.temperature_digest);
  // i32 targets with the same values: the same digest (targets are digested as int64 values).
  std::vector<int32_t> t32(p.targets.begin(), p.targets.end());
  detlogp::LinearLogpInputs in = p.inputs();
  in.targets = detlogp::TensorView::vector(t32.data(), detlogp::DType::i32, p.rows);
  a.run(p, in);
  EXPECT_EQ(a.partials.layout.targets_digest, shards[0].partials.layout.targets_digest);
}

TEST(TensorParallel, ARefusedPartialsCallRecordsNoLayout) {
  const Problem p = tp_problem(2112, 2053, 41);
  Shard shard;
  shard.start = 100;
  shard.count = 1000;
  detlogp::LinearLogpInputs in = p.inputs();
  in.temperature = 0.0f;  // outside the range
  EXPECT_THROW(shard.run(p, in), detlogp::Error);
  EXPECT_EQ(shard.partials.layout.vocab_local, 0);
}

TEST(TensorParallel, MergeRefusesShardsOutOfRankOrder) {
  const Problem p = tp_problem(2112, 2053, 42);
  std::vector<Shard> shards = shards_of(p, {0, 1024, 2112});
  std::swap(shards[0], shards[1]);
  expect_merge_refused(
      p, shards,
      {"rank 1 shard starts at vocab_start=0, before rank 0's vocab_start=1024", "ascending vocab_start order"},
      "swapped shards");
  // Three shards, the last two swapped.
  std::vector<Shard> three = shards_of(p, {0, 128, 1024, 2112});
  std::swap(three[1], three[2]);
  expect_merge_refused(p, three, {"rank 2 shard starts at vocab_start=128, before rank 1's vocab_start=1024"},
                       "three shards, last two swapped");
}

TEST(TensorParallel, MergeRefusesAGapOrAnOverlapNamingTheIds) {
  // Every target in [0, 64): each one still has exactly one owner, only the layout shows the
  // missing or doubled tiles (a merge without it returns another lse and no error).
  const Problem p = with_low_targets(tp_problem(2112, 2053, 43));
  std::vector<Shard> gap = shards_of(p, {0, 128});
  Shard tail;
  tail.start = 1024, tail.count = 1088;
  tail.run(p);
  gap.push_back(std::move(tail));
  expect_merge_refused(
      p, gap,
      {"rank 1 shard starts at vocab_start=1024 but rank 0 ends at 128", "vocab ids [128, 1024) are owned by no rank"},
      "gap");
  std::vector<Shard> overlap = shards_of(p, {0, 1088});
  Shard second;
  second.start = 1024, second.count = 1088;
  second.run(p);
  overlap.push_back(std::move(second));
  expect_merge_refused(p, overlap,
                       {"rank 1 shard starts at vocab_start=1024 but rank 0 ends at 1088",
                        "vocab ids [1024, 1088) are owned by two ranks"},
                       "overlap");
  std::vector<Shard> no_start = shards_of(p, {0, 1024, 2112});
  no_start.erase(no_start.begin());
  expect_merge_refused(p, no_start,
                       {"rank 0 shard starts at vocab_start=1024: vocab ids [0, 1024) are owned by no rank"},
                       "first shard missing");
}

TEST(TensorParallel, MergeRefusesTargetsOtherThanThoseOfThePartials) {
  const Problem p = tp_problem(2112, 2053, 44);
  std::vector<Shard> shards = shards_of(p, {0, 1024, 2112});
  std::vector<detlogp::ShardPartials> ranks;
  for (const auto& s : shards) ranks.push_back(s.partials);
  std::vector<int64_t> other = p.targets;
  other[6] = (other[6] + 1) % p.real_vocab;  // the same owner or not: either way not the partials' y_t
  expect_merge_refused(p, ranks, detlogp::TensorView::vector(other.data(), detlogp::DType::i64, p.rows), p.ignore_index,
                       {"targets differ from those the partials were computed with"}, "one other target");
  other = p.targets;
  other[2] = 5;  // an ignored row made a real one
  expect_merge_refused(p, ranks, detlogp::TensorView::vector(other.data(), detlogp::DType::i64, p.rows), p.ignore_index,
                       {"targets differ from those the partials were computed with"}, "an ignored row un-ignored");
  expect_merge_refused(p, ranks, detlogp::TensorView::vector(p.targets.data(), detlogp::DType::i64, p.rows), -1,
                       {"ignore_index=-1 differs from ignore_index=-100 the partials were computed with"},
                       "another ignore_index");
  // The same values as i32: accepted, and the TP = 1 bits.
  const Outputs single = run_linear_logp(p);
  std::vector<int32_t> t32(p.targets.begin(), p.targets.end());
  Outputs out(p.rows, p.vocab, false);
  auto views = out.views();
  detlogp::merge_partials(ranks, detlogp::TensorView::vector(t32.data(), detlogp::DType::i32, p.rows), p.ignore_index,
                          views.logp, views.lse);
  expect_identical(single, out, "i32 targets of the same values");
}

TEST(TensorParallel, MergeRefusesPartialsThatDisagree) {
  const Problem p = tp_problem(2112, 2053, 45);
  // Another real_vocab on rank 1.
  std::vector<Shard> shards = shards_of(p, {0, 1024, 2112});
  detlogp::LinearLogpInputs in = p.inputs();
  in.real_vocab = 2100;
  shards[1].run(p, in);
  expect_merge_refused(p, shards, {"ranks disagree on real_vocab: rank 0 has 2053, rank 1 has 2100"}, "real_vocab");
  // Another ignore_index on rank 0 (no row is ignored under it: only the layout differs).
  shards = shards_of(p, {0, 1024, 2112});
  in = p.inputs();
  in.ignore_index = -7;
  Problem no_ignored = p;
  no_ignored.targets[2] = 5;
  in.targets = detlogp::TensorView::vector(no_ignored.targets.data(), detlogp::DType::i64, p.rows);
  shards[0].run(p, in);
  expect_merge_refused(p, shards, {"ranks disagree on ignore_index: rank 0 has -7, rank 1 has -100"}, "ignore_index");
  // Other targets on rank 1.
  shards = shards_of(p, {0, 1024, 2112});
  shards[1].run(no_ignored);
  expect_merge_refused(p, shards, {"ranks disagree on targets (rank 0 and rank 1 digest them differently)"}, "targets");
  // Other temperatures on rank 1.
  shards = shards_of(p, {0, 1024, 2112});
  Problem hotter = p;
  hotter.temperature_rows[0] = 4.0f;
  shards[1].run(hotter);
  expect_merge_refused(p, shards, {"ranks disagree on temperatures (rank 0 and rank 1 digest them differently)"},
                       "temperatures");
  // Another backend or contract (one build serves CPU partials from one backend: the recorded
  // digest stands in for a rank served elsewhere).
  shards = shards_of(p, {0, 1024, 2112});
  shards[1].partials.layout.backend_digest ^= 1;
  expect_merge_refused(p, shards, {"ranks are served by different backends or contracts (rank 0 and rank 1)"},
                       "backend");
}

TEST(TensorParallel, MergeRefusesPartialsWithoutOrWithAMismatchedLayout) {
  const Problem p = tp_problem(2112, 2053, 46);
  std::vector<Shard> shards = shards_of(p, {0, 1024, 2112});
  shards[1].partials.layout = {};
  expect_merge_refused(p, shards, {"rank 1 partials carry no layout (layout.vocab_local=0)", "linear_logp_partials"},
                       "no layout");
  shards = shards_of(p, {0, 1024, 2112});
  shards[0].partials.layout.vocab_local = 960;
  expect_merge_refused(p, shards,
                       {"rank 0 partials have tiles=16 but their layout's shard [0, 960) has 15 whole tiles"},
                       "tiles against V_local");
  // A layout moved off the tile grid: the buffers no longer fit its geometry.
  shards = shards_of(p, {0, 1024, 2112});
  shards[1].partials.layout.vocab_start = 1000;
  shards[0].partials.layout.vocab_local = 1000;
  shards[0].partials.tiles = 15;
  expect_merge_refused(p, shards,
                       {"rank 0 partials have edge_lanes=0 but their layout's shard [0, 1000) has 40 edge lanes"},
                       "start off the tile grid");
  shards = shards_of(p, {0, 1024, 2112});
  shards[1].partials.layout.real_vocab = 0;
  expect_merge_refused(p, shards, {"rank 1 partials carry a layout with vocab_start=1024 and real_vocab=0"},
                       "no real_vocab");
}

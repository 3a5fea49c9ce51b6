// Tensor parallelism on the CPU: the simulated R-rank run, and hand-made vocab shards through
// linear_logp_partials + merge_partials, give the bits of the single-shard linear_logp; the
// partials themselves are the contract's tile summaries of the global tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;

namespace {

// One hand-made vocab shard [start, start + count) of p's weight, with its partials buffers.
struct Shard {
  int64_t start = 0, count = 0;
  std::vector<detlogp::TileSummary> summaries;
  std::vector<float> target_logit;
  std::vector<uint8_t> owned;
  detlogp::ShardPartials partials;

  detlogp::CallReport run(const Problem& p) {
    detlogp::LinearLogpInputs in = p.inputs();
    in.weight = detlogp::TensorView::matrix(p.weight.data() + start * p.dim, detlogp::DType::bf16, count, p.dim);
    if (!p.bias.empty()) in.bias = detlogp::TensorView::vector(p.bias.data() + start, detlogp::DType::f32, count);
    in.vocab_start = start;
    in.real_vocab = p.real_vocab;
    partials.rows = p.rows;
    partials.tiles = detlogp::shard_tiles(count);
    summaries.assign(static_cast<size_t>(p.rows * partials.tiles), {NAN, NAN});
    target_logit.assign(static_cast<size_t>(p.rows), NAN);
    owned.assign(static_cast<size_t>(p.rows), 77);
    partials.summaries = summaries.data();
    partials.target_logit = target_logit.data();
    partials.target_owned = owned.data();
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

TEST(TensorParallel, ShardStartNotOnATileBoundaryIsRefused) {
  const Problem p = tp_problem(2112, 2053, 33);
  Shard shard;
  shard.start = 100;
  shard.count = 1000;
  try {
    shard.run(p);
    FAIL() << "a shard starting at vocab id 100 was accepted";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_start"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("100"), std::string::npos) << e.what();
  }
  for (float x : shard.target_logit) EXPECT_TRUE(std::isnan(x)) << "partials written despite the error";
  for (uint8_t o : shard.owned) EXPECT_EQ(o, 77) << "partials written despite the error";
}

TEST(TensorParallel, ShardEndingInsideTheRealVocabAtANonTileBoundaryIsRefused) {
  // [0, 1000) of real_vocab 2053: its last tile would straddle two shards.
  const Problem p = tp_problem(2112, 2053, 34);
  Shard shard;
  shard.start = 0;
  shard.count = 1000;
  EXPECT_THROW(shard.run(p), detlogp::Error);
}

TEST(TensorParallel, MergeRefusesATargetOwnedByNoShard) {
  // Only the first two shards of three: targets in the third are owned by nobody.
  const Problem p = tp_problem(2112, 2053, 35);
  std::vector<Shard> shards(2);
  shards[0].start = 0, shards[0].count = 128;
  shards[1].start = 128, shards[1].count = 896;
  for (auto& s : shards) s.run(p);
  EXPECT_THROW(merge(p, shards), detlogp::Error);
}

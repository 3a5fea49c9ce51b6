// The sampling program (docs/contract.md §11) on the CPU backend: its pieces (the exact top-p
// threshold, the rank key, the uniform and the Gumbel noise, the masked tile summary), the
// properties of the two entries (bits independent of N, row position, chunking, threads and
// padding; every filter off gives logp == logp_raw == linear_logp's bits; the replay gives the
// rollout's bits), the filters' boundaries and ties on exact small-integer logits, the token
// frequencies against the processed distribution, and the refusals.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "core/grad_logits.hpp"
#include "core/sample.hpp"
#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_sample.hpp"
#include "detlogp/sample.hpp"
#include "sample_util.hpp"
#include "test_util.hpp"

namespace {

using namespace detlogp_test;
using namespace sample_test;
using detlogp::DType;
using detlogp::TensorView;
using detlogp::bitcmp::float_bits;

constexpr const char* kCpu = "cpu-linear-logp-contract-v1";

// ---------------------------------------------------------------- the pieces

// tau = ceil(Q * top_p) exactly: Q * m <= tau * 2^s and (tau - 1) * 2^s < Q * m, in 128-bit integers.
TEST(SampleCore, TopPThresholdIsTheExactCeiling) {
  Rng rng(3);
  const auto check = [](uint64_t q, float top_p) {
    const uint64_t tau = detlogp::top_p_threshold(q, top_p);
    const uint32_t b = detlogp::fp::bits(top_p);
    const uint32_t biased = b >> 23;
    const unsigned __int128 m = biased == 0 ? (b & 0x7FFFFFu) : ((b & 0x7FFFFFu) | 0x800000u);
    const int s = biased == 0 ? 149 : 150 - static_cast<int>(biased);
    const unsigned __int128 product = static_cast<unsigned __int128>(q) * m;
    if (s > 100) {  // Q * top_p < 2^-12: the ceiling is 1 (or 0 for Q = 0)
      EXPECT_EQ(tau, q == 0 ? 0u : 1u) << q << " " << top_p;
      return;
    }
    EXPECT_LE(product, static_cast<unsigned __int128>(tau) << s) << q << " " << top_p;
    if (tau > 0) {
      EXPECT_GT(product, static_cast<unsigned __int128>(tau - 1) << s) << q << " " << top_p;
    }
  };
  for (int i = 0; i < 200000; ++i) {
    const uint64_t q = rng.next() >> rng.below(64);
    float top_p = rng.next_unit_float();
    if (top_p == 0.0f) top_p = 1.0f;
    check(q, top_p);
    check(q, detlogp::fp::from_bits(static_cast<uint32_t>(rng.below(0x3F800001))));  // any float in (0, 1]
  }
  for (uint64_t q : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 40, ~uint64_t{0}, (uint64_t{1} << 63) + 12345})
    for (float top_p : {1.0f, 0.5f, 0x1p-149f, 0x1p-126f, 0.99999994f, 0x1.fffffep-64f, 0x1p-64f}) check(q, top_p);
  EXPECT_EQ(detlogp::top_p_threshold(uint64_t{1} << 42, 0.5f), uint64_t{1} << 41);
  EXPECT_EQ(detlogp::top_p_threshold(4, 0.3f), 2u);  // ceil(1.2000000476837158)
  EXPECT_EQ(detlogp::top_p_threshold(~uint64_t{0}, 1.0f), ~uint64_t{0});
}

TEST(SampleCore, RankKeyOrdersAsRankPrecedes) {
  const std::vector<float> ys = {-INFINITY, -3.5f, -0x1p-149f, -0.0f, 0.0f, 0x1p-149f, 1.0f, 2.5f, 3.4e38f};
  Rng rng(5);
  for (int i = 0; i < 20000; ++i) {
    const float ya = i < 10000 ? ys[static_cast<size_t>(rng.below(static_cast<int64_t>(ys.size())))]
                               : static_cast<float>(rng.normal() * 4.0);
    const float yb = i < 10000 ? ys[static_cast<size_t>(rng.below(static_cast<int64_t>(ys.size())))]
                               : (rng.below(4) == 0 ? ya : static_cast<float>(rng.normal() * 4.0));
    const int64_t ida = rng.below(1 << 24), idb = rng.below(4) == 0 ? ida : rng.below(1 << 24);
    EXPECT_EQ(detlogp::rank_precedes(ya, ida, yb, idb), detlogp::rank_key(ya, ida) > detlogp::rank_key(yb, idb))
        << ya << "@" << ida << " vs " << yb << "@" << idb;
  }
  EXPECT_EQ(detlogp::rank_key(-0.0f, 7), detlogp::rank_key(0.0f, 7));  // -0 and +0 are one value
}

// Every uniform is an odd multiple of 2^-24 strictly inside (0, 1), and the Gumbel noise of each of
// the 2^23 of them is within 2.5e-6 of float64's -log(-log(u)) (relative to max(1, |g|)).
TEST(SampleCore, UniformAndGumbelOverEveryValue) {
  double worst = 0;
  float lo = INFINITY, hi = -INFINITY;
  for (uint64_t r = 0; r < (uint64_t{1} << 23); ++r) {
    const float u = detlogp::sample_uniform(r << 41 | (r * 0x9E3779B9u & 0x1FFFFFFFFFFull));
    ASSERT_EQ(static_cast<double>(u), (2.0 * static_cast<double>(r) + 1.0) * 0x1p-24);
    ASSERT_GT(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    const float g = detlogp::sample_gumbel(u);
    const double ref = -std::log(-std::log(static_cast<double>(u)));
    worst = std::max(worst, std::fabs(static_cast<double>(g) - ref) / std::max(1.0, std::fabs(ref)));
    lo = std::min(lo, g);
    hi = std::max(hi, g);
  }
  EXPECT_LT(worst, 2.5e-6);
  EXPECT_NEAR(lo, -2.8115, 1e-3);  // u = 2^-24
  EXPECT_NEAR(hi, 16.6355, 1e-3);  // u = 1 - 2^-24
  std::printf("gumbel: max error %.3g (relative to max(1, |g|)), range [%.6g, %.6g]\n", worst, lo, hi);
}

TEST(SampleCore, LaneBitsAreABijectionOfTheId) {
  const uint64_t s = detlogp::sample_stream(7, 99);
  std::vector<uint64_t> bits;
  for (int64_t id = 0; id < 100000; ++id) bits.push_back(detlogp::sample_lane_bits(s, id));
  std::sort(bits.begin(), bits.end());
  EXPECT_EQ(std::adjacent_find(bits.begin(), bits.end()), bits.end());
  EXPECT_NE(detlogp::sample_stream(7, 99), detlogp::sample_stream(7, 100));
  EXPECT_NE(detlogp::sample_stream(7, 99), detlogp::sample_stream(8, 99));
}

// With the prefix mask of the real lanes the masked summary is tile_summary bit for bit; lanes
// outside the mask are never read (NaN there changes nothing).
TEST(SampleCore, MaskedTileSummaryIsTheContractSummary) {
  Rng rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    float y[64];
    for (float& v : y) v = static_cast<float>(rng.normal() * 5.0);
    const int real = static_cast<int>(rng.below(65));
    const uint64_t prefix = real == 64 ? ~uint64_t{0} : ((uint64_t{1} << real) - 1);
    const detlogp::TileSummary a = detlogp::tile_summary(y, real);
    const detlogp::TileSummary b = detlogp::tile_summary_masked(y, prefix);
    ASSERT_EQ(float_bits(a.max), float_bits(b.max));
    ASSERT_EQ(float_bits(a.sum), float_bits(b.sum));
    const uint64_t mask = rng.next();
    float poisoned_y[64];
    for (int v = 0; v < 64; ++v) poisoned_y[v] = ((mask >> v) & 1) ? y[v] : NAN;
    const detlogp::TileSummary c = detlogp::tile_summary_masked(y, mask);
    const detlogp::TileSummary d = detlogp::tile_summary_masked(poisoned_y, mask);
    ASSERT_EQ(float_bits(c.max), float_bits(d.max));
    ASSERT_EQ(float_bits(c.sum), float_bits(d.sum));
  }
}

// A tile with one real lane, at each of the 64 places, over ordinary, huge, tiny, signed-zero,
// infinite and NaN logits (quiet NaNs with payloads and signs too): the one-lane summary is the
// masked summary bit for bit.
TEST(SampleCore, OneLaneTileSummaryIsTheMaskedSummary) {
  Rng rng(12);
  std::vector<float> values{0.0f, -0.0f, 1.0f, -1.0f, 3.0e38f, -3.0e38f, 1.0e-45f, -1.0e-45f, INFINITY, -INFINITY};
  for (uint32_t nan_bits : {0x7FC00000u, 0xFFC00000u, 0x7FC01234u, 0xFFFFFFFFu, 0x7F800001u}) {
    float f;
    std::memcpy(&f, &nan_bits, sizeof f);
    values.push_back(f);
  }
  for (int i = 0; i < 4000; ++i) values.push_back(static_cast<float>(rng.normal() * (i % 2 ? 80.0 : 3.0)));
  for (size_t i = 0; i < values.size(); ++i) {
    const int place = static_cast<int>(i % 64);
    float y[64];
    for (float& v : y) v = NAN;  // lanes outside the mask are not read
    y[place] = values[i];
    const detlogp::TileSummary a = detlogp::tile_summary_masked(y, uint64_t{1} << place);
    const detlogp::TileSummary b = detlogp::tile_summary_one_lane(values[i]);
    ASSERT_EQ(float_bits(a.max), float_bits(b.max)) << "y = " << values[i] << " at lane " << place;
    ASSERT_EQ(float_bits(a.sum), float_bits(b.sum)) << "y = " << values[i] << " at lane " << place;
  }
}

// ---------------------------------------------------------------- the entries' properties

TEST(Sample, EveryFilterOffGivesLinearLogpsBits) {
  Problem p = random_problem(37, 333, 1);
  p.temperature_rows.resize(static_cast<size_t>(p.rows));
  for (int64_t n = 0; n < p.rows; ++n) p.temperature_rows[static_cast<size_t>(n)] = 0.25f + 0.125f * (n % 11);
  Program prog;
  prog.temperature_rows = p.temperature_rows;
  const Drawn d = draw(p, prog, row_keys(p.rows), true);
  EXPECT_EQ(d.report.provenance.sample_id, detlogp::kSampleId);
  Problem scored = p;
  for (int64_t n = 0; n < p.rows; ++n) {
    ASSERT_GE(d.token[n], 0);
    scored.targets[static_cast<size_t>(n)] = d.token[n];
    EXPECT_EQ(d.support_size[n], p.real_vocab);
  }
  const Outputs ref = run_linear_logp(scored, true);
  EXPECT_TRUE(detlogp::bitcmp::compare(d.logp, d.logp_raw)) << "logp == logp_raw with every filter off";
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.logp, d.logp_raw))
      << detlogp::bitcmp::compare(ref.logp, d.logp_raw).describe("logp_raw");
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.lse, d.lse));
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.logits, d.logits)) << "the serving logits";
  // The replay with every filter off: logp == logp_raw == linear_logp's, lse_support == lse.
  const Replayed r = replay(scored, prog);
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.logp, r.logp));
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.logp, r.logp_raw));
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.lse, r.lse));
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.lse, r.lse_support));
  EXPECT_EQ(r.report.sampling.outside_support, 0);
}

TEST(Sample, ReplayGivesTheRolloutsBits) {
  Problem p = random_problem(64, 700, 2);
  const Program prog = varied_program(p.rows);
  const Drawn d = draw(p, prog, row_keys(p.rows, 1000));
  Problem scored = p;
  for (int64_t n = 0; n < p.rows; ++n) scored.targets[static_cast<size_t>(n)] = d.token[n];
  const Replayed r = replay(scored, prog);
  EXPECT_TRUE(detlogp::bitcmp::compare(d.logp, r.logp)) << detlogp::bitcmp::compare(d.logp, r.logp).describe("logp");
  EXPECT_TRUE(detlogp::bitcmp::compare(d.logp_raw, r.logp_raw));
  EXPECT_TRUE(detlogp::bitcmp::compare(d.lse, r.lse));
  EXPECT_EQ(d.support_size, r.support_size);
  EXPECT_EQ(r.report.sampling.outside_support, 0);
  // logp_raw is linear_logp's at each row's temperature (1 for the greedy rows).
  scored.temperature_rows = prog.temperature_rows;
  for (float& t : scored.temperature_rows) t = t == 0.0f ? 1.0f : t;
  const Outputs ref = run_linear_logp(scored);
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.logp, d.logp_raw));
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.lse, d.lse));
  int64_t filtered = 0;
  for (int64_t n = 0; n < p.rows; ++n) {
    filtered += d.support_size[n] < p.real_vocab;
    EXPECT_GE(d.logp[n], d.logp_raw[n]) << "row " << n << ": renormalizing over the support raises logp";
  }
  EXPECT_GT(filtered, p.rows / 2) << "the program must actually filter most rows";
}

TEST(Sample, BitsDoNotDependOnBatchPositionChunksThreadsOrPadding) {
  Problem p = random_problem(41, 517, 3);
  const Program prog = varied_program(p.rows);
  Keys keys = row_keys(p.rows, 50);
  keys.seed_rows.resize(static_cast<size_t>(p.rows));
  for (int64_t n = 0; n < p.rows; ++n) keys.seed_rows[static_cast<size_t>(n)] = static_cast<int64_t>(0x9E37ull * n + 1);
  const Drawn base = draw(p, prog, keys);

  // Rows reordered, duplicated and embedded in another batch.
  std::vector<int64_t> picks = {40, 3, 3, 17, 0, 22, 39, 8};
  const Problem sub = p.select_rows(picks);
  Keys sub_keys;
  for (int64_t i : picks) {
    sub_keys.key.push_back(keys.key[static_cast<size_t>(i)]);
    sub_keys.seed_rows.push_back(keys.seed_rows[static_cast<size_t>(i)]);
  }
  const Drawn d = draw(sub, prog.select_rows(picks), sub_keys);
  for (size_t i = 0; i < picks.size(); ++i) {
    const int64_t n = picks[i];
    EXPECT_EQ(d.token[i], base.token[static_cast<size_t>(n)]) << "row " << n;
    EXPECT_EQ(float_bits(d.logp[i]), float_bits(base.logp[static_cast<size_t>(n)])) << "row " << n;
    EXPECT_EQ(float_bits(d.logp_raw[i]), float_bits(base.logp_raw[static_cast<size_t>(n)])) << "row " << n;
    EXPECT_EQ(d.support_size[i], base.support_size[static_cast<size_t>(n)]) << "row " << n;
  }
  for (int64_t chunk : {1, 5, 16})
    expect_same_bits(base, draw_in_chunks(p, prog, keys, chunk), "chunk of " + std::to_string(chunk) + " rows");
  for (const char* threads : {"1", "3"}) {
    ScopedEnv env("DETLOGP_CPU_THREADS", threads);
    expect_same_bits(base, draw(p, prog, keys), std::string("threads ") + threads);
  }
  // Padding weight rows beyond real_vocab (with wild values) change nothing.
  Problem padded = p;
  padded.vocab = p.vocab + 75;
  padded.real_vocab = p.vocab;
  padded.weight.resize(static_cast<size_t>(padded.vocab * p.dim), bf16_round(1e30f));
  padded.bias.resize(static_cast<size_t>(padded.vocab), 1e30f);
  expect_same_bits(base, draw(padded, prog, keys), "padding");
  // The scalar seed is every row's seed.
  Keys scalar = keys;
  scalar.seed_rows.assign(static_cast<size_t>(p.rows), static_cast<int64_t>(scalar.seed));
  Keys unset = keys;
  unset.seed_rows.clear();
  expect_same_bits(draw(p, prog, scalar), draw(p, prog, unset), "scalar seed");
}

// The row program over given logits (what a device backend's bits are checked against) is the
// entry's program over its own serving logits.
TEST(Sample, TheProgramOverGivenLogitsIsTheEntrysProgram) {
  Problem p = random_problem(19, 400, 14);
  const Program prog = varied_program(p.rows);
  const Keys keys = row_keys(p.rows, 3);
  const Drawn base = draw(p, prog, keys, true);
  Drawn again;
  const detlogp::SampleOutputs o = sample_views(again, p.rows, p.vocab, false);
  detlogp::detail::cpu_sample_from_logits(detlogp::detail::make_sample_problem(sample_inputs(p, prog, keys), o),
                                          base.logits.data());
  expect_same_bits(base, again, "from logits");
}

// The SM90-emulated backend runs the same program over its own (wgmma-model) serving logits: the
// bits an SM90 sampling entry must give, on the host.
TEST(Sample, TheSm90EmulatedBackendRunsTheProgramOverItsOwnLogits) {
  Problem p = random_problem(23, 300, 40);
  const Program prog = varied_program(p.rows);
  const Keys keys = row_keys(p.rows, 5);
  detlogp::CallOptions emulated;
  emulated.backend = "cpu-sm90-emulated-contract-v1";
  Drawn base;
  const detlogp::SampleOutputs o = sample_views(base, p.rows, p.vocab, true);
  base.report = detlogp::sample(sample_inputs(p, prog, keys), o, emulated);
  EXPECT_EQ(base.report.provenance.backend_id, "cpu-sm90-emulated-contract-v1");
  EXPECT_EQ(base.report.provenance.sample_id, "sample/v1");
  // Its logits are the emulated serving entry's, and the program over them is the entry's.
  std::vector<float> logits(static_cast<size_t>(p.rows * p.vocab)), lp(static_cast<size_t>(p.rows)),
      ls(static_cast<size_t>(p.rows));
  detlogp::LinearLogpInputs in = p.inputs();
  detlogp::LinearLogpOutputs lo;
  lo.logp = detlogp::mutable_vector(lp.data(), DType::f32, p.rows);
  lo.lse = detlogp::mutable_vector(ls.data(), DType::f32, p.rows);
  lo.logits = detlogp::mutable_matrix(logits.data(), DType::f32, p.rows, p.vocab);
  detlogp::linear_logp(in, lo, emulated);
  EXPECT_TRUE(detlogp::bitcmp::compare(base.logits, logits))
      << detlogp::bitcmp::compare(base.logits, logits).describe("the sampling entry's logits vs the serving entry's");
  Drawn again;
  const detlogp::SampleOutputs o2 = sample_views(again, p.rows, p.vocab, false);
  detlogp::detail::cpu_sample_from_logits(detlogp::detail::make_sample_problem(sample_inputs(p, prog, keys), o2),
                                          logits.data());
  expect_same_bits(base, again, "emulated from its logits");
  // The wgmma K walk differs from the CPU's fp32 chain somewhere on random rows.
  const Drawn cpu = draw(p, prog, keys, true);
  EXPECT_FALSE(detlogp::bitcmp::compare(cpu.logits, base.logits));
}

TEST(Sample, TheKeyAndTheSeedDrawDifferentTokens) {
  Problem p = random_problem(1, 200, 4, 0.5);  // a flat row: many likely tokens
  Program prog;
  std::map<int64_t, int> seen;
  for (int64_t key = 0; key < 64; ++key) {
    Keys k = row_keys(1, key);
    seen[draw(p, prog, k).token[0]]++;
  }
  EXPECT_GT(seen.size(), 30u);
  Keys a = row_keys(1, 5), b = row_keys(1, 5);
  b.seed = a.seed + 1;
  int differ = 0;
  for (int64_t key = 0; key < 32; ++key) {
    a.key[0] = b.key[0] = key;
    differ += draw(p, prog, a).token[0] != draw(p, prog, b).token[0];
  }
  EXPECT_GT(differ, 20);
}

// ---------------------------------------------------------------- boundaries and ties

TEST(SampleFilters, GreedyTakesTheLowestIdOfTheMaximum) {
  Problem p = exact_logits({{1, 7, 3, 7, 7, -2}, {0, 0, 0, 0, 0, 0}, {-0.0f, 0.0f, -5, -1, -0.0f, 0.0f}});
  Program prog;
  prog.temperature = 0.0f;
  prog.top_p = 0.3f;  // checked, no effect
  prog.min_p = 0.5f;
  const Drawn d = draw(p, prog, row_keys(3));
  EXPECT_EQ(d.token, (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(d.support_size, (std::vector<int64_t>{1, 1, 1}));
  for (int n = 0; n < 3; ++n) EXPECT_EQ(float_bits(d.logp[n]), 0u) << "greedy logp is +0";
  Problem scored = p;
  scored.targets = d.token;
  const Outputs ref = run_linear_logp(scored);  // T = 1
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.logp, d.logp_raw));
  EXPECT_TRUE(detlogp::bitcmp::compare(ref.lse, d.lse));
  // The replay: +0 for the greedy token, -inf (counted) for another maximum.
  scored.targets = {1, 0, 5};
  const Replayed r = replay(scored, prog);
  EXPECT_EQ(float_bits(r.logp[0]), 0u);
  EXPECT_EQ(float_bits(r.logp[1]), 0u);
  EXPECT_EQ(r.logp[2], -INFINITY);
  EXPECT_EQ(r.report.sampling.outside_support, 1);
  EXPECT_EQ(r.report.sampling.first_outside_support, 2);
}

TEST(SampleFilters, TopKBoundaryTiesGoToTheLowerIds) {
  Problem p = exact_logits({{3, 5, 5, 1, 5, 5}});
  Program prog;
  prog.top_k = 2;
  std::map<int64_t, int> seen;
  for (int64_t key = 0; key < 200; ++key) seen[draw(p, prog, row_keys(1, key)).token[0]]++;
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[1], 60);
  EXPECT_GT(seen[2], 60);
  const Drawn d = draw(p, prog, row_keys(1));
  EXPECT_EQ(d.support_size[0], 2);
  // Two equal lanes: lse_Sigma = fl(5 + logc(2)), logp = fl(5 - lse_Sigma) exactly.
  const float lse_support = detlogp::fp::add(5.0f, detlogp::logc(2.0f));
  EXPECT_EQ(float_bits(d.logp[0]), float_bits(detlogp::fp::sub(5.0f, lse_support)));
  Problem scored = p;
  for (int64_t t : {1, 2, 4, 0}) {
    scored.targets = {t};
    const Replayed r = replay(scored, prog);
    EXPECT_EQ(float_bits(r.lse_support[0]), float_bits(lse_support));
    if (t == 1 || t == 2) {
      EXPECT_EQ(float_bits(r.logp[0]), float_bits(d.logp[0])) << t;
      EXPECT_EQ(r.report.sampling.outside_support, 0);
    } else {
      EXPECT_EQ(r.logp[0], -INFINITY) << t;
      EXPECT_EQ(r.report.sampling.outside_support, 1);
    }
    EXPECT_EQ(r.cut_id[0], 2);
    EXPECT_EQ(r.cut_logit[0], 5.0f);
  }
  prog.top_k = 6;  // = V: off
  EXPECT_EQ(draw(p, prog, row_keys(1)).support_size[0], 6);
  prog.top_k = 1000;  // beyond V: every lane
  EXPECT_EQ(draw(p, prog, row_keys(1)).support_size[0], 6);
}

// Four equal lanes carry 1/4 each: top_p = 1/2 reaches the threshold exactly after two of them, the
// next float above 1/2 needs a third; ties go to the lower ids. With top_k = 2 first, top-p's mass is
// renormalized over those two, so 1/2 keeps one lane.
TEST(SampleFilters, TopPBoundaryIsTheSmallestPrefixReachingTheMass) {
  Problem p = exact_logits({{2, 2, 2, 2, -100}});
  Program prog;
  Problem scored = p;
  const auto support = [&](const Program& q) {
    const Drawn d = draw(p, q, row_keys(1));
    std::vector<int64_t> in;
    for (int64_t t = 0; t < p.vocab; ++t) {
      scored.targets = {t};
      if (replay(scored, q).logp[0] != -INFINITY) in.push_back(t);
    }
    EXPECT_EQ(static_cast<int64_t>(in.size()), d.support_size[0]);
    EXPECT_TRUE(std::find(in.begin(), in.end(), d.token[0]) != in.end()) << "the token is in the support";
    return in;
  };
  prog.top_p = 0.5f;
  EXPECT_EQ(support(prog), (std::vector<int64_t>{0, 1}));
  prog.top_p = std::nextafter(0.5f, 1.0f);
  EXPECT_EQ(support(prog), (std::vector<int64_t>{0, 1, 2}));
  prog.top_p = 0.25f;
  EXPECT_EQ(support(prog), (std::vector<int64_t>{0}));
  prog.top_p = 0x1p-149f;
  EXPECT_EQ(support(prog), (std::vector<int64_t>{0}));
  prog.top_p = std::nextafter(1.0f, 0.0f);  // the lane at -100 has mass 0: never needed
  EXPECT_EQ(support(prog), (std::vector<int64_t>{0, 1, 2, 3}));
  prog.top_p = 1.0f;  // off: every lane, the zero-mass one too
  EXPECT_EQ(support(prog), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  prog.top_k = 2;
  prog.top_p = 0.5f;
  EXPECT_EQ(support(prog), (std::vector<int64_t>{0}));
  prog.top_p = std::nextafter(0.5f, 1.0f);
  EXPECT_EQ(support(prog), (std::vector<int64_t>{0, 1}));
}

// min_p keeps e_v >= min_p, one fp32 comparison: exactly at a lane's weight it stays, one float
// above it goes. Min-p comes after top-p (it does not change top-p's mass).
TEST(SampleFilters, MinPBoundaryIsOneComparison) {
  Problem p = exact_logits({{0, -1, -2, -3, 0.5f}});
  Problem scored = p;
  const float m = 0.5f;
  const float e2 = detlogp::relative_weight(-2.0f, m);
  Program prog;
  const auto support_size = [&](const Program& q) { return draw(p, q, row_keys(1)).support_size[0]; };
  prog.min_p = e2;
  EXPECT_EQ(support_size(prog), 4);  // 0.5, 0, -1, -2
  prog.min_p = std::nextafter(e2, 1.0f);
  EXPECT_EQ(support_size(prog), 3);
  scored.targets = {2};
  EXPECT_EQ(replay(scored, prog).logp[0], -INFINITY);
  prog.min_p = std::nextafter(1.0f, 0.0f);  // only the maximum
  EXPECT_EQ(support_size(prog), 1);
  // Temperature first: at T = 2 the weights are e^{(y - M)/2}, so lane -2 comes back.
  prog.min_p = std::nextafter(e2, 1.0f);
  prog.temperature = 2.0f;
  EXPECT_EQ(support_size(prog), 5);
  // top-p, then min-p: the weights are 1 (lane 4), 0.61, 0.22, 0.08, 0.03 of 1.94; top_p = 0.6 keeps
  // lanes 4 and 0, min-p = 0.5 keeps both, 0.7 drops lane 0 (top-p's mass is not recomputed).
  prog.temperature = 1.0f;
  prog.top_p = 0.6f;
  prog.min_p = 0.5f;
  EXPECT_EQ(support_size(prog), 2);
  prog.min_p = 0.7f;
  EXPECT_EQ(support_size(prog), 1);
  prog.top_p = 0.5f;
  prog.min_p = 0.0f;
  EXPECT_EQ(support_size(prog), 1);
}

// ---------------------------------------------------------------- statistics

// Token frequencies over many keys at one seed against the processed distribution, from the
// replay's logp of every lane (-inf outside the support): Pearson's chi-square below a fixed
// threshold (about the 1e-4 tail for the support's degrees of freedom).
TEST(SampleStatistics, TokenFrequenciesMatchTheProcessedDistribution) {
  const std::vector<float> z = {1.5f, 0.25f, -0.5f, 2.0f, 0.0f, -1.0f, 1.0f, 2.0f, -3.0f, 0.5f, -0.25f, 1.25f};
  std::vector<Program> cases(3);
  cases[0].temperature = 0.7f;  // no filter
  cases[1].temperature = 1.3f;
  cases[1].top_k = 8;
  cases[1].top_p = 0.9f;
  cases[1].min_p = 0.1f;
  cases[2].top_k = 3;  // lanes 3 and 7 tie at 2.0, then lane 0
  // The chi-square distribution's 1 - 1e-4 quantile for 1..11 degrees of freedom.
  const double quantile[] = {0, 15.14, 18.42, 21.11, 23.51, 25.74, 27.86, 29.88, 31.83, 33.72, 35.56, 37.37};
  const int64_t draws = 60000;
  for (const Program& prog : cases) {
    Problem p = exact_logits({z});
    p = p.select_rows(std::vector<int64_t>(static_cast<size_t>(draws), 0));
    const Drawn d = draw(p, prog, row_keys(draws, 7));
    std::vector<double> count(z.size(), 0.0);
    for (int64_t t : d.token) count[static_cast<size_t>(t)] += 1;
    Problem one = exact_logits({z});
    std::vector<double> prob(z.size(), 0.0);
    double total = 0;
    for (size_t t = 0; t < z.size(); ++t) {
      one.targets = {static_cast<int64_t>(t)};
      const float lp = replay(one, prog).logp[0];
      prob[t] = lp == -INFINITY ? 0.0 : std::exp(static_cast<double>(lp));
      total += prob[t];
    }
    EXPECT_NEAR(total, 1.0, 1e-5);
    double chi2 = 0;
    int support = 0;
    for (size_t t = 0; t < z.size(); ++t) {
      if (prob[t] == 0) {
        EXPECT_EQ(count[t], 0) << "a token outside the support was drawn: " << t;
        continue;
      }
      ++support;
      const double expect = prob[t] * static_cast<double>(draws);
      chi2 += (count[t] - expect) * (count[t] - expect) / expect;
    }
    EXPECT_EQ(support, d.support_size[0]);
    ASSERT_GE(support, 2);
    EXPECT_LT(chi2, quantile[support - 1]) << "support " << support;
    std::printf("chi-square %.2f over %d lanes (threshold %.2f)\n", chi2, support, quantile[support - 1]);
  }
}

// ---------------------------------------------------------------- rows without a distribution, errors

TEST(SampleRows, NanAndAllNegativeInfinityRowsHaveNoToken) {
  Problem p = random_problem(4, 130, 6);
  p.hidden[1 * p.dim + 5] = 0x7FC0;  // row 1: NaN
  const Drawn d = draw(p, varied_program(p.rows), row_keys(p.rows));
  EXPECT_EQ(d.token[1], detlogp::kNoToken);
  EXPECT_EQ(d.support_size[1], 0);
  EXPECT_EQ(float_bits(d.logp[1]), detlogp::kCanonicalNanBits);
  EXPECT_EQ(float_bits(d.logp_raw[1]), detlogp::kCanonicalNanBits);
  EXPECT_EQ(float_bits(d.lse[1]), detlogp::kCanonicalNanBits);
  for (int n : {0, 2, 3}) EXPECT_GE(d.token[n], 0);
  Problem scored = p;
  scored.targets = {d.token[0], 3, -100, d.token[3]};
  const Replayed r = replay(scored, varied_program(p.rows));
  EXPECT_EQ(float_bits(r.logp[1]), detlogp::kCanonicalNanBits);
  EXPECT_EQ(float_bits(r.logp[2]), 0u) << "ignored row";
  EXPECT_EQ(float_bits(r.logp_raw[2]), 0u) << "ignored row";
  EXPECT_EQ(r.report.sampling.outside_support, 0);
  Problem neg = exact_logits({{0, 1}});
  neg.bias = {-INFINITY, -INFINITY};
  const Drawn dn = draw(neg, Program{}, row_keys(1));
  EXPECT_EQ(dn.token[0], detlogp::kNoToken);
  EXPECT_EQ(dn.lse[0], -INFINITY);
}

TEST(SampleRows, ATargetOutsideTheSupportIsMinusInfinityAndCounted) {
  Problem p = random_problem(12, 300, 7);
  Program prog;
  prog.top_k = 5;
  for (int64_t n = 0; n < p.rows; ++n) p.targets[static_cast<size_t>(n)] = (n * 37) % p.vocab;
  const Replayed r = replay(p, prog);
  int64_t outside = 0, first = -1;
  for (int64_t n = 0; n < p.rows; ++n) {
    if (r.logp[n] == -INFINITY) {
      if (first < 0) first = n;
      ++outside;
    } else {
      EXPECT_TRUE(std::isfinite(r.logp[n]));
    }
    EXPECT_TRUE(std::isfinite(r.logp_raw[n]));
  }
  EXPECT_GT(outside, 5);
  EXPECT_EQ(r.report.sampling.outside_support, outside);
  EXPECT_EQ(r.report.sampling.first_outside_support, first);
}

void expect_refused(const std::function<void()>& call, const std::string& message) {
  try {
    call();
    ADD_FAILURE() << "not refused; expected: " << message;
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

TEST(SampleErrors, BadParametersNameTheArgumentRowAndValueAndWriteNothing) {
  Problem p = random_problem(6, 100, 8);
  const Keys keys = row_keys(p.rows);
  struct Bad {
    std::function<void(Program&)> set;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {[](Program& q) { q.top_p = 0.0f; }, "top_p=0 is outside (0, 1]"},
      {[](Program& q) { q.top_p = 1.5f; }, "top_p=1.5 is outside (0, 1]"},
      {[](Program& q) { q.top_p = NAN; }, "top_p=nan is outside (0, 1]"},
      {[](Program& q) { q.top_k = -1; }, "top_k=-1 must be >= 0"},
      {[](Program& q) { q.min_p = 1.0f; }, "min_p=1 is outside [0, 1)"},
      {[](Program& q) { q.min_p = -0.5f; }, "min_p=-0.5 is outside [0, 1)"},
      {[](Program& q) { q.temperature = -1.0f; }, "temperature=-1 is outside the sampling temperature range"},
      {[](Program& q) { q.temperature = NAN; }, "temperature=nan is outside the sampling temperature range"},
      {[](Program& q) { q.temperature = 1e-39f; }, "temperature=1e-39 is outside"},
      {[](Program& q) { q.temperature_rows = {1, 1, 1, -2, 1, 1}; }, "temperature_rows[3]=-2 is outside"},
      {[](Program& q) { q.top_k_rows = {0, 0, 0, 0, -7, 0}; }, "top_k_rows[4]=-7 must be >= 0"},
      {[](Program& q) { q.top_p_rows = {1, 0, 1, 1, 1, 1}; }, "top_p_rows[1]=0 is outside (0, 1]"},
      {[](Program& q) { q.min_p_rows = {0, 0, 0, 0, 0, NAN}; }, "min_p_rows[5]=nan is outside [0, 1)"},
      {[](Program& q) {
         q.top_p_rows = {1, 1, 1};
       },
       "top_p_rows has 3 elements, expected 6"},
  };
  for (const Bad& b : bad) {
    Program prog;
    b.set(prog);
    Drawn d;
    const detlogp::SampleOutputs o = sample_views(d, p.rows, p.vocab, true);
    expect_refused([&] { detlogp::sample(sample_inputs(p, prog, keys), o, cpu_backend_options()); }, b.message);
    EXPECT_TRUE(untouched(d)) << b.message;
    expect_refused([&] { replay(p, prog); }, b.message);
  }
  // Seeds, keys, outputs and the limits of the entries.
  Program prog;
  Drawn d;
  detlogp::SampleOutputs o = sample_views(d, p.rows, p.vocab, false);
  Keys short_key = keys;
  short_key.key.resize(2);
  expect_refused([&] { detlogp::sample(sample_inputs(p, prog, short_key), o, cpu_backend_options()); },
                 "key has 2 elements, expected 6");
  o.token = detlogp::mutable_vector(d.logp.data(), DType::f32, p.rows);
  expect_refused([&] { detlogp::sample(sample_inputs(p, prog, keys), o, cpu_backend_options()); },
                 "token must be i64, got f32");
  Problem big = p;
  big.real_vocab = (int64_t{1} << 24) + 1;
  expect_refused([&] { replay(big, prog); }, "larger than the sampling program's limit 2^24");
  // The replay's temperature is the program's.
  Problem hot = p;
  hot.temperature = 2.0f;
  detlogp::SampledLogpOutputs so;
  std::vector<float> a(6), b(6), c(6);
  so.logp = detlogp::mutable_vector(a.data(), DType::f32, 6);
  so.logp_raw = detlogp::mutable_vector(b.data(), DType::f32, 6);
  so.lse = detlogp::mutable_vector(c.data(), DType::f32, 6);
  expect_refused([&] { detlogp::linear_logp(hot.inputs(), prog.view(), so, cpu_backend_options()); },
                 "with a sampling program the temperature is the program's");
  // A backend without the program refuses it by name.
  detlogp::CallOptions ref;
  ref.backend = "reference-materialized";
  expect_refused([&] { detlogp::sample(sample_inputs(p, prog, keys), o, ref); },
                 "'reference-materialized' does not run the sampling program");
}

TEST(SampleErrors, AcceptedBoundaryValues) {
  Problem p = random_problem(2, 80, 9);
  Program prog;
  prog.temperature_rows = {0.0f, detlogp::kMaxTemperature};
  prog.top_p = 0x1p-149f;
  prog.min_p = std::nextafter(1.0f, 0.0f);
  prog.top_k = int64_t{1} << 40;
  const Drawn d = draw(p, prog, row_keys(2));
  EXPECT_EQ(d.support_size, (std::vector<int64_t>{1, 1}));
}

// ---------------------------------------------------------------- the replay's logit gradient

// dz of the replay, in two vocabulary chunks, against float64 of the same formula on the serving
// logits: dL/dy = onehot(t) (g + g_raw) - g [y in support] e^{y - lse_support} + (g_lse - g_raw) e^{y - lse}.
// The columns the backward counts in the support are the forward's support_size, row by row.
TEST(SampleGrad, TheReplaysGradientHoldsTheSupportFixed) {
  Problem p = random_problem(23, 300, 12);
  const Program prog = varied_program(p.rows);
  for (int64_t n = 0; n < p.rows; ++n) p.targets[static_cast<size_t>(n)] = (n * 41) % p.vocab;
  p.targets[5] = detlogp::kDefaultIgnoreIndex;
  const Replayed r = replay(p, prog);
  ASSERT_GT(r.report.sampling.outside_support, 0);
  const Drawn logits = draw(p, prog, row_keys(p.rows), true);  // the serving logits z
  Rng rng(13);
  std::vector<float> g(static_cast<size_t>(p.rows)), gs(g.size()), gr(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = static_cast<float>(rng.normal());
    gs[i] = static_cast<float>(rng.normal());
    gr[i] = static_cast<float>(rng.normal());
  }
  const auto vec = [&](const auto& v, DType t) { return TensorView::vector(v.data(), t, p.rows); };
  detlogp::SampledGradArgs args;
  args.logp = vec(r.logp, DType::f32);
  args.lse = vec(r.lse, DType::f32);
  args.lse_support = vec(r.lse_support, DType::f32);
  args.support_max = vec(r.support_max, DType::f32);
  args.cut_logit = vec(r.cut_logit, DType::f32);
  args.cut_id = vec(r.cut_id, DType::i64);
  args.g_logp = vec(g, DType::f32);
  args.g_lse = vec(gs, DType::f32);
  args.g_logp_raw = vec(gr, DType::f32);
  std::vector<uint16_t> dz(static_cast<size_t>(p.rows * p.vocab), 0xFFFF);
  for (const auto& [c0, c1] : {std::pair<int64_t, int64_t>{0, 200}, {200, p.vocab}}) {
    detlogp::LinearLogpInputs in = p.shard_inputs(c0, c1 - c0);
    in.real_vocab = p.real_vocab;
    detlogp::MutableTensorView out{
        TensorView::matrix(dz.data() + c0, DType::bf16, p.rows, c1 - c0, detlogp::Memory::host, p.vocab)};
    detlogp::linear_logp_grad_logits(in, prog.view(), args, out);
  }
  double worst = 0;
  for (int64_t n = 0; n < p.rows; ++n) {
    const detlogp::SampleRowParams prm = detlogp::detail::ProgramOperands{prog.temperature,
                                                                          prog.temperature_rows.data(),
                                                                          0,
                                                                          prog.top_k_rows.data(),
                                                                          true,
                                                                          1.0f,
                                                                          prog.top_p_rows.data(),
                                                                          0.0f,
                                                                          prog.min_p_rows.data()}
                                             .row(n, p.real_vocab);
    const detlogp::SupportRow support{r.support_max[n], {r.cut_logit[n], r.cut_id[n]}, prm.min_p};
    const int64_t t = p.targets[static_cast<size_t>(n)];
    const bool ignored = t == detlogp::kDefaultIgnoreIndex;
    const double gl = ignored || r.logp[n] == -INFINITY ? 0.0 : g[n];
    const double glr = ignored ? 0.0 : gr[n];
    int64_t in_support = 0;
    for (int64_t v = 0; v < p.vocab; ++v) {
      const float y = detlogp::scale_logit(logits.logits[static_cast<size_t>(n * p.vocab + v)], prm.inv_temperature);
      const bool in = detlogp::in_support(y, v, support);
      in_support += in;
      const double raw = (gs[n] - glr) * std::exp(static_cast<double>(y) - r.lse[n]);
      const double processed = in ? gl * std::exp(static_cast<double>(y) - r.lse_support[n]) : 0.0;
      const double onehot = v == t ? gl + glr : 0.0;
      const double ref = (raw - processed + onehot) * prm.inv_temperature;
      // bf16's rounding of the result, and a few fp32 ulps of the largest term (the terms cancel).
      const double scale = (std::fabs(raw) + std::fabs(processed) + std::fabs(onehot)) * prm.inv_temperature;
      const double got = bf16_to_float(dz[static_cast<size_t>(n * p.vocab + v)]);
      const double err = std::fabs(got - ref);
      worst = std::max(worst, err / (0x1p-8 * std::fabs(ref) + 0x1p-20 * scale + 1e-38));
      ASSERT_LE(err, 0x1p-8 * std::fabs(ref) + 0x1p-20 * scale + 1e-38)
          << "row " << n << " column " << v << ": " << got << " vs " << ref;
    }
    EXPECT_EQ(in_support, r.support_size[n]) << "row " << n << ": the backward's support is the forward's";
  }
  std::printf("sampled logit gradient: the worst column uses %.3g of its error bound\n", worst);
  // The host epilogue over given logits (the bitwise reference of the SM90 kernel on its own logits)
  // gives the CPU implementation's bits on the CPU serving logits.
  {
    std::vector<uint16_t> from_logits(dz.size(), 0xFFFF);
    detlogp::MutableTensorView whole{TensorView::matrix(from_logits.data(), DType::bf16, p.rows, p.vocab)};
    detlogp::LinearLogpInputs in = p.inputs();
    in.temperature = 1.0f;
    in.temperature_rows = {};
    const detlogp::detail::GradLogitsProblem gp =
        detlogp::detail::make_sampled_grad_logits_problem(in, prog.view(), args, whole);
    detlogp::detail::grad_logits_from_logits(gp, logits.logits.data(), p.vocab);
    EXPECT_EQ(from_logits, dz);
  }
  // Refused on CUDA-less paths and without the replay's outputs, naming what is missing.
  args.cut_id = {};
  detlogp::MutableTensorView out{TensorView::matrix(dz.data(), DType::bf16, p.rows, p.vocab)};
  expect_refused([&] { detlogp::linear_logp_grad_logits(p.inputs(), prog.view(), args, out); }, "cut_id is required");
}

// The top-k output beside the draw (an engine's logprobs=K): the ids and bits of linear_logp's top-k
// output at each row's temperature (1 for a greedy row), whatever the filters, for a NaN row too;
// the sampled token's logp_raw is its entry's bits where it is among the K; rows do not depend on
// the batch; K outside [1, 128] or above real_vocab is refused with nothing written.
TEST(Sample, TheTopkOutputIsLinearLogpsTopkAtTheRowsTemperature) {
  Problem p = random_problem(29, 2053, 41);
  p.hidden[static_cast<size_t>(3 * p.dim)] = 0x7FC0;  // row 3: NaN
  const Program prog = varied_program(p.rows);
  const int64_t k = 20;
  const Drawn d = draw(p, prog, row_keys(p.rows), false, k);
  Problem scaled = p;
  scaled.temperature_rows.resize(static_cast<size_t>(p.rows));
  for (int64_t n = 0; n < p.rows; ++n) {
    const float t = prog.temperature_rows[static_cast<size_t>(n)];
    scaled.temperature_rows[static_cast<size_t>(n)] = t == 0.0f ? 1.0f : t;
  }
  Outputs ref(p.rows, p.vocab, false);
  std::vector<int64_t> ids(static_cast<size_t>(p.rows * k), -7);
  std::vector<float> logp = poisoned(static_cast<size_t>(p.rows * k));
  detlogp::LinearLogpOutputs o = ref.views();
  o.topk_ids = detlogp::mutable_matrix(ids.data(), DType::i64, p.rows, k);
  o.topk_logp = detlogp::mutable_matrix(logp.data(), DType::f32, p.rows, k);
  detlogp::linear_logp(scaled.inputs(), o, cpu_backend_options());
  EXPECT_EQ(d.topk_ids, ids);
  EXPECT_TRUE(detlogp::bitcmp::compare(d.topk_logp, logp))
      << detlogp::bitcmp::compare(d.topk_logp, logp).describe("topk_logp");
  EXPECT_TRUE(detlogp::bitcmp::compare(d.lse, ref.lse)) << "lse";
  int64_t listed = 0;
  for (int64_t n = 0; n < p.rows; ++n)
    for (int64_t j = 0; j < k; ++j)
      if (d.topk_ids[static_cast<size_t>(n * k + j)] == d.token[static_cast<size_t>(n)]) {
        ++listed;
        EXPECT_EQ(float_bits(d.topk_logp[static_cast<size_t>(n * k + j)]),
                  float_bits(d.logp_raw[static_cast<size_t>(n)]))
            << "row " << n << ": the token's entry";
      }
  EXPECT_GT(listed, p.rows / 2) << "most sampled tokens are among the 20 largest";
  const std::vector<int64_t> picks{28, 3, 0, 17};
  const Keys keys = row_keys(p.rows);
  Keys some_keys;
  for (int64_t i : picks) some_keys.key.push_back(keys.key[static_cast<size_t>(i)]);
  const Drawn some = draw(p.select_rows(picks), prog.select_rows(picks), some_keys, false, k);
  for (size_t i = 0; i < picks.size(); ++i)
    for (int64_t j = 0; j < k; ++j) {
      const size_t at = static_cast<size_t>(picks[i] * k + j), mine = i * static_cast<size_t>(k) + j;
      EXPECT_EQ(some.topk_ids[mine], d.topk_ids[at]) << "row " << picks[i] << " alone";
      EXPECT_EQ(float_bits(some.topk_logp[mine]), float_bits(d.topk_logp[at])) << "row " << picks[i] << " alone";
    }
  const Problem small = random_problem(3, 50, 42);
  const Program plain;
  for (const auto& [head, bad, message] :
       {std::tuple{static_cast<const Problem*>(&p), int64_t{129},
                   "topk=129 (topk_ids has K=129 columns) must be in [1, 128] (kMaxTopk)"},
        std::tuple{&small, int64_t{51}, "topk=51 exceeds real_vocab=50"}}) {
    Drawn r;
    detlogp::SampleOutputs views = sample_views(r, head->rows, head->vocab, false, bad);
    expect_refused(
        [&] {
          detlogp::sample(sample_inputs(*head, head == &p ? prog : plain, row_keys(head->rows)), views,
                          cpu_backend_options());
        },
        message);
    EXPECT_TRUE(untouched(r)) << "topk=" << bad;
  }
}

}  // namespace

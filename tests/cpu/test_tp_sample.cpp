// The sampling program over vocabulary shards (docs/contract.md §11.9) with in-process ranks (one
// thread each, host memory, CPU backend): sample_tensor_parallel and the replay's
// linear_logp_tensor_parallel give every rank the TP = 1 bits (token, logp, logp_raw, lse,
// support_size, the top-k output beside the draw; the replay's lse_support, support_max, cut_logit
// and cut_id) for engine splits V / TP off the tile grid at TP = 2, 3, 4 and 8, odd vocabularies,
// unequal shards, shards narrower than a tile and a shard of padding only, in row chunks; each rank
// keeps its logits shard; bad or inconsistent calls are refused by every rank with the same
// message and nothing written.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "detlogp/dist.hpp"
#include "sample_util.hpp"

namespace {

using namespace detlogp_test;
using namespace sample_test;
using detlogp::bitcmp::float_bits;

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

struct RankDraw {
  Drawn d;
  std::string error;
};
struct RankReplay {
  Replayed r;
  std::string error;
};

using SampleEdit = std::function<void(int, detlogp::SampleInputs&)>;
using ReplayEdit = std::function<void(int, detlogp::LinearLogpInputs&, detlogp::SamplingProgram&)>;

// Every rank in its own thread over in-process communicators; `edit` may alter rank r's call.
std::vector<RankDraw> draw_ranks(
    const Problem& p, const Program& prog, const Keys& keys, const std::vector<int64_t>& bounds,
    bool with_logits = false, const SampleEdit& edit = [](int, detlogp::SampleInputs&) {}, int64_t topk = 0,
    int64_t rank0_topk = -1) {  // rank0_topk >= 0: rank 0's K instead of topk
  const int ranks = static_cast<int>(bounds.size()) - 1;
  auto comms = detlogp::make_local_communicators(ranks, detlogp::Memory::host);
  std::vector<RankDraw> out(static_cast<size_t>(ranks));
  std::vector<detlogp::SampleOutputs> views;
  for (int r = 0; r < ranks; ++r)
    views.push_back(sample_views(out[r].d, p.rows, bounds[r + 1] - bounds[r], with_logits,
                                 r == 0 && rank0_topk >= 0 ? rank0_topk : topk));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      detlogp::SampleInputs in = sample_inputs(p, prog, keys);
      const detlogp::LinearLogpInputs shard = p.shard_inputs(bounds[r], bounds[r + 1] - bounds[r]);
      in.weight = shard.weight;
      in.bias = shard.bias;
      in.vocab_start = bounds[r];
      edit(r, in);
      try {
        out[r].d.report = detlogp::sample_tensor_parallel(in, views[r], *comms[r], cpu_backend_options());
      } catch (const detlogp::Error& e) {
        out[r].error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

detlogp::SampledLogpOutputs replay_views(Replayed& r, int64_t rows) {
  const size_t n = static_cast<size_t>(rows);
  for (auto* v : {&r.logp, &r.logp_raw, &r.lse, &r.lse_support, &r.support_max, &r.cut_logit}) *v = poisoned(n);
  r.support_size.assign(n, kPoisonToken);
  r.cut_id.assign(n, kPoisonToken);
  detlogp::SampledLogpOutputs o;
  o.logp = detlogp::mutable_vector(r.logp.data(), DType::f32, rows);
  o.logp_raw = detlogp::mutable_vector(r.logp_raw.data(), DType::f32, rows);
  o.lse = detlogp::mutable_vector(r.lse.data(), DType::f32, rows);
  o.lse_support = detlogp::mutable_vector(r.lse_support.data(), DType::f32, rows);
  o.support_size = detlogp::mutable_vector(r.support_size.data(), DType::i64, rows);
  o.support_max = detlogp::mutable_vector(r.support_max.data(), DType::f32, rows);
  o.cut_logit = detlogp::mutable_vector(r.cut_logit.data(), DType::f32, rows);
  o.cut_id = detlogp::mutable_vector(r.cut_id.data(), DType::i64, rows);
  return o;
}

std::vector<RankReplay> replay_ranks(
    const Problem& p, const Program& prog, const std::vector<int64_t>& bounds,
    const ReplayEdit& edit = [](int, detlogp::LinearLogpInputs&, detlogp::SamplingProgram&) {}) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  auto comms = detlogp::make_local_communicators(ranks, detlogp::Memory::host);
  std::vector<RankReplay> out(static_cast<size_t>(ranks));
  std::vector<detlogp::SampledLogpOutputs> views;
  for (int r = 0; r < ranks; ++r) views.push_back(replay_views(out[r].r, p.rows));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      detlogp::LinearLogpInputs in = p.shard_inputs(bounds[r], bounds[r + 1] - bounds[r]);
      in.temperature = 1.0f;
      in.temperature_rows = {};
      detlogp::SamplingProgram program = prog.view();
      edit(r, in, program);
      try {
        out[r].r.report = detlogp::linear_logp_tensor_parallel(in, program, views[r], *comms[r], cpu_backend_options());
      } catch (const detlogp::Error& e) {
        out[r].error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

void expect_same_replay(const Replayed& a, const Replayed& b, const std::string& what) {
  namespace bc = detlogp::bitcmp;
  EXPECT_TRUE(bc::compare(a.logp, b.logp)) << bc::compare(a.logp, b.logp).describe(what + " logp");
  EXPECT_TRUE(bc::compare(a.logp_raw, b.logp_raw)) << what << " logp_raw";
  EXPECT_TRUE(bc::compare(a.lse, b.lse)) << what << " lse";
  EXPECT_TRUE(bc::compare(a.lse_support, b.lse_support)) << what << " lse_support";
  EXPECT_TRUE(bc::compare(a.support_max, b.support_max)) << what << " support_max";
  EXPECT_TRUE(bc::compare(a.cut_logit, b.cut_logit)) << what << " cut_logit";
  EXPECT_EQ(a.cut_id, b.cut_id) << what;
  EXPECT_EQ(a.support_size, b.support_size) << what;
  EXPECT_EQ(a.report.sampling.outside_support, b.report.sampling.outside_support) << what;
  EXPECT_EQ(a.report.sampling.first_outside_support, b.report.sampling.first_outside_support) << what;
}

// Rollout and replay at TP = 1 and over `bounds`, every rank compared with TP = 1, bit for bit.
// With the top-k output (K = 20, or every real id of a smaller vocabulary) beside the draw.
void expect_tp1_bits(const Problem& p, const Program& prog, const Keys& keys, const std::vector<int64_t>& bounds) {
  const std::string what = name_of(bounds);
  const int64_t topk = std::min<int64_t>(20, p.real_vocab);
  const Drawn ref = draw(p, prog, keys, false, topk);
  const std::vector<RankDraw> got = draw_ranks(
      p, prog, keys, bounds, false, [](int, detlogp::SampleInputs&) {}, topk);
  for (size_t r = 0; r < got.size(); ++r) {
    ASSERT_TRUE(got[r].error.empty()) << what << " rank " << r << ": " << got[r].error;
    expect_same_bits(got[r].d, ref, what + " rank " + std::to_string(r));
    EXPECT_EQ(got[r].d.report.provenance.sample_id, detlogp::kSampleId);
  }
  Problem scored = p;
  for (int64_t n = 0; n < p.rows; ++n) {  // a row without a distribution (token -1) replays id 7: NaN
    const int64_t t = ref.token[static_cast<size_t>(n)];
    scored.targets[static_cast<size_t>(n)] = t >= 0 ? t : 7;
  }
  scored.targets[1] = detlogp::kDefaultIgnoreIndex;  // an ignored row
  scored.targets[2] = 0;                             // usually outside the support: -inf, counted
  const Replayed want = replay(scored, prog);
  const std::vector<RankReplay> rep = replay_ranks(scored, prog, bounds);
  for (size_t r = 0; r < rep.size(); ++r) {
    ASSERT_TRUE(rep[r].error.empty()) << what << " replay rank " << r << ": " << rep[r].error;
    expect_same_replay(rep[r].r, want, what + " replay rank " + std::to_string(r));
  }
}

// Rows with every filter, per-row values, greedy rows, and rows with no filter at all.
Program tp_program(int64_t rows) {
  Program prog = varied_program(rows);
  prog.top_k_rows[0] = 0;
  prog.top_p_rows[0] = 1.0f;
  prog.min_p_rows[0] = 0.0f;  // every filter off
  return prog;
}

}  // namespace

TEST(TensorParallelSample, EngineSplitsOfAQwenSizedVocabularyGiveTheSingleRankBits) {
  const Problem p = random_problem(6, 151936, 11, 4.0);
  const Program prog = tp_program(p.rows);
  const Keys keys = row_keys(p.rows, 7000);
  for (int ranks : {2, 3, 4, 8}) expect_tp1_bits(p, prog, keys, engine_bounds(p.vocab, ranks));
}

TEST(TensorParallelSample, OddVocabulariesUnequalNarrowAndPaddingOnlyShards) {
  Problem p = random_problem(23, 2053, 12);
  p.hidden[static_cast<size_t>(5 * p.dim)] = 0x7FC0;  // a NaN row: no processed distribution (token -1)
  const Program prog = tp_program(p.rows);
  const Keys keys = row_keys(p.rows, 3);
  for (const std::vector<int64_t>& b : std::vector<std::vector<int64_t>>{
           {0, 2053},                       // TP = 1 through the operator
           {0, 1027, 2053},                 // V / 2, off the grid
           {0, 700, 1366, 2053},            // V / 3
           {0, 5, 64, 100, 128, 2053},      // narrower than a tile, inside one tile, on the grid
           {0, 1, 2, 3, 1500, 2052, 2053},  // one-lane shards at both ends
           {0, 64, 1984, 2048, 2053}})      // aligned, then the last partial tile alone
    expect_tp1_bits(p, prog, keys, b);

  // A padded vocabulary: real_vocab < V_local; the last shard holds padding only.
  Problem padded = random_problem(9, 2112, 13);
  padded.real_vocab = 2000;
  for (int64_t& t : padded.targets) t %= padded.real_vocab;
  const Program pp = tp_program(padded.rows);
  for (const std::vector<int64_t>& b :
       std::vector<std::vector<int64_t>>{{0, 1000, 2000, 2112}, {0, 1999, 2001, 2050, 2112}, {0, 777, 2112}})
    expect_tp1_bits(padded, pp, row_keys(padded.rows), b);
}

TEST(TensorParallelSample, RowChunksAndTheLogitsShardAreBitNeutral) {
  const Problem p = random_problem(40, 1500, 14);
  const Program prog = tp_program(p.rows);
  const Keys keys = row_keys(p.rows, 99);
  const std::vector<int64_t> bounds = engine_bounds(p.vocab, 3);
  const Drawn ref = draw(p, prog, keys, true);
  {
    // A 1 MiB workspace: chunks of a few rows.
    ScopedEnv env("DETLOGP_TP_WORKSPACE_MB", "1");
    const std::vector<RankDraw> got = draw_ranks(p, prog, keys, bounds, true);
    for (size_t r = 0; r < got.size(); ++r) {
      ASSERT_TRUE(got[r].error.empty()) << got[r].error;
      expect_same_bits(got[r].d, ref, "chunked rank " + std::to_string(r));
      // This rank's logits shard is the TP = 1 serving logits' columns.
      const int64_t start = bounds[r], count = bounds[r + 1] - bounds[r];
      for (int64_t n = 0; n < p.rows; ++n)
        for (int64_t v = 0; v < count; ++v)
          ASSERT_EQ(float_bits(got[r].d.logits[n * count + v]), float_bits(ref.logits[n * p.vocab + start + v]))
              << "rank " << r << " row " << n << " column " << v;
    }
  }
  // Flat rows (every lane a top-p candidate) and greedy-only rows.
  Program flat;
  flat.top_p = 0.999f;
  flat.min_p = 0.0f;
  expect_tp1_bits(random_problem(5, 1500, 15, 0.05), flat, row_keys(5), bounds);
  Program greedy;
  greedy.temperature = 0.0f;
  greedy.top_p = 0.3f;
  expect_tp1_bits(p, greedy, keys, bounds);
}

TEST(TensorParallelSample, EveryRankRefusesTheSameWayAndWritesNothing) {
  const Problem p = random_problem(8, 700, 16);
  const Program prog = tp_program(p.rows);
  const Keys keys = row_keys(p.rows);
  const std::vector<int64_t> bounds = engine_bounds(p.vocab, 3);
  std::vector<int64_t> other_keys(keys.key.begin(), keys.key.end());
  other_keys[5] += 1;
  std::vector<int64_t> bad_rows(static_cast<size_t>(p.rows), 10);
  bad_rows[4] = -3;
  const auto check = [&](const SampleEdit& edit, const std::string& needle) {
    const std::vector<RankDraw> got = draw_ranks(p, prog, keys, bounds, false, edit);
    for (size_t r = 0; r < got.size(); ++r) {
      EXPECT_EQ(got[r].error, got[0].error) << "rank " << r << " refuses in other words";
      EXPECT_NE(got[r].error.find(needle), std::string::npos) << got[r].error;
      EXPECT_TRUE(untouched(got[r].d)) << "rank " << r << " wrote outputs: " << needle;
    }
  };
  check([&](int r, detlogp::SampleInputs& in) { in.key.data = r == 2 ? other_keys.data() : in.key.data; },
        "ranks disagree on the keys (key)");
  std::vector<float> other_top_p = prog.top_p_rows;
  other_top_p[6] = 0.25f;
  check(
      [&](int r, detlogp::SampleInputs& in) {
        if (r == 1) in.program.top_p_rows = detlogp::TensorView::vector(other_top_p.data(), DType::f32, p.rows);
      },
      "ranks disagree on top_p");
  check(
      [](int r, detlogp::SampleInputs& in) {
        if (r == 2) in.program.min_p_rows = {};  // the scalar instead of the rows
      },
      "ranks disagree on min_p");
  check([](int r, detlogp::SampleInputs& in) { in.seed += static_cast<uint64_t>(r); }, "ranks disagree on the seeds");
  check([](int r, detlogp::SampleInputs& in) { in.program.min_p = r == 0 ? 1.5f : 0.0f; }, "rank 0: ");
  check(
      [&](int r, detlogp::SampleInputs& in) {
        if (r == 1) in.program.top_k_rows = detlogp::TensorView::vector(bad_rows.data(), DType::i64, p.rows);
      },
      "top_k_rows[4]=-3 must be >= 0");
  check([](int r, detlogp::SampleInputs& in) { in.vocab_start += r == 2 ? 1 : 0; }, "rank 2 shard starts at");
  check([&](int r, detlogp::SampleInputs& in) { in.real_vocab = r == 1 ? 600 : p.real_vocab; },
        "ranks disagree on real_vocab");
  check([](int, detlogp::SampleInputs& in) { in.real_vocab = (int64_t{1} << 24) + 1; }, "limit 2^24");
  // The top-k output's K differs by rank (rank 0 asks for none, then for 4 against 5).
  for (int64_t k0 : {int64_t{0}, int64_t{4}}) {
    const std::vector<RankDraw> got = draw_ranks(
        p, prog, keys, bounds, false, [](int, detlogp::SampleInputs&) {}, 5, k0);
    for (size_t r = 0; r < got.size(); ++r) {
      EXPECT_EQ(got[r].error, got[0].error) << "rank " << r << " refuses in other words";
      EXPECT_NE(got[r].error.find("ranks disagree on topk"), std::string::npos) << got[r].error;
      EXPECT_TRUE(untouched(got[r].d)) << "rank " << r << " wrote outputs with K differing by rank";
    }
  }

  // The replay: inconsistent targets, and a program that differs by rank.
  Problem scored = p;
  const auto check_replay = [&](const ReplayEdit& edit, const std::string& needle) {
    const std::vector<RankReplay> got = replay_ranks(scored, prog, bounds, edit);
    for (size_t r = 0; r < got.size(); ++r) {
      EXPECT_EQ(got[r].error, got[0].error);
      EXPECT_NE(got[r].error.find(needle), std::string::npos) << got[r].error;
      EXPECT_EQ(count_unpoisoned(got[r].r.logp) + count_unpoisoned(got[r].r.lse), 0);
    }
  };
  std::vector<int64_t> other_targets = scored.targets;
  other_targets[3] = (other_targets[3] + 1) % p.real_vocab;
  check_replay(
      [&](int r, detlogp::LinearLogpInputs& in, detlogp::SamplingProgram&) {
        if (r == 1) in.targets.data = other_targets.data();
      },
      "ranks disagree on targets");
  check_replay(
      [](int r, detlogp::LinearLogpInputs&, detlogp::SamplingProgram& g) {
        if (r == 2) g.top_k_rows = {};
      },
      "ranks disagree on top_k");
  check_replay(
      [](int r, detlogp::LinearLogpInputs& in, detlogp::SamplingProgram&) { in.temperature = r == 0 ? 0.5f : 1.0f; },
      "the temperature is the program's");
}

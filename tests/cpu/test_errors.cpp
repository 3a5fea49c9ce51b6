// Bad inputs: a detlogp::Error whose message names the offending argument, and nothing written
// (outputs are poisoned with a NaN pattern beforehand and must come back untouched). N = 0 is
// not an error. A NaN in one row's hidden state stays in that row. The temperature range
// [kMinTemperature, kMaxTemperature] is exact and refused outside on every entry; a scaled logit
// that overflows stays in its row; every DETLOGP_* knob's value is checked in every build.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "detlogp/dist.hpp"
#include "detlogp/fpops.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;
using detlogp::DType;
using detlogp::TensorView;

namespace {

Problem base_problem() {
  return make_problem(
      ProblemSpec{.rows = 6, .dim = 64, .vocab = 200, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 41});
}

// Runs linear_logp with `mutate` applied to the inputs (and outputs); expects a detlogp::Error
// whose message contains every one of `needles`, and poisoned outputs left untouched.
void expect_refused(const Problem& p,
                    const std::function<void(detlogp::LinearLogpInputs&, detlogp::LinearLogpOutputs&)>& mutate,
                    std::initializer_list<const char*> needles, bool with_logits = true) {
  Outputs out(p.rows, p.vocab, with_logits);
  detlogp::LinearLogpInputs in = p.inputs();
  detlogp::LinearLogpOutputs views = out.views();
  mutate(in, views);
  try {
    detlogp::linear_logp(in, views);
    ADD_FAILURE() << "accepted; expected an error naming " << *needles.begin();
  } catch (const detlogp::Error& e) {
    const std::string msg = e.what();
    for (const char* needle : needles)
      EXPECT_NE(msg.find(needle), std::string::npos) << "message lacks '" << needle << "': " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-detlogp exception: " << e.what();
  }
  EXPECT_TRUE(out.untouched()) << "outputs written despite the error: logp " << count_unpoisoned(out.logp) << ", lse "
                               << count_unpoisoned(out.lse) << ", logits " << count_unpoisoned(out.logits);
}

}  // namespace

TEST(BadInputs, TargetAtOrAboveRealVocab) {
  Problem p = base_problem();
  p.targets[3] = 200;
  expect_refused(p, [](auto&, auto&) {}, {"targets[3]", "200", "real_vocab"});
  // A padded weight: the target is a padding id (< V_local but >= real_vocab).
  Problem q = base_problem();
  q.real_vocab = 150;
  for (auto& t : q.targets) t %= 150;
  q.targets[5] = 170;
  expect_refused(q, [](auto&, auto&) {}, {"targets[5]", "170", "real_vocab"});
}

TEST(BadInputs, NegativeTargetOtherThanIgnoreIndex) {
  Problem p = base_problem();
  p.targets[1] = -1;
  expect_refused(p, [](auto&, auto&) {}, {"targets[1]", "-1", "ignore_index"});
  p.targets[1] = -100;  // the default ignore_index: fine
  EXPECT_NO_THROW(run_linear_logp(p));
  p.ignore_index = -7;  // now -100 is just a negative target
  expect_refused(p, [](auto&, auto&) {}, {"targets[1]", "-100"});
}

TEST(BadInputs, ZeroHiddenSize) {
  const Problem p = base_problem();
  expect_refused(p,
                 [&](auto& in, auto&) {
                   in.hidden = TensorView::matrix(p.hidden.data(), DType::bf16, p.rows, 0);
                   in.weight = TensorView::matrix(p.weight.data(), DType::bf16, p.vocab, 0);
                 },
                 {"hidden", "D=0"});
}

TEST(BadInputs, ZeroVocab) {
  const Problem p = base_problem();
  expect_refused(
      p,
      [&](auto& in, auto&) {
        in.weight = TensorView::matrix(p.weight.data(), DType::bf16, 0, p.dim);
        in.bias = {};
      },
      {"weight", "V_local=0"}, /*with_logits=*/false);
}

TEST(BadInputs, WrongDtypes) {
  const Problem p = base_problem();
  expect_refused(p, [&](auto& in, auto&) { in.hidden.dtype = DType::f32; }, {"hidden", "bf16"});
  expect_refused(p, [&](auto& in, auto&) { in.weight.dtype = DType::f32; }, {"weight", "bf16"});
  expect_refused(p, [&](auto& in, auto&) { in.targets.dtype = DType::f32; }, {"targets"});
  expect_refused(p, [&](auto& in, auto&) { in.bias.dtype = DType::bf16; }, {"bias", "f32"});
  expect_refused(p, [&](auto&, auto& out) { out.logp.dtype = DType::bf16; }, {"logp"});
  expect_refused(p, [&](auto&, auto& out) { out.logits.dtype = DType::i32; }, {"logits"});
}

TEST(BadInputs, WrongShapes) {
  const Problem p = base_problem();
  // weight with a different D than hidden.
  expect_refused(
      p, [&](auto& in, auto&) { in.weight = TensorView::matrix(p.weight.data(), DType::bf16, p.vocab / 2, 2 * p.dim); },
      {"weight", "D="}, false);
  // 1-D hidden.
  expect_refused(p,
                 [&](auto& in, auto&) { in.hidden = TensorView::vector(p.hidden.data(), DType::bf16, p.rows * p.dim); },
                 {"hidden", "2-D"});
  // bias of the wrong length.
  expect_refused(p, [&](auto& in, auto&) { in.bias = TensorView::vector(p.bias.data(), DType::f32, p.vocab - 1); },
                 {"bias"});
  // per-row temperatures of the wrong length.
  std::vector<float> temps(static_cast<size_t>(p.rows) + 1, 1.0f);
  expect_refused(
      p, [&](auto& in, auto&) { in.temperature_rows = TensorView::vector(temps.data(), DType::f32, p.rows + 1); },
      {"temperature_rows"});
  // lse of the wrong length.
  expect_refused(p, [&](auto&, auto& out) { out.lse.rows = p.rows - 1; }, {"lse"});
}

TEST(BadInputs, MismatchedRowCountBetweenHiddenAndTargets) {
  const Problem p = base_problem();
  expect_refused(p, [&](auto& in, auto&) { in.targets = TensorView::vector(p.targets.data(), DType::i64, p.rows - 1); },
                 {"targets", "elements", std::to_string(p.rows).c_str()});
}

TEST(BadInputs, NonPositiveOrNanTemperature) {
  const Problem p = base_problem();
  for (float T : {0.0f, -1.0f, -0.0f, NAN, INFINITY}) {
    expect_refused(p, [&](auto& in, auto&) { in.temperature = T; }, {"temperature"});
  }
  std::vector<float> temps(static_cast<size_t>(p.rows), 1.0f);
  temps[4] = 0.0f;
  expect_refused(p,
                 [&](auto& in, auto&) { in.temperature_rows = TensorView::vector(temps.data(), DType::f32, p.rows); },
                 {"temperature_rows[4]"});
  temps[4] = NAN;
  expect_refused(p,
                 [&](auto& in, auto&) { in.temperature_rows = TensorView::vector(temps.data(), DType::f32, p.rows); },
                 {"temperature_rows[4]"});
}

TEST(BadInputs, LinearLogpOnAShardOffTheTileGridIsRefused) {
  // Shards may start anywhere (their partials carry edge lanes), but linear_logp needs the whole vocabulary.
  const Problem p = base_problem();
  expect_refused(p, [&](auto& in, auto&) { in.vocab_start = 32; },
                 {"linear_logp needs the whole real vocabulary", "got shard [32, ", "linear_logp_partials"});
}

TEST(BadInputs, LinearLogpOnAVocabShardIsRefused) {
  const Problem p = base_problem();
  expect_refused(p, [&](auto& in, auto&) { in.real_vocab = p.vocab + 64; }, {"real_vocab"});
  expect_refused(p, [&](auto& in, auto&) { in.vocab_start = 64; }, {"vocab_start"});
}

TEST(BadInputs, LogitsOutputOfWrongShape) {
  const Problem p = base_problem();
  std::vector<float> small = poisoned(static_cast<size_t>(p.rows * (p.vocab - 1)));
  expect_refused(
      p, [&](auto&, auto& out) { out.logits = detlogp::mutable_matrix(small.data(), DType::f32, p.rows, p.vocab - 1); },
      {"logits", "V_local"});
  EXPECT_EQ(count_unpoisoned(small), 0);
  expect_refused(p, [&](auto&, auto& out) { out.logits.rows = p.rows + 1; }, {"logits"});
}

TEST(EmptyBatch, ZeroRowsReturnsWithoutWriting) {
  Problem p = base_problem();
  Problem empty = p.select_rows({});
  ASSERT_EQ(empty.rows, 0);
  // Views of zero rows over poisoned storage: nothing may be written.
  std::vector<float> logp = poisoned(4), lse = poisoned(4), logits = poisoned(4 * static_cast<size_t>(p.vocab));
  std::vector<uint16_t> hidden_storage(static_cast<size_t>(p.dim), 0);
  std::vector<int64_t> targets_storage(1, 0);
  detlogp::LinearLogpInputs in = empty.inputs();
  in.hidden = TensorView::matrix(hidden_storage.data(), DType::bf16, 0, p.dim);
  in.targets = TensorView::vector(targets_storage.data(), DType::i64, 0);
  detlogp::LinearLogpOutputs out;
  out.logp = detlogp::mutable_vector(logp.data(), DType::f32, 0);
  out.lse = detlogp::mutable_vector(lse.data(), DType::f32, 0);
  out.logits = detlogp::mutable_matrix(logits.data(), DType::f32, 0, p.vocab);
  EXPECT_NO_THROW(detlogp::linear_logp(in, out));
  EXPECT_EQ(count_unpoisoned(logp) + count_unpoisoned(lse) + count_unpoisoned(logits), 0);
  // The trainer entry and the TP simulation too.
  out.logits = {};
  EXPECT_NO_THROW(detlogp::linear_logp(in, out));
  EXPECT_NO_THROW(detlogp::simulate_tensor_parallel(in, 4, out));
  EXPECT_EQ(count_unpoisoned(logp) + count_unpoisoned(lse), 0);
}

TEST(NanRows, NanHiddenStaysInItsRow) {
  ProblemSpec s{.rows = 70, .dim = 128, .vocab = 2053, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 42};
  const Problem clean = make_problem(s);
  const Outputs ref = run_linear_logp(clean, true);
  for (int64_t bad_row : {0, 37, 69}) {
    Problem p = clean;
    p.hidden[bad_row * p.dim + 77] = detlogp::kCanonicalNanBf16;
    const Outputs out = run_linear_logp(p, true);
    for (int64_t n = 0; n < p.rows; ++n) {
      if (n == bad_row) {
        EXPECT_EQ(bc::float_bits(out.lse[n]), detlogp::kCanonicalNanBits) << "row " << n;
        EXPECT_EQ(bc::float_bits(out.logp[n]), detlogp::kCanonicalNanBits) << "row " << n;
        for (int64_t v = 0; v < p.vocab; ++v) ASSERT_TRUE(std::isnan(out.logits[n * p.vocab + v])) << "v " << v;
      } else {
        ASSERT_EQ(bc::float_bits(out.lse[n]), bc::float_bits(ref.lse[n]))
            << "NaN in row " << bad_row << " leaked into row " << n;
        ASSERT_EQ(bc::float_bits(out.logp[n]), bc::float_bits(ref.logp[n]))
            << "NaN in row " << bad_row << " leaked into row " << n;
        const bc::Result lg = bc::compare(&ref.logits[n * p.vocab], &out.logits[n * p.vocab], p.vocab);
        ASSERT_TRUE(lg.identical()) << lg.describe("row " + std::to_string(n) + " logits");
      }
    }
  }
}

TEST(NanRows, NanHiddenWithIgnoredTargetKeepsLogpZero) {
  Problem p = make_problem(ProblemSpec{
      .rows = 3, .dim = 64, .vocab = 130, .real_vocab = -1, .bias = false, .logit_stddev = 2.0, .seed = 43});
  p.hidden[1 * p.dim] = detlogp::kCanonicalNanBf16;
  p.targets[1] = -100;
  const Outputs out = run_linear_logp(p);
  EXPECT_EQ(bc::float_bits(out.logp[1]), 0x00000000u);
  EXPECT_EQ(bc::float_bits(out.lse[1]), detlogp::kCanonicalNanBits);
  EXPECT_FALSE(std::isnan(out.lse[0]));
  EXPECT_FALSE(std::isnan(out.lse[2]));
}

TEST(BadInputs, ReduceLogitsRefusesBadTargetsAndTemperature) {
  Problem p = base_problem();
  std::vector<float> z(static_cast<size_t>(p.rows * p.vocab), 0.5f);
  p.targets[2] = p.vocab;
  EXPECT_THROW(run_reduce_logits(p, z), detlogp::Error);
  p.targets[2] = 0;
  p.temperature = 0.0f;
  try {
    run_reduce_logits(p, z);
    ADD_FAILURE() << "temperature 0 accepted by reduce_logits";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("temperature"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- the temperature range

namespace {

float from_bits(uint32_t u) { return bc::float_from_bits(u); }

std::string shortest(float t) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, t);
  return std::string(buf, r.ptr);
}

// The message every face gives for a temperature outside the range (docs/inputs.md).
std::string range_message(const std::string& what, float t) {
  return what + "=" + shortest(t) +
         " is outside the temperature range [1.1754944e-38, 8.507059e+37] (2^-126 to 2^126, where T and 1/T are "
         "finite normal fp32 numbers; docs/contract.md 3.3)";
}

// T below, at and above both bounds. Outside: the float below 2^-126 (subnormal, fl(1/T) finite),
// the smallest T with a finite fl(1/T) (subnormal), 1e-39 and 2^-128 (fl(1/T) = inf), the float
// above 2^126 (fl(1/T) subnormal), FLT_MAX, the smallest subnormal, and the old refusals.
const std::vector<float>& outside_temperatures() {
  static const std::vector<float> v = {from_bits(0x007FFFFFu),
                                       from_bits(0x00200001u),
                                       1e-39f,
                                       from_bits(0x00200000u),
                                       from_bits(0x7E800001u),
                                       FLT_MAX,
                                       from_bits(1u),
                                       0.0f,
                                       -0.0f,
                                       -1.0f,
                                       -0x1p-126f,
                                       NAN,
                                       INFINITY,
                                       -INFINITY};
  return v;
}
const std::vector<float>& edge_temperatures() {  // inside: both bounds and their inner neighbours
  static const std::vector<float> v = {0x1p-126f, from_bits(0x00800001u), from_bits(0x7E7FFFFFu), 0x1p+126f};
  return v;
}

template <class F>
std::optional<std::string> error_of(F&& call) {
  try {
    call();
    return std::nullopt;
  } catch (const detlogp::Error& e) {
    return std::string(e.what());
  }
}

// One entry point run on p (its temperature and temperature_rows included) into poisoned outputs:
// the error it raised (nullopt: none), and whether its outputs are still all poison.
using Entry = std::function<std::optional<std::string>(const Problem&, bool& untouched)>;

std::optional<std::string> tp_operator_entry(const Problem& p, bool& untouched) {
  constexpr int kRanks = 2;
  const int64_t bounds[kRanks + 1] = {0, 128, p.vocab};
  auto comms = detlogp::make_local_communicators(kRanks, detlogp::Memory::host);
  std::vector<Outputs> outs;
  for (int r = 0; r < kRanks; ++r) outs.emplace_back(p.rows, bounds[r + 1] - bounds[r], false);
  std::vector<std::optional<std::string>> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      detlogp::LinearLogpInputs in = p.inputs();
      const int64_t start = bounds[r], count = bounds[r + 1] - bounds[r];
      in.weight = TensorView::matrix(p.weight.data() + start * p.dim, DType::bf16, count, p.dim);
      in.bias = TensorView::vector(p.bias.data() + start, DType::f32, count);
      in.vocab_start = start;
      in.real_vocab = p.real_vocab;
      errors[r] = error_of(
          [&] { detlogp::linear_logp_tensor_parallel(in, outs[r].views(), *comms[r], cpu_backend_options()); });
    });
  for (auto& t : threads) t.join();
  untouched = outs[0].untouched() && outs[1].untouched();
  EXPECT_EQ(errors[0].has_value(), errors[1].has_value()) << "the ranks decided differently";
  return errors[0] ? errors[0] : errors[1];
}

const std::vector<std::pair<const char*, Entry>>& entries() {
  static const std::vector<std::pair<const char*, Entry>> list = {
      {"linear_logp",
       [](const Problem& p, bool& untouched) {
         Outputs out(p.rows, p.vocab, true);
         auto err = error_of([&] { detlogp::linear_logp(p.inputs(), out.views(), cpu_backend_options()); });
         untouched = out.untouched();
         return err;
       }},
      {"linear_logp_partials",
       [](const Problem& p, bool& untouched) {
         const int64_t tiles = detlogp::shard_tiles(p.vocab);
         std::vector<float> sums = poisoned(static_cast<size_t>(p.rows * tiles * 2)),
                            target = poisoned(static_cast<size_t>(p.rows));
         std::vector<uint8_t> owned(static_cast<size_t>(p.rows), 0xEE);
         detlogp::ShardPartials sp;
         sp.rows = p.rows;
         sp.tiles = tiles;
         sp.summaries = reinterpret_cast<detlogp::TileSummary*>(sums.data());
         sp.target_logit = target.data();
         sp.target_owned = owned.data();
         auto err = error_of([&] { detlogp::linear_logp_partials(p.inputs(), sp, cpu_backend_options()); });
         untouched = count_unpoisoned(sums) == 0 && count_unpoisoned(target) == 0 &&
                     std::all_of(owned.begin(), owned.end(), [](uint8_t b) { return b == 0xEE; });
         return err;
       }},
      {"reduce_logits",
       [](const Problem& p, bool& untouched) {
         const std::vector<float> z(static_cast<size_t>(p.rows * p.vocab), 0.5f);
         detlogp::ReduceLogitsInputs in;
         in.logits = TensorView::matrix(z.data(), DType::f32, p.rows, p.vocab);
         in.targets = TensorView::vector(p.targets.data(), DType::i64, p.rows);
         in.temperature = p.temperature;
         if (!p.temperature_rows.empty())
           in.temperature_rows = TensorView::vector(p.temperature_rows.data(), DType::f32, p.rows);
         Outputs out(p.rows, p.vocab, false);
         auto err = error_of([&] {
           detlogp::reduce_logits(in, detlogp::mutable_vector(out.logp.data(), DType::f32, p.rows),
                                  detlogp::mutable_vector(out.lse.data(), DType::f32, p.rows));
         });
         untouched = out.untouched();
         return err;
       }},
      {"linear_logp_grad_logits",
       [](const Problem& p, bool& untouched) {
         const std::vector<float> lse(static_cast<size_t>(p.rows), 5.0f), g_logp(static_cast<size_t>(p.rows), 1.0f);
         std::vector<uint16_t> dz(static_cast<size_t>(p.rows * p.vocab), 0xFFEEu);
         detlogp::GradLogitsArgs args;
         args.lse = TensorView::vector(lse.data(), DType::f32, p.rows);
         args.g_logp = TensorView::vector(g_logp.data(), DType::f32, p.rows);
         auto err = error_of([&] {
           detlogp::linear_logp_grad_logits(p.inputs(), args,
                                            detlogp::mutable_matrix(dz.data(), DType::bf16, p.rows, p.vocab));
         });
         untouched = std::all_of(dz.begin(), dz.end(), [](uint16_t b) { return b == 0xFFEEu; });
         return err;
       }},
      {"linear_logp_tensor_parallel", tp_operator_entry},
      {"simulate_tensor_parallel",
       [](const Problem& p, bool& untouched) {
         Outputs out(p.rows, p.vocab, false);
         auto err =
             error_of([&] { detlogp::simulate_tensor_parallel(p.inputs(), 3, out.views(), cpu_backend_options()); });
         untouched = out.untouched();
         return err;
       }},
  };
  return list;
}

// Runs every entry on p: each must refuse with a message containing `needle` and write nothing.
void expect_every_entry_refuses(const Problem& p, const std::string& needle, const std::string& what) {
  for (const auto& [name, run] : entries()) {
    bool untouched = false;
    const auto err = run(p, untouched);
    if (!err) {
      ADD_FAILURE() << name << ", " << what << ": accepted; expected an error containing '" << needle << "'";
      continue;
    }
    EXPECT_NE(err->find(needle), std::string::npos) << name << ", " << what << ": " << *err;
    EXPECT_TRUE(untouched) << name << ", " << what << ": outputs written despite the error";
  }
}

void expect_every_entry_accepts(const Problem& p, const std::string& what) {
  for (const auto& [name, run] : entries()) {
    bool untouched = true;
    const auto err = run(p, untouched);
    EXPECT_FALSE(err.has_value()) << name << ", " << what << ": " << err.value_or("");
    EXPECT_FALSE(untouched) << name << ", " << what << ": nothing written";
  }
}

}  // namespace

TEST(TemperatureRange, BoundsAreExact) {
  using detlogp::fp::div;
  EXPECT_EQ(bc::float_bits(detlogp::kMinTemperature), detlogp::kMinTemperatureBits);
  EXPECT_EQ(bc::float_bits(detlogp::kMaxTemperature), detlogp::kMaxTemperatureBits);
  EXPECT_EQ(detlogp::kMinTemperature, FLT_MIN);
  EXPECT_EQ(detlogp::kMaxTemperature, 0x1p+126f);
  // At the bounds fl(1/T) is the other bound: finite and normal.
  EXPECT_EQ(div(1.0f, detlogp::kMinTemperature), 0x1p+126f);
  EXPECT_EQ(div(1.0f, detlogp::kMaxTemperature), FLT_MIN);
  // Just below kMin T is subnormal; the smallest T whose fl(1/T) is finite is the subnormal
  // 0x1.000008p-128, and 2^-128 gives inf.
  const float below_min = from_bits(detlogp::kMinTemperatureBits - 1);
  EXPECT_EQ(std::fpclassify(below_min), FP_SUBNORMAL);
  EXPECT_EQ(std::fpclassify(div(1.0f, from_bits(0x00200001u))), FP_NORMAL);
  EXPECT_EQ(div(1.0f, from_bits(0x00200000u)), INFINITY);
  // Just above kMax fl(1/T) is subnormal.
  const float above_max = from_bits(detlogp::kMaxTemperatureBits + 1);
  EXPECT_EQ(std::fpclassify(div(1.0f, above_max)), FP_SUBNORMAL);
  EXPECT_EQ(bc::float_bits(div(1.0f, above_max)), 0x007FFFFFu);
  // The predicate at the bounds and at up to 4 ulps either side of them.
  for (uint32_t k = 0; k <= 4; ++k) {
    EXPECT_TRUE(detlogp::temperature_in_range(from_bits(detlogp::kMinTemperatureBits + k))) << k;
    EXPECT_TRUE(detlogp::temperature_in_range(from_bits(detlogp::kMaxTemperatureBits - k))) << k;
    if (k == 0) continue;
    EXPECT_FALSE(detlogp::temperature_in_range(from_bits(detlogp::kMinTemperatureBits - k))) << k;
    EXPECT_FALSE(detlogp::temperature_in_range(from_bits(detlogp::kMaxTemperatureBits + k))) << k;
  }
}

// Every float: temperature_in_range(T) is exactly "T > 0, T normal, fl(1/T) finite and normal".
TEST(TemperatureRange, PredicateIsItsDefinitionOnEveryFloat) {
  const unsigned workers = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  std::vector<uint64_t> mismatches(workers, 0);
  std::vector<uint32_t> first(workers, 0);
  std::vector<std::thread> threads;
  for (unsigned w = 0; w < workers; ++w)
    threads.emplace_back([&, w] {
      for (uint64_t u = w; u <= 0x7FFFFFFFull; u += workers) {
        const float t = from_bits(static_cast<uint32_t>(u));
        const float inv = detlogp::fp::div(1.0f, t);
        const bool defined = std::isnormal(t) && std::isnormal(inv);  // t >= +0 here: normal means > 0
        const bool ok = detlogp::temperature_in_range(t) == defined && !detlogp::temperature_in_range(-t);
        if (!ok && mismatches[w]++ == 0) first[w] = static_cast<uint32_t>(u);
      }
    });
  for (auto& t : threads) t.join();
  for (unsigned w = 0; w < workers; ++w)
    EXPECT_EQ(mismatches[w], 0u) << "first mismatch at bits 0x" << std::hex << first[w];
}

TEST(BadInputs, TemperatureOutsideTheRangeIsRefusedOnEveryEntry) {
  const Problem base = base_problem();
  for (float bad : outside_temperatures()) {
    Problem scalar = base;
    scalar.temperature = bad;
    expect_every_entry_refuses(scalar, range_message("temperature", bad), "temperature=" + shortest(bad));
    Problem rows = base;
    rows.temperature_rows.assign(static_cast<size_t>(rows.rows), 0.75f);
    rows.temperature_rows[4] = bad;
    rows.temperature_rows[5] = -2.0f;  // a later bad row: the error names the first
    expect_every_entry_refuses(rows, range_message("temperature_rows[4]", bad), "temperature_rows[4]=" + shortest(bad));
  }
  Problem p = base;
  p.temperature = 1e-39f;
  std::printf("   %s\n", error_of([&] { run_linear_logp(p); }).value_or("accepted").c_str());
}

TEST(BadInputs, TemperatureAtTheBoundsIsAccepted) {
  const Problem base = base_problem();
  for (float t : edge_temperatures()) {
    Problem scalar = base;
    scalar.temperature = t;
    expect_every_entry_accepts(scalar, "temperature=" + shortest(t));
  }
  Problem rows = base;
  rows.temperature_rows = {0x1p-126f, 0x1p+126f, 1.0f, from_bits(0x00800001u), from_bits(0x7E7FFFFFu), 0.5f};
  expect_every_entry_accepts(rows, "per-row temperatures at the bounds");
}

// T = kMaxTemperature scales every logit below 2^-121: every lane's exponential is exactly 1, so
// lse is logc(V) and logp = -lse, bit for bit.
TEST(TemperatureRange, TheLargestTemperatureGivesTheUniformRow) {
  Problem p = base_problem();
  p.temperature = detlogp::kMaxTemperature;
  const Outputs out = run_linear_logp(p);
  const float lse = detlogp::logc(static_cast<float>(p.vocab));
  for (int64_t n = 0; n < p.rows; ++n) {
    EXPECT_EQ(bc::float_bits(out.lse[n]), bc::float_bits(lse)) << "row " << n;
    EXPECT_EQ(bc::float_bits(out.logp[n]), bc::float_bits(-lse)) << "row " << n;
  }
}

// With a small T, y = fl(z * fl(1/T)) overflows for large |z|, a data-dependent outcome inside
// the range: +inf in y makes the row's lse and logp the canonical NaN (inf - inf in the tile
// summary), -inf lanes contribute nothing (a -inf target gives logp = -inf; all -inf gives
// lse = -inf and logp NaN), an ignored row keeps logp = +0. Every other row keeps its bits.
TEST(TemperatureRange, AnOverflowingScaledLogitStaysInItsRow) {
  constexpr int64_t kRows = 5, kVocab = 130;
  const float kMin = detlogp::kMinTemperature;
  std::vector<float> z(kRows * kVocab);
  for (int64_t v = 0; v < kVocab; ++v) {
    z[0 * kVocab + v] = v == 7 ? 5.0f : 0.5f;                       // one +inf lane
    z[1 * kVocab + v] = -5.0f - 0.01f * static_cast<float>(v);      // every lane -inf
    z[2 * kVocab + v] = v == 100 ? -5.0f : 0.25f;                   // the target's lane -inf
    z[3 * kVocab + v] = 0.03f * static_cast<float>(v % 17) - 0.2f;  // an ordinary row
    z[4 * kVocab + v] = v == 7 ? 5.0f : 0.5f;                       // as row 0, target ignored
  }
  Problem p;
  p.rows = kRows;
  p.vocab = p.real_vocab = kVocab;
  p.targets = {3, 0, 100, 11, -100};
  p.temperature_rows = {kMin, kMin, kMin, 0.7f, kMin};
  const Outputs out = run_reduce_logits(p, z);
  const uint32_t nan = detlogp::kCanonicalNanBits;
  EXPECT_EQ(bc::float_bits(out.lse[0]), nan);
  EXPECT_EQ(bc::float_bits(out.logp[0]), nan);
  EXPECT_EQ(out.lse[1], -INFINITY);
  EXPECT_EQ(bc::float_bits(out.logp[1]), nan);
  EXPECT_EQ(out.lse[2], 0x1p+124f);  // fl(2^124 + logc(129)) with every finite y = 0.25 * 2^126
  EXPECT_EQ(out.logp[2], -INFINITY);
  EXPECT_EQ(bc::float_bits(out.lse[4]), nan);
  EXPECT_EQ(bc::float_bits(out.logp[4]), 0u);
  // Row 3 alone gives the same bits.
  const Problem row3 = p.select_rows({3});
  const Outputs alone = run_reduce_logits(row3, std::vector<float>(z.begin() + 3 * kVocab, z.begin() + 4 * kVocab));
  EXPECT_EQ(bc::float_bits(out.lse[3]), bc::float_bits(alone.lse[0]));
  EXPECT_EQ(bc::float_bits(out.logp[3]), bc::float_bits(alone.logp[0]));

  // Through the fused CPU entry: the row with T = kMinTemperature whose largest logit overflows
  // gets the canonical NaN, the others keep the bits of a run where that row had T = 1, and the
  // row equals the portable reducer over its serving logits.
  Problem q = base_problem();
  q.temperature_rows.assign(static_cast<size_t>(q.rows), 1.0f);
  const Outputs ref = run_linear_logp(q, true);
  int64_t hot = 0;  // the row with the largest logit
  for (int64_t i = 0; i < q.rows * q.vocab; ++i)
    if (ref.logits[i] > ref.logits[hot * q.vocab]) hot = i / q.vocab;
  float zmax = -INFINITY;
  for (int64_t v = 0; v < q.vocab; ++v) zmax = std::max(zmax, ref.logits[hot * q.vocab + v]);
  ASSERT_TRUE(std::isinf(detlogp::scale_logit(zmax, detlogp::inverse_temperature(kMin))))
      << "the test needs a logit that overflows: max z = " << zmax;
  q.temperature_rows[hot] = kMin;
  const Outputs got = run_linear_logp(q, true);
  for (int64_t n = 0; n < q.rows; ++n) {
    if (n == hot) continue;
    EXPECT_EQ(bc::float_bits(got.lse[n]), bc::float_bits(ref.lse[n])) << "row " << n;
    EXPECT_EQ(bc::float_bits(got.logp[n]), bc::float_bits(ref.logp[n])) << "row " << n;
  }
  EXPECT_EQ(bc::float_bits(got.lse[hot]), nan);
  EXPECT_EQ(bc::float_bits(got.logp[hot]), nan);
  const Outputs reduced = run_reduce_logits(q, got.logits);
  const bc::Result a = bc::compare(got.lse, reduced.lse), b = bc::compare(got.logp, reduced.logp);
  EXPECT_TRUE(a.identical() && b.identical()) << a.describe("lse") << "; " << b.describe("logp");
}

// ---------------------------------------------------------------- environment knobs

namespace {

struct KnobCase {
  const char* name;
  std::vector<std::string> bad;
  std::string message;  // after "NAME=value"
  std::vector<std::string> good;
};

const std::vector<KnobCase>& knob_cases() {
  static const std::vector<KnobCase> cases = {
      {"DETLOGP_SM90_BUCKET",
       {"bogus", "", "AUTO", "prefill ", "huge"},
       " is not an SM90 launch bucket; use one of: auto, decode8_n128, ",
       {"auto", "decode8_n128", "decode", "prefill", "prefill_c2", "coop256_persistent"}},
      {"DETLOGP_SM90_WORKSPACE_MB",
       {"-5", "0", "1048577", "12abc", " 5", "", "0x10", "99999999999999999999"},
       " must be an integer in [1, 1048576] (MiB)",
       {"1", "256", "1048576"}},
      {"DETLOGP_TP_WORKSPACE_MB",
       {"-5", "0", "1048577", "1.5", ""},
       " must be an integer in [1, 1048576] (MiB)",
       {"1"}},
      {"DETLOGP_CPU_THREADS", {"0", "-1", "4097", "two", "+2", ""}, " must be an integer in [1, 4096]", {"1", "2"}},
      {"DETLOGP_SM90_GRAD_CLUSTER", {"0", "3", "two", ""}, " must be an integer in [1, 2]", {"1", "2"}},
      {"DETLOGP_STRICT", {"yes", "2", "true", ""}, " must be 0 or 1", {"0", "1"}},
      {"DETLOGP_TORCH_FUSED_BACKWARD", {"2", "false", ""}, " must be 0 or 1", {"0", "1"}},
      {"DETLOGP_TORCH_LOSS_CHUNK_BYTES",
       {"0", "-1", "1099511627777", "1MiB", ""},
       " must be an integer in [1, 1099511627776] (bytes)",
       {"1", "335544320", "1099511627776"}},
      {"DETLOGP_SM90_SAMPLE_RADIX", {"2", "yes", ""}, " must be 0 or 1", {"0", "1"}},
      {"DETLOGP_SM90_TOPK_LOGITS", {"2", "yes", ""}, " must be 0 or 1", {"0", "1"}},
      {"DETLOGP_BACKEND",
       {"bogus", "", "AUTO"},
       " is not a backend id; use one of: auto, cuda-fused-linear-logp-sm90-contract-v1, cpu-linear-logp-contract-v1, "
       "cpu-sm90-emulated-contract-v1, cuda-cublas-materialized, reference-materialized, "
       "torch-materialized-noncontract",
       {"auto", "cpu-linear-logp-contract-v1", "cpu-sm90-emulated-contract-v1",
        "cuda-fused-linear-logp-sm90-contract-v1", "reference-materialized", "torch-materialized-noncontract"}},
  };
  return cases;
}

}  // namespace

// Garbage in any knob is refused by check_environment and by every entry, with or without CUDA
// and a GPU (this test runs in the CPU-only build too), with the message of the GPU path.
TEST(Environment, EveryKnobsValueIsCheckedOnEveryBuild) {
  const Problem p = base_problem();
  for (const KnobCase& c : knob_cases()) {
    for (const std::string& v : c.bad) {
      ScopedEnv env(c.name, v);
      const std::string needle = std::string(c.name) + "=" + v + c.message;
      const auto err = error_of([] { detlogp::check_environment(); });
      ASSERT_TRUE(err.has_value()) << c.name << "='" << v << "' accepted by check_environment";
      EXPECT_NE(err->find(needle), std::string::npos) << *err;
      expect_every_entry_refuses(p, needle, std::string(c.name) + "='" + v + "'");
    }
    for (const std::string& v : c.good) {
      ScopedEnv env(c.name, v);
      EXPECT_EQ(error_of([] { detlogp::check_environment(); }), std::nullopt) << c.name << "=" << v;
    }
  }
}

// The SM90 knobs are free axes: set to valid values, the CPU backend gives the same bits.
TEST(Environment, ValidSm90KnobsLeaveTheCpuBitsAlone) {
  const Problem p = base_problem();
  const Outputs ref = run_linear_logp(p, true);
  ScopedEnv bucket("DETLOGP_SM90_BUCKET", "prefill_c2");
  ScopedEnv workspace("DETLOGP_SM90_WORKSPACE_MB", "1");
  ScopedEnv cluster("DETLOGP_SM90_GRAD_CLUSTER", "1");
  expect_identical(run_linear_logp(p, true), ref, "with the SM90 knobs set");
}

// check_row_values runs the entries' row-value checks alone, with their messages.
TEST(Errors, CheckRowValuesGivesTheEntriesMessages) {
  const std::vector<int64_t> targets = {0, 5, -100, 16};
  const auto t = detlogp::TensorView::vector(targets.data(), detlogp::DType::i64, 4);
  EXPECT_NO_THROW(detlogp::check_row_values(t, 17, -100, 0.7f));
  auto message = [&](auto&& call) {
    try {
      call();
    } catch (const detlogp::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { detlogp::check_row_values(t, 16, -100, 1.0f); }).find("targets[3]=16 is >= real_vocab=16"),
            std::string::npos);
  EXPECT_NE(message([&] { detlogp::check_row_values(t, 17, -1, 1.0f); }).find("targets[2]=-100 is negative"),
            std::string::npos);
  EXPECT_NE(message([&] { detlogp::check_row_values(t, 17, -100, 1e-39f); }).find("temperature=1e-39 is outside"),
            std::string::npos);
  const std::vector<float> rows = {1.0f, 0.5f, 0.0f, 2.0f};
  const auto r = detlogp::TensorView::vector(rows.data(), detlogp::DType::f32, 4);
  EXPECT_NE(message([&] { detlogp::check_row_values(t, 17, -100, 1.0f, r); }).find("temperature_rows[2]=0 is outside"),
            std::string::npos);
  const auto short_rows = detlogp::TensorView::vector(rows.data(), detlogp::DType::f32, 3);
  EXPECT_NE(message([&] {
              detlogp::check_row_values(t, 17, -100, 1.0f, short_rows);
            }).find("temperature_rows has 3 elements, expected 4"),
            std::string::npos);
  // [N, K] targets: each entry named targets[n, k], K in its range, temperature_rows per row.
  const auto t2 = detlogp::TensorView::matrix(targets.data(), detlogp::DType::i64, 2, 2);
  EXPECT_NO_THROW(
      detlogp::check_row_values(t2, 17, -100, 1.0f, detlogp::TensorView::vector(rows.data(), detlogp::DType::f32, 2)));
  EXPECT_NE(
      message([&] { detlogp::check_row_values(t2, 16, -100, 1.0f); }).find("targets[1, 1]=16 is >= real_vocab=16"),
      std::string::npos);
  EXPECT_NE(message([&] {
              detlogp::check_row_values(t2, 17, -100, 1.0f, r);
            }).find("temperature_rows has 4 elements, expected 2"),
            std::string::npos);
  const std::vector<int64_t> wide(65, 0);
  const auto t65 = detlogp::TensorView::matrix(wide.data(), detlogp::DType::i64, 1, 65);
  EXPECT_NE(message([&] {
              detlogp::check_row_values(t65, 17, -100, 1.0f);
            }).find("targets has K=65 ids per row; K must be in [1, 64] (kMaxTargetsPerRow)"),
            std::string::npos);
}

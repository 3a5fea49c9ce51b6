// Bad inputs: a detlogp::Error whose message names the offending argument, and nothing written
// (outputs are poisoned with a NaN pattern beforehand and must come back untouched). N = 0 is
// not an error. A NaN in one row's hidden state stays in that row.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
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

TEST(BadInputs, VocabStartNotAMultipleOf64) {
  const Problem p = base_problem();
  expect_refused(p, [&](auto& in, auto&) { in.vocab_start = 32; }, {"vocab_start", "32", "64"});
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

// linear_logp_grad_logits on the CPU: the bf16 rounding helper, the op against a float64 formula
// on odd shapes (bias, per-row temperatures, ignored rows, padding columns, chunks at vocab_start
// > 0, strided dz), bitwise equality with the pinned formula applied to the CPU backend's own
// serving logits, thread-count invariance, and the error cases (nothing written).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "core/grad_logits.hpp"
#include "detlogp/grad.hpp"
#include "test_util.hpp"

using namespace detlogp_test;
namespace bc = detlogp::bitcmp;

namespace {

constexpr uint16_t kPoison16 = 0xFFEEu;  // a bf16 NaN payload the op never writes (it writes 0x7FC0)

float f(uint32_t bits) { return bc::float_from_bits(bits); }

// A chunk [vocab_start, vocab_start + cols) of a full problem, with the forward's lse and
// upstream gradients. dz has row stride dz_stride >= cols; columns past cols stay poisoned.
struct GradCase {
  Problem full;
  int64_t vocab_start = 0, cols = 0, dz_stride = 0;
  std::vector<float> lse, g_logp, g_lse;
  std::vector<uint16_t> dz;
  bool with_g_logp = true, with_g_lse = true;

  GradCase(const Problem& p, int64_t start, int64_t c, int64_t stride_pad = 0, uint64_t seed = 3)
      : full(p), vocab_start(start), cols(c), dz_stride(c + stride_pad) {
    Outputs out = run_linear_logp(full);
    lse = out.lse;
    Rng rng(seed);
    g_logp.resize(static_cast<size_t>(full.rows));
    g_lse.resize(static_cast<size_t>(full.rows));
    for (auto& g : g_logp) g = static_cast<float>(rng.uniform() * 2.0 - 0.5);
    for (auto& g : g_lse) g = static_cast<float>(rng.uniform() - 0.5);
    dz.assign(static_cast<size_t>(full.rows * dz_stride), kPoison16);
  }
  detlogp::LinearLogpInputs inputs() const {
    detlogp::LinearLogpInputs in = full.inputs();
    in.weight =
        detlogp::TensorView::matrix(full.weight.data() + vocab_start * full.dim, detlogp::DType::bf16, cols, full.dim);
    in.bias = {};
    if (!full.bias.empty())
      in.bias = detlogp::TensorView::vector(full.bias.data() + vocab_start, detlogp::DType::f32, cols);
    in.vocab_start = vocab_start;
    in.real_vocab = full.real_vocab;
    return in;
  }
  detlogp::GradLogitsArgs args() const {
    detlogp::GradLogitsArgs a;
    a.lse = detlogp::TensorView::vector(lse.data(), detlogp::DType::f32, full.rows);
    if (with_g_logp) a.g_logp = detlogp::TensorView::vector(g_logp.data(), detlogp::DType::f32, full.rows);
    if (with_g_lse) a.g_lse = detlogp::TensorView::vector(g_lse.data(), detlogp::DType::f32, full.rows);
    return a;
  }
  detlogp::MutableTensorView dz_view() {
    return {detlogp::TensorView::matrix(dz.data(), detlogp::DType::bf16, full.rows, cols, detlogp::Memory::host,
                                        dz_stride)};
  }
  detlogp::CallReport run() { return detlogp::linear_logp_grad_logits(inputs(), args(), dz_view()); }
  uint16_t at(int64_t n, int64_t c) const { return dz[static_cast<size_t>(n * dz_stride + c)]; }
  bool untouched() const {
    for (uint16_t b : dz)
      if (b != kPoison16) return false;
    return true;
  }
};

// float64 dL/dz of one element, from the same bf16 inputs and the forward's fp32 lse.
double reference_grad(const GradCase& g, int64_t n, int64_t c) {
  const Problem& p = g.full;
  const int64_t v = g.vocab_start + c;
  double z = 0;
  for (int64_t k = 0; k < p.dim; ++k) z += static_cast<double>(p.h(n, k)) * static_cast<double>(p.w(v, k));
  if (!p.bias.empty()) z += static_cast<double>(p.bias[v]);
  const double inv_t = 1.0 / static_cast<double>(p.temperature_of(n));
  const bool ignored = p.targets[n] == p.ignore_index;
  const double gl = (ignored || !g.with_g_logp) ? 0.0 : g.g_logp[n];
  const double gs = g.with_g_lse ? g.g_lse[n] : 0.0;
  const double prob = v < p.real_vocab ? std::exp(z * inv_t - static_cast<double>(g.lse[n])) : 0.0;
  double d = (gs - gl) * prob;
  if (!ignored && p.targets[n] == v) d += gl;
  return d * inv_t;
}

void expect_matches_float64(GradCase& g, const std::string& what) {
  const Problem& p = g.full;
  int64_t bad = 0;
  for (int64_t n = 0; n < p.rows; ++n) {
    const double inv_t = 1.0 / static_cast<double>(p.temperature_of(n));
    const double scale = (std::fabs(g.g_logp[n]) + std::fabs(g.g_lse[n])) * inv_t;
    for (int64_t c = 0; c < g.cols; ++c) {
      const double ref = reference_grad(g, n, c);
      const double got = bf16_to_float(g.at(n, c));
      // bf16 rounding (half an ulp: 2^-9 relative) plus the fp32 pipeline (z, expc, the products).
      const double tol = 0x1p-8 * std::fabs(ref) + 1e-6 * scale;
      if (!(std::fabs(got - ref) <= tol) && bad++ < 5)
        ADD_FAILURE() << what << ": dz[" << n << "][" << c << "] = " << got << ", float64 " << ref << " (tol " << tol
                      << ")";
      if (g.vocab_start + c >= p.real_vocab) {
        EXPECT_EQ(g.at(n, c), 0) << what << ": padding column " << c << " of row " << n << " is not +0";
      }
    }
    for (int64_t c = g.cols; c < g.dz_stride; ++c)
      EXPECT_EQ(g.at(n, c), kPoison16) << what << ": dz[" << n << "][" << c << "] past C was written";
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements outside the tolerance";
}

// The pinned formula on the CPU backend's own serving logits of the whole vocabulary.
std::vector<uint16_t> formula_on_cpu_logits(GradCase& g) {
  const Outputs fwd = run_linear_logp(g.full, /*with_logits=*/true);
  std::vector<uint16_t> out(g.dz.size(), kPoison16);
  detlogp::detail::GradLogitsProblem prob = detlogp::detail::make_grad_logits_problem(
      g.inputs(), g.args(),
      {detlogp::TensorView::matrix(out.data(), detlogp::DType::bf16, g.full.rows, g.cols, detlogp::Memory::host,
                                   g.dz_stride)});
  detlogp::detail::grad_logits_from_logits(prob, fwd.logits.data() + g.vocab_start, g.full.vocab);
  return out;
}

struct Shape {
  int64_t rows, dim, vocab, real_vocab, vocab_start, cols, stride_pad;
  bool bias, temp_rows;
};

Problem shaped_problem(const Shape& s, uint64_t seed) {
  Problem p = make_problem(ProblemSpec{.rows = s.rows,
                                       .dim = s.dim,
                                       .vocab = s.vocab,
                                       .real_vocab = s.real_vocab,
                                       .bias = s.bias,
                                       .logit_stddev = 3.0,
                                       .seed = seed});
  if (s.temp_rows) {
    p.temperature_rows.resize(static_cast<size_t>(p.rows));
    for (int64_t n = 0; n < p.rows; ++n) p.temperature_rows[n] = 0.5f + 0.125f * static_cast<float>(n % 9);
  } else {
    p.temperature = 0.7f;
  }
  for (int64_t n = 1; n < p.rows; n += 5) p.targets[n] = p.ignore_index;
  // Some targets inside the chunk, the first and last real ids.
  if (p.rows > 2) p.targets[0] = s.vocab_start + s.cols / 2 < p.real_vocab ? s.vocab_start + s.cols / 2 : 0;
  if (p.rows > 3) p.targets[2] = p.real_vocab - 1;
  if (p.rows > 4) p.targets[3] = s.vocab_start;
  return p;
}

const Shape kShapes[] = {
    {1, 64, 17, -1, 0, 17, 0, false, false},         // one row, one partial tile
    {77, 200, 300, 250, 64, 236, 3, true, true},     // chunk past real_vocab (padding), strided dz
    {33, 96, 2053, 2000, 37, 2016, 0, true, false},  // vocab_start not a multiple of 64, ends in padding
    {13, 48, 123, -1, 0, 123, 1, false, true},       // odd everything
    {300, 64, 1000, 900, 512, 123, 0, true, true},   // a chunk in the middle, all real
};

}  // namespace

TEST(Bf16Round, RoundsToNearestEvenAndCanonicalizesNan) {
  EXPECT_EQ(detlogp::bf16_round(1.0f), 0x3F80);
  EXPECT_EQ(detlogp::bf16_round(f(0x3F808000u)), 0x3F80);  // tie, even below
  EXPECT_EQ(detlogp::bf16_round(f(0x3F818000u)), 0x3F82);  // tie, even above
  EXPECT_EQ(detlogp::bf16_round(f(0x3F808001u)), 0x3F81);
  EXPECT_EQ(detlogp::bf16_round(f(0x3F807FFFu)), 0x3F80);
  EXPECT_EQ(detlogp::bf16_round(-0.0f), 0x8000);
  EXPECT_EQ(detlogp::bf16_round(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(detlogp::bf16_round(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(detlogp::bf16_round(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to inf
  EXPECT_EQ(detlogp::bf16_round(f(0x00018000u)), 0x0002);                     // subnormal tie to even
  EXPECT_EQ(detlogp::bf16_round(f(0x7FC00001u)), detlogp::kCanonicalNanBf16);
  EXPECT_EQ(detlogp::bf16_round(f(0xFFFFFFFFu)), detlogp::kCanonicalNanBf16);
  EXPECT_EQ(detlogp::bf16_round(f(0x7F800001u)), detlogp::kCanonicalNanBf16);
}

TEST(GradLogit, PinnedOrderOfOperations) {
  const detlogp::GradRow r{detlogp::inverse_temperature(0.7f), 3.25f, 0.75f, -0.125f};
  const float z = 2.5f;
  const float y = z * r.inv_t;
  const float p = detlogp::expc(y - r.lse);
  const float d = (r.gs - r.gl) * p;
  EXPECT_EQ(bc::float_bits(detlogp::grad_logit(z, r, true, false)), bc::float_bits(d * r.inv_t));
  EXPECT_EQ(bc::float_bits(detlogp::grad_logit(z, r, true, true)), bc::float_bits((d + r.gl) * r.inv_t));
  EXPECT_EQ(bc::float_bits(detlogp::grad_logit(z, r, false, false)), 0u);  // padding: exactly +0
  const detlogp::GradRow nan_lse{1.0f, std::numeric_limits<float>::quiet_NaN(), 1.0f, 0.0f};
  EXPECT_EQ(detlogp::grad_logit_bf16(z, nan_lse, true, false), detlogp::kCanonicalNanBf16);
}

TEST(CpuGradLogits, MatchesFloat64OnOddShapes) {
  uint64_t seed = 11;
  for (const Shape& s : kShapes) {
    GradCase g(shaped_problem(s, seed), s.vocab_start, s.cols, s.stride_pad, seed);
    ++seed;
    const detlogp::CallReport r = g.run();
    EXPECT_EQ(r.provenance.backend_id, "cpu-linear-logp-contract-v1");
    expect_matches_float64(
        g, "N=" + std::to_string(s.rows) + " C=" + std::to_string(s.cols) + " start=" + std::to_string(s.vocab_start));
  }
}

TEST(CpuGradLogits, AbsentUpstreamGradientsAreZeros) {
  GradCase g(shaped_problem(kShapes[1], 5), kShapes[1].vocab_start, kShapes[1].cols, 0, 5);
  g.with_g_lse = false;
  g.run();
  expect_matches_float64(g, "no g_lse");
  GradCase none(shaped_problem(kShapes[1], 5), kShapes[1].vocab_start, kShapes[1].cols, 0, 5);
  none.with_g_logp = false;
  none.with_g_lse = false;
  none.run();
  for (int64_t n = 0; n < none.full.rows; ++n)
    for (int64_t c = 0; c < none.cols; ++c) ASSERT_EQ(none.at(n, c), 0) << "dz[" << n << "][" << c << "]";
}

TEST(CpuGradLogits, BitsEqualThePinnedFormulaOnTheCpuServingLogits) {
  uint64_t seed = 21;
  for (const Shape& s : kShapes) {
    GradCase g(shaped_problem(s, seed), s.vocab_start, s.cols, s.stride_pad, seed);
    ++seed;
    g.run();
    const std::vector<uint16_t> ref = formula_on_cpu_logits(g);
    int64_t diff = 0, first = -1;
    for (size_t i = 0; i < ref.size(); ++i)
      if (ref[i] != g.dz[i]) {
        if (first < 0) first = static_cast<int64_t>(i);
        ++diff;
      }
    EXPECT_EQ(diff, 0) << "N=" << s.rows << " C=" << s.cols << ": " << diff << " bf16 elements differ, first at flat "
                       << first;
  }
}

TEST(CpuGradLogits, ThreadCountIsAFreeAxis) {
  const Shape s{65, 256, 2053, 2000, 0, 2053, 0, true, true};
  std::vector<std::vector<uint16_t>> runs;
  for (const char* threads : {"1", "2", "5"}) {
    ScopedEnv env("DETLOGP_CPU_THREADS", std::string(threads));
    GradCase g(shaped_problem(s, 52), s.vocab_start, s.cols, 0, 52);
    g.run();
    runs.push_back(g.dz);
  }
  EXPECT_TRUE(runs[0] == runs[1] && runs[0] == runs[2]);
}

TEST(CpuGradLogits, RowsAreIndependentOfTheBatch) {
  const Shape s{40, 64, 300, -1, 64, 200, 0, true, true};
  GradCase all(shaped_problem(s, 8), s.vocab_start, s.cols, 0, 8);
  all.run();
  Problem sub = all.full.select_rows({7, 3, 3, 39});
  GradCase part(sub, s.vocab_start, s.cols, 0, 8);
  const int64_t picks[] = {7, 3, 3, 39};
  for (int i = 0; i < 4; ++i) {
    part.lse[i] = all.lse[picks[i]];
    part.g_logp[i] = all.g_logp[picks[i]];
    part.g_lse[i] = all.g_lse[picks[i]];
  }
  part.run();
  for (int i = 0; i < 4; ++i)
    for (int64_t c = 0; c < s.cols; ++c) ASSERT_EQ(part.at(i, c), all.at(picks[i], c)) << "row " << picks[i];
}

TEST(CpuGradLogits, EmptyBatchReturnsAtOnce) {
  Problem p = make_problem(ProblemSpec{.rows = 0, .dim = 16, .vocab = 70});
  GradCase g(p, 0, 70);
  EXPECT_NO_THROW(g.run());
}

namespace {

void expect_refused(GradCase& g, const std::function<void()>& call, std::initializer_list<const char*> needles) {
  try {
    call();
    ADD_FAILURE() << "no error raised";
  } catch (const detlogp::Error& e) {
    const std::string msg = e.what();
    for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
  }
  EXPECT_TRUE(g.untouched()) << "dz was written despite the error";
}

}  // namespace

TEST(CpuGradLogits, BadInputsAreRefusedByNameAndWriteNothing) {
  const Shape s{9, 32, 300, 250, 64, 200, 0, true, true};
  auto fresh = [&] { return GradCase(shaped_problem(s, 4), s.vocab_start, s.cols, 0, 4); };
  {
    GradCase g = fresh();
    g.full.targets[4] = 250;
    expect_refused(g, [&] { g.run(); }, {"targets[4]=250", "real_vocab=250"});
  }
  {
    GradCase g = fresh();
    g.full.targets[2] = -3;
    expect_refused(g, [&] { g.run(); }, {"targets[2]=-3", "ignore_index=-100"});
  }
  {
    GradCase g = fresh();
    g.full.temperature_rows[6] = 0.0f;
    expect_refused(g, [&] { g.run(); }, {"temperature_rows[6]=0"});
  }
  {
    GradCase g = fresh();
    std::vector<float> dz32(static_cast<size_t>(g.full.rows * g.cols));
    expect_refused(g,
                   [&] {
                     detlogp::linear_logp_grad_logits(
                         g.inputs(), g.args(),
                         detlogp::mutable_matrix(dz32.data(), detlogp::DType::f32, g.full.rows, g.cols));
                   },
                   {"dz must be bf16, got f32"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     detlogp::linear_logp_grad_logits(
                         g.inputs(), g.args(),
                         detlogp::mutable_matrix(g.dz.data(), detlogp::DType::bf16, g.full.rows, g.cols - 1));
                   },
                   {"dz must be [N=9, C=200], got [9, 199]"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     detlogp::linear_logp_grad_logits(
                         g.inputs(), g.args(),
                         {detlogp::TensorView::matrix(g.dz.data(), detlogp::DType::bf16, g.full.rows, g.cols,
                                                      detlogp::Memory::host, g.cols - 8)});
                   },
                   {"dz row_stride=192"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     auto a = g.args();
                     a.lse = {};
                     detlogp::linear_logp_grad_logits(g.inputs(), a, g.dz_view());
                   },
                   {"lse is required"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     auto a = g.args();
                     a.g_logp.rows = 8;
                     detlogp::linear_logp_grad_logits(g.inputs(), a, g.dz_view());
                   },
                   {"g_logp has 8 elements, expected 9"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     auto a = g.args();
                     a.g_lse.dtype = detlogp::DType::i32;
                     detlogp::linear_logp_grad_logits(g.inputs(), a, g.dz_view());
                   },
                   {"g_lse must be f32, got i32"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     auto in = g.inputs();
                     in.bias.rows = 300;
                     detlogp::linear_logp_grad_logits(in, g.args(), g.dz_view());
                   },
                   {"bias has 300 elements, expected 200"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     auto in = g.inputs();
                     in.temperature = -1.0f;
                     detlogp::linear_logp_grad_logits(in, g.args(), g.dz_view());
                   },
                   {"temperature=-1"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     auto dz = g.dz_view();
                     dz.memory = detlogp::Memory::cuda;
                     detlogp::linear_logp_grad_logits(g.inputs(), g.args(), dz);
                   },
                   {"dz is in CUDA memory but hidden is in host memory"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     auto in = g.inputs();
                     in.vocab_start = -64;
                     detlogp::linear_logp_grad_logits(in, g.args(), g.dz_view());
                   },
                   {"vocab_start=-64"});
  }
  {
    GradCase g = fresh();
    expect_refused(g,
                   [&] {
                     auto in = g.inputs();
                     in.weight.cols = 31;
                     detlogp::linear_logp_grad_logits(in, g.args(), g.dz_view());
                   },
                   {"weight has D=31 columns but hidden has D=32"});
  }
}

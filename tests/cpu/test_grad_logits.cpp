// linear_logp_grad_logits on the CPU: the bf16 rounding helper, the op against a float64 formula
// on odd shapes (bias, per-row temperatures, ignored rows, padding columns, chunks at vocab_start
// > 0, strided dz), bitwise equality with the pinned formula applied to the CPU backend's own
// serving logits, thread-count invariance, and the error cases (nothing written). The entropy
// term (g_entropy with the forward's entropy): the same checks against the float64 gradient of a
// loss mixing logp, lse and entropy, and the logp-only bits whenever g_entropy is absent.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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
  std::vector<float> entropy, g_entropy;  // filled by with_entropy_term
  std::vector<uint16_t> dz;
  bool with_g_logp = true, with_g_lse = true;
  bool pass_entropy = false, pass_g_entropy = false;

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
  // The forward's entropy (CPU backend, beside the same lse bits) and a dL/dH per row; both are
  // passed from here on.
  GradCase& with_entropy_term(uint64_t seed = 17) {
    Outputs out(full.rows, full.vocab, false);
    entropy = poisoned(static_cast<size_t>(full.rows));
    detlogp::LinearLogpOutputs views = out.views();
    views.entropy = detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, full.rows);
    detlogp::linear_logp(full.inputs(), views, cpu_backend_options());
    Rng rng(seed);
    g_entropy.resize(static_cast<size_t>(full.rows));
    for (auto& g : g_entropy) g = static_cast<float>(rng.uniform() * 1.5 - 0.75);
    pass_entropy = pass_g_entropy = true;
    return *this;
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
    if (pass_entropy) a.entropy = detlogp::TensorView::vector(entropy.data(), detlogp::DType::f32, full.rows);
    if (pass_g_entropy) a.g_entropy = detlogp::TensorView::vector(g_entropy.data(), detlogp::DType::f32, full.rows);
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

// Every dz element of the case against a float64 reference (want, tol) = reference(n, c), padding
// columns +0 exactly, and nothing written past C.
struct Expected {
  double want, tol;
};
void expect_dz_within(const GradCase& g, const std::string& what,
                      const std::function<Expected(int64_t, int64_t)>& reference) {
  const Problem& p = g.full;
  int64_t bad = 0;
  for (int64_t n = 0; n < p.rows; ++n) {
    for (int64_t c = 0; c < g.cols; ++c) {
      const Expected e = reference(n, c);
      const double got = bf16_to_float(g.at(n, c));
      if (!(std::fabs(got - e.want) <= e.tol) && bad++ < 5)
        ADD_FAILURE() << what << ": dz[" << n << "][" << c << "] = " << got << ", float64 " << e.want << " (tol "
                      << e.tol << ")";
      if (g.vocab_start + c >= p.real_vocab) {
        EXPECT_EQ(g.at(n, c), 0) << what << ": padding column " << c << " of row " << n << " is not +0";
      }
    }
    for (int64_t c = g.cols; c < g.dz_stride; ++c)
      EXPECT_EQ(g.at(n, c), kPoison16) << what << ": dz[" << n << "][" << c << "] past C was written";
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements outside the tolerance";
}

void expect_matches_float64(GradCase& g, const std::string& what) {
  expect_dz_within(g, what, [&](int64_t n, int64_t c) {
    const double inv_t = 1.0 / static_cast<double>(g.full.temperature_of(n));
    const double scale = (std::fabs(g.g_logp[n]) + std::fabs(g.g_lse[n])) * inv_t;
    const double ref = reference_grad(g, n, c);
    // bf16 rounding (half an ulp: 2^-9 relative) plus the fp32 pipeline (z, expc, the products).
    return Expected{ref, 0x1p-8 * std::fabs(ref) + 1e-6 * scale};
  });
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

namespace {

// The float64 gradient of the mixed loss L = sum_n g_logp[n] logp_n + g_lse[n] lse_n + g_entropy[n] H_n
// from the same bf16 inputs, lse and H in float64 too: for the chunk's column v of row n,
//   dL/dz_v = [onehot(t)_v gl + p_v ((gs - gl) - gh (log p_v + H))] / T,
// and the row's scale for the tolerance (the error of the fp32 pipeline is about ulps of each term).
struct EntropyRef {
  std::vector<double> dz;     // [cols]
  std::vector<double> slack;  // [cols]: per-column absolute error allowed beside bf16 rounding
};

EntropyRef entropy_reference_row(const GradCase& g, int64_t n) {
  const Problem& p = g.full;
  const double inv_t = 1.0 / static_cast<double>(p.temperature_of(n));
  std::vector<double> y(static_cast<size_t>(p.real_vocab));
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < p.real_vocab; ++v) {
    double z = 0;
    for (int64_t k = 0; k < p.dim; ++k) z += static_cast<double>(p.h(n, k)) * static_cast<double>(p.w(v, k));
    if (!p.bias.empty()) z += static_cast<double>(p.bias[v]);
    y[v] = z * inv_t;
    m = std::max(m, y[v]);
  }
  double s = 0, u = 0;
  for (double yv : y) {
    s += std::exp(yv - m);
    u += std::exp(yv - m) * (yv - m);
  }
  const double lse = m + std::log(s);
  const double h = std::log(s) - u / s;
  const bool ignored = p.targets[n] == p.ignore_index;
  const double gl = (ignored || !g.with_g_logp) ? 0.0 : g.g_logp[n];
  const double gs = g.with_g_lse ? g.g_lse[n] : 0.0;
  const double gh = g.g_entropy[n];
  EntropyRef r;
  r.dz.assign(static_cast<size_t>(g.cols), 0.0);
  r.slack.assign(static_cast<size_t>(g.cols), 0.0);
  for (int64_t c = 0; c < g.cols; ++c) {
    const int64_t v = g.vocab_start + c;
    if (v >= p.real_vocab) continue;  // padding: exactly +0, checked bitwise
    const double x = y[v] - lse;
    const double prob = std::exp(x);
    double d = prob * ((gs - gl) - gh * (x + h));
    if (!ignored && p.targets[n] == v) d += gl;
    r.dz[c] = d * inv_t;
    // fp32 y, x, lse and H carry ~1e-6 relative error of their own magnitudes; the factor of p is
    // their sum scaled by gh (it may cancel, so the error is absolute), plus a floor for p's underflow.
    r.slack[c] = inv_t * (1e-5 * prob * (std::fabs(gs - gl) + std::fabs(gh) * (std::fabs(x) + h + 1.0)) +
                          1e-6 * (std::fabs(gl) + std::fabs(gs) + std::fabs(gh)));
  }
  return r;
}

void expect_entropy_term_matches_float64(const GradCase& g, const std::string& what) {
  int64_t row = -1;
  EntropyRef ref;
  expect_dz_within(g, what, [&](int64_t n, int64_t c) {
    if (n != row) ref = entropy_reference_row(g, row = n);  // once per row: columns come in order
    const double want = ref.dz[static_cast<size_t>(c)];
    return Expected{want, 0x1p-8 * std::fabs(want) + ref.slack[static_cast<size_t>(c)]};
  });
}

int64_t count_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t* first) {
  int64_t diff = 0;
  *first = -1;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      if (*first < 0) *first = static_cast<int64_t>(i);
      ++diff;
    }
  return diff;
}

}  // namespace

TEST(GradLogit, EntropyTermPinnedOrderOfOperations) {
  detlogp::GradRow r{detlogp::inverse_temperature(0.7f), 3.25f, 0.75f, -0.125f};
  r.entropy_term = true;
  r.gh = -0.375f;
  r.h = 2.125f;
  const float z = 2.5f;
  const float y = z * r.inv_t;
  const float x = y - r.lse;
  const float p = detlogp::expc(x);
  const float c = std::fma(-r.gh, x + r.h, r.gs - r.gl);
  const float d = c * p;
  EXPECT_EQ(bc::float_bits(detlogp::grad_logit(z, r, true, false)), bc::float_bits(d * r.inv_t));
  EXPECT_EQ(bc::float_bits(detlogp::grad_logit(z, r, true, true)), bc::float_bits((d + r.gl) * r.inv_t));
  EXPECT_EQ(bc::float_bits(detlogp::grad_logit(z, r, false, false)), 0u);  // padding: exactly +0
  // Where p == 0 the term is skipped: x = -inf (a -inf logit) gives no 0 * inf NaN.
  const float ninf = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(detlogp::grad_logit_bf16(ninf, r, true, false), detlogp::bf16_round((r.gs - r.gl) * 0.0f * r.inv_t));
  EXPECT_FALSE(std::isnan(detlogp::grad_logit(ninf, r, true, true)));
  EXPECT_EQ(bc::float_bits(detlogp::grad_from_p(0.0f, ninf, r, true)), bc::float_bits((0.0f + r.gl) * r.inv_t));
  // Without the term the bits are the logp/lse-only ones, whatever gh and h hold.
  detlogp::GradRow off = r;
  off.entropy_term = false;
  const detlogp::GradRow plain{r.inv_t, r.lse, r.gl, r.gs};
  EXPECT_EQ(bc::float_bits(detlogp::grad_logit(z, off, true, false)),
            bc::float_bits(detlogp::grad_logit(z, plain, true, false)));
  EXPECT_EQ(bc::float_bits(detlogp::grad_logit(z, plain, true, false)), bc::float_bits((r.gs - r.gl) * p * r.inv_t));
}

TEST(CpuGradLogits, EntropyTermMatchesFloat64OnOddShapes) {
  uint64_t seed = 31;
  for (const Shape& s : kShapes) {
    GradCase g(shaped_problem(s, seed), s.vocab_start, s.cols, s.stride_pad, seed);
    g.with_entropy_term(seed);
    ++seed;
    g.run();
    expect_entropy_term_matches_float64(g, "entropy term N=" + std::to_string(s.rows) + " C=" + std::to_string(s.cols) +
                                               " start=" + std::to_string(s.vocab_start));
  }
  // The entropy term alone (no g_logp, no g_lse), and beside g_logp only.
  const Shape& s = kShapes[1];
  GradCase only(shaped_problem(s, 6), s.vocab_start, s.cols, s.stride_pad, 6);
  only.with_entropy_term(6);
  only.with_g_logp = only.with_g_lse = false;
  only.run();
  expect_entropy_term_matches_float64(only, "g_entropy alone");
  GradCase logp(shaped_problem(s, 7), s.vocab_start, s.cols, s.stride_pad, 7);
  logp.with_entropy_term(7);
  logp.with_g_lse = false;
  logp.run();
  expect_entropy_term_matches_float64(logp, "g_logp and g_entropy");
}

TEST(CpuGradLogits, EntropyTermOnPeakedRowsWhereProbabilitiesUnderflow) {
  // Logits spread far at a low temperature: most lanes have p == 0 (x below expc's range), where the
  // entropy term is skipped; nothing turns NaN and the rest still matches float64.
  Problem p = make_problem(ProblemSpec{
      .rows = 19, .dim = 64, .vocab = 517, .real_vocab = 500, .bias = true, .logit_stddev = 40.0, .seed = 9});
  p.temperature = 0.25f;
  p.targets[4] = p.ignore_index;
  GradCase g(p, 0, 517, 0, 9);
  g.with_entropy_term(9);
  g.run();
  int64_t zeros = 0;
  for (int64_t n = 0; n < p.rows; ++n)
    for (int64_t c = 0; c < g.cols; ++c) {
      ASSERT_FALSE(std::isnan(bf16_to_float(g.at(n, c)))) << "dz[" << n << "][" << c << "] is NaN";
      zeros += g.at(n, c) == 0 || g.at(n, c) == 0x8000;
    }
  EXPECT_GT(zeros, p.rows * 400) << "the problem should underflow most probabilities";
  expect_entropy_term_matches_float64(g, "peaked rows");
}

TEST(CpuGradLogits, EntropyTermBitsEqualThePinnedFormulaOnTheCpuServingLogits) {
  uint64_t seed = 41;
  for (const Shape& s : kShapes) {
    GradCase g(shaped_problem(s, seed), s.vocab_start, s.cols, s.stride_pad, seed);
    g.with_entropy_term(seed);
    ++seed;
    g.run();
    const std::vector<uint16_t> ref = formula_on_cpu_logits(g);
    int64_t first = -1;
    const int64_t diff = count_diff(ref, g.dz, &first);
    EXPECT_EQ(diff, 0) << "N=" << s.rows << " C=" << s.cols << ": " << diff << " bf16 elements differ, first at flat "
                       << first;
  }
}

TEST(CpuGradLogits, WithoutGEntropyTheBitsAreTheLogpOnlyOnes) {
  uint64_t seed = 21;  // the seeds of BitsEqualThePinnedFormulaOnTheCpuServingLogits
  for (const Shape& s : kShapes) {
    GradCase plain(shaped_problem(s, seed), s.vocab_start, s.cols, s.stride_pad, seed);
    plain.run();
    // The forward's entropy handed over without g_entropy is not read: even NaN leaves the bits alone.
    GradCase given(shaped_problem(s, seed), s.vocab_start, s.cols, s.stride_pad, seed);
    given.with_entropy_term(seed);
    given.pass_g_entropy = false;
    for (auto& h : given.entropy) h = std::numeric_limits<float>::quiet_NaN();
    given.run();
    ++seed;
    int64_t first = -1;
    EXPECT_EQ(count_diff(plain.dz, given.dz, &first), 0) << "N=" << s.rows << " C=" << s.cols << ", first at " << first;
    EXPECT_EQ(formula_on_cpu_logits(plain), plain.dz) << "N=" << s.rows << " C=" << s.cols;
  }
}

TEST(CpuGradLogits, EntropyTermReachesIgnoredRowsWithoutTheirLogpTerm) {
  // An ignored row has no g_logp term but keeps its entropy term (H does not depend on the target):
  // its dz equals the same row's with g_logp zeroed, and is not zero.
  const Shape& s = kShapes[4];
  GradCase g(shaped_problem(s, 12), s.vocab_start, s.cols, s.stride_pad, 12);
  g.with_entropy_term(12);
  g.run();
  GradCase zeroed(shaped_problem(s, 12), s.vocab_start, s.cols, s.stride_pad, 12);
  zeroed.with_entropy_term(12);
  int64_t ignored_rows = 0;
  for (int64_t n = 0; n < g.full.rows; ++n)
    if (g.full.targets[n] == g.full.ignore_index) {
      zeroed.g_logp[n] = 0.0f;
      ++ignored_rows;
    }
  zeroed.run();
  ASSERT_GT(ignored_rows, 0);
  for (int64_t n = 0; n < g.full.rows; ++n) {
    if (g.full.targets[n] != g.full.ignore_index) continue;
    int64_t nonzero = 0;
    for (int64_t c = 0; c < g.cols; ++c) {
      ASSERT_EQ(g.at(n, c), zeroed.at(n, c)) << "ignored row " << n << " col " << c;
      nonzero += (g.at(n, c) & 0x7FFF) != 0;
    }
    EXPECT_GT(nonzero, 0) << "ignored row " << n << " lost its entropy term";
  }
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
  {
    GradCase g = fresh();
    g.with_entropy_term();
    expect_refused(g,
                   [&] {
                     auto a = g.args();
                     a.entropy = {};
                     detlogp::linear_logp_grad_logits(g.inputs(), a, g.dz_view());
                   },
                   {"g_entropy needs entropy"});
  }
  {
    GradCase g = fresh();
    g.with_entropy_term();
    expect_refused(g,
                   [&] {
                     auto a = g.args();
                     a.g_entropy.rows = 8;
                     detlogp::linear_logp_grad_logits(g.inputs(), a, g.dz_view());
                   },
                   {"g_entropy has 8 elements, expected 9"});
  }
  {
    GradCase g = fresh();
    g.with_entropy_term();
    expect_refused(g,
                   [&] {
                     auto a = g.args();
                     a.entropy.dtype = detlogp::DType::i32;
                     detlogp::linear_logp_grad_logits(g.inputs(), a, g.dz_view());
                   },
                   {"entropy must be f32, got i32"});
  }
}

// linear_logp_grad_from_logits: the public entry over given logits (the CPU backend's serving logits
// of the chunk), written to its own dz or over the logits in place (each row's bf16 dz in the first
// half of its fp32 bytes), gives linear_logp_grad_logits's bits; the entropy term too.
namespace {

struct FromLogits {
  std::vector<float> logits;  // the chunk's serving logits [N][cols], contiguous
  detlogp::GradFromLogitsInputs in;
};

FromLogits chunk_logits(const GradCase& g) {
  const Outputs fwd = run_linear_logp(g.full, /*with_logits=*/true);
  FromLogits f;
  f.logits.resize(static_cast<size_t>(g.full.rows * g.cols));
  for (int64_t n = 0; n < g.full.rows; ++n)
    for (int64_t c = 0; c < g.cols; ++c)
      f.logits[static_cast<size_t>(n * g.cols + c)] =
          fwd.logits[static_cast<size_t>(n * g.full.vocab + g.vocab_start + c)];
  const detlogp::LinearLogpInputs head = g.inputs();
  f.in.logits = detlogp::TensorView::matrix(f.logits.data(), detlogp::DType::f32, g.full.rows, g.cols);
  f.in.targets = head.targets;
  f.in.temperature = head.temperature;
  f.in.temperature_rows = head.temperature_rows;
  f.in.vocab_start = g.vocab_start;
  f.in.real_vocab = g.full.real_vocab;
  f.in.ignore_index = head.ignore_index;
  return f;
}

// dz of the in-place layout, copied out of the logits buffer into [N][cols] bf16.
std::vector<uint16_t> in_place_dz(const GradCase& g, FromLogits& f) {
  const detlogp::MutableTensorView dz{detlogp::TensorView::matrix(f.logits.data(), detlogp::DType::bf16, g.full.rows,
                                                                  g.cols, detlogp::Memory::host, 2 * g.cols)};
  detlogp::linear_logp_grad_from_logits(f.in, g.args(), dz);
  std::vector<uint16_t> out(static_cast<size_t>(g.full.rows * g.cols));
  const auto* bits = reinterpret_cast<const uint16_t*>(f.logits.data());
  for (int64_t n = 0; n < g.full.rows; ++n)
    for (int64_t c = 0; c < g.cols; ++c)
      out[static_cast<size_t>(n * g.cols + c)] = bits[static_cast<size_t>(n * 2 * g.cols + c)];
  return out;
}

std::vector<uint16_t> packed(const GradCase& g) {  // g.dz without its row padding
  std::vector<uint16_t> out(static_cast<size_t>(g.full.rows * g.cols));
  for (int64_t n = 0; n < g.full.rows; ++n)
    for (int64_t c = 0; c < g.cols; ++c) out[static_cast<size_t>(n * g.cols + c)] = g.at(n, c);
  return out;
}

}  // namespace

TEST(CpuGradFromLogits, BitsEqualTheRecomputingEntryOwnBufferAndInPlace) {
  uint64_t seed = 41;
  for (bool entropy : {false, true}) {
    for (const Shape& s : kShapes) {
      GradCase g(shaped_problem(s, seed), s.vocab_start, s.cols, s.stride_pad, seed);
      if (entropy) g.with_entropy_term(seed);
      ++seed;
      g.run();
      const std::vector<uint16_t> want = packed(g);

      FromLogits f = chunk_logits(g);
      std::vector<uint16_t> own(want.size(), kPoison16);
      detlogp::linear_logp_grad_from_logits(
          f.in, g.args(), detlogp::mutable_matrix(own.data(), detlogp::DType::bf16, g.full.rows, g.cols));
      int64_t first = -1;
      EXPECT_EQ(count_diff(want, own, &first), 0)
          << "own dz, entropy=" << entropy << " N=" << s.rows << " C=" << s.cols << ", first at " << first;
      EXPECT_EQ(count_diff(want, in_place_dz(g, f), &first), 0)
          << "in place, entropy=" << entropy << " N=" << s.rows << " C=" << s.cols << ", first at " << first;
    }
  }
}

TEST(CpuGradFromLogits, KTargetsARowInPlace) {
  const Shape s{40, 64, 300, 280, 0, 300, 0, true, false};
  Problem p = shaped_problem(s, 9);
  const int64_t k = 3;
  std::vector<int64_t> ids(static_cast<size_t>(p.rows * k));
  std::vector<float> g_logp(ids.size());
  Rng rng(5);
  for (int64_t n = 0; n < p.rows; ++n)
    for (int64_t i = 0; i < k; ++i) {
      const size_t j = static_cast<size_t>(n * k + i);
      ids[j] = (n % 7 == 3 && i == 1) ? p.ignore_index : (i == 2 ? ids[j - 2] : (n * 31 + i * 17) % p.real_vocab);
      g_logp[j] = static_cast<float>(rng.uniform() - 0.3);
    }
  GradCase g(p, 0, s.cols, 0, 9);
  detlogp::LinearLogpInputs in = g.inputs();
  in.targets = detlogp::TensorView::matrix(ids.data(), detlogp::DType::i64, p.rows, k);
  detlogp::GradLogitsArgs args = g.args();
  args.g_logp = detlogp::TensorView::matrix(g_logp.data(), detlogp::DType::f32, p.rows, k);
  std::vector<uint16_t> want(static_cast<size_t>(p.rows * s.cols), kPoison16);
  detlogp::linear_logp_grad_logits(in, args,
                                   detlogp::mutable_matrix(want.data(), detlogp::DType::bf16, p.rows, s.cols));
  FromLogits f = chunk_logits(g);
  f.in.targets = in.targets;
  const detlogp::MutableTensorView dz{detlogp::TensorView::matrix(f.logits.data(), detlogp::DType::bf16, p.rows, s.cols,
                                                                  detlogp::Memory::host, 2 * s.cols)};
  detlogp::linear_logp_grad_from_logits(f.in, args, dz);
  const auto* bits = reinterpret_cast<const uint16_t*>(f.logits.data());
  int64_t diff = 0;
  for (int64_t n = 0; n < p.rows; ++n)
    for (int64_t c = 0; c < s.cols; ++c)
      diff += bits[static_cast<size_t>(n * 2 * s.cols + c)] != want[static_cast<size_t>(n * s.cols + c)];
  EXPECT_EQ(diff, 0);
}

TEST(CpuGradFromLogits, BadInputsAreRefusedByNameAndWriteNothing) {
  const Shape s{9, 32, 300, 250, 64, 200, 0, true, true};
  auto fresh = [&] { return GradCase(shaped_problem(s, 4), s.vocab_start, s.cols, 0, 4); };
  auto refused = [](const std::function<void()>& call, std::initializer_list<const char*> words,
                    const std::vector<uint16_t>& dz) {
    try {
      call();
      ADD_FAILURE() << "accepted";
    } catch (const detlogp::Error& e) {
      for (const char* w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
    }
    for (uint16_t b : dz) ASSERT_EQ(b, kPoison16) << "written before the error";
  };
  {
    GradCase g = fresh();
    FromLogits f = chunk_logits(g);
    g.full.targets[4] = 250;
    f.in.targets = g.inputs().targets;
    refused([&] { detlogp::linear_logp_grad_from_logits(f.in, g.args(), g.dz_view()); },
            {"targets[4]=250", "real_vocab=250"}, g.dz);
  }
  {
    GradCase g = fresh();
    FromLogits f = chunk_logits(g);
    g.full.temperature_rows[6] = -1.0f;
    f.in.temperature_rows = g.inputs().temperature_rows;
    refused([&] { detlogp::linear_logp_grad_from_logits(f.in, g.args(), g.dz_view()); }, {"temperature_rows[6]=-1"},
            g.dz);
  }
  {
    GradCase g = fresh();
    FromLogits f = chunk_logits(g);
    f.in.logits = detlogp::TensorView::matrix(f.logits.data(), detlogp::DType::f32, g.full.rows, g.cols - 1);
    refused([&] { detlogp::linear_logp_grad_from_logits(f.in, g.args(), g.dz_view()); },
            {"dz must be [N=9, C=199], got [9, 200]"}, g.dz);
  }
  {  // dz over the logits, but not the in-place layout: refused, the logits untouched
    GradCase g = fresh();
    FromLogits f = chunk_logits(g);
    const std::vector<float> before = f.logits;
    const detlogp::MutableTensorView dz{detlogp::TensorView::matrix(
        f.logits.data() + 1, detlogp::DType::bf16, g.full.rows, g.cols, detlogp::Memory::host, 2 * g.cols)};
    refused([&] { detlogp::linear_logp_grad_from_logits(f.in, g.args(), dz); },
            {"dz overlaps logits but is not their in-place layout"}, g.dz);
    EXPECT_EQ(std::memcmp(before.data(), f.logits.data(), before.size() * 4), 0);
  }
  {
    GradCase g = fresh();
    FromLogits f = chunk_logits(g);
    f.in.vocab_start = -1;
    refused([&] { detlogp::linear_logp_grad_from_logits(f.in, g.args(), g.dz_view()); }, {"vocab_start=-1"}, g.dz);
  }
}

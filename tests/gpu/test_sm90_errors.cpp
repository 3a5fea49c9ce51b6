// Error paths of the SM90 backend through the public API: invalid device-resident targets and
// temperatures are reported as clear errors naming the row and value, nothing is written, and
// the CUDA context stays usable; TMA alignment/stride violations and bad knob values are refused.
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>

#include "gpu_test_util.hpp"

using namespace gput;
using namespace detlogp;

namespace {

constexpr const char* kId = "cuda-fused-linear-logp-sm90-contract-v1";

struct Case {
  int64_t n, d, v;
  DeviceModel m;
  DevBuf<uint16_t> hidden;
  DevBuf<int32_t> targets;
  Outputs out;
  std::vector<int32_t> host_targets;
  explicit Case(int64_t rows = 16, int64_t dim = 64, int64_t vocab = 2053) : n(rows), d(dim), v(vocab) {
    m.make(d, v, 5, false);
    hidden = DevBuf<uint16_t>(static_cast<size_t>(n * d + 64));
    fill_bf16_uniform(hidden.get(), n * d + 64, 6, 1.0f);
    host_targets.resize(n);
    for (int64_t i = 0; i < n; ++i) host_targets[i] = static_cast<int32_t>((i * 131) % v);
    targets = DevBuf<int32_t>(static_cast<size_t>(n));
    targets.from_host(host_targets);
    out.make(n, v, true);
  }
  LinearLogpInputs inputs() const {
    LinearLogpInputs in;
    in.hidden = TensorView::matrix(hidden.get(), DType::bf16, n, d, Memory::cuda);
    in.weight = TensorView::matrix(m.weight.get(), DType::bf16, v, d, Memory::cuda);
    in.targets = TensorView::vector(targets.get(), DType::i32, n, Memory::cuda);
    return in;
  }
  LinearLogpOutputs outputs() {
    LinearLogpOutputs o;
    o.logp = mutable_vector(out.logp.get(), DType::f32, n, Memory::cuda);
    o.lse = mutable_vector(out.lse.get(), DType::f32, n, Memory::cuda);
    o.logits = mutable_matrix(out.logits.get(), DType::f32, n, v, Memory::cuda);
    return o;
  }
  // The trainer entry: logp and lse only (no logits output).
  LinearLogpOutputs trainer_outputs() {
    LinearLogpOutputs o;
    o.logp = mutable_vector(out.logp.get(), DType::f32, n, Memory::cuda);
    o.lse = mutable_vector(out.lse.get(), DType::f32, n, Memory::cuda);
    return o;
  }
  void poison() {
    out.logp.poison();
    out.lse.poison();
    out.logits.poison();
  }
  bool untouched() const {
    return count_poison(out.logp.get(), n) == n && count_poison(out.lse.get(), n) == n &&
           count_poison(out.logits.get(), n * v) == n * v;
  }
};

CallOptions opts() {
  CallOptions o;
  o.backend = kId;
  o.strict = true;
  return o;
}

// Expects fn to throw detlogp::Error whose message contains every needle, leaving no CUDA error.
void expect_error(const char* what, const std::function<void()>& fn, std::initializer_list<const char*> needles) {
  try {
    fn();
    ADD_FAILURE() << what << ": no error raised";
  } catch (const detlogp::Error& e) {
    const std::string msg = e.what();
    bool ok = true;
    for (const char* n : needles) ok = ok && msg.find(n) != std::string::npos;
    EXPECT_TRUE(ok) << what << ": message lacks an expected part: " << msg;
    std::printf("   %s -> %s\n", what, msg.c_str());
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": wrong exception type: " << e.what();
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << what << ": CUDA error state left behind";
}

// A valid run first (the reference bits); every test ends by checking that the context is still
// usable and gives those bits again.
class Sm90Errors : public Sm90Test {
 protected:
  std::optional<Case> case_;  // made after the skip check: it allocates device memory
  std::vector<float> ref_logp, ref_lse;

  Case& problem() { return *case_; }

  void SetUp() override {
    Sm90Test::SetUp();
    if (IsSkipped()) return;
    Case& c = case_.emplace();
    auto report = linear_logp(c.inputs(), c.outputs(), opts());
    EXPECT_EQ(report.provenance.backend_id, kId) << "served by " << report.provenance.backend_id;
    EXPECT_TRUE(report.provenance.arch == "sm90a" && report.provenance.cc == 90)
        << "provenance arch/cc " << report.provenance.arch << "/" << report.provenance.cc;
    ref_logp = c.out.logp.to_host();
    ref_lse = c.out.lse.to_host();
  }

  void with_targets(const std::vector<int32_t>& t) {
    Case& c = problem();
    c.targets.from_host(t);
    c.poison();
    linear_logp(c.inputs(), c.outputs(), opts());
  }

  void expect_context_usable() {
    Case& c = problem();
    c.targets.from_host(c.host_targets);
    c.poison();
    try {
      linear_logp(c.inputs(), c.outputs(), opts());
      auto a = bitcmp::compare(ref_logp, c.out.logp.to_host()), b = bitcmp::compare(ref_lse, c.out.lse.to_host());
      EXPECT_TRUE(a.identical() && b.identical())
          << "after errors: " << a.describe("logp") << "; " << b.describe("lse");
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "device not healthy after the error cases";
      std::printf("   valid run after the error cases: %s\n", a.describe("logp").c_str());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "valid run after errors threw: " << e.what();
    }
  }
};

}  // namespace

TEST_F(Sm90Errors, InvalidTargetsAreNamedAndNothingIsWritten) {
  Case& c = problem();
  {
    auto t = c.host_targets;
    t[5] = static_cast<int32_t>(c.v);
    expect_error("target == V", [&] { with_targets(t); }, {"targets[5]=2053", "real_vocab=2053"});
    EXPECT_TRUE(c.untouched()) << "outputs were written despite an invalid target";
  }
  {
    auto t = c.host_targets;
    t[3] = -5;
    t[9] = 999999;
    expect_error("negative target", [&] { with_targets(t); }, {"targets[3]=-5", "ignore_index=-100"});
    EXPECT_TRUE(c.untouched()) << "outputs were written despite a negative target";
  }
  {  // i64 targets beyond 2^31
    std::vector<int64_t> t(c.host_targets.begin(), c.host_targets.end());
    t[12] = int64_t{1} << 40;
    DevBuf<int64_t> d64(t.size());
    d64.from_host(t);
    c.poison();
    auto in = c.inputs();
    in.targets = TensorView::vector(d64.get(), DType::i64, c.n, Memory::cuda);
    expect_error("i64 target 2^40", [&] { linear_logp(in, c.outputs(), opts()); }, {"targets[12]=1099511627776"});
    EXPECT_TRUE(c.untouched()) << "outputs were written despite an invalid i64 target";
  }
  expect_context_usable();
}

TEST_F(Sm90Errors, BadPerRowTemperaturesAreNamedAndNothingIsWritten) {
  Case& c = problem();
  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    std::vector<float> temps(c.n, 1.0f);
    temps[4] = bad;
    temps[7] = 0.0f;
    DevBuf<float> dt(temps.size());
    dt.from_host(temps);
    c.poison();
    auto in = c.inputs();
    in.temperature_rows = TensorView::vector(dt.get(), DType::f32, c.n, Memory::cuda);
    expect_error("bad per-row temperature", [&] { linear_logp(in, c.outputs(), opts()); }, {"temperature_rows[4]="});
    EXPECT_TRUE(c.untouched()) << "outputs were written despite a bad temperature (" << bad << ")";
  }
  expect_context_usable();
}

TEST_F(Sm90Errors, TmaAlignmentAndStrideViolationsAndBadKnobsAreRefused) {
  Case& c = problem();
  {  // misaligned hidden base (2 bytes off)
    auto in = c.inputs();
    in.hidden = TensorView::matrix(c.hidden.get() + 1, DType::bf16, c.n, c.d, Memory::cuda);
    expect_error("misaligned hidden", [&] { linear_logp(in, c.outputs(), opts()); }, {"hidden", "16-byte"});
  }
  {  // row stride not a multiple of 16 bytes
    auto in = c.inputs();
    in.hidden = TensorView::matrix(c.hidden.get(), DType::bf16, c.n - 1, c.d, Memory::cuda, c.d + 1);
    auto o = c.outputs();
    o.logp.rows = o.lse.rows = c.n - 1;
    o.logits.rows = c.n - 1;
    in.targets.rows = c.n - 1;
    expect_error("hidden stride", [&] { linear_logp(in, o, opts()); }, {"hidden", "row stride", "16 bytes"});
  }
  {
    ScopedEnv env("DETLOGP_SM90_BUCKET", "huge");
    expect_error("bad bucket knob", [&] { linear_logp(c.inputs(), c.outputs(), opts()); },
                 {"DETLOGP_SM90_BUCKET=huge"});
  }
  expect_context_usable();
}

TEST_F(Sm90Errors, PartialModeInvalidTargetLeavesThePartialBuffersUntouched) {
  Case& c = problem();
  auto t = c.host_targets;
  t[0] = static_cast<int32_t>(c.v) + 64;
  c.targets.from_host(t);
  const int64_t tiles = (c.v + 63) / 64;
  DevBuf<float> sums(static_cast<size_t>(c.n * tiles * 2)), tl(static_cast<size_t>(c.n));
  DevBuf<uint8_t> owned(static_cast<size_t>(c.n));
  sums.poison();
  tl.poison();
  GPU_CUDA(cudaMemset(owned.get(), 0xFF, c.n));
  ShardPartials sp;
  sp.rows = c.n;
  sp.tiles = tiles;
  sp.summaries = reinterpret_cast<TileSummary*>(sums.get());
  sp.target_logit = tl.get();
  sp.target_owned = owned.get();
  sp.memory = Memory::cuda;
  expect_error("partial mode invalid target", [&] { linear_logp_partials(c.inputs(), sp, opts()); }, {"targets[0]="});
  const auto ho = owned.to_host();
  bool owned_untouched = true;
  for (auto b : ho) owned_untouched = owned_untouched && b == 0xFF;
  EXPECT_TRUE(count_poison(sums.get(), c.n * tiles * 2) == c.n * tiles * 2 && count_poison(tl.get(), c.n) == c.n &&
              owned_untouched)
      << "partial buffers were written despite an invalid target";
  expect_context_usable();
}

// The trainer entry above 64 rows: its first fused launch validates the rows itself when every row
// carries >= 2^26 FLOPs (D = 4096, V = 8192), the validation kernel does it otherwise (D = 64);
// either way the error names the first bad row and logp / lse stay untouched.
TEST_F(Sm90Errors, TrainerAbove64RowsNamesTheFirstBadRowInKernelOrInTheValidationKernel) {
  for (const int64_t dim : {int64_t{4096}, int64_t{64}}) {
    Case t(200, dim, 8192);
    t.poison();
    linear_logp(t.inputs(), t.trainer_outputs(), opts());
    EXPECT_EQ(count_poison(t.out.logp.get(), t.n), 0) << "D=" << dim << ": valid trainer run left rows unwritten";
    auto bad = t.host_targets;
    bad[150] = 8192;
    bad[180] = -7;
    t.targets.from_host(bad);
    t.poison();
    expect_error(dim == 4096 ? "trainer N=200 D=4096 bad target (in-kernel validation)"
                             : "trainer N=200 D=64 bad target (validation kernel)",
                 [&] { linear_logp(t.inputs(), t.trainer_outputs(), opts()); },
                 {"targets[150]=8192", "real_vocab=8192"});
    EXPECT_TRUE(count_poison(t.out.logp.get(), t.n) == t.n && count_poison(t.out.lse.get(), t.n) == t.n)
        << "D=" << dim << ": trainer outputs were written despite an invalid target";
    t.targets.from_host(t.host_targets);
    std::vector<float> temps(t.n, 1.0f);
    temps[170] = NAN;
    DevBuf<float> dtemp(temps.size());
    dtemp.from_host(temps);
    auto in = t.inputs();
    in.temperature_rows = TensorView::vector(dtemp.get(), DType::f32, t.n, Memory::cuda);
    t.poison();
    expect_error(dim == 4096 ? "trainer N=200 D=4096 NaN temperature (in-kernel validation)"
                             : "trainer N=200 D=64 NaN temperature (validation kernel)",
                 [&] { linear_logp(in, t.trainer_outputs(), opts()); }, {"temperature_rows[170]="});
    EXPECT_TRUE(count_poison(t.out.logp.get(), t.n) == t.n && count_poison(t.out.lse.get(), t.n) == t.n)
        << "D=" << dim << ": trainer outputs were written despite a NaN temperature";
  }
  expect_context_usable();
}

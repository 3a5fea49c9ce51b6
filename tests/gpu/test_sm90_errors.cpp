// Error paths of the SM90 backend through the public API: invalid device-resident targets and
// temperatures (outside [kMinTemperature, kMaxTemperature], in the validation kernel and in the
// fused kernel's own validation) are reported as clear errors naming the row and value, nothing is
// written, and the CUDA context stays usable; TMA alignment/stride violations and bad knob values
// are refused with the messages of the CPU-only build; a scaled logit that overflows stays in its row.
#include <cfloat>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>

#include "core/env.hpp"
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

float from_bits(uint32_t u) { return bitcmp::float_from_bits(u); }

std::string shortest(float t) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, t);
  return std::string(buf, r.ptr);
}

// The message of a temperature outside the range (docs/inputs.md); device-resident rows add where
// they were checked.
std::string range_message(const std::string& what, float t, bool on_device) {
  return what + "=" + shortest(t) +
         " is outside the temperature range [1.1754944e-38, 8.507059e+37] (2^-126 to 2^126, where T and 1/T are "
         "finite normal fp32 numbers; docs/contract.md 3.3)" +
         (on_device ? " (checked on the device; nothing was written)" : "");
}

// Outside the range: the old refusals, and both sides of both bounds (1e-39 and 2^-128 give
// fl(1/T) = inf; 0x007FFFFF and 0x00200001 are subnormal; 0x7E800001 and FLT_MAX give a subnormal
// fl(1/T)).
const std::vector<float>& outside_temperatures() {
  static const std::vector<float> v = {0.0f,
                                       -1.0f,
                                       NAN,
                                       INFINITY,
                                       1e-39f,
                                       from_bits(0x00200000u),
                                       from_bits(0x00200001u),
                                       from_bits(0x007FFFFFu),
                                       from_bits(0x7E800001u),
                                       FLT_MAX};
  return v;
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
  for (float bad : outside_temperatures()) {
    std::vector<float> temps(c.n, 1.0f);
    temps[4] = bad;
    temps[7] = 0.0f;
    DevBuf<float> dt(temps.size());
    dt.from_host(temps);
    c.poison();
    auto in = c.inputs();
    in.temperature_rows = TensorView::vector(dt.get(), DType::f32, c.n, Memory::cuda);
    const std::string msg = range_message("temperature_rows[4]", bad, true);
    expect_error("bad per-row temperature", [&] { linear_logp(in, c.outputs(), opts()); }, {msg.c_str()});
    EXPECT_TRUE(c.untouched()) << "outputs were written despite a bad temperature (" << bad << ")";
    // The scalar is checked on the host, with the same words.
    auto scalar = c.inputs();
    scalar.temperature = bad;
    const std::string smsg = range_message("temperature", bad, false);
    expect_error("bad scalar temperature", [&] { linear_logp(scalar, c.outputs(), opts()); }, {smsg.c_str()});
    EXPECT_TRUE(c.untouched()) << "outputs were written despite a bad scalar temperature (" << bad << ")";
  }
  expect_context_usable();
}

// The partial mode and the logit gradient validate device-resident temperatures the same way.
TEST_F(Sm90Errors, PartialsAndGradLogitsRefuseTemperaturesOutsideTheRange) {
  Case& c = problem();
  for (float bad : {1e-39f, from_bits(0x7E800001u)}) {
    std::vector<float> temps(c.n, 1.0f);
    temps[4] = bad;
    DevBuf<float> dt(temps.size());
    dt.from_host(temps);
    auto in = c.inputs();
    in.temperature_rows = TensorView::vector(dt.get(), DType::f32, c.n, Memory::cuda);
    const std::string msg = range_message("temperature_rows[4]", bad, true);

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
    expect_error("partials, bad per-row temperature", [&] { linear_logp_partials(in, sp, opts()); }, {msg.c_str()});
    EXPECT_TRUE(count_poison(sums.get(), c.n * tiles * 2) == c.n * tiles * 2 && count_poison(tl.get(), c.n) == c.n)
        << "partial buffers were written despite a bad temperature";

    DevBuf<float> lse(static_cast<size_t>(c.n));
    GPU_CUDA(cudaMemset(lse.get(), 0, c.n * sizeof(float)));
    DevBuf<uint16_t> dz(static_cast<size_t>(c.n * c.v));
    dz.poison();
    GradLogitsArgs args;
    args.lse = TensorView::vector(lse.get(), DType::f32, c.n, Memory::cuda);
    const auto dz_view = mutable_matrix(dz.get(), DType::bf16, c.n, c.v, Memory::cuda);
    expect_error("grad_logits, bad per-row temperature", [&] { linear_logp_grad_logits(in, args, dz_view, opts()); },
                 {msg.c_str()});
    auto scalar = c.inputs();
    scalar.temperature = bad;
    const std::string smsg = range_message("temperature", bad, false);
    expect_error("grad_logits, bad scalar temperature", [&] { linear_logp_grad_logits(scalar, args, dz_view, opts()); },
                 {smsg.c_str()});
    bool dz_untouched = true;
    for (uint16_t b : dz.to_host()) dz_untouched = dz_untouched && b == 0xFFFFu;
    EXPECT_TRUE(dz_untouched) << "dz was written despite a bad temperature";
  }
  expect_context_usable();
}

// Inside the range, a small T makes y = fl(z * fl(1/T)) overflow for large |z| (data-dependent, not
// an error): that row's lse and logp are the canonical NaN, the other rows keep their bits, and the
// row equals the portable reducer over the SM90 serving logits (docs/contract.md 3.3). Both bounds
// are accepted, per row and as the scalar.
TEST_F(Sm90Errors, TemperaturesAtTheBoundsAreAcceptedAndAnOverflowStaysInItsRow) {
  Case& c = problem();
  const std::vector<float> ref_logits = c.out.logits.to_host();  // SetUp's run at T = 1
  int64_t hot = 0;  // the row with the largest logit: z * 2^126 overflows there
  for (int64_t i = 0; i < c.n * c.v; ++i)
    if (ref_logits[i] > ref_logits[hot * c.v]) hot = i / c.v;
  float zmax = -INFINITY;
  for (int64_t v = 0; v < c.v; ++v) zmax = std::max(zmax, ref_logits[hot * c.v + v]);
  ASSERT_TRUE(std::isinf(scale_logit(zmax, inverse_temperature(kMinTemperature))))
      << "the test needs a logit that overflows at T = kMinTemperature: max z = " << zmax;

  std::vector<float> temps(c.n, 1.0f);
  temps[hot] = kMinTemperature;
  const int64_t other = (hot + 1) % c.n;
  temps[other] = kMaxTemperature;
  DevBuf<float> dt(temps.size());
  dt.from_host(temps);
  auto in = c.inputs();
  in.temperature_rows = TensorView::vector(dt.get(), DType::f32, c.n, Memory::cuda);
  c.poison();
  linear_logp(in, c.outputs(), opts());
  const auto logp = c.out.logp.to_host(), lse = c.out.lse.to_host(), logits = c.out.logits.to_host();
  EXPECT_EQ(bitcmp::float_bits(lse[hot]), kCanonicalNanBits) << "row " << hot;
  EXPECT_EQ(bitcmp::float_bits(logp[hot]), kCanonicalNanBits) << "row " << hot;
  for (int64_t n = 0; n < c.n; ++n) {
    if (n == hot || n == other) continue;
    EXPECT_TRUE(same_bits(lse[n], ref_lse[n]) && same_bits(logp[n], ref_logp[n])) << "row " << n << " changed";
  }
  // The portable reducer over the SM90 logits gives the same bits in every row (also T = kMax's).
  std::vector<float> rlogp(c.n), rlse(c.n), htemps = temps;
  ReduceLogitsInputs rin;
  rin.logits = TensorView::matrix(logits.data(), DType::f32, c.n, c.v);
  rin.targets = TensorView::vector(c.host_targets.data(), DType::i32, c.n);
  rin.temperature_rows = TensorView::vector(htemps.data(), DType::f32, c.n);
  reduce_logits(rin, mutable_vector(rlogp.data(), DType::f32, c.n), mutable_vector(rlse.data(), DType::f32, c.n));
  const auto a = bitcmp::compare(rlse, lse), b = bitcmp::compare(rlogp, logp);
  EXPECT_TRUE(a.identical() && b.identical())
      << a.describe("lse vs reduce_logits") << "; " << b.describe("logp vs reduce_logits");
  // The scalar bounds are accepted too.
  for (float t : {kMinTemperature, kMaxTemperature}) {
    auto sin = c.inputs();
    sin.temperature = t;
    c.poison();
    EXPECT_NO_THROW(linear_logp(sin, c.outputs(), opts())) << "T = " << t;
    EXPECT_EQ(count_poison(c.out.lse.get(), c.n), 0) << "T = " << t << ": rows left unwritten";
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
    // The message lists the launch table's names, the ones the CPU-only build knows too.
    std::string names = "auto";
    for (const std::string& name : sm90_bucket_names()) names += ", " + name;
    EXPECT_EQ(detail::sm90_bucket_names(), sm90_bucket_names())
        << "the CUDA-free bucket names differ from bucket_info's";
    const std::string msg = "DETLOGP_SM90_BUCKET=huge is not an SM90 launch bucket; use one of: " + names;
    ScopedEnv env("DETLOGP_SM90_BUCKET", "huge");
    expect_error("bad bucket knob", [&] { linear_logp(c.inputs(), c.outputs(), opts()); }, {msg.c_str()});
  }
  for (const char* bad : {"-5", "0", "12abc", ""}) {
    ScopedEnv env("DETLOGP_SM90_WORKSPACE_MB", bad);
    c.poison();
    const std::string msg =
        std::string("DETLOGP_SM90_WORKSPACE_MB=") + bad + " must be an integer in [1, 1048576] (MiB)";
    expect_error("bad workspace knob", [&] { linear_logp(c.inputs(), c.outputs(), opts()); }, {msg.c_str()});
    EXPECT_TRUE(c.untouched()) << "outputs were written despite DETLOGP_SM90_WORKSPACE_MB=" << bad;
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
    // Finite and > 0 but outside the range: 1e-39 (fl(1/T) = inf) and the float above 2^126
    // (fl(1/T) subnormal), each named with the full message.
    for (float bad : {1e-39f, from_bits(0x7E800001u)}) {
      temps[170] = bad;
      temps[190] = 0.0f;  // a later bad row: the first is named
      dtemp.from_host(temps);
      t.poison();
      const std::string msg = range_message("temperature_rows[170]", bad, true);
      expect_error(dim == 4096 ? "trainer N=200 D=4096 temperature outside the range (in-kernel validation)"
                               : "trainer N=200 D=64 temperature outside the range (validation kernel)",
                   [&] { linear_logp(in, t.trainer_outputs(), opts()); }, {msg.c_str()});
      EXPECT_TRUE(count_poison(t.out.logp.get(), t.n) == t.n && count_poison(t.out.lse.get(), t.n) == t.n)
          << "D=" << dim << ": trainer outputs were written despite T=" << bad;
    }
    // At the bounds the trainer entry runs, and its bits are the serving entry's (an overflowing
    // row included).
    temps.assign(t.n, 1.0f);
    temps[170] = kMinTemperature;
    temps[171] = kMaxTemperature;
    dtemp.from_host(temps);
    t.poison();
    linear_logp(in, t.trainer_outputs(), opts());
    const auto trainer_logp = t.out.logp.to_host(), trainer_lse = t.out.lse.to_host();
    t.poison();
    linear_logp(in, t.outputs(), opts());
    const auto a = bitcmp::compare(t.out.lse.to_host(), trainer_lse),
               b = bitcmp::compare(t.out.logp.to_host(), trainer_logp);
    EXPECT_TRUE(a.identical() && b.identical())
        << "D=" << dim << ": " << a.describe("trainer vs serving lse") << "; " << b.describe("logp");
  }
  expect_context_usable();
}

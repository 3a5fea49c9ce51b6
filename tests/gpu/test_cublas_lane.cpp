// The non-contract cuda-cublas-materialized lane: reports its own non-contract id, is refused in
// strict mode, agrees with a float64 reference to fp32 accuracy (trainer and serving entries,
// bias, per-row temperature, ignore_index, padding), and refuses a bad target without writing.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "gpu_test_util.hpp"

using namespace gput;

namespace {

constexpr const char* kLaneId = "cuda-cublas-materialized";

// One problem on the device: padded vocabulary, bias, per-row temperatures, one ignored row.
class CublasLane : public Sm90Test {
 protected:
  static constexpr int64_t n = 33, d = 1024, v = 2112, real = 2053;
  DeviceModel m;
  DevBuf<uint16_t> h;
  std::vector<int32_t> t;
  DevBuf<int32_t> dt;
  std::vector<float> temps;
  DevBuf<float> dtemps;
  detlogp::CallOptions lane;

  void SetUp() override {
    Sm90Test::SetUp();
    if (IsSkipped()) return;
    m.make(d, v, 0xC0B1, true);
    h = DevBuf<uint16_t>(static_cast<size_t>(n * d));
    fill_bf16_uniform(h.get(), n * d, 0x51, 1.0f);
    t.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 7919) % real);
    t[3] = -100;
    dt = DevBuf<int32_t>(t.size());
    dt.from_host(t);
    temps.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) temps[i] = 0.6f + 0.1f * static_cast<float>(i % 7);
    dtemps = DevBuf<float>(temps.size());
    dtemps.from_host(temps);
    lane.backend = kLaneId;
  }

  detlogp::LinearLogpInputs inputs(const DevBuf<int32_t>& targets) const {
    detlogp::LinearLogpInputs in;
    in.hidden = detlogp::TensorView::matrix(h.get(), detlogp::DType::bf16, n, d, detlogp::Memory::cuda);
    in.weight = detlogp::TensorView::matrix(m.weight.get(), detlogp::DType::bf16, v, d, detlogp::Memory::cuda);
    in.bias = detlogp::TensorView::vector(m.bias.get(), detlogp::DType::f32, v, detlogp::Memory::cuda);
    in.targets = detlogp::TensorView::vector(targets.get(), detlogp::DType::i32, n, detlogp::Memory::cuda);
    in.temperature_rows = detlogp::TensorView::vector(dtemps.get(), detlogp::DType::f32, n, detlogp::Memory::cuda);
    in.real_vocab = real;
    return in;
  }
  static detlogp::LinearLogpOutputs outputs(Outputs& o) {
    detlogp::LinearLogpOutputs out;
    out.logp = detlogp::mutable_vector(o.logp.get(), detlogp::DType::f32, n, detlogp::Memory::cuda);
    out.lse = detlogp::mutable_vector(o.lse.get(), detlogp::DType::f32, n, detlogp::Memory::cuda);
    if (o.logits.size())
      out.logits = detlogp::mutable_matrix(o.logits.get(), detlogp::DType::f32, n, v, detlogp::Memory::cuda);
    return out;
  }
};

}  // namespace

TEST_F(CublasLane, ReportsItsIdAndAgreesWithFloat64OnBothEntries) {
  const auto hh = h.to_host();
  const auto w = m.weight.to_host();
  const auto b = m.bias.to_host();
  for (bool serving : {false, true}) {
    Outputs o;
    o.make(n, v, serving);
    const detlogp::CallReport r = detlogp::linear_logp(inputs(dt), outputs(o), lane);
    EXPECT_TRUE(r.provenance.backend_id == kLaneId && r.provenance.contract_version == 0)
        << "report names " << r.provenance.backend_id << " v" << r.provenance.contract_version;
    const auto logp = o.logp.to_host(), lse = o.lse.to_host();
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const RefRow ref = reference_row(hh.data() + i * d, w, &b, d, v, real, temps[i], t[i]);
      const double dl = std::fabs(lse[i] - ref.lse),
                   dp = t[i] == -100 ? std::fabs(logp[i]) : std::fabs(logp[i] - ref.logp);
      worst = std::max(worst, std::max(dl, dp));
    }
    EXPECT_LT(worst, 2e-4) << "cuBLAS lane vs float64: max |d|";
    std::printf("cuBLAS lane %s: max |dlogp|,|dlse| vs float64 = %.3g\n", serving ? "serving" : "trainer", worst);
  }
}

TEST_F(CublasLane, IsRefusedInStrictMode) {
  detlogp::CallOptions strict = lane;
  strict.strict = true;
  Outputs o;
  o.make(n, v, false);
  std::string err;
  try {
    detlogp::linear_logp(inputs(dt), outputs(o), strict);
  } catch (const detlogp::Error& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("strict mode refuses backend 'cuda-cublas-materialized'"), std::string::npos)
      << "strict error: '" << err << "'";
}

TEST_F(CublasLane, RefusesABadTargetWithoutWriting) {
  std::vector<int32_t> bad = t;
  bad[9] = static_cast<int32_t>(real);
  DevBuf<int32_t> dbad(bad.size());
  dbad.from_host(bad);
  Outputs o;
  o.make(n, v, false);
  std::string err;
  try {
    detlogp::linear_logp(inputs(dbad), outputs(o), lane);
  } catch (const detlogp::Error& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("targets[9]=2053 is >= real_vocab=2053"), std::string::npos) << "bad target: '" << err << "'";
  EXPECT_TRUE(count_poison(o.logp.get(), n) == n && count_poison(o.lse.get(), n) == n) << "lane wrote on a bad target";
}

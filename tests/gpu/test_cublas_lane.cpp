// The non-contract cuda-cublas-materialized lane: reports its own non-contract id, is refused in
// strict mode, agrees with a float64 reference to fp32 accuracy (trainer and serving entries,
// bias, per-row temperature, ignore_index, padding), refuses a bad target without writing, and
// differs from the contract backend in bits on at least one row (it is the materializing path).
#include <cmath>

#include "gpu_test_util.hpp"

using namespace gput;

int main() {
  if (int rc = skip_unless_sm90("test_cublas_lane")) return rc;
  const int64_t n = 33, d = 1024, v = 2112, real = 2053;
  DeviceModel m;
  m.make(d, v, 0xC0B1, true);
  DevBuf<uint16_t> h(static_cast<size_t>(n * d));
  fill_bf16_uniform(h.get(), n * d, 0x51, 1.0f);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 7919) % real);
  t[3] = -100;
  DevBuf<int32_t> dt(t.size());
  dt.from_host(t);
  std::vector<float> temps(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) temps[i] = 0.6f + 0.1f * static_cast<float>(i % 7);
  DevBuf<float> dtemps(temps.size());
  dtemps.from_host(temps);

  auto inputs = [&](const DevBuf<int32_t>& targets) {
    detlogp::LinearLogpInputs in;
    in.hidden = detlogp::TensorView::matrix(h.get(), detlogp::DType::bf16, n, d, detlogp::Memory::cuda);
    in.weight = detlogp::TensorView::matrix(m.weight.get(), detlogp::DType::bf16, v, d, detlogp::Memory::cuda);
    in.bias = detlogp::TensorView::vector(m.bias.get(), detlogp::DType::f32, v, detlogp::Memory::cuda);
    in.targets = detlogp::TensorView::vector(targets.get(), detlogp::DType::i32, n, detlogp::Memory::cuda);
    in.temperature_rows = detlogp::TensorView::vector(dtemps.get(), detlogp::DType::f32, n, detlogp::Memory::cuda);
    in.real_vocab = real;
    return in;
  };
  auto outputs = [&](Outputs& o) {
    detlogp::LinearLogpOutputs out;
    out.logp = detlogp::mutable_vector(o.logp.get(), detlogp::DType::f32, n, detlogp::Memory::cuda);
    out.lse = detlogp::mutable_vector(o.lse.get(), detlogp::DType::f32, n, detlogp::Memory::cuda);
    if (o.logits.size())
      out.logits = detlogp::mutable_matrix(o.logits.get(), detlogp::DType::f32, n, v, detlogp::Memory::cuda);
    return out;
  };
  detlogp::CallOptions lane;
  lane.backend = "cuda-cublas-materialized";

  const auto hh = h.to_host();
  const auto w = m.weight.to_host();
  const auto b = m.bias.to_host();
  for (bool serving : {false, true}) {
    Outputs o;
    o.make(n, v, serving);
    const detlogp::CallReport r = detlogp::linear_logp(inputs(dt), outputs(o), lane);
    GPU_EXPECT(r.provenance.backend_id == "cuda-cublas-materialized" && r.provenance.contract_version == 0,
               "report names " << r.provenance.backend_id << " v" << r.provenance.contract_version);
    const auto logp = o.logp.to_host(), lse = o.lse.to_host();
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const RefRow ref = reference_row(hh.data() + i * d, w, &b, d, v, real, temps[i], t[i]);
      const double dl = std::fabs(lse[i] - ref.lse),
                   dp = t[i] == -100 ? std::fabs(logp[i]) : std::fabs(logp[i] - ref.logp);
      worst = std::max(worst, std::max(dl, dp));
    }
    GPU_EXPECT(worst < 2e-4, "cuBLAS lane vs float64: max |d| = " << worst);
    std::printf("cuBLAS lane %s: max |dlogp|,|dlse| vs float64 = %.3g\n", serving ? "serving" : "trainer", worst);
  }
  {  // strict mode refuses the lane
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
    GPU_EXPECT(err.find("strict mode refuses backend 'cuda-cublas-materialized'") != std::string::npos,
               "strict error: '" << err << "'");
  }
  {  // a bad target: error, nothing written
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
    GPU_EXPECT(err.find("targets[9]=2053 is >= real_vocab=2053") != std::string::npos, "bad target: '" << err << "'");
    GPU_EXPECT(count_poison(o.logp.get(), n) == n && count_poison(o.lse.get(), n) == n, "lane wrote on a bad target");
  }
  return finish("test_cublas_lane");
}

// detlogp from an installed package: the fused operator on a tiny problem on the CPU contract
// backend, checked bit for bit against the contract reducer applied to the same logits (small
// integers, so h.W is exact in fp32 and both paths see identical logits). Exits 1 on a mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <detlogp/bitcmp.hpp>
#include <detlogp/detlogp.hpp>
#include <detlogp/fpops.hpp>
#include <vector>

int main() {
  constexpr int64_t N = 3, D = 4, V = 70;  // two vocab tiles, the second one partial
  std::vector<uint16_t> h(N * D), w(V * D);
  std::vector<float> z(N * V);  // the logits h.W, computed here
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) h[n * D + d] = detlogp::fp::bf16_round(n == 2 ? 0.0f : float((n + d) % 3) - 1.0f);
  for (int64_t v = 0; v < V; ++v)
    for (int64_t d = 0; d < D; ++d) w[v * D + d] = detlogp::fp::bf16_round(float((v * 7 + d * 3) % 5) - 2.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v) {
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d)
        acc += detlogp::fp::bf16_to_float(h[n * D + d]) * detlogp::fp::bf16_to_float(w[v * D + d]);
      z[n * V + v] = acc;  // |acc| <= 8: exact
    }
  const std::vector<int64_t> targets = {3, 69, 12};  // row 2 has h = 0: every logit is 0

  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(h.data(), detlogp::DType::bf16, N, D);
  in.weight = detlogp::TensorView::matrix(w.data(), detlogp::DType::bf16, V, D);
  in.targets = detlogp::TensorView::vector(targets.data(), detlogp::DType::i64, N);
  in.temperature = 0.5f;
  std::vector<float> logp(N), lse(N);
  detlogp::LinearLogpOutputs out{detlogp::mutable_vector(logp.data(), detlogp::DType::f32, N),
                                 detlogp::mutable_vector(lse.data(), detlogp::DType::f32, N),
                                 {}};
  detlogp::CallOptions opt;
  opt.backend = "cpu-linear-logp-contract-v1";
  opt.strict = true;
  const detlogp::CallReport report = detlogp::linear_logp(in, out, opt);

  detlogp::ReduceLogitsInputs rin;
  rin.logits = detlogp::TensorView::matrix(z.data(), detlogp::DType::f32, N, V);
  rin.targets = in.targets;
  rin.temperature = in.temperature;
  std::vector<float> logp_ref(N), lse_ref(N);
  detlogp::reduce_logits(rin, detlogp::mutable_vector(logp_ref.data(), detlogp::DType::f32, N),
                         detlogp::mutable_vector(lse_ref.data(), detlogp::DType::f32, N));

  std::printf("detlogp %s, served by %s\n", detlogp::version_string().c_str(), report.provenance.backend_id.c_str());
  for (int64_t n = 0; n < N; ++n)
    std::printf("row %lld: target %lld logp %.9g lse %.9g\n", static_cast<long long>(n),
                static_cast<long long>(targets[n]), logp[n], lse[n]);
  const detlogp::bitcmp::Result logp_cmp = detlogp::bitcmp::compare(logp_ref, logp);
  const detlogp::bitcmp::Result lse_cmp = detlogp::bitcmp::compare(lse_ref, lse);
  std::printf("%s\n%s\n", logp_cmp.describe("logp vs reduce_logits").c_str(),
              lse_cmp.describe("lse vs reduce_logits").c_str());
  bool ok = logp_cmp.identical() && lse_cmp.identical() && report.provenance.backend_id == opt.backend;
  // Row 2: all V logits are 0, so y_t = 0 and logp = -lse exactly, with lse = log(V) up to the
  // contract's logc.
  ok = ok && logp[2] == -lse[2] && std::fabs(lse[2] - std::log(float(V))) <= 1e-6f;
  std::printf("example: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// Small shapes through every launch bucket, both entries and partial mode: fully written outputs,
// CPU reduce_logits re-reduction bit-identical. Then special rows (NaN, +inf, logits spread far
// past expc_normal's domain, all-zero hidden) with and without bias, so the trainer entry runs both
// the plain epilogue (no bias) and the general one: each row's results stay in that row. Fast
// enough to run under compute-sanitizer (memcheck, racecheck, synccheck) in scripts/gpu_check.sh.
#include "gpu_test_util.hpp"

using namespace gput;

namespace {

// CPU re-reduction of [n][v] logits (the cross-backend oracle).
void cpu_reduce(const std::vector<float>& z, const std::vector<int32_t>& t, int64_t n, int64_t v,
                std::vector<float>& lp, std::vector<float>& ls) {
  lp.assign(n, 0.0f);
  ls.assign(n, 0.0f);
  detlogp::ReduceLogitsInputs ri;
  ri.logits = detlogp::TensorView::matrix(z.data(), detlogp::DType::f32, n, v);
  ri.targets = detlogp::TensorView::vector(t.data(), detlogp::DType::i32, n);
  detlogp::reduce_logits(ri, detlogp::mutable_vector(lp.data(), detlogp::DType::f32, n),
                         detlogp::mutable_vector(ls.data(), detlogp::DType::f32, n));
}

class Sm90Small : public Sm90Test {};

}  // namespace

TEST_F(Sm90Small, EveryBucketWritesEveryOutputAndMatchesTheCpuReduction) {
  struct S {
    int64_t n, d, v;
  };
  const S shapes[] = {{37, 64, 2053}, {3, 72, 130}, {130, 128, 300}};
  for (const auto& s : shapes)
    for (const std::string& name : sm90_bucket_names()) {
      const char* bucket = name.c_str();
      ScopedEnv env("DETLOGP_SM90_BUCKET", bucket);
      DeviceModel m;
      m.make(s.d, s.v, 3, true);
      DevBuf<uint16_t> hidden(static_cast<size_t>(s.n * s.d));
      fill_bf16_uniform(hidden.get(), s.n * s.d, 4, 1.0f);
      std::vector<int32_t> t(static_cast<size_t>(s.n));
      for (int64_t i = 0; i < s.n; ++i) t[i] = i % 4 == 1 ? -100 : static_cast<int32_t>((i * 977) % s.v);
      DevBuf<int32_t> dt(t.size());
      dt.from_host(t);
      Outputs o;
      o.make(s.n, s.v, true);
      auto p = device_problem(m, hidden.get(), s.n, dt.get(), o);
      try {
        sm90().run(p);
      } catch (const std::exception& e) {
        ADD_FAILURE() << bucket << " N=" << s.n << ": " << e.what();
        continue;
      }
      EXPECT_TRUE(count_poison(o.logits.get(), s.n * s.v) == 0 && count_poison(o.logp.get(), s.n) == 0 &&
                  count_poison(o.lse.get(), s.n) == 0)
          << bucket << " N=" << s.n << " V=" << s.v << ": outputs not fully written";
      const auto z = o.logits.to_host();
      std::vector<float> lp, ls;
      cpu_reduce(z, t, s.n, s.v, lp, ls);
      auto a = detlogp::bitcmp::compare(lp, o.logp.to_host()), b = detlogp::bitcmp::compare(ls, o.lse.to_host());
      EXPECT_TRUE(a.identical() && b.identical())
          << bucket << " N=" << s.n << ": " << a.describe("logp") << "; " << b.describe("lse");

      // Partial mode over the whole shard.
      const int64_t tiles = (s.v + 63) / 64;
      DevBuf<detlogp::TileSummary> sums(static_cast<size_t>(s.n * tiles));
      DevBuf<float> tl(static_cast<size_t>(s.n));
      DevBuf<uint8_t> owned(static_cast<size_t>(s.n));
      Outputs none;
      auto pp = device_problem(m, hidden.get(), s.n, dt.get(), none);
      pp.logp = pp.lse = nullptr;
      pp.summaries = sums.get();
      pp.target_logit = tl.get();
      pp.target_owned = owned.get();
      EXPECT_NO_THROW(sm90().run(pp)) << bucket << " N=" << s.n << " partial mode";
      GPU_CUDA(cudaDeviceSynchronize());
    }
}

TEST_F(Sm90Small, SpecialRowsStayInTheirRowWithAndWithoutBias) {
  // A whole 256-column fragment first (the 256-column buckets' wide epilogue, with its warp vote and
  // slow path, sees every special row), then three whole vocab tiles and one of 8 lanes (the general
  // epilogue).
  const int64_t n = 40, d = 64, v = 456;
  constexpr int64_t kNanRow = 3, kInfRow = 5, kWideRow = 7, kZeroRow = 9;
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = i % 5 == 2 ? -100 : static_cast<int32_t>((i * 7) % v);
  DevBuf<int32_t> dt(t.size());
  dt.from_host(t);
  for (const bool with_bias : {false, true}) {
    DeviceModel m;
    m.make(d, v, 5, with_bias);
    DevBuf<uint16_t> clean(static_cast<size_t>(n * d));
    fill_bf16_uniform(clean.get(), n * d, 6, 1.0f);
    auto h = clean.to_host();
    h[kNanRow * d + 10] = 0x7FC0u;  // NaN
    h[kInfRow * d + 20] = 0x7F80u;  // +inf
    for (int64_t k = 0; k < d; ++k) {
      // x3000: logits spread by thousands, so most exponent arguments fall below -87 (expc's branches).
      h[kWideRow * d + k] = detlogp::fp::bf16_round(detlogp::fp::bf16_to_float(h[kWideRow * d + k]) * 3000.0f);
      h[kZeroRow * d + k] = 0;
    }
    DevBuf<uint16_t> special(h.size());
    special.from_host(h);
    for (const std::string& name : sm90_bucket_names()) {
      ScopedEnv env("DETLOGP_SM90_BUCKET", name.c_str());
      const std::string what = name + (with_bias ? " bias" : " no bias");
      Outputs serving, trainer, reference;
      serving.make(n, v, true);
      trainer.make(n, v, false);
      reference.make(n, v, true);
      auto ps = device_problem(m, special.get(), n, dt.get(), serving);
      auto pt = device_problem(m, special.get(), n, dt.get(), trainer);
      auto pr = device_problem(m, clean.get(), n, dt.get(), reference);
      try {
        sm90().run(ps);
        sm90().run(pt);
        sm90().run(pr);
      } catch (const std::exception& e) {
        ADD_FAILURE() << what << ": " << e.what();
        continue;
      }
      const auto z = serving.logits.to_host(), zr = reference.logits.to_host();
      std::vector<float> lp, ls;
      cpu_reduce(z, t, n, v, lp, ls);
      const auto slp = serving.logp.to_host(), sls = serving.lse.to_host();
      const auto tlp = trainer.logp.to_host(), tls = trainer.lse.to_host();
      const auto rlp = reference.logp.to_host(), rls = reference.lse.to_host();
      auto a = detlogp::bitcmp::compare(lp, slp), b = detlogp::bitcmp::compare(ls, sls);
      auto c = detlogp::bitcmp::compare(lp, tlp), e = detlogp::bitcmp::compare(ls, tls);
      EXPECT_TRUE(a.identical() && b.identical())
          << what << " serving: " << a.describe("logp") << "; " << b.describe("lse");
      EXPECT_TRUE(c.identical() && e.identical())
          << what << " trainer: " << c.describe("logp") << "; " << e.describe("lse");
      EXPECT_EQ(detlogp::fp::bits(tlp[kNanRow]), detlogp::kCanonicalNanBits) << what << ": the NaN row's logp";
      EXPECT_EQ(detlogp::fp::bits(tls[kNanRow]), detlogp::kCanonicalNanBits) << what << ": the NaN row's lse";
      // Every other row: the same logits and results as without the special rows.
      long long leaked = 0;
      for (int64_t r = 0; r < n; ++r) {
        if (r == kNanRow || r == kInfRow || r == kWideRow || r == kZeroRow) continue;
        bool same = same_bits(tlp[r], rlp[r]) && same_bits(tls[r], rls[r]);
        for (int64_t col = 0; col < v && same; ++col) same = same_bits(z[r * v + col], zr[r * v + col]);
        if (!same) ++leaked;
      }
      EXPECT_EQ(leaked, 0) << what << ": ordinary rows differ from the run without special rows";
    }
  }
}

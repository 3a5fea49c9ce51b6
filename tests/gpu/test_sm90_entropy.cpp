// The SM90 entropy output (docs/contract.md §10): in every launch bucket, on both entries and in
// partial mode, the entropy bits equal the CPU reduction of the SM90 serving logits
// (reduce_logits(..., entropy)), logp and lse keep the bits they have without it, rows stay in
// their row, the bits do not depend on N, position or the N chunking, the device merge over
// rank-ordered partials gives the TP = 1 bits, and the accuracy bound holds at the Qwen3-8B head.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "core/device_ops.hpp"
#include "gpu_test_util.hpp"

using namespace gput;

namespace {

class Sm90Entropy : public Sm90Test {};

// CPU reduction of [n][v] logits with entropy, at per-row temperatures (empty: T = 1).
struct CpuReduced {
  std::vector<float> logp, lse, entropy;
};
CpuReduced cpu_reduce(const std::vector<float>& z, const std::vector<int32_t>& t, int64_t n, int64_t v,
                      int64_t real_vocab, const std::vector<float>& temps) {
  CpuReduced r;
  r.logp.assign(n, 0.0f);
  r.lse.assign(n, 0.0f);
  r.entropy.assign(n, 0.0f);
  detlogp::ReduceLogitsInputs ri;
  ri.logits = detlogp::TensorView::matrix(z.data(), detlogp::DType::f32, n, v);
  ri.targets = detlogp::TensorView::vector(t.data(), detlogp::DType::i32, n);
  ri.real_vocab = real_vocab;
  if (!temps.empty()) ri.temperature_rows = detlogp::TensorView::vector(temps.data(), detlogp::DType::f32, n);
  detlogp::reduce_logits(ri, detlogp::mutable_vector(r.logp.data(), detlogp::DType::f32, n),
                         detlogp::mutable_vector(r.lse.data(), detlogp::DType::f32, n),
                         detlogp::mutable_vector(r.entropy.data(), detlogp::DType::f32, n));
  return r;
}

// One run of the backend with an entropy output (poisoned first).
struct EntropyRun {
  Outputs out;
  DevBuf<float> entropy;
};
void run_with_entropy(const DeviceModel& m, const uint16_t* hidden, int64_t n, const int32_t* targets,
                      const float* temps, int64_t real_vocab, bool serving, EntropyRun& r) {
  r.out.make(n, m.vocab, serving);
  r.entropy = DevBuf<float>(static_cast<size_t>(n));
  r.entropy.poison();
  auto p = device_problem(m, hidden, n, targets, r.out);
  p.real_vocab = real_vocab;
  p.temperature_rows = temps;
  p.entropy = r.entropy.get();
  sm90().run(p);
  GPU_CUDA(cudaDeviceSynchronize());
}

}  // namespace

TEST_F(Sm90Entropy, EveryBucketMatchesTheCpuReductionOfItsLogitsAndLeavesLogpAndLseUnchanged) {
  struct S {
    int64_t n, d, v, real;
    bool bias, temps;
  };
  const S shapes[] = {{37, 64, 2053, 2053, false, false}, {3, 72, 130, 130, true, true},
                      {130, 128, 300, 260, true, false},  {5, 64, 17, 17, false, true},
                      {9, 64, 123, 123, true, true},      {70, 64, 512, 512, false, true}};
  for (const auto& s : shapes) {
    DeviceModel m;
    m.make(s.d, s.v, 11, s.bias);
    DevBuf<uint16_t> hidden(static_cast<size_t>(s.n * s.d));
    fill_bf16_uniform(hidden.get(), s.n * s.d, 12, 1.0f);
    std::vector<int32_t> t(static_cast<size_t>(s.n));
    for (int64_t i = 0; i < s.n; ++i) t[i] = i % 4 == 1 ? -100 : static_cast<int32_t>((i * 977) % s.real);
    DevBuf<int32_t> dt(t.size());
    dt.from_host(t);
    std::vector<float> temps;
    DevBuf<float> dtemps;
    if (s.temps) {
      temps.resize(static_cast<size_t>(s.n));
      for (int64_t i = 0; i < s.n; ++i) temps[i] = i % 3 == 0 ? 1.0f : 0.3f + 0.1f * static_cast<float>(i % 7);
      dtemps = DevBuf<float>(temps.size());
      dtemps.from_host(temps);
    }
    for (const std::string& name : sm90_bucket_names()) {
      ScopedEnv env("DETLOGP_SM90_BUCKET", name.c_str());
      const std::string what = name + " N=" + std::to_string(s.n) + " V=" + std::to_string(s.v) +
                               (s.bias ? " bias" : "") + (s.temps ? " row temperatures" : "");
      EntropyRun serving, trainer;
      Outputs plain;
      plain.make(s.n, s.v, false);
      try {
        run_with_entropy(m, hidden.get(), s.n, dt.get(), dtemps.get(), s.real, true, serving);
        run_with_entropy(m, hidden.get(), s.n, dt.get(), dtemps.get(), s.real, false, trainer);
        auto pp = device_problem(m, hidden.get(), s.n, dt.get(), plain);
        pp.real_vocab = s.real;
        pp.temperature_rows = dtemps.get();
        sm90().run(pp);
        GPU_CUDA(cudaDeviceSynchronize());
      } catch (const std::exception& e) {
        ADD_FAILURE() << what << ": " << e.what();
        continue;
      }
      EXPECT_EQ(count_poison(serving.entropy.get(), s.n), 0) << what << ": entropy not fully written";
      const auto z = serving.out.logits.to_host();
      const CpuReduced cpu = cpu_reduce(z, t, s.n, s.v, s.real, temps);
      const auto se = serving.entropy.to_host(), te = trainer.entropy.to_host();
      auto a = detlogp::bitcmp::compare(cpu.entropy, se), b = detlogp::bitcmp::compare(cpu.entropy, te);
      EXPECT_TRUE(a.identical()) << what << " serving: " << a.describe("entropy");
      EXPECT_TRUE(b.identical()) << what << " trainer: " << b.describe("entropy");
      // logp and lse: the CPU's, and the bits of the run without entropy.
      auto c = detlogp::bitcmp::compare(cpu.logp, serving.out.logp.to_host());
      auto d = detlogp::bitcmp::compare(plain.logp.to_host(), trainer.out.logp.to_host());
      auto e = detlogp::bitcmp::compare(plain.lse.to_host(), trainer.out.lse.to_host());
      EXPECT_TRUE(c.identical() && d.identical() && e.identical())
          << what << ": " << c.describe("serving logp") << "; " << d.describe("trainer logp") << "; "
          << e.describe("trainer lse");
    }
  }
}

TEST_F(Sm90Entropy, SpecialRowsStayInTheirRow) {
  // NaN, +inf, logits spread far past expc_normal's domain (the slow path), all-zero hidden (a flat
  // row: H = log V), and a row peaked on one lane (H near 0), with and without bias.
  const int64_t n = 40, d = 64, v = 456;
  constexpr int64_t kNanRow = 3, kInfRow = 5, kWideRow = 7, kZeroRow = 9, kPeakRow = 11;
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
    const auto w = m.weight.to_host();
    h[kNanRow * d + 10] = 0x7FC0u;
    h[kInfRow * d + 20] = 0x7F80u;
    for (int64_t k = 0; k < d; ++k) {
      h[kWideRow * d + k] = detlogp::fp::bf16_round(detlogp::fp::bf16_to_float(h[kWideRow * d + k]) * 3000.0f);
      h[kZeroRow * d + k] = 0;
      h[kPeakRow * d + k] = detlogp::fp::bf16_round(detlogp::fp::bf16_to_float(w[100 * d + k]) * 400.0f);
    }
    DevBuf<uint16_t> special(h.size());
    special.from_host(h);
    for (const std::string& name : sm90_bucket_names()) {
      ScopedEnv env("DETLOGP_SM90_BUCKET", name.c_str());
      const std::string what = name + (with_bias ? " bias" : " no bias");
      EntropyRun serving, trainer, reference;
      try {
        run_with_entropy(m, special.get(), n, dt.get(), nullptr, v, true, serving);
        run_with_entropy(m, special.get(), n, dt.get(), nullptr, v, false, trainer);
        run_with_entropy(m, clean.get(), n, dt.get(), nullptr, v, false, reference);
      } catch (const std::exception& e) {
        ADD_FAILURE() << what << ": " << e.what();
        continue;
      }
      const CpuReduced cpu = cpu_reduce(serving.out.logits.to_host(), t, n, v, v, {});
      const auto se = serving.entropy.to_host(), te = trainer.entropy.to_host(), re = reference.entropy.to_host();
      auto a = detlogp::bitcmp::compare(cpu.entropy, se), b = detlogp::bitcmp::compare(cpu.entropy, te);
      EXPECT_TRUE(a.identical() && b.identical())
          << what << ": " << a.describe("serving") << "; " << b.describe("trainer");
      EXPECT_EQ(detlogp::fp::bits(te[kNanRow]), detlogp::kCanonicalNanBits) << what << ": the NaN row's entropy";
      if (!with_bias) {
        EXPECT_EQ(detlogp::fp::bits(te[kZeroRow]), detlogp::fp::bits(detlogp::logc(static_cast<float>(v))))
            << what << ": a flat row's entropy is logc(V)";
      }
      EXPECT_GE(te[kPeakRow], 0.0f) << what;
      EXPECT_LT(te[kPeakRow], 1e-3f) << what << ": a peaked row's entropy is near 0";
      long long leaked = 0;
      for (int64_t r = 0; r < n; ++r) {
        if (r == kNanRow || r == kInfRow || r == kWideRow || r == kZeroRow || r == kPeakRow) continue;
        if (!same_bits(te[r], re[r])) ++leaked;
      }
      EXPECT_EQ(leaked, 0) << what << ": ordinary rows' entropy differs from the run without special rows";
    }
  }
}

TEST_F(Sm90Entropy, BitsDoNotDependOnNPositionOrChunking) {
  // A pool of rows; each call takes a permuted subset of N rows (auto bucket, and small workspaces
  // that chunk N): every row's entropy equals its bits in the N = 1 call.
  const int64_t pool = options().small ? 96 : 1200, d = 128, v = 5000;
  DeviceModel m;
  m.make(d, v, 21, false);
  DevBuf<uint16_t> pool_h(static_cast<size_t>(pool * d));
  fill_bf16_uniform(pool_h.get(), pool * d, 22, 1.0f);
  std::vector<int32_t> pool_t(static_cast<size_t>(pool));
  for (int64_t i = 0; i < pool; ++i) pool_t[i] = static_cast<int32_t>((i * 131) % v);
  // Reference: each row alone (N = 1).
  std::vector<float> alone(static_cast<size_t>(pool));
  const auto hh = pool_h.to_host();
  const int64_t probe_rows = std::min<int64_t>(pool, 24);
  for (int64_t i = 0; i < probe_rows; ++i) {
    DevBuf<uint16_t> one(static_cast<size_t>(d));
    one.from_host(std::vector<uint16_t>(hh.begin() + i * d, hh.begin() + (i + 1) * d));
    DevBuf<int32_t> ti(1);
    ti.from_host({pool_t[i]});
    EntropyRun r;
    run_with_entropy(m, one.get(), 1, ti.get(), nullptr, v, false, r);
    alone[i] = r.entropy.to_host()[0];
  }
  // N = 7 and 64: the held schedule; the pool (1200) and 2500 rows: the lanes schedule with 4 and
  // 8 rows per CTA (chunked to fewer rows by the 1 MiB workspace).
  std::vector<int64_t> sizes{7, 64, pool};
  if (!options().small) sizes.push_back(2500);
  for (const int64_t n : sizes) {
    for (const char* ws : {"", "1"}) {
      ScopedEnv env("DETLOGP_SM90_WORKSPACE_MB", ws[0] ? std::optional<std::string>(ws) : std::nullopt);
      // Rows in reverse order starting at the probe rows' mirror positions.
      std::vector<int64_t> idx(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) idx[i] = (n - 1 - i) % pool;
      std::vector<uint16_t> h(static_cast<size_t>(n * d));
      std::vector<int32_t> t(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        std::copy(hh.begin() + idx[i] * d, hh.begin() + (idx[i] + 1) * d, h.begin() + i * d);
        t[i] = pool_t[idx[i]];
      }
      DevBuf<uint16_t> dh(h.size());
      dh.from_host(h);
      DevBuf<int32_t> dt(t.size());
      dt.from_host(t);
      for (const bool serving : {false, true}) {
        EntropyRun r;
        run_with_entropy(m, dh.get(), n, dt.get(), nullptr, v, serving, r);
        const auto e = r.entropy.to_host();
        long long differ = 0;
        for (int64_t i = 0; i < n; ++i)
          if (idx[i] < probe_rows && !same_bits(e[i], alone[idx[i]])) ++differ;
        EXPECT_EQ(differ, 0) << "N=" << n << " workspace '" << ws << "' " << (serving ? "serving" : "trainer");
      }
    }
  }
}

TEST_F(Sm90Entropy, DeviceMergeOfShardPartialsGivesTheTp1Bits) {
  // Partial mode on 64-aligned shards with the entropy sums, merged on the device in rank order:
  // the entropy (and logp, lse) bits of the full-vocabulary call.
  const int64_t n = options().small ? 20 : 300, d = 64, v = 1000, real = 990;
  DeviceModel m;
  m.make(d, v, 31, true);
  DevBuf<uint16_t> hidden(static_cast<size_t>(n * d));
  fill_bf16_uniform(hidden.get(), n * d, 32, 1.0f);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = i % 6 == 0 ? -100 : static_cast<int32_t>((i * 37) % real);
  DevBuf<int32_t> dt(t.size());
  dt.from_host(t);
  EntropyRun full;
  run_with_entropy(m, hidden.get(), n, dt.get(), nullptr, real, false, full);

  const int64_t bounds[] = {0, 320, 640, v};
  struct Shard {
    DevBuf<detlogp::TileSummary> sums;
    DevBuf<float> usums, target_logit;
    DevBuf<uint8_t> owned;
    int64_t tiles = 0;
  };
  Shard shards[3];
  std::vector<detlogp::detail::DeviceMergeRank> ranks;
  const auto w = m.weight.to_host();
  const auto b = m.bias.to_host();
  DevBuf<uint16_t> wshard[3];
  DevBuf<float> bshard[3];
  for (int r = 0; r < 3; ++r) {
    const int64_t v0 = bounds[r], vl = bounds[r + 1] - bounds[r];
    Shard& s = shards[r];
    s.tiles = (vl + 63) / 64;
    s.sums = DevBuf<detlogp::TileSummary>(static_cast<size_t>(n * s.tiles));
    s.usums = DevBuf<float>(static_cast<size_t>(n * s.tiles));
    s.usums.poison();
    s.target_logit = DevBuf<float>(static_cast<size_t>(n));
    s.owned = DevBuf<uint8_t>(static_cast<size_t>(n));
    wshard[r] = DevBuf<uint16_t>(static_cast<size_t>(vl * d));
    wshard[r].from_host(std::vector<uint16_t>(w.begin() + v0 * d, w.begin() + (v0 + vl) * d));
    bshard[r] = DevBuf<float>(static_cast<size_t>(vl));
    bshard[r].from_host(std::vector<float>(b.begin() + v0, b.begin() + v0 + vl));
    Outputs none;
    auto p = device_problem(m, hidden.get(), n, dt.get(), none);
    p.logp = p.lse = nullptr;
    p.weight = wshard[r].get();
    p.bias = bshard[r].get();
    p.vocab_start = v0;
    p.vocab_local = vl;
    p.real_vocab = real;
    p.summaries = s.sums.get();
    p.usums = s.usums.get();
    p.target_logit = s.target_logit.get();
    p.target_owned = s.owned.get();
    sm90().run(p);
    ranks.push_back({s.sums.get(), s.tiles, s.target_logit.get(), s.owned.get(), s.usums.get()});
  }
  GPU_CUDA(cudaDeviceSynchronize());
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(count_poison(shards[r].usums.get(), n * shards[r].tiles), 0) << "rank " << r << ": usums not written";
  for (const bool few : {true, false}) {  // the merge's held schedule (<= 256 rows) and its chunked one
    const int64_t rows = few ? std::min<int64_t>(n, 200) : n;
    DevBuf<float> lp(static_cast<size_t>(rows)), ls(static_cast<size_t>(rows)), ent(static_cast<size_t>(rows));
    ent.poison();
    detlogp::detail::device_merge(ranks, rows, dt.get(), false, -100, lp.get(), ls.get(), 0, nullptr, ent.get());
    GPU_CUDA(cudaDeviceSynchronize());
    auto fe = full.entropy.to_host(), fl = full.out.logp.to_host(), fs = full.out.lse.to_host();
    fe.resize(rows);
    fl.resize(rows);
    fs.resize(rows);
    auto a = detlogp::bitcmp::compare(fe, ent.to_host()), c = detlogp::bitcmp::compare(fl, lp.to_host()),
         e = detlogp::bitcmp::compare(fs, ls.to_host());
    EXPECT_TRUE(a.identical() && c.identical() && e.identical())
        << rows << " rows: " << a.describe("entropy") << "; " << c.describe("logp") << "; " << e.describe("lse");
  }
}

TEST_F(Sm90Entropy, MeetsTheAccuracyBoundAtTheQwen3Head) {
  // |H - H_fp64| <= 1e-4 max(1, H) on random, peaked (logp near 0), flat (H near log V) and
  // large-logit (|z| ~ 80 at T = 0.3) rows, where H_fp64 is the float64 entropy of the SM90's own
  // fp32 logits: the error of the entropy's reduction. The end-to-end error against float64 logits
  // of the same bf16 inputs is reported beside it; it adds the fp32 GEMM's error on z, which the
  // entropy amplifies by |log p + H| / T per lane (a logit error, like lse's, outside the reduction).
  if (options().small) GTEST_SKIP() << "--small: the Qwen3-8B head is not a small shape";
  const int64_t d = 4096, v = 151936, per_kind = 4;
  const int64_t n = 4 * per_kind;
  DevBuf<uint16_t> weight(static_cast<size_t>(v * d));
  fill_bf16_uniform(weight.get(), v * d, 41, 0.0346f);  // uniform with std 0.02
  DeviceModel m;
  m.dim = d;
  m.vocab = v;
  m.weight = std::move(weight);
  const auto w = m.weight.to_host();
  DevBuf<uint16_t> base(static_cast<size_t>(n * d));
  fill_bf16_uniform(base.get(), n * d, 42, 1.0f);
  auto h = base.to_host();
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::vector<float> temps(static_cast<size_t>(n), 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t kind = i / per_kind;
    t[i] = static_cast<int32_t>((i * 7919) % v);
    for (int64_t k = 0; k < d; ++k) {
      const float x = detlogp::fp::bf16_to_float(h[i * d + k]);
      float y = x * 1.7f;  // random: unit-RMS hidden
      // peaked on the target: z_t ~ 1.64 c above logits of std ~ 0.026 c (c = 8 + 2 j: logp -1e-2 .. -1e-6)
      if (kind == 1) y = detlogp::fp::bf16_to_float(w[t[i] * d + k]) * static_cast<float>(8 + 2 * (i % per_kind));
      if (kind == 2) y = x * 0.01f;  // flat
      if (kind == 3) y = x * 24.0f;  // logits of std ~ 18, max |z| ~ 80, at T = 0.3
      h[i * d + k] = detlogp::fp::bf16_round(y);
    }
    if (kind == 3) temps[i] = 0.3f;
  }
  DevBuf<uint16_t> dh(h.size());
  dh.from_host(h);
  DevBuf<int32_t> dt(t.size());
  dt.from_host(t);
  DevBuf<float> dtemps(temps.size());
  dtemps.from_host(temps);
  EntropyRun r;
  run_with_entropy(m, dh.get(), n, dt.get(), dtemps.get(), v, true, r);
  const auto e = r.entropy.to_host();
  const auto z32 = r.out.logits.to_host();
  const auto lp = r.out.logp.to_host();
  // float64 entropy of logits z (as double) at temperature T.
  auto entropy_f64 = [&](auto logit, double temp) {
    double s = 0, u = 0, mx = -INFINITY;
    for (int64_t c = 0; c < v; ++c) mx = std::max(mx, logit(c) / temp);
    for (int64_t c = 0; c < v; ++c) {
      const double x = logit(c) / temp - mx;
      s += std::exp(x);
      u += std::exp(x) * x;
    }
    return std::log(s) - u / s;
  };
  const char* kinds[] = {"random", "peaked", "flat", "large"};
  double worst[4] = {0, 0, 0, 0}, worst_e2e[4] = {0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) {
    const double same = entropy_f64([&](int64_t c) { return static_cast<double>(z32[i * v + c]); }, temps[i]);
    const RefRow ref = reference_row(h.data() + i * d, w, nullptr, d, v, v, temps[i], t[i]);
    const double exact = entropy_f64([&](int64_t c) { return ref.z[c]; }, temps[i]);
    const double err = std::fabs(static_cast<double>(e[i]) - same) / std::max(1.0, same);
    const double e2e = std::fabs(static_cast<double>(e[i]) - exact) / std::max(1.0, exact);
    const int64_t kind = i / per_kind;
    worst[kind] = std::max(worst[kind], err);
    worst_e2e[kind] = std::max(worst_e2e[kind], e2e);
    EXPECT_LE(err, 1e-4) << kinds[kind] << " row " << i << ": H = " << e[i] << ", fp64 of its logits " << same;
    std::printf(
        "INFO entropy accuracy %-6s row %2lld: H %.7g logp %.3g | fp64 of the SM90 logits %.9g rel err %.2e | "
        "fp64 GEMM %.9g rel err %.2e\n",
        kinds[kind], static_cast<long long>(i), e[i], lp[i], same, err, exact, e2e);
  }
  for (int k = 0; k < 4; ++k)
    std::printf(
        "INFO entropy accuracy at D=4096 V=151936, %s rows: worst |H - H_fp64| / max(1, H) %.2e (reduction), "
        "%.2e (end to end)\n",
        kinds[k], worst[k], worst_e2e[k]);
}

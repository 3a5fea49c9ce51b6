// Bit-level promises of the SM90 backend (CONTRACT.md §3): L1 run-to-run, L2 per-row bits
// independent of N, row position, permutation, launch bucket, serving on/off and N chunking;
// temperature per row vs scalar; bias added once after the K walk; padded vs real vocabulary;
// ignore_index; tensor-parallel partials (tile summaries equal the contract's tile_summary of the
// logits, and merged shards equal the full run); i64 vs i32 targets.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <utility>

#include "gpu_test_util.hpp"
#include "sm90/workspace.hpp"
#include "test_random.hpp"
#include "tp/tp_merge.hpp"

using namespace gput;
using detlogp::bitcmp::compare;
using detlogp::fp::bits;
using detlogp_test::Rng;

namespace {

std::vector<int32_t> random_targets(int64_t n, int64_t vocab, uint64_t seed, int ignore_every) {
  Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    t[i] = (ignore_every > 0 && i % ignore_every == ignore_every - 1) ? -100 : static_cast<int32_t>(rng.below(vocab));
  return t;
}

struct Base {
  std::vector<float> logp, lse;
  DevBuf<float> logits;  // [pool][vocab] when kept
};

// Runs rows idx of the pool and compares every output row with the base run's row idx[i].
void run_subset(const char* what, const DeviceModel& m, const DevBuf<uint16_t>& pool_hidden,
                const std::vector<int32_t>& pool_targets, const Base& base, const std::vector<int64_t>& idx,
                bool serving) {
  const int64_t n = static_cast<int64_t>(idx.size());
  DevBuf<int64_t> didx(idx.size());
  didx.from_host(idx);
  DevBuf<uint16_t> hidden(static_cast<size_t>(n * m.dim));
  gather_rows_bf16(hidden.get(), pool_hidden.get(), didx.get(), n, m.dim);
  std::vector<int32_t> t(idx.size());
  for (int64_t i = 0; i < n; ++i) t[i] = pool_targets[idx[i]];
  DevBuf<int32_t> dt(t.size());
  dt.from_host(t);
  Outputs o;
  o.make(n, m.vocab, serving);
  auto p = device_problem(m, hidden.get(), n, dt.get(), o);
  try {
    sm90().run(p);
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": exception " << e.what();
    return;
  }
  const auto logp = o.logp.to_host(), lse = o.lse.to_host();
  std::vector<float> el(idx.size()), es(idx.size());
  for (int64_t i = 0; i < n; ++i) {
    el[i] = base.logp[idx[i]];
    es[i] = base.lse[idx[i]];
  }
  auto a = compare(el, logp), b = compare(es, lse);
  EXPECT_TRUE(a.identical() && b.identical()) << what << " N=" << n << (serving ? " serving" : " trainer") << ": "
                                              << a.describe("logp") << "; " << b.describe("lse");
  if (serving && base.logits.size()) {
    const RowMismatch mm = compare_logit_rows(o.logits.get(), base.logits.get(), didx.get(), n, m.vocab);
    EXPECT_EQ(mm.count, 0u) << what << " N=" << n << " logits: elements differ, first at row "
                            << mm.first_flat / m.vocab << " col " << mm.first_flat % m.vocab;
  }
}

// n distinct rows of the pool at random positions in random order (a Fisher-Yates prefix).
std::vector<int64_t> sample(int64_t pool, int64_t n, Rng& rng) {
  std::vector<int64_t> all(static_cast<size_t>(pool));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t i = 0; i < n; ++i) std::swap(all[i], all[i + rng.below(pool - i)]);
  all.resize(static_cast<size_t>(n));
  return all;
}

Base base_run(const DeviceModel& m, const DevBuf<uint16_t>& hidden, int64_t rows, const DevBuf<int32_t>& targets,
              bool keep_logits) {
  Base b;
  Outputs t, s;
  t.make(rows, m.vocab, false);
  auto pt = device_problem(m, hidden.get(), rows, targets.get(), t);
  sm90().run(pt);
  b.logp = t.logp.to_host();
  b.lse = t.lse.to_host();
  if (keep_logits) {
    s.make(rows, m.vocab, true);
    auto ps = device_problem(m, hidden.get(), rows, targets.get(), s);
    sm90().run(ps);
    EXPECT_EQ(count_poison(s.logits.get(), rows * m.vocab), 0) << "base serving logits not fully written";
    auto a = compare(b.logp, s.logp.to_host()), c = compare(b.lse, s.lse.to_host());
    EXPECT_TRUE(a.identical() && c.identical())
        << "base serving vs trainer: " << a.describe("logp") << "; " << c.describe("lse");
    b.logits = std::move(s.logits);
  }
  return b;
}

class Sm90Invariance : public Sm90Test {};

}  // namespace

TEST_F(Sm90Invariance, MediumShapeRowBitsIndependentOfBatchBucketChunkingTargetsTypeAndShards) {
  std::printf("-- L2 medium shape D=1024 V=30522 (bias), pool 16384\n");
  const int64_t pool = 16384;
  DeviceModel m;
  m.make(1024, 30522, 11, true);
  DevBuf<uint16_t> hidden(static_cast<size_t>(pool * m.dim));
  fill_bf16_uniform(hidden.get(), pool * m.dim, 12, 1.0f);
  const auto targets = random_targets(pool, m.vocab, 13, 9);
  DevBuf<int32_t> dt(targets.size());
  dt.from_host(targets);
  const Base base = base_run(m, hidden, pool, dt, true);
  for (size_t i = 0; i < base.logp.size(); ++i)
    if (bits(base.logp[i]) == 0xFFFFFFFFu || bits(base.lse[i]) == 0xFFFFFFFFu) {
      ADD_FAILURE() << "base row " << i << " not written";
      break;
    }

  const std::vector<std::string> buckets = sm90_bucket_names();
  Rng g(99);
  const int64_t ns[] = {1, 2, 3, 7, 31, 63, 64, 65, 127, 128, 129, 1000, 4096, 16384};
  int runs = 0;
  for (int64_t n : ns)
    for (const std::string& name : buckets)
      for (bool serving : {false, true}) {
        const char* bucket = name.c_str();
        ScopedEnv env("DETLOGP_SM90_BUCKET", bucket);
        const auto idx = sample(pool, n, g);
        run_subset(bucket, m, hidden, targets, base, idx, serving);
        ++runs;
      }
  std::printf("   %d subset runs (14 N x %zu buckets x serving on/off) compared per row with the base run\n", runs,
              buckets.size());

  // N chunking (workspace cap 1 MiB -> 256-row chunks) is bit-neutral.
  {
    ScopedEnv env(detlogp::sm90::kWorkspaceEnv, "1");
    std::printf("   chunked run: %lld rows per chunk\n",
                (long long)detlogp::sm90::chunk_rows(pool, (m.vocab + 63) / 64));
    std::vector<int64_t> all(static_cast<size_t>(pool));
    std::iota(all.begin(), all.end(), 0);
    run_subset("chunked", m, hidden, targets, base, all, false);
  }

  // i64 targets give the same bits as i32.
  {
    std::vector<int64_t> t64(targets.begin(), targets.end());
    DevBuf<int64_t> d64(t64.size());
    d64.from_host(t64);
    Outputs o;
    o.make(pool, m.vocab, false);
    auto p = device_problem(m, hidden.get(), pool, nullptr, o);
    p.targets = d64.get();
    p.targets_i64 = true;
    sm90().run(p);
    auto a = compare(base.logp, o.logp.to_host()), b = compare(base.lse, o.lse.to_host());
    EXPECT_TRUE(a.identical() && b.identical()) << "i64 targets: " << a.describe("logp") << "; " << b.describe("lse");
  }

  // Tensor-parallel partials: two shards split at a tile boundary.
  {
    const int64_t n = 300, split = 15360;
    const auto idx = sample(pool, n, g);
    DevBuf<int64_t> didx(idx.size());
    didx.from_host(idx);
    DevBuf<uint16_t> h(static_cast<size_t>(n * m.dim));
    gather_rows_bf16(h.get(), hidden.get(), didx.get(), n, m.dim);
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) t[i] = targets[idx[i]];
    DevBuf<int32_t> dt2(t.size());
    dt2.from_host(t);
    struct Shard {
      int64_t start, count, tiles;
      DevBuf<detlogp::TileSummary> sums;
      DevBuf<float> tl;
      DevBuf<uint8_t> owned;
      std::vector<detlogp::TileSummary> hs;
      std::vector<float> htl;
      std::vector<uint8_t> howned;
    };
    Shard shards[2];
    shards[0].start = 0;
    shards[0].count = split;
    shards[1].start = split;
    shards[1].count = m.vocab - split;
    std::vector<detlogp::ShardPartials> parts;
    for (auto& s : shards) {
      s.tiles = (s.count + 63) / 64;
      s.sums = DevBuf<detlogp::TileSummary>(static_cast<size_t>(n * s.tiles));
      s.tl = DevBuf<float>(static_cast<size_t>(n));
      s.owned = DevBuf<uint8_t>(static_cast<size_t>(n));
      GPU_CUDA(cudaMemset(s.sums.get(), 0xFF, s.sums.size() * sizeof(detlogp::TileSummary)));
      s.tl.poison();
      GPU_CUDA(cudaMemset(s.owned.get(), 0xFF, static_cast<size_t>(n)));
      Outputs unused;
      auto p = device_problem(m, h.get(), n, dt2.get(), unused);
      p.logp = p.lse = nullptr;
      p.weight = m.weight.get() + s.start * m.dim;
      p.bias = m.bias.get() + s.start;
      p.vocab_local = s.count;
      p.vocab_start = s.start;
      p.real_vocab = m.vocab;
      p.summaries = s.sums.get();
      p.target_logit = s.tl.get();
      p.target_owned = s.owned.get();
      sm90().run(p);
      s.hs = s.sums.to_host();
      s.htl = s.tl.to_host();
      s.howned = s.owned.to_host();
      detlogp::ShardPartials sp;
      sp.rows = n;
      sp.tiles = s.tiles;
      sp.summaries = s.hs.data();
      sp.target_logit = s.htl.data();
      sp.target_owned = s.howned.data();
      parts.push_back(sp);
    }
    std::vector<float> logp(n), lse(n);
    // The backend's own partials carry no PartialsLayout (merge_partials requires one, filled by
    // linear_logp_partials): the protocol's merge, which leaves the layouts to its caller.
    detlogp::tp::merge_owned(parts, detlogp::TensorView::vector(t.data(), detlogp::DType::i32, n), -100,
                             detlogp::mutable_vector(logp.data(), detlogp::DType::f32, n),
                             detlogp::mutable_vector(lse.data(), detlogp::DType::f32, n), nullptr);
    std::vector<float> el(n), es(n);
    for (int64_t i = 0; i < n; ++i) {
      el[i] = base.logp[idx[i]];
      es[i] = base.lse[idx[i]];
    }
    auto a = compare(el, logp), b = compare(es, lse);
    EXPECT_TRUE(a.identical() && b.identical())
        << "TP 2 shards merged: " << a.describe("logp") << "; " << b.describe("lse");
    // Tile summaries == the contract's tile_summary over the SM90 logits (proves the tree mapping).
    std::vector<float> logits_rows(static_cast<size_t>(n * m.vocab));
    for (int64_t i = 0; i < n; ++i)
      GPU_CUDA(cudaMemcpy(logits_rows.data() + i * m.vocab, base.logits.get() + idx[i] * m.vocab, m.vocab * 4,
                          cudaMemcpyDeviceToHost));
    int64_t bad = 0, owned_bad = 0;
    for (const auto& s : shards)
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < s.tiles; ++j) {
          float y[64];
          const int64_t c0 = s.start + j * 64;
          const int cols = static_cast<int>(std::min<int64_t>(64, s.start + s.count - c0));
          for (int c = 0; c < cols; ++c) y[c] = logits_rows[i * m.vocab + c0 + c];
          const auto ref = detlogp::tile_summary(y, cols);
          const auto got = s.hs[i * s.tiles + j];
          if (bits(ref.max) != bits(got.max) || bits(ref.sum) != bits(got.sum)) {
            if (bad == 0)
              std::printf("   first summary mismatch shard@%lld row %lld tile %lld: ref {%a, %a} got {%a, %a}\n",
                          (long long)s.start, (long long)i, (long long)j, ref.max, ref.sum, got.max, got.sum);
            ++bad;
          }
        }
        const bool own = t[i] != -100 && t[i] >= s.start && t[i] < s.start + s.count;
        if (s.howned[i] != (own ? 1 : 0)) ++owned_bad;
        if (own && bits(s.htl[i]) != bits(logits_rows[i * m.vocab + t[i]])) ++owned_bad;
        if (!own && bits(s.htl[i]) != 0u) ++owned_bad;
      }
    EXPECT_EQ(bad, 0) << "tile summaries differ from detlogp::tile_summary of the logits";
    EXPECT_EQ(owned_bad, 0) << "target ownership / target logit errors in partial mode";
  }
}

TEST_F(Sm90Invariance, QwenShapeRunToRunAndRowSubsetsInEveryBucket) {
  std::printf("-- Qwen3-8B shape D=4096 V=151936, pool 1024\n");
  const int64_t pool = 1024;
  DeviceModel m;
  m.make(4096, 151936, 21, false);
  DevBuf<uint16_t> hidden(static_cast<size_t>(pool * m.dim));
  fill_bf16_uniform(hidden.get(), pool * m.dim, 22, 1.0f);
  const auto targets = random_targets(pool, m.vocab, 23, 0);
  DevBuf<int32_t> dt(targets.size());
  dt.from_host(targets);
  const Base base = base_run(m, hidden, pool, dt, false);

  // L1: 100 repeats (trainer) and 20 (serving) of the same 129 rows are identical.
  {
    const int64_t n = 129;
    Outputs first;
    first.make(n, m.vocab, true);
    auto p0 = device_problem(m, hidden.get(), n, dt.get(), first);
    sm90().run(p0);
    const auto l0 = first.logp.to_host(), s0 = first.lse.to_host();
    std::vector<int64_t> id(n);
    std::iota(id.begin(), id.end(), 0);
    DevBuf<int64_t> did(id.size());
    did.from_host(id);
    int diff = 0;
    for (int rep = 0; rep < 100; ++rep) {
      const bool serving = rep % 5 == 0;
      Outputs o;
      o.make(n, m.vocab, serving);
      auto p = device_problem(m, hidden.get(), n, dt.get(), o);
      sm90().run(p);
      if (!compare(l0, o.logp.to_host()).identical() || !compare(s0, o.lse.to_host()).identical()) ++diff;
      if (serving && compare_logit_rows(o.logits.get(), first.logits.get(), did.get(), n, m.vocab).count) ++diff;
    }
    EXPECT_EQ(diff, 0) << "L1: repeats (of 100) that differ from the first run";
    std::printf("   L1: 100 repeats (20 with logits) of N=129: %d differ\n", diff);
    std::vector<float> el(base.logp.begin(), base.logp.begin() + n), es(base.lse.begin(), base.lse.begin() + n);
    auto a = compare(el, l0), b = compare(es, s0);
    EXPECT_TRUE(a.identical() && b.identical())
        << "N=129 prefix vs N=1024: " << a.describe("logp") << "; " << b.describe("lse");
  }
  Rng g(7);
  for (int64_t n : {1, 7, 64, 65, 129, 1000})
    for (const std::string& name : sm90_bucket_names()) {
      const char* bucket = name.c_str();
      ScopedEnv env("DETLOGP_SM90_BUCKET", bucket);
      run_subset(bucket, m, hidden, targets, base, sample(pool, n, g), false);
    }
}

TEST_F(Sm90Invariance, PaddedVocabularyGivesTheRealVocabularysBits) {
  std::printf("-- padded V_local=152064 vs real 151936 (D=256)\n");
  const int64_t real = 151936, padded = 152064, d = 256, n = 300;
  DeviceModel mr, mp;
  mr.make(d, real, 31, true);
  mp.make(d, padded, 32, true);  // random padding rows and bias, then the real part copied in
  GPU_CUDA(cudaMemcpy(mp.weight.get(), mr.weight.get(), real * d * 2, cudaMemcpyDeviceToDevice));
  GPU_CUDA(cudaMemcpy(mp.bias.get(), mr.bias.get(), real * 4, cudaMemcpyDeviceToDevice));
  DevBuf<uint16_t> hidden(static_cast<size_t>(n * d));
  fill_bf16_uniform(hidden.get(), n * d, 33, 1.0f);
  const auto targets = random_targets(n, real, 34, 11);
  DevBuf<int32_t> dt(targets.size());
  dt.from_host(targets);
  Outputs orl, opd;
  orl.make(n, real, true);
  opd.make(n, padded, true);
  auto pr = device_problem(mr, hidden.get(), n, dt.get(), orl);
  auto pp = device_problem(mp, hidden.get(), n, dt.get(), opd);
  pp.real_vocab = real;
  sm90().run(pr);
  sm90().run(pp);
  auto a = compare(orl.logp.to_host(), opd.logp.to_host()), b = compare(orl.lse.to_host(), opd.lse.to_host());
  EXPECT_TRUE(a.identical() && b.identical()) << "padded vs real: " << a.describe("logp") << "; " << b.describe("lse");
  const auto lr = orl.logits.to_host(), lp = opd.logits.to_host();
  auto c = detlogp::bitcmp::compare_rows(lr.data(), real, lp.data(), padded, n, real);
  EXPECT_TRUE(c.identical()) << "padded vs real logits (real columns): " << c.describe("logits");
  std::printf("   %s; %s; %s\n", a.describe("logp").c_str(), b.describe("lse").c_str(), c.describe("logits").c_str());
}

TEST_F(Sm90Invariance, PerRowTemperatureBiasAddPointAndIgnoreIndex) {
  std::printf("-- temperature per row vs scalar, bias add point, ignore_index (D=1024 V=30522)\n");
  const int64_t n = 256;
  DeviceModel m;
  m.make(1024, 30522, 41, true);
  DevBuf<uint16_t> hidden(static_cast<size_t>(n * m.dim));
  fill_bf16_uniform(hidden.get(), n * m.dim, 42, 1.0f);
  const auto targets = random_targets(n, m.vocab, 43, 0);
  DevBuf<int32_t> dt(targets.size());
  dt.from_host(targets);

  const float tvals[] = {0.5f, 0.8f, 1.0f, 1.7f};
  std::vector<float> temps(n);
  for (int64_t i = 0; i < n; ++i) temps[i] = tvals[(i * 7) % 4];
  DevBuf<float> dtemps(temps.size());
  dtemps.from_host(temps);
  Outputs per_row;
  per_row.make(n, m.vocab, false);
  auto pr = device_problem(m, hidden.get(), n, dt.get(), per_row);
  pr.temperature = 3.0f;  // ignored when per-row temperatures are given
  pr.temperature_rows = dtemps.get();
  sm90().run(pr);
  const auto lp = per_row.logp.to_host(), ls = per_row.lse.to_host();
  int bad = 0;
  for (float tv : tvals) {
    Outputs o;
    o.make(n, m.vocab, false);
    auto p = device_problem(m, hidden.get(), n, dt.get(), o);
    p.temperature = tv;
    sm90().run(p);
    const auto a = o.logp.to_host(), b = o.lse.to_host();
    for (int64_t i = 0; i < n; ++i)
      if (temps[i] == tv && (!same_bits(a[i], lp[i]) || !same_bits(b[i], ls[i]))) ++bad;
  }
  EXPECT_EQ(bad, 0) << "rows differ between per-row temperature and the scalar run at the same T";

  // Bias: z = fl(acc + b) once after the K walk, so logits(bias) == fl(logits(no bias) + b) bitwise.
  {
    Outputs with_b, without_b;
    with_b.make(n, m.vocab, true);
    without_b.make(n, m.vocab, true);
    auto p1 = device_problem(m, hidden.get(), n, dt.get(), with_b);
    auto p0 = device_problem(m, hidden.get(), n, dt.get(), without_b);
    p0.bias = nullptr;
    sm90().run(p1);
    sm90().run(p0);
    const auto z1 = with_b.logits.to_host(), z0 = without_b.logits.to_host(), b = m.bias.to_host();
    std::vector<float> expect(z0.size());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t v = 0; v < m.vocab; ++v) expect[i * m.vocab + v] = detlogp::add_bias(z0[i * m.vocab + v], b[v]);
    auto c = compare(expect, z1);
    EXPECT_TRUE(c.identical()) << "bias add point: " << c.describe("logits");
  }

  // ignore_index: +0 logp, lse unchanged, for the default -100 and a custom in-vocabulary index.
  for (int64_t ignore : {int64_t{-100}, int64_t{7}}) {
    std::vector<int32_t> t2 = targets;
    for (int64_t i = 0; i < n; i += 3) t2[i] = static_cast<int32_t>(ignore);
    DevBuf<int32_t> dt2(t2.size());
    dt2.from_host(t2);
    Outputs a, b;
    a.make(n, m.vocab, false);
    b.make(n, m.vocab, false);
    auto pa = device_problem(m, hidden.get(), n, dt.get(), a);
    auto pb = device_problem(m, hidden.get(), n, dt2.get(), b);
    pa.ignore_index = -100;  // reference: nothing ignored (targets has no -100)
    pb.ignore_index = ignore;
    sm90().run(pa);
    sm90().run(pb);
    const auto la = a.logp.to_host(), sa = a.lse.to_host(), lb = b.logp.to_host(), sb = b.lse.to_host();
    int errs = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (!same_bits(sa[i], sb[i])) ++errs;
      if (t2[i] == ignore && bits(lb[i]) != 0u) ++errs;
      if (t2[i] != ignore && !same_bits(la[i], lb[i])) ++errs;
    }
    EXPECT_EQ(errs, 0) << "ignore_index=" << ignore;
  }
}

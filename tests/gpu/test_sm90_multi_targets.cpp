// Multi-id logprobs on the SM90 backend: targets [N, K] (K <= 64) give logp [N, K] from one pass
// over the vocabulary, every entry bit-identical to a single-target call for that id (the same lse
// and entropy), ignore_index per entry. Through linear_logp on CUDA memory: both entries (trainer,
// serving with logits), every launch bucket, odd vocabularies, K = 1, 2, 8, 64, int32 and int64
// targets, per-row temperatures, a row alone against the same row in a batch; the tensor-parallel
// operator over simulated ranks (shards on and off the tile grid) and linear_logp_partials +
// merge_partials with the device merge; the refusals (a bad target named by row and column with
// nothing written, the logit gradient of [N, K] targets).
#include <cstring>
#include <thread>

#include "detlogp/dist.hpp"
#include "gpu_test_util.hpp"

using namespace gput;
using detlogp::DType;
using detlogp::Memory;

namespace {

class Sm90MultiTargets : public Sm90Test {};

// One head on the device: hidden [n][d] (row stride d), weight [v][d], optional bias.
struct Head {
  int64_t n = 0, d = 0, v = 0;
  DeviceModel m;
  DevBuf<uint16_t> hidden;
  DevBuf<float> temps;  // [n] or empty
  Head(int64_t n_, int64_t d_, int64_t v_, bool bias, bool row_temps, uint64_t seed) : n(n_), d(d_), v(v_) {
    m.make(d, v, seed, bias);
    hidden = DevBuf<uint16_t>(static_cast<size_t>(n * d));
    fill_bf16_uniform(hidden.get(), n * d, seed + 17, 2.0f);
    if (row_temps) {
      temps = DevBuf<float>(static_cast<size_t>(n));
      fill_f32_uniform(temps.get(), n, seed + 29, 0.5f, 1.5f);
    }
  }
};

// K ids per row: ids across the vocabulary, its last id, the tile edges 63 and 64 (where V allows),
// the same id twice in a row, every 5th entry ignored (-100).
std::vector<int64_t> multi_ids(int64_t n, int64_t k, int64_t v, uint64_t seed) {
  std::vector<int64_t> t(static_cast<size_t>(n * k));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < k; ++j) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      int64_t id = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(v));
      if (j == 1) id = v - 1;
      if (j == 2 && v > 63) id = 63;
      if (j == 3 && v > 64) id = 64;
      if (j == 4 && k > 5) id = t[static_cast<size_t>(r * k + 1)];
      if ((r * k + j) % 5 == 4) id = -100;
      t[static_cast<size_t>(r * k + j)] = id;
    }
  return t;
}

// Targets on the device as int32 or int64 bytes.
struct DevTargets {
  DevBuf<int32_t> i32;
  DevBuf<int64_t> i64;
  bool wide = false;
  DevTargets(const std::vector<int64_t>& t, bool as_i64) : wide(as_i64) {
    if (wide) {
      i64 = DevBuf<int64_t>(t.size());
      i64.from_host(t);
    } else {
      std::vector<int32_t> n(t.begin(), t.end());
      i32 = DevBuf<int32_t>(n.size());
      i32.from_host(n);
    }
  }
  const void* data() const { return wide ? static_cast<const void*>(i64.get()) : i32.get(); }
  DType dtype() const { return wide ? DType::i64 : DType::i32; }
};

struct Result {
  std::vector<float> logp, lse, entropy, logits;
};

// One linear_logp call on rows [row0, row0 + rows) of the head with targets [rows][k] (k == 0: the
// [N] form), entropy always, logits when serving; the outputs poisoned first.
Result run(const Head& h, int64_t row0, int64_t rows, const DevTargets& t, int64_t k, bool serving) {
  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(h.hidden.get() + row0 * h.d, DType::bf16, rows, h.d, Memory::cuda);
  in.weight = detlogp::TensorView::matrix(h.m.weight.get(), DType::bf16, h.v, h.d, Memory::cuda);
  if (h.m.bias.size()) in.bias = detlogp::TensorView::vector(h.m.bias.get(), DType::f32, h.v, Memory::cuda);
  const int64_t per = k == 0 ? 1 : k;
  const size_t width = t.wide ? 8 : 4;
  const void* tdata = static_cast<const uint8_t*>(t.data()) + static_cast<size_t>(row0 * per) * width;
  in.targets = k == 0 ? detlogp::TensorView::vector(tdata, t.dtype(), rows, Memory::cuda)
                      : detlogp::TensorView::matrix(tdata, t.dtype(), rows, k, Memory::cuda);
  if (h.temps.size())
    in.temperature_rows = detlogp::TensorView::vector(h.temps.get() + row0, DType::f32, rows, Memory::cuda);
  DevBuf<float> logp(static_cast<size_t>(rows * per)), lse(static_cast<size_t>(rows)), ent(static_cast<size_t>(rows)),
      logits(serving ? static_cast<size_t>(rows * h.v) : 0);
  logp.poison();
  lse.poison();
  ent.poison();
  if (serving) logits.poison();
  detlogp::LinearLogpOutputs out;
  out.logp = k == 0 ? detlogp::mutable_vector(logp.get(), DType::f32, rows, Memory::cuda)
                    : detlogp::mutable_matrix(logp.get(), DType::f32, rows, k, Memory::cuda);
  out.lse = detlogp::mutable_vector(lse.get(), DType::f32, rows, Memory::cuda);
  out.entropy = detlogp::mutable_vector(ent.get(), DType::f32, rows, Memory::cuda);
  if (serving) out.logits = detlogp::mutable_matrix(logits.get(), DType::f32, rows, h.v, Memory::cuda);
  detlogp::CallOptions opt;
  opt.strict = true;
  detlogp::linear_logp(in, out, opt);
  return {logp.to_host(), lse.to_host(), ent.to_host(), logits.to_host()};
}

// The multi-target call against K single-target calls (targets column j as [N]): every entry,
// lse and entropy bit for bit, and the logits where served. Returns the mismatches.
int64_t check_against_single(const Head& h, const std::vector<int64_t>& ids, int64_t k, bool as_i64, bool serving,
                             const std::string& what) {
  const DevTargets t(ids, as_i64);
  const Result multi = run(h, 0, h.n, t, k, serving);
  int64_t bad = 0;
  for (int64_t j = 0; j < k; ++j) {
    std::vector<int64_t> col(static_cast<size_t>(h.n));
    for (int64_t r = 0; r < h.n; ++r) col[r] = ids[static_cast<size_t>(r * k + j)];
    const Result single = run(h, 0, h.n, DevTargets(col, as_i64), 0, serving);
    for (int64_t r = 0; r < h.n; ++r) {
      const float a = multi.logp[static_cast<size_t>(r * k + j)], b = single.logp[static_cast<size_t>(r)];
      if (!same_bits(a, b) && bad++ < 5)
        ADD_FAILURE() << what << ": logp[" << r << ", " << j << "] (id " << col[r] << ") = " << a
                      << ", the single-target call gives " << b;
    }
    if (j == 0) {
      const auto l = detlogp::bitcmp::compare(single.lse, multi.lse);
      const auto e = detlogp::bitcmp::compare(single.entropy, multi.entropy);
      const auto z = detlogp::bitcmp::compare(single.logits, multi.logits);
      EXPECT_TRUE(l.identical() && e.identical() && z.identical())
          << what << ": " << l.describe("lse") << "; " << e.describe("entropy") << "; " << z.describe("logits");
      bad += l.identical() && e.identical() && z.identical() ? 0 : 1;
    }
  }
  return bad;
}

}  // namespace

// Odd vocabularies (a partial last tile, fewer ids than a fragment, Qwen3's 151936), K = 1, 2, 8,
// 64, int32 and int64 targets, both entries; per-row temperatures and a bias on some.
TEST_F(Sm90MultiTargets, EveryEntryHasTheSingleTargetBits) {
  struct S {
    int64_t n, d, v;
    bool bias, temps;
  };
  const S shapes[] = {{37, 64, 17, false, false},
                      {29, 72, 123, true, false},
                      {67, 64, 2053, true, true},
                      {options().small ? int64_t{3} : int64_t{9}, 128, 151936, false, false}};
  for (const S& s : shapes) {
    const Head h(s.n, s.d, s.v, s.bias, s.temps, static_cast<uint64_t>(s.v));
    for (int64_t k : {1, 2, 8, 64}) {
      if (s.v == 151936 && k == 64 && options().small) continue;
      const std::vector<int64_t> ids = multi_ids(s.n, k, s.v, static_cast<uint64_t>(k));
      for (bool i64 : {false, true})
        for (bool serving : {false, true}) {
          if (k == 64 && s.v == 151936 && (i64 || serving)) continue;  // 64 single calls each: keep one
          const std::string what = "N=" + std::to_string(s.n) + " V=" + std::to_string(s.v) +
                                   " K=" + std::to_string(k) + (i64 ? " i64" : " i32") +
                                   (serving ? " serving" : " trainer");
          EXPECT_EQ(check_against_single(h, ids, k, i64, serving, what), 0) << what;
        }
    }
  }
}

// Every launch bucket (both schedules, clusters, 8-row decode tiles) takes the kMulti form.
TEST_F(Sm90MultiTargets, EveryBucketGivesTheSingleTargetBits) {
  const Head h(70, 64, 2053, true, false, 5);
  const std::vector<int64_t> ids = multi_ids(h.n, 8, h.v, 8);
  for (const std::string& name : sm90_bucket_names()) {
    ScopedEnv env("DETLOGP_SM90_BUCKET", name.c_str());
    for (bool serving : {false, true}) {
      const std::string what = name + (serving ? " serving" : " trainer");
      EXPECT_EQ(check_against_single(h, ids, 8, false, serving, what), 0) << what;
    }
  }
}

// Ignored entries: -100 anywhere in a row (all of a row's entries too) gives exactly what a
// single-target call gives an ignored target; the other entries of the row are unaffected.
TEST_F(Sm90MultiTargets, IgnoreIndexWorksPerEntry) {
  const Head h(20, 64, 300, false, false, 11);
  const int64_t k = 4;
  std::vector<int64_t> ids(static_cast<size_t>(h.n * k));
  for (int64_t r = 0; r < h.n; ++r)
    for (int64_t j = 0; j < k; ++j) ids[r * k + j] = r % 3 == 0 || (r + j) % 2 == 0 ? -100 : (r * 37 + j * 71) % h.v;
  for (bool serving : {false, true}) {
    const Result multi = run(h, 0, h.n, DevTargets(ids, false), k, serving);
    const Result ignored = run(h, 0, h.n, DevTargets(std::vector<int64_t>(h.n, -100), false), 0, serving);
    for (int64_t r = 0; r < h.n; ++r)
      for (int64_t j = 0; j < k; ++j)
        if (ids[r * k + j] == -100) {
          EXPECT_TRUE(same_bits(multi.logp[r * k + j], ignored.logp[r]))
              << "ignored logp[" << r << ", " << j << "] = " << multi.logp[r * k + j] << ", single call "
              << ignored.logp[r];
        }
    EXPECT_EQ(check_against_single(h, ids, k, true, serving, serving ? "ignored, serving" : "ignored, trainer"), 0);
  }
}

// A row's entries do not depend on the other rows of the call: each row alone (its hidden row, its
// K targets) gives the bits it has in the batch, for rows in different tiles and chunks.
TEST_F(Sm90MultiTargets, ARowAloneMatchesTheRowInABatch) {
  const Head h(300, 64, 2053, true, true, 21);
  const int64_t k = 8;
  const std::vector<int64_t> ids = multi_ids(h.n, k, h.v, 3);
  const DevTargets t(ids, false);
  for (bool serving : {false, true}) {
    const Result batch = run(h, 0, h.n, t, k, serving);
    for (int64_t r : {int64_t{0}, int64_t{7}, int64_t{63}, int64_t{64}, int64_t{129}, int64_t{299}}) {
      const Result alone = run(h, r, 1, t, k, serving);
      for (int64_t j = 0; j < k; ++j)
        EXPECT_TRUE(same_bits(alone.logp[j], batch.logp[r * k + j]))
            << (serving ? "serving" : "trainer") << " row " << r << " entry " << j << ": alone " << alone.logp[j]
            << ", in the batch " << batch.logp[r * k + j];
      EXPECT_TRUE(same_bits(alone.lse[0], batch.lse[r]) && same_bits(alone.entropy[0], batch.entropy[r]))
          << (serving ? "serving" : "trainer") << " row " << r << ": lse or entropy differs alone";
    }
  }
}

// A target out of range at [n, k]: the error names the row and the column, and nothing is written
// (the trainer entry validates inside the fused kernel, the serving entry in its own kernel).
TEST_F(Sm90MultiTargets, ABadTargetIsNamedByRowAndColumnAndNothingIsWritten) {
  const Head h(40, 64, 500, false, false, 31);
  const int64_t k = 6;
  std::vector<int64_t> ids = multi_ids(h.n, k, h.v, 9);
  ids[17 * k + 4] = 500;  // == real_vocab
  ids[23 * k + 1] = -7;   // a later row: not the one reported
  for (bool i64 : {false, true})
    for (bool serving : {false, true}) {
      const DevTargets t(ids, i64);
      detlogp::LinearLogpInputs in;
      in.hidden = detlogp::TensorView::matrix(h.hidden.get(), DType::bf16, h.n, h.d, Memory::cuda);
      in.weight = detlogp::TensorView::matrix(h.m.weight.get(), DType::bf16, h.v, h.d, Memory::cuda);
      in.targets = detlogp::TensorView::matrix(t.data(), t.dtype(), h.n, k, Memory::cuda);
      DevBuf<float> logp(static_cast<size_t>(h.n * k)), lse(static_cast<size_t>(h.n)),
          logits(static_cast<size_t>(h.n * h.v));
      logp.poison();
      lse.poison();
      logits.poison();
      detlogp::LinearLogpOutputs out;
      out.logp = detlogp::mutable_matrix(logp.get(), DType::f32, h.n, k, Memory::cuda);
      out.lse = detlogp::mutable_vector(lse.get(), DType::f32, h.n, Memory::cuda);
      if (serving) out.logits = detlogp::mutable_matrix(logits.get(), DType::f32, h.n, h.v, Memory::cuda);
      std::string msg;
      try {
        detlogp::linear_logp(in, out);
      } catch (const std::exception& e) {
        msg = e.what();
      }
      EXPECT_NE(msg.find("targets[17, 4]=500 is >= real_vocab=500"), std::string::npos)
          << (serving ? "serving" : "trainer") << (i64 ? " i64" : " i32") << ": " << msg;
      EXPECT_EQ(count_poison(logp.get(), h.n * k), h.n * k) << "logp written on a bad target";
      EXPECT_EQ(count_poison(lse.get(), h.n), h.n) << "lse written on a bad target";
      if (serving) {
        EXPECT_EQ(count_poison(logits.get(), h.n * h.v), h.n * h.v) << "logits written on a bad target";
      }
    }
}

// The SM90 logit gradient takes one target a row: [N, K] targets are refused, naming the CPU
// backend that computes it, and dz is not written.
TEST_F(Sm90MultiTargets, TheLogitGradientOfMultiTargetsIsRefused) {
  const Head h(8, 64, 256, false, false, 41);
  const int64_t k = 2;
  const DevTargets t(multi_ids(h.n, k, h.v, 1), false);
  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(h.hidden.get(), DType::bf16, h.n, h.d, Memory::cuda);
  in.weight = detlogp::TensorView::matrix(h.m.weight.get(), DType::bf16, h.v, h.d, Memory::cuda);
  in.targets = detlogp::TensorView::matrix(t.data(), t.dtype(), h.n, k, Memory::cuda);
  DevBuf<float> lse(static_cast<size_t>(h.n)), g(static_cast<size_t>(h.n * k));
  GPU_CUDA(cudaMemset(lse.get(), 0, lse.size() * 4));
  GPU_CUDA(cudaMemset(g.get(), 0, g.size() * 4));
  DevBuf<uint16_t> dz(static_cast<size_t>(h.n * h.v));
  GPU_CUDA(cudaMemset(dz.get(), 0xFF, dz.size() * 2));
  detlogp::GradLogitsArgs args;
  args.lse = detlogp::TensorView::vector(lse.get(), DType::f32, h.n, Memory::cuda);
  args.g_logp = detlogp::TensorView::matrix(g.get(), DType::f32, h.n, k, Memory::cuda);
  std::string msg;
  try {
    detlogp::linear_logp_grad_logits(in, args, detlogp::mutable_matrix(dz.get(), DType::bf16, h.n, h.v, Memory::cuda));
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("takes one target per row"), std::string::npos) << msg;
  const auto host = dz.to_host();
  for (uint16_t b : host) ASSERT_EQ(b, 0xFFFF) << "dz written on a refused call";
}

namespace {

detlogp::LinearLogpInputs shard_inputs(const Head& h, const DeviceShard& s, const DevTargets& t, int64_t k) {
  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(h.hidden.get(), DType::bf16, h.n, h.d, Memory::cuda);
  in.weight = detlogp::TensorView::matrix(s.weight.get(), DType::bf16, s.count, h.d, Memory::cuda);
  if (s.bias.size()) in.bias = detlogp::TensorView::vector(s.bias.get(), DType::f32, s.count, Memory::cuda);
  in.targets = detlogp::TensorView::matrix(t.data(), t.dtype(), h.n, k, Memory::cuda);
  if (h.temps.size()) in.temperature_rows = detlogp::TensorView::vector(h.temps.get(), DType::f32, h.n, Memory::cuda);
  in.vocab_start = s.start;
  in.real_vocab = h.v;
  return in;
}

}  // namespace

// The tensor-parallel operator over simulated ranks on one GPU (local CUDA communicators), shards
// on and off the 64-id tile grid: every rank's logp [N, K], lse and entropy are the TP = 1 bits.
TEST_F(Sm90MultiTargets, TensorParallelRanksGiveTheTp1Bits) {
  const Head h(45, 64, 2053, true, true, 51);
  for (int64_t k : {2, 8}) {
    const std::vector<int64_t> ids = multi_ids(h.n, k, h.v, static_cast<uint64_t>(k) + 100);
    for (bool i64 : {false, true}) {
      const DevTargets t(ids, i64);
      const Result ref = run(h, 0, h.n, t, k, false);
      for (const std::vector<int64_t>& bounds :
           {std::vector<int64_t>{0, 1024, 2053}, std::vector<int64_t>{0, 700, 1301, 2053},
            std::vector<int64_t>{0, 64, 1000, 1001, 2053}}) {
        const int tp = static_cast<int>(bounds.size()) - 1;
        std::vector<DeviceShard> shards = make_shards(h.m, bounds);
        auto comms = detlogp::make_local_communicators(tp, Memory::cuda, 0);
        std::vector<DevBuf<float>> logp(tp), lse(tp), ent(tp);
        std::vector<std::string> errors(tp);
        std::vector<std::thread> threads;
        for (int r = 0; r < tp; ++r) {
          logp[r] = DevBuf<float>(static_cast<size_t>(h.n * k));
          lse[r] = DevBuf<float>(static_cast<size_t>(h.n));
          ent[r] = DevBuf<float>(static_cast<size_t>(h.n));
          logp[r].poison();
          lse[r].poison();
          ent[r].poison();
        }
        std::vector<cudaStream_t> streams(tp, nullptr);  // a rank's own stream, as an engine's
        for (int r = 0; r < tp; ++r) GPU_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
        for (int r = 0; r < tp; ++r)
          threads.emplace_back([&, r] {
            try {
              GPU_CUDA(cudaSetDevice(0));
              detlogp::LinearLogpOutputs out;
              out.logp = detlogp::mutable_matrix(logp[r].get(), DType::f32, h.n, k, Memory::cuda);
              out.lse = detlogp::mutable_vector(lse[r].get(), DType::f32, h.n, Memory::cuda);
              out.entropy = detlogp::mutable_vector(ent[r].get(), DType::f32, h.n, Memory::cuda);
              detlogp::CallOptions opt;
              opt.strict = true;
              opt.cuda_stream = streams[r];
              detlogp::linear_logp_tensor_parallel(shard_inputs(h, shards[r], t, k), out, *comms[r], opt);
              GPU_CUDA(cudaStreamSynchronize(streams[r]));
            } catch (const std::exception& e) {
              errors[r] = e.what();
            }
          });
        for (auto& th : threads) th.join();
        for (cudaStream_t st : streams) GPU_CUDA(cudaStreamDestroy(st));
        for (int r = 0; r < tp; ++r) {
          const std::string what = "TP=" + std::to_string(tp) + " rank " + std::to_string(r) +
                                   " K=" + std::to_string(k) + (i64 ? " i64" : " i32");
          ASSERT_TRUE(errors[r].empty()) << what << ": " << errors[r];
          const auto a = detlogp::bitcmp::compare(ref.logp, logp[r].to_host());
          const auto b = detlogp::bitcmp::compare(ref.lse, lse[r].to_host());
          const auto c = detlogp::bitcmp::compare(ref.entropy, ent[r].to_host());
          EXPECT_TRUE(a.identical() && b.identical() && c.identical())
              << what << ": " << a.describe("logp") << "; " << b.describe("lse") << "; " << c.describe("entropy");
        }
      }
    }
  }
}

// linear_logp_partials on each shard (CUDA memory, [N, K] targets) and merge_partials with the
// device merge: the TP = 1 bits.
TEST_F(Sm90MultiTargets, PartialsAndTheDeviceMergeGiveTheTp1Bits) {
  const Head h(33, 64, 1000, false, false, 61);
  const int64_t k = 5;
  const std::vector<int64_t> ids = multi_ids(h.n, k, h.v, 77);
  const DevTargets t(ids, false);
  const Result ref = run(h, 0, h.n, t, k, false);
  const std::vector<int64_t> bounds{0, 333, 640, 1000};
  std::vector<DeviceShard> shards = make_shards(h.m, bounds);
  struct Bufs {
    DevBuf<detlogp::TileSummary> sums;
    DevBuf<float> y, edge;
    DevBuf<uint8_t> owned;
    detlogp::ShardPartials p;
  };
  std::vector<Bufs> bufs(shards.size());
  std::vector<detlogp::ShardPartials> ranks;
  for (size_t r = 0; r < shards.size(); ++r) {
    const detlogp::ShardGeometry g = detlogp::shard_geometry(shards[r].start, shards[r].count, h.v);
    Bufs& b = bufs[r];
    b.sums = DevBuf<detlogp::TileSummary>(static_cast<size_t>(std::max<int64_t>(1, h.n * g.tiles)));
    b.y = DevBuf<float>(static_cast<size_t>(h.n * k));
    b.owned = DevBuf<uint8_t>(static_cast<size_t>(h.n * k));
    b.edge = DevBuf<float>(static_cast<size_t>(std::max<int64_t>(1, h.n * g.edge_lanes())));
    b.p.rows = h.n;
    b.p.tiles = g.tiles;
    b.p.edge_lanes = g.edge_lanes();
    b.p.summaries = b.sums.get();
    b.p.target_logit = b.y.get();
    b.p.target_owned = b.owned.get();
    b.p.edge_logits = b.edge.get();
    b.p.targets_per_row = k;
    b.p.memory = Memory::cuda;
    b.p.device = 0;
    detlogp::CallOptions opt;
    opt.strict = true;
    detlogp::linear_logp_partials(shard_inputs(h, shards[r], t, k), b.p, opt);
    ranks.push_back(b.p);
  }
  DevBuf<float> logp(static_cast<size_t>(h.n * k)), lse(static_cast<size_t>(h.n));
  logp.poison();
  lse.poison();
  detlogp::merge_partials(ranks, detlogp::TensorView::matrix(t.data(), t.dtype(), h.n, k, Memory::cuda), -100,
                          detlogp::mutable_matrix(logp.get(), DType::f32, h.n, k, Memory::cuda),
                          detlogp::mutable_vector(lse.get(), DType::f32, h.n, Memory::cuda));
  const auto a = detlogp::bitcmp::compare(ref.logp, logp.to_host());
  const auto b = detlogp::bitcmp::compare(ref.lse, lse.to_host());
  EXPECT_TRUE(a.identical() && b.identical()) << a.describe("logp") << "; " << b.describe("lse");
}

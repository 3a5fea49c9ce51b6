// The top-k output on the SM90 backend (docs/contract.md §12): topk_ids are the first K real ids
// of a full sort of the row's scaled logits (larger y first, NaN first, equal ones by the lower id),
// taken from the serving logits the same call returns, and each topk_logp is the bits of a
// single-target call for that id. Odd vocabularies (17, 123, 2053, 151936), K = 1 .. 128, per-row
// temperatures and a bias, both entries; rows with exact ties, a NaN row and a row whose top lanes
// overflow the candidate buffer (the radix path); a row alone against the row in a batch, N
// chunking and every launch bucket; host tensors; the tensor-parallel operator over simulated ranks
// and linear_logp_partials + merge_partials on the device (shards on and off the tile grid, one
// narrower than K real ids, one with padding only); a bad target writes nothing; the candidate
// path of many rows against the logits path.
#include <algorithm>
#include <numeric>
#include <thread>

#include "detlogp/dist.hpp"
#include "gpu_test_util.hpp"

using namespace gput;
using detlogp::DType;
using detlogp::Memory;

namespace {

class Sm90Topk : public Sm90Test {};

// One head on the device: hidden [n][d], weight [v][d], optional bias and per-row temperatures.
struct Head {
  int64_t n = 0, d = 0, v = 0, real = 0;
  DeviceModel m;
  DevBuf<uint16_t> hidden;
  DevBuf<float> temps;
  Head(int64_t n_, int64_t d_, int64_t v_, bool bias, bool row_temps, uint64_t seed, int64_t real_vocab = -1)
      : n(n_), d(d_), v(v_), real(real_vocab < 0 ? v_ : real_vocab) {
    m.make(d, v, seed, bias);
    hidden = DevBuf<uint16_t>(static_cast<size_t>(n * d));
    fill_bf16_uniform(hidden.get(), n * d, seed + 17, 2.0f);
    if (row_temps) {
      temps = DevBuf<float>(static_cast<size_t>(n));
      fill_f32_uniform(temps.get(), n, seed + 29, 0.5f, 1.5f);
    }
  }
};

struct Result {
  std::vector<float> logp, lse, logits, topk_logp;
  std::vector<int64_t> topk_ids;
};

detlogp::LinearLogpInputs inputs(const Head& h, int64_t row0, int64_t rows, const int64_t* targets) {
  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(h.hidden.get() + row0 * h.d, DType::bf16, rows, h.d, Memory::cuda);
  in.weight = detlogp::TensorView::matrix(h.m.weight.get(), DType::bf16, h.v, h.d, Memory::cuda);
  if (h.m.bias.size()) in.bias = detlogp::TensorView::vector(h.m.bias.get(), DType::f32, h.v, Memory::cuda);
  in.targets = detlogp::TensorView::vector(targets + row0, DType::i64, rows, Memory::cuda);
  if (h.temps.size())
    in.temperature_rows = detlogp::TensorView::vector(h.temps.get() + row0, DType::f32, rows, Memory::cuda);
  in.real_vocab = h.real;
  return in;
}

// One linear_logp call on rows [row0, row0 + rows) with targets `t` (device, [n]) and topk = k (0:
// none); logits when serving; every output poisoned first.
Result run(const Head& h, int64_t row0, int64_t rows, const DevBuf<int64_t>& t, int64_t k, bool serving) {
  DevBuf<float> logp(static_cast<size_t>(rows)), lse(static_cast<size_t>(rows)),
      logits(serving ? static_cast<size_t>(rows * h.v) : 0), tl(static_cast<size_t>(rows * k));
  DevBuf<int64_t> ids(static_cast<size_t>(rows * k));
  logp.poison();
  lse.poison();
  logits.poison();
  tl.poison();
  ids.poison();
  detlogp::LinearLogpOutputs out;
  out.logp = detlogp::mutable_vector(logp.get(), DType::f32, rows, Memory::cuda);
  out.lse = detlogp::mutable_vector(lse.get(), DType::f32, rows, Memory::cuda);
  if (serving) out.logits = detlogp::mutable_matrix(logits.get(), DType::f32, rows, h.v, Memory::cuda);
  if (k > 0) {
    out.topk_ids = detlogp::mutable_matrix(ids.get(), DType::i64, rows, k, Memory::cuda);
    out.topk_logp = detlogp::mutable_matrix(tl.get(), DType::f32, rows, k, Memory::cuda);
  }
  detlogp::CallOptions opt;
  opt.strict = true;
  detlogp::linear_logp(inputs(h, row0, rows, t.get()), out, opt);
  GPU_CUDA(cudaDeviceSynchronize());
  return {logp.to_host(), lse.to_host(), logits.to_host(), tl.to_host(), ids.to_host()};
}

DevBuf<int64_t> device_targets(const std::vector<int64_t>& t) {
  DevBuf<int64_t> d(t.size());
  d.from_host(t);
  return d;
}

std::vector<int64_t> some_targets(const Head& h) {
  std::vector<int64_t> t(static_cast<size_t>(h.n));
  for (int64_t r = 0; r < h.n; ++r) t[r] = r % 7 == 3 ? -100 : (r * 7919 + 13) % h.real;
  return t;
}

// The first k ids of a full sort of row r's y (from the serving logits z) by topk_before.
std::vector<int64_t> sorted_ids(const Head& h, const std::vector<float>& z, const std::vector<float>& temps, int64_t r,
                                int64_t k) {
  const float inv_t = detlogp::inverse_temperature(temps.empty() ? 1.0f : temps[r]);
  std::vector<detlogp::TopkEntry> all(static_cast<size_t>(h.real));
  for (int64_t v = 0; v < h.real; ++v) all[v] = {detlogp::scale_logit(z[r * h.v + v], inv_t), v};
  std::partial_sort(all.begin(), all.begin() + k, all.end(), detlogp::topk_before);
  std::vector<int64_t> ids(static_cast<size_t>(k));
  for (int64_t j = 0; j < k; ++j) ids[j] = all[j].id;
  return ids;
}

// The top-k call against the contract: ids by a full sort of the serving logits of the same call,
// logp and lse as the call without top-k, topk_logp column j (a few columns) as a single-target
// call for those ids. Returns the mismatches.
int64_t check_topk(const Head& h, int64_t k, bool serving, const std::string& what) {
  const DevBuf<int64_t> t = device_targets(some_targets(h));
  const Result top = run(h, 0, h.n, t, k, true);
  const Result plain = run(h, 0, h.n, t, 0, serving);
  const std::vector<float> temps = h.temps.size() ? h.temps.to_host() : std::vector<float>{};
  int64_t bad = 0;
  const auto l = detlogp::bitcmp::compare(plain.logp, top.logp);
  const auto s = detlogp::bitcmp::compare(plain.lse, top.lse);
  if (!l.identical() || !s.identical()) {
    ADD_FAILURE() << what << ": " << l.describe("logp") << "; " << s.describe("lse");
    ++bad;
  }
  if (serving) {
    const auto z = detlogp::bitcmp::compare(plain.logits, top.logits);
    if (!z.identical()) {
      ADD_FAILURE() << what << ": " << z.describe("logits");
      ++bad;
    }
  }
  for (int64_t r = 0; r < h.n; ++r) {
    const std::vector<int64_t> want = sorted_ids(h, top.logits, temps, r, k);
    for (int64_t j = 0; j < k; ++j)
      if (top.topk_ids[r * k + j] != want[j] && bad++ < 5)
        ADD_FAILURE() << what << ": topk_ids[" << r << ", " << j << "] = " << top.topk_ids[r * k + j]
                      << ", a full sort of the logits gives " << want[j];
  }
  std::vector<int64_t> columns{0, k - 1, k / 2};
  columns.erase(std::unique(columns.begin(), columns.end()), columns.end());
  for (int64_t j : columns) {
    std::vector<int64_t> col(static_cast<size_t>(h.n));
    for (int64_t r = 0; r < h.n; ++r) col[r] = top.topk_ids[r * k + j];
    const Result single = run(h, 0, h.n, device_targets(col), 0, false);
    for (int64_t r = 0; r < h.n; ++r)
      if (!same_bits(top.topk_logp[r * k + j], single.logp[r]) && bad++ < 5)
        ADD_FAILURE() << what << ": topk_logp[" << r << ", " << j << "] = " << top.topk_logp[r * k + j]
                      << ", the single-target call for id " << col[r] << " gives " << single.logp[r];
  }
  return bad;
}

}  // namespace

TEST_F(Sm90Topk, IdsAreAFullSortAndLogpIsTheSingleTargetBits) {
  struct S {
    int64_t n, d, v;
    bool bias, temps;
  };
  // 140 rows at the Qwen3 vocabulary take one CTA a whole row (past the few-rows split), whose
  // listing pass finds its floor from the first round's loads.
  std::vector<S> shapes{{37, 64, 17, false, false},
                        {29, 72, 123, true, false},
                        {67, 64, 2053, true, true},
                        {options().small ? int64_t{3} : int64_t{9}, 128, 151936, false, true}};
  if (!options().small) shapes.push_back({140, 64, 151936, true, true});
  for (const S& s : shapes) {
    const Head h(s.n, s.d, s.v, s.bias, s.temps, static_cast<uint64_t>(s.v));
    for (int64_t k : {1, 5, 20, 128}) {
      if (k > s.v) continue;
      for (bool serving : {false, true}) {
        const std::string what = "N=" + std::to_string(s.n) + " V=" + std::to_string(s.v) + " K=" + std::to_string(k) +
                                 (serving ? " serving" : " trainer");
        EXPECT_EQ(check_topk(h, k, serving, what), 0) << what;
      }
    }
  }
  // Every real id (K = V_real = 17), and padding rows past real_vocab never listed.
  const Head all(11, 64, 17, true, false, 3);
  EXPECT_EQ(check_topk(all, 17, false, "K=V=17"), 0);
  const Head padded(13, 64, 128, true, false, 4, 100);
  EXPECT_EQ(check_topk(padded, 100, false, "V=128 real 100 K=100"), 0);
}

// Rows built from the bias alone (hidden rows zero: z is the bias exactly): exact ties (broken by
// the lower id), a row whose 128 top threads hold ~2500 lanes above the bound (more than the
// kernel's candidate buffer: the radix path), and a NaN row (hidden NaN: every y NaN, ids 0..K-1 in
// order, logp NaN). With 4 rows each row is split over slices; with 160 (random rows after the
// first four) one CTA takes a whole row.
namespace {
void ties_overflow_and_nan_rows(int64_t n) {
  const int64_t d = 64, v = 151936;
  Head h(n, d, v, true, false, 9);
  std::vector<float> bias(static_cast<size_t>(v));
  for (int64_t c = 0; c < v; ++c) bias[c] = static_cast<float>(c % 7) - 3.0f;  // ties: 3 at ids 6, 13, 20, ...
  for (int64_t t = 0; t < 128; ++t)
    for (int64_t i = 0; i < 20; ++i)
      bias[t + 256 * i] = 20.0f + static_cast<float>(t) * static_cast<float>(i + 1) / 20.0f;
  h.m.bias.from_host(bias);
  std::vector<uint16_t> hid(static_cast<size_t>(n * d), 0);
  for (int64_t c = 0; c < d; ++c) hid[2 * d + c] = 0x7FC0;  // row 2: NaN
  fill_bf16_uniform(h.hidden.get() + 3 * d, d, 77, 2.0f);   // row 3: random
  GPU_CUDA(cudaMemcpy(h.hidden.get(), hid.data(), static_cast<size_t>(3 * d) * 2, cudaMemcpyHostToDevice));
  for (int64_t k : {1, 20, 128}) EXPECT_EQ(check_topk(h, k, false, "bias rows K=" + std::to_string(k)), 0);
  const Result r = run(h, 2, 1, device_targets(std::vector<int64_t>(n, 0)), 8, false);
  for (int64_t j = 0; j < 8; ++j) {
    EXPECT_EQ(r.topk_ids[j], j) << "NaN row";
    EXPECT_TRUE(detlogp::fp::is_nan(r.topk_logp[j])) << "NaN row: topk_logp[" << j << "] = " << r.topk_logp[j];
  }
}

}  // namespace

TEST_F(Sm90Topk, TiesOverflowAndNanRows) {
  for (int64_t n : {int64_t{4}, int64_t{160}}) {
    if (n > 4 && options().small) continue;
    ties_overflow_and_nan_rows(n);
  }
}

// A row's top-k does not depend on the other rows, on the N chunking or on the launch bucket.
TEST_F(Sm90Topk, ARowAloneChunksAndBucketsGiveTheSameBits) {
  const Head h(300, 64, 2053, true, true, 21);
  const int64_t k = 16;
  const DevBuf<int64_t> t = device_targets(some_targets(h));
  const Result batch = run(h, 0, h.n, t, k, false);
  for (int64_t r : {int64_t{0}, int64_t{63}, int64_t{64}, int64_t{299}}) {
    const Result alone = run(h, r, 1, t, k, false);
    for (int64_t j = 0; j < k; ++j)
      EXPECT_TRUE(alone.topk_ids[j] == batch.topk_ids[r * k + j] &&
                  same_bits(alone.topk_logp[j], batch.topk_logp[r * k + j]))
          << "row " << r << " entry " << j << " differs alone";
  }
  // At the Qwen3 vocabulary a few rows split each row over several CTAs (topk_split) and a batch of
  // 200 does not: the same ids and bits.
  const Head wide(200, 64, 151936, false, true, 23);
  const DevBuf<int64_t> wt = device_targets(some_targets(wide));
  const Result wide_batch = run(wide, 0, wide.n, wt, 20, false);
  for (int64_t first : {int64_t{0}, int64_t{131}, int64_t{190}})
    for (int64_t rows : {int64_t{1}, int64_t{8}, int64_t{10}}) {
      const Result few = run(wide, first, rows, wt, 20, false);
      for (int64_t e = 0; e < rows * 20; ++e)
        EXPECT_TRUE(few.topk_ids[e] == wide_batch.topk_ids[first * 20 + e] &&
                    same_bits(few.topk_logp[e], wide_batch.topk_logp[first * 20 + e]))
            << "V=151936: rows " << first << "+" << rows << " entry " << e << " differ from the batch's";
    }
  {
    ScopedEnv env("DETLOGP_SM90_WORKSPACE_MB", "1");  // ~127 rows a chunk
    const Result chunked = run(h, 0, h.n, t, k, false);
    EXPECT_EQ(chunked.topk_ids, batch.topk_ids) << "chunked";
    EXPECT_TRUE(detlogp::bitcmp::compare(batch.topk_logp, chunked.topk_logp).identical()) << "chunked";
  }
  for (const std::string& name : sm90_bucket_names()) {
    ScopedEnv env("DETLOGP_SM90_BUCKET", name.c_str());
    const Result b = run(h, 0, h.n, t, k, false);
    EXPECT_EQ(b.topk_ids, batch.topk_ids) << name;
    EXPECT_TRUE(detlogp::bitcmp::compare(batch.topk_logp, b.topk_logp).identical()) << name;
  }
}

// Host tensors through the SM90 backend (its device copies) give the CUDA call's bits.
TEST_F(Sm90Topk, HostTensorsGiveTheDeviceBits) {
  const Head h(19, 64, 500, true, false, 31);
  const int64_t k = 7;
  const std::vector<int64_t> targets = some_targets(h);
  const Result dev = run(h, 0, h.n, device_targets(targets), k, false);
  const std::vector<uint16_t> hid = h.hidden.to_host(), w = h.m.weight.to_host();
  const std::vector<float> b = h.m.bias.to_host();
  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(hid.data(), DType::bf16, h.n, h.d);
  in.weight = detlogp::TensorView::matrix(w.data(), DType::bf16, h.v, h.d);
  in.bias = detlogp::TensorView::vector(b.data(), DType::f32, h.v);
  in.targets = detlogp::TensorView::vector(targets.data(), DType::i64, h.n);
  std::vector<float> logp(h.n), lse(h.n), tl(static_cast<size_t>(h.n * k));
  std::vector<int64_t> ids(static_cast<size_t>(h.n * k));
  detlogp::LinearLogpOutputs out;
  out.logp = detlogp::mutable_vector(logp.data(), DType::f32, h.n);
  out.lse = detlogp::mutable_vector(lse.data(), DType::f32, h.n);
  out.topk_ids = detlogp::mutable_matrix(ids.data(), DType::i64, h.n, k);
  out.topk_logp = detlogp::mutable_matrix(tl.data(), DType::f32, h.n, k);
  detlogp::CallOptions opt;
  opt.backend = "cuda-fused-linear-logp-sm90-contract-v1";
  detlogp::linear_logp(in, out, opt);
  EXPECT_EQ(ids, dev.topk_ids);
  EXPECT_TRUE(detlogp::bitcmp::compare(dev.topk_logp, tl).identical());
  EXPECT_TRUE(detlogp::bitcmp::compare(dev.logp, logp).identical());
}

// A target out of range: named, and no output written (top-k ones included).
TEST_F(Sm90Topk, ABadTargetWritesNothing) {
  const Head h(40, 64, 500, false, true, 41);
  std::vector<int64_t> targets = some_targets(h);
  targets[17] = 500;
  const DevBuf<int64_t> t = device_targets(targets);
  const int64_t k = 4;
  DevBuf<float> logp(h.n), lse(h.n), tl(static_cast<size_t>(h.n * k));
  DevBuf<int64_t> ids(static_cast<size_t>(h.n * k));
  logp.poison();
  lse.poison();
  tl.poison();
  GPU_CUDA(cudaMemset(ids.get(), 0x5A, ids.size() * 8));
  detlogp::LinearLogpOutputs out;
  out.logp = detlogp::mutable_vector(logp.get(), DType::f32, h.n, Memory::cuda);
  out.lse = detlogp::mutable_vector(lse.get(), DType::f32, h.n, Memory::cuda);
  out.topk_ids = detlogp::mutable_matrix(ids.get(), DType::i64, h.n, k, Memory::cuda);
  out.topk_logp = detlogp::mutable_matrix(tl.get(), DType::f32, h.n, k, Memory::cuda);
  std::string msg;
  try {
    detlogp::linear_logp(inputs(h, 0, h.n, t.get()), out);
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("targets[17]=500 is >= real_vocab=500"), std::string::npos) << msg;
  EXPECT_EQ(count_poison(logp.get(), h.n), h.n);
  EXPECT_EQ(count_poison(lse.get(), h.n), h.n);
  EXPECT_EQ(count_poison(tl.get(), h.n * k), h.n * k);
  for (int64_t id : ids.to_host()) ASSERT_EQ(id, 0x5A5A5A5A5A5A5A5All) << "topk_ids written on a bad target";
}

namespace {

detlogp::LinearLogpInputs shard_inputs(const Head& h, const DeviceShard& s, const int64_t* targets) {
  detlogp::LinearLogpInputs in = inputs(h, 0, h.n, targets);
  in.weight = detlogp::TensorView::matrix(s.weight.get(), DType::bf16, s.count, h.d, Memory::cuda);
  in.bias = s.bias.size() ? detlogp::TensorView::vector(s.bias.get(), DType::f32, s.count, Memory::cuda)
                          : detlogp::TensorView{};
  in.vocab_start = s.start;
  return in;
}

}  // namespace

// The tensor-parallel operator over simulated ranks on one GPU (local CUDA communicators): every
// rank's top-k ids and logp are the TP = 1 bits, for shards on and off the tile grid, a shard with
// fewer real ids than K and one that holds padding only.
TEST_F(Sm90Topk, TensorParallelRanksGiveTheTp1Bits) {
  const Head h(45, 64, 2112, true, true, 51, 2053);  // ids [2053, 2112) are padding
  const int64_t k = 20;
  const DevBuf<int64_t> t = device_targets(some_targets(h));
  const Result ref = run(h, 0, h.n, t, k, false);
  for (const std::vector<int64_t>& bounds :
       {std::vector<int64_t>{0, 1024, 2112}, std::vector<int64_t>{0, 700, 1301, 2112},
        std::vector<int64_t>{0, 64, 1000, 1010, 2053, 2112}}) {
    const int tp = static_cast<int>(bounds.size()) - 1;
    std::vector<DeviceShard> shards = make_shards(h.m, bounds);
    auto comms = detlogp::make_local_communicators(tp, Memory::cuda, 0);
    std::vector<DevBuf<float>> logp(tp), lse(tp), tl(tp);
    std::vector<DevBuf<int64_t>> ids(tp);
    std::vector<std::string> errors(tp);
    for (int r = 0; r < tp; ++r) {
      logp[r] = DevBuf<float>(static_cast<size_t>(h.n));
      lse[r] = DevBuf<float>(static_cast<size_t>(h.n));
      tl[r] = DevBuf<float>(static_cast<size_t>(h.n * k));
      ids[r] = DevBuf<int64_t>(static_cast<size_t>(h.n * k));
      logp[r].poison();
      lse[r].poison();
      tl[r].poison();
      ids[r].poison();
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r)
      threads.emplace_back([&, r] {
        try {
          GPU_CUDA(cudaSetDevice(0));
          detlogp::LinearLogpOutputs out;
          out.logp = detlogp::mutable_vector(logp[r].get(), DType::f32, h.n, Memory::cuda);
          out.lse = detlogp::mutable_vector(lse[r].get(), DType::f32, h.n, Memory::cuda);
          out.topk_ids = detlogp::mutable_matrix(ids[r].get(), DType::i64, h.n, k, Memory::cuda);
          out.topk_logp = detlogp::mutable_matrix(tl[r].get(), DType::f32, h.n, k, Memory::cuda);
          detlogp::CallOptions opt;
          opt.strict = true;
          detlogp::linear_logp_tensor_parallel(shard_inputs(h, shards[r], t.get()), out, *comms[r], opt);
          GPU_CUDA(cudaDeviceSynchronize());
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& th : threads) th.join();
    for (int r = 0; r < tp; ++r) {
      const std::string what = "TP=" + std::to_string(tp) + " rank " + std::to_string(r);
      ASSERT_TRUE(errors[r].empty()) << what << ": " << errors[r];
      EXPECT_EQ(ids[r].to_host(), ref.topk_ids) << what;
      const auto a = detlogp::bitcmp::compare(ref.topk_logp, tl[r].to_host());
      const auto b = detlogp::bitcmp::compare(ref.logp, logp[r].to_host());
      EXPECT_TRUE(a.identical() && b.identical())
          << what << ": " << a.describe("topk_logp") << "; " << b.describe("logp");
    }
  }
}

// linear_logp_partials on each shard (CUDA memory) with their top-k lists, merge_partials with the
// device merge: the TP = 1 bits.
TEST_F(Sm90Topk, PartialsAndTheDeviceMergeGiveTheTp1Bits) {
  const Head h(33, 64, 1000, false, false, 61);
  const int64_t k = 12;
  const DevBuf<int64_t> t = device_targets(some_targets(h));
  const Result ref = run(h, 0, h.n, t, k, false);
  const std::vector<int64_t> bounds{0, 333, 640, 1000};
  std::vector<DeviceShard> shards = make_shards(h.m, bounds);
  struct Bufs {
    DevBuf<detlogp::TileSummary> sums;
    DevBuf<float> y, edge, topk_logit;
    DevBuf<int64_t> topk_ids;
    DevBuf<uint8_t> owned;
    detlogp::ShardPartials p;
  };
  std::vector<Bufs> bufs(shards.size());
  std::vector<detlogp::ShardPartials> ranks;
  for (size_t r = 0; r < shards.size(); ++r) {
    const detlogp::ShardGeometry g = detlogp::shard_geometry(shards[r].start, shards[r].count, h.v);
    Bufs& b = bufs[r];
    b.sums = DevBuf<detlogp::TileSummary>(static_cast<size_t>(std::max<int64_t>(1, h.n * g.tiles)));
    b.y = DevBuf<float>(static_cast<size_t>(h.n));
    b.owned = DevBuf<uint8_t>(static_cast<size_t>(h.n));
    b.edge = DevBuf<float>(static_cast<size_t>(std::max<int64_t>(1, h.n * g.edge_lanes())));
    b.topk_logit = DevBuf<float>(static_cast<size_t>(h.n * k));
    b.topk_ids = DevBuf<int64_t>(static_cast<size_t>(h.n * k));
    b.p.rows = h.n;
    b.p.tiles = g.tiles;
    b.p.edge_lanes = g.edge_lanes();
    b.p.summaries = b.sums.get();
    b.p.target_logit = b.y.get();
    b.p.target_owned = b.owned.get();
    b.p.edge_logits = b.edge.get();
    b.p.topk = k;
    b.p.topk_logit = b.topk_logit.get();
    b.p.topk_ids = b.topk_ids.get();
    b.p.memory = Memory::cuda;
    b.p.device = 0;
    detlogp::CallOptions opt;
    opt.strict = true;
    detlogp::linear_logp_partials(shard_inputs(h, shards[r], t.get()), b.p, opt);
    ranks.push_back(b.p);
  }
  DevBuf<float> logp(h.n), lse(h.n), tl(static_cast<size_t>(h.n * k));
  DevBuf<int64_t> ids(static_cast<size_t>(h.n * k));
  logp.poison();
  lse.poison();
  tl.poison();
  detlogp::LinearLogpOutputs out;
  out.logp = detlogp::mutable_vector(logp.get(), DType::f32, h.n, Memory::cuda);
  out.lse = detlogp::mutable_vector(lse.get(), DType::f32, h.n, Memory::cuda);
  out.topk_ids = detlogp::mutable_matrix(ids.get(), DType::i64, h.n, k, Memory::cuda);
  out.topk_logp = detlogp::mutable_matrix(tl.get(), DType::f32, h.n, k, Memory::cuda);
  detlogp::merge_partials(ranks, detlogp::TensorView::vector(t.get(), DType::i64, h.n, Memory::cuda), -100, out);
  GPU_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(ids.to_host(), ref.topk_ids);
  const auto a = detlogp::bitcmp::compare(ref.topk_logp, tl.to_host());
  const auto b = detlogp::bitcmp::compare(ref.lse, lse.to_host());
  EXPECT_TRUE(a.identical() && b.identical()) << a.describe("topk_logp") << "; " << b.describe("lse");
}

// The candidate path (full mode, N >= 128 rows, no logits: the fused run's lane-group candidates,
// with the groups it cannot decide recomputed by the wgmma model) against the row kernel over the
// serving logits (DETLOGP_SM90_TOPK_LOGITS=1), which the tests above check against a full sort: the
// same ids and bits, and logp / lse as the call without top-k. Random rows with a bias and row
// temperatures, zero hidden rows (z is the bias or 0: ties everywhere, and zero logits), a NaN row,
// and a vocabulary tile whose 64 weight rows are one row (equal lanes in every lane group: its
// groups are recomputed wherever they reach the top K); K = 1 .. 128, odd vocabularies, N chunked.
TEST_F(Sm90Topk, TheCandidatePathGivesTheLogitsPathBits) {
  struct S {
    int64_t n, d, v;
    bool bias, temps;
  };
  const S shapes[] = {{130, 64, 17, true, false},
                      {150, 72, 2053, true, true},
                      {options().small ? int64_t{128} : int64_t{260}, 128, 151936, false, true},
                      {129, 64, 151936, true, false}};
  for (const S& s : shapes) {
    Head h(s.n, s.d, s.v, s.bias, s.temps, static_cast<uint64_t>(s.v + 5));
    std::vector<uint16_t> hid = h.hidden.to_host();
    std::fill(hid.begin(), hid.begin() + 2 * s.d, uint16_t{0});                 // rows 0, 1: zero
    std::fill(hid.begin() + 2 * s.d, hid.begin() + 3 * s.d, uint16_t{0x7FC0});  // row 2: NaN
    h.hidden.from_host(hid);
    if (s.v >= 6 * 64) {  // tile 5: one weight row, twice its size, in all 64 lanes
      std::vector<uint16_t> w = h.m.weight.to_host();
      const std::vector<uint16_t> row(w.begin() + 5 * 64 * s.d, w.begin() + (5 * 64 + 1) * s.d);
      for (int64_t c = 5 * 64; c < 6 * 64; ++c)
        for (int64_t e = 0; e < s.d; ++e) {
          const float x = detlogp::fp::bf16_to_float(row[e]) * 2.0f;  // exact in bf16
          w[c * s.d + e] = static_cast<uint16_t>(detlogp::fp::bits(x) >> 16);
        }
      h.m.weight.from_host(w);
    }
    const DevBuf<int64_t> t = device_targets(some_targets(h));
    for (int64_t k : {1, 20, 128}) {
      if (k > s.v) continue;
      const std::string what = "N=" + std::to_string(s.n) + " V=" + std::to_string(s.v) + " K=" + std::to_string(k);
      const Result cand = run(h, 0, h.n, t, k, false);
      Result logits;
      {
        ScopedEnv env("DETLOGP_SM90_TOPK_LOGITS", "1");
        logits = run(h, 0, h.n, t, k, false);
      }
      EXPECT_EQ(cand.topk_ids, logits.topk_ids) << what;
      const auto a = detlogp::bitcmp::compare(logits.topk_logp, cand.topk_logp);
      const auto b = detlogp::bitcmp::compare(logits.logp, cand.logp);
      const auto c = detlogp::bitcmp::compare(logits.lse, cand.lse);
      EXPECT_TRUE(a.identical() && b.identical() && c.identical())
          << what << ": " << a.describe("topk_logp") << "; " << b.describe("logp") << "; " << c.describe("lse");
      if (k == 20) {
        ScopedEnv env("DETLOGP_SM90_WORKSPACE_MB", "1");  // candidate chunks of a few rows at V = 151936
        const Result chunked = run(h, 0, h.n, t, k, false);
        EXPECT_EQ(chunked.topk_ids, cand.topk_ids) << what << " chunked";
        EXPECT_TRUE(detlogp::bitcmp::compare(cand.topk_logp, chunked.topk_logp).identical()) << what << " chunked";
      }
    }
  }
}

// Tensor parallel on the SM90 backend.
//   one-GPU simulation: TP in {1, 2, 4, 8} ranks as threads on one device (in-process CUDA
//     communicators), Qwen3-8B lm_head shape padded 152064 / real 151936, trainer and serving;
//   linear_logp_partials + merge_partials on CUDA memory: the layout recorded and checked; the
//     merge's entropy output from usums on the device equals the host merge's bits;
//   real NCCL (when built with NCCL and >= 2 GPUs are visible): TP in {2, 4, 8} up to the GPU
//     count, one GPU per rank; every rank's logp/lse equal the TP = 1 bits; an invalid target
//     makes every rank throw the same error (no hang); the usual logsumexp-of-logsumexps merge
//     differs from its TP = 1 on some rows while detlogp does not (negative control).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "detlogp/dist.hpp"
#include "gpu_test_util.hpp"
#include "test_random.hpp"
#ifdef DETLOGP_WITH_NCCL
#include "detlogp/nccl.hpp"
#endif

using namespace gput;
namespace bc = detlogp::bitcmp;

namespace {

// Qwen3-8B lm_head, padded; `--small` (for compute-sanitizer) uses D=256, V=2112 real 2053.
int64_t kDim = 4096, kVocab = 152064, kReal = 151936;

struct Reference {
  std::vector<float> logp, lse, logits;  // logits [rows][kVocab] (serving run)
};

// One rank's inputs on its device: a copy of the shard, hidden and targets.
struct RankData {
  int device = 0;
  int64_t start = 0, count = 0;
  DevBuf<uint16_t> hidden, weight;
  DevBuf<float> bias;
  DevBuf<int32_t> targets;
  Outputs out;
  std::string error;
  cudaStream_t stream = nullptr;
  RankData() = default;
  RankData(const RankData&) = delete;
  RankData& operator=(const RankData&) = delete;
  ~RankData() {
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

void upload_rank(RankData& r, int device, int64_t start, int64_t count, const std::vector<uint16_t>& h,
                 const std::vector<uint16_t>& w, const std::vector<float>& b, const std::vector<int32_t>& t,
                 int64_t rows, bool serving) {
  GPU_CUDA(cudaSetDevice(device));
  r.device = device;
  r.start = start;
  r.count = count;
  r.hidden = DevBuf<uint16_t>(h.size());
  r.hidden.from_host(h);
  r.weight = DevBuf<uint16_t>(static_cast<size_t>(count * kDim));
  GPU_CUDA(cudaMemcpy(r.weight.get(), w.data() + start * kDim, static_cast<size_t>(count * kDim) * 2,
                      cudaMemcpyHostToDevice));
  r.bias = DevBuf<float>(static_cast<size_t>(count));
  GPU_CUDA(cudaMemcpy(r.bias.get(), b.data() + start, static_cast<size_t>(count) * 4, cudaMemcpyHostToDevice));
  r.targets = DevBuf<int32_t>(t.size());
  r.targets.from_host(t);
  r.out.make(rows, count, serving);
  if (r.stream == nullptr) GPU_CUDA(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
}

detlogp::LinearLogpInputs rank_inputs(const RankData& r, int64_t rows) {
  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(r.hidden.get(), detlogp::DType::bf16, rows, kDim, detlogp::Memory::cuda);
  in.hidden.device = r.device;
  in.weight = detlogp::TensorView::matrix(r.weight.get(), detlogp::DType::bf16, r.count, kDim, detlogp::Memory::cuda);
  in.weight.device = r.device;
  in.bias = detlogp::TensorView::vector(r.bias.get(), detlogp::DType::f32, r.count, detlogp::Memory::cuda);
  in.bias.device = r.device;
  in.targets = detlogp::TensorView::vector(r.targets.get(), detlogp::DType::i32, rows, detlogp::Memory::cuda);
  in.targets.device = r.device;
  in.vocab_start = r.start;
  in.real_vocab = kReal;
  return in;
}

detlogp::LinearLogpOutputs rank_outputs(RankData& r, int64_t rows) {
  detlogp::LinearLogpOutputs o;
  o.logp = detlogp::mutable_vector(r.out.logp.get(), detlogp::DType::f32, rows, detlogp::Memory::cuda);
  o.lse = detlogp::mutable_vector(r.out.lse.get(), detlogp::DType::f32, rows, detlogp::Memory::cuda);
  o.logp.device = o.lse.device = r.device;
  if (r.out.logits.size()) {
    o.logits = detlogp::mutable_matrix(r.out.logits.get(), detlogp::DType::f32, rows, r.count, detlogp::Memory::cuda);
    o.logits.device = r.device;
  }
  return o;
}

// Runs the operator on every rank in its own thread; errors are recorded per rank.
void run_ranks(std::vector<RankData>& ranks, std::vector<std::unique_ptr<detlogp::Communicator>>& comms, int64_t rows) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      detlogp::CallOptions opt;
      opt.strict = true;
      opt.cuda_stream = ranks[r].stream;
      try {
        GPU_CUDA(cudaSetDevice(ranks[r].device));
        detlogp::linear_logp_tensor_parallel(rank_inputs(ranks[r], rows), rank_outputs(ranks[r], rows), *comms[r], opt);
        GPU_CUDA(cudaStreamSynchronize(ranks[r].stream));
      } catch (const std::exception& e) {  // detlogp::Error, or a CUDA error of the test itself
        ranks[r].error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
}

// Columns [start, start + count) of every row of the whole vocabulary's logits [rows][kVocab].
std::vector<float> logits_shard(const std::vector<float>& logits, int64_t rows, int64_t start, int64_t count) {
  std::vector<float> shard;
  for (int64_t n = 0; n < rows; ++n)
    shard.insert(shard.end(), logits.begin() + n * kVocab + start, logits.begin() + n * kVocab + start + count);
  return shard;
}

// Every rank succeeded and holds the reference bits (and its logits shard on the serving entry).
int64_t check_ranks(std::vector<RankData>& ranks, const Reference& ref, int64_t rows, const std::string& what) {
  int64_t mismatched_rows = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_TRUE(ranks[r].error.empty()) << what << " rank " << r << " threw: " << ranks[r].error;
    if (!ranks[r].error.empty()) continue;
    GPU_CUDA(cudaSetDevice(ranks[r].device));
    const auto logp = ranks[r].out.logp.to_host(), lse = ranks[r].out.lse.to_host();
    for (int64_t n = 0; n < rows; ++n)
      mismatched_rows += (!same_bits(logp[n], ref.logp[n]) || !same_bits(lse[n], ref.lse[n])) ? 1 : 0;
    const auto a = bc::compare(ref.logp, logp), b = bc::compare(ref.lse, lse);
    EXPECT_TRUE(a.identical() && b.identical())
        << what << " rank " << r << ": " << a.describe("logp") << "; " << b.describe("lse");
    if (ranks[r].out.logits.size() && !ref.logits.empty()) {
      const auto got = ranks[r].out.logits.to_host();
      const auto c = bc::compare(logits_shard(ref.logits, rows, ranks[r].start, ranks[r].count), got);
      EXPECT_TRUE(c.identical()) << what << " rank " << r << " logits shard: " << c.describe("logits");
    }
  }
  return mismatched_rows;
}

std::vector<int64_t> even_bounds(int ranks) {
  std::vector<int64_t> b;
  const int64_t per = (kVocab / ranks + 63) / 64 * 64;  // 152064 / 8 = 19008 = 297 * 64
  for (int r = 0; r <= ranks; ++r) b.push_back(std::min(kVocab, per * r));
  return b;
}

// The usual vocab-parallel merge from fp32 logits: per-rank logsumexp, then logsumexp of those.
float usual_lse(const std::vector<float>& logits, int64_t n, const std::vector<int64_t>& bounds) {
  std::vector<float> part;
  for (size_t r = 0; r + 1 < bounds.size(); ++r) {
    const int64_t end = std::min(bounds[r + 1], kReal);
    float m = -INFINITY, s = 0.0f;
    for (int64_t v = bounds[r]; v < end; ++v) m = std::max(m, logits[n * kVocab + v]);
    for (int64_t v = bounds[r]; v < end; ++v) s += std::exp(logits[n * kVocab + v] - m);
    if (end > bounds[r]) part.push_back(m + std::log(s));
  }
  float m = -INFINITY, s = 0.0f;
  for (float l : part) m = std::max(m, l);
  for (float l : part) s += std::exp(l - m);
  return m + std::log(s);
}

// One model (host copies; each rank uploads its own shard to its own device), the hidden rows and
// targets (the vocabulary's edges, an ignored row, the TP = 2 split), and the TP = 1 reference:
// the whole (padded) vocabulary on GPU 0, serving entry.
class Sm90Tp : public Sm90Test {
 protected:
  int64_t rows = 0;
  std::vector<uint16_t> h, w;
  std::vector<float> b;
  std::vector<int32_t> t;
  Reference ref;

  void SetUp() override {
    Sm90Test::SetUp();
    if (IsSkipped()) return;
    if (options().small) {
      kDim = 256;
      kVocab = 2112;
      kReal = 2053;
    }
    // 37 rows: the device merge's held-tiles schedule (<= 256 rows, also under compute-sanitizer);
    // 300: its many-row schedule.
    rows = options().small ? 37 : 300;
    DeviceModel model;
    model.make(kDim, kVocab, 0x7E57, true);
    w = model.weight.to_host();
    b = model.bias.to_host();
    DevBuf<uint16_t> hdev(static_cast<size_t>(rows * kDim));
    fill_bf16_uniform(hdev.get(), rows * kDim, 0x4D1D, 1.0f);
    h = hdev.to_host();
    t.resize(static_cast<size_t>(rows));
    for (int64_t n = 0; n < rows; ++n) t[n] = static_cast<int32_t>((n * 1000003) % kReal);
    t[0] = 0;
    t[1] = kReal - 1;
    t[2] = -100;
    t[3] = even_bounds(2)[1] - 1;  // last id of rank 0 at TP = 2
    t[4] = even_bounds(2)[1];      // first id of rank 1

    std::vector<RankData> one(1);
    upload_rank(one[0], 0, 0, kVocab, h, w, b, t, rows, true);
    detlogp::CallOptions opt;
    opt.strict = true;
    detlogp::linear_logp(rank_inputs(one[0], rows), rank_outputs(one[0], rows), opt);
    GPU_CUDA(cudaDeviceSynchronize());
    ref.logp = one[0].out.logp.to_host();
    ref.lse = one[0].out.lse.to_host();
    ref.logits = one[0].out.logits.to_host();
  }

  // The ranks of an even split over `devices` (rank r on device devices[r]), with targets `targets`.
  std::vector<RankData> make_ranks(int tp, const std::vector<int>& devices, const std::vector<int32_t>& targets,
                                   bool serving) {
    const auto bounds = even_bounds(tp);
    std::vector<RankData> ranks(static_cast<size_t>(tp));
    for (int r = 0; r < tp; ++r)
      upload_rank(ranks[r], devices[r], bounds[r], bounds[r + 1] - bounds[r], h, w, b, targets, rows, serving);
    return ranks;
  }
};

}  // namespace

TEST_F(Sm90Tp, SimulatedRanksOnOneGpuGiveTheTp1Bits) {
  for (int tp : {1, 2, 4, 8}) {
    for (bool serving : {false, true}) {
      if (serving && tp != 2) continue;
      const auto bounds = even_bounds(tp);
      if (bounds[tp - 1] >= bounds[tp]) continue;  // more ranks than 64-id tiles (--small)
      std::vector<RankData> ranks = make_ranks(tp, std::vector<int>(tp, 0), t, serving);
      auto comms = detlogp::make_local_communicators(tp, detlogp::Memory::cuda, 0);
      run_ranks(ranks, comms, rows);
      const int64_t bad =
          check_ranks(ranks, ref, rows, "simulated TP=" + std::to_string(tp) + (serving ? " serving" : ""));
      std::printf("simulated TP=%d%s on one GPU: %lld of %lld rows differ from TP=1\n", tp, serving ? " serving" : "",
                  static_cast<long long>(bad), static_cast<long long>(rows));
    }
  }
}

TEST_F(Sm90Tp, GatherRowChunksAreBitNeutral) {
  ScopedEnv tiny_workspace("DETLOGP_TP_WORKSPACE_MB", "1");
  std::vector<RankData> ranks = make_ranks(2, {0, 0}, t, false);
  auto comms = detlogp::make_local_communicators(2, detlogp::Memory::cuda, 0);
  run_ranks(ranks, comms, rows);
  check_ranks(ranks, ref, rows, "simulated TP=2, 1 MiB gather chunks");
}

// The public pieces on CUDA memory: linear_logp_partials on each shard records its layout (the
// targets read back for their digest), merge_partials checks it and gives the TP = 1 bits; shards
// out of rank order, other targets and another ignore_index are refused with nothing written.
TEST_F(Sm90Tp, CudaPartialsCarryTheirLayoutAndTheMergeChecksIt) {
  const auto bounds = even_bounds(2);
  std::vector<RankData> ranks = make_ranks(2, {0, 0}, t, false);
  detlogp::CallOptions opt;
  opt.strict = true;
  opt.cuda_stream = ranks[0].stream;
  struct DevicePartials {
    DevBuf<detlogp::TileSummary> summaries;
    DevBuf<float> target_logit;
    DevBuf<uint8_t> owned;
    detlogp::ShardPartials p;
  };
  std::vector<DevicePartials> parts(2);
  for (int r = 0; r < 2; ++r) {
    DevicePartials& d = parts[r];
    const int64_t tiles = detlogp::shard_tiles(ranks[r].count);
    d.summaries = DevBuf<detlogp::TileSummary>(static_cast<size_t>(rows * tiles));
    d.target_logit = DevBuf<float>(static_cast<size_t>(rows));
    d.owned = DevBuf<uint8_t>(static_cast<size_t>(rows));
    d.p.rows = rows;
    d.p.tiles = tiles;
    d.p.summaries = d.summaries.get();
    d.p.target_logit = d.target_logit.get();
    d.p.target_owned = d.owned.get();
    d.p.memory = detlogp::Memory::cuda;
    d.p.device = 0;
    detlogp::linear_logp_partials(rank_inputs(ranks[r], rows), d.p, opt);
    EXPECT_EQ(d.p.layout.vocab_start, bounds[r]) << "rank " << r;
    EXPECT_EQ(d.p.layout.vocab_local, bounds[r + 1] - bounds[r]) << "rank " << r;
    EXPECT_EQ(d.p.layout.real_vocab, kReal) << "rank " << r;
  }
  EXPECT_EQ(parts[0].p.layout.targets_digest, parts[1].p.layout.targets_digest);
  EXPECT_EQ(parts[0].p.layout.backend_digest, parts[1].p.layout.backend_digest);

  DevBuf<float> logp(static_cast<size_t>(rows)), lse(static_cast<size_t>(rows));
  auto merge = [&](std::vector<detlogp::ShardPartials> in_order, const int32_t* targets, int64_t ignore_index) {
    logp.poison();
    lse.poison();
    auto vec = [&](float* p) {
      detlogp::MutableTensorView v = detlogp::mutable_vector(p, detlogp::DType::f32, rows, detlogp::Memory::cuda);
      v.device = 0;
      return v;
    };
    detlogp::TensorView tv = detlogp::TensorView::vector(targets, detlogp::DType::i32, rows, detlogp::Memory::cuda);
    tv.device = 0;
    std::string error;
    try {
      detlogp::merge_partials(in_order, tv, ignore_index, vec(logp.get()), vec(lse.get()), opt);
      GPU_CUDA(cudaStreamSynchronize(ranks[0].stream));
    } catch (const detlogp::Error& e) {
      error = e.what();
    }
    return error;
  };
  const std::string ok = merge({parts[0].p, parts[1].p}, ranks[0].targets.get(), -100);
  ASSERT_TRUE(ok.empty()) << ok;
  const auto a = bc::compare(ref.logp, logp.to_host()), b = bc::compare(ref.lse, lse.to_host());
  EXPECT_TRUE(a.identical() && b.identical()) << a.describe("logp") << "; " << b.describe("lse");

  auto expect_refused = [&](const std::string& error, const std::string& needle, const char* what) {
    EXPECT_NE(error.find(needle), std::string::npos) << what << ": '" << error << "'";
    EXPECT_EQ(count_poison(logp.get(), rows), rows) << what << ": logp written despite the error";
    EXPECT_EQ(count_poison(lse.get(), rows), rows) << what << ": lse written despite the error";
  };
  expect_refused(merge({parts[1].p, parts[0].p}, ranks[0].targets.get(), -100),
                 "rank 1 shard starts at vocab_start=0, before rank 0's vocab_start=" + std::to_string(bounds[1]),
                 "swapped shards");
  std::vector<int32_t> other = t;
  other[5] = (other[5] + 1) % static_cast<int32_t>(kReal);
  DevBuf<int32_t> other_dev(other.size());
  other_dev.from_host(other);
  expect_refused(merge({parts[0].p, parts[1].p}, other_dev.get(), -100),
                 "targets differ from those the partials were computed with", "other targets");
  expect_refused(merge({parts[0].p, parts[1].p}, ranks[0].targets.get(), -1),
                 "ignore_index=-1 differs from ignore_index=-100 the partials were computed with",
                 "another ignore_index");
}

// merge_partials' entropy output on CUDA memory: the CPU backend's partials with their usums (host
// memory, one problem with padding, bias, per-row temperatures, an ignored row and a NaN row),
// copied to the device, merge there (the device merge's entropy chain) to the bits of the same
// merge on the host; a rank without usums is refused naming it, with nothing written. Independent
// of which backend computes partials on the device.
namespace {

// One case of the test below: n_rows rows.
void merge_with_entropy_case(int64_t n_rows) {
  constexpr int64_t kDimE = 64, kVocabE = 2112, kRealE = 2053;
  const std::vector<int64_t> bounds = {0, 704, 1408, 2112};
  detlogp_test::Rng rng(2026);
  std::vector<uint16_t> h(n_rows * kDimE), w(kVocabE * kDimE);
  for (auto& x : h) x = detlogp::fp::bf16_round(static_cast<float>(rng.normal()));
  for (auto& x : w) x = detlogp::fp::bf16_round(static_cast<float>(rng.normal() * 3.0 / 8.0));
  h[6 * kDimE + 3] = 0x7FC0;  // row 6: a NaN row
  std::vector<float> b(kVocabE), temps(n_rows);
  for (auto& x : b) x = static_cast<float>(rng.normal() * 0.5);
  std::vector<int32_t> t(n_rows);
  for (int64_t n = 0; n < n_rows; ++n) {
    t[n] = static_cast<int32_t>(rng.below(kRealE));
    temps[n] = 0.5f + 0.125f * static_cast<float>(n % 9);
  }
  t[2] = -100;
  struct Shard {
    std::vector<detlogp::TileSummary> summaries;
    std::vector<float> target_logit, usums;
    std::vector<uint8_t> owned;
    detlogp::ShardPartials host;
    DevBuf<detlogp::TileSummary> d_summaries;
    DevBuf<float> d_target_logit, d_usums;
    DevBuf<uint8_t> d_owned;
    detlogp::ShardPartials dev;
  };
  std::vector<Shard> shards(bounds.size() - 1);
  detlogp::CallOptions cpu;
  cpu.backend = "cpu-linear-logp-contract-v1";
  for (size_t r = 0; r < shards.size(); ++r) {
    Shard& s = shards[r];
    const int64_t start = bounds[r], count = bounds[r + 1] - bounds[r], tiles = detlogp::shard_tiles(count);
    detlogp::LinearLogpInputs in;
    in.hidden = detlogp::TensorView::matrix(h.data(), detlogp::DType::bf16, n_rows, kDimE);
    in.weight = detlogp::TensorView::matrix(w.data() + start * kDimE, detlogp::DType::bf16, count, kDimE);
    in.bias = detlogp::TensorView::vector(b.data() + start, detlogp::DType::f32, count);
    in.targets = detlogp::TensorView::vector(t.data(), detlogp::DType::i32, n_rows);
    in.temperature_rows = detlogp::TensorView::vector(temps.data(), detlogp::DType::f32, n_rows);
    in.vocab_start = start;
    in.real_vocab = kRealE;
    s.summaries.resize(static_cast<size_t>(n_rows * tiles));
    s.target_logit.resize(n_rows);
    s.owned.resize(n_rows);
    s.usums.resize(static_cast<size_t>(n_rows * tiles));
    s.host.rows = n_rows;
    s.host.tiles = tiles;
    s.host.summaries = s.summaries.data();
    s.host.target_logit = s.target_logit.data();
    s.host.target_owned = s.owned.data();
    s.host.usums = s.usums.data();
    detlogp::linear_logp_partials(in, s.host, cpu);
    s.d_summaries = DevBuf<detlogp::TileSummary>(s.summaries.size());
    s.d_summaries.from_host(s.summaries);
    s.d_target_logit = DevBuf<float>(s.target_logit.size());
    s.d_target_logit.from_host(s.target_logit);
    s.d_owned = DevBuf<uint8_t>(s.owned.size());
    s.d_owned.from_host(s.owned);
    s.d_usums = DevBuf<float>(s.usums.size());
    s.d_usums.from_host(s.usums);
    s.dev = s.host;
    s.dev.summaries = s.d_summaries.get();
    s.dev.target_logit = s.d_target_logit.get();
    s.dev.target_owned = s.d_owned.get();
    s.dev.usums = s.d_usums.get();
    s.dev.memory = detlogp::Memory::cuda;
    s.dev.device = 0;
  }
  // The host merge: the reference bits (themselves TP = 1's, tests/cpu/test_tp_entropy.cpp).
  std::vector<float> logp(n_rows), lse(n_rows), entropy(n_rows);
  std::vector<detlogp::ShardPartials> host_ranks, dev_ranks;
  for (const Shard& s : shards) {
    host_ranks.push_back(s.host);
    dev_ranks.push_back(s.dev);
  }
  detlogp::merge_partials(host_ranks, detlogp::TensorView::vector(t.data(), detlogp::DType::i32, n_rows), -100,
                          detlogp::mutable_vector(logp.data(), detlogp::DType::f32, n_rows),
                          detlogp::mutable_vector(lse.data(), detlogp::DType::f32, n_rows),
                          detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, n_rows));
  ASSERT_TRUE(std::isnan(entropy[6]) && std::isfinite(entropy[2]));

  DevBuf<int32_t> d_t(t.size());
  d_t.from_host(t);
  DevBuf<float> d_logp(n_rows), d_lse(n_rows), d_entropy(n_rows);
  auto vec = [&](float* p) {
    detlogp::MutableTensorView v = detlogp::mutable_vector(p, detlogp::DType::f32, n_rows, detlogp::Memory::cuda);
    v.device = 0;
    return v;
  };
  detlogp::TensorView tv = detlogp::TensorView::vector(d_t.get(), detlogp::DType::i32, n_rows, detlogp::Memory::cuda);
  tv.device = 0;
  auto merge = [&](const std::vector<detlogp::ShardPartials>& ranks) {
    d_logp.poison();
    d_lse.poison();
    d_entropy.poison();
    std::string error;
    try {
      detlogp::merge_partials(ranks, tv, -100, vec(d_logp.get()), vec(d_lse.get()), vec(d_entropy.get()));
      GPU_CUDA(cudaDeviceSynchronize());
    } catch (const detlogp::Error& e) {
      error = e.what();
    }
    return error;
  };
  const std::string ok = merge(dev_ranks);
  ASSERT_TRUE(ok.empty()) << ok;
  const auto a = bc::compare(logp, d_logp.to_host()), c = bc::compare(lse, d_lse.to_host()),
             e = bc::compare(entropy, d_entropy.to_host());
  EXPECT_TRUE(a.identical() && c.identical() && e.identical())
      << a.describe("logp") << "; " << c.describe("lse") << "; " << e.describe("entropy");

  std::vector<detlogp::ShardPartials> missing = dev_ranks;
  missing[1].usums = nullptr;
  const std::string refused = merge(missing);
  EXPECT_NE(refused.find("rank 1 partials carry none (usums is null)"), std::string::npos) << refused;
  EXPECT_EQ(count_poison(d_logp.get(), n_rows), n_rows);
  EXPECT_EQ(count_poison(d_lse.get(), n_rows), n_rows);
  EXPECT_EQ(count_poison(d_entropy.get(), n_rows), n_rows);
}

}  // namespace

// Needs no model of its own: a plain SM90 test, not the Sm90Tp fixture.
class Sm90TpEntropy : public Sm90Test {};

TEST_F(Sm90TpEntropy, CudaMergeWithEntropyEqualsTheHostMerge) {
  // 37 rows: the device merge's held-tiles schedule; 300: its many-row schedule.
  for (const int64_t n_rows : {int64_t{37}, int64_t{300}}) {
    SCOPED_TRACE("rows=" + std::to_string(n_rows));
    merge_with_entropy_case(n_rows);
  }
}

// Real NCCL, one GPU per rank, TP in {2, 4, 8} up to the GPU count.
TEST_F(Sm90Tp, NcclRanksGiveTheTp1BitsAndRefuseAnInvalidTargetTogether) {
#ifdef DETLOGP_WITH_NCCL
  if (!options().nccl) GTEST_SKIP() << "NCCL part skipped: --no-nccl";
  int gpus = 0;
  GPU_CUDA(cudaGetDeviceCount(&gpus));
  if (gpus < 2) GTEST_SKIP() << "NCCL part skipped: fewer than 2 GPUs visible";
  for (int tp = 2; tp <= gpus && tp <= 8; tp *= 2) {
    std::vector<ncclComm_t> comms_raw(static_cast<size_t>(tp));
    std::vector<int> devs(static_cast<size_t>(tp));
    for (int r = 0; r < tp; ++r) devs[r] = r;
    const ncclResult_t init = ncclCommInitAll(comms_raw.data(), tp, devs.data());
    ASSERT_EQ(init, ncclSuccess) << "ncclCommInitAll(" << tp << ") failed: " << ncclGetErrorString(init);
    std::vector<std::unique_ptr<detlogp::Communicator>> comms;
    for (int r = 0; r < tp; ++r) comms.push_back(detlogp::make_nccl_communicator(comms_raw[r]));
    const auto bounds = even_bounds(tp);
    for (bool serving : {false, true}) {
      std::vector<RankData> ranks = make_ranks(tp, devs, t, serving);
      run_ranks(ranks, comms, rows);
      const int64_t bad = check_ranks(ranks, ref, rows, "NCCL TP=" + std::to_string(tp) + (serving ? " serving" : ""));
      std::printf("NCCL TP=%d%s on %d GPUs: %lld of %lld rows differ from TP=1 (logp and lse, every rank)\n", tp,
                  serving ? " serving" : "", tp, static_cast<long long>(bad), static_cast<long long>(rows));
      if (serving && tp == 2) {
        // Negative control on the same logits: the usual merge moves with the split, detlogp does not.
        int64_t usual_bad = 0;
        for (int64_t n = 0; n < rows; ++n)
          usual_bad += usual_lse(ref.logits, n, {0, kVocab}) != usual_lse(ref.logits, n, bounds) ? 1 : 0;
        std::printf("negative control: the usual merge at TP=2 differs from its TP=1 on %lld of %lld rows\n",
                    static_cast<long long>(usual_bad), static_cast<long long>(rows));
        EXPECT_GT(usual_bad, 0) << "the usual merge matched its TP=1 on every row; the control shows nothing";
      }
    }
    {  // An invalid target: every rank throws the same message and nobody hangs.
      std::vector<int32_t> bad_t = t;
      bad_t[7] = 200000;
      std::vector<RankData> ranks = make_ranks(tp, devs, bad_t, false);
      run_ranks(ranks, comms, rows);
      const std::string expect = "targets[7]=200000 is >= real_vocab=" + std::to_string(kReal);
      for (int r = 0; r < tp; ++r) {
        EXPECT_NE(ranks[r].error.find(expect), std::string::npos)
            << "NCCL TP=" << tp << " rank " << r << " error: '" << ranks[r].error << "'";
        EXPECT_EQ(ranks[r].error, ranks[0].error) << "rank " << r << " disagrees with rank 0";
        GPU_CUDA(cudaSetDevice(r));
        EXPECT_EQ(count_poison(ranks[r].out.logp.get(), rows), rows) << "rank " << r << " wrote logp";
      }
      std::printf("NCCL TP=%d invalid target: every rank refused: %s\n", tp,
                  ranks[0].error.substr(0, ranks[0].error.find('\n', ranks[0].error.find('\n') + 1)).c_str());
    }
    for (auto c : comms_raw) ncclCommDestroy(c);
  }
#else
  GTEST_SKIP() << "NCCL part skipped: this build has no NCCL (DETLOGP_WITH_NCCL undefined)";
#endif
}

// ---- Shards at any boundary (docs/contract.md §7) ------------------------------------------------
// Engines split an unpadded head as V / TP (Qwen3 151936 / 4 = 37984, not a multiple of 64): the
// SM90 partial mode then computes the whole tiles in the fused launch and the edge columns in a
// launch of their own, and the device merge assembles the straddling tiles (their summaries on the
// device, chained as the completing rank's head tile). logp, lse and entropy keep the TP = 1 bits.
namespace {

// V / tp rows each over the real vocabulary, the last rank also holding the padding rows.
std::vector<int64_t> engine_bounds(int tp) {
  std::vector<int64_t> b{0};
  for (int r = 0; r < tp; ++r) b.push_back(b.back() + kReal / tp + (r < kReal % tp ? 1 : 0));
  b.back() = kVocab;
  return b;
}

// One lane, a shard inside one tile, shards of a few lanes around the real vocabulary's end and one
// of padding only, off the grid.
std::vector<int64_t> narrow_bounds() {
  if (options().small) return {0, 1, 70, 90, 1000, 2049, 2052, 2060, kVocab};
  return {0, 1, 70, 90, 2050, 2060, 100001, 151900, 151990, kVocab};
}

std::string bounds_name(const std::vector<int64_t>& bounds) {
  std::string s = "shards";
  for (int64_t x : bounds) s += " " + std::to_string(x);
  return s;
}

// t with targets right before, at and after every boundary (where real).
std::vector<int32_t> boundary_targets(std::vector<int32_t> t, const std::vector<int64_t>& bounds) {
  size_t n = 5;
  for (size_t r = 1; r + 1 < bounds.size(); ++r)
    for (int64_t d : {-1, 0, 1}) {
      const int64_t id = bounds[r] + d;
      if (id >= 0 && id < kReal && n < t.size()) t[n++] = static_cast<int32_t>(id);
    }
  return t;
}

detlogp::MutableTensorView device_vector(float* p, int64_t rows, int device) {
  detlogp::MutableTensorView v = detlogp::mutable_vector(p, detlogp::DType::f32, rows, detlogp::Memory::cuda);
  v.device = device;
  return v;
}

// TP = 1 on GPU 0 with the entropy output: logp, lse, entropy (and the logits, serving).
struct EntropyReference {
  std::vector<float> logp, lse, entropy, logits;
};
EntropyReference tp1_with_entropy(const std::vector<uint16_t>& h, const std::vector<uint16_t>& w,
                                  const std::vector<float>& b, const std::vector<int32_t>& targets, int64_t rows) {
  std::vector<RankData> one(1);
  upload_rank(one[0], 0, 0, kVocab, h, w, b, targets, rows, true);
  DevBuf<float> entropy(static_cast<size_t>(rows));
  detlogp::LinearLogpOutputs out = rank_outputs(one[0], rows);
  out.entropy = device_vector(entropy.get(), rows, 0);
  detlogp::CallOptions opt;
  opt.strict = true;
  detlogp::linear_logp(rank_inputs(one[0], rows), out, opt);
  GPU_CUDA(cudaDeviceSynchronize());
  return {one[0].out.logp.to_host(), one[0].out.lse.to_host(), entropy.to_host(), one[0].out.logits.to_host()};
}

}  // namespace

namespace {

// The operator over `bounds` (rank r on devices[r], over `comms`) with the entropy output: every
// rank's logp, lse and entropy against `want` (and its logits shard, serving). Returns the rank-rows
// that differ.
int64_t run_unaligned(const std::vector<int64_t>& bounds, const std::vector<int>& devices,
                      std::vector<std::unique_ptr<detlogp::Communicator>>& comms, const std::vector<uint16_t>& h,
                      const std::vector<uint16_t>& w, const std::vector<float>& b, const std::vector<int32_t>& targets,
                      int64_t rows, bool serving, const EntropyReference& want, const std::string& what) {
  const int tp = static_cast<int>(bounds.size()) - 1;
  std::vector<RankData> ranks(static_cast<size_t>(tp));
  std::vector<DevBuf<float>> entropy(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    upload_rank(ranks[r], devices[r], bounds[r], bounds[r + 1] - bounds[r], h, w, b, targets, rows, serving);
    entropy[r] = DevBuf<float>(static_cast<size_t>(rows));
    entropy[r].poison();
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r)
    threads.emplace_back([&, r] {
      detlogp::CallOptions opt;
      opt.strict = true;
      opt.cuda_stream = ranks[r].stream;
      try {
        GPU_CUDA(cudaSetDevice(ranks[r].device));
        detlogp::LinearLogpOutputs out = rank_outputs(ranks[r], rows);
        out.entropy = device_vector(entropy[r].get(), rows, ranks[r].device);
        detlogp::linear_logp_tensor_parallel(rank_inputs(ranks[r], rows), out, *comms[r], opt);
        GPU_CUDA(cudaStreamSynchronize(ranks[r].stream));
      } catch (const std::exception& e) {
        ranks[r].error = e.what();
      }
    });
  for (auto& th : threads) th.join();
  int64_t bad = 0;
  for (int r = 0; r < tp; ++r) {
    EXPECT_TRUE(ranks[r].error.empty()) << what << " rank " << r << ": " << ranks[r].error;
    if (!ranks[r].error.empty()) continue;
    GPU_CUDA(cudaSetDevice(ranks[r].device));
    const auto logp = ranks[r].out.logp.to_host(), lse = ranks[r].out.lse.to_host(), ent = entropy[r].to_host();
    const auto a = bc::compare(want.logp, logp), c = bc::compare(want.lse, lse), e = bc::compare(want.entropy, ent);
    EXPECT_TRUE(a.identical() && c.identical() && e.identical())
        << what << " rank " << r << ": " << a.describe("logp") << "; " << c.describe("lse") << "; "
        << e.describe("entropy");
    for (int64_t n = 0; n < rows; ++n)
      bad += !same_bits(logp[n], want.logp[n]) || !same_bits(lse[n], want.lse[n]) || !same_bits(ent[n], want.entropy[n])
                 ? 1
                 : 0;
    if (serving) {
      const auto z =
          bc::compare(logits_shard(want.logits, rows, ranks[r].start, ranks[r].count), ranks[r].out.logits.to_host());
      EXPECT_TRUE(z.identical()) << what << " rank " << r << " logits shard: " << z.describe("logits");
    }
  }
  return bad;
}

}  // namespace

TEST_F(Sm90Tp, UnalignedShardsOnOneGpuGiveTheTp1Bits) {
  std::vector<std::vector<int64_t>> splits;
  for (int tp : {2, 3, 4, 8}) splits.push_back(engine_bounds(tp));
  splits.push_back(narrow_bounds());
  for (size_t i = 0; i < splits.size(); ++i) {
    const std::vector<int64_t>& bounds = splits[i];
    const int tp = static_cast<int>(bounds.size()) - 1;
    const std::vector<int32_t> targets = boundary_targets(t, bounds);
    const EntropyReference want = tp1_with_entropy(h, w, b, targets, rows);
    for (bool serving : {false, true}) {
      if (serving && i != 1) continue;  // the serving entry at TP = 3: every rank's logits shard too
      const std::string what = bounds_name(bounds) + (serving ? " serving" : "");
      auto comms = detlogp::make_local_communicators(tp, detlogp::Memory::cuda, 0);
      const int64_t bad = run_unaligned(bounds, std::vector<int>(static_cast<size_t>(tp), 0), comms, h, w, b, targets,
                                        rows, serving, want, what);
      std::printf("%s on one GPU: %lld rank-rows differ from TP=1 (logp, lse, entropy)\n", what.c_str(),
                  static_cast<long long>(bad));
    }
  }
}

// The same over real NCCL, one GPU per rank, TP in {2, 4, 8} up to the GPU count.
TEST_F(Sm90Tp, NcclUnalignedShardsGiveTheTp1Bits) {
#ifdef DETLOGP_WITH_NCCL
  if (!options().nccl) GTEST_SKIP() << "NCCL part skipped: --no-nccl";
  int gpus = 0;
  GPU_CUDA(cudaGetDeviceCount(&gpus));
  if (gpus < 2) GTEST_SKIP() << "NCCL part skipped: fewer than 2 GPUs visible";
  for (int tp = 2; tp <= gpus && tp <= 8; tp *= 2) {
    std::vector<ncclComm_t> comms_raw(static_cast<size_t>(tp));
    std::vector<int> devs(static_cast<size_t>(tp));
    for (int r = 0; r < tp; ++r) devs[r] = r;
    const ncclResult_t init = ncclCommInitAll(comms_raw.data(), tp, devs.data());
    ASSERT_EQ(init, ncclSuccess) << "ncclCommInitAll(" << tp << ") failed: " << ncclGetErrorString(init);
    std::vector<std::unique_ptr<detlogp::Communicator>> comms;
    for (int r = 0; r < tp; ++r) comms.push_back(detlogp::make_nccl_communicator(comms_raw[r]));
    const std::vector<int64_t> bounds = engine_bounds(tp);
    const std::vector<int32_t> targets = boundary_targets(t, bounds);
    const EntropyReference want = tp1_with_entropy(h, w, b, targets, rows);
    for (bool serving : {false, true}) {
      const std::string what = "NCCL " + bounds_name(bounds) + (serving ? " serving" : "");
      const int64_t bad = run_unaligned(bounds, devs, comms, h, w, b, targets, rows, serving, want, what);
      std::printf("%s on %d GPUs: %lld rank-rows differ from TP=1 (logp, lse, entropy)\n", what.c_str(), tp,
                  static_cast<long long>(bad));
    }
    for (auto c : comms_raw) ncclCommDestroy(c);
  }
#else
  GTEST_SKIP() << "NCCL part skipped: this build has no NCCL (DETLOGP_WITH_NCCL undefined)";
#endif
}

// The CUDA partials of shards off the tile grid are the contract's pieces of the TP = 1 logits: each
// whole tile's summary is tile_summary of the TP = 1 scaled logits, each edge lane the TP = 1 scaled
// logit of its id, y_t the owner's. merge_partials on the device (the straddling tiles assembled
// there) gives the bits of the host merge of the same partials and of TP = 1, with the entropy, at
// 37 rows (the held-tiles merge) and at the fixture's rows (the chunked merge, 300 without --small).
TEST_F(Sm90Tp, UnalignedCudaPartialsAreTheTp1PiecesAndMergeOnTheDevice) {
  const std::vector<int64_t> bounds = engine_bounds(3);
  for (const int64_t n_rows : {int64_t{37}, rows}) {
    SCOPED_TRACE("rows=" + std::to_string(n_rows));
    std::vector<int32_t> targets = boundary_targets(t, bounds);
    targets.resize(static_cast<size_t>(n_rows));
    std::vector<uint16_t> hn(h.begin(), h.begin() + n_rows * kDim);
    const EntropyReference want = tp1_with_entropy(hn, w, b, targets, n_rows);
    struct DevicePartials {
      DevBuf<detlogp::TileSummary> summaries;
      DevBuf<float> target_logit, usums, edge;
      DevBuf<uint8_t> owned;
      detlogp::ShardPartials p;
      std::vector<detlogp::TileSummary> h_summaries;
      std::vector<float> h_target_logit, h_usums, h_edge;
      std::vector<uint8_t> h_owned;
      detlogp::ShardPartials host;
    };
    std::vector<RankData> ranks(bounds.size() - 1);
    std::vector<DevicePartials> parts(bounds.size() - 1);
    detlogp::CallOptions opt;
    opt.strict = true;
    for (size_t r = 0; r + 1 < bounds.size(); ++r) {
      upload_rank(ranks[r], 0, bounds[r], bounds[r + 1] - bounds[r], hn, w, b, targets, n_rows, false);
      const detlogp::ShardGeometry g = detlogp::shard_geometry(bounds[r], bounds[r + 1] - bounds[r], kReal);
      DevicePartials& d = parts[r];
      d.summaries = DevBuf<detlogp::TileSummary>(static_cast<size_t>(n_rows * g.tiles));
      d.usums = DevBuf<float>(static_cast<size_t>(n_rows * g.tiles));
      d.target_logit = DevBuf<float>(static_cast<size_t>(n_rows));
      d.owned = DevBuf<uint8_t>(static_cast<size_t>(n_rows));
      d.edge = DevBuf<float>(static_cast<size_t>(n_rows * g.edge_lanes()));
      d.p.rows = n_rows;
      d.p.tiles = g.tiles;
      d.p.edge_lanes = g.edge_lanes();
      d.p.summaries = d.summaries.get();
      d.p.usums = d.usums.get();
      d.p.target_logit = d.target_logit.get();
      d.p.target_owned = d.owned.get();
      d.p.edge_logits = d.edge.get();
      d.p.memory = detlogp::Memory::cuda;
      d.p.device = 0;
      opt.cuda_stream = ranks[r].stream;
      detlogp::linear_logp_partials(rank_inputs(ranks[r], n_rows), d.p, opt);
      GPU_CUDA(cudaStreamSynchronize(ranks[r].stream));
      d.h_summaries = d.summaries.to_host();
      d.h_usums = d.usums.to_host();
      d.h_target_logit = d.target_logit.to_host();
      d.h_owned = d.owned.to_host();
      d.h_edge = d.edge.to_host();
      d.host = d.p;
      d.host.memory = detlogp::Memory::host;
      d.host.summaries = d.h_summaries.data();
      d.host.usums = d.h_usums.data();
      d.host.target_logit = d.h_target_logit.data();
      d.host.target_owned = d.h_owned.data();
      d.host.edge_logits = d.h_edge.data();
      // The pieces against the TP = 1 logits (z, scaled as the contract scales: T = 1 here).
      for (int64_t n = 0; n < n_rows; ++n) {
        for (int64_t j = 0; j < g.tiles; ++j) {
          const int64_t g0 = (g.first_tile + j) * 64;
          float y[64] = {};
          for (int l = 0; l < 64 && g0 + l < kVocab; ++l) y[l] = want.logits[n * kVocab + g0 + l];
          const int real = static_cast<int>(std::clamp<int64_t>(kReal - g0, 0, 64));
          const detlogp::TileEntropySummary s = detlogp::tile_entropy_summary(y, real);
          const detlogp::TileSummary got = d.h_summaries[n * g.tiles + j];
          ASSERT_TRUE(same_bits(got.max, s.summary.max) && same_bits(got.sum, s.summary.sum) &&
                      same_bits(d.h_usums[n * g.tiles + j], s.usum))
              << "rank " << r << " row " << n << " whole tile " << g.first_tile + j;
        }
        for (int64_t e = 0; e < g.edge_lanes(); ++e) {
          const int64_t id = e < g.head_lanes ? bounds[r] + e : bounds[r + 1] - g.tail_lanes + (e - g.head_lanes);
          ASSERT_TRUE(same_bits(d.h_edge[n * g.edge_lanes() + e], want.logits[n * kVocab + id]))
              << "rank " << r << " row " << n << " edge lane " << e << " (id " << id << ")";
        }
        const int64_t tg = targets[n];
        const bool owns = tg != -100 && tg >= bounds[r] && tg < bounds[r + 1];
        ASSERT_EQ(d.h_owned[n], owns ? 1 : 0) << "rank " << r << " row " << n;
        if (owns) {
          ASSERT_TRUE(same_bits(d.h_target_logit[n], want.logits[n * kVocab + tg])) << "rank " << r << " row " << n;
        }
      }
    }
    std::vector<detlogp::ShardPartials> dev, host;
    for (const DevicePartials& d : parts) {
      dev.push_back(d.p);
      host.push_back(d.host);
    }
    std::vector<float> logp(n_rows), lse(n_rows), entropy(n_rows);
    detlogp::merge_partials(host, detlogp::TensorView::vector(targets.data(), detlogp::DType::i32, n_rows), -100,
                            detlogp::mutable_vector(logp.data(), detlogp::DType::f32, n_rows),
                            detlogp::mutable_vector(lse.data(), detlogp::DType::f32, n_rows),
                            detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, n_rows));
    DevBuf<float> d_logp(n_rows), d_lse(n_rows), d_entropy(n_rows);
    d_logp.poison();
    d_lse.poison();
    d_entropy.poison();
    detlogp::TensorView tv =
        detlogp::TensorView::vector(ranks[0].targets.get(), detlogp::DType::i32, n_rows, detlogp::Memory::cuda);
    tv.device = 0;
    opt.cuda_stream = ranks[0].stream;
    detlogp::merge_partials(dev, tv, -100, device_vector(d_logp.get(), n_rows, 0),
                            device_vector(d_lse.get(), n_rows, 0), device_vector(d_entropy.get(), n_rows, 0), opt);
    GPU_CUDA(cudaStreamSynchronize(ranks[0].stream));
    for (const auto& [name, got, host_bits, tp1] :
         {std::tuple<const char*, std::vector<float>, std::vector<float>*, const std::vector<float>*>{
              "logp", d_logp.to_host(), &logp, &want.logp},
          {"lse", d_lse.to_host(), &lse, &want.lse},
          {"entropy", d_entropy.to_host(), &entropy, &want.entropy}}) {
      const auto a = bc::compare(*host_bits, got), c = bc::compare(*tp1, got);
      EXPECT_TRUE(a.identical()) << a.describe(std::string("device merge against the host merge: ") + name);
      EXPECT_TRUE(c.identical()) << c.describe(std::string("device merge against TP = 1: ") + name);
    }
  }
}

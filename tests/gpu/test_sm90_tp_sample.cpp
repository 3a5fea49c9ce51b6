// The sampling program over vocabulary shards on CUDA tensors (docs/contract.md §11.9,
// docs/tensor-parallel.md): sample_tensor_parallel and the replay's linear_logp_tensor_parallel over
// in-process CUDA communicators (ranks as threads on one GPU) at TP = 2, 3, 4 with engine splits off
// the tile grid, shards narrower than a tile and a shard of padding only, and over real NCCL (one GPU
// per rank, when built with NCCL and >= 2 GPUs are visible): every rank's token, logp, logp_raw, lse
// and support_size (the replay's lse_support, support_max, cut_logit, cut_id) equal the bits of the
// single-GPU sample / replay at TP = 1, and each rank's logits shard equals its columns of the TP = 1
// logits, and the top-k output beside the draw equals linear_logp's top-k at the rows'
// temperatures (1 for a greedy row) at TP = 1. A bad device parameter on one rank and inconsistent
// shards are refused by every rank with the same message, nothing written, no rank left in a
// collective.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "detlogp/dist.hpp"
#include "gpu_test_util.hpp"
#ifdef DETLOGP_WITH_NCCL
#include "detlogp/nccl.hpp"
#endif

using namespace gput;
namespace bc = detlogp::bitcmp;
using detlogp::DType;
using detlogp::Memory;
using detlogp::TensorView;

namespace {

// Padded V not a multiple of 64, an odd real vocabulary; `--small` shrinks D and N.
int64_t kDim = 512, kVocab = 8250, kReal = 8221;
constexpr uint64_t kSeed = 0xC0FFEE;
constexpr int64_t kTopk = 12;  // the top-k output beside the draw of the tensor-parallel sample

TensorView dev(TensorView t, int device) {
  t.memory = Memory::cuda;
  t.device = device;
  return t;
}
detlogp::MutableTensorView dev_out(void* p, DType t, int64_t n, int device) {
  return {dev(TensorView::vector(p, t, n), device)};
}

// The host copies every rank uploads from.
struct Host {
  int64_t rows = 0;
  std::vector<uint16_t> h, w;
  std::vector<float> b;
  std::vector<float> temperature, top_p, min_p;
  std::vector<int64_t> top_k, key, targets;
};

// Outputs of both entries, poisoned before the call.
struct Result {
  std::vector<int64_t> token, support_size, cut_id;
  std::vector<float> logp, logp_raw, lse, lse_support, support_max, cut_logit, logits;
  std::vector<int64_t> topk_ids;  // [rows][kTopk]
  std::vector<float> topk_logp;
};

// One rank's operands and outputs on its device: the shard [start, start + count).
struct Rank {
  int device = 0;
  int64_t start = 0, count = 0;
  DevBuf<uint16_t> hidden, weight;
  DevBuf<float> bias, temperature, top_p, min_p;
  DevBuf<int64_t> top_k, key, targets;
  DevBuf<int64_t> token, support_size, cut_id;
  DevBuf<float> logp, logp_raw, lse, lse_support, support_max, cut_logit, logits;
  DevBuf<int64_t> topk_ids;
  DevBuf<float> topk_logp;
  bool with_topk = false;  // sample_outputs asks for the top-k output
  cudaStream_t stream = nullptr;
  std::string error;
  Rank() = default;
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;
  ~Rank() {
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }

  template <class T>
  static DevBuf<T> upload(const std::vector<T>& v) {
    DevBuf<T> d(v.size());
    d.from_host(v);
    return d;
  }
  void make(const Host& x, int dev_id, int64_t s, int64_t c) {
    GPU_CUDA(cudaSetDevice(dev_id));
    device = dev_id;
    start = s;
    count = c;
    const int64_t n = x.rows;
    hidden = upload(x.h);
    weight = upload(std::vector<uint16_t>(x.w.begin() + s * kDim, x.w.begin() + (s + c) * kDim));
    bias = upload(std::vector<float>(x.b.begin() + s, x.b.begin() + s + c));
    temperature = upload(x.temperature);
    top_p = upload(x.top_p);
    min_p = upload(x.min_p);
    top_k = upload(x.top_k);
    key = upload(x.key);
    targets = upload(x.targets);
    token = DevBuf<int64_t>(n);
    support_size = DevBuf<int64_t>(n);
    cut_id = DevBuf<int64_t>(n);
    for (auto* f : {&logp, &logp_raw, &lse, &lse_support, &support_max, &cut_logit}) *f = DevBuf<float>(n);
    logits = DevBuf<float>(static_cast<size_t>(n * c));
    topk_ids = DevBuf<int64_t>(static_cast<size_t>(n * kTopk));
    topk_logp = DevBuf<float>(static_cast<size_t>(n * kTopk));
    for (auto* i : {&token, &support_size, &cut_id, &topk_ids}) i->poison();
    for (auto* f : {&logp, &logp_raw, &lse, &lse_support, &support_max, &cut_logit, &logits, &topk_logp}) f->poison();
    if (stream == nullptr) GPU_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }

  detlogp::SamplingProgram program(int64_t n) const {
    detlogp::SamplingProgram s;
    s.temperature_rows = dev(TensorView::vector(temperature.get(), DType::f32, n), device);
    s.top_k_rows = dev(TensorView::vector(top_k.get(), DType::i64, n), device);
    s.top_p_rows = dev(TensorView::vector(top_p.get(), DType::f32, n), device);
    s.min_p_rows = dev(TensorView::vector(min_p.get(), DType::f32, n), device);
    return s;
  }
  detlogp::SampleInputs sample_inputs(int64_t n) const {
    detlogp::SampleInputs in;
    in.hidden = dev(TensorView::matrix(hidden.get(), DType::bf16, n, kDim), device);
    in.weight = dev(TensorView::matrix(weight.get(), DType::bf16, count, kDim), device);
    in.bias = dev(TensorView::vector(bias.get(), DType::f32, count), device);
    in.real_vocab = kReal;
    in.vocab_start = start;
    in.program = program(n);
    in.seed = kSeed;
    in.key = dev(TensorView::vector(key.get(), DType::i64, n), device);
    return in;
  }
  detlogp::SampleOutputs sample_outputs(int64_t n) {
    detlogp::SampleOutputs o;
    o.token = dev_out(token.get(), DType::i64, n, device);
    o.logp = dev_out(logp.get(), DType::f32, n, device);
    o.logp_raw = dev_out(logp_raw.get(), DType::f32, n, device);
    o.lse = dev_out(lse.get(), DType::f32, n, device);
    o.support_size = dev_out(support_size.get(), DType::i64, n, device);
    o.logits = {dev(TensorView::matrix(logits.get(), DType::f32, n, count), device)};
    if (with_topk) {
      o.topk_ids = {dev(TensorView::matrix(topk_ids.get(), DType::i64, n, kTopk), device)};
      o.topk_logp = {dev(TensorView::matrix(topk_logp.get(), DType::f32, n, kTopk), device)};
    }
    return o;
  }
  detlogp::LinearLogpInputs replay_inputs(int64_t n) const {
    detlogp::LinearLogpInputs in;
    in.hidden = dev(TensorView::matrix(hidden.get(), DType::bf16, n, kDim), device);
    in.weight = dev(TensorView::matrix(weight.get(), DType::bf16, count, kDim), device);
    in.bias = dev(TensorView::vector(bias.get(), DType::f32, count), device);
    in.targets = dev(TensorView::vector(targets.get(), DType::i64, n), device);
    in.real_vocab = kReal;
    in.vocab_start = start;
    return in;
  }
  detlogp::SampledLogpOutputs replay_outputs(int64_t n) {
    detlogp::SampledLogpOutputs o;
    o.logp = dev_out(logp.get(), DType::f32, n, device);
    o.logp_raw = dev_out(logp_raw.get(), DType::f32, n, device);
    o.lse = dev_out(lse.get(), DType::f32, n, device);
    o.lse_support = dev_out(lse_support.get(), DType::f32, n, device);
    o.support_size = dev_out(support_size.get(), DType::i64, n, device);
    o.support_max = dev_out(support_max.get(), DType::f32, n, device);
    o.cut_logit = dev_out(cut_logit.get(), DType::f32, n, device);
    o.cut_id = dev_out(cut_id.get(), DType::i64, n, device);
    return o;
  }
  Result read() const {
    GPU_CUDA(cudaSetDevice(device));
    return {token.to_host(),     support_size.to_host(), cut_id.to_host(),      logp.to_host(),
            logp_raw.to_host(),  lse.to_host(),          lse_support.to_host(), support_max.to_host(),
            cut_logit.to_host(), logits.to_host(),       topk_ids.to_host(),    topk_logp.to_host()};
  }
};

// An engine's split: V / R rows each, the first V % R ranks one more (no 64 rounding).
std::vector<int64_t> engine_bounds(int ranks) {
  std::vector<int64_t> b{0};
  for (int r = 0; r < ranks; ++r) b.push_back(b.back() + kVocab / ranks + (r < kVocab % ranks ? 1 : 0));
  return b;
}

std::string name_of(const std::vector<int64_t>& bounds) {
  std::string s = "shards";
  for (int64_t b : bounds) s += " " + std::to_string(b);
  return s;
}

enum class Entry { sample, replay };

// Every rank in its own thread over `comms`; errors recorded per rank.
void run_ranks(std::vector<std::unique_ptr<Rank>>& ranks, std::vector<std::unique_ptr<detlogp::Communicator>>& comms,
               int64_t rows, Entry entry) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      Rank& k = *ranks[r];
      detlogp::CallOptions opt;
      opt.strict = true;
      opt.cuda_stream = k.stream;
      try {
        GPU_CUDA(cudaSetDevice(k.device));
        if (entry == Entry::sample)
          detlogp::sample_tensor_parallel(k.sample_inputs(rows), k.sample_outputs(rows), *comms[r], opt);
        else
          detlogp::linear_logp_tensor_parallel(k.replay_inputs(rows), k.program(rows), k.replay_outputs(rows),
                                               *comms[r], opt);
        GPU_CUDA(cudaStreamSynchronize(k.stream));
      } catch (const std::exception& e) {  // detlogp::Error, or a CUDA error of the test itself
        k.error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
}

// Columns [start, start + count) of the TP = 1 logits [rows][kVocab].
std::vector<float> logits_shard(const std::vector<float>& logits, int64_t rows, int64_t start, int64_t count) {
  std::vector<float> shard;
  for (int64_t n = 0; n < rows; ++n)
    shard.insert(shard.end(), logits.begin() + n * kVocab + start, logits.begin() + n * kVocab + start + count);
  return shard;
}

bool same_ints(const std::vector<int64_t>& a, const std::vector<int64_t>& b, const char* what, const std::string& who) {
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      ADD_FAILURE() << who << ": " << what << "[" << i << "]=" << b[i] << ", TP=1 gives " << a[i];
      return false;
    }
  return true;
}
void expect_bits(const std::vector<float>& want, const std::vector<float>& got, const char* what,
                 const std::string& who) {
  const auto c = bc::compare(want, got);
  EXPECT_TRUE(c.identical()) << who << ": " << c.describe(what);
}

class Sm90TpSample : public Sm90Test {
 protected:
  Host x;
  Result ref_sample, ref_replay;

  void SetUp() override {
    Sm90Test::SetUp();
    if (IsSkipped()) return;
    if (options().small) kDim = 256;
    x.rows = options().small ? 37 : 300;
    const int64_t n = x.rows;
    DeviceModel model;
    model.make(kDim, kVocab, 0x5A3D, true);
    x.w = model.weight.to_host();
    x.b = model.bias.to_host();
    DevBuf<uint16_t> hdev(static_cast<size_t>(n * kDim));
    fill_bf16_uniform(hdev.get(), n * kDim, 0x7AB1, 1.0f);
    x.h = hdev.to_host();
    // Per-row programs: greedy rows, top-k (1 and a cut inside the straddling tiles' range), top-p,
    // min-p, every filter at once and none.
    for (int64_t i = 0; i < n; ++i) {
      x.temperature.push_back(i % 7 == 3 ? 0.0f : 0.5f + 0.25f * static_cast<float>(i % 5));
      x.top_k.push_back(i % 4 == 0 ? 0 : (i % 11 == 1 ? 1 : 1 + (i * 13) % 300));
      x.top_p.push_back(i % 3 == 0 ? 1.0f : 0.6f + 0.1f * static_cast<float>(i % 4));
      x.min_p.push_back(i % 5 == 0 ? 0.0f : 0.01f * static_cast<float>(i % 4));
      x.key.push_back(1000 + 3 * i);
    }
    x.targets.assign(static_cast<size_t>(n), 0);

    // TP = 1: the single-GPU sample over the whole vocabulary, then its replay with the drawn tokens
    // as targets (some ignored, some outside the support).
    Rank one;
    one.make(x, 0, 0, kVocab);
    detlogp::CallOptions opt;
    opt.strict = true;
    detlogp::sample(one.sample_inputs(n), one.sample_outputs(n), opt);
    GPU_CUDA(cudaDeviceSynchronize());
    ref_sample = one.read();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = ref_sample.token[static_cast<size_t>(i)];
      x.targets[static_cast<size_t>(i)] = i % 9 == 2 ? -100 : (i % 6 == 5 || t < 0 ? (i * 7919) % kReal : t);
    }
    Rank again;
    again.make(x, 0, 0, kVocab);
    detlogp::linear_logp(again.replay_inputs(n), again.program(n), again.replay_outputs(n), opt);
    GPU_CUDA(cudaDeviceSynchronize());
    ref_replay = again.read();

    // The top-k beside the draw at TP = 1: linear_logp's top-k output at each row's T (1 for T = 0).
    std::vector<float> t1(x.temperature);
    for (float& t : t1) t = t == 0.0f ? 1.0f : t;
    const DevBuf<float> d_t1 = Rank::upload(t1);
    Rank plain;
    plain.make(x, 0, 0, kVocab);
    detlogp::LinearLogpInputs in = plain.replay_inputs(n);
    DevBuf<int64_t> valid = Rank::upload(std::vector<int64_t>(static_cast<size_t>(n), 0));
    in.targets = dev(TensorView::vector(valid.get(), DType::i64, n), 0);
    in.temperature_rows = dev(TensorView::vector(d_t1.get(), DType::f32, n), 0);
    detlogp::LinearLogpOutputs out;
    out.logp = dev_out(plain.logp.get(), DType::f32, n, 0);
    out.lse = dev_out(plain.lse.get(), DType::f32, n, 0);
    out.topk_ids = {dev(TensorView::matrix(plain.topk_ids.get(), DType::i64, n, kTopk), 0)};
    out.topk_logp = {dev(TensorView::matrix(plain.topk_logp.get(), DType::f32, n, kTopk), 0)};
    detlogp::linear_logp(in, out, opt);
    GPU_CUDA(cudaDeviceSynchronize());
    const Result topk = plain.read();
    ref_sample.topk_ids = topk.topk_ids;
    ref_sample.topk_logp = topk.topk_logp;
  }

  std::vector<std::unique_ptr<Rank>> make_ranks(const std::vector<int64_t>& bounds, const std::vector<int>& devices) {
    std::vector<std::unique_ptr<Rank>> ranks;
    for (size_t r = 0; r + 1 < bounds.size(); ++r) {
      ranks.push_back(std::make_unique<Rank>());
      ranks.back()->make(x, devices[r], bounds[r], bounds[r + 1] - bounds[r]);
      ranks.back()->with_topk = true;
    }
    return ranks;
  }

  // Every rank succeeded with the TP = 1 bits of `entry`.
  void check(std::vector<std::unique_ptr<Rank>>& ranks, Entry entry, const std::string& what) {
    const Result& want = entry == Entry::sample ? ref_sample : ref_replay;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const std::string who = what + " rank " + std::to_string(r);
      EXPECT_TRUE(ranks[r]->error.empty()) << who << " threw: " << ranks[r]->error;
      if (!ranks[r]->error.empty()) continue;
      const Result got = ranks[r]->read();
      expect_bits(want.logp, got.logp, "logp", who);
      expect_bits(want.logp_raw, got.logp_raw, "logp_raw", who);
      expect_bits(want.lse, got.lse, "lse", who);
      same_ints(want.support_size, got.support_size, "support_size", who);
      if (entry == Entry::sample) {
        same_ints(want.token, got.token, "token", who);
        expect_bits(logits_shard(want.logits, x.rows, ranks[r]->start, ranks[r]->count), got.logits, "logits shard",
                    who);
        same_ints(want.topk_ids, got.topk_ids, "topk_ids", who);
        expect_bits(want.topk_logp, got.topk_logp, "topk_logp", who);
      } else {
        expect_bits(want.lse_support, got.lse_support, "lse_support", who);
        expect_bits(want.support_max, got.support_max, "support_max", who);
        expect_bits(want.cut_logit, got.cut_logit, "cut_logit", who);
        same_ints(want.cut_id, got.cut_id, "cut_id", who);
      }
    }
  }
};

// The shards of the one-GPU simulation: engine splits at TP = 2, 3, 4 (V / TP off the tile grid),
// shards narrower than a tile, and a last shard of padding only.
std::vector<std::vector<int64_t>> simulated_bounds() {
  return {engine_bounds(2), engine_bounds(3), engine_bounds(4), {0, 40, 4000, 4030, kVocab}, {0, 4100, kReal, kVocab}};
}

}  // namespace

TEST_F(Sm90TpSample, SimulatedRanksOnOneGpuGiveTheTp1Bits) {
  for (const auto& bounds : simulated_bounds()) {
    const int tp = static_cast<int>(bounds.size()) - 1;
    for (Entry entry : {Entry::sample, Entry::replay}) {
      auto comms = detlogp::make_local_communicators(tp, Memory::cuda, 0);
      auto ranks = make_ranks(bounds, std::vector<int>(static_cast<size_t>(tp), 0));
      run_ranks(ranks, comms, x.rows, entry);
      check(ranks, entry, std::string(entry == Entry::sample ? "sample " : "replay ") + name_of(bounds));
    }
  }
}

TEST_F(Sm90TpSample, RowChunksAreBitNeutral) {
  // A workspace of 1 MiB forces several row chunks at this shape (bit-neutral by construction).
  ScopedEnv env("DETLOGP_TP_WORKSPACE_MB", "1");
  const auto bounds = engine_bounds(3);
  for (Entry entry : {Entry::sample, Entry::replay}) {
    auto comms = detlogp::make_local_communicators(3, Memory::cuda, 0);
    auto ranks = make_ranks(bounds, {0, 0, 0});
    run_ranks(ranks, comms, x.rows, entry);
    check(ranks, entry, std::string(entry == Entry::sample ? "chunked sample " : "chunked replay ") + name_of(bounds));
  }
}

TEST_F(Sm90TpSample, BadCallsAreRefusedByEveryRankAlike) {
  const auto bounds = engine_bounds(3);
  const auto refused_alike = [&](std::vector<std::unique_ptr<Rank>>& ranks, const std::string& expect,
                                 const std::string& what) {
    for (size_t r = 0; r < ranks.size(); ++r) {
      EXPECT_NE(ranks[r]->error.find(expect), std::string::npos)
          << what << " rank " << r << " error: '" << ranks[r]->error << "'";
      EXPECT_EQ(ranks[r]->error, ranks[0]->error) << what << ": rank " << r << " disagrees with rank 0";
      GPU_CUDA(cudaSetDevice(ranks[r]->device));
      EXPECT_EQ(count_poison(ranks[r]->logp.get(), x.rows), x.rows) << what << ": rank " << r << " wrote logp";
    }
  };
  {  // A bad temperature held on the device of rank 1 only.
    auto comms = detlogp::make_local_communicators(3, Memory::cuda, 0);
    auto ranks = make_ranks(bounds, {0, 0, 0});
    const float bad = -2.0f;
    GPU_CUDA(cudaMemcpy(ranks[1]->temperature.get() + 5, &bad, 4, cudaMemcpyHostToDevice));
    run_ranks(ranks, comms, x.rows, Entry::sample);
    refused_alike(ranks, "temperature_rows[5]=-2", "bad temperature");
    EXPECT_NE(ranks[0]->error.find("rank 1: "), std::string::npos) << "the refusal names rank 1: " << ranks[0]->error;
  }
  {  // A replay target past the real vocabulary, on every rank.
    Host y = x;
    y.targets[7] = kReal + 3;
    auto comms = detlogp::make_local_communicators(3, Memory::cuda, 0);
    std::vector<std::unique_ptr<Rank>> ranks;
    for (int r = 0; r < 3; ++r) {
      ranks.push_back(std::make_unique<Rank>());
      ranks.back()->make(y, 0, bounds[r], bounds[r + 1] - bounds[r]);
    }
    run_ranks(ranks, comms, x.rows, Entry::replay);
    refused_alike(ranks, "targets[7]=" + std::to_string(kReal + 3), "bad target");
  }
  {  // Shards that leave a gap: rank 2 starts one id late.
    auto comms = detlogp::make_local_communicators(3, Memory::cuda, 0);
    auto ranks = make_ranks(bounds, {0, 0, 0});
    ranks[2]->start += 1;
    ranks[2]->count -= 1;
    run_ranks(ranks, comms, x.rows, Entry::sample);
    refused_alike(ranks, "vocab_start=" + std::to_string(bounds[2] + 1), "inconsistent shards");
  }
}

// Real NCCL, one GPU per rank, TP in {2, 4, 8} up to the GPU count, an engine split off the tile grid.
TEST_F(Sm90TpSample, NcclRanksGiveTheTp1Bits) {
#ifdef DETLOGP_WITH_NCCL
  if (!options().nccl) GTEST_SKIP() << "NCCL part skipped: --no-nccl";
  int gpus = 0;
  GPU_CUDA(cudaGetDeviceCount(&gpus));
  if (gpus < 2) GTEST_SKIP() << "NCCL part skipped: fewer than 2 GPUs visible";
  for (int tp = 2; tp <= gpus && tp <= 8; tp *= 2) {
    std::vector<ncclComm_t> comms_raw(static_cast<size_t>(tp));
    std::vector<int> devs(static_cast<size_t>(tp));
    std::iota(devs.begin(), devs.end(), 0);
    const ncclResult_t init = ncclCommInitAll(comms_raw.data(), tp, devs.data());
    ASSERT_EQ(init, ncclSuccess) << "ncclCommInitAll(" << tp << ") failed: " << ncclGetErrorString(init);
    std::vector<std::unique_ptr<detlogp::Communicator>> comms;
    for (int r = 0; r < tp; ++r) comms.push_back(detlogp::make_nccl_communicator(comms_raw[r]));
    const auto bounds = engine_bounds(tp);
    for (Entry entry : {Entry::sample, Entry::replay}) {
      auto ranks = make_ranks(bounds, devs);
      run_ranks(ranks, comms, x.rows, entry);
      check(ranks, entry, "NCCL " + std::string(entry == Entry::sample ? "sample " : "replay ") + name_of(bounds));
      std::printf("NCCL TP=%d %s %s: checked against TP=1\n", tp, entry == Entry::sample ? "sample" : "replay",
                  name_of(bounds).c_str());
    }
    {  // A bad temperature on the last rank's device: every rank refuses alike, nobody hangs.
      auto ranks = make_ranks(bounds, devs);
      const float bad = -2.0f;
      GPU_CUDA(cudaSetDevice(ranks[tp - 1]->device));
      GPU_CUDA(cudaMemcpy(ranks[tp - 1]->temperature.get() + 5, &bad, 4, cudaMemcpyHostToDevice));
      run_ranks(ranks, comms, x.rows, Entry::sample);
      for (int r = 0; r < tp; ++r) {
        EXPECT_NE(ranks[r]->error.find("temperature_rows[5]=-2"), std::string::npos)
            << "NCCL TP=" << tp << " rank " << r << " error: '" << ranks[r]->error << "'";
        EXPECT_EQ(ranks[r]->error, ranks[0]->error) << "rank " << r << " disagrees with rank 0";
      }
    }
    // The NCCL entry point (ncclComm_t) runs the same protocol.
    {
      auto ranks = make_ranks(bounds, devs);
      std::vector<std::thread> threads;
      for (int r = 0; r < tp; ++r)
        threads.emplace_back([&, r] {
          Rank& k = *ranks[r];
          detlogp::CallOptions opt;
          opt.strict = true;
          opt.cuda_stream = k.stream;
          try {
            GPU_CUDA(cudaSetDevice(k.device));
            detlogp::sample_tensor_parallel(k.sample_inputs(x.rows), k.sample_outputs(x.rows), comms_raw[r], opt);
          } catch (const std::exception& e) {
            k.error = e.what();
          }
        });
      for (auto& t : threads) t.join();
      check(ranks, Entry::sample, "NCCL entry sample");
    }
    for (auto c : comms_raw) ncclCommDestroy(c);
  }
#else
  GTEST_SKIP() << "NCCL part skipped: this build has no NCCL (DETLOGP_WITH_NCCL undefined)";
#endif
}

// The sampling program on the SM90 backend (docs/contract.md §11): on CUDA tensors, `sample` and
// its replay give the bits of the CPU row program applied to the SM90 serving logits
// (cpu_sample_from_logits), with per-row parameters that exercise top-k, top-p (the radix selection
// by mass over the whole vocabulary), min-p and greedy rows; the replay gives the rollout's bits and
// counts the targets outside the support; the N chunking is bit-neutral; bad parameters held on the
// device are refused before anything is written. The replay's logit gradient (the grad-logits
// kernel's sampled epilogue) gives the bits of the pinned formula (sampled_grad_logit) applied on
// the host to the SM90 serving logits, chunk by chunk, and refuses a bad device parameter likewise.
#include <algorithm>
#include <numeric>

#include "core/grad_logits.hpp"
#include "core/sample.hpp"
#include "cpu/cpu_sample.hpp"
#include "gpu_test_util.hpp"

using namespace gput;
using detlogp::DType;
using detlogp::Memory;
using detlogp::TensorView;

namespace {

class Sm90Sample : public Sm90Test {};

TensorView dev_vector(const void* p, DType t, int64_t n) { return TensorView::vector(p, t, n, Memory::cuda); }
detlogp::MutableTensorView dev_out(void* p, DType t, int64_t n) {
  return detlogp::mutable_vector(p, t, n, Memory::cuda);
}

// The per-row program on the host and on the device.
struct Program {
  std::vector<float> temperature, top_p, min_p;
  std::vector<int64_t> top_k;
  DevBuf<float> d_temperature, d_top_p, d_min_p;
  DevBuf<int64_t> d_top_k;

  void make(int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      temperature.push_back(i % 7 == 3 ? 0.0f : 0.5f + 0.25f * static_cast<float>(i % 5));
      top_k.push_back(i % 4 == 0 ? 0 : 1 + (i * 13) % 60);
      top_p.push_back(i % 3 == 0 ? 1.0f : 0.6f + 0.1f * static_cast<float>(i % 4));
      min_p.push_back(i % 5 == 0 ? 0.0f : 0.01f * static_cast<float>(i % 4));
    }
    upload(n);
  }
  // The host vectors, already filled, onto the device.
  void upload(int64_t n) {
    d_temperature = DevBuf<float>(n);
    d_top_p = DevBuf<float>(n);
    d_min_p = DevBuf<float>(n);
    d_top_k = DevBuf<int64_t>(n);
    d_temperature.from_host(temperature);
    d_top_p.from_host(top_p);
    d_min_p.from_host(min_p);
    d_top_k.from_host(top_k);
  }
  detlogp::SamplingProgram host_view(int64_t n) const {
    detlogp::SamplingProgram s;
    s.temperature_rows = TensorView::vector(temperature.data(), DType::f32, n);
    s.top_k_rows = TensorView::vector(top_k.data(), DType::i64, n);
    s.top_p_rows = TensorView::vector(top_p.data(), DType::f32, n);
    s.min_p_rows = TensorView::vector(min_p.data(), DType::f32, n);
    return s;
  }
  detlogp::SamplingProgram device_view(int64_t n) const {
    detlogp::SamplingProgram s;
    s.temperature_rows = dev_vector(d_temperature.get(), DType::f32, n);
    s.top_k_rows = dev_vector(d_top_k.get(), DType::i64, n);
    s.top_p_rows = dev_vector(d_top_p.get(), DType::f32, n);
    s.min_p_rows = dev_vector(d_min_p.get(), DType::f32, n);
    return s;
  }
};

struct Drawn {
  std::vector<int64_t> token, support_size;
  std::vector<float> logp, logp_raw, lse, logits;
};

// The [n] outputs of `sample` over buffers in memory `mem` (support_size may be null).
detlogp::SampleOutputs outputs_of(int64_t* token, float* logp, float* logp_raw, float* lse, int64_t* support_size,
                                  int64_t n, Memory mem) {
  detlogp::SampleOutputs out;
  out.token = detlogp::mutable_vector(token, DType::i64, n, mem);
  out.logp = detlogp::mutable_vector(logp, DType::f32, n, mem);
  out.logp_raw = detlogp::mutable_vector(logp_raw, DType::f32, n, mem);
  out.lse = detlogp::mutable_vector(lse, DType::f32, n, mem);
  if (support_size) out.support_size = detlogp::mutable_vector(support_size, DType::i64, n, mem);
  return out;
}

// sample on the device, read back.
Drawn device_sample(const DeviceModel& m, const DevBuf<uint16_t>& hidden, int64_t n, const Program& prog,
                    const DevBuf<int64_t>& key) {
  DevBuf<int64_t> token(n), size(n);
  DevBuf<float> logp(n), raw(n), lse(n), logits(static_cast<size_t>(n * m.vocab));
  logp.poison();
  detlogp::SampleInputs in;
  in.hidden = TensorView::matrix(hidden.get(), DType::bf16, n, m.dim, Memory::cuda);
  in.weight = TensorView::matrix(m.weight.get(), DType::bf16, m.vocab, m.dim, Memory::cuda);
  if (m.bias.size()) in.bias = dev_vector(m.bias.get(), DType::f32, m.vocab);
  in.program = prog.device_view(n);
  in.seed = 0xC0FFEE;
  in.key = dev_vector(key.get(), DType::i64, n);
  detlogp::SampleOutputs out = outputs_of(token.get(), logp.get(), raw.get(), lse.get(), size.get(), n, Memory::cuda);
  out.logits = {TensorView::matrix(logits.get(), DType::f32, n, m.vocab, Memory::cuda)};
  const detlogp::CallReport r = detlogp::sample(in, out);
  EXPECT_EQ(r.provenance.sample_id, detlogp::kSampleId);
  GPU_CUDA(cudaDeviceSynchronize());
  return {token.to_host(), size.to_host(), logp.to_host(), raw.to_host(), lse.to_host(), logits.to_host()};
}

// The CPU row program on the SM90 serving logits, with the same program and keys.
Drawn cpu_on_logits(const DeviceModel& m, int64_t n, const Program& prog, const std::vector<int64_t>& key,
                    const std::vector<float>& logits) {
  std::vector<uint16_t> hidden(static_cast<size_t>(n * m.dim), 0), weight(static_cast<size_t>(m.vocab * m.dim), 0);
  detlogp::SampleInputs in;
  in.hidden = TensorView::matrix(hidden.data(), DType::bf16, n, m.dim);
  in.weight = TensorView::matrix(weight.data(), DType::bf16, m.vocab, m.dim);
  in.program = prog.host_view(n);
  in.seed = 0xC0FFEE;
  in.key = TensorView::vector(key.data(), DType::i64, n);
  Drawn d;
  d.token.resize(n);
  d.support_size.resize(n);
  d.logp.resize(n);
  d.logp_raw.resize(n);
  d.lse.resize(n);
  const detlogp::SampleOutputs out = outputs_of(d.token.data(), d.logp.data(), d.logp_raw.data(), d.lse.data(),
                                                d.support_size.data(), n, Memory::host);
  detlogp::detail::cpu_sample_from_logits(detlogp::detail::make_sample_problem(in, out), logits.data());
  return d;
}

void expect_same(const Drawn& gpu, const Drawn& cpu, const char* what) {
  EXPECT_EQ(gpu.token, cpu.token) << what;
  EXPECT_EQ(gpu.support_size, cpu.support_size) << what;
  EXPECT_TRUE(detlogp::bitcmp::compare(cpu.logp, gpu.logp))
      << what << ": " << detlogp::bitcmp::compare(cpu.logp, gpu.logp).describe("logp");
  EXPECT_TRUE(detlogp::bitcmp::compare(cpu.logp_raw, gpu.logp_raw)) << what;
  EXPECT_TRUE(detlogp::bitcmp::compare(cpu.lse, gpu.lse)) << what;
}

}  // namespace

TEST_F(Sm90Sample, TheDeviceProgramIsTheCpuProgramOnTheServingLogits) {
  struct S {
    int64_t n, d, v;
    bool bias;
  };
  // 160 rows at the Qwen3 vocabulary take one CTA a whole row (past the few-rows split), whose
  // listing pass finds its floor from the first round's loads.
  std::vector<S> shapes{{37, 128, 4099, true}, {8, 64, 151936, false}, {3, 64, 65, true}};
  if (!options().small) shapes.push_back({160, 64, 151936, true});
  for (const S& s : shapes) {
    DeviceModel m;
    m.make(s.d, s.v, 21, s.bias);
    DevBuf<uint16_t> hidden(static_cast<size_t>(s.n * s.d));
    fill_bf16_uniform(hidden.get(), s.n * s.d, 22, 1.0f);
    Program prog;
    prog.make(s.n);
    std::vector<int64_t> key(static_cast<size_t>(s.n));
    std::iota(key.begin(), key.end(), 500);
    DevBuf<int64_t> d_key(key.size());
    d_key.from_host(key);
    const Drawn gpu = device_sample(m, hidden, s.n, prog, d_key);
    expect_same(gpu, cpu_on_logits(m, s.n, prog, key, gpu.logits), "sample");
    {
      ScopedEnv env("DETLOGP_SM90_WORKSPACE_MB", "1");  // many row chunks
      expect_same(device_sample(m, hidden, s.n, prog, d_key), gpu, "chunked");
    }

    // The replay: the rollout's tokens give its bits; every 4th target moved by V/2 (outside a small
    // support) is counted.
    std::vector<int64_t> targets = gpu.token;
    for (int64_t i = 1; i < s.n; i += 4) targets[i] = (targets[i] + s.v / 2) % s.v;
    DevBuf<int64_t> d_targets(targets.size());
    d_targets.from_host(targets);
    DevBuf<float> logp(s.n), raw(s.n), lse(s.n);
    detlogp::LinearLogpInputs in;
    in.hidden = TensorView::matrix(hidden.get(), DType::bf16, s.n, s.d, Memory::cuda);
    in.weight = TensorView::matrix(m.weight.get(), DType::bf16, s.v, s.d, Memory::cuda);
    if (m.bias.size()) in.bias = dev_vector(m.bias.get(), DType::f32, s.v);
    in.targets = dev_vector(d_targets.get(), DType::i64, s.n);
    detlogp::SampledLogpOutputs out;
    out.logp = dev_out(logp.get(), DType::f32, s.n);
    out.logp_raw = dev_out(raw.get(), DType::f32, s.n);
    out.lse = dev_out(lse.get(), DType::f32, s.n);
    const detlogp::CallReport r = detlogp::linear_logp(in, prog.device_view(s.n), out);
    const std::vector<float> replayed = logp.to_host();
    int64_t outside = 0;
    for (int64_t i = 0; i < s.n; ++i) {
      if (replayed[i] == -INFINITY) {
        ++outside;
        continue;
      }
      if (targets[i] == gpu.token[i]) {
        EXPECT_TRUE(same_bits(replayed[i], gpu.logp[i])) << "row " << i;
      }
    }
    EXPECT_EQ(r.sampling.outside_support, outside);
    if (s.v > 1000) {
      EXPECT_GT(outside, 0);
    }
  }
}

TEST_F(Sm90Sample, ABadParameterOnTheDeviceIsRefusedBeforeAnythingIsWritten) {
  DeviceModel m;
  m.make(64, 300, 31, false);
  const int64_t n = 6;
  DevBuf<uint16_t> hidden(static_cast<size_t>(n * 64));
  fill_bf16_uniform(hidden.get(), n * 64, 32, 1.0f);
  Program prog;
  prog.make(n);
  prog.top_p[4] = 0.0f;
  prog.d_top_p.from_host(prog.top_p);
  DevBuf<int64_t> key(n), token(n);
  key.from_host(std::vector<int64_t>(n, 1));
  DevBuf<float> logp(n), raw(n), lse(n);
  logp.poison();
  detlogp::SampleInputs in;
  in.hidden = TensorView::matrix(hidden.get(), DType::bf16, n, 64, Memory::cuda);
  in.weight = TensorView::matrix(m.weight.get(), DType::bf16, 300, 64, Memory::cuda);
  in.program = prog.device_view(n);
  in.key = dev_vector(key.get(), DType::i64, n);
  const detlogp::SampleOutputs out =
      outputs_of(token.get(), logp.get(), raw.get(), lse.get(), nullptr, n, Memory::cuda);
  try {
    detlogp::sample(in, out);
    ADD_FAILURE() << "not refused";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_p_rows[4]=0 is outside (0, 1]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(count_poison(logp.get(), n), n);
}

namespace {

// The replay on the device with every output the backward reads, and its logit gradient per chunk.
struct ReplayGrad {
  int64_t n, d, v, real_vocab;
  DeviceModel m;
  DevBuf<uint16_t> hidden;
  Program prog;
  std::vector<int64_t> targets;
  DevBuf<int64_t> d_targets;
  std::vector<float> g, gs, gr;
  DevBuf<float> d_g, d_gs, d_gr;
  DevBuf<float> logp, raw, lse, lse_support, support_max, cut_logit, logits;
  DevBuf<int64_t> cut_id, support_size;
  int64_t outside = 0;  // the replay's count of targets outside the support

  ReplayGrad(int64_t rows, int64_t dim, int64_t vocab, int64_t real, uint64_t seed)
      : n(rows), d(dim), v(vocab), real_vocab(real) {
    m.make(d, v, seed, true);
    hidden = DevBuf<uint16_t>(static_cast<size_t>(n * d));
    fill_bf16_uniform(hidden.get(), n * d, seed + 1, 1.0f);
    prog.make(n);
    // The serving logits z (the bits the kernel recomputes), from the plain entry with ignored targets.
    logits = DevBuf<float>(static_cast<size_t>(n * v));
    {
      DevBuf<int64_t> ignored(n);
      ignored.from_host(std::vector<int64_t>(static_cast<size_t>(n), detlogp::kDefaultIgnoreIndex));
      DevBuf<float> lp(n), ls(n);
      detlogp::LinearLogpInputs in = head_inputs(ignored.get());
      detlogp::LinearLogpOutputs out;
      out.logp = dev_out(lp.get(), DType::f32, n);
      out.lse = dev_out(ls.get(), DType::f32, n);
      out.logits = {TensorView::matrix(logits.get(), DType::f32, n, v, Memory::cuda)};
      detlogp::linear_logp(in, out);
    }
    // Targets: the argmax of each row's z (in every support: rank 0) with every third moved by V/2
    // (outside a small support), one ignored row, one at the last real id.
    const std::vector<float> z = logits.to_host();
    targets.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float* row = z.data() + i * v;
      targets[i] = std::max_element(row, row + real_vocab) - row;
      if (i % 3 == 1) targets[i] = (targets[i] + real_vocab / 2) % real_vocab;
    }
    targets[2] = detlogp::kDefaultIgnoreIndex;
    targets[n - 1] = real_vocab - 1;
    d_targets = DevBuf<int64_t>(targets.size());
    d_targets.from_host(targets);
    for (int64_t i = 0; i < n; ++i) {
      g.push_back(0.25f * static_cast<float>(i % 9) - 1.0f);
      gs.push_back(0.125f * static_cast<float>(i % 5) - 0.25f);
      gr.push_back(0.5f - 0.0625f * static_cast<float>(i % 11));
    }
    d_g = DevBuf<float>(g.size());
    d_g.from_host(g);
    d_gs = DevBuf<float>(gs.size());
    d_gs.from_host(gs);
    d_gr = DevBuf<float>(gr.size());
    d_gr.from_host(gr);
    for (auto* b : {&logp, &raw, &lse, &lse_support, &support_max, &cut_logit}) *b = DevBuf<float>(n);
    cut_id = DevBuf<int64_t>(n);
    support_size = DevBuf<int64_t>(n);
    detlogp::SampledLogpOutputs out;
    out.logp = dev_out(logp.get(), DType::f32, n);
    out.logp_raw = dev_out(raw.get(), DType::f32, n);
    out.lse = dev_out(lse.get(), DType::f32, n);
    out.lse_support = dev_out(lse_support.get(), DType::f32, n);
    out.support_max = dev_out(support_max.get(), DType::f32, n);
    out.cut_logit = dev_out(cut_logit.get(), DType::f32, n);
    out.cut_id = dev_out(cut_id.get(), DType::i64, n);
    out.support_size = dev_out(support_size.get(), DType::i64, n);
    outside = detlogp::linear_logp(head_inputs(d_targets.get()), prog.device_view(n), out).sampling.outside_support;
  }
  detlogp::LinearLogpInputs head_inputs(const int64_t* t) const {
    detlogp::LinearLogpInputs in;
    in.hidden = TensorView::matrix(hidden.get(), DType::bf16, n, d, Memory::cuda);
    in.weight = TensorView::matrix(m.weight.get(), DType::bf16, v, d, Memory::cuda);
    in.bias = dev_vector(m.bias.get(), DType::f32, v);
    in.targets = dev_vector(t, DType::i64, n);
    in.real_vocab = real_vocab;
    return in;
  }
  // The gradient's arguments over buffers in memory `mem` (the host copies' pointers for Memory::host).
  detlogp::SampledGradArgs args(Memory mem, const std::vector<const void*>& ptrs, bool with_lse, bool with_raw) const {
    const auto f32 = [&](size_t i) { return TensorView::vector(ptrs[i], DType::f32, n, mem); };
    detlogp::SampledGradArgs a;
    a.logp = f32(0);
    a.lse = f32(1);
    a.lse_support = f32(2);
    a.support_max = f32(3);
    a.cut_logit = f32(4);
    a.cut_id = TensorView::vector(ptrs[5], DType::i64, n, mem);
    a.g_logp = f32(6);
    if (with_lse) a.g_lse = f32(7);
    if (with_raw) a.g_logp_raw = f32(8);
    return a;
  }
  std::vector<const void*> device_ptrs() const {
    return {logp.get(),   lse.get(), lse_support.get(), support_max.get(), cut_logit.get(),
            cut_id.get(), d_g.get(), d_gs.get(),        d_gr.get()};
  }
  // dz of the chunk [c0, c0 + c) on the device, row stride c + 3 (the 3 columns past C stay poisoned).
  std::vector<uint16_t> device_dz(int64_t c0, int64_t c, bool with_lse, bool with_raw) const {
    const int64_t stride = c + 3;
    DevBuf<uint16_t> dz(static_cast<size_t>(n * stride));
    dz.poison();
    detlogp::LinearLogpInputs in = head_inputs(d_targets.get());
    in.weight = TensorView::matrix(m.weight.get() + c0 * d, DType::bf16, c, d, Memory::cuda);
    in.bias = dev_vector(m.bias.get() + c0, DType::f32, c);
    in.vocab_start = c0;
    const detlogp::MutableTensorView out{TensorView::matrix(dz.get(), DType::bf16, n, c, Memory::cuda, stride)};
    detlogp::CallOptions o;
    o.strict = true;
    const detlogp::CallReport r = detlogp::linear_logp_grad_logits(
        in, prog.device_view(n), args(Memory::cuda, device_ptrs(), with_lse, with_raw), out, o);
    EXPECT_EQ(r.provenance.backend_id, detlogp::detail::sm90_contract_backend().id());
    return dz.to_host();
  }
  // The pinned formula on the host over the SM90 serving logits of the chunk, the same row stride.
  std::vector<uint16_t> host_dz(int64_t c0, int64_t c, bool with_lse, bool with_raw) const {
    const int64_t stride = c + 3;
    std::vector<uint16_t> dz(static_cast<size_t>(n * stride), 0xFFFFu);
    const std::vector<float> z = logits.to_host();
    const std::vector<float> h_logp = logp.to_host(), h_lse = lse.to_host(), h_ls = lse_support.to_host(),
                             h_max = support_max.to_host(), h_cut = cut_logit.to_host();
    const std::vector<int64_t> h_cut_id = cut_id.to_host();
    const std::vector<uint16_t> h(static_cast<size_t>(n * d), 0), w(static_cast<size_t>(c * d), 0);
    detlogp::LinearLogpInputs in;
    in.hidden = TensorView::matrix(h.data(), DType::bf16, n, d);
    in.weight = TensorView::matrix(w.data(), DType::bf16, c, d);
    in.targets = TensorView::vector(targets.data(), DType::i64, n);
    in.real_vocab = real_vocab;
    in.vocab_start = c0;
    const detlogp::MutableTensorView out{TensorView::matrix(dz.data(), DType::bf16, n, c, Memory::host, stride)};
    const std::vector<const void*> ptrs{h_logp.data(),   h_lse.data(), h_ls.data(), h_max.data(), h_cut.data(),
                                        h_cut_id.data(), g.data(),     gs.data(),   gr.data()};
    const detlogp::detail::GradLogitsProblem p = detlogp::detail::make_sampled_grad_logits_problem(
        in, prog.host_view(n), args(Memory::host, ptrs, with_lse, with_raw), out);
    detlogp::detail::grad_logits_from_logits(p, z.data() + c0, v);
    return dz;
  }
};

int64_t differing(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t stride, std::string* first) {
  int64_t count = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    if (count++ == 0)
      *first = "row " + std::to_string(i / stride) + " col " + std::to_string(i % stride) + ": expected " +
               std::to_string(a[i]) + ", got " + std::to_string(b[i]);
  }
  return count;
}

}  // namespace

TEST_F(Sm90Sample, TheReplayGradientIsTheHostFormulaOnTheServingLogits) {
  struct S {
    int64_t n, d, v, real;
  };
  const S shapes[] = {{77, 128, 4099, 4096}, {8, 64, 151936, 151936}};
  for (const S& s : shapes) {
    const ReplayGrad rg(s.n, s.d, s.v, s.real, 41);
    EXPECT_GT(rg.outside, 0) << "V=" << s.v << ": no target outside the support (the g_logp = 0 rows untested)";
    // Chunks: the whole head, one that starts off the 64-grid and one holding the padding tail.
    const std::pair<int64_t, int64_t> chunks[] = {{0, s.v}, {1000, 2053}, {s.v - 131, 131}};
    for (const auto& [c0, c] : chunks) {
      for (const bool with_lse : {true, false}) {
        const bool with_raw = with_lse;
        const std::vector<uint16_t> got = rg.device_dz(c0, c, with_lse, with_raw);
        const std::vector<uint16_t> want = rg.host_dz(c0, c, with_lse, with_raw);
        std::string first;
        EXPECT_EQ(differing(want, got, c + 3, &first), 0)
            << "V=" << s.v << " chunk [" << c0 << ", " << c0 + c << ") g_lse/g_logp_raw=" << with_lse << ": " << first;
        if (c0 == 0 && with_lse) {
          EXPECT_EQ(rg.device_dz(c0, c, true, true), got) << "run to run";
        }
      }
    }
  }
}

TEST_F(Sm90Sample, TheReplayGradientRefusesABadDeviceParameterBeforeWriting) {
  ReplayGrad rg(6, 64, 300, 300, 43);
  rg.prog.min_p[3] = 1.0f;
  rg.prog.d_min_p.from_host(rg.prog.min_p);
  DevBuf<uint16_t> dz(static_cast<size_t>(6 * 300));
  dz.poison();
  const detlogp::MutableTensorView out{TensorView::matrix(dz.get(), DType::bf16, 6, 300, Memory::cuda)};
  try {
    detlogp::linear_logp_grad_logits(rg.head_inputs(rg.d_targets.get()), rg.prog.device_view(6),
                                     rg.args(Memory::cuda, rg.device_ptrs(), true, true), out);
    ADD_FAILURE() << "not refused";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("min_p_rows[3]=1 is outside [0, 1)"), std::string::npos) << e.what();
  }
  const std::vector<uint16_t> after = dz.to_host();
  EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](uint16_t x) { return x == 0xFFFFu; })) << "dz was written";
}

// The SM90 kernel finds the cut from gathered candidates where it can and by radix selection
// otherwise (a large top-k, a flat row under top-p); DETLOGP_SM90_SAMPLE_RADIX=1 takes the radix
// path for every row. Both give the CPU program's bits, over top-k on both sides of the candidate
// path's limits, top-p with and without top-k, flat rows (every logit equal) and odd vocabularies.
TEST_F(Sm90Sample, TheCandidateCutAndTheRadixCutGiveTheSameBits) {
  struct S {
    int64_t n, d, v;
    bool bias;
  };
  const S shapes[] = {{48, 64, 151936, false}, {24, 128, 17, true}, {40, 64, 2053, true}, {16, 64, 123, false}};
  const int64_t top_ks[] = {0, 1, 2, 50, 255, 256, 257, 1000, 0, 64};
  const float top_ps[] = {1.0f, 0.9f, 0.999f, 0.3f, 0.95f};
  for (const S& s : shapes) {
    DeviceModel m;
    m.make(s.d, s.v, 31, s.bias);
    DevBuf<uint16_t> hidden(static_cast<size_t>(s.n * s.d));
    fill_bf16_uniform(hidden.get(), s.n * s.d, 32, 1.0f);
    for (int64_t i = 5; i < s.n; i += 6)  // flat rows: every logit the bias (or 0)
      GPU_CUDA(cudaMemset(hidden.get() + i * s.d, 0, static_cast<size_t>(s.d) * 2));
    Program prog;
    for (int64_t i = 0; i < s.n; ++i) {
      prog.temperature.push_back(i % 11 == 7 ? 0.0f : 0.6f + 0.35f * static_cast<float>(i % 3));
      prog.top_k.push_back(top_ks[i % 10]);
      prog.top_p.push_back(top_ps[(i / 2) % 5]);
      prog.min_p.push_back(i % 4 == 3 ? 0.02f : 0.0f);
    }
    prog.upload(s.n);
    std::vector<int64_t> key(static_cast<size_t>(s.n));
    std::iota(key.begin(), key.end(), 77);
    DevBuf<int64_t> d_key(key.size());
    d_key.from_host(key);
    const Drawn fast = device_sample(m, hidden, s.n, prog, d_key);
    const std::string what = "V=" + std::to_string(s.v);
    expect_same(fast, cpu_on_logits(m, s.n, prog, key, fast.logits), (what + " candidate path vs CPU").c_str());
    ScopedEnv env("DETLOGP_SM90_SAMPLE_RADIX", "1");
    expect_same(device_sample(m, hidden, s.n, prog, d_key), fast, (what + " radix path vs candidate path").c_str());
  }
}

// A few rows split their lanes over slices (each slice's CTA lists its largest keys, the row kernel
// merges them); a batch of 200 does not split. Rows alone and in groups of 8 give the batch's bits:
// top-k cuts of 1..128 (the merged path), larger ones and none (the pass over the row), greedy,
// flat and NaN rows (a NaN row's M comes from the pass).
TEST_F(Sm90Sample, FewRowsSplitOverSlicesGiveTheBatchBits) {
  const int64_t n = 200, d = 64, v = 151936;
  DeviceModel m;
  m.make(d, v, 41, true);
  std::vector<uint16_t> h(static_cast<size_t>(n * d));
  {
    DevBuf<uint16_t> filled(h.size());
    fill_bf16_uniform(filled.get(), n * d, 42, 1.0f);
    h = filled.to_host();
  }
  std::fill(h.begin() + 5 * d, h.begin() + 6 * d, uint16_t{0});  // flat: every logit the bias
  h[3 * d + 7] = 0x7FC0;                                         // a NaN row
  Program prog;
  for (int64_t i = 0; i < n; ++i) {
    prog.temperature.push_back(i % 9 == 4 ? 0.0f : 0.9f);
    const int64_t ks[] = {50, 1 + (i * 7) % 128, 0, 20, 500};
    prog.top_k.push_back(ks[i % 5]);
    prog.top_p.push_back(i % 2 == 0 ? 0.95f : 1.0f);
    prog.min_p.push_back(i % 4 == 1 ? 0.05f : 0.0f);
  }
  prog.upload(n);
  std::vector<int64_t> key(static_cast<size_t>(n));
  std::iota(key.begin(), key.end(), 900);
  DevBuf<uint16_t> hidden(h.size());
  hidden.from_host(h);
  DevBuf<int64_t> d_key(key.size());
  d_key.from_host(key);
  const Drawn all = device_sample(m, hidden, n, prog, d_key);
  expect_same(all, cpu_on_logits(m, n, prog, key, all.logits), "batch vs CPU");

  for (const int64_t group : {int64_t{1}, int64_t{8}}) {
    for (const int64_t first : {int64_t{0}, int64_t{3}, int64_t{4}, int64_t{41}, int64_t{192}}) {
      const int64_t rows = std::min(group, n - first);
      Program sub;
      const auto part = [&](const auto& full) {
        return std::vector(full.begin() + first, full.begin() + first + rows);
      };
      sub.temperature = part(prog.temperature);
      sub.top_k = part(prog.top_k);
      sub.top_p = part(prog.top_p);
      sub.min_p = part(prog.min_p);
      sub.upload(rows);
      DevBuf<uint16_t> sub_hidden(static_cast<size_t>(rows * d));
      sub_hidden.from_host(std::vector(h.begin() + first * d, h.begin() + (first + rows) * d));
      DevBuf<int64_t> sub_key(static_cast<size_t>(rows));
      sub_key.from_host(part(key));
      const Drawn few = device_sample(m, sub_hidden, rows, sub, sub_key);
      Drawn expected;
      expected.token = part(all.token);
      expected.support_size = part(all.support_size);
      expected.logp = part(all.logp);
      expected.logp_raw = part(all.logp_raw);
      expected.lse = part(all.lse);
      const std::string what = std::to_string(rows) + " rows from row " + std::to_string(first);
      expect_same(few, expected, what.c_str());
    }
  }
}

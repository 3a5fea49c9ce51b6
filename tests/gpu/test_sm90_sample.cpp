// The sampling program on the SM90 backend (docs/contract.md §11): on CUDA tensors, `sample` and
// its replay give the bits of the CPU row program applied to the SM90 serving logits
// (cpu_sample_from_logits), with per-row parameters that exercise top-k, top-p (the radix selection
// by mass over the whole vocabulary), min-p and greedy rows; the replay gives the rollout's bits and
// counts the targets outside the support; the N chunking is bit-neutral; bad parameters held on the
// device are refused before anything is written.
#include <algorithm>
#include <numeric>

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
  const S shapes[] = {{37, 128, 4099, true}, {8, 64, 151936, false}, {3, 64, 65, true}};
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

// linear_logp_grad_logits on SM90: dz bit-identical to the pinned formula (detlogp/grad.hpp)
// applied on the host to the SM90 backend's own serving logits z (the logits are arch-specific,
// docs/contract.md §1, so the bitwise reference is the formula on the device's z, exactly as
// reduce_logits is for logp/lse), on odd shapes: N in {1, 77, 300}, C in {17, 123, 2053, 4096},
// D in {64, 200, 4096}, with bias, per-row temperatures, ignored rows, padding columns,
// vocab_start > 0 (also not a multiple of 64), strided and 2-byte-offset dz, i32/i64 targets and
// absent upstream gradients. The same bits from linear_logp_grad_from_logits over the serving logits
// (also with dz written over its own logits in place). Also: close to the CPU implementation, deterministic across
// runs, columns past C never written, and a bad target or temperature refused with nothing written. With the entropy
// term (g_entropy and the rows' entropy H, the CPU reduce_logits of the same SM90 logits): bit-identical to the pinned
// formula on SM90 logits, and the logp-only bits without it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/grad_logits.hpp"
#include "gpu_test_util.hpp"
#include "test_random.hpp"

using namespace gput;
using namespace detlogp;

namespace {

constexpr const char* kId = "cuda-fused-linear-logp-sm90-contract-v1";
constexpr uint16_t kPoison = 0xFFFFu;  // cudaMemset 0xFF: a bf16 NaN the op never writes (it writes 0x7FC0)

struct Spec {
  int64_t n, c, d;
  int64_t vocab_start;
  int64_t real_vocab;  // global
  int64_t vocab;       // rows of the full weight (>= vocab_start + c)
  bool bias, temp_rows, g_logp, g_lse, i64, offset_dz;
  int64_t stride_pad;
};

std::string describe(const Spec& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "N=%lld C=%lld D=%lld start=%lld real=%lld V=%lld bias=%d temp_rows=%d g_logp=%d g_lse=%d i64=%d "
                "offset_dz=%d pad=%lld",
                static_cast<long long>(s.n), static_cast<long long>(s.c), static_cast<long long>(s.d),
                static_cast<long long>(s.vocab_start), static_cast<long long>(s.real_vocab),
                static_cast<long long>(s.vocab), s.bias, s.temp_rows, s.g_logp, s.g_lse, s.i64, s.offset_dz,
                static_cast<long long>(s.stride_pad));
  return buf;
}

// One problem on the device: the full head, the forward's serving logits and lse, upstream
// gradients, and a poisoned dz for the chunk [vocab_start, vocab_start + c).
struct GradCase {
  Spec s;
  DeviceModel m;
  DevBuf<uint16_t> hidden;
  std::vector<int64_t> targets;
  DevBuf<int32_t> t32;
  DevBuf<int64_t> t64;
  std::vector<float> temps, g_logp, g_lse;
  DevBuf<float> d_temps, d_g_logp, d_g_lse;
  bool entropy_term = false;              // with_entropy_term: entropy and g_entropy are passed
  std::vector<float> entropy, g_entropy;  // [n]
  DevBuf<float> d_entropy, d_g_entropy;
  Outputs fwd;  // logp, lse, logits [n][vocab]
  int64_t dz_stride = 0;
  DevBuf<uint16_t> dz;  // [n * dz_stride + 1]

  explicit GradCase(const Spec& spec, uint64_t seed) : s(spec) {
    m.make(s.d, s.vocab, seed, s.bias);
    hidden = DevBuf<uint16_t>(static_cast<size_t>(s.n * s.d));
    fill_bf16_uniform(hidden.get(), s.n * s.d, seed ^ 0x51ull, 1.0f);
    detlogp_test::Rng rng(seed);
    targets.resize(static_cast<size_t>(s.n));
    const int64_t in_chunk = std::min(s.c, s.real_vocab - s.vocab_start);
    for (int64_t i = 0; i < s.n; ++i) {
      targets[i] = rng.below(s.real_vocab);
      if (i % 3 == 0 && in_chunk > 0) targets[i] = s.vocab_start + rng.below(in_chunk);
      if (i % 7 == 5) targets[i] = kDefaultIgnoreIndex;
    }
    if (s.n > 1) targets[1] = s.real_vocab - 1;
    set_targets(targets);
    temps.resize(static_cast<size_t>(s.n));
    g_logp.resize(static_cast<size_t>(s.n));
    g_lse.resize(static_cast<size_t>(s.n));
    for (int64_t i = 0; i < s.n; ++i) {
      temps[i] = 0.5f + 0.125f * static_cast<float>(i % 9);
      g_logp[i] = static_cast<float>(rng.below(2001)) / 1000.0f - 0.5f;
      g_lse[i] = static_cast<float>(rng.below(1001)) / 1000.0f - 0.5f;
    }
    d_temps = DevBuf<float>(temps.size());
    d_temps.from_host(temps);
    d_g_logp = DevBuf<float>(g_logp.size());
    d_g_logp.from_host(g_logp);
    d_g_lse = DevBuf<float>(g_lse.size());
    d_g_lse.from_host(g_lse);

    // The forward on the whole head: lse, and the serving logits whose bits the kernel recomputes.
    fwd.make(s.n, s.vocab, true);
    LinearLogpInputs in = full_inputs();
    LinearLogpOutputs out;
    out.logp = mutable_vector(fwd.logp.get(), DType::f32, s.n, Memory::cuda);
    out.lse = mutable_vector(fwd.lse.get(), DType::f32, s.n, Memory::cuda);
    out.logits = mutable_matrix(fwd.logits.get(), DType::f32, s.n, s.vocab, Memory::cuda);
    CallOptions o;
    o.backend = kId;
    o.strict = true;
    linear_logp(in, out, o);

    dz_stride = s.c + s.stride_pad;
    dz = DevBuf<uint16_t>(static_cast<size_t>(s.n * dz_stride + 1));
    dz.poison();
  }
  // The rows' entropy H from the CPU reduce_logits of the forward's SM90 serving logits (the bits
  // the SM90 forward's entropy output has by the contract, §10) and a dL/dH per row, on the device.
  void with_entropy_term(uint64_t seed) {
    const std::vector<float> logits = fwd.logits.to_host();
    ReduceLogitsInputs ri;
    ri.logits = TensorView::matrix(logits.data(), DType::f32, s.n, s.vocab);
    ri.targets = TensorView::vector(targets.data(), DType::i64, s.n);
    if (s.temp_rows)
      ri.temperature_rows = TensorView::vector(temps.data(), DType::f32, s.n);
    else
      ri.temperature = 0.8f;
    ri.real_vocab = s.real_vocab;
    std::vector<float> logp(static_cast<size_t>(s.n)), lse(static_cast<size_t>(s.n));
    entropy.assign(static_cast<size_t>(s.n), 0.0f);
    reduce_logits(ri, mutable_vector(logp.data(), DType::f32, s.n), mutable_vector(lse.data(), DType::f32, s.n),
                  mutable_vector(entropy.data(), DType::f32, s.n));
    detlogp_test::Rng rng(seed ^ 0xE7ull);
    g_entropy.resize(static_cast<size_t>(s.n));
    for (auto& g : g_entropy) g = static_cast<float>(rng.below(1501)) / 1000.0f - 0.75f;
    d_entropy = DevBuf<float>(entropy.size());
    d_entropy.from_host(entropy);
    d_g_entropy = DevBuf<float>(g_entropy.size());
    d_g_entropy.from_host(g_entropy);
    entropy_term = true;
  }
  void set_targets(const std::vector<int64_t>& t) {
    if (s.i64) {
      t64 = DevBuf<int64_t>(t.size());
      t64.from_host(t);
    } else {
      std::vector<int32_t> t32h(t.begin(), t.end());
      t32 = DevBuf<int32_t>(t32h.size());
      t32.from_host(t32h);
    }
  }
  TensorView targets_view() const {
    return s.i64 ? TensorView::vector(t64.get(), DType::i64, s.n, Memory::cuda)
                 : TensorView::vector(t32.get(), DType::i32, s.n, Memory::cuda);
  }
  LinearLogpInputs full_inputs() const {
    LinearLogpInputs in;
    in.hidden = TensorView::matrix(hidden.get(), DType::bf16, s.n, s.d, Memory::cuda);
    in.weight = TensorView::matrix(m.weight.get(), DType::bf16, s.vocab, s.d, Memory::cuda);
    if (s.bias) in.bias = TensorView::vector(m.bias.get(), DType::f32, s.vocab, Memory::cuda);
    in.targets = targets_view();
    if (s.temp_rows)
      in.temperature_rows = TensorView::vector(d_temps.get(), DType::f32, s.n, Memory::cuda);
    else
      in.temperature = 0.8f;
    in.real_vocab = s.real_vocab;
    return in;
  }
  LinearLogpInputs chunk_inputs() const {
    LinearLogpInputs in = full_inputs();
    in.weight = TensorView::matrix(m.weight.get() + s.vocab_start * s.d, DType::bf16, s.c, s.d, Memory::cuda);
    if (s.bias) in.bias = TensorView::vector(m.bias.get() + s.vocab_start, DType::f32, s.c, Memory::cuda);
    in.vocab_start = s.vocab_start;
    return in;
  }
  GradLogitsArgs args() const {
    GradLogitsArgs a;
    a.lse = TensorView::vector(fwd.lse.get(), DType::f32, s.n, Memory::cuda);
    if (s.g_logp) a.g_logp = TensorView::vector(d_g_logp.get(), DType::f32, s.n, Memory::cuda);
    if (s.g_lse) a.g_lse = TensorView::vector(d_g_lse.get(), DType::f32, s.n, Memory::cuda);
    if (entropy_term) {
      a.entropy = TensorView::vector(d_entropy.get(), DType::f32, s.n, Memory::cuda);
      a.g_entropy = TensorView::vector(d_g_entropy.get(), DType::f32, s.n, Memory::cuda);
    }
    return a;
  }
  uint16_t* dz_base() const { return dz.get() + (s.offset_dz ? 1 : 0); }
  MutableTensorView dz_view() const {
    return {TensorView::matrix(dz_base(), DType::bf16, s.n, s.c, Memory::cuda, dz_stride)};
  }
  CallReport run() const {
    CallOptions o;
    o.strict = true;
    return linear_logp_grad_logits(chunk_inputs(), args(), dz_view(), o);
  }
  // dz as the host sees it: [n][dz_stride] (the offset element dropped).
  std::vector<uint16_t> dz_host() const {
    std::vector<uint16_t> all = dz.to_host();
    const size_t off = s.offset_dz ? 1 : 0;
    return std::vector<uint16_t>(all.begin() + off, all.begin() + off + static_cast<size_t>(s.n * dz_stride));
  }
  // The host reference: the pinned formula on the device's own serving logits of the chunk.
  std::vector<uint16_t> reference() const {
    const std::vector<float> logits = fwd.logits.to_host();
    const std::vector<float> lse = fwd.lse.to_host();
    std::vector<float> bias_host = s.bias ? m.bias.to_host() : std::vector<float>{};
    std::vector<uint16_t> out(static_cast<size_t>(s.n * dz_stride), kPoison);
    detail::GradLogitsProblem p;
    p.rows = s.n;
    p.cols = s.c;
    p.dim = s.d;
    p.vocab_start = s.vocab_start;
    p.real_vocab = s.real_vocab;
    p.targets = targets.data();
    p.targets_i64 = true;
    p.temperature = s.temp_rows ? 1.0f : 0.8f;
    p.temperature_rows = s.temp_rows ? temps.data() : nullptr;
    p.lse = lse.data();
    p.g_logp = s.g_logp ? g_logp.data() : nullptr;
    p.g_lse = s.g_lse ? g_lse.data() : nullptr;
    p.entropy = entropy_term ? entropy.data() : nullptr;
    p.g_entropy = entropy_term ? g_entropy.data() : nullptr;
    p.dz = out.data();
    p.dz_stride = dz_stride;
    detail::grad_logits_from_logits(p, logits.data() + s.vocab_start, s.vocab);
    return out;
  }
};

void expect_bits(const std::vector<uint16_t>& ref, const std::vector<uint16_t>& got, const Spec& s, int64_t stride,
                 const char* what) {
  int64_t diff = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i)
    if (ref[i] != got[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++diff;
    }
  if (diff == 0) return;
  ADD_FAILURE() << what << " " << describe(s) << ": " << diff << " of " << ref.size()
                << " bf16 elements differ; first at row " << (first / stride) << " col " << (first % stride)
                << ": expected 0x" << std::hex << ref[first] << ", got 0x" << got[first] << std::dec;
}

// The CPU implementation on host copies: its z is the CPU's (arch-specific), so only close.
void expect_close_to_cpu(const GradCase& g, const std::vector<uint16_t>& gpu) {
  const Spec& s = g.s;
  std::vector<uint16_t> h = g.hidden.to_host(), w = g.m.weight.to_host();
  std::vector<float> b = s.bias ? g.m.bias.to_host() : std::vector<float>{};
  std::vector<float> lse = g.fwd.lse.to_host();
  LinearLogpInputs in;
  in.hidden = TensorView::matrix(h.data(), DType::bf16, s.n, s.d);
  in.weight = TensorView::matrix(w.data() + s.vocab_start * s.d, DType::bf16, s.c, s.d);
  if (s.bias) in.bias = TensorView::vector(b.data() + s.vocab_start, DType::f32, s.c);
  in.targets = TensorView::vector(g.targets.data(), DType::i64, s.n);
  if (s.temp_rows)
    in.temperature_rows = TensorView::vector(g.temps.data(), DType::f32, s.n);
  else
    in.temperature = 0.8f;
  in.real_vocab = s.real_vocab;
  in.vocab_start = s.vocab_start;
  GradLogitsArgs a;
  a.lse = TensorView::vector(lse.data(), DType::f32, s.n);
  if (s.g_logp) a.g_logp = TensorView::vector(g.g_logp.data(), DType::f32, s.n);
  if (s.g_lse) a.g_lse = TensorView::vector(g.g_lse.data(), DType::f32, s.n);
  std::vector<uint16_t> cpu(static_cast<size_t>(s.n * g.dz_stride), kPoison);
  const CallReport r = linear_logp_grad_logits(
      in, a, {TensorView::matrix(cpu.data(), DType::bf16, s.n, s.c, Memory::host, g.dz_stride)});
  EXPECT_EQ(r.provenance.backend_id, "cpu-linear-logp-contract-v1") << "the backend that served the CPU op";
  int64_t bad = 0;
  double worst = 0;
  for (int64_t n = 0; n < s.n; ++n) {
    const double scale = (std::fabs(g.g_logp[n]) + std::fabs(g.g_lse[n])) / (s.temp_rows ? g.temps[n] : 0.8f);
    for (int64_t c = 0; c < s.c; ++c) {
      const double x = fp::bf16_to_float(cpu[n * g.dz_stride + c]), y = fp::bf16_to_float(gpu[n * g.dz_stride + c]);
      const double err = std::fabs(x - y);
      // One bf16 ulp (2^-8 relative) from a rounding flip plus the fp32 z difference.
      if (!(err <= 0x1p-7 * std::fabs(x) + 1e-5 * scale)) ++bad;
      worst = std::max(worst, err / (std::fabs(x) + 1e-30));
    }
  }
  EXPECT_EQ(bad, 0) << "SM90 vs CPU " << describe(s) << ": elements outside the tolerance";
}

class Sm90GradLogits : public Sm90Test {};

}  // namespace

TEST_F(Sm90GradLogits, ShapeGridMatchesThePinnedFormulaOnSm90LogitsBitForBit) {
  // --small: the shapes with D <= 200 only (fast enough for compute-sanitizer).
  const bool small = options().small;

  // The shape grid: every (N, C, D), the other options varied along it.
  int idx = 0;
  for (int64_t n : {1, 77, 300})
    for (int64_t c : {17, 123, 2053, 4096})
      for (int64_t d : {64, 200, 4096}) {
        if (small && d > 200) continue;
        Spec s{};
        s.n = n;
        s.c = c;
        s.d = d;
        const int64_t starts[] = {0, 64, 296, 1000};
        s.vocab_start = starts[idx % 4];
        switch (idx % 3) {
          case 0:
            s.real_vocab = s.vocab_start + c;  // whole chunk real
            break;
          case 1:
            s.real_vocab = s.vocab_start + c - c / 3;  // the chunk ends in padding
            break;
          default:
            s.real_vocab = s.vocab_start + c + 100;  // more real vocabulary after the chunk
        }
        s.vocab = std::max(s.real_vocab, s.vocab_start + c) + (idx % 2 ? 64 : 0);
        s.bias = idx % 2 == 0;
        s.temp_rows = idx % 3 != 0;
        s.g_logp = idx % 5 != 4;
        s.g_lse = idx % 4 != 3;
        s.i64 = idx % 2 == 1;
        s.offset_dz = idx % 6 == 5;
        s.stride_pad = idx % 4 == 2 ? 7 : 0;
        GradCase g(s, 1000 + idx);
        const CallReport r = g.run();
        EXPECT_EQ(r.provenance.backend_id, kId) << describe(s);
        const std::vector<uint16_t> got = g.dz_host();
        expect_bits(g.reference(), got, s, g.dz_stride, "SM90 dz vs the pinned formula on SM90 logits");
        if (d <= 200 && n * c <= 300 * 2053) expect_close_to_cpu(g, got);
        if (idx % 4 == 0) {  // run to run
          g.dz.poison();
          g.run();
          expect_bits(got, g.dz_host(), s, g.dz_stride, "second run");
        }
        {  // the other free-axis schedule: one CTA per weight stage instead of a 2-CTA cluster
          ScopedEnv env("DETLOGP_SM90_GRAD_CLUSTER", "1");
          g.dz.poison();
          g.run();
          expect_bits(got, g.dz_host(), s, g.dz_stride, "DETLOGP_SM90_GRAD_CLUSTER=1 vs the default 2");
        }
        if (g.s.offset_dz) {  // the element before dz stays untouched
          EXPECT_EQ(g.dz.to_host()[0], kPoison) << "the element before dz was written " << describe(s);
        }
        ++idx;
      }
  std::printf("   %d shapes checked (each also with DETLOGP_SM90_GRAD_CLUSTER=1: same bits)\n", idx);
}

TEST_F(Sm90GradLogits, EntropyTermMatchesThePinnedFormulaOnSm90LogitsBitForBit) {
  // Odd shapes with the entropy term: bias, per-row temperatures, padding, vocab_start not a
  // multiple of 64, strided and offset dz, absent g_logp / g_lse; D = 4096 left out with --small.
  const Spec specs[] = {
      {1, 17, 64, 0, 17, 17, false, false, true, true, false, false, 0},
      {77, 123, 200, 64, 64 + 123 - 41, 64 + 123 + 64, true, true, true, true, true, false, 7},
      {300, 2053, 64, 296, 296 + 2053 + 100, 296 + 2053 + 100, true, false, false, true, false, true, 0},
      {77, 4096, 200, 1000, 1000 + 4096, 1000 + 4096, false, true, true, false, true, false, 0},
      {33, 123, 64, 37, 37 + 123, 37 + 123, true, true, false, false, false, true, 3},  // g_entropy alone
      {300, 2053, 4096, 0, 2053 - 684, 2053 + 64, true, true, true, true, false, false, 0},
  };
  int idx = 0;
  for (const Spec& s : specs) {
    if (options().small && s.d > 200) continue;
    GradCase g(s, 2000 + idx);
    // Without g_entropy first: the logp-only bits, which the entropy term must not disturb.
    g.run();
    const std::vector<uint16_t> plain = g.dz_host();
    expect_bits(g.reference(), plain, s, g.dz_stride, "SM90 dz (no entropy term) vs the pinned formula");
    g.with_entropy_term(2000 + idx);
    g.dz.poison();
    const CallReport r = g.run();
    EXPECT_EQ(r.provenance.backend_id, kId) << describe(s);
    const std::vector<uint16_t> got = g.dz_host();
    expect_bits(g.reference(), got, s, g.dz_stride, "SM90 dz with the entropy term vs the pinned formula");
    {
      ScopedEnv env("DETLOGP_SM90_GRAD_CLUSTER", "1");
      g.dz.poison();
      g.run();
      expect_bits(got, g.dz_host(), s, g.dz_stride, "entropy term, DETLOGP_SM90_GRAD_CLUSTER=1 vs the default 2");
    }
    if (s.offset_dz) {
      EXPECT_EQ(g.dz.to_host()[0], kPoison) << "the element before dz was written " << describe(s);
    }
    // The forward's entropy handed over without g_entropy is not read: the logp-only bits again.
    GradLogitsArgs a = g.args();
    a.g_entropy = {};
    g.dz.poison();
    CallOptions o;
    o.strict = true;
    linear_logp_grad_logits(g.chunk_inputs(), a, g.dz_view(), o);
    expect_bits(plain, g.dz_host(), s, g.dz_stride, "entropy without g_entropy vs the logp-only bits");
    ++idx;
  }
  std::printf("   %d shapes checked with the entropy term\n", idx);
}

TEST_F(Sm90GradLogits, GEntropyWithoutEntropyIsRefusedWithNothingWritten) {
  Spec s{77, 123, 64, 0, 123, 123, true, true, true, true, false, false, 0};
  GradCase g(s, 13);
  g.with_entropy_term(13);
  GradLogitsArgs a = g.args();
  a.entropy = {};
  g.dz.poison();
  try {
    linear_logp_grad_logits(g.chunk_inputs(), a, g.dz_view());
    ADD_FAILURE() << "g_entropy without entropy was not refused";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("g_entropy needs entropy"), std::string::npos) << "message: " << e.what();
  }
  EXPECT_EQ(count_poison(reinterpret_cast<const float*>(g.dz.get()), (s.n * s.c + 1) / 2), (s.n * s.c + 1) / 2)
      << "dz was written despite the error";
}

TEST_F(Sm90GradLogits, ABadClusterKnobIsRefusedByName) {
  {
    Spec s{77, 123, 64, 0, 123, 123, false, false, true, false, false, false, 0};
    GradCase g(s, 11);  // its forward runs before the knob is set
    ScopedEnv env("DETLOGP_SM90_GRAD_CLUSTER", "3");
    try {
      g.run();
      ADD_FAILURE() << "DETLOGP_SM90_GRAD_CLUSTER=3 was not refused";
    } catch (const detlogp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("DETLOGP_SM90_GRAD_CLUSTER=3"), std::string::npos)
          << "message: " << e.what();
    }
  }
}

// Bad device-resident inputs: refused with the row and value named, nothing written.
TEST_F(Sm90GradLogits, BadTargetsAndTemperaturesAreRefusedWithNothingWritten) {
  {
    Spec s{77, 123, 64, 64, 64 + 123, 64 + 123 + 64, true, true, true, true, false, false, 0};
    GradCase g(s, 7);
    std::vector<int64_t> bad = g.targets;
    bad[5] = s.real_vocab;
    g.set_targets(bad);
    g.dz.poison();
    try {
      g.run();
      ADD_FAILURE() << "a target == real_vocab was not refused";
    } catch (const detlogp::Error& e) {
      const std::string msg = e.what();
      const std::string want =
          "targets[5]=" + std::to_string(s.real_vocab) + " is >= real_vocab=" + std::to_string(s.real_vocab);
      EXPECT_NE(msg.find(want), std::string::npos) << "message: " << msg;
      std::printf("   bad target -> %s\n", msg.c_str());
    }
    EXPECT_EQ(count_poison(reinterpret_cast<const float*>(g.dz.get()), (s.n * s.c + 1) / 2), (s.n * s.c + 1) / 2)
        << "dz was written despite an invalid target";
    bad[5] = -7;
    g.set_targets(bad);
    try {
      g.run();
      ADD_FAILURE() << "a negative target was not refused";
    } catch (const detlogp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("targets[5]=-7"), std::string::npos) << "message: " << e.what();
    }
    g.set_targets(g.targets);
    std::vector<float> t = g.temps;
    t[9] = 0.0f;
    g.d_temps.from_host(t);
    try {
      g.run();
      ADD_FAILURE() << "a zero temperature was not refused";
    } catch (const detlogp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("temperature_rows[9]=0"), std::string::npos) << "message: " << e.what();
    }
    EXPECT_EQ(count_poison(reinterpret_cast<const float*>(g.dz.get()), (s.n * s.c + 1) / 2), (s.n * s.c + 1) / 2)
        << "dz was written despite an invalid input";
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "CUDA error state left behind";
    // Still usable afterwards.
    g.d_temps.from_host(g.temps);
    g.run();
    expect_bits(g.reference(), g.dz_host(), s, g.dz_stride, "after the errors");
  }
}

TEST_F(Sm90GradLogits, AMisalignedHiddenIsRefusedOnTheHost) {
  {
    Spec s{16, 64, 64, 0, 64, 64, false, false, true, false, false, false, 0};
    GradCase g(s, 9);
    auto in = g.chunk_inputs();
    in.hidden = TensorView::matrix(g.hidden.get() + 1, DType::bf16, s.n - 1, s.d, Memory::cuda);
    auto a = g.args();
    a.lse.rows = s.n - 1;
    a.g_logp.rows = s.n - 1;
    in.targets.rows = s.n - 1;
    in.temperature_rows = {};
    auto dz = g.dz_view();
    dz.rows = s.n - 1;
    try {
      linear_logp_grad_logits(in, a, dz);
      ADD_FAILURE() << "a misaligned hidden was not refused";
    } catch (const detlogp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("16-byte"), std::string::npos) << "message: " << e.what();
    }
  }
}

// linear_logp_grad_from_logits on SM90: the kernel over given logits (the forward's serving logits
// of the chunk, read in place with the full row stride, or copied into a contiguous buffer whose
// rows then receive their own bf16 dz in place) gives the recomputing kernel's bits; a bad target
// is refused with nothing written, the logits left as they were.
namespace {

GradFromLogitsInputs from_logits_inputs(const GradCase& g, const float* logits, int64_t stride) {
  GradFromLogitsInputs in;
  in.logits = TensorView::matrix(logits, DType::f32, g.s.n, g.s.c, Memory::cuda, stride);
  in.targets = g.targets_view();
  if (g.s.temp_rows)
    in.temperature_rows = TensorView::vector(g.d_temps.get(), DType::f32, g.s.n, Memory::cuda);
  else
    in.temperature = 0.8f;
  in.vocab_start = g.s.vocab_start;
  in.real_vocab = g.s.real_vocab;
  return in;
}

// The chunk's serving logits copied into a contiguous [n][c] device buffer.
DevBuf<float> contiguous_chunk(const GradCase& g) {
  DevBuf<float> z(static_cast<size_t>(g.s.n * g.s.c));
  EXPECT_EQ(cudaMemcpy2D(z.get(), g.s.c * 4, g.fwd.logits.get() + g.s.vocab_start, g.s.vocab * 4, g.s.c * 4, g.s.n,
                         cudaMemcpyDeviceToDevice),
            cudaSuccess);
  return z;
}

// The first half of each row's bytes of an in-place buffer, as [n][dz_stride] bf16 (padding poison).
std::vector<uint16_t> in_place_bits(const GradCase& g, const DevBuf<float>& z) {
  const std::vector<float> host = z.to_host();
  const auto* bits = reinterpret_cast<const uint16_t*>(host.data());
  std::vector<uint16_t> out(static_cast<size_t>(g.s.n * g.dz_stride), kPoison);
  for (int64_t n = 0; n < g.s.n; ++n)
    for (int64_t c = 0; c < g.s.c; ++c)
      out[static_cast<size_t>(n * g.dz_stride + c)] = bits[static_cast<size_t>(n * 2 * g.s.c + c)];
  return out;
}

}  // namespace

TEST_F(Sm90GradLogits, FromLogitsMatchesTheRecomputingKernelBitForBitOwnBufferAndInPlace) {
  int idx = 0;
  for (bool entropy : {false, true})
    for (int64_t n : {1, 77, 300})
      for (int64_t c : {17, 123, 2053, 4101}) {
        Spec s{};
        s.n = n;
        s.c = c;
        s.d = idx % 2 ? 200 : 64;
        s.vocab_start = (idx % 3) * 37;
        s.real_vocab = s.vocab_start + c - (idx % 2 ? c / 4 : 0);
        s.vocab = s.vocab_start + c + 64;
        s.bias = idx % 2 == 0;
        s.temp_rows = idx % 3 != 1;
        s.g_logp = idx % 5 != 4;
        s.g_lse = true;
        s.i64 = idx % 2 == 1;
        s.offset_dz = idx % 4 == 3;
        s.stride_pad = idx % 4 == 2 ? 5 : 0;
        GradCase g(s, 3000 + idx);
        if (entropy) g.with_entropy_term(3000 + idx);
        g.run();
        const std::vector<uint16_t> want = g.dz_host();

        g.dz.poison();
        const CallReport r = linear_logp_grad_from_logits(
            from_logits_inputs(g, g.fwd.logits.get() + s.vocab_start, s.vocab), g.args(), g.dz_view());
        EXPECT_EQ(r.provenance.backend_id, kId) << describe(s);
        expect_bits(want, g.dz_host(), s, g.dz_stride, "from the serving logits vs the recomputing kernel");

        DevBuf<float> z = contiguous_chunk(g);
        const MutableTensorView over{TensorView::matrix(z.get(), DType::bf16, s.n, s.c, Memory::cuda, 2 * s.c)};
        linear_logp_grad_from_logits(from_logits_inputs(g, z.get(), s.c), g.args(), over);
        expect_bits(want, in_place_bits(g, z), s, g.dz_stride, "in place vs the recomputing kernel");
        ++idx;
      }
  std::printf("   %d shapes checked (serving logits in place of the recompute, and dz over its own logits)\n", idx);
}

TEST_F(Sm90GradLogits, FromLogitsRefusesABadTargetWithNothingWritten) {
  Spec s{77, 123, 64, 64, 64 + 123, 64 + 123 + 64, true, true, true, true, true, false, 0};
  GradCase g(s, 11);
  DevBuf<float> z = contiguous_chunk(g);
  const std::vector<float> before = z.to_host();
  std::vector<int64_t> bad = g.targets;
  bad[6] = s.real_vocab + 3;
  g.set_targets(bad);
  const MutableTensorView over{TensorView::matrix(z.get(), DType::bf16, s.n, s.c, Memory::cuda, 2 * s.c)};
  try {
    linear_logp_grad_from_logits(from_logits_inputs(g, z.get(), s.c), g.args(), over);
    ADD_FAILURE() << "a target past real_vocab was not refused";
  } catch (const detlogp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("targets[6]=" + std::to_string(s.real_vocab + 3)), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(z.to_host(), before) << "the logits were written despite an invalid target";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "CUDA error state left behind";
}

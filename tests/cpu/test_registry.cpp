// Registry, strict mode, fallback reporting, provenance, and the environment knobs: free axes
// change nothing in the bytes; an attempt to set a frozen constant or an unknown DETLOGP_*
// variable is refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "detlogp/bitcmp.hpp"
#include "detlogp/detlogp.hpp"
#include "test_util.hpp"

using namespace detlogp_test;

namespace {

constexpr const char* kCpuId = "cpu-linear-logp-contract-v1";
constexpr const char* kReferenceId = "reference-materialized";
constexpr const char* kSm90Id = "cuda-fused-linear-logp-sm90-contract-v1";

Problem small_problem() {
  return make_problem(ProblemSpec{
      .rows = 9, .dim = 128, .vocab = 517, .real_vocab = -1, .bias = true, .logit_stddev = 2.0, .seed = 51});
}

const detlogp::BackendInfo* find_backend(const std::vector<detlogp::BackendInfo>& all, const std::string& id) {
  for (const auto& b : all)
    if (b.id == id) return &b;
  return nullptr;
}

bool sm90_available() {
  const auto all = detlogp::list_backends();
  const auto* b = find_backend(all, kSm90Id);
  return b && b->available;
}

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

// Runs linear_logp and expects a detlogp::Error containing all needles, with the outputs untouched.
void expect_refused(const Problem& p, const detlogp::CallOptions& opt, std::initializer_list<std::string> needles) {
  Outputs out(p.rows, p.vocab, true);
  try {
    detlogp::linear_logp(p.inputs(), out.views(), opt);
    ADD_FAILURE() << "call accepted; expected an error naming " << *needles.begin();
  } catch (const detlogp::Error& e) {
    for (const auto& n : needles) EXPECT_TRUE(contains(e.what(), n)) << "message lacks '" << n << "': " << e.what();
  }
  EXPECT_TRUE(out.untouched()) << "outputs written despite the refusal";
}

}  // namespace

TEST(Registry, ListsTheCpuContractBackendAndTheNonContractReferenceLane) {
  const auto all = detlogp::list_backends();
  const auto* cpu = find_backend(all, kCpuId);
  ASSERT_NE(cpu, nullptr) << "no " << kCpuId << " in list_backends()";
  EXPECT_TRUE(cpu->contract_bearing);
  EXPECT_TRUE(cpu->available) << cpu->detail;
  EXPECT_EQ(cpu->memory, detlogp::Memory::host);
  EXPECT_EQ(cpu->provenance.backend_id, kCpuId);
  EXPECT_EQ(cpu->provenance.contract_name, detlogp::kContractName);
  EXPECT_EQ(cpu->provenance.contract_version, detlogp::kContractVersion);
  EXPECT_EQ(cpu->provenance.arch, "cpu");
  EXPECT_EQ(cpu->provenance.cc, 0);
  EXPECT_EQ(cpu->provenance.vocab_tile, 64);
  EXPECT_EQ(cpu->provenance.k_slab, 32);
  EXPECT_EQ(cpu->provenance.tree_id, detlogp::kTreeId);
  EXPECT_EQ(cpu->provenance.transcendental_id, detlogp::kTranscendentalId);
  EXPECT_EQ(cpu->provenance.temperature_id, detlogp::kTemperatureId);
  EXPECT_EQ(cpu->provenance.entropy_id, detlogp::kEntropyId);  // the CPU backend computes the entropy output
  EXPECT_EQ(cpu->provenance.sample_id, detlogp::kSampleId);    // and runs the sampling program
  EXPECT_EQ(cpu->provenance.n_split_policy, detlogp::kNSplitPolicy);

  const auto* ref = find_backend(all, kReferenceId);
  ASSERT_NE(ref, nullptr) << "no " << kReferenceId << " in list_backends()";
  EXPECT_FALSE(ref->contract_bearing);
  EXPECT_TRUE(ref->available);
  EXPECT_EQ(ref->provenance.contract_version, 0);
  EXPECT_EQ(ref->provenance.entropy_id, "");
  EXPECT_EQ(ref->provenance.sample_id, "");

  const auto* sm90 = find_backend(all, kSm90Id);
  ASSERT_NE(sm90, nullptr) << "no " << kSm90Id << " in list_backends()";
  EXPECT_TRUE(sm90->contract_bearing);
  if (!sm90->available) {
    EXPECT_FALSE(sm90->detail.empty()) << "an unavailable backend must say why";
  }
}

TEST(Registry, ProvenanceToStringNamesTheContractAndTheBackend) {
  const auto all = detlogp::list_backends();
  const std::string s = detlogp::to_string(find_backend(all, kCpuId)->provenance);
  EXPECT_TRUE(contains(s, kCpuId)) << s;
  EXPECT_TRUE(contains(s, detlogp::kTreeId)) << s;
  EXPECT_TRUE(contains(s, detlogp::kTranscendentalId)) << s;
  EXPECT_FALSE(detlogp::version_string().empty());
}

TEST(CallReport, DefaultCallSaysWhichBackendServedAndNoFallback) {
  detlogp::CallReport r;
  run_linear_logp(small_problem(), false, {}, &r);
  EXPECT_EQ(r.requested_backend, "auto");
  EXPECT_FALSE(r.strict);
  EXPECT_FALSE(r.fallback);
  EXPECT_TRUE(r.fallback_reason.empty()) << r.fallback_reason;
  EXPECT_EQ(r.provenance.backend_id, sm90_available() ? kSm90Id : kCpuId);
  EXPECT_EQ(r.provenance.contract_version, detlogp::kContractVersion);
}

TEST(CallReport, ExplicitCpuBackend) {
  detlogp::CallOptions opt;
  opt.backend = kCpuId;
  detlogp::CallReport r;
  const Outputs a = run_linear_logp(small_problem(), true, opt, &r);
  EXPECT_EQ(r.requested_backend, kCpuId);
  EXPECT_EQ(r.provenance.backend_id, kCpuId);
  EXPECT_FALSE(r.fallback);
  opt.strict = true;
  const Outputs b = run_linear_logp(small_problem(), true, opt, &r);
  EXPECT_TRUE(r.strict);
  EXPECT_EQ(r.provenance.backend_id, kCpuId);
  expect_identical(a, b, "strict vs non-strict cpu");
}

TEST(StrictMode, ReferenceLaneServesWhenNotStrict) {
  const Problem p = small_problem();
  const Outputs contract = run_linear_logp(p);
  detlogp::CallOptions opt;
  opt.backend = kReferenceId;
  detlogp::CallReport r;
  const Outputs ref = run_linear_logp(p, true, opt, &r);
  EXPECT_EQ(r.provenance.backend_id, kReferenceId);
  EXPECT_EQ(r.provenance.contract_version, 0);
  EXPECT_FALSE(r.fallback);
  // A plain fp32 log-softmax: close to the contract, not necessarily the same bits.
  for (int64_t n = 0; n < p.rows; ++n) {
    EXPECT_NEAR(ref.logp[n], contract.logp[n], 1e-4 * (1 + std::fabs(contract.logp[n]))) << "row " << n;
    EXPECT_NEAR(ref.lse[n], contract.lse[n], 1e-4 * (1 + std::fabs(contract.lse[n]))) << "row " << n;
  }
}

TEST(StrictMode, OptionRefusesTheReferenceLaneByName) {
  detlogp::CallOptions opt;
  opt.backend = kReferenceId;
  opt.strict = true;
  expect_refused(small_problem(), opt, {kReferenceId, "strict"});
}

TEST(StrictMode, EnvironmentRefusesTheReferenceLaneByName) {
  ScopedEnv strict("DETLOGP_STRICT", "1");
  detlogp::CallOptions opt;
  opt.backend = kReferenceId;
  expect_refused(small_problem(), opt, {kReferenceId, "strict"});
  // And the lane chosen through DETLOGP_BACKEND.
  ScopedEnv backend("DETLOGP_BACKEND", kReferenceId);
  expect_refused(small_problem(), {}, {kReferenceId, "strict"});
}

TEST(StrictMode, EnvironmentStrictStillServesTheContractBackend) {
  ScopedEnv strict("DETLOGP_STRICT", "1");
  detlogp::CallReport r;
  run_linear_logp(small_problem(), false, {}, &r);
  EXPECT_TRUE(r.strict);
  EXPECT_FALSE(r.fallback);
  EXPECT_EQ(r.provenance.contract_version, detlogp::kContractVersion);
}

TEST(Fallback, UnavailableSm90FallsBackToCpuWithAReasonUnlessStrict) {
  if (sm90_available()) GTEST_SKIP() << "the SM90 backend is available here: no fallback to observe";
  const Problem p = small_problem();
  const Outputs cpu = run_linear_logp(p, true);
  detlogp::CallOptions opt;
  opt.backend = kSm90Id;
  detlogp::CallReport r;
  const Outputs fell_back = run_linear_logp(p, true, opt, &r);
  EXPECT_TRUE(r.fallback);
  EXPECT_FALSE(r.fallback_reason.empty());
  EXPECT_TRUE(contains(r.fallback_reason, kSm90Id)) << r.fallback_reason;
  EXPECT_EQ(r.requested_backend, kSm90Id);
  EXPECT_EQ(r.provenance.backend_id, kCpuId);
  expect_identical(cpu, fell_back, "fallback vs cpu");

  opt.strict = true;
  expect_refused(p, opt, {kSm90Id, "fallback"});
  ScopedEnv strict("DETLOGP_STRICT", "1");
  opt.strict = false;
  expect_refused(p, opt, {kSm90Id, "fallback"});
}

TEST(Registry, UnknownBackendIsRefusedByName) {
  detlogp::CallOptions opt;
  opt.backend = "no-such-backend";
  expect_refused(small_problem(), opt, {"no-such-backend"});
}

TEST(Environment, FrozenConstantOverrideIsRefusedByName) {
  const Problem p = small_problem();
  for (const char* var : {"DETLOGP_VOCAB_TILE", "DETLOGP_K_SLAB"}) {
    ScopedEnv frozen(var, var[8] == 'V' ? "128" : "16");
    EXPECT_THROW(detlogp::check_environment(), detlogp::Error) << var;
    expect_refused(p, {}, {var, "frozen"});
    // The TP path and the public reducer refuse it too.
    Outputs out(p.rows, p.vocab, false);
    EXPECT_THROW(detlogp::simulate_tensor_parallel(p.inputs(), 2, out.views()), detlogp::Error) << var;
    std::vector<float> z(static_cast<size_t>(p.rows * p.vocab), 0.0f);
    EXPECT_THROW(run_reduce_logits(p, z), detlogp::Error) << var;
    EXPECT_TRUE(out.untouched());
  }
  EXPECT_NO_THROW(detlogp::check_environment());
  EXPECT_NO_THROW(run_linear_logp(p));
}

TEST(Environment, UnknownDetlogpVariableIsRefusedByName) {
  const Problem p = small_problem();
  {
    ScopedEnv unknown("DETLOGP_FOO", "1");
    try {
      detlogp::check_environment();
      ADD_FAILURE() << "DETLOGP_FOO=1 accepted";
    } catch (const detlogp::Error& e) {
      EXPECT_TRUE(contains(e.what(), "DETLOGP_FOO")) << e.what();
    }
    expect_refused(p, {}, {"DETLOGP_FOO"});
  }
  EXPECT_NO_THROW(run_linear_logp(p));
}

TEST(Environment, BadValuesOfFreeKnobsAreRefused) {
  const Problem p = small_problem();
  {
    ScopedEnv threads("DETLOGP_CPU_THREADS", "zero");
    expect_refused(p, {}, {"DETLOGP_CPU_THREADS"});
  }
  {
    ScopedEnv strict("DETLOGP_STRICT", "yes");
    expect_refused(p, {}, {"DETLOGP_STRICT"});
  }
}

TEST(Environment, CpuThreadCountIsAFreeAxis) {
  const Problem p = make_problem(ProblemSpec{
      .rows = 65, .dim = 256, .vocab = 2053, .real_vocab = -1, .bias = true, .logit_stddev = 3.0, .seed = 52});
  Outputs one(0, 0, false), two(0, 0, false), three(0, 0, false), tp_one(0, 0, false), tp_three(0, 0, false);
  {
    ScopedEnv t("DETLOGP_CPU_THREADS", "1");
    one = run_linear_logp(p, true);
    tp_one = run_tensor_parallel(p, 4);
  }
  {
    ScopedEnv t("DETLOGP_CPU_THREADS", "2");
    two = run_linear_logp(p, true);
  }
  {
    ScopedEnv t("DETLOGP_CPU_THREADS", "3");
    three = run_linear_logp(p, true);
    tp_three = run_tensor_parallel(p, 4);
  }
  expect_identical(one, two, "DETLOGP_CPU_THREADS 1 vs 2");
  expect_identical(one, three, "DETLOGP_CPU_THREADS 1 vs 3");
  expect_identical(tp_one, tp_three, "TP R=4, DETLOGP_CPU_THREADS 1 vs 3");
  expect_identical(one, tp_one, "TP R=4 vs single shard");
}

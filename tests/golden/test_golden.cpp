// Validation layer (docs/validation.md): generator bit-stability, the CPU goldens (logp/lse and the
// entropy rows), the L3 checker, the L4/L5 harness (exact zeros of logp and entropy, negative
// control, fingerprint mismatch).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "detlogp/fpops.hpp"
#include "golden/generator.hpp"
#include "golden/goldens.hpp"
#include "golden/harness.hpp"
#include "golden/report.hpp"
#include "io/safetensors.hpp"
#include "io/sha256.hpp"

namespace {

namespace g = detlogp::golden;
using detlogp::DType;
using detlogp::TensorView;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::string sha(const void* p, size_t n) { return detlogp::io::Sha256::hex(detlogp::io::Sha256::of(p, n)); }

detlogp::CallOptions cpu_strict() {
  detlogp::CallOptions o;
  o.backend = "cpu-linear-logp-contract-v1";
  o.strict = true;
  return o;
}

// Pinned values: any change to the hash, the normal variate, the bf16 rounding or the RMS norm
// changes every golden; these say which part moved.
TEST(Generator, BitStable) {
  EXPECT_EQ(g::draw(0, 0, 0), 0x574cca60cecc11e9ull);
  EXPECT_EQ(g::draw(1, 102, 5), 0xf07bf0daafde3ab1ull);
  EXPECT_EQ(g::draw(~0ull, 7, ~0ull), 0x053b4c00d4387389ull);
  EXPECT_EQ(bits(g::normal(3, 101, 0)), 0x3fb1aef5u);
  EXPECT_EQ(bits(g::normal(3, 101, 1)), 0xbfa9ba35u);
  EXPECT_EQ(bits(g::normal(3, 101, 2)), 0x3f1a886du);
  EXPECT_EQ(bits(g::normal(3, 101, 3)), 0x3e6b2692u);
  EXPECT_EQ(bits(g::uniform(3, 106, 9)), 0x3f298100u);
  const std::vector<uint16_t> w = g::weight_rows(1, 0, 64, 128);
  EXPECT_EQ(sha(w.data(), w.size() * 2), "05f49148ff13668974c32c441e0474067d012138fc67781e5016216e8a147ef5");
  std::vector<uint16_t> h(256);
  g::hidden_row(1, 7, 256, 1.0f, nullptr, h.data());
  EXPECT_EQ(sha(h.data(), h.size() * 2), "b05250beb792a18bd70d52571e5fbb01d8c9bde0b29dd9177905180280b1e19d");
  g::hidden_row(1, 7, 128, 1.0f, w.data() + 5 * 128, h.data());
  EXPECT_EQ(sha(h.data(), 128 * 2), "fa7ef82f6a20f29e2524e1ac4279ad0498bbc1fdb9d586429493a614af0d1ae6");
}

TEST(Generator, Bf16RoundsToNearestEven) {  // the generator's rounding: fp::bf16_round
  EXPECT_EQ(detlogp::fp::bf16_round(1.0f), 0x3F80);
  EXPECT_EQ(detlogp::fp::bf16_round(std::bit_cast<float>(0x3F808000u)), 0x3F80);  // tie, even stays
  EXPECT_EQ(detlogp::fp::bf16_round(std::bit_cast<float>(0x3F818000u)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(detlogp::fp::bf16_round(std::bit_cast<float>(0x3F808001u)), 0x3F81);  // above the tie
  EXPECT_EQ(detlogp::fp::bf16_round(-0.0f), 0x8000);
  EXPECT_EQ(detlogp::fp::bf16_round(std::bit_cast<float>(0x7F7FFFFFu)), 0x7F80);  // overflows to +inf
}

TEST(Generator, ShardsAreSlicesAndRowsAreRmsNormalized) {
  const std::vector<uint16_t> whole = g::weight_rows(4, 0, 200, 64), tail = g::weight_rows(4, 128, 72, 64);
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), whole.begin() + 128 * 64));
  std::vector<uint16_t> h(1024);
  g::hidden_row(4, 3, 1024, 1.0f, nullptr, h.data());
  double ss = 0;
  for (uint16_t b : h) ss += static_cast<double>(detlogp::fp::bf16_to_float(b)) * detlogp::fp::bf16_to_float(b);
  EXPECT_NEAR(ss / 1024, 1.0, 1e-2);
}

TEST(WeightFingerprint, RankOrderedShardsEqualTheWholeHeadAndOneBitChangesIt) {
  std::vector<uint16_t> w = g::weight_rows(5, 0, 300, 32);
  const std::string whole = g::weight_fingerprint({TensorView::matrix(w.data(), DType::bf16, 300, 32)});
  const std::string sharded = g::weight_fingerprint({TensorView::matrix(w.data(), DType::bf16, 128, 32),
                                                     TensorView::matrix(w.data() + 128 * 32, DType::bf16, 172, 32)});
  EXPECT_EQ(whole, sharded);
  const std::string header = "detlogp-weight-v1 bf16 rows=300 cols=32\n";
  std::string bytes = header + std::string(reinterpret_cast<const char*>(w.data()), w.size() * 2);
  EXPECT_EQ(whole, sha(bytes.data(), bytes.size()));
  w[77] ^= 1;
  EXPECT_NE(whole, g::weight_fingerprint({TensorView::matrix(w.data(), DType::bf16, 300, 32)}));
}

// The checked-in CPU fingerprints, every case but the Qwen3-8B shard (the CLI test replays all).
TEST(Goldens, CpuFingerprintsMatchTheCheckedInFile) {
  const auto table = g::read_fingerprints(DETLOGP_GOLDEN_FILE);
  int checked = 0;
  for (const g::GoldenCase& c : g::golden_cases()) {
    if (c.dim * c.weight_rows > 16'000'000) continue;
    const g::CaseResult r = g::run_case(g::make_inputs(c), cpu_strict());
    ASSERT_FALSE(r.report.fallback);
    for (const g::Fingerprint& f : r.fingerprints) {
      const bool any = f.scope == "inputs";
      const g::FingerprintKey key{1, any ? "any" : "cpu", any ? "-" : "0", c.name, f.scope};
      ASSERT_TRUE(table.count(key)) << c.name << " " << f.scope << " is not recorded";
      EXPECT_EQ(table.at(key), f.sha256) << c.name << " " << f.scope;
      ++checked;
    }
  }
  EXPECT_GE(checked, 20);
}

// The sampling program (docs/contract.md §11, sample/v1) and the top-k beside its draw (§12.5),
// pinned like logp: a fixed program (per-row T with greedy rows, per-row top-k, top-p, min-p), seed
// and keys on each TP = 1 golden case through the CPU backend; the fingerprint covers token, logp,
// logp_raw, lse, support_size, topk_ids and topk_logp in that order. A change to any of the
// program's bits (the counter hash, the noise, the cut, the support) moves these rows; a missing
// row prints the line to record.
TEST(Goldens, CpuSamplingProgramFingerprintsMatchTheCheckedInFile) {
  const auto table = g::read_fingerprints(DETLOGP_GOLDEN_FILE);
  const std::string scope = "sample/v1:token|logp|logp_raw|lse|support_size|topk_ids|topk_logp";
  int checked = 0;
  for (const g::GoldenCase& c : g::golden_cases()) {
    if (c.tp != 1 || c.dim * c.weight_rows > 16'000'000) continue;
    const g::CaseInputs in = g::make_inputs(c);
    const detlogp::LinearLogpInputs head = in.view();
    const int64_t n = c.rows, k = std::min<int64_t>(4, c.real_vocab);
    std::vector<float> temps(static_cast<size_t>(n));
    std::vector<int64_t> top_k(static_cast<size_t>(n)), key(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      temps[static_cast<size_t>(i)] = i % 4 == 2 ? 0.0f : 0.6f + 0.15f * static_cast<float>(i % 3);
      top_k[static_cast<size_t>(i)] = i % 3 == 0 ? 0 : 3 + i % 5;
      key[static_cast<size_t>(i)] = 7 * i + 1;
    }
    detlogp::SampleInputs s;
    s.hidden = head.hidden;
    s.weight = head.weight;
    s.bias = head.bias;
    s.real_vocab = head.real_vocab;
    s.program.temperature_rows = TensorView::vector(temps.data(), DType::f32, n);
    s.program.top_k_rows = TensorView::vector(top_k.data(), DType::i64, n);
    s.program.top_p = 0.9f;
    s.program.min_p = 0.02f;
    s.seed = 20261203;
    s.key = TensorView::vector(key.data(), DType::i64, n);
    std::vector<int64_t> token(static_cast<size_t>(n)), support(static_cast<size_t>(n)),
        topk_ids(static_cast<size_t>(n * k));
    std::vector<float> logp(static_cast<size_t>(n)), logp_raw(logp.size()), lse(logp.size()),
        topk_logp(static_cast<size_t>(n * k));
    detlogp::SampleOutputs o;
    o.token = detlogp::mutable_vector(token.data(), DType::i64, n);
    o.logp = detlogp::mutable_vector(logp.data(), DType::f32, n);
    o.logp_raw = detlogp::mutable_vector(logp_raw.data(), DType::f32, n);
    o.lse = detlogp::mutable_vector(lse.data(), DType::f32, n);
    o.support_size = detlogp::mutable_vector(support.data(), DType::i64, n);
    o.topk_ids = detlogp::mutable_matrix(topk_ids.data(), DType::i64, n, k);
    o.topk_logp = detlogp::mutable_matrix(topk_logp.data(), DType::f32, n, k);
    const detlogp::CallReport report = detlogp::sample(s, o, cpu_strict());
    ASSERT_EQ(report.provenance.sample_id, "sample/v1");
    detlogp::io::Sha256 h;
    h.update(token.data(), token.size() * 8);
    h.update(logp.data(), logp.size() * 4);
    h.update(logp_raw.data(), logp_raw.size() * 4);
    h.update(lse.data(), lse.size() * 4);
    h.update(support.data(), support.size() * 8);
    h.update(topk_ids.data(), topk_ids.size() * 8);
    h.update(topk_logp.data(), topk_logp.size() * 4);
    const std::string got = detlogp::io::Sha256::hex(h.finish());
    const g::FingerprintKey fk{1, "cpu", "0", c.name, scope};
    if (!table.count(fk)) {
      ADD_FAILURE() << c.name << ": not recorded; the line: " << g::fingerprint_line(fk, got);
      continue;
    }
    EXPECT_EQ(table.at(fk), got) << c.name;
    ++checked;
  }
  EXPECT_GE(checked, 5);
}

std::string scope_sha(const g::CaseResult& r, const std::string& scope) {
  for (const g::Fingerprint& f : r.fingerprints)
    if (f.scope == scope) return f.sha256;
  ADD_FAILURE() << "no fingerprint of scope " << scope;
  return "";
}

// Every CPU case carries an entropy row (the CPU backend serves the output), recorded beside the
// case's logp/lse rows; its call left logp/lse as they were (run_case checks the bits).
TEST(Goldens, EveryCpuCaseHasARecordedEntropyRow) {
  const auto table = g::read_fingerprints(DETLOGP_GOLDEN_FILE);
  for (const g::GoldenCase& c : g::golden_cases()) {
    EXPECT_TRUE(table.count({1, "cpu", "0", c.name, "entropy"})) << c.name << ": no cpu entropy row";
    EXPECT_TRUE(table.count({1, "cpu", "0", c.name, c.serving ? "logp|lse|logits" : "logp|lse"})) << c.name;
  }
  const g::CaseResult r = g::run_case(g::make_inputs(g::golden_cases()[0]), cpu_strict());
  ASSERT_FALSE(r.report.provenance.entropy_id.empty());
  ASSERT_EQ(r.entropy.size(), static_cast<size_t>(r.logp.size()));
  EXPECT_EQ(scope_sha(r, "entropy"), sha(r.entropy.data(), r.entropy.size() * 4));
  for (size_t n = 0; n < r.entropy.size(); ++n) {
    EXPECT_GT(r.entropy[n], 0.0f) << n;
    EXPECT_LE(r.entropy[n], std::log(17.0f) * 1.0001f) << n;  // at most log V_real
  }
}

// A backend without the entropy output (the materializing lane) gives no entropy fingerprint.
TEST(Goldens, NoEntropyRowWhereTheBackendServesNone) {
  detlogp::CallOptions o;
  o.backend = "reference-materialized";
  const g::CaseResult r = g::run_case(g::make_inputs(g::golden_cases()[0]), o);
  ASSERT_TRUE(r.report.provenance.entropy_id.empty());
  EXPECT_TRUE(r.entropy.empty());
  for (const g::Fingerprint& f : r.fingerprints) EXPECT_NE(f.scope, "entropy");
}

TEST(Goldens, DominantRowsHaveLogpNearZeroAndTheTp2CaseMatchesTp1) {
  const g::CaseInputs in = g::make_inputs(g::golden_cases()[2]);  // v2053-bias-t0.7
  const g::CaseResult r = g::run_case(in, cpu_strict());
  for (int64_t n = 3; n < in.c.rows; n += 8) {
    EXPECT_LT(r.logp[n], 0.0f) << n;
    EXPECT_GT(r.logp[n], -0.05f) << n;
  }
  EXPECT_LT(r.logp[0], -1.0f);
  EXPECT_EQ(bits(r.logp[15]), 0u);  // ignore_index
  g::GoldenCase tp2 = in.c;
  tp2.tp = 2;
  g::CaseInputs in2 = in;
  in2.c = tp2;
  const g::CaseResult r2 = g::run_case(in2, cpu_strict());
  EXPECT_EQ(scope_sha(r, "logp|lse"), scope_sha(r2, "logp|lse"));
  EXPECT_EQ(scope_sha(r, "logp|lse"), scope_sha(r2, "tp-operator:logp|lse"));
  EXPECT_EQ(scope_sha(r, "entropy"), scope_sha(r2, "entropy"));
  // A dominant row is peaked: its entropy is well below a uniform target row's.
  EXPECT_LT(r.entropy[3], 0.5f * r.entropy[0]);
}

std::filesystem::path temp_dir(const std::string& name) {
  const auto d = std::filesystem::path(::testing::TempDir()) / (name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(d);
  return d;
}

TEST(L3, CheckerPassesIdenticalSidesAndFailsOnOneFlippedBit) {
  const auto dir = temp_dir("l3");
  std::ostringstream log;
  g::l3_run_side(g::L3Side::trainer, {"tiny-v17", "v17-i32-ignore7"}, 2, cpu_strict(), (dir / "t.safetensors").string(),
                 log);
  g::l3_run_side(g::L3Side::rollout, {"tiny-v17", "v17-i32-ignore7"}, 1, cpu_strict(), (dir / "r.safetensors").string(),
                 log);
  // Both ran in this process; make them look like two processes so the byte comparison decides.
  auto f = detlogp::io::read_safetensors(dir / "r.safetensors");
  f.metadata["pid"] = "other";
  detlogp::io::write_safetensors(dir / "r.safetensors", f);
  std::ostringstream ok;
  EXPECT_TRUE(g::l3_check((dir / "t.safetensors").string(), (dir / "r.safetensors").string(), ok)) << ok.str();
  for (auto& t : f.tensors)
    if (t.name == "tiny-v17/logp") t.tensor.bytes[4] ^= 1;
  detlogp::io::write_safetensors(dir / "r.safetensors", f);
  std::ostringstream bad;
  EXPECT_FALSE(g::l3_check((dir / "t.safetensors").string(), (dir / "r.safetensors").string(), bad));
  EXPECT_NE(bad.str().find("tiny-v17                FAIL  1 of 5 logp differ"), std::string::npos) << bad.str();
  std::filesystem::remove_all(dir);
}

g::HarnessConfig small_config() {
  g::HarnessConfig cfg;
  cfg.seqs = 9;
  cfg.max_len = 6;
  cfg.max_batch = 4;
  cfg.dim = 256;
  cfg.weight_rows = 2112;  // padded head
  cfg.real_vocab = 2053;
  cfg.tp = 2;
  cfg.seed = 3;
  cfg.rollout_opt = cfg.trainer_opt = cpu_strict();
  return cfg;
}

TEST(Harness, RolloutVsTrainerIsExactAndTheNegativeControlDrifts) {
  for (int tp : {2, 3}) {
    g::HarnessConfig cfg = small_config();
    cfg.tp = tp;
    std::ostringstream log;
    const g::HarnessResult r = g::run_rollout_vs_trainer(cfg, log);
    ASSERT_TRUE(r.compared) << log.str();
    EXPECT_TRUE(r.exact) << log.str();
    EXPECT_GT(r.metrics.total, 9);
    EXPECT_EQ(r.metrics.mismatch_count, 0);
    EXPECT_EQ(r.metrics.train_rollout_logprob_abs_diff, 0.0);
    EXPECT_EQ(r.metrics.current_rollout_logprob_max_abs_diff, 0.0);
    EXPECT_EQ(r.metrics.k3_max, 0.0);
    EXPECT_EQ(r.metrics.k3_nonzero, 0);
    EXPECT_TRUE(r.control_drift);
    EXPECT_GT(r.control.mismatch_count, 0);
    EXPECT_GT(r.control.current_rollout_logprob_max_abs_diff, 0.0);
    EXPECT_NE(r.json.find("\"logp_exact_zero\": true"), std::string::npos);
    EXPECT_NE(r.markdown.find("**logp claim: exact zero**"), std::string::npos);
    EXPECT_NE(r.markdown.find("no fallback observed"), std::string::npos);
  }
}

// The entropy row: rollout entropy (the reducer over the served logits, and the serving call's own
// where the engine is TP = 1) against the trainer's entropy output, exactly zero on the CPU.
TEST(Harness, RolloutVsTrainerEntropyIsExact) {
  for (int rollout_tp : {1, 2}) {
    g::HarnessConfig cfg = small_config();
    cfg.rollout_tp = rollout_tp;
    cfg.cp = 2;
    std::ostringstream log;
    const g::HarnessResult r = g::run_rollout_vs_trainer(cfg, log);
    ASSERT_TRUE(r.compared) << log.str();
    ASSERT_TRUE(r.entropy_compared) << r.entropy_note;
    EXPECT_TRUE(r.entropy_exact) << log.str();
    EXPECT_EQ(r.entropy.total, r.metrics.total);
    EXPECT_GT(r.entropy.total, 9);
    EXPECT_EQ(r.entropy.mismatch_count, 0);
    EXPECT_EQ(r.entropy.mean_abs_diff, 0.0);
    EXPECT_EQ(r.entropy.max_abs_diff, 0.0);
    EXPECT_NE(r.json.find("\"entropy_exact_zero\": true"), std::string::npos);
    EXPECT_NE(r.json.find("\"entropy_trainer\": \"0x"), std::string::npos);
    EXPECT_NE(r.markdown.find("**entropy claim: exact zero**"), std::string::npos);
    EXPECT_NE(log.str().find("entropy: mismatch 0/"), std::string::npos) << log.str();
    // A TP = 1 engine asks its serving call for the entropy too: checked against the reducer.
    const std::string readback =
        "\"serving_readback_checked\": " + std::to_string(rollout_tp == 1 ? r.entropy.total : 0);
    EXPECT_NE(r.json.find(readback + ", \"serving_readback_mismatch\": 0"), std::string::npos)
        << r.json.substr(0, 2000);
  }
}

// Where the trainer's backend serves no entropy output (no such contract backend is built for the
// CPU, so the report is rendered from a run that says so) the row says why and the logp claim stands.
TEST(Harness, EntropyRowSaysNotComparedWhereTheTrainerServesNone) {
  g::HarnessConfig cfg = small_config();
  g::HarnessRun run;
  run.real_vocab = cfg.real_vocab;
  run.rollout_fingerprint = run.trainer_fingerprint = "ab";
  run.where = {{0, 0}};
  run.tokens = {5};
  run.temperatures = {1.0f};
  run.rollout_logp = run.trainer_logp = run.control_logp = {-2.0f};
  run.rollout_entropy = {3.0f};
  run.k3 = run.control_k3 = {0.0};
  g::HarnessResult res;
  res.compared = res.exact = true;
  res.entropy_note = "the trainer's backend x serves no entropy output (no entropy_id)";
  const std::string json = g::report_json(cfg, run, res), md = g::report_markdown(cfg, run, res);
  std::ostringstream log;
  g::log_summary(cfg, run, res, log);
  EXPECT_NE(json.find("\"entropy\": null"), std::string::npos) << json;
  EXPECT_NE(json.find("\"entropy_exact_zero\": null, \"entropy_not_compared\": \"the trainer's backend x"),
            std::string::npos)
      << json;
  EXPECT_EQ(json.find("entropy_trainer"), std::string::npos);
  EXPECT_NE(md.find("**logp claim: exact zero**"), std::string::npos);
  EXPECT_NE(md.find("**entropy claim: not compared (the trainer's backend x serves no entropy output"),
            std::string::npos)
      << md;
  EXPECT_NE(log.str().find("entropy: not compared (the trainer's backend x"), std::string::npos) << log.str();
}

// The seed's acceptance topology on in-process ranks: trainer TP=2 x CP=2, rollout at TP=1 and
// TP=2 (vocab-parallel serving entry, logits shards gathered for the sampler).
TEST(Harness, TrainerTpTimesCpAndATensorParallelRolloutStayExact) {
  for (int rollout_tp : {1, 2}) {
    g::HarnessConfig cfg = small_config();
    cfg.tp = 2;
    cfg.cp = 2;
    cfg.rollout_tp = rollout_tp;
    std::ostringstream log;
    const g::HarnessResult r = g::run_rollout_vs_trainer(cfg, log);
    ASSERT_TRUE(r.compared) << log.str();
    EXPECT_TRUE(r.exact) << log.str();
    EXPECT_EQ(r.metrics.mismatch_count, 0);
    EXPECT_EQ(r.metrics.k3_max, 0.0);
    EXPECT_TRUE(r.control_drift);
    EXPECT_NE(r.json.find("\"cp\": 2"), std::string::npos);
    EXPECT_NE(r.json.find("\"rollout_tp\": " + std::to_string(rollout_tp)), std::string::npos);
  }
}

TEST(Harness, MismatchedWeightFingerprintsAreReportedAndNotCompared) {
  g::HarnessConfig cfg = small_config();
  cfg.perturb_trainer_weight = true;
  std::ostringstream log;
  const g::HarnessResult r = g::run_rollout_vs_trainer(cfg, log);
  EXPECT_FALSE(r.compared);
  EXPECT_FALSE(r.exact);
  EXPECT_EQ(r.metrics.total, 0);
  EXPECT_NE(r.json.find("\"weight_fingerprints_match\": false"), std::string::npos);
  EXPECT_NE(r.json.find("not compared"), std::string::npos);
  EXPECT_NE(r.markdown.find("the logprobs were not compared"), std::string::npos);
  EXPECT_FALSE(r.entropy_compared);
  EXPECT_NE(r.json.find("\"entropy\": null"), std::string::npos);
}

}  // namespace

// End-to-end tests of the `detlogp` binary: each test runs it through the shell, checks the exit
// code and output, and reads its files back with the io layer.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "detlogp/fpops.hpp"
#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "io/sha256.hpp"
#include "test_random.hpp"

namespace {

namespace fs = std::filesystem;
using detlogp::io::ElementType;
using detlogp::io::HostTensor;
using detlogp::io::SafetensorsContents;

constexpr const char* kCpu = "cpu-linear-logp-contract-v1";

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// Runs `env <env> detlogp <args>` with DETLOGP_* variables of the calling environment removed,
// so the test controls them.
CliResult run_cli(const std::string& args, const std::string& env = "") {
  // Per test and process: ctest runs tests in parallel.
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::path(::testing::TempDir()) /
                       (std::string("detlogp_cli_capture_") + info->name() + "_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path out = dir / "stdout", err = dir / "stderr";
  const std::string command = "env -u DETLOGP_BACKEND -u DETLOGP_STRICT " + env + " '" + DETLOGP_CLI_PATH + "' " +
                              args + " >'" + out.string() + "' 2>'" + err.string() + "'";
  const int status = std::system(command.c_str());
  CliResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  fs::remove_all(dir);
  return r;
}

std::string sha_line(const std::string& out) {
  std::smatch m;
  const std::regex re("sha256\\(([a-z_|]+)\\): ([0-9a-f]{64})");
  return std::regex_search(out, m, re) ? m[1].str() + ":" + m[2].str() : "";
}

std::string sha_of(const std::string& out) {
  const std::string line = sha_line(out);
  return line.empty() ? "" : line.substr(line.find(':') + 1);
}

template <class T>
HostTensor tensor_of(ElementType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

template <class T>
std::vector<T> values_of(const HostTensor& t) {
  std::vector<T> v(t.bytes.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  return v;
}

// A small problem for file inputs: values uniform in [-1, 1) from the tests' RNG, scaled.
struct FileProblem {
  int64_t rows = 37, dim = 96, vocab = 300;
  std::vector<uint16_t> hidden, weight;
  std::vector<int32_t> targets;
  std::vector<float> bias, temperatures;

  FileProblem() {
    detlogp_test::Rng rng(12345);
    auto next = [&] { return rng.next_unit_float() * 2.0f - 1.0f; };
    for (int64_t i = 0; i < rows * dim; ++i) hidden.push_back(detlogp::fp::bf16_round(next() * 2.0f));
    for (int64_t i = 0; i < vocab * dim; ++i) weight.push_back(detlogp::fp::bf16_round(next() * 0.3f));
    for (int64_t n = 0; n < rows; ++n) targets.push_back(n == 5 ? -100 : static_cast<int32_t>((n * 7919) % vocab));
    for (int64_t v = 0; v < vocab; ++v) bias.push_back(next());
    for (int64_t n = 0; n < rows; ++n) temperatures.push_back(0.5f + static_cast<float>(n % 4) * 0.25f);
  }

  SafetensorsContents contents(bool with_bias, bool with_temperatures) const {
    SafetensorsContents c;
    c.add("hidden", tensor_of(ElementType::bf16, {rows, dim}, hidden));
    c.add("weight", tensor_of(ElementType::bf16, {vocab, dim}, weight));
    c.add("targets", tensor_of(ElementType::i32, {rows}, targets));
    if (with_bias) c.add("bias", tensor_of(ElementType::f32, {vocab}, bias));
    if (with_temperatures) c.add("temperature", tensor_of(ElementType::f32, {rows}, temperatures));
    return c;
  }

  detlogp::LinearLogpInputs inputs(bool with_bias, bool with_temperatures) const {
    detlogp::LinearLogpInputs in;
    in.hidden = detlogp::TensorView::matrix(hidden.data(), detlogp::DType::bf16, rows, dim);
    in.weight = detlogp::TensorView::matrix(weight.data(), detlogp::DType::bf16, vocab, dim);
    in.targets = detlogp::TensorView::vector(targets.data(), detlogp::DType::i32, rows);
    if (with_bias) in.bias = detlogp::TensorView::vector(bias.data(), detlogp::DType::f32, vocab);
    if (with_temperatures)
      in.temperature_rows = detlogp::TensorView::vector(temperatures.data(), detlogp::DType::f32, rows);
    return in;
  }
};

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    ASSERT_EQ(x, y) << what << "[" << i << "] differs: " << a[i] << " vs " << b[i];
  }
}

size_t entries_in(const fs::path& dir) {
  return static_cast<size_t>(std::distance(fs::directory_iterator(dir), fs::directory_iterator()));
}

// Each test gets a fresh directory, removed afterwards unless the test failed (kept to inspect).
class Cli : public ::testing::Test {
 protected:
  fs::path test_dir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           (std::string("detlogp_cli_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    return dir_;
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) fs::remove_all(dir_);
  }

 private:
  fs::path dir_;
};

TEST_F(Cli, HelpAndUsage) {
  CliResult r = run_cli("--help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("exit codes"), std::string::npos);
  for (const char* command : {"info", "run", "verify"}) {
    r = run_cli(std::string(command) + " --help");
    EXPECT_EQ(r.exit_code, 0) << command;
    EXPECT_NE(r.out.find(std::string("usage: detlogp ") + command), std::string::npos) << r.out;
  }
  r = run_cli("");
  EXPECT_EQ(r.exit_code, 2);
  r = run_cli("frobnicate");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown command 'frobnicate'"), std::string::npos) << r.err;
}

TEST_F(Cli, InfoListsContractConstantsBackendsAndProvenance) {
  const CliResult r = run_cli("info");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const std::string& needle :
       {std::string(detlogp::kContractName) + " v1", std::string(detlogp::kTreeId),
        std::string(detlogp::kTranscendentalId), std::string(kCpu), std::string("reference-materialized"),
        std::string("non-contract"), std::string("served by: "), std::string("provenance: contract=")}) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << "missing \"" << needle << "\" in:\n" << r.out;
  }
  EXPECT_TRUE(std::regex_search(r.out, std::regex("VOCAB_TILE +64\n"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("K_SLAB +32\n"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("CANONICAL_NAN +0x7fc00000\n"))) << r.out;
  const CliResult cpu = run_cli(std::string("info --strict --backend ") + kCpu);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  EXPECT_NE(cpu.out.find(std::string("served by: ") + kCpu), std::string::npos) << cpu.out;
}

TEST_F(Cli, RunPrintsTheSameShaTwice) {
  const CliResult a = run_cli("run"), b = run_cli("run");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_NE(a.out.find("N=64 D=1024 V_local=32000"), std::string::npos) << a.out;
  EXPECT_NE(a.out.find("rows/s"), std::string::npos) << a.out;
  EXPECT_FALSE(sha_of(a.out).empty()) << a.out;
  EXPECT_EQ(sha_line(a.out), sha_line(b.out));
}

// The synthetic generator is integer-only and the CPU contract fixes every rounding (bf16 products
// are exact in fp32), so this digest is the same on every machine. It changes only when the
// generator or the contract changes (a contract version bump).
TEST_F(Cli, SyntheticCpuDigestIsPinned) {
  const CliResult r = run_cli(std::string("run --rows 8 --dim 64 --vocab 200 --with-bias --backend ") + kCpu);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(sha_line(r.out), "logp|lse:63467a9bd8324a754566839fd5740b8de1edee9ddb02dfa0ce40c80322492089") << r.out;
}

TEST_F(Cli, PaddedVocabGivesTheSameDigest) {
  const std::string shape = std::string("run --rows 32 --dim 128 --backend ") + kCpu;
  const CliResult plain = run_cli(shape + " --vocab 1000");
  const CliResult padded = run_cli(shape + " --vocab 1088 --real-vocab 1000");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(padded.exit_code, 0) << padded.err;
  EXPECT_EQ(sha_line(plain.out), sha_line(padded.out));
  const CliResult repeated = run_cli(shape + " --vocab 1000 --repeat 3");
  ASSERT_EQ(repeated.exit_code, 0) << repeated.err;
  EXPECT_NE(repeated.out.find("best of 3"), std::string::npos);
  EXPECT_EQ(sha_line(plain.out), sha_line(repeated.out));
}

TEST_F(Cli, RunOutMatchesTheApiAndTheDigest) {
  const fs::path dir = test_dir();
  const FileProblem problem;
  detlogp::io::write_safetensors(dir / "in.safetensors", problem.contents(true, true));
  const CliResult r = run_cli("run --input '" + (dir / "in.safetensors").string() + "' --out '" +
                              (dir / "out.safetensors").string() + "' --return-logits --backend " + kCpu);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("entry: serving"), std::string::npos) << r.out;

  const SafetensorsContents file = detlogp::io::read_safetensors(dir / "out.safetensors");
  ASSERT_NE(file.find("logp"), nullptr);
  ASSERT_NE(file.find("lse"), nullptr);
  ASSERT_NE(file.find("logits"), nullptr);
  EXPECT_EQ(file.find("logits")->shape, (std::vector<int64_t>{problem.rows, problem.vocab}));
  EXPECT_EQ(file.metadata.at("format"), "detlogp-output-v1");

  std::vector<float> logp(static_cast<size_t>(problem.rows)), lse(logp.size());
  std::vector<float> logits(static_cast<size_t>(problem.rows * problem.vocab));
  detlogp::CallOptions opt;
  opt.backend = kCpu;
  detlogp::linear_logp(problem.inputs(true, true),
                       {detlogp::mutable_vector(logp.data(), detlogp::DType::f32, problem.rows),
                        detlogp::mutable_vector(lse.data(), detlogp::DType::f32, problem.rows),
                        detlogp::mutable_matrix(logits.data(), detlogp::DType::f32, problem.rows, problem.vocab)},
                       opt);
  expect_same_bits(values_of<float>(*file.find("logp")), logp, "logp");
  expect_same_bits(values_of<float>(*file.find("lse")), lse, "lse");
  expect_same_bits(values_of<float>(*file.find("logits")), logits, "logits");
  EXPECT_EQ(values_of<float>(*file.find("logp"))[5], 0.0f);  // ignored row

  // The printed digest is SHA-256 over logp, lse, logits bytes in that order.
  detlogp::io::Sha256 h;
  for (const char* name : {"logp", "lse", "logits"})
    h.update(file.find(name)->bytes.data(), file.find(name)->bytes.size());
  EXPECT_EQ(sha_line(r.out), "logp|lse|logits:" + detlogp::io::Sha256::hex(h.finish()));
  EXPECT_EQ(file.metadata.at("sha256"), sha_of(r.out));
  EXPECT_EQ(entries_in(dir), 2u);  // in + out, no temporary left behind
}

TEST_F(Cli, NpyInputsGiveTheSameDigestAsSafetensors) {
  const fs::path dir = test_dir();
  const FileProblem problem;
  const SafetensorsContents c = problem.contents(true, false);
  detlogp::io::write_safetensors(dir / "in.safetensors", c);
  for (const auto& t : c.tensors) detlogp::io::write_npy(dir / (t.name + ".npy"), t.tensor);
  const std::string common = std::string(" --temperature 0.7 --backend ") + kCpu;
  const CliResult st = run_cli("run --input '" + (dir / "in.safetensors").string() + "'" + common);
  const CliResult npy = run_cli("run --hidden '" + (dir / "hidden.npy").string() + "' --weight '" +
                                (dir / "weight.npy").string() + "' --targets '" + (dir / "targets.npy").string() +
                                "' --bias '" + (dir / "bias.npy").string() + "'" + common);
  ASSERT_EQ(st.exit_code, 0) << st.err;
  ASSERT_EQ(npy.exit_code, 0) << npy.err;
  EXPECT_EQ(sha_line(st.out), sha_line(npy.out));
  EXPECT_FALSE(sha_line(st.out).empty());
}

// Two vocabulary shards through the CLI, merged with merge_partials, equal the whole-vocab run.
// The PartialsLayout a detlogp-partials-v1 file records (docs/file-formats.md), as a reader rebuilds it.
detlogp::PartialsLayout layout_from_metadata(const std::map<std::string, std::string>& m) {
  detlogp::PartialsLayout l;
  l.vocab_start = std::stoll(m.at("vocab_start"));
  l.vocab_local = std::stoll(m.at("vocab_local"));
  l.real_vocab = std::stoll(m.at("real_vocab"));
  l.ignore_index = std::stoll(m.at("ignore_index"));
  l.targets_digest = std::stoull(m.at("targets_digest"), nullptr, 16);
  l.temperature_digest = std::stoull(m.at("temperature_digest"), nullptr, 16);
  l.backend_digest = std::stoull(m.at("backend_digest"), nullptr, 16);
  return l;
}

TEST_F(Cli, ShardPartialsMergeToTheFullResult) {
  const fs::path dir = test_dir();
  const FileProblem problem;
  const int64_t split = 192;  // a multiple of 64
  detlogp::io::write_safetensors(dir / "full.safetensors", problem.contents(true, false));
  SafetensorsContents shards[2];
  for (int s = 0; s < 2; ++s) {
    const int64_t begin = s == 0 ? 0 : split, end = s == 0 ? split : problem.vocab;
    shards[s].add("hidden", tensor_of(ElementType::bf16, {problem.rows, problem.dim}, problem.hidden));
    shards[s].add("weight", tensor_of(ElementType::bf16, {end - begin, problem.dim},
                                      std::vector<uint16_t>(problem.weight.begin() + begin * problem.dim,
                                                            problem.weight.begin() + end * problem.dim)));
    shards[s].add("targets", tensor_of(ElementType::i32, {problem.rows}, problem.targets));
    shards[s].add("bias", tensor_of(ElementType::f32, {end - begin},
                                    std::vector<float>(problem.bias.begin() + begin, problem.bias.begin() + end)));
    const std::string name = "shard" + std::to_string(s);
    detlogp::io::write_safetensors(dir / (name + ".safetensors"), shards[s]);
    const CliResult r =
        run_cli("run --input '" + (dir / (name + ".safetensors")).string() + "' --partials --vocab-start " +
                std::to_string(begin) + " --real-vocab " + std::to_string(problem.vocab) + " --out '" +
                (dir / (name + "_out.safetensors")).string() + "' --backend " + kCpu);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("entry: partials"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("sha256(tile_max|tile_sum|target_logit|target_owned)"), std::string::npos) << r.out;
  }
  const CliResult full = run_cli("run --input '" + (dir / "full.safetensors").string() + "' --out '" +
                                 (dir / "full_out.safetensors").string() + "' --backend " + kCpu);
  ASSERT_EQ(full.exit_code, 0) << full.err;

  std::vector<std::vector<detlogp::TileSummary>> summaries(2);
  std::vector<std::vector<float>> target_logit(2);
  std::vector<std::vector<uint8_t>> owned(2);
  std::vector<detlogp::ShardPartials> partials(2);
  for (int s = 0; s < 2; ++s) {
    const SafetensorsContents out =
        detlogp::io::read_safetensors(dir / ("shard" + std::to_string(s) + "_out.safetensors"));
    const HostTensor* tile_max = out.find("tile_max");
    ASSERT_NE(tile_max, nullptr);
    // The layout a merge checks travels with the partials.
    const std::map<std::string, std::string> layout = {
        {"format", "detlogp-partials-v2"},
        {"rows", std::to_string(problem.rows)},
        {"tiles", std::to_string(detlogp::shard_tiles(s == 0 ? split : problem.vocab - split))},
        {"vocab_start", s == 0 ? "0" : std::to_string(split)},
        {"vocab_local", std::to_string(s == 0 ? split : problem.vocab - split)},
        {"real_vocab", std::to_string(problem.vocab)},
        {"ignore_index", "-100"},
        {"backend", kCpu},
        {"contract", std::string(detlogp::kContractName) + " v" + std::to_string(detlogp::kContractVersion)},
    };
    for (const auto& [key, value] : layout) {
      ASSERT_EQ(out.metadata.count(key), 1u) << key;
      EXPECT_EQ(out.metadata.at(key), value) << key;
    }
    EXPECT_NE(out.metadata.at("provenance").find(std::string("backend=") + kCpu), std::string::npos);
    ASSERT_EQ(out.find("target_owned")->dtype, ElementType::u8);
    const int64_t tiles = tile_max->shape[1];
    EXPECT_EQ(tiles, detlogp::shard_tiles(s == 0 ? split : problem.vocab - split));
    const std::vector<float> maxes = values_of<float>(*tile_max), sums = values_of<float>(*out.find("tile_sum"));
    for (size_t i = 0; i < maxes.size(); ++i) summaries[s].push_back({maxes[i], sums[i]});
    target_logit[s] = values_of<float>(*out.find("target_logit"));
    owned[s] = values_of<uint8_t>(*out.find("target_owned"));
    partials[s].rows = problem.rows;
    partials[s].tiles = tiles;
    partials[s].summaries = summaries[s].data();
    partials[s].target_logit = target_logit[s].data();
    partials[s].target_owned = owned[s].data();
    partials[s].layout = layout_from_metadata(out.metadata);
  }
  std::vector<float> logp(static_cast<size_t>(problem.rows)), lse(logp.size());
  // The layout read back from the files is what the checked merge verifies: swapped shards and
  // other targets are refused, the files in rank order merge to the whole-vocabulary bits.
  const auto targets = detlogp::TensorView::vector(problem.targets.data(), detlogp::DType::i32, problem.rows);
  const auto logp_view = detlogp::mutable_vector(logp.data(), detlogp::DType::f32, problem.rows);
  const auto lse_view = detlogp::mutable_vector(lse.data(), detlogp::DType::f32, problem.rows);
  EXPECT_THROW(
      detlogp::merge_partials({partials[1], partials[0]}, targets, detlogp::kDefaultIgnoreIndex, logp_view, lse_view),
      detlogp::Error);
  std::vector<int32_t> other_targets = problem.targets;
  other_targets[0] = (other_targets[0] + 1) % static_cast<int32_t>(problem.vocab);
  EXPECT_THROW(detlogp::merge_partials(
                   partials, detlogp::TensorView::vector(other_targets.data(), detlogp::DType::i32, problem.rows),
                   detlogp::kDefaultIgnoreIndex, logp_view, lse_view),
               detlogp::Error);
  detlogp::merge_partials(partials, targets, detlogp::kDefaultIgnoreIndex, logp_view, lse_view);
  const SafetensorsContents full_out = detlogp::io::read_safetensors(dir / "full_out.safetensors");
  expect_same_bits(logp, values_of<float>(*full_out.find("logp")), "merged logp");
  expect_same_bits(lse, values_of<float>(*full_out.find("lse")), "merged lse");
}

// Every bad input: exit code 3, a message naming the problem, and nothing written (an existing
// output file keeps its old contents, no temporary file is left).
TEST_F(Cli, BadFilesExitNonZeroAndWriteNothing) {
  const fs::path dir = test_dir();
  const FileProblem problem;
  const std::vector<uint8_t> good = detlogp::io::serialize_safetensors(problem.contents(false, false));
  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string expected_error;
  };
  std::vector<Case> cases;
  cases.push_back({"truncated", std::vector<uint8_t>(good.begin(), good.end() - 10), "out of bounds"});
  cases.push_back({"tiny", {1, 2, 3}, "file too short"});
  std::vector<uint8_t> huge_header = good;
  huge_header[5] = 0x7F;
  cases.push_back({"header_length", huge_header, "is absurd"});
  std::vector<uint8_t> bad_json = good;
  bad_json[9] = '[';
  cases.push_back({"bad_json", bad_json, "not valid JSON"});
  auto with = [&](const std::function<void(SafetensorsContents&)>& edit) {
    SafetensorsContents c = problem.contents(false, false);
    edit(c);
    return detlogp::io::serialize_safetensors(c);
  };
  cases.push_back({"hidden_f32", with([&](SafetensorsContents& c) {
                     c.tensors[0].tensor = tensor_of(ElementType::f32, {problem.rows, problem.dim},
                                                     std::vector<float>(problem.rows * problem.dim));
                   }),
                   "hidden must be bf16, got f32"});  // the library's own check: the tensor reaches it
  cases.push_back({"targets_shape", with([&](SafetensorsContents& c) {
                     c.tensors[2].tensor =
                         tensor_of(ElementType::i32, {problem.rows - 1}, std::vector<int32_t>(problem.rows - 1));
                   }),
                   "tensor 'targets' must be [N=37]"});
  cases.push_back({"targets_f32", with([&](SafetensorsContents& c) {
                     c.tensors[2].tensor =
                         tensor_of(ElementType::f32, {problem.rows}, std::vector<float>(problem.rows));
                   }),
                   "targets must be i32 or i64, got f32"});
  // dtypes the library has no DType for: refused by the CLI in the library's sentence.
  cases.push_back({"hidden_f16", with([&](SafetensorsContents& c) {
                     c.tensors[0].tensor = tensor_of(ElementType::f16, {problem.rows, problem.dim},
                                                     std::vector<uint16_t>(problem.rows * problem.dim));
                   }),
                   "hidden must be bf16, got f16"});
  cases.push_back({"weight_bool", with([&](SafetensorsContents& c) {
                     c.tensors[1].tensor = tensor_of(ElementType::boolean, {problem.vocab, problem.dim},
                                                     std::vector<uint8_t>(problem.vocab * problem.dim));
                   }),
                   "weight must be bf16, got bool"});
  cases.push_back({"targets_u8", with([&](SafetensorsContents& c) {
                     c.tensors[2].tensor =
                         tensor_of(ElementType::u8, {problem.rows}, std::vector<uint8_t>(problem.rows));
                   }),
                   "targets must be i32 or i64, got u8"});
  cases.push_back({"bias_f64", with([&](SafetensorsContents& c) {
                     c.add("bias", tensor_of(ElementType::f64, {problem.vocab}, std::vector<double>(problem.vocab)));
                   }),
                   "bias must be f32, got f64"});
  cases.push_back({"weight_dim", with([&](SafetensorsContents& c) {
                     c.tensors[1].tensor = tensor_of(ElementType::bf16, {4, problem.dim - 1},
                                                     std::vector<uint16_t>(4 * (problem.dim - 1)));
                   }),
                   "has D=95 columns but 'hidden' has D=96"});
  cases.push_back({"missing_targets", with([&](SafetensorsContents& c) { c.tensors.pop_back(); }),
                   "lacks the required tensor 'targets'"});
  cases.push_back({"extra_tensor", with([&](SafetensorsContents& c) {
                     c.add("biass", tensor_of(ElementType::f32, {1}, std::vector<float>{0}));
                   }),
                   "unexpected tensor 'biass'"});
  cases.push_back({"target_out_of_range", with([&](SafetensorsContents& c) {
                     std::vector<int32_t> t = problem.targets;
                     t[3] = static_cast<int32_t>(problem.vocab);
                     c.tensors[2].tensor = tensor_of(ElementType::i32, {problem.rows}, t);
                   }),
                   "targets[3]=300"});

  for (const Case& c : cases) {
    const fs::path in = dir / (c.name + ".safetensors");
    std::ofstream(in, std::ios::binary)
        .write(reinterpret_cast<const char*>(c.bytes.data()), static_cast<std::streamsize>(c.bytes.size()));
    const fs::path out = dir / "result.safetensors";
    std::ofstream(out) << "previous contents";
    const size_t before = entries_in(dir);
    const CliResult r = run_cli("run --input '" + in.string() + "' --out '" + out.string() + "'");
    EXPECT_EQ(r.exit_code, 3) << c.name << ": " << r.out << r.err;
    EXPECT_NE(r.err.find(c.expected_error), std::string::npos)
        << c.name << ": stderr lacks \"" << c.expected_error << "\":\n"
        << r.err;
    EXPECT_EQ(r.out.find("wrote:"), std::string::npos) << c.name;
    EXPECT_EQ(slurp(out), "previous contents") << c.name;
    EXPECT_EQ(entries_in(dir), before) << c.name << ": a file was left behind";
  }

  // A missing input writes nothing either, and creates no directory for --out.
  const CliResult r = run_cli("run --input '" + (dir / "absent.safetensors").string() + "' --out '" +
                              (dir / "missing" / "x.safetensors").string() + "'");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.err.find("absent.safetensors': no such file"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir / "missing"));
}

TEST_F(Cli, BadOptionsAreUsageErrors) {
  const fs::path dir = test_dir();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"run --rows abc", "--rows=abc is not an integer"},
      {"run --rows 0x10", "is not an integer"},
      {"run --bogus", "unknown option '--bogus'"},
      {"run --temperature", "needs a value"},
      {"run --strict=1", "takes no value"},
      {"run --rows 4 --rows 5", "given twice"},
      {"run --out '" + (dir / "out.txt").string() + "'", "--out must name a .safetensors file"},
      {"run --input a.safetensors --hidden h.npy", "exclude each other"},
      {"run --hidden h.npy", "needs --hidden, --weight and --targets"},
      {"run --input a.safetensors --rows 3", "synthetic problem"},
      {"verify --dim -3", "out of range"},
      {"info extra", "unexpected argument 'extra'"},
  };
  for (const auto& [args, expected] : cases) {
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find(expected), std::string::npos) << args << ": stderr lacks \"" << expected << "\":\n" << r.err;
  }
  EXPECT_EQ(entries_in(dir), 0u);
  // Invalid values the API rejects are errors (3), not usage errors.
  const CliResult r = run_cli("run --rows 4 --dim 8 --vocab 64 --temperature -1");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("temperature=-1"), std::string::npos) << r.err;
  // A value float32 cannot hold is refused like that (exit 3), in the Python faces' words; one
  // that rounds to a finite float32 (a subnormal, a value beyond the double range) goes to the
  // library's range check.
  const std::vector<std::pair<std::string, std::string>> unrepresentable = {
      {"1e-50", "temperature=1e-50 is not representable as float32 (it would round to 0)"},
      {"-1e-46", "temperature=-1e-46 is not representable as float32 (it would round to 0)"},
      {"1e39", "temperature=1e+39 is not representable as float32 (it would round to inf)"},
      {"3.4028235677973366e38",
       "temperature=3.4028235677973366e+38 is not representable as float32 (it would round to inf)"},
      {"1e-40", "temperature=1e-40 is outside the temperature range"},
      {"3.4028235e38", "temperature=3.4028235e+38 is outside the temperature range"},
      {"1e400", "temperature=inf is outside the temperature range"},
      {"1e-400", "temperature=0 is outside the temperature range"},
  };
  for (const auto& [value, expected] : unrepresentable) {
    const CliResult t = run_cli("run --rows 4 --dim 8 --vocab 64 --temperature " + value);
    EXPECT_EQ(t.exit_code, 3) << value << ": " << t.err;
    EXPECT_NE(t.err.find(expected), std::string::npos) << value << ": stderr lacks \"" << expected << "\":\n" << t.err;
  }
  // A shard off the tile grid gives partials with its edge lanes.
  const CliResult shard = run_cli("run --rows 4 --dim 8 --vocab 64 --vocab-start 32 --real-vocab 128 --partials");
  EXPECT_EQ(shard.exit_code, 0) << shard.err;
  EXPECT_NE(shard.out.find("sha256(tile_max|tile_sum|target_logit|target_owned|edge_logits)"), std::string::npos)
      << shard.out;
}

TEST_F(Cli, VerifyPassesOnTheCpuBackend) {
  const CliResult r = run_cli(std::string("verify --strict --backend ") + kCpu);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("verdict: PASS"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  for (const char* check : {"L1 repeat", "L2 N=1 ", "L2 N=1000", "L2 permuted", "L2 duplicated", "serving == trainer",
                            "TP R=8", "padded vocab", "reduce_logits"}) {
    EXPECT_NE(r.out.find(check), std::string::npos) << check;
  }
}

TEST_F(Cli, StrictModeRefusesTheReferenceLane) {
  for (const char* command_text : {"run --rows 4 --dim 8 --vocab 64", "verify"}) {
    const std::string command = command_text;
    CliResult r = run_cli(command + " --strict --backend reference-materialized");
    EXPECT_EQ(r.exit_code, 3) << command << ": " << r.out << r.err;
    EXPECT_NE(r.err.find("strict mode refuses backend 'reference-materialized'"), std::string::npos) << r.err;
    r = run_cli(command + " --backend reference-materialized", "DETLOGP_STRICT=1");
    EXPECT_EQ(r.exit_code, 3) << command << ": " << r.out << r.err;
    EXPECT_NE(r.err.find("strict mode refuses"), std::string::npos) << r.err;
  }
  // Without strict mode the reference lane serves, and says so.
  const CliResult r = run_cli("run --rows 4 --dim 8 --vocab 64 --backend reference-materialized");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("backend: reference-materialized"), std::string::npos) << r.out;
}

TEST_F(Cli, FrozenConstantOverrideIsRefused) {
  const fs::path dir = test_dir();
  for (const char* command : {"run", "info", "verify"}) {
    const CliResult r = run_cli(
        std::string(command) +
            (std::string(command) == "run" ? " --out '" + (dir / "out.safetensors").string() + "'" : std::string()),
        "DETLOGP_VOCAB_TILE=128");
    EXPECT_EQ(r.exit_code, 3) << command << ": " << r.out << r.err;
    EXPECT_NE(r.err.find("DETLOGP_VOCAB_TILE=128"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("frozen"), std::string::npos) << r.err;
  }
  EXPECT_EQ(entries_in(dir), 0u);
  const CliResult unknown = run_cli("run --rows 2 --dim 8 --vocab 64", "DETLOGP_TYPO=1");
  EXPECT_EQ(unknown.exit_code, 3);
}

// A weight that is not the whole vocabulary from id 0 has no logp/lse of its own: without
// --partials the run is refused, naming the values; --partials needs the shard's place stated.
// --entropy adds the rows' entropy [N] f32 after the other outputs: the library's bits for the same
// problem, logp/lse unchanged.
TEST_F(Cli, EntropyIsWrittenBesideUnchangedLogpAndLse) {
  const fs::path dir = test_dir();
  const FileProblem problem;
  detlogp::io::write_safetensors(dir / "in.safetensors", problem.contents(true, true));
  const std::string base =
      "run --backend " + std::string(kCpu) + " --input '" + (dir / "in.safetensors").string() + "'";
  const CliResult plain = run_cli(base + " --out '" + (dir / "plain.safetensors").string() + "'");
  const CliResult with = run_cli(base + " --entropy --out '" + (dir / "with.safetensors").string() + "'");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(with.exit_code, 0) << with.err;
  EXPECT_NE(with.out.find("sha256(logp|lse|entropy)"), std::string::npos) << with.out;
  const SafetensorsContents a = detlogp::io::read_safetensors(dir / "plain.safetensors");
  const SafetensorsContents b = detlogp::io::read_safetensors(dir / "with.safetensors");
  expect_same_bits(values_of<float>(*a.find("logp")), values_of<float>(*b.find("logp")), "logp");
  expect_same_bits(values_of<float>(*a.find("lse")), values_of<float>(*b.find("lse")), "lse");
  ASSERT_NE(b.find("entropy"), nullptr);
  std::vector<float> logp(problem.rows), lse(problem.rows), entropy(problem.rows);
  detlogp::LinearLogpOutputs o{detlogp::mutable_vector(logp.data(), detlogp::DType::f32, problem.rows),
                               detlogp::mutable_vector(lse.data(), detlogp::DType::f32, problem.rows),
                               {},
                               detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, problem.rows)};
  detlogp::CallOptions opt;
  opt.backend = kCpu;
  detlogp::linear_logp(problem.inputs(true, true), o, opt);
  expect_same_bits(values_of<float>(*b.find("entropy")), entropy, "entropy");
}

// [N, K] targets give logp [N, K], and --topk K writes topk_ids [N, K] I64 and topk_logp [N, K] F32
// after the other outputs, with the library's bits (docs/contract.md §6, §11).
TEST_F(Cli, SeveralTargetsARowAndTopkAreWritten) {
  const fs::path dir = test_dir();
  const FileProblem problem;
  const int64_t k = 3;
  std::vector<int32_t> ids;
  for (int64_t n = 0; n < problem.rows; ++n)
    for (int64_t j = 0; j < k; ++j)
      ids.push_back(j == 0 ? problem.targets[n] : static_cast<int32_t>((n * 31 + j) % 300));
  SafetensorsContents c = problem.contents(true, true);
  SafetensorsContents multi;
  for (const char* name : {"hidden", "weight", "bias", "temperature"}) multi.add(name, *c.find(name));
  multi.add("targets", tensor_of(ElementType::i32, {problem.rows, k}, ids));
  detlogp::io::write_safetensors(dir / "multi.safetensors", multi);
  const CliResult r =
      run_cli("run --backend " + std::string(kCpu) + " --input '" + (dir / "multi.safetensors").string() +
              "' --topk 7 --out '" + (dir / "out.safetensors").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("sha256(logp|lse|topk_ids|topk_logp)"), std::string::npos) << r.out;
  const SafetensorsContents out = detlogp::io::read_safetensors(dir / "out.safetensors");
  ASSERT_NE(out.find("topk_ids"), nullptr);
  EXPECT_EQ(out.find("logp")->shape, (std::vector<int64_t>{problem.rows, k}));
  EXPECT_EQ(out.find("topk_ids")->shape, (std::vector<int64_t>{problem.rows, 7}));
  EXPECT_EQ(out.find("topk_logp")->shape, (std::vector<int64_t>{problem.rows, 7}));
  std::vector<float> logp(problem.rows * k), lse(problem.rows), topk_logp(problem.rows * 7);
  std::vector<int64_t> topk_ids(problem.rows * 7);
  detlogp::LinearLogpInputs in = problem.inputs(true, true);
  in.targets = detlogp::TensorView::matrix(ids.data(), detlogp::DType::i32, problem.rows, k);
  detlogp::LinearLogpOutputs o{detlogp::mutable_matrix(logp.data(), detlogp::DType::f32, problem.rows, k),
                               detlogp::mutable_vector(lse.data(), detlogp::DType::f32, problem.rows),
                               {},
                               {},
                               detlogp::mutable_matrix(topk_ids.data(), detlogp::DType::i64, problem.rows, 7),
                               detlogp::mutable_matrix(topk_logp.data(), detlogp::DType::f32, problem.rows, 7)};
  detlogp::CallOptions opt;
  opt.backend = kCpu;
  detlogp::linear_logp(in, o, opt);
  expect_same_bits(values_of<float>(*out.find("logp")), logp, "logp");
  expect_same_bits(values_of<float>(*out.find("topk_logp")), topk_logp, "topk_logp");
  EXPECT_EQ(values_of<int64_t>(*out.find("topk_ids")), topk_ids);
  const CliResult big = run_cli("run --backend " + std::string(kCpu) + " --rows 4 --dim 8 --vocab 64 --topk 129");
  EXPECT_EQ(big.exit_code, 3) << big.err;
  EXPECT_NE(big.err.find("topk=129 (topk_ids has K=129 columns) must be in [1, 128]"), std::string::npos) << big.err;
  // A K far beyond the range gets the same refusal, not an allocation of [N, K] buffers.
  for (const auto& [entry, message] :
       {std::pair<std::string, std::string>{"", "topk=100000000000 (topk_ids has K=100000000000 columns) must be in"},
        {" --partials --vocab-start 0 --real-vocab 64", "partials.topk=100000000000 must be in [0, 128]"}}) {
    const CliResult huge =
        run_cli("run --backend " + std::string(kCpu) + " --rows 4 --dim 8 --vocab 64 --topk 100000000000" + entry);
    EXPECT_EQ(huge.exit_code, 3) << huge.err;
    EXPECT_NE(huge.err.find(message), std::string::npos) << huge.err;
  }
}

// --partials --entropy adds the tiles' entropy sums (usums [N, tiles] F32) after the four partials
// tensors; two shards' files merged with merge_partials' entropy output give the whole-vocabulary
// --entropy bits, beside unchanged logp/lse.
TEST_F(Cli, ShardPartialsWithEntropyMergeToTheFullEntropy) {
  const fs::path dir = test_dir();
  const FileProblem problem;
  const int64_t split = 128;  // a multiple of 64
  detlogp::io::write_safetensors(dir / "full.safetensors", problem.contents(true, true));
  const CliResult full = run_cli("run --entropy --input '" + (dir / "full.safetensors").string() + "' --out '" +
                                 (dir / "full_out.safetensors").string() + "' --backend " + kCpu);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  std::vector<std::vector<detlogp::TileSummary>> summaries(2);
  std::vector<std::vector<float>> target_logit(2), usums(2);
  std::vector<std::vector<uint8_t>> owned(2);
  std::vector<detlogp::ShardPartials> partials(2);
  for (int s = 0; s < 2; ++s) {
    const int64_t begin = s == 0 ? 0 : split, end = s == 0 ? split : problem.vocab;
    SafetensorsContents shard;
    shard.add("hidden", tensor_of(ElementType::bf16, {problem.rows, problem.dim}, problem.hidden));
    shard.add("weight", tensor_of(ElementType::bf16, {end - begin, problem.dim},
                                  std::vector<uint16_t>(problem.weight.begin() + begin * problem.dim,
                                                        problem.weight.begin() + end * problem.dim)));
    shard.add("targets", tensor_of(ElementType::i32, {problem.rows}, problem.targets));
    shard.add("bias", tensor_of(ElementType::f32, {end - begin},
                                std::vector<float>(problem.bias.begin() + begin, problem.bias.begin() + end)));
    shard.add("temperature", tensor_of(ElementType::f32, {problem.rows}, problem.temperatures));
    const std::string name = "shard" + std::to_string(s);
    detlogp::io::write_safetensors(dir / (name + ".safetensors"), shard);
    const CliResult r =
        run_cli("run --entropy --input '" + (dir / (name + ".safetensors")).string() + "' --partials --vocab-start " +
                std::to_string(begin) + " --real-vocab " + std::to_string(problem.vocab) + " --out '" +
                (dir / (name + "_out.safetensors")).string() + "' --backend " + kCpu);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("sha256(tile_max|tile_sum|target_logit|target_owned|usums)"), std::string::npos) << r.out;
    const SafetensorsContents out = detlogp::io::read_safetensors(dir / (name + "_out.safetensors"));
    const HostTensor* u = out.find("usums");
    ASSERT_NE(u, nullptr);
    const int64_t tiles = detlogp::shard_tiles(end - begin);
    ASSERT_EQ(u->dtype, ElementType::f32);
    ASSERT_EQ(u->shape, (std::vector<int64_t>{problem.rows, tiles}));
    const std::vector<float> maxes = values_of<float>(*out.find("tile_max")),
                             sums = values_of<float>(*out.find("tile_sum"));
    for (size_t i = 0; i < maxes.size(); ++i) summaries[s].push_back({maxes[i], sums[i]});
    target_logit[s] = values_of<float>(*out.find("target_logit"));
    owned[s] = values_of<uint8_t>(*out.find("target_owned"));
    usums[s] = values_of<float>(*u);
    partials[s].rows = problem.rows;
    partials[s].tiles = tiles;
    partials[s].summaries = summaries[s].data();
    partials[s].target_logit = target_logit[s].data();
    partials[s].target_owned = owned[s].data();
    partials[s].usums = usums[s].data();
    partials[s].layout = layout_from_metadata(out.metadata);
  }
  std::vector<float> logp(static_cast<size_t>(problem.rows)), lse(logp.size()), entropy(logp.size());
  detlogp::merge_partials(
      partials, detlogp::TensorView::vector(problem.targets.data(), detlogp::DType::i32, problem.rows),
      detlogp::kDefaultIgnoreIndex, detlogp::mutable_vector(logp.data(), detlogp::DType::f32, problem.rows),
      detlogp::mutable_vector(lse.data(), detlogp::DType::f32, problem.rows),
      detlogp::mutable_vector(entropy.data(), detlogp::DType::f32, problem.rows));
  const SafetensorsContents full_out = detlogp::io::read_safetensors(dir / "full_out.safetensors");
  expect_same_bits(logp, values_of<float>(*full_out.find("logp")), "merged logp");
  expect_same_bits(lse, values_of<float>(*full_out.find("lse")), "merged lse");
  expect_same_bits(entropy, values_of<float>(*full_out.find("entropy")), "merged entropy");
}

TEST_F(Cli, VocabShardNeedsPartials) {
  const fs::path dir = test_dir();
  const std::string shape = std::string("run --rows 4 --dim 8 --vocab 64 --backend ") + kCpu;
  const std::string out = " --out '" + (dir / "out.safetensors").string() + "'";
  struct Case {
    std::string args;
    int exit_code;
    std::vector<std::string> needles;
  };
  const std::string kForms =
      "temperature must be a float, a 0-d floating array or a float32 array of shape [37], got shape ";
  const std::vector<Case> refused = {
      {" --real-vocab 128", 3, {"real_vocab=128", "V_local=64", "vocab_start=0", "pass --partials"}},
      {" --real-vocab 128 --return-logits", 3, {"real_vocab=128", "V_local=64", "pass --partials"}},
      {" --vocab-start 64 --real-vocab 128", 3, {"real_vocab=128", "V_local=64", "vocab_start=64", "pass --partials"}},
      {" --vocab-start 64", 3, {"vocab_start=64", "pass --partials"}},
      {" --partials --real-vocab 128", 2, {"--partials needs --vocab-start"}},
      {" --partials --vocab-start 0", 2, {"--partials needs --vocab-start", "--real-vocab"}},
      {" --partials --vocab-start 0 --real-vocab 128 --return-logits", 2, {"exclude each other"}},
  };
  for (const Case& c : refused) {
    const CliResult r = run_cli(shape + c.args + out);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.args << ": " << r.out << r.err;
    for (const std::string& needle : c.needles)
      EXPECT_NE(r.err.find(needle), std::string::npos) << c.args << ": stderr lacks \"" << needle << "\":\n" << r.err;
    EXPECT_EQ(r.out.find("sha256("), std::string::npos) << c.args;
  }
  EXPECT_EQ(entries_in(dir), 0u);

  const CliResult partials = run_cli(shape + " --partials --vocab-start 0 --real-vocab 128" + out);
  ASSERT_EQ(partials.exit_code, 0) << partials.err;
  EXPECT_NE(partials.out.find("entry: partials"), std::string::npos) << partials.out;
  const SafetensorsContents file = detlogp::io::read_safetensors(dir / "out.safetensors");
  EXPECT_EQ(file.find("logp"), nullptr);
  ASSERT_NE(file.find("tile_max"), nullptr);
  EXPECT_EQ(file.metadata.at("format"), "detlogp-partials-v2");
  EXPECT_EQ(file.metadata.at("real_vocab"), "128");
  EXPECT_EQ(file.metadata.at("vocab_local"), "64");
  // The whole vocabulary in one shard may still be asked for as partials (TP = 1).
  const CliResult whole = run_cli(shape + " --partials --vocab-start 0 --real-vocab 64");
  EXPECT_EQ(whole.exit_code, 0) << whole.err;
  EXPECT_NE(whole.out.find("sha256(tile_max|tile_sum|target_logit|target_owned)"), std::string::npos) << whole.out;
}

// The temperature tensor of an input file: [] F32 is the scalar, [N] F32 one per row; nothing is
// broadcast ([1] with N != 1 is refused like on every face) and other dtypes are refused by name.
TEST_F(Cli, TemperatureTensorFollowsTheSharedRules) {
  const fs::path dir = test_dir();
  const FileProblem problem;
  auto write_with = [&](const std::string& name, std::optional<HostTensor> temperature, int64_t rows) {
    SafetensorsContents c;
    c.add("hidden",
          tensor_of(ElementType::bf16, {rows, problem.dim},
                    std::vector<uint16_t>(problem.hidden.begin(), problem.hidden.begin() + rows * problem.dim)));
    c.add("weight", tensor_of(ElementType::bf16, {problem.vocab, problem.dim}, problem.weight));
    c.add("targets", tensor_of(ElementType::i32, {rows},
                               std::vector<int32_t>(problem.targets.begin(), problem.targets.begin() + rows)));
    if (temperature) c.add("temperature", std::move(*temperature));
    const fs::path path = dir / (name + ".safetensors");
    detlogp::io::write_safetensors(path, c);
    return "run --backend " + std::string(kCpu) + " --input '" + path.string() + "'";
  };
  const int64_t n = problem.rows;
  const std::string out = " --out '" + (dir / "out.safetensors").string() + "'";

  // [] F32 = the scalar flag; [1] with N = 1 = per row = the same bits.
  const CliResult flag = run_cli(write_with("none", std::nullopt, n) + " --temperature 0.7");
  const CliResult scalar = run_cli(write_with("scalar", tensor_of(ElementType::f32, {}, std::vector<float>{0.7f}), n));
  ASSERT_EQ(flag.exit_code, 0) << flag.err;
  ASSERT_EQ(scalar.exit_code, 0) << scalar.err;
  EXPECT_NE(scalar.out.find("temperature=0.7 "), std::string::npos) << scalar.out;
  EXPECT_EQ(sha_line(scalar.out), sha_line(flag.out));
  const CliResult one_flag = run_cli(write_with("one_none", std::nullopt, 1) + " --temperature 0.7");
  const CliResult one_row =
      run_cli(write_with("one_row", tensor_of(ElementType::f32, {1}, std::vector<float>{0.7f}), 1));
  ASSERT_EQ(one_flag.exit_code, 0) << one_flag.err;
  ASSERT_EQ(one_row.exit_code, 0) << one_row.err;
  EXPECT_NE(one_row.out.find("temperature=per-row"), std::string::npos) << one_row.out;
  EXPECT_EQ(sha_line(one_row.out), sha_line(one_flag.out));

  // A 0-d tensor of any floating dtype is the scalar, as the Python faces read one: F16 and BF16
  // widened exactly, F64 rounded to float32 like --temperature.
  const CliResult half_flag = run_cli(write_with("half_none", std::nullopt, n) + " --temperature 0.5");
  ASSERT_EQ(half_flag.exit_code, 0) << half_flag.err;
  const std::vector<std::pair<std::string, HostTensor>> scalars = {
      {"scalar_bf16", tensor_of(ElementType::bf16, {}, std::vector<uint16_t>{0x3f00})},  // 0.5
      {"scalar_f16", tensor_of(ElementType::f16, {}, std::vector<uint16_t>{0x3800})},    // 0.5
      {"scalar_f64", tensor_of(ElementType::f64, {}, std::vector<double>{0.5})},
  };
  for (const auto& [name, t] : scalars) {
    const CliResult r = run_cli(write_with(name, t, n));
    ASSERT_EQ(r.exit_code, 0) << name << ": " << r.err;
    EXPECT_EQ(sha_line(r.out), sha_line(half_flag.out)) << name;
  }
  const CliResult tiny_f64 =
      run_cli(write_with("scalar_f64_tiny", tensor_of(ElementType::f64, {}, std::vector<double>{1e-50}), n));
  EXPECT_EQ(tiny_f64.exit_code, 3) << tiny_f64.out;
  EXPECT_NE(tiny_f64.err.find("temperature=1e-50 is not representable as float32 (it would round to 0)"),
            std::string::npos)
      << tiny_f64.err;

  struct Case {
    std::string name;
    HostTensor temperature;
    std::vector<std::string> needles;
  };
  const std::string kForms =
      "temperature must be a float, a 0-d floating array or a float32 array of shape [37], got shape ";
  const std::vector<Case> refused = {
      {"broadcast",
       tensor_of(ElementType::f32, {1}, std::vector<float>{0.7f}),
       {kForms + "[1] dtype float32 (one value per row, no broadcast: pass a float for one temperature of every row)"}},
      {"short",
       tensor_of(ElementType::f32, {n - 1}, std::vector<float>(n - 1, 0.7f)),
       {kForms + "[36] dtype float32\n"}},
      {"rows_i32",
       tensor_of(ElementType::i32, {n}, std::vector<int32_t>(n, 1)),
       {"temperature of shape [37] must be float32, got int32 (no silent cast)"}},
      {"rows_u8",
       tensor_of(ElementType::u8, {n}, std::vector<uint8_t>(n, 1)),
       {"temperature of shape [37] must be float32, got uint8 (no silent cast)"}},
      {"rows_f64",
       tensor_of(ElementType::f64, {n}, std::vector<double>(n, 0.7)),
       {"temperature of shape [37] must be float32, got float64 (no silent cast)"}},
      {"rows_bf16",
       tensor_of(ElementType::bf16, {n}, std::vector<uint16_t>(n, 0x3f80)),
       {"temperature of shape [37] must be float32, got bfloat16 (no silent cast)"}},
      {"scalar_i32", tensor_of(ElementType::i32, {}, std::vector<int32_t>{1}), {kForms + "[] dtype int32"}},
      {"column",
       tensor_of(ElementType::f32, {n, 1}, std::vector<float>(n, 0.7f)),
       {kForms + "[37, 1] dtype float32\n"}},
      {"scalar_zero", tensor_of(ElementType::f32, {}, std::vector<float>{0.0f}), {"temperature=0"}},
  };
  for (const Case& c : refused) {
    const CliResult r = run_cli(write_with(c.name, c.temperature, n) + out);
    EXPECT_EQ(r.exit_code, 3) << c.name << ": " << r.out << r.err;
    for (const std::string& needle : c.needles)
      EXPECT_NE(r.err.find(needle), std::string::npos) << c.name << ": stderr lacks \"" << needle << "\":\n" << r.err;
    EXPECT_FALSE(fs::exists(dir / "out.safetensors")) << c.name;
  }

  // The .npy face of the same rule.
  const SafetensorsContents c = problem.contents(false, false);
  for (const auto& t : c.tensors) detlogp::io::write_npy(dir / (t.name + ".npy"), t.tensor);
  detlogp::io::write_npy(dir / "t1.npy", tensor_of(ElementType::f32, {1}, std::vector<float>{0.7f}));
  const CliResult npy = run_cli("run --hidden '" + (dir / "hidden.npy").string() + "' --weight '" +
                                (dir / "weight.npy").string() + "' --targets '" + (dir / "targets.npy").string() +
                                "' --temperatures '" + (dir / "t1.npy").string() + "'" + out);
  EXPECT_EQ(npy.exit_code, 3) << npy.out << npy.err;
  EXPECT_NE(npy.err.find(kForms + "[1] dtype float32 (one value per row"), std::string::npos) << npy.err;
  EXPECT_FALSE(fs::exists(dir / "out.safetensors"));
}

// A missing input is reported as missing, a directory as a directory, on every command that reads.
TEST_F(Cli, MissingInputsAreReportedAsMissing) {
  const fs::path dir = test_dir();
  const std::string absent = (dir / "absent.safetensors").string();
  fs::create_directories(dir / "folder.safetensors");
  const FileProblem problem;
  const SafetensorsContents c = problem.contents(false, false);
  for (const auto& t : c.tensors) detlogp::io::write_npy(dir / (t.name + ".npy"), t.tensor);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"run --input '" + absent + "'", "cannot read '" + absent + "': no such file"},
      {"run --input '" + (dir / "no" / "such" / "dir.safetensors").string() + "'", "no such file"},
      {"run --input '" + (dir / "folder.safetensors").string() + "'", "folder.safetensors': it is a directory"},
      {"run --hidden '" + (dir / "hidden.npy").string() + "' --weight '" + (dir / "absent.npy").string() +
           "' --targets '" + (dir / "targets.npy").string() + "'",
       "absent.npy': no such file"},
      {"harness l3-check --a '" + absent + "' --b '" + absent + "'", "absent.safetensors': no such file"},
      {"verify --golden --case tiny-v17 --golden-file '" + (dir / "folder.safetensors").string() + "'",
       "it is a directory"},
  };
  for (const auto& [args, expected] : cases) {
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.exit_code, 3) << args << ": " << r.out << r.err;
    EXPECT_NE(r.err.find(expected), std::string::npos) << args << ": stderr lacks \"" << expected << "\":\n" << r.err;
    EXPECT_EQ(r.err.find("not a regular file"), std::string::npos) << r.err;
  }
}

// Every command that writes a file creates the missing directories of its path (mkdir -p), after
// its work succeeded; a path that cannot become a file is refused before any work.
TEST_F(Cli, OutputDirectoriesAreCreated) {
  const fs::path dir = test_dir();
  const std::string small = std::string(" --backend ") + kCpu;
  CliResult r =
      run_cli("run --rows 2 --dim 8 --vocab 64 --out '" + (dir / "run" / "a" / "x.safetensors").string() + "'" + small);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(dir / "run" / "a" / "x.safetensors"));
  r = run_cli("harness l3 --side rollout --case tiny-v17 --out '" + (dir / "l3" / "a" / "r.safetensors").string() +
              "'" + small);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(dir / "l3" / "a" / "r.safetensors"));
  r = run_cli("harness l3-export --case tiny-v17 --dir '" + (dir / "export" / "a").string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(dir / "export" / "a" / "tiny-v17.safetensors"));
  r = run_cli("harness rollout-vs-trainer --seqs 2 --max-len 2 --d 64 --v 128 --tp 2 --out '" +
              (dir / "harness" / "a").string() + "'" + small);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::is_regular_file(dir / "harness" / "a" / "report.json"));
  EXPECT_TRUE(fs::is_regular_file(dir / "harness" / "a" / "report.md"));
  r = run_cli("verify --golden --record --case tiny-v17 --golden-file '" + (dir / "golden" / "a" / "f.tsv").string() +
              "'" + small);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::is_regular_file(dir / "golden" / "a" / "f.tsv"));

  // A failed run creates nothing; a path through a regular file is refused before the work.
  r = run_cli("run --rows 2 --dim 8 --vocab 64 --temperature -1 --out '" + (dir / "failed" / "x.safetensors").string() +
              "'" + small);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_FALSE(fs::exists(dir / "failed"));
  std::ofstream(dir / "plain") << "a file";
  for (const std::string& args :
       {"run --rows 2 --dim 8 --vocab 64 --out '" + (dir / "plain" / "x.safetensors").string() + "'" + small,
        "harness l3 --side rollout --case tiny-v17 --out '" + (dir / "plain" / "r.safetensors").string() + "'" + small,
        "harness l3-export --case tiny-v17 --dir '" + (dir / "plain" / "e").string() + "'"}) {
    r = run_cli(args);
    EXPECT_EQ(r.exit_code, 3) << args << ": " << r.out << r.err;
    EXPECT_NE(r.err.find("plain' is not a directory"), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(r.out.find("sha256("), std::string::npos) << args;
  }
}

// A sparse file: `header` then `prefix` bytes, the rest up to `size` a hole (no disk blocks).
// Returns false when the file system stored the hole as data (the test then cannot run cheaply).
bool write_sparse(const fs::path& path, const std::string& header, const std::vector<uint8_t>& prefix, uint64_t size) {
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    f.write(reinterpret_cast<const char*>(prefix.data()), static_cast<std::streamsize>(prefix.size()));
  }
  fs::resize_file(path, size);
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_blocks) * 512 < (uint64_t{64} << 20);
}

// Runs the CLI as this process's direct child (no shell in between) and returns its exit code
// and peak resident set size in bytes, from wait4's rusage of exactly that child.
std::pair<int, int64_t> run_cli_peak_rss(const std::vector<std::string>& args, const fs::path& log) {
  std::vector<std::string> argv_storage = {DETLOGP_CLI_PATH};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<char*> envp;  // the caller's environment without DETLOGP_* (the test sets the backend)
  for (char** e = environ; *e != nullptr; ++e)
    if (std::strncmp(*e, "DETLOGP_", 8) != 0) envp.push_back(*e);
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) return {-1, 0};
  int status = 0;
  struct rusage usage {};
  if (::wait4(pid, &status, 0, &usage) != pid) return {-1, 0};
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, static_cast<int64_t>(usage.ru_maxrss) * 1024};
}

// Inputs are used where they are mapped, not copied: the peak resident set of `detlogp run` on a
// 2 GiB weight stays within the input's size plus the outputs, the resident set of the same run on
// a one-tile weight (the binary and its libraries: the CUDA ones where the build links them) and a
// small fixed allowance (thread stacks, the CPU backend's panels). A reader that copies the file
// (or a tensor of it) needs twice the input.
TEST_F(Cli, PeakMemoryStaysWithinTheInputSize) {
  const fs::path dir = test_dir();
  const int64_t dim = 4096, vocab = 262144;  // weight: 2 GiB of bf16, every byte read by the GEMM
  const uint64_t weight_bytes = static_cast<uint64_t>(vocab * dim) * 2;
  const int64_t allowance = int64_t{64} << 20;
  const std::vector<uint16_t> hidden(static_cast<size_t>(dim), 0x3f80);  // bf16 1.0
  const std::vector<int64_t> targets = {12345};
  std::vector<uint8_t> prefix(sizeof(int64_t) + hidden.size() * 2);
  std::memcpy(prefix.data(), targets.data(), sizeof(int64_t));
  std::memcpy(prefix.data() + sizeof(int64_t), hidden.data(), hidden.size() * 2);

  // safetensors: targets, hidden, then the weight as a hole at the end.
  std::string json =
      "{\"targets\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]},"
      "\"hidden\":{\"dtype\":\"BF16\",\"shape\":[1," +
      std::to_string(dim) + "],\"data_offsets\":[8," + std::to_string(prefix.size()) +
      "]},\"weight\":{\"dtype\":\"BF16\",\"shape\":[" + std::to_string(vocab) + "," + std::to_string(dim) +
      "],\"data_offsets\":[" + std::to_string(prefix.size()) + "," + std::to_string(prefix.size() + weight_bytes) +
      "]}}";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string header(8, '\0');
  for (int i = 0; i < 8; ++i) header[static_cast<size_t>(i)] = static_cast<char>(json.size() >> (8 * i));
  header += json;
  const fs::path input = dir / "big.safetensors";
  const uint64_t input_bytes = header.size() + prefix.size() + weight_bytes;
  if (!write_sparse(input, header, prefix, input_bytes)) GTEST_SKIP() << "the file system does not keep holes";

  // .npy: the weight file alone is the hole; hidden and targets are small files. A quarter of the
  // rows keeps the test short and still shows a copy (512 MiB against the 64 MiB allowance).
  const fs::path weight_npy = dir / "weight.npy";
  const int64_t npy_vocab = vocab / 4;
  const uint64_t npy_weight_bytes = weight_bytes / 4;
  // The writer needs the data in memory, so the header of the [V, D] '<u2' array is made here.
  std::string dict = "{'descr': '<u2', 'fortran_order': False, 'shape': (" + std::to_string(npy_vocab) + ", " +
                     std::to_string(dim) + "), }";
  dict.append((64 - (10 + dict.size() + 1) % 64) % 64, ' ');
  dict += '\n';
  std::string npy = std::string("\x93NUMPY\x01\x00", 8);
  npy += static_cast<char>(dict.size() & 0xff);
  npy += static_cast<char>(dict.size() >> 8);
  npy += dict;
  ASSERT_TRUE(write_sparse(weight_npy, npy, {}, npy.size() + npy_weight_bytes));
  detlogp::io::write_npy(dir / "hidden.npy", tensor_of(ElementType::bf16, {1, dim}, hidden));
  detlogp::io::write_npy(dir / "targets.npy", tensor_of(ElementType::i64, {1}, targets));
  const uint64_t npy_bytes =
      fs::file_size(weight_npy) + fs::file_size(dir / "hidden.npy") + fs::file_size(dir / "targets.npy");

  // The baseline: the same run on a 64-row weight.
  SafetensorsContents small;
  small.add("targets", tensor_of(ElementType::i64, {1}, std::vector<int64_t>{12}));
  small.add("hidden", tensor_of(ElementType::bf16, {1, dim}, hidden));
  small.add("weight", tensor_of(ElementType::bf16, {64, dim}, std::vector<uint16_t>(static_cast<size_t>(64 * dim), 0)));
  detlogp::io::write_safetensors(dir / "small.safetensors", small);
  const auto [small_exit, baseline] =
      run_cli_peak_rss({"run", "--backend", kCpu, "--input", (dir / "small.safetensors").string()}, dir / "log");
  ASSERT_EQ(small_exit, 0) << slurp(dir / "log");

  const std::vector<std::pair<std::vector<std::string>, uint64_t>> runs = {
      {{"--input", input.string()}, input_bytes},
      {{"--hidden", (dir / "hidden.npy").string(), "--weight", weight_npy.string(), "--targets",
        (dir / "targets.npy").string()},
       npy_bytes},
  };
  for (const auto& [inputs, bytes_in] : runs) {
    std::vector<std::string> args = {"run", "--backend", kCpu, "--out", (dir / "out.safetensors").string()};
    args.insert(args.end(), inputs.begin(), inputs.end());
    const auto [exit_code, peak] = run_cli_peak_rss(args, dir / "log");
    ASSERT_EQ(exit_code, 0) << inputs[0] << ":\n" << slurp(dir / "log");
    const int64_t outputs = 2 * sizeof(float);  // logp and lse of one row
    EXPECT_GT(peak, 0) << inputs[0];
    EXPECT_LE(peak, baseline + static_cast<int64_t>(bytes_in) + outputs + allowance)
        << inputs[0] << ": peak RSS " << (peak >> 20) << " MiB for " << (bytes_in >> 20)
        << " MiB of input, where a one-tile run peaks at " << (baseline >> 20) << " MiB";
    EXPECT_NE(slurp(dir / "log").find("sha256(logp|lse)"), std::string::npos) << slurp(dir / "log");
    fs::remove(dir / "out.safetensors");
  }
}

}  // namespace

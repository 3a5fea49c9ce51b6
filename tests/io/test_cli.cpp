// End-to-end tests of the `detlogp` binary: each test runs it through the shell, checks the exit
// code and output, and reads its files back with the io layer.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "detlogp/fpops.hpp"
#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "io/sha256.hpp"
#include "test_random.hpp"
#include "tp/tp_merge.hpp"

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
    const CliResult r = run_cli("run --input '" + (dir / (name + ".safetensors")).string() + "' --vocab-start " +
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
  }
  std::vector<float> logp(static_cast<size_t>(problem.rows)), lse(logp.size());
  // The partials files carry no PartialsLayout, which merge_partials requires: merge them with the
  // protocol's unchecked merge.
  detlogp::tp::merge_owned(
      partials, detlogp::TensorView::vector(problem.targets.data(), detlogp::DType::i32, problem.rows),
      detlogp::kDefaultIgnoreIndex, detlogp::mutable_vector(logp.data(), detlogp::DType::f32, problem.rows),
      detlogp::mutable_vector(lse.data(), detlogp::DType::f32, problem.rows), nullptr);
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
                     c.tensors[0].tensor = tensor_of(ElementType::f32, {problem.rows, problem.dim / 2},
                                                     std::vector<float>(problem.rows * problem.dim / 2));
                   }),
                   "tensor 'hidden' must be BF16, got F32"});
  cases.push_back({"targets_shape", with([&](SafetensorsContents& c) {
                     c.tensors[2].tensor =
                         tensor_of(ElementType::i32, {problem.rows - 1}, std::vector<int32_t>(problem.rows - 1));
                   }),
                   "tensor 'targets' must be [N=37]"});
  cases.push_back({"targets_f32", with([&](SafetensorsContents& c) {
                     c.tensors[2].tensor =
                         tensor_of(ElementType::f32, {problem.rows}, std::vector<float>(problem.rows));
                   }),
                   "tensor 'targets' must be I32 or I64, got F32"});
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

  // A missing input, and an output into a missing directory, write nothing either.
  CliResult r = run_cli("run --input '" + (dir / "absent.safetensors").string() + "' --out '" +
                        (dir / "x.safetensors").string() + "'");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.err.find("absent.safetensors"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir / "x.safetensors"));
  r = run_cli("run --rows 2 --dim 8 --vocab 64 --out '" + (dir / "missing" / "x.safetensors").string() + "'");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
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
      {"run --rows 4 --dim 8 --vocab 64 --real-vocab 128 --return-logits",
       "--return-logits needs the whole vocabulary"},
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
  const CliResult shard = run_cli("run --rows 4 --dim 8 --vocab 64 --vocab-start 32 --real-vocab 128");
  EXPECT_EQ(shard.exit_code, 3) << shard.err;
  EXPECT_NE(shard.err.find("vocab_start=32"), std::string::npos) << shard.err;
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

}  // namespace

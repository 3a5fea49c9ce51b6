// A problem in host memory: the CLI's built-in synthetic problems (docs/cli.md) and problems read
// from a safetensors file or from .npy files.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "detlogp/hash.hpp"
#include "io/file.hpp"
#include "io/host_tensor.hpp"

namespace detlogp::cli {

// The built-in problems' generator, identical on every platform: SplitMix64 (integer ops only) on
// the state seed * kSplitMixGamma ^ stream, and bf16 values made by integer sums, one fp32
// multiply and round-to-nearest-even on the bits. No std::*_distribution, whose algorithms differ
// between standard libraries.
class ProblemRng {
 public:
  ProblemRng(uint64_t seed, uint64_t stream) : rng_(seed * kSplitMixGamma ^ stream) {}
  uint64_t next() { return rng_.next(); }
  // Bell-shaped value with standard deviation ~1: the sum of four 16-bit uniforms, centered.
  float bell();

 private:
  SplitMix64 rng_;
};

// Stream tags keep tensors independent: the first V rows of the weight are the same whatever V.
constexpr uint64_t kStreamHidden = 1, kStreamWeight = 2, kStreamTargets = 3, kStreamBias = 4, kStreamVerify = 6;

// `count` values bf16(bell * scale) from one stream.
std::vector<uint16_t> random_bf16(uint64_t seed, uint64_t stream, int64_t count, float scale);

// The tensors of a problem as the library reads them: views into `storage`, which holds the
// mapped input files or the generated vectors. Copying a HostProblem shares the storage.
struct HostProblem {
  std::string source;  // for the summary
  int64_t rows = 0, dim = 0, vocab_local = 0;
  TensorView hidden, weight, targets, bias;  // bias absent: data == nullptr
  TensorView temperature_rows;               // absent: the scalar temperature
  float temperature = 1.0f;
  bool temperature_from_input = false;  // the input file carried a 'temperature' tensor
  int64_t real_vocab = -1;
  int64_t vocab_start = 0;
  int64_t ignore_index = kDefaultIgnoreIndex;
  std::vector<std::shared_ptr<const void>> storage;

  LinearLogpInputs inputs() const;
  int64_t effective_real_vocab() const { return real_vocab < 0 ? vocab_start + vocab_local : real_vocab; }
};

// The synthetic problem's tensors: hidden ~ bell * 1, weight ~ bell * 0.1 (logits of standard
// deviation ~3 at D=1024), targets uniform over the real vocabulary (V when real_vocab < 0),
// every 16th row (n % 16 == 15) ignored, optional bias ~ bell * 0.5.
struct SyntheticTensors {
  std::vector<uint16_t> hidden, weight;
  std::vector<int64_t> targets;
  std::vector<float> bias;  // empty: none
};
SyntheticTensors synthetic_tensors(uint64_t seed, int64_t rows, int64_t dim, int64_t vocab, int64_t real_vocab,
                                   int64_t ignore_index, bool with_bias);

// The same as a problem (real_vocab and ignore_index set as given).
HostProblem synthetic_problem(uint64_t seed, int64_t rows, int64_t dim, int64_t vocab, int64_t real_vocab,
                              int64_t ignore_index, bool with_bias);

// The named input tensors (from one safetensors file or several .npy files): views into the
// mapped files, which `files` keeps alive.
struct NamedInputs {
  std::map<std::string, std::pair<std::string, io::TensorRef>> tensors;  // name -> (file, tensor)
  std::vector<std::shared_ptr<const io::MappedFile>> files;
};

NamedInputs inputs_from_safetensors(const std::string& path);
// name -> .npy path, for the names given.
NamedInputs inputs_from_npy(const std::map<std::string, std::string>& paths);

// hidden, weight, targets, optional bias and temperature, their shapes checked with messages that
// name the file and the tensor; their dtypes go to the library, which refuses a wrong one (one it
// has no DType for, such as F16, is refused here in its words). A temperature tensor follows the
// Python faces' rules and words: shape [] F32 is the scalar, [N] F32 temperature_rows. The tensors
// stay where the files are mapped; only one whose data is not aligned to its element size is copied.
HostProblem problem_from_inputs(const NamedInputs& in);

// A temperature given in double precision (--temperature, a 0-d F64 tensor) as float32, refused in
// the Python faces' words where the rounding itself would make it 0 or inf.
float float32_temperature(double t);

}  // namespace detlogp::cli

// A problem in host memory: the CLI's built-in synthetic problems (docs/cli.md) and problems read
// from a safetensors file or from .npy files.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "detlogp/hash.hpp"
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

struct HostProblem {
  std::string source;  // for the summary
  int64_t rows = 0, dim = 0, vocab_local = 0;
  std::vector<uint16_t> hidden, weight;
  std::vector<int64_t> targets;
  std::vector<float> bias;              // empty: none
  std::vector<float> temperature_rows;  // empty: scalar temperature
  float temperature = 1.0f;
  bool temperature_from_input = false;  // the input file carried a 'temperature' tensor
  int64_t real_vocab = -1;
  int64_t vocab_start = 0;
  int64_t ignore_index = kDefaultIgnoreIndex;

  LinearLogpInputs inputs() const;
  int64_t effective_real_vocab() const { return real_vocab < 0 ? vocab_start + vocab_local : real_vocab; }
};

// Synthetic problem: hidden ~ bell * 1, weight ~ bell * 0.1 (logits of standard deviation ~3 at
// D=1024), targets uniform over the real vocabulary, every 16th row (n % 16 == 15) ignored.
HostProblem synthetic_problem(uint64_t seed, int64_t rows, int64_t dim, int64_t vocab, int64_t real_vocab,
                              int64_t ignore_index, bool with_bias);

// The named input tensors (from one safetensors file or several .npy files).
struct NamedInputs {
  std::map<std::string, std::pair<std::string, io::HostTensor>> tensors;  // name -> (file, tensor)
};

NamedInputs inputs_from_safetensors(const std::string& path);

// hidden, weight, targets, optional bias and temperature, checked for dtype and shape with
// messages that name the file and the tensor.
HostProblem problem_from_inputs(const NamedInputs& in);

}  // namespace detlogp::cli

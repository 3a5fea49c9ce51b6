// The proof of the wgmma model on an SM90 GPU (docs/contract.md §3.1.1): generated inputs through
// the SM90 backend's serving entry (fp32 logits from the tensor cores) and through
// cpu-sm90-emulated-contract-v1 (the model, multithreaded on this machine's CPUs), compared
// element by element; also the logp, lse and entropy bits, and a sample of elements against the
// model's scalar definition (wgmma::dot). Prints a table of elements compared and differing per
// case, lists every differing element (row, column, model bits, hardware bits, a summary of its
// inputs) and writes them to OUT/wgmma_proof.csv (OUT/wgmma_proof_cases.csv: the table;
// OUT/wgmma_diff_inputs.txt: the operands of the first differing elements, as bf16 hex).
//
//   sm90_wgmma_proof [--quick] [--logits N] [--dims 64,384,...] [--out DIR] [--seed S] [--cpu-only]
//
// --logits: the total number of logits over all cases (default 1e8; --quick: 1e7). Without a
// usable SM90 GPU it says why and exits 0, unless --cpu-only, which runs the generation and the
// model alone (timing, no comparison). Exit 1 when any element differs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "detlogp/fpops.hpp"
#include "detlogp/wgmma_model.hpp"
#include "test_random.hpp"

namespace {

using detlogp_test::Rng;
namespace wgmma = detlogp::wgmma;
namespace fp = detlogp::fp;

constexpr const char* kSm90Id = "cuda-fused-linear-logp-sm90-contract-v1";
constexpr const char* kModelId = "cpu-sm90-emulated-contract-v1";

uint16_t bf16_bits(float x) { return fp::bf16_round(x); }
float bf16_value(uint16_t b) { return fp::bf16_to_float(b); }

// A bf16 of exponent e (clamped to the normal range, or a subnormal below it), random significand
// and sign.
uint16_t bf16_at(Rng& rng, int e) {
  const uint32_t sign = rng.below(2) ? 0x8000u : 0u;
  if (e < -126) return static_cast<uint16_t>(sign | static_cast<uint32_t>(1 + rng.below(127)));
  e = std::min(e, 127);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(e + 127) << 7) | static_cast<uint32_t>(rng.below(128)));
}

uint16_t normal_bf16(Rng& rng, double stddev) { return bf16_bits(static_cast<float>(rng.normal() * stddev)); }

// One generated case: hidden [rows][dim], weight [vocab][dim], optional bias, targets,
// temperatures per row.
struct Case {
  std::string name;
  int64_t dim = 0, rows = 0, vocab = 0;
  std::vector<uint16_t> hidden, weight;
  std::vector<float> bias, temperatures;
  std::vector<int64_t> targets;
};

// The input kinds. Each fills a case's hidden rows and weight rows; `kind_of_row` / `kind_of_col`
// describe element (n, v) in the listing.
struct Kind {
  const char* name;
  bool bias;
  std::function<void(Case&, Rng&)> fill;
};

void fill_random(Case& c, Rng& rng) {
  for (auto& h : c.hidden) h = normal_bf16(rng, 1.0);
  const double s = 2.0 / std::sqrt(static_cast<double>(c.dim));
  for (auto& w : c.weight) w = normal_bf16(rng, s);
}

// Random, then every 4th row is a weight row (times 4): one dominant logit per such row.
void fill_peaked(Case& c, Rng& rng) {
  fill_random(c, rng);
  for (int64_t n = 0; n < c.rows; n += 4) {
    const int64_t v = rng.below(c.vocab);
    for (int64_t k = 0; k < c.dim; ++k)
      c.hidden[n * c.dim + k] = bf16_bits(4.0f * bf16_value(c.weight[v * c.dim + k]) * std::sqrt(float(c.dim)));
    c.targets[n] = v;
  }
}

// Exponents spread over [-60, 60] per element: huge and tiny products in every block.
void fill_mixed_exponents(Case& c, Rng& rng) {
  for (auto& h : c.hidden) h = bf16_at(rng, static_cast<int>(rng.below(61)) - 30);
  for (auto& w : c.weight) w = bf16_at(rng, static_cast<int>(rng.below(61)) - 30);
}

// Pairs of equal and opposite products (cancel exactly), with a survivor per block placed at a
// random distance below the block's largest exponent: exercises cancellation and the window's
// last bits.
void fill_cancellation(Case& c, Rng& rng) {
  for (int64_t n = 0; n < c.rows; ++n)
    for (int64_t k = 0; k < c.dim; ++k)
      c.hidden[n * c.dim + k] = k % 2 ? c.hidden[n * c.dim + k - 1] : bf16_at(rng, static_cast<int>(rng.below(9)) - 4);
  for (int64_t v = 0; v < c.vocab; ++v)
    for (int64_t k = 0; k < c.dim; ++k) {
      uint16_t& w = c.weight[v * c.dim + k];
      if (k % 2 == 0) {
        w = bf16_at(rng, static_cast<int>(rng.below(9)) - 4);
      } else if (rng.below(8) == 0) {
        w = bf16_at(rng, -static_cast<int>(rng.below(34)));  // a survivor, 0 to 33 binades down
      } else {
        w = c.weight[v * c.dim + k - 1] ^ 0x8000u;  // cancels the previous product exactly
      }
    }
}

// Per block one large product at 2^e and the rest between 2^(e - 20) and 2^(e - 30): many terms
// at the window's edge (its last bit is 2^(E - 25)), signs random.
void fill_window_edge(Case& c, Rng& rng) {
  for (auto& h : c.hidden) h = bf16_at(rng, static_cast<int>(rng.below(3)) - 1);
  for (int64_t v = 0; v < c.vocab; ++v)
    for (int64_t k = 0; k < c.dim; ++k)
      c.weight[v * c.dim + k] =
          bf16_at(rng, k % 16 == static_cast<int64_t>(v % 16) ? 0 : -20 - static_cast<int>(rng.below(11)));
}

// Products near and below fp32's subnormal range, bf16 subnormal operands, and the block
// exponent's floor (products of 2^-150 .. 2^-162).
void fill_subnormal(Case& c, Rng& rng) {
  // Row n sits 3 (n % 10) binades lower: results from normal down to subnormal and zero.
  for (int64_t n = 0; n < c.rows; ++n)
    for (int64_t k = 0; k < c.dim; ++k)
      c.hidden[n * c.dim + k] = bf16_at(rng, -60 - 3 * static_cast<int>(n % 10) - static_cast<int>(rng.below(12)));
  for (int64_t v = 0; v < c.vocab; ++v)
    for (int64_t k = 0; k < c.dim; ++k) {
      const int64_t kind = (v + k) % 4;
      c.weight[v * c.dim + k] = kind == 0   ? bf16_at(rng, -134)  // subnormal bf16
                                : kind == 1 ? bf16_at(rng, -70 - static_cast<int>(rng.below(14)))
                                            : bf16_at(rng, -60 - static_cast<int>(rng.below(30)));
    }
}

// Products near fp32's overflow: some rows overflow to +-inf, some cancel above FLT_MAX.
void fill_overflow(Case& c, Rng& rng) {
  for (int64_t n = 0; n < c.rows; ++n)
    for (int64_t k = 0; k < c.dim; ++k)
      c.hidden[n * c.dim + k] = bf16_at(rng, 54 + 2 * static_cast<int>(n % 5) + static_cast<int>(rng.below(8)));
  for (auto& w : c.weight) w = bf16_at(rng, 52 + static_cast<int>(rng.below(8)));
}

// The accumulator against the products: blocks alternate between large and small magnitudes, so
// the running sum is truncated by a later block's exponent and itself truncates the next block.
void fill_accumulator(Case& c, Rng& rng) {
  for (auto& h : c.hidden) h = bf16_at(rng, static_cast<int>(rng.below(3)) - 1);
  for (int64_t v = 0; v < c.vocab; ++v)
    for (int64_t k = 0; k < c.dim; ++k) {
      const int64_t block = k / 16;
      const int e = block % 3 == 0 ? 12 : block % 3 == 1 ? -14 - static_cast<int>(rng.below(4)) : 0;
      c.weight[v * c.dim + k] = bf16_at(rng, e);
    }
}

// Random rows with signed zeros everywhere (a fifth of the operands +-0), a few infinities and
// NaNs in some rows and columns, and rows that are all -0.
void fill_specials(Case& c, Rng& rng) {
  fill_random(c, rng);
  for (auto& h : c.hidden)
    if (rng.below(5) == 0) h = rng.below(2) ? 0x8000u : 0u;
  for (auto& w : c.weight)
    if (rng.below(5) == 0) w = rng.below(2) ? 0x8000u : 0u;
  for (int64_t n = 0; n < c.rows; ++n) {
    uint16_t* h = c.hidden.data() + n * c.dim;
    if (n % 17 == 1) h[rng.below(c.dim)] = 0x7F80u;               // +inf
    if (n % 17 == 2) h[rng.below(c.dim)] = 0xFF80u;               // -inf
    if (n % 17 == 3) h[rng.below(c.dim)] = 0x7FC0u;               // NaN
    if (n % 17 == 4) std::fill(h, h + c.dim, uint16_t{0x8000u});  // all -0
  }
  for (int64_t v = 0; v < c.vocab; v += 61) c.weight[v * c.dim + rng.below(c.dim)] = 0x7F80u;
  for (int64_t v = 29; v < c.vocab; v += 97) c.weight[v * c.dim + rng.below(c.dim)] = 0xFFC1u;
  for (int64_t v = 13; v < c.vocab; v += 89) c.weight[v * c.dim + rng.below(c.dim)] = 0x0000u;
}

const std::vector<Kind>& kinds() {
  static const std::vector<Kind> k = {
      {"random", false, fill_random},
      {"random+bias", true, fill_random},
      {"peaked", false, fill_peaked},
      {"peaked+bias", true, fill_peaked},
      {"mixed-exponents", false, fill_mixed_exponents},
      {"cancellation", false, fill_cancellation},
      {"window-edge", false, fill_window_edge},
      {"subnormal", false, fill_subnormal},
      {"overflow", true, fill_overflow},
      {"accumulator", false, fill_accumulator},
      {"specials", true, fill_specials},
  };
  return k;
}

Case make_case(const Kind& kind, int64_t dim, int64_t logits, uint64_t seed) {
  Case c;
  c.name = kind.name;
  c.dim = dim;
  c.vocab = std::max<int64_t>(64, std::min<int64_t>(4099, logits / 8));  // a vocabulary that ends mid-tile
  c.rows = std::max<int64_t>(1, (logits + c.vocab - 1) / c.vocab);
  Rng rng(seed);
  c.hidden.assign(static_cast<size_t>(c.rows * dim), 0);
  c.weight.assign(static_cast<size_t>(c.vocab * dim), 0);
  c.targets.resize(static_cast<size_t>(c.rows));
  for (auto& t : c.targets) t = rng.below(c.vocab);
  c.temperatures.resize(static_cast<size_t>(c.rows));
  static const float kT[] = {1.0f, 1.0f, 0.7f, 1.3f};
  for (auto& t : c.temperatures) t = kT[rng.below(4)];
  kind.fill(c, rng);
  if (kind.bias) {
    c.bias.resize(static_cast<size_t>(c.vocab));
    for (auto& b : c.bias) b = static_cast<float>(rng.normal() * 0.5);
  }
  return c;
}

struct Result {
  std::vector<float> logits, logp, lse, entropy;
  double seconds = 0;
};

Result run(const Case& c, const char* backend, bool entropy) {
  Result r;
  r.logits.assign(static_cast<size_t>(c.rows * c.vocab), 0.0f);
  r.logp.assign(static_cast<size_t>(c.rows), 0.0f);
  r.lse = r.logp;
  r.entropy = r.logp;
  detlogp::LinearLogpInputs in;
  in.hidden = detlogp::TensorView::matrix(c.hidden.data(), detlogp::DType::bf16, c.rows, c.dim);
  in.weight = detlogp::TensorView::matrix(c.weight.data(), detlogp::DType::bf16, c.vocab, c.dim);
  if (!c.bias.empty()) in.bias = detlogp::TensorView::vector(c.bias.data(), detlogp::DType::f32, c.vocab);
  in.targets = detlogp::TensorView::vector(c.targets.data(), detlogp::DType::i64, c.rows);
  in.temperature_rows = detlogp::TensorView::vector(c.temperatures.data(), detlogp::DType::f32, c.rows);
  in.real_vocab = c.vocab;
  detlogp::LinearLogpOutputs out;
  out.logits = detlogp::mutable_matrix(r.logits.data(), detlogp::DType::f32, c.rows, c.vocab);
  out.logp = detlogp::mutable_vector(r.logp.data(), detlogp::DType::f32, c.rows);
  out.lse = detlogp::mutable_vector(r.lse.data(), detlogp::DType::f32, c.rows);
  if (entropy) out.entropy = detlogp::mutable_vector(r.entropy.data(), detlogp::DType::f32, c.rows);
  detlogp::CallOptions opt;
  opt.backend = backend;
  opt.strict = true;
  const auto t0 = std::chrono::steady_clock::now();
  detlogp::linear_logp(in, out, opt);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::string hex32(uint32_t u) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08X", u);
  return b;
}

std::string hexfloat(double x) {
  char b[48];
  std::snprintf(b, sizeof b, "%a", x);
  return b;
}

// What the listing says of element (n, v)'s inputs: exponent range and specials of the row and
// the column, the float64 dot, and the fp32 fma chain.
std::string inputs_summary(const Case& c, int64_t n, int64_t v) {
  const uint16_t* h = c.hidden.data() + n * c.dim;
  const uint16_t* w = c.weight.data() + v * c.dim;
  int emin = 1000, emax = -1000, zeros = 0, specials = 0;
  double exact = 0;
  float chain = 0;
  for (int64_t k = 0; k < c.dim; ++k) {
    for (uint16_t x : {h[k], w[k]}) {
      if (!wgmma::bf16_finite(x)) {
        ++specials;
        continue;
      }
      const wgmma::Bf16Parts p = wgmma::bf16_parts(x);
      if (p.sig == 0) {
        ++zeros;
        continue;
      }
      emin = std::min(emin, p.exp);
      emax = std::max(emax, p.exp);
    }
    exact += static_cast<double>(bf16_value(h[k])) * bf16_value(w[k]);
    chain = std::fma(bf16_value(h[k]), bf16_value(w[k]), chain);
  }
  std::ostringstream s;
  s << "exp[" << emin << "," << emax << "] zeros=" << zeros << " specials=" << specials << " f64dot=" << hexfloat(exact)
    << " fp32fma=" << hex32(fp::bits(chain))
    << (c.bias.empty() ? "" : " bias=" + hexfloat(c.bias[static_cast<size_t>(v)]));
  return s.str();
}

int64_t ulp_distance(uint32_t a, uint32_t b) {
  auto key = [](uint32_t u) { return (u & 0x80000000u) ? -static_cast<int64_t>(u & 0x7FFFFFFFu) : int64_t(u); };
  return std::llabs(key(a) - key(b));
}

}  // namespace

int main(int argc, char** argv) {
  double total_logits = 1e8;
  std::vector<int64_t> dims = {64, 384, 1000, 1024, 4096, 8192};
  std::string out_dir = ".";
  uint64_t seed = 1;
  bool cpu_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << a << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") {
      total_logits = 1e7;
    } else if (a == "--logits") {
      total_logits = std::stod(value());
    } else if (a == "--dims") {
      dims.clear();
      std::stringstream ss(value());
      for (std::string d; std::getline(ss, d, ',');) dims.push_back(std::stoll(d));
    } else if (a == "--out") {
      out_dir = value();
    } else if (a == "--seed") {
      seed = std::stoull(value());
    } else if (a == "--cpu-only") {
      cpu_only = true;
    } else {
      std::cerr << "unknown argument '" << a << "'\nusage: " << argv[0]
                << " [--quick] [--logits N] [--dims 64,384,...] [--out DIR] [--seed S] [--cpu-only]\n";
      return 2;
    }
  }
  if (total_logits < 1 || dims.empty()) {
    std::cerr << "--logits must be >= 1 and --dims non-empty\n";
    return 2;
  }
  std::string why;
  bool sm90 = false;
  for (const auto& b : detlogp::list_backends())
    if (b.id == kSm90Id) {
      sm90 = b.available;
      why = b.detail;
    }
  if (!sm90 && !cpu_only) {
    std::cout << "sm90_wgmma_proof: skipped: no usable SM90 GPU (" << why << ")\n";
    return 0;
  }
  std::filesystem::create_directories(out_dir);
  const std::string diff_csv = out_dir + "/wgmma_proof.csv", case_csv = out_dir + "/wgmma_proof_cases.csv",
                    diff_inputs = out_dir + "/wgmma_diff_inputs.txt";
  std::ofstream diffs(diff_csv), table(case_csv), dump(diff_inputs);
  diffs << "case,dim,row,col,model_bits,hardware_bits,ulps,inputs\n";
  table << "case,dim,rows,vocab,bias,logits_compared,logits_differing,logp_rows_differing,lse_rows_differing,"
           "entropy_rows_differing,scalar_model_checked,scalar_model_differing,gpu_s,cpu_s,inf/nan/zero/subnormal\n";
  const char* threads = std::getenv("DETLOGP_CPU_THREADS");
  std::cout << "sm90_wgmma_proof: " << (cpu_only ? "cpu-only (no comparison)" : why) << "\n"
            << "model: " << kModelId << " on " << (threads ? threads : "all hardware") << " CPU threads; logits "
            << total_logits << " over " << kinds().size() * dims.size() << " cases\n";
  const int64_t per_case =
      std::max<int64_t>(64, static_cast<int64_t>(total_logits / static_cast<double>(kinds().size() * dims.size())));
  std::printf("%-16s %5s %6s %5s %4s %12s %10s %5s %5s %5s %8s %6s %7s %7s  %s\n", "case", "D", "N", "V", "bias",
              "compared", "differing", "logp", "lse", "H", "scalar", "s.diff", "gpu_s", "cpu_s", "inf/nan/0/sub");
  int64_t compared_all = 0, differing_all = 0, listed = 0, dumped = 0, stat_diff_all = 0, scalar_diff_all = 0;
  constexpr int64_t kListOnStdout = 200, kDumpInputs = 16, kScalarSample = 2000;
  uint64_t case_seed = seed;
  for (int64_t dim : dims) {
    for (const Kind& kind : kinds()) {
      const Case c = make_case(kind, dim, per_case, case_seed++ * 0x9E3779B97F4A7C15ull);
      // With the entropy output where the SM90 serves it for this call; otherwise without (said).
      bool entropy = true;
      Result hw;
      if (!cpu_only) {
        try {
          hw = run(c, kSm90Id, true);
        } catch (const std::exception& e) {
          std::printf("  %s D=%lld: the SM90 call with the entropy output failed (%s); again without it\n",
                      c.name.c_str(), static_cast<long long>(dim), e.what());
          entropy = false;
          hw = run(c, kSm90Id, false);
        }
      }
      const Result model = run(c, kModelId, entropy);
      int64_t differing = 0, logp_d = 0, lse_d = 0, ent_d = 0, scalar_d = 0;
      const int64_t n_logits = c.rows * c.vocab;
      if (!cpu_only) {
        for (int64_t i = 0; i < n_logits; ++i) {
          const uint32_t mb = fp::bits(model.logits[i]), hb = fp::bits(hw.logits[i]);
          if (mb == hb) continue;
          ++differing;
          const int64_t n = i / c.vocab, v = i % c.vocab;
          const std::string summary = inputs_summary(c, n, v);
          diffs << c.name << "," << dim << "," << n << "," << v << "," << hex32(mb) << "," << hex32(hb) << ","
                << ulp_distance(mb, hb) << "," << summary << "\n";
          if (listed++ < kListOnStdout)
            std::printf("  DIFF %s D=%lld row=%lld col=%lld model=%s hw=%s (%lld ulp) %s\n", c.name.c_str(),
                        static_cast<long long>(dim), static_cast<long long>(n), static_cast<long long>(v),
                        hex32(mb).c_str(), hex32(hb).c_str(), static_cast<long long>(ulp_distance(mb, hb)),
                        summary.c_str());
          if (dumped++ < kDumpInputs) {
            dump << c.name << " D=" << dim << " row=" << n << " col=" << v << " model=" << hex32(mb)
                 << " hw=" << hex32(hb) << (c.bias.empty() ? "" : " bias=" + hexfloat(c.bias[v])) << "\nhidden";
            for (int64_t k = 0; k < dim; ++k) dump << (k % 16 ? " " : "\n  ") << std::hex << c.hidden[n * dim + k];
            dump << std::dec << "\nweight";
            for (int64_t k = 0; k < dim; ++k) dump << (k % 16 ? " " : "\n  ") << std::hex << c.weight[v * dim + k];
            dump << std::dec << "\n\n";
          }
        }
        for (int64_t n = 0; n < c.rows; ++n) {
          logp_d += fp::bits(model.logp[n]) != fp::bits(hw.logp[n]);
          lse_d += fp::bits(model.lse[n]) != fp::bits(hw.lse[n]);
          ent_d += fp::bits(model.entropy[n]) != fp::bits(hw.entropy[n]);
        }
      }
      // The fast GEMM against the model's scalar definition on a sample of elements (bias free
      // cases: the logit is the dot itself).
      Rng pick(case_seed);
      const int64_t sample = c.bias.empty() ? std::min(kScalarSample, n_logits) : 0;
      for (int64_t s = 0; s < sample; ++s) {
        const int64_t i = pick.below(n_logits), n = i / c.vocab, v = i % c.vocab;
        const float want = wgmma::dot(c.hidden.data() + n * dim, c.weight.data() + v * dim, dim);
        scalar_d += fp::bits(want) != fp::bits(model.logits[i]);
      }
      // What the model's logits are made of: infinities, NaNs, zeros, subnormals (a case that is all
      // one class proves little).
      int64_t inf = 0, nan = 0, zero = 0, sub = 0;
      for (float z : model.logits) {
        const uint32_t u = fp::bits(z) & 0x7FFFFFFFu;
        inf += u == 0x7F800000u;
        nan += u > 0x7F800000u;
        zero += u == 0;
        sub += u != 0 && u < 0x00800000u;
      }
      const std::string classes =
          std::to_string(inf) + "/" + std::to_string(nan) + "/" + std::to_string(zero) + "/" + std::to_string(sub);
      compared_all += cpu_only ? 0 : n_logits;
      differing_all += differing;
      stat_diff_all += logp_d + lse_d + ent_d;
      scalar_diff_all += scalar_d;
      std::printf("%-16s %5lld %6lld %5lld %4s %12lld %10lld %5lld %5lld %5lld %8lld %6lld %7.2f %7.2f  %s\n",
                  c.name.c_str(), static_cast<long long>(dim), static_cast<long long>(c.rows),
                  static_cast<long long>(c.vocab), c.bias.empty() ? "no" : "yes",
                  static_cast<long long>(cpu_only ? 0 : n_logits), static_cast<long long>(differing),
                  static_cast<long long>(logp_d), static_cast<long long>(lse_d), static_cast<long long>(ent_d),
                  static_cast<long long>(sample), static_cast<long long>(scalar_d), hw.seconds, model.seconds,
                  classes.c_str());
      std::fflush(stdout);
      table << c.name << "," << dim << "," << c.rows << "," << c.vocab << "," << (c.bias.empty() ? "no" : "yes") << ","
            << (cpu_only ? 0 : n_logits) << "," << differing << "," << logp_d << "," << lse_d << "," << ent_d << ","
            << sample << "," << scalar_d << "," << hw.seconds << "," << model.seconds << "\n";
    }
  }
  if (listed > kListOnStdout)
    std::cout << "  (" << listed - kListOnStdout << " more differing elements in " << diff_csv << ")\n";
  std::cout << "total: " << compared_all << " logits compared, " << differing_all << " differing; " << stat_diff_all
            << " logp/lse/entropy rows differing; " << scalar_diff_all
            << " sampled elements where the GEMM differs from the scalar model\n"
            << "files: " << case_csv << ", " << diff_csv << ", " << diff_inputs << "\n"
            << "verdict: "
            << (cpu_only                                                           ? "NOT COMPARED (--cpu-only)"
                : differing_all == 0 && stat_diff_all == 0 && scalar_diff_all == 0 ? "EXACT"
                                                                                   : "DIFFERS")
            << "\n";
  return differing_all == 0 && stat_diff_all == 0 && scalar_diff_all == 0 ? 0 : 1;
}

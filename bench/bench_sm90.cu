// SM90 benchmark: detlogp trainer and serving entries against cuBLAS bf16 GEMM alone (fp32 and
// bf16 output) and cuBLAS GEMM + an fp32 log-softmax kernel (the materializing path), in one run.
// The cuBLAS paths make the call torch makes for F.linear (TorchStyleGemm, bench_common.cuh);
// "cublas_gemm_bf16out_legacy" is the call this bench made before (a bare handle, cuBLAS's own
// workspace, CUBLAS_GEMM_DEFAULT), kept as a column to compare with.
// CUDA-event timing, median of many, L2 flushed before every timed launch; at each N all methods
// are timed round-robin in a shuffled order per repetition. Ratios to cuBLAS bf16-out: of the
// medians, and ("paired") the median of each repetition's own ratio, in which drifts of clock and
// temperature slower than one round cancel.
// Data (--data): "realistic" (default), the inputs of python/detlogp/bench/data.py (RMS-normalized
// hidden rows, an N(0, 0.02) head, every third row peaked on its target), or "random" (uniform
// hidden in [-1, 1), uniform head in +-9 / sqrt(D)). Under the 700 W cap the clock depends on the
// data, so every path of a run uses the same inputs.
// --reference-only: only the cuBLAS bf16-out calls (--methods picks among cublas_gemm_bf16out,
// cublas_gemm_bf16out_legacy, cublas_gemm_f32out), and --data may then list both kinds
// ("random,realistic"): every call on every kind in one round-robin, the data's effect on the
// clock measured apart from the call's (bench/cublas_probe.sh).
// Writes CSV rows (GPU, versions, date, reproduce command) and prints a summary table.
// The trainer with the entropy output (docs/contract.md §10), "detlogp_trainer_entropy", is timed
// at N = 1024, 4096 and 16384 beside the trainer without it and reported as the ratio of the two
// (medians, and paired), against the goal of docs/perf.md (<= 1.03x).
// --tp R: also rank 1's tensor-parallel partials (the trainer's partial mode) of an R-way split,
// 64-aligned (ceil(V / R) rounded up to 64 rows a rank) and as engines split (V / R rows: tiles
// straddle the boundaries, docs/contract.md §7.1), "detlogp_partials_tpR_aligned" /
// "_unaligned", reported as the ratio of the two against the goal of issue 29 (<= 1.03x).
//
//   bench_sm90 [--n 1,8,64,1024,4096,16384] [--d 4096] [--v 151936] [--csv out.csv] [--reps K]
//              [--buckets all|none|name,name]  (the forced launch buckets also timed; default all)
//              [--tp R] [--data realistic|random] [--reference-only [--methods a,b]]
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "core/backend.hpp"
#include "sm90/launch_table.hpp"
#include "sm90/workspace.hpp"

namespace {

using namespace detlogp_bench;

// Baseline log-softmax over materialized fp32 logits: one CTA per row, max pass, sum-exp pass.
__global__ void log_softmax_rows(const float* z, int64_t v, const int32_t* targets, float* logp, float* lse) {
  const float* row = z + blockIdx.x * v;
  __shared__ float red[32];
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) m = fmaxf(m, row[i]);
  for (int o = 16; o; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  m = -INFINITY;
  for (int i = 0; i < blockDim.x / 32; ++i) m = fmaxf(m, red[i]);
  __syncthreads();
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) s += expf(row[i] - m);
  for (int o = 16; o; o /= 2) s += __shfl_xor_sync(~0u, s, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int i = 0; i < blockDim.x / 32; ++i) t += red[i];
    const float l = m + logf(t);
    lse[blockIdx.x] = l;
    logp[blockIdx.x] = row[targets[blockIdx.x]] - l;
  }
}

struct Row {
  int64_t n;
  std::string method, data;
  double ms, tflops, gbps;
  int64_t extra_bytes;
  double ratio_bf16, ratio_f32;
  double sm_mhz, watts;
  unsigned long long clock_reasons;
  double paired_bf16;  // median of the per-repetition ratios to cuBLAS bf16-out
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ns = {1, 8, 64, 1024, 4096, 16384};
  int64_t d = 4096, v = 151936;
  std::string csv = "bench_sm90.csv";
  int reps_override = 0;
  std::string buckets = "all";  // forced buckets timed at N <= 64, 1024, 4096, 16384: all, none, or a list
  int tp = 0;                   // --tp R: rank 1's partials of an R-way split, aligned and not
  std::string data_arg = "realistic";
  bool reference_only = false;
  std::string ref_methods = "cublas_gemm_bf16out,cublas_gemm_bf16out_legacy";
  std::string command;
  // Reproduce command without machine-specific paths: program and file names only.
  auto base = [](const char* a) {
    const char* slash = std::strrchr(a, '/');
    return std::string(slash ? slash + 1 : a);
  };
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + base(argv[i]);
  command += " (reproduce: scripts/gpu_check.sh)";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--n")
      ns = parse_list(next());
    else if (a == "--d")
      d = std::atoll(next());
    else if (a == "--v")
      v = std::atoll(next());
    else if (a == "--csv")
      csv = next();
    else if (a == "--reps")
      reps_override = std::atoi(next());
    else if (a == "--buckets")
      buckets = next();
    else if (a == "--tp")
      tp = std::atoi(next());
    else if (a == "--data")
      data_arg = next();
    else if (a == "--reference-only")
      reference_only = true;
    else if (a == "--methods")
      ref_methods = next();
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (buckets != "all" && buckets != "none") {  // every listed name must be a launch bucket
    std::string rest = buckets + ",";
    for (size_t at = 0, comma; (comma = rest.find(',', at)) != std::string::npos; at = comma + 1) {
      const std::string name = rest.substr(at, comma - at);
      bool known = false;
      for (int bi = 0; bi < detlogp::sm90::kBucketCount; ++bi)
        known = known || name == detlogp::sm90::bucket_info(static_cast<detlogp::sm90::Bucket>(bi)).name;
      if (!known) {
        std::fprintf(stderr, "--buckets: '%s' is not a launch bucket (all, none, or names of DETLOGP_SM90_BUCKET)\n",
                     name.c_str());
        return 2;
      }
    }
  }
  // The data kinds of this run, each checked.
  std::vector<std::string> kinds;
  {
    std::string rest = data_arg + ",";
    for (size_t at = 0, comma; (comma = rest.find(',', at)) != std::string::npos; at = comma + 1) {
      const std::string k = rest.substr(at, comma - at);
      if (k != "random" && k != "realistic") {
        std::fprintf(stderr, "--data: '%s' is not a data kind (realistic, random)\n", k.c_str());
        return 2;
      }
      if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) kinds.push_back(k);
    }
  }
  if (reference_only && tp != 0) {
    std::fprintf(stderr, "--tp %d: the partials are detlogp paths, not timed with --reference-only\n", tp);
    return 2;
  }
  if (kinds.size() > 1 && !reference_only) {
    std::fprintf(stderr, "--data %s: several kinds need --reference-only (every path of a full run uses one kind)\n",
                 data_arg.c_str());
    return 2;
  }
  const std::vector<std::string> known_refs = {"cublas_gemm_bf16out", "cublas_gemm_bf16out_legacy",
                                               "cublas_gemm_f32out"};
  std::vector<std::string> refs;
  {
    std::string rest = ref_methods + ",";
    for (size_t at = 0, comma; (comma = rest.find(',', at)) != std::string::npos; at = comma + 1) {
      const std::string m = rest.substr(at, comma - at);
      if (std::find(known_refs.begin(), known_refs.end(), m) == known_refs.end()) {
        std::fprintf(stderr,
                     "--methods: '%s' is not a reference method (cublas_gemm_bf16out, cublas_gemm_bf16out_legacy, "
                     "cublas_gemm_f32out)\n",
                     m.c_str());
        return 2;
      }
      if (std::find(refs.begin(), refs.end(), m) == refs.end()) refs.push_back(m);
    }
  }
  if (std::find(kinds.begin(), kinds.end(), "realistic") != kinds.end() && d > 8192) {
    std::fprintf(stderr, "--data realistic: --d %lld is over the generator's 8192\n", (long long)d);
    return 2;
  }
  const auto& backend = detlogp::detail::sm90_contract_backend();
  std::string why;
  if (reference_only) {  // only cuBLAS runs: any CUDA GPU will do
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      std::printf("SKIP bench_sm90: --reference-only needs a CUDA device (none found)\n");
      return 0;
    }
  } else if (!backend.available(&why)) {
    std::printf("SKIP bench_sm90: %s\n", why.c_str());
    return 0;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  int rt = 0, drv = 0;
  CK(cudaRuntimeGetVersion(&rt));
  CK(cudaDriverGetVersion(&drv));
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::printf("bench_sm90 on %s (%d SMs), CUDA runtime %d, driver %d, %s\n", prop.name, prop.multiProcessorCount, rt,
              drv, date);

  const int64_t nmax = *std::max_element(ns.begin(), ns.end());
  Timer timer;
  // Copy bandwidth (device to device), counting bytes read + written.
  double copy_gbps = 0;
  {
    const size_t bytes = size_t{2} << 30;
    void *x, *y;
    CK(cudaMalloc(&x, bytes));
    CK(cudaMalloc(&y, bytes));
    CK(cudaMemset(x, 1, bytes));
    const double ms = timer.median_ms([&] { CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice)); }, 10);
    copy_gbps = 2.0 * bytes / (ms * 1e-3) / 1e9;
    CK(cudaFree(x));
    CK(cudaFree(y));
  }
  const double weight_bytes = 2.0 * v * d;
  const double floor_ms = weight_bytes / (copy_gbps * 1e9) * 1e3;
  std::printf("device-to-device copy: %.0f GB/s (read+write); HBM floor for the weight (%.3f GB): %.4f ms\n", copy_gbps,
              weight_bytes / 1e9, floor_ms);

  std::vector<int32_t> ht(static_cast<size_t>(nmax));
  for (int64_t i = 0; i < nmax; ++i) ht[i] = static_cast<int32_t>((i * 7919 + 13) % v);
  int32_t* targets;
  CK(cudaMalloc(&targets, ht.size() * 4));
  CK(cudaMemcpy(targets, ht.data(), ht.size() * 4, cudaMemcpyHostToDevice));
  // One weight and hidden pair per data kind (the first is the run's for every detlogp path).
  struct Inputs {
    std::string kind;
    uint16_t *w, *h;
  };
  std::vector<Inputs> inputs;
  for (const auto& kind : kinds) {
    Inputs in{kind, nullptr, nullptr};
    CK(cudaMalloc(&in.w, static_cast<size_t>(v * d) * 2));
    CK(cudaMalloc(&in.h, static_cast<size_t>(nmax * d) * 2));
    if (kind == "random") {
      fill_bf16<<<2048, 256>>>(in.w, v * d, 1, static_cast<float>(9.0 / std::sqrt(double(d))));
      fill_bf16<<<2048, 256>>>(in.h, nmax * d, 2, 1.0f);
    } else {
      fill_normal_bf16<<<2048, 256>>>(in.w, v * d, 3, 0.02f);
      realistic_hidden<<<static_cast<unsigned>(nmax), 256>>>(in.h, in.w, targets, d, 4);
    }
    CK(cudaGetLastError());
    inputs.push_back(in);
  }
  CK(cudaDeviceSynchronize());
  // What the inputs look like, from rows 0 (peaked in the realistic kind) and 1: their RMS, their
  // target's logit, and the head's spread (realistic: RMS 1, logit 9-45 for row 0, head std 0.02).
  for (const auto& in : inputs) {
    const int64_t rows_checked = std::min<int64_t>(2, nmax);
    std::vector<uint16_t> hh(static_cast<size_t>(rows_checked * d)), wt(static_cast<size_t>(d)),
        w0(static_cast<size_t>(d));
    CK(cudaMemcpy(hh.data(), in.h, hh.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(w0.data(), in.w, w0.size() * 2, cudaMemcpyDeviceToHost));
    double wsq = 0;
    for (auto b : w0) wsq += double(detlogp::fp::bf16_to_float(b)) * detlogp::fp::bf16_to_float(b);
    std::printf("data %s: head std %.4f (first row)", in.kind.c_str(), std::sqrt(wsq / d));
    for (int64_t r = 0; r < rows_checked; ++r) {
      CK(cudaMemcpy(wt.data(), in.w + static_cast<int64_t>(ht[r]) * d, wt.size() * 2, cudaMemcpyDeviceToHost));
      double sq = 0, dot = 0;
      for (int64_t c = 0; c < d; ++c) {
        const double x = detlogp::fp::bf16_to_float(hh[r * d + c]);
        sq += x * x;
        dot += x * detlogp::fp::bf16_to_float(wt[c]);
      }
      std::printf("; row %lld: RMS %.3f, target logit %.2f", (long long)r, std::sqrt(sq / d), dot);
    }
    std::printf("\n");
  }
  uint16_t* w = inputs[0].w;
  uint16_t* h = inputs[0].h;
  std::printf("data: %s%s\n", data_arg.c_str(),
              reference_only ? " (reference only: the cuBLAS calls alone)" : " (every path of the run)");
  // [N, kMultiIds] targets: the row's target, then ids spread over the vocabulary (the multi-id case).
  constexpr int64_t kMultiIds = 8;
  std::vector<int32_t> hm(static_cast<size_t>(nmax * kMultiIds));
  for (int64_t i = 0; i < nmax; ++i)
    for (int64_t j = 0; j < kMultiIds; ++j) hm[i * kMultiIds + j] = static_cast<int32_t>((ht[i] + j * (v / 8 + 1)) % v);
  int32_t* multi_targets;
  float* multi_logp;
  CK(cudaMalloc(&multi_targets, hm.size() * 4));
  CK(cudaMemcpy(multi_targets, hm.data(), hm.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&multi_logp, hm.size() * 4));
  float *logp, *lse, *entropy, *logits;
  uint16_t* logits_bf16;
  CK(cudaMalloc(&logp, nmax * 4));
  CK(cudaMalloc(&lse, nmax * 4));
  CK(cudaMalloc(&entropy, nmax * 4));
  CK(cudaMalloc(&logits, static_cast<size_t>(nmax * v) * 4));
  CK(cudaMalloc(&logits_bf16, static_cast<size_t>(nmax * v) * 2));
  // The reference: the call torch makes (its own handle and workspace); the legacy column: a bare
  // handle on the default stream, cuBLAS's own workspace pool.
  TorchStyleGemm torch_gemm;
  cublasHandle_t cublas;
  CB(cublasCreate(&cublas));
  std::printf(
      "cuBLAS %d (linked), torch-style workspace %zu bytes (CUBLAS_WORKSPACE_CONFIG %s)\n",
      [&] {
        int ver = 0;
        CB(cublasGetVersion(cublas, &ver));
        return ver;
      }(),
      torch_gemm.workspace_size(), std::getenv("CUBLAS_WORKSPACE_CONFIG") ? "set" : "unset");

  // The entropy case needs a backend that computes the output; one that does not says so once.
  const bool entropy_served = !reference_only && backend.supports_entropy();
  if (!entropy_served && !reference_only)
    std::printf("entropy: %s serves no entropy output (no entropy_id): detlogp_trainer_entropy not timed\n",
                backend.id().c_str());
  constexpr double kEntropyGoal = 1.03;  // docs/perf.md: the trainer with entropy over the trainer
  struct EntropyRatio {
    int64_t n;
    double ratio, paired;
  };
  std::vector<EntropyRatio> entropy_ratios, shard_ratios, multi_ratios;
  const bool multi_served = !reference_only && backend.supports_multi_targets();
  std::vector<Row> rows;
  std::vector<std::string> call_lines;  // the reference and data comparisons, printed at the end
  auto fmt = [](const char* f, auto... args) {
    char buf[512];
    std::snprintf(buf, sizeof buf, f, args...);
    return std::string(buf);
  };
  // Rank 1's shard of a tp-way split: 64-aligned, and V / tp rows (engines' split).
  struct ShardSpec {
    int64_t start, count;
  };
  const int64_t aligned_rows = tp >= 2 ? ((v + tp - 1) / tp + 63) / 64 * 64 : 0;
  const ShardSpec aligned{aligned_rows, std::min(aligned_rows, v - aligned_rows)};
  const ShardSpec unaligned{tp >= 2 ? v / tp : 0, tp >= 2 ? v / tp : 0};
  if (tp >= 2 && (aligned.count <= 0 || unaligned.count <= 0)) {
    std::fprintf(stderr, "--tp %d: rank 1 holds no rows of V=%lld\n", tp, (long long)v);
    return 2;
  }
  const int64_t shard_max = std::max(aligned.count, unaligned.count);
  detlogp::TileSummary* shard_summaries = nullptr;
  float *shard_target_logit = nullptr, *shard_edge = nullptr;
  uint8_t* shard_owned = nullptr;
  if (tp >= 2) {
    CK(cudaMalloc(&shard_summaries, static_cast<size_t>(nmax * (shard_max / 64 + 2)) * sizeof(detlogp::TileSummary)));
    CK(cudaMalloc(&shard_target_logit, nmax * 4));
    CK(cudaMalloc(&shard_owned, nmax));
    CK(cudaMalloc(&shard_edge, nmax * 128 * 4));
  }
  for (int64_t n : ns) {
    const int reps = reps_override ? reps_override : (n >= 4096 ? 15 : 30);
    const double flops = 2.0 * n * v * d;
    const double in_bytes = weight_bytes + 2.0 * n * d;
    detlogp::detail::LogpProblem p;
    p.rows = n;
    p.dim = d;
    p.vocab_local = v;
    p.real_vocab = v;
    p.hidden = h;
    p.hidden_stride = d;
    p.weight = w;
    p.weight_stride = d;
    p.targets = targets;
    p.memory = detlogp::Memory::cuda;
    p.logp = logp;
    p.lse = lse;
    // The cuBLAS calls on one data kind's inputs: torch's call, and the legacy one.
    auto gemm_on = [&](const Inputs& in, void* c, cudaDataType ct) { torch_gemm(in.w, in.h, c, ct, v, n, d); };
    auto legacy_on = [&](const Inputs& in, void* c, cudaDataType ct) {
      const float alpha = 1.0f, beta = 0.0f;
      CB(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(v), static_cast<int>(n), static_cast<int>(d),
                      &alpha, in.w, CUDA_R_16BF, static_cast<int>(d), in.h, CUDA_R_16BF, static_cast<int>(d), &beta, c,
                      ct, static_cast<int>(v), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    auto gemm = [&](void* c, cudaDataType ct) { gemm_on(inputs[0], c, ct); };
    detlogp::detail::LogpProblem ps = p;
    ps.logits = logits;
    const int64_t ws = detlogp::sm90::workspace_bytes(p);
    const double logit_bytes = 4.0 * n * v;
    struct Method {
      std::string name;
      std::function<void()> fn;
      double bytes;
      int64_t extra;
      std::string data;  // the data kind it runs on
    };
    std::vector<Method> methods;
    if (reference_only) {
      for (const auto& in : inputs)
        for (const auto& m : refs) {
          if (m == "cublas_gemm_bf16out")
            methods.push_back({m, [&, in] { gemm_on(in, logits_bf16, CUDA_R_16BF); }, in_bytes + 2.0 * n * v,
                               static_cast<int64_t>(2.0 * n * v), in.kind});
          else if (m == "cublas_gemm_bf16out_legacy")
            methods.push_back({m, [&, in] { legacy_on(in, logits_bf16, CUDA_R_16BF); }, in_bytes + 2.0 * n * v,
                               static_cast<int64_t>(2.0 * n * v), in.kind});
          else
            methods.push_back({m, [&, in] { gemm_on(in, logits, CUDA_R_32F); }, in_bytes + logit_bytes,
                               static_cast<int64_t>(logit_bytes), in.kind});
        }
    } else
      methods = {
          {"cublas_gemm_bf16out", [&] { gemm(logits_bf16, CUDA_R_16BF); }, in_bytes + 2.0 * n * v,
           static_cast<int64_t>(2.0 * n * v)},
          {"cublas_gemm_f32out", [&] { gemm(logits, CUDA_R_32F); }, in_bytes + logit_bytes,
           static_cast<int64_t>(logit_bytes)},
          {"cublas_f32+log_softmax",
           [&] {
             gemm(logits, CUDA_R_32F);
             log_softmax_rows<<<static_cast<unsigned>(n), 512>>>(logits, v, targets, logp, lse);
           },
           in_bytes + 2 * logit_bytes + 8.0 * n, static_cast<int64_t>(logit_bytes)},
          {"detlogp_trainer", [&] { backend.run(p); }, in_bytes + 8.0 * n, ws},
          {"detlogp_serving", [&] { backend.run(ps); }, in_bytes + logit_bytes + 8.0 * n, ws},
          {"cublas_gemm_bf16out_legacy", [&] { legacy_on(inputs[0], logits_bf16, CUDA_R_16BF); },
           in_bytes + 2.0 * n * v, static_cast<int64_t>(2.0 * n * v)},
      };
    for (auto& m : methods)
      if (m.data.empty()) m.data = inputs[0].kind;
    // A method's index by name and data kind (methods.size() when not timed).
    auto index_of = [&](const std::string& name, const std::string& kind) {
      size_t i = 0;
      while (i < methods.size() && !(methods[i].name == name && methods[i].data == kind)) ++i;
      return i;
    };
    const size_t trainer_method = index_of("detlogp_trainer", inputs[0].kind);  // the entropy case's reference
    detlogp::detail::LogpProblem pe = p;
    pe.entropy = entropy;
    const bool time_entropy = entropy_served && (n == 1024 || n == 4096 || n == 16384);
    const size_t entropy_method = methods.size();
    if (time_entropy)
      methods.push_back({"detlogp_trainer_entropy", [&] { backend.run(pe); }, in_bytes + 12.0 * n,
                         detlogp::sm90::workspace_bytes(pe)});
    // K = 8 ids a row from one pass, against the single-target trainer (goal <= 1.03x, docs/sm90.md).
    detlogp::detail::LogpProblem pm = p;
    pm.targets = multi_targets;
    pm.targets_per_row = kMultiIds;
    pm.targets_2d = true;
    pm.logp = multi_logp;
    const bool time_multi = multi_served && (n == 1 || n == 64 || n == 1024 || n == 4096 || n == 16384);
    const size_t multi_method = methods.size();
    if (time_multi)
      methods.push_back({"detlogp_trainer_multi8", [&] { backend.run(pm); }, in_bytes + 4.0 * n * (2 * kMultiIds + 1),
                         detlogp::sm90::workspace_bytes(pm)});
    auto shard_problem = [&](const ShardSpec& sh) {
      detlogp::detail::LogpProblem q = p;
      q.logp = q.lse = nullptr;
      q.weight = w + sh.start * d;
      q.vocab_start = sh.start;
      q.vocab_local = sh.count;
      q.partial = true;
      q.summaries = shard_summaries;
      q.target_logit = shard_target_logit;
      q.target_owned = shard_owned;
      q.edge_logits = q.geometry().edge_lanes() > 0 ? shard_edge : nullptr;
      return q;
    };
    const detlogp::detail::LogpProblem pa = shard_problem(aligned), pu = shard_problem(unaligned);
    const size_t aligned_method = methods.size();
    if (tp >= 2) {
      const double shard_bytes = 2.0 * aligned.count * d + 2.0 * n * d + 8.0 * n * (aligned.count / 64);
      methods.push_back(
          {"detlogp_partials_tp" + std::to_string(tp) + "_aligned", [&] { backend.run(pa); }, shard_bytes, 0});
      methods.push_back(
          {"detlogp_partials_tp" + std::to_string(tp) + "_unaligned", [&] { backend.run(pu); }, shard_bytes, 0});
    }
    if (n <= 64 || n == 1024 || n == 4096 || n == 16384) {
      for (int bi = 0; bi < detlogp::sm90::kBucketCount; ++bi) {
        const char* b = detlogp::sm90::bucket_info(static_cast<detlogp::sm90::Bucket>(bi)).name;
        // The 8-row decode tiles stream the weight once per 8 rows: forced only where that is sane.
        if (std::strncmp(b, "decode8", 7) == 0 && n > 64) continue;
        if (buckets != "all" && ("," + buckets + ",").find(std::string(",") + b + ",") == std::string::npos) continue;
        methods.push_back({std::string("detlogp_trainer[") + b + "]",
                           [&, b] {
                             setenv("DETLOGP_SM90_BUCKET", b, 1);
                             backend.run(p);
                             unsetenv("DETLOGP_SM90_BUCKET");
                           },
                           in_bytes + 8.0 * n, ws});
      }
    }
    if (reference_only) {  // none of the detlogp paths
      std::vector<Method> kept;
      for (auto& m : methods)
        if (m.name.rfind("cublas_", 0) == 0) kept.push_back(m);
      methods = kept;
    }
    std::vector<std::function<void()>> fns;
    for (const auto& m : methods) fns.push_back(m.fn);
    const std::vector<double> med = timer.interleaved_medians(fns, reps);
    CK(cudaGetLastError());
    const size_t methods_count = methods.size();
    // Ratios are to the reference of the same data kind (NaN when it was not timed).
    auto med_of = [&](size_t i) { return i < methods_count ? med[i] : std::nan(""); };
    if (time_entropy)
      entropy_ratios.push_back(
          {n, med[entropy_method] / med[trainer_method], timer.paired_ratio_median(entropy_method, trainer_method)});
    if (time_multi)
      multi_ratios.push_back(
          {n, med[multi_method] / med[trainer_method], timer.paired_ratio_median(multi_method, trainer_method)});
    if (tp >= 2)
      shard_ratios.push_back({n, med[aligned_method + 1] / med[aligned_method],
                              timer.paired_ratio_median(aligned_method + 1, aligned_method)});
    for (size_t i = 0; i < methods.size(); ++i) {
      const double ms = med[i];
      const size_t ref = index_of("cublas_gemm_bf16out", methods[i].data);
      const double t_bf16 = med_of(ref), t_f32 = med_of(index_of("cublas_gemm_f32out", methods[i].data));
      rows.push_back({n, methods[i].name, methods[i].data, ms, flops / (ms * 1e-3) / 1e12,
                      methods[i].bytes / (ms * 1e-3) / 1e9, methods[i].extra, ms / t_bf16, ms / t_f32, timer.mhz[i],
                      timer.watts[i], timer.reasons[i],
                      ref < methods_count ? timer.paired_ratio_median(i, ref) : std::nan("")});
    }
    // The legacy call over torch's, per data kind; with two kinds, each call on realistic data over
    // the same call on random data (paired: the two ran in the same rounds).
    for (const auto& in : inputs) {
      const size_t a = index_of("cublas_gemm_bf16out_legacy", in.kind), b = index_of("cublas_gemm_bf16out", in.kind);
      if (a < methods_count && b < methods_count)
        call_lines.push_back(
            fmt("reference N=%lld data=%s: cublas_gemm_bf16out_legacy / cublas_gemm_bf16out = %.3fx "
                "(paired %.3fx); SM MHz %.0f / %.0f, W %.0f / %.0f",
                (long long)n, in.kind.c_str(), med[a] / med[b], timer.paired_ratio_median(a, b), timer.mhz[a],
                timer.mhz[b], timer.watts[a], timer.watts[b]));
    }
    if (inputs.size() > 1)
      for (const auto& m : refs) {
        const size_t a = index_of(m, "realistic"), b = index_of(m, "random");
        if (a < methods_count && b < methods_count)
          call_lines.push_back(
              fmt("data N=%lld %s: realistic / random = %.3fx (paired %.3fx); SM MHz %.0f / %.0f, "
                  "W %.0f / %.0f, reasons 0x%llx / 0x%llx",
                  (long long)n, m.c_str(), med[a] / med[b], timer.paired_ratio_median(a, b), timer.mhz[a], timer.mhz[b],
                  timer.watts[a], timer.watts[b], timer.reasons[a], timer.reasons[b]));
      }
    std::printf("N=%lld done\n", (long long)n);
    std::fflush(stdout);
  }

  FILE* f = std::fopen(csv.c_str(), "w");
  if (f) {
    std::fprintf(
        f,
        "gpu,cuda_runtime,driver,git_sha,date,command,N,D,V,method,ms_median,tflops,gbps,extra_bytes,ratio_vs_"
        "cublas_bf16out,ratio_vs_cublas_f32out,copy_gbps,hbm_floor_ms,sm_mhz_mean,power_w_mean,clock_event_reasons,"
        "ratio_vs_cublas_bf16out_paired,data\n");
    for (const auto& r : rows)
      std::fprintf(
          f,
          "\"%s\",%d,%d,%s,%s,\"%s\",%lld,%lld,%lld,%s,%.5f,%.2f,%.1f,%lld,%.3f,%.3f,%.0f,%.5f,%.0f,%.0f,0x%llx,%.4f,"
          "%s\n",
          prop.name, rt, drv, DETLOGP_GIT_SHA, date, command.c_str(), (long long)r.n, (long long)d, (long long)v,
          r.method.c_str(), r.ms, r.tflops, r.gbps, (long long)r.extra_bytes, r.ratio_bf16, r.ratio_f32, copy_gbps,
          floor_ms, r.sm_mhz, r.watts, r.clock_reasons, r.paired_bf16, r.data.c_str());
    std::fclose(f);
  }
  std::printf("\n%-7s %-36s %-9s %10s %9s %9s %12s %10s %10s %10s %7s %6s %8s\n", "N", "method", "data", "ms",
              "TFLOP/s", "GB/s", "extra_MB", "vs_bf16", "paired", "vs_f32", "SM_MHz", "W", "reasons");
  for (const auto& r : rows)
    std::printf("%-7lld %-36s %-9s %10.4f %9.1f %9.0f %12.1f %10.3f %10.3f %10.3f %7.0f %6.0f %8llx\n", (long long)r.n,
                r.method.c_str(), r.data.c_str(), r.ms, r.tflops, r.gbps, r.extra_bytes / 1048576.0, r.ratio_bf16,
                r.paired_bf16, r.ratio_f32, r.sm_mhz, r.watts, r.clock_reasons);
  for (const auto& line : call_lines) std::printf("%s\n", line.c_str());
  for (const auto& r : rows)
    if (r.n == 1 && r.method == "detlogp_trainer")
      std::printf("N=1 trainer vs HBM floor (%.4f ms at %.0f GB/s copy): %.3fx\n", floor_ms, copy_gbps,
                  r.ms / floor_ms);
  // One line per N (scripts/gpu_check.sh copies them into its summary).
  for (const auto& e : entropy_ratios)
    std::printf("entropy N=%lld: detlogp_trainer_entropy / detlogp_trainer = %.3fx (paired %.3fx), goal <= %.2fx: %s\n",
                (long long)e.n, e.ratio, e.paired, kEntropyGoal, e.paired <= kEntropyGoal ? "within" : "OVER");
  for (const auto& e : multi_ratios)
    std::printf("multi N=%lld: detlogp_trainer_multi8 / detlogp_trainer = %.3fx (paired %.3fx), goal <= 1.03x: %s\n",
                (long long)e.n, e.ratio, e.paired, e.paired <= 1.03 ? "within" : "OVER");
  for (const auto& e : shard_ratios)
    std::printf(
        "shards N=%lld TP=%d: rank 1 [%lld, %lld) / [%lld, %lld) (V / TP over 64-aligned) = %.3fx (paired %.3fx), goal "
        "<= 1.03x: %s\n",
        (long long)e.n, tp, (long long)unaligned.start, (long long)(unaligned.start + unaligned.count),
        (long long)aligned.start, (long long)(aligned.start + aligned.count), e.ratio, e.paired,
        e.paired <= 1.03 ? "within" : "OVER");
  std::printf("csv: %s\n", csv.c_str());
  return 0;
}

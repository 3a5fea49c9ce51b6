// detlogp run: one problem (built-in, a safetensors file or .npy files) through the library; prints
// the SHA-256 of the outputs and optionally writes them to a safetensors file.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <string_view>

#include "cli/commands.hpp"
#include "cli/compute.hpp"
#include "cli/problem.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"

namespace detlogp::cli {

namespace {

void run_help(std::ostream& os) {
  os << "usage: detlogp run [--input FILE.safetensors | --hidden A.npy --weight B.npy --targets C.npy]\n"
        "                   [options] [--out FILE.safetensors]\n\n"
        "Computes logp and lse per row (and logits with --return-logits, entropy with --entropy).\n"
        "Without an input it runs a built-in synthetic problem (N=64, D=1024, V=32000 unless changed)\n"
        "from a fixed-seed generator, so the same command prints the same SHA-256 on every machine\n"
        "with the same backend. A weight\n"
        "that is a vocabulary shard (vocab_start > 0 or vocab_start + V_local < real_vocab) has no\n"
        "logp/lse of its own: it is refused unless --partials asks for its tensor-parallel partials,\n"
        "tile_max, tile_sum [N, tiles] f32, target_logit [N] f32, target_owned [N] u8 (and with\n"
        "--entropy the tiles' entropy sums usums [N, tiles] f32; for a shard that is not 64-aligned\n"
        "the scaled logits of its lanes in the tiles that straddle its boundaries, edge_logits\n"
        "[N, edge_lanes] f32), written with their layout (vocab_start, vocab_local, real_vocab,\n"
        "ignore_index, backend, targets digest, the shard's tiles and edge lanes).\n"
        "The SHA-256 covers the raw little-endian bytes of the output tensors concatenated in the\n"
        "order printed (logp|lse[|logits][|entropy][|topk_ids|topk_logp], or the partials).\n"
        "targets may be [N, K] (K ids a row: logp [N, K]); --topk K adds topk_ids [N, K] i64 and\n"
        "topk_logp [N, K] f32.\n\n";
  print_option_help(os, command_options("run"));
  os << "\nexit codes: 0 ok, 1 --repeat saw differing bits, 2 usage error, 3 error (bad input, refused)\n";
}

// The entry --partials and --return-logits ask for; --partials needs the shard's place stated.
Entry requested_entry(const Options& o) {
  if (!o.flag("partials")) return o.flag("return-logits") ? Entry::serving : Entry::trainer;
  if (o.flag("return-logits"))
    throw UsageError("--partials and --return-logits exclude each other (a shard's partials carry no logits)");
  if (!o.has("vocab-start") || !o.has("real-vocab"))
    throw UsageError(
        "--partials needs --vocab-start (the global id of the weight's row 0) and --real-vocab (the whole "
        "vocabulary), the layout its output records");
  return Entry::partials;
}

HostProblem load_problem(const Options& o) {
  const bool from_npy =
      o.has("hidden") || o.has("weight") || o.has("targets") || o.has("bias") || o.has("temperatures");
  const bool synthetic_shape = o.has("rows") || o.has("dim") || o.has("vocab") || o.has("seed") || o.flag("with-bias");
  if (o.has("input") && from_npy) throw UsageError("--input and the .npy inputs (--hidden ...) exclude each other");
  if ((o.has("input") || from_npy) && synthetic_shape)
    throw UsageError("--rows/--dim/--vocab/--seed/--with-bias describe the synthetic problem; not with an input file");
  if (from_npy && !(o.has("hidden") && o.has("weight") && o.has("targets")))
    throw UsageError(".npy input needs --hidden, --weight and --targets");

  HostProblem p;
  if (o.has("input")) {
    const std::string path = o.text("input");
    if (path.size() >= 4 && path.substr(path.size() - 4) == ".npy")
      throw UsageError("--input takes a .safetensors file; for .npy use --hidden/--weight/--targets");
    p = problem_from_inputs(inputs_from_safetensors(path));
    p.source = path;
  } else if (from_npy) {
    std::map<std::string, std::string> paths;
    for (const char* name : {"hidden", "weight", "targets", "bias", "temperatures"}) {
      if (!o.has(name)) continue;
      paths[std::string(name) == "temperatures" ? "temperature" : name] = o.text(name);
    }
    p = problem_from_inputs(inputs_from_npy(paths));
    p.source = "npy files";
  } else {
    const int64_t rows = o.integer("rows", 64, 0, int64_t{1} << 24);
    const int64_t dim = o.integer("dim", 1024, 1, int64_t{1} << 20);
    const int64_t vocab = o.integer("vocab", 32000, 1, int64_t{1} << 24);
    const int64_t seed = o.integer("seed", 0, 0, INT64_MAX);
    if (rows * dim > (int64_t{1} << 30) || vocab * dim > (int64_t{1} << 31))
      throw UsageError("synthetic problem too large (N*D <= 2^30 and V*D <= 2^31)");
    const int64_t real_vocab = o.integer("real-vocab", -1, 1, INT64_MAX);
    const int64_t ignore_index = o.integer("ignore-index", kDefaultIgnoreIndex, INT64_MIN, INT64_MAX);
    p = synthetic_problem(static_cast<uint64_t>(seed), rows, dim, vocab, real_vocab, ignore_index, o.flag("with-bias"));
    std::ostringstream src;
    src << "synthetic (seed " << seed << (o.flag("with-bias") ? ", with bias" : "") << ")";
    p.source = src.str();
  }
  if (o.has("real-vocab")) p.real_vocab = o.integer("real-vocab", -1, 1, INT64_MAX);
  p.vocab_start = o.integer("vocab-start", 0, 0, INT64_MAX);
  p.ignore_index = o.integer("ignore-index", p.ignore_index, INT64_MIN, INT64_MAX);
  if (o.has("temperature")) {
    if (p.temperature_from_input)
      throw UsageError("--temperature given but the input already has a 'temperature' tensor");
    p.temperature = float32_temperature(o.real("temperature", 1.0));
  }
  return p;
}

// The --out path, checked before any work: a .safetensors name that can become a file (its
// missing directories are created when it is written, after the computation succeeded).
std::filesystem::path checked_out_path(const Options& o) {
  if (!o.has("out")) return {};
  const std::filesystem::path out_path = o.text("out");
  if (out_path.extension() != ".safetensors") throw UsageError("--out must name a .safetensors file");
  io::check_output_file(out_path);
  return out_path;
}

void print_summary(const HostProblem& p, const RunOutputs& out, double best_seconds, int64_t repeat,
                   const std::string& sha) {
  std::ostringstream temperature;
  if (!p.temperature_rows.present())
    temperature << p.temperature;
  else
    temperature << "per-row";
  std::cout << "problem: " << p.source << ": N=" << p.rows << " D=" << p.dim << " V_local=" << p.vocab_local
            << " real_vocab=" << p.effective_real_vocab() << " vocab_start=" << p.vocab_start
            << " ignore_index=" << p.ignore_index << " temperature=" << temperature.str()
            << " bias=" << (p.bias.present() ? "yes" : "no") << "\n";
  std::cout << "backend: " << describe_report(out.report) << "\n";
  std::cout << "entry: "
            << (out.entry == Entry::partials  ? "partials (vocab shard)"
                : out.entry == Entry::serving ? "serving (logits)"
                                              : "trainer")
            << "\n";
  std::ostringstream timing;
  timing.setf(std::ios::fixed);
  timing.precision(3);
  timing << "time: " << best_seconds * 1e3 << " ms" << (repeat > 1 ? " (best of " + std::to_string(repeat) + ")" : "");
  timing.precision(0);
  timing << ", " << (best_seconds > 0 ? static_cast<double>(p.rows) / best_seconds : 0.0) << " rows/s";
  std::cout << timing.str() << "\n";
  std::cout << "sha256(" << sha_scope(out) << "): " << sha << "\n";
}

int command_run(const Options& o) {
  check_environment();
  const int64_t repeat = o.integer("repeat", 1, 1, 1000);
  const Entry entry = requested_entry(o);
  const std::filesystem::path out_path = checked_out_path(o);
  const HostProblem p = load_problem(o);
  const CallOptions opt = call_options(o);
  // The range is the library's check (topk in [1, 128], <= real_vocab): any integer >= 1 reaches it
  // (compute allocates no [N, K] buffers for a K beyond 128).
  const int64_t topk = o.has("topk") ? o.integer("topk", 0, 1, std::numeric_limits<int64_t>::max()) : 0;

  RunOutputs out;
  double best_seconds = 0;
  std::string first_sha;
  for (int64_t r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    RunOutputs current = compute(p, entry, opt, o.flag("entropy"), topk);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string sha = output_sha256(current);
    if (r == 0) {
      first_sha = sha;
      best_seconds = seconds;
      out = std::move(current);
    } else {
      best_seconds = std::min(best_seconds, seconds);
      if (sha != first_sha) {
        std::cerr << "detlogp run: repeat " << r << " gave different bits: sha256 " << sha << " vs " << first_sha
                  << "\n";
        return kExitCheckFailed;
      }
    }
  }
  print_summary(p, out, best_seconds, repeat, first_sha);

  if (!out_path.empty()) {
    io::SafetensorsContents file;
    for (auto& [name, t] : out.tensors) file.add(name, std::move(t));
    if (out.entry == Entry::partials) file.metadata = partials_metadata(p, out);
    file.metadata["format"] = out.entry == Entry::partials ? "detlogp-partials-v2" : "detlogp-output-v1";
    file.metadata["detlogp_version"] = version_string();
    file.metadata["provenance"] = to_string(out.report.provenance);
    file.metadata["sha256"] = first_sha;
    io::write_safetensors(out_path, file);
    std::cout << "wrote: " << out_path.string() << "\n";
  }
  return kExitOk;
}

}  // namespace

const Command kRunCommand{run_help, command_run};

}  // namespace detlogp::cli

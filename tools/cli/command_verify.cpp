// detlogp verify: the validation ladder on one backend with a built-in problem (docs/cli.md);
// `verify --golden` is in command_verify_golden.cpp.
#include <algorithm>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
#include <set>

#include "cli/bits.hpp"
#include "cli/commands.hpp"
#include "cli/compute.hpp"
#include "cli/problem.hpp"
#include "detlogp/dist.hpp"
#include "detlogp/fpops.hpp"

namespace detlogp::cli {

namespace {

void verify_help(std::ostream& os) {
  os << "usage: detlogp verify [--backend ID] [--strict] [--seed S] [--dim D] [--vocab V]\n"
        "       detlogp verify --golden [--backend ID] [--strict] [--record] [--case A,B] [--golden-file F]\n\n"
        "--golden replays the golden cases (docs/validation.md) and compares the SHA-256 of their output\n"
        "bytes with the fingerprints recorded for this backend's (contract version, arch, cc): PASS, FAIL,\n"
        "or NOT RECORDED (exit 1); --record appends the missing ones to the file and prints them.\n\n"
        "Runs the validation ladder on one backend with a built-in problem (a pool of 1000 rows, bias,\n"
        "temperature 0.7, some ignored rows) and prints one line per check. Every comparison is on\n"
        "bit patterns (so -0.0 vs +0.0 and NaN payloads differ):\n"
        "  L1 repeat          the same batch three times gives identical logp, lse and logits\n"
        "  L2 N=...           rows drawn from the pool (with duplicates) at random positions in batches of\n"
        "                     N in {1,2,3,7,63,64,65,127,128,1000} match the pool's own result\n"
        "  L2 permuted / duplicated / strided   the pool permuted, one row 65 times, rows with a gap\n"
        "  serving == trainer logp and lse do not change when logits are returned\n"
        "  TP R=1,2,4,8       simulate_tensor_parallel equals the single-shard result\n"
        "  padded vocab       extra weight rows beyond real_vocab (random, and huge) change nothing\n"
        "  temperature rows   per-row temperatures equal to the scalar give the scalar's bits\n"
        "  ignore_index       ignored rows have logp = +0.0 exactly\n"
        "  reduce_logits      the backend's logits re-reduced by reduce_logits give identical bits\n\n";
  print_option_help(os, command_options("verify"));
  os << "\nexit codes: 0 every check passed, 1 a check failed, 2 usage error, 3 error (refused, ...)\n";
}

struct VerifyPool {
  int64_t rows = 0, dim = 0, vocab = 0;
  std::vector<uint16_t> hidden, weight;
  std::vector<float> bias;
  std::vector<int64_t> targets;
  float temperature = 0.7f;
  int64_t ignore_index = kDefaultIgnoreIndex;
};

struct Result {
  std::vector<float> logp, lse, logits;
};

struct Batch {
  std::vector<int64_t> pool_rows;  // batch row i is pool row pool_rows[i]
  int64_t hidden_stride_pad = 0;   // extra elements between hidden rows
};

class Verifier {
 public:
  Verifier(VerifyPool pool, CallOptions opt) : pool_(std::move(pool)), opt_(std::move(opt)) {}

  // Runs a batch through linear_logp. weight_rows > vocab pads the weight with extra rows
  // (huge_padding: values near the bf16 maximum) while real_vocab stays the pool's vocabulary.
  Result run(const Batch& batch, bool logits, int64_t weight_rows = -1, bool huge_padding = false,
             bool temperature_rows = false, int tp_ranks = 0) {
    const int64_t n = static_cast<int64_t>(batch.pool_rows.size());
    const int64_t stride = pool_.dim + batch.hidden_stride_pad;
    std::vector<uint16_t> hidden(static_cast<size_t>(std::max<int64_t>(1, n * stride)), 0xFFC1);  // NaN filler
    std::vector<int64_t> targets(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t src = batch.pool_rows[static_cast<size_t>(i)];
      std::copy_n(pool_.hidden.begin() + src * pool_.dim, pool_.dim, hidden.begin() + i * stride);
      targets[static_cast<size_t>(i)] = pool_.targets[static_cast<size_t>(src)];
    }
    const int64_t v_local = weight_rows < 0 ? pool_.vocab : weight_rows;
    const std::vector<uint16_t>& weight = weight_rows < 0 ? pool_.weight : padded_weight(v_local, huge_padding);
    std::vector<float> bias = pool_.bias;
    bias.resize(static_cast<size_t>(v_local), huge_padding ? 1e30f : 0.25f);
    std::vector<float> temps(static_cast<size_t>(n), pool_.temperature);

    LinearLogpInputs in;
    in.hidden = TensorView::matrix(hidden.data(), DType::bf16, n, pool_.dim, Memory::host, stride);
    in.weight = TensorView::matrix(weight.data(), DType::bf16, v_local, pool_.dim);
    in.bias = TensorView::vector(bias.data(), DType::f32, v_local);
    in.targets = TensorView::vector(targets.data(), DType::i64, n);
    in.temperature = pool_.temperature;
    if (temperature_rows) in.temperature_rows = TensorView::vector(temps.data(), DType::f32, n);
    in.real_vocab = pool_.vocab;
    in.ignore_index = pool_.ignore_index;

    Result r;
    r.logp.assign(static_cast<size_t>(n), 0.0f);
    r.lse.assign(static_cast<size_t>(n), 0.0f);
    LinearLogpOutputs out{
        mutable_vector(r.logp.data(), DType::f32, n), mutable_vector(r.lse.data(), DType::f32, n), {}};
    if (logits) {
      r.logits.assign(static_cast<size_t>(n * v_local), 0.0f);
      out.logits = mutable_matrix(r.logits.data(), DType::f32, n, v_local);
    }
    const CallReport report =
        tp_ranks > 0 ? simulate_tensor_parallel(in, tp_ranks, out, opt_) : linear_logp(in, out, opt_);
    if (served_by_.empty()) served_by_ = describe_report(report);
    return r;
  }

  const VerifyPool& pool() const { return pool_; }
  const std::string& served_by() const { return served_by_; }

 private:
  const std::vector<uint16_t>& padded_weight(int64_t rows, bool huge) {
    auto& cached = padded_[{rows, huge}];
    if (cached.empty()) {
      cached = pool_.weight;
      ProblemRng rng(7, static_cast<uint64_t>(rows));
      cached.resize(static_cast<size_t>(rows * pool_.dim));
      for (size_t i = pool_.weight.size(); i < cached.size(); ++i)
        cached[i] = huge ? static_cast<uint16_t>((rng.next() & 1 ? 0xFF00 : 0x7F00) | (rng.next() & 0x7F))
                         : fp::bf16_round(rng.bell() * 0.1f);
    }
    return cached;
  }

  VerifyPool pool_;
  CallOptions opt_;
  std::string served_by_;
  std::map<std::pair<int64_t, bool>, std::vector<uint16_t>> padded_;
};

struct Verdict {
  std::string name;
  bool pass;
  std::string detail;
};

// The first non-empty mismatch description, or "".
std::string first_of(std::initializer_list<std::string> mismatches) {
  for (const std::string& m : mismatches)
    if (!m.empty()) return m;
  return "";
}

VerifyPool built_in_pool(uint64_t seed, const Options& o) {
  VerifyPool pool;
  pool.rows = 1000;
  pool.dim = o.integer("dim", 256, 1, 1 << 16);
  pool.vocab = o.integer("vocab", 2053, 1, 1 << 20);
  SyntheticTensors t = synthetic_tensors(seed, pool.rows, pool.dim, pool.vocab, pool.vocab, pool.ignore_index, true);
  pool.hidden = std::move(t.hidden);
  pool.weight = std::move(t.weight);
  pool.bias = std::move(t.bias);
  pool.targets = std::move(t.targets);
  return pool;
}

int print_verdicts(const Verifier& v, uint64_t seed, const std::vector<Verdict>& verdicts) {
  const VerifyPool& P = v.pool();
  std::cout << "detlogp verify: " << v.served_by() << "\n";
  std::cout << "problem: pool of " << P.rows << " rows, D=" << P.dim << ", real_vocab=" << P.vocab
            << ", bias, temperature " << P.temperature << ", seed " << seed << "\n";
  int failures = 0;
  for (const Verdict& verdict : verdicts) {
    std::string name = verdict.name;
    name.append(28 - std::min<size_t>(28, name.size()), ' ');
    std::cout << "  " << name << (verdict.pass ? "PASS  " : "FAIL  ") << verdict.detail << "\n";
    failures += verdict.pass ? 0 : 1;
  }
  std::cout << (failures == 0 ? "verdict: PASS (" + std::to_string(verdicts.size()) + " checks)"
                              : "verdict: FAIL (" + std::to_string(failures) + " of " +
                                    std::to_string(verdicts.size()) + " checks failed)")
            << "\n";
  return failures == 0 ? kExitOk : kExitCheckFailed;
}

int command_verify(const Options& o) {
  if (o.flag("golden")) return command_verify_golden(o);
  if (o.flag("record") || o.has("case") || o.has("golden-file"))
    throw UsageError("--record, --case and --golden-file go with --golden");
  check_environment();
  const uint64_t seed = static_cast<uint64_t>(o.integer("seed", 0, 0, INT64_MAX));
  Verifier v(built_in_pool(seed, o), call_options(o));
  const VerifyPool& P = v.pool();

  std::vector<Verdict> verdicts;
  auto check = [&](const std::string& name, const std::function<std::string(std::string*)>& body) {
    std::string detail;
    try {
      const std::string mismatch = body(&detail);
      verdicts.push_back({name, mismatch.empty(), mismatch.empty() ? detail : mismatch});
    } catch (const std::exception& e) {
      verdicts.push_back({name, false, std::string("error: ") + e.what()});
    }
  };

  std::vector<int64_t> all_rows(static_cast<size_t>(P.rows));
  std::iota(all_rows.begin(), all_rows.end(), 0);
  const Batch first128{{all_rows.begin(), all_rows.begin() + std::min<int64_t>(128, P.rows)}, 0};

  // The reference: the whole pool as one batch, served with logits.
  Result reference;
  try {
    reference = v.run({all_rows, 0}, true);
  } catch (const Error& e) {
    std::cerr << "detlogp verify: the backend cannot run the built-in problem: " << e.what() << "\n";
    return kExitError;
  }
  auto compare_rows = [&](const Result& r, const std::vector<int64_t>& pool_rows) {
    return first_of({compare_bits("logp", r.logp, reference.logp, pool_rows),
                     compare_bits("lse", r.lse, reference.lse, pool_rows)});
  };
  auto compare_first128 = [&](const Result& r) {
    return first_of({compare_bits("logp", r.logp, {reference.logp.begin(), reference.logp.begin() + 128}),
                     compare_bits("lse", r.lse, {reference.lse.begin(), reference.lse.begin() + 128})});
  };

  check("L1 repeat", [&](std::string* detail) {
    const Result a = v.run(first128, true), b = v.run(first128, true), c = v.run(first128, true);
    *detail = "3 runs x 128 rows: logp, lse, logits identical";
    return first_of({compare_bits("logp", b.logp, a.logp), compare_bits("lse", b.lse, a.lse),
                     compare_bits("logits", b.logits, a.logits), compare_bits("logp", c.logp, a.logp),
                     compare_bits("lse", c.lse, a.lse), compare_bits("logits", c.logits, a.logits)});
  });

  ProblemRng rng(seed, kStreamVerify);
  for (int64_t n : {1, 2, 3, 7, 63, 64, 65, 127, 128, 1000}) {
    check("L2 N=" + std::to_string(n), [&](std::string* detail) {
      Batch batch;
      for (int64_t i = 0; i < n; ++i) batch.pool_rows.push_back(static_cast<int64_t>(rng.next() % P.rows));
      const std::set<int64_t> distinct(batch.pool_rows.begin(), batch.pool_rows.end());
      *detail = std::to_string(n) + " random pool rows (" + std::to_string(distinct.size()) +
                " distinct) match the N=1000 reference";
      return compare_rows(v.run(batch, false), batch.pool_rows);
    });
  }
  check("L2 permuted", [&](std::string* detail) {
    Batch batch{all_rows, 0};
    for (size_t i = batch.pool_rows.size(); i > 1; --i)  // Fisher-Yates with our own generator
      std::swap(batch.pool_rows[i - 1], batch.pool_rows[static_cast<size_t>(rng.next() % i)]);
    *detail = "the pool in a random order";
    return compare_rows(v.run(batch, false), batch.pool_rows);
  });
  check("L2 duplicated", [&](std::string* detail) {
    Batch batch{std::vector<int64_t>(65, 17), 0};
    *detail = "pool row 17 repeated 65 times";
    return compare_rows(v.run(batch, false), batch.pool_rows);
  });
  check("L2 strided", [&](std::string* detail) {
    Batch batch = first128;
    batch.hidden_stride_pad = 64;
    *detail = "hidden rows 64 elements apart (NaN filler between them)";
    return compare_rows(v.run(batch, false), batch.pool_rows);
  });
  check("serving == trainer", [&](std::string* detail) {
    const Result trainer = v.run(first128, false), serving = v.run(first128, true);
    *detail = "128 rows: logp and lse identical with and without logits";
    return first_of({compare_bits("logp", serving.logp, trainer.logp), compare_bits("lse", serving.lse, trainer.lse),
                     compare_first128(trainer)});
  });
  for (int ranks : {1, 2, 4, 8}) {
    check("TP R=" + std::to_string(ranks), [&](std::string* detail) {
      const Result tp = v.run(first128, false, -1, false, false, ranks);
      *detail = "simulate_tensor_parallel over " + std::to_string(ranks) + " shards == TP=1";
      return compare_first128(tp);
    });
  }
  const int64_t tile_padded = (P.vocab + 63) / 64 * 64 + 64;
  for (auto [rows, huge] : {std::pair<int64_t, bool>{tile_padded, false}, {P.vocab + 2048, true}}) {
    check("padded vocab " + std::to_string(rows) + (huge ? " huge" : ""),
          [&, rows = rows, huge = huge](std::string* d) {
            const Result r = v.run(first128, true, rows, huge);
            *d = std::to_string(rows - P.vocab) + (huge ? " rows of near-max bf16 and 1e30 bias" : " random rows") +
                 " beyond real_vocab: logp, lse and the real logits identical";
            std::vector<float> real_logits;
            for (int64_t i = 0; i < 128; ++i)
              real_logits.insert(real_logits.end(), r.logits.begin() + i * rows, r.logits.begin() + i * rows + P.vocab);
            const std::vector<float> ref_logits(reference.logits.begin(), reference.logits.begin() + 128 * P.vocab);
            return first_of({compare_first128(r), compare_bits("logits", real_logits, ref_logits)});
          });
  }
  check("temperature rows", [&](std::string* detail) {
    *detail = "temperature_rows all 0.7 == scalar 0.7";
    return compare_first128(v.run(first128, false, -1, false, true));
  });
  check("ignore_index", [&](std::string* detail) {
    int64_t ignored = 0;
    for (int64_t i = 0; i < P.rows; ++i) {
      if (P.targets[static_cast<size_t>(i)] != P.ignore_index) continue;
      ++ignored;
      if (fp::bits(reference.logp[static_cast<size_t>(i)]) != 0u)
        return "logp[" + std::to_string(i) + "] = " + describe_bits(reference.logp[static_cast<size_t>(i)]) +
               " for an ignored row, expected +0.0 (0x00000000)";
    }
    *detail = std::to_string(ignored) + " ignored rows have logp = +0.0 exactly";
    return std::string();
  });
  check("reduce_logits", [&](std::string* detail) {
    std::vector<float> logp(static_cast<size_t>(P.rows)), lse(static_cast<size_t>(P.rows));
    ReduceLogitsInputs in;
    in.logits = TensorView::matrix(reference.logits.data(), DType::f32, P.rows, P.vocab);
    in.targets = TensorView::vector(P.targets.data(), DType::i64, P.rows);
    in.temperature = P.temperature;
    in.real_vocab = P.vocab;
    in.ignore_index = P.ignore_index;
    reduce_logits(in, mutable_vector(logp.data(), DType::f32, P.rows), mutable_vector(lse.data(), DType::f32, P.rows));
    *detail = "the backend's logits [1000, " + std::to_string(P.vocab) + "] re-reduced: identical logp, lse";
    return first_of({compare_bits("logp", logp, reference.logp), compare_bits("lse", lse, reference.lse)});
  });
  return print_verdicts(v, seed, verdicts);
}

}  // namespace

const Command kVerifyCommand{verify_help, command_verify};

}  // namespace detlogp::cli

#include "golden/harness.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "golden/generator.hpp"
#include "golden/goldens.hpp"
#include "io/safetensors.hpp"

namespace detlogp::golden {

namespace {

using io::ElementType;
using io::HostTensor;

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

std::string hex_bits(float x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", bits_of(x));
  return buf;
}

std::string num(double x) {
  if (!std::isfinite(x)) return "null";  // JSON has no NaN or inf
  std::ostringstream os;
  os.precision(17);
  os << x;
  return os.str();
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      o += '\\';
      o += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      o += buf;
    } else {
      o += ch;
    }
  }
  return o + "\"";
}

HostTensor f32_tensor(const std::vector<float>& v) {
  HostTensor t = HostTensor::zeros(ElementType::f32, {static_cast<int64_t>(v.size())});
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}

// What one side observed: the backend of every call, and whether any call fell back.
struct SideReadback {
  std::string backend, provenance;
  int64_t calls = 0, fallbacks = 0;
  std::string fallback_reason;
  void add(const CallReport& r) {
    const std::string p = to_string(r.provenance);
    if (calls == 0) {
      backend = r.provenance.backend_id;
      provenance = p;
    }
    DETLOGP_CHECK(p == provenance, "one side was served by two backends: " << provenance << " and " << p);
    ++calls;
    if (r.fallback) {
      ++fallbacks;
      fallback_reason = r.fallback_reason;
    }
  }
};

// Trainer entry, vocabulary parallel, through the tensor-parallel operator (one thread per rank);
// empty shards (a head smaller than the TP degree's tiles) are left out.
void trainer_tensor_parallel(const LinearLogpInputs& in, const std::vector<Shard>& shards, float* logp, float* lse,
                             const CallOptions& opt, SideReadback& rb, const TpPlacement& placement = {},
                             float* logits = nullptr) {
  std::vector<Shard> used;
  for (const Shard& s : shards)
    if (s.weight.rows > 0) used.push_back(s);
  DETLOGP_CHECK(logits == nullptr || used.size() == shards.size(),
                "a serving call needs every shard non-empty (the logits columns are the shards')");
  std::vector<CallReport> reports;
  tensor_parallel_logp(in, used, logp, lse, opt, &reports, placement, logits);
  for (const CallReport& r : reports) rb.add(r);
}

std::vector<const GoldenCase*> select_cases(const std::vector<std::string>& names) {
  std::vector<const GoldenCase*> out;
  for (const GoldenCase& c : golden_cases())
    if (names.empty() || std::find(names.begin(), names.end(), c.name) != names.end()) out.push_back(&c);
  for (const std::string& n : names) {
    bool found = false;
    for (const GoldenCase* c : out) found |= c->name == n;
    DETLOGP_CHECK(found, "unknown golden case '" << n << "'");
  }
  return out;
}

}  // namespace

// ---- L3 ------------------------------------------------------------------------------------------

void l3_run_side(L3Side side, const std::vector<std::string>& names, int tp, const CallOptions& opt,
                 const std::string& out_path, std::ostream& log) {
  DETLOGP_CHECK(tp >= 1, "--tp=" << tp << " must be >= 1");
  io::SafetensorsContents file;
  SideReadback rb;
  for (const GoldenCase* c : select_cases(names)) {
    const CaseInputs in = make_inputs(*c);
    std::vector<float> logp(static_cast<size_t>(c->rows)), lse(static_cast<size_t>(c->rows));
    int ranks = 0;
    if (side == L3Side::trainer) {
      // One packed batch over `tp` vocabulary shards, trainer entry (no logits anywhere).
      std::vector<Shard> shards;
      for (auto [start, count] : shard_ranges(c->weight_rows, tp)) {
        const LinearLogpInputs v = in.view(start, count);
        shards.push_back({start, v.weight, v.bias});
        ranks += count > 0 ? 1 : 0;
      }
      trainer_tensor_parallel(in.view(), shards, logp.data(), lse.data(), opt, rb);
    } else {
      // One row at a time through the serving entry (logits [1, V] for the sampler).
      std::vector<float> logits(static_cast<size_t>(c->weight_rows));
      for (int64_t n = 0; n < c->rows; ++n) {
        LinearLogpInputs v = in.view();
        v.hidden = TensorView::matrix(in.hidden.data() + n * c->dim, DType::bf16, 1, c->dim);
        v.targets = c->targets_i32 ? TensorView::vector(in.targets32.data() + n, DType::i32, 1)
                                   : TensorView::vector(in.targets.data() + n, DType::i64, 1);
        if (c->temperature_rows) v.temperature_rows = TensorView::vector(in.temperatures.data() + n, DType::f32, 1);
        const size_t i = static_cast<size_t>(n);
        rb.add(linear_logp(v,
                           {mutable_vector(&logp[i], DType::f32, 1), mutable_vector(&lse[i], DType::f32, 1),
                            mutable_matrix(logits.data(), DType::f32, 1, c->weight_rows)},
                           opt));
      }
    }
    file.add(c->name + "/logp", f32_tensor(logp));
    file.add(c->name + "/lse", f32_tensor(lse));
    file.metadata[c->name + "/inputs_sha256"] = in.inputs_sha256();
    file.metadata[c->name + "/weight_fingerprint"] = in.weight_fingerprint;
    log << "  " << c->name << ": N=" << c->rows << " D=" << c->dim << " V=" << c->weight_rows
        << (side == L3Side::trainer ? " packed, TP=" + std::to_string(ranks) + " (non-empty shards), trainer entry"
                                    : std::string(" one row at a time, serving entry"))
        << "\n";
  }
  file.metadata["format"] = "detlogp-l3-v1";
  file.metadata["side"] = side == L3Side::trainer ? "trainer" : "rollout";
  file.metadata["producer"] = "detlogp-cli";
  file.metadata["pid"] = std::to_string(::getpid());
  file.metadata["backend"] = rb.backend;
  file.metadata["provenance"] = rb.provenance;
  file.metadata["calls"] = std::to_string(rb.calls);
  file.metadata["fallback"] = rb.fallbacks == 0 ? "no" : rb.fallback_reason;
  io::write_safetensors(out_path, file);
  log << "side " << file.metadata["side"] << ": " << rb.calls << " calls, backend " << rb.backend << ", fallback "
      << file.metadata["fallback"] << ", pid " << file.metadata["pid"] << "\nwrote: " << out_path << "\n";
}

bool l3_check(const std::string& a_path, const std::string& b_path, std::ostream& log) {
  const io::SafetensorsContents a = io::read_safetensors(a_path), b = io::read_safetensors(b_path);
  auto meta = [](const io::SafetensorsContents& f, const std::string& k) {
    auto it = f.metadata.find(k);
    return it == f.metadata.end() ? std::string("(missing)") : it->second;
  };
  for (const auto* f : {&a, &b})
    DETLOGP_CHECK(meta(*f, "format") == "detlogp-l3-v1", "'" << (f == &a ? a_path : b_path)
                                                             << "' is not a detlogp-l3-v1 file (format "
                                                             << meta(*f, "format") << ")");
  bool ok = true;
  for (const auto* f : {&a, &b}) {
    log << "side " << meta(*f, "side") << " (" << (f == &a ? a_path : b_path) << "): producer " << meta(*f, "producer")
        << ", pid " << meta(*f, "pid") << ", backend " << meta(*f, "backend") << ", fallback " << meta(*f, "fallback")
        << "\n  provenance: " << meta(*f, "provenance") << "\n";
    if (meta(*f, "fallback") != "no") ok = false;
  }
  if (meta(a, "pid") == meta(b, "pid") && meta(a, "producer") == meta(b, "producer")) {
    log << "  FAIL  both sides report the same process id: not two processes\n";
    ok = false;
  }
  std::set<std::string> cases;
  for (const auto* f : {&a, &b})
    for (const auto& t : f->tensors)
      if (t.name.size() > 5 && t.name.ends_with("/logp")) cases.insert(t.name.substr(0, t.name.size() - 5));
  for (const std::string& c : cases) {
    const HostTensor *la = a.find(c + "/logp"), *lb = b.find(c + "/logp");
    const HostTensor *sa = a.find(c + "/lse"), *sb = b.find(c + "/lse");
    std::string verdict;
    if (!la || !lb || !sa || !sb) {
      verdict = "FAIL  present on one side only";
    } else if (meta(a, c + "/weight_fingerprint") != meta(b, c + "/weight_fingerprint")) {
      verdict = "FAIL  weight fingerprints differ (" + meta(a, c + "/weight_fingerprint").substr(0, 16) + " vs " +
                meta(b, c + "/weight_fingerprint").substr(0, 16) + "): not compared";
    } else if (meta(a, c + "/inputs_sha256") != meta(b, c + "/inputs_sha256")) {
      verdict = "FAIL  inputs differ: not compared";
    } else if (la->bytes != lb->bytes || sa->bytes != sb->bytes) {
      const auto* pa = reinterpret_cast<const float*>(la->bytes.data());
      const auto* pb = reinterpret_cast<const float*>(lb->bytes.data());
      int64_t diff = 0;
      const size_t n = std::min(la->bytes.size(), lb->bytes.size()) / 4;
      for (size_t i = 0; i < n; ++i) diff += bits_of(pa[i]) != bits_of(pb[i]);
      verdict = "FAIL  " + std::to_string(diff) + " of " + std::to_string(n) + " logp differ" +
                (sa->bytes != sb->bytes ? " (lse differs too)" : "");
    } else {
      verdict = "PASS  " + std::to_string(la->bytes.size() / 4) + " rows: logp and lse bytes identical, weight " +
                meta(a, c + "/weight_fingerprint").substr(0, 16);
    }
    if (verdict.rfind("PASS", 0) != 0) ok = false;
    std::string name = c;
    name.append(24 - std::min<size_t>(24, name.size()), ' ');
    log << "  " << name << verdict << "\n";
  }
  if (cases.empty()) {
    log << "  FAIL  no cases\n";
    ok = false;
  }
  log << "verdict: " << (ok ? "PASS" : "FAIL") << "\n";
  return ok;
}

void l3_export_inputs(const std::vector<std::string>& names, const std::string& dir, std::ostream& log) {
  DETLOGP_CHECK(std::filesystem::is_directory(dir), "'" << dir << "' is not a directory");
  for (const GoldenCase* c : select_cases(names)) {
    const CaseInputs in = make_inputs(*c);
    io::SafetensorsContents f;
    HostTensor hidden = HostTensor::zeros(ElementType::bf16, {c->rows, c->dim});
    std::memcpy(hidden.data(), in.hidden.data(), in.hidden.size() * 2);
    HostTensor weight = HostTensor::zeros(ElementType::bf16, {c->weight_rows, c->dim});
    std::memcpy(weight.data(), in.weight.data(), in.weight.size() * 2);
    HostTensor targets = HostTensor::zeros(c->targets_i32 ? ElementType::i32 : ElementType::i64, {c->rows});
    if (c->targets_i32)
      std::memcpy(targets.data(), in.targets32.data(), in.targets32.size() * 4);
    else
      std::memcpy(targets.data(), in.targets.data(), in.targets.size() * 8);
    f.add("hidden", std::move(hidden));
    f.add("weight", std::move(weight));
    f.add("targets", std::move(targets));
    if (!in.bias.empty()) f.add("bias", f32_tensor(in.bias));
    if (c->temperature_rows) {
      f.add("temperature", f32_tensor(in.temperatures));
    } else {
      HostTensor t = HostTensor::zeros(ElementType::f32, {});
      std::memcpy(t.data(), &c->temperature, 4);
      f.add("temperature", std::move(t));
    }
    f.metadata["case"] = c->name;
    f.metadata["real_vocab"] = std::to_string(c->real_vocab);
    f.metadata["ignore_index"] = std::to_string(c->ignore_index);
    f.metadata["inputs_sha256"] = in.inputs_sha256();
    f.metadata["weight_fingerprint"] = in.weight_fingerprint;
    const std::string path = (std::filesystem::path(dir) / (c->name + ".safetensors")).string();
    io::write_safetensors(path, f);
    log << "wrote: " << path << " (real_vocab " << c->real_vocab << ", ignore_index " << c->ignore_index << ")\n";
  }
}

// ---- L4/L5 ---------------------------------------------------------------------------------------

namespace {

constexpr uint64_t kStreamKey = 201, kStreamDominant = 202, kStreamBos = 203;

// Hidden state of (sequence, position, previous token): the synthetic model's final hidden row.
// One position in four leans towards a token derived from the previous one (a confident step).
// `row_of(v)` returns lm_head row v from the caller's own copy of the head.
template <class RowOf>
void model_hidden(const HarnessConfig& cfg, int64_t real_vocab, const RowOf& row_of, int64_t s, int64_t p, int64_t prev,
                  uint16_t* out) {
  const uint64_t key =
      draw(cfg.seed, kStreamKey,
           (static_cast<uint64_t>(s) << 42) ^ (static_cast<uint64_t>(p) << 21) ^ static_cast<uint64_t>(prev));
  const bool confident = draw(cfg.seed, kStreamDominant, key) % 4 == 0;
  const int64_t lean = (prev * 31 + 7) % real_vocab;
  hidden_row(cfg.seed, key, cfg.dim, 1.0f, confident ? row_of(lean) : nullptr, out);
}

float temperature_of(const HarnessConfig& cfg, int64_t s) {
  static const float kTable[] = {0.6f, 0.7f, 0.85f, 1.0f, 1.3f};
  return kTable[draw(cfg.seed, kStreamTemperature, static_cast<uint64_t>(s)) % 5];
}

// Inverse-CDF sampling on softmax(z / T) over the real vocabulary, keyed by (seed, sequence,
// position). The sampler's arithmetic (double, libm exp) is not part of the contract: only the
// chosen token is recorded, and the trainer is given that token.
int64_t sample(const HarnessConfig& cfg, const float* z, int64_t real_vocab, float T, int64_t s, int64_t p) {
  double m = -INFINITY;
  for (int64_t v = 0; v < real_vocab; ++v) m = std::max(m, static_cast<double>(z[v]) / T);
  double total = 0;
  std::vector<double> cdf(static_cast<size_t>(real_vocab));
  for (int64_t v = 0; v < real_vocab; ++v)
    cdf[static_cast<size_t>(v)] = total += std::exp(z[v] / static_cast<double>(T) - m);
  const double u = uniform(cfg.seed, kStreamSampler, (static_cast<uint64_t>(s) << 32) | static_cast<uint64_t>(p));
  const auto it = std::upper_bound(cdf.begin(), cdf.end(), u * total);
  return std::min<int64_t>(real_vocab - 1, it - cdf.begin());
}

// The negative control: what a materializing engine records. Logits rounded to bf16, then a plain
// fp32 log-softmax at the temperature (libm exp/log, sequential sum).
float materialized_bf16_logp(const float* z, int64_t real_vocab, float T, int64_t t) {
  std::vector<float> y(static_cast<size_t>(real_vocab));
  float m = -INFINITY;
  for (int64_t v = 0; v < real_vocab; ++v) {
    y[static_cast<size_t>(v)] = from_bf16(to_bf16(z[v])) / T;
    m = std::max(m, y[static_cast<size_t>(v)]);
  }
  float sum = 0;
  for (float yv : y) sum += std::exp(yv - m);
  return y[static_cast<size_t>(t)] - (m + std::log(sum));
}

Metrics compare(const std::vector<float>& train, const std::vector<float>& rollout, std::vector<double>* k3_out) {
  Metrics m;
  m.total = static_cast<int64_t>(train.size());
  double sum = 0, k3_sum = 0;
  for (size_t i = 0; i < train.size(); ++i) {
    m.mismatch_count += bits_of(train[i]) != bits_of(rollout[i]);
    const double d = static_cast<double>(train[i]) - static_cast<double>(rollout[i]);
    sum += std::fabs(d);
    m.current_rollout_logprob_max_abs_diff = std::max(m.current_rollout_logprob_max_abs_diff, std::fabs(d));
    // rho = exp(logp_train - logp_rollout); d == 0 gives rho = 1 and K3 = 0 exactly.
    const double rho = std::exp(d);
    const double k3 = rho - 1.0 - std::log(rho);
    if (k3_out) k3_out->push_back(k3);
    m.k3_max = std::max(m.k3_max, k3);
    k3_sum += k3;
    m.k3_nonzero += k3 != 0.0;
  }
  m.train_rollout_logprob_abs_diff = m.total ? sum / static_cast<double>(m.total) : 0;
  m.k3_mean = m.total ? k3_sum / static_cast<double>(m.total) : 0;
  return m;
}

bool all_zero(const Metrics& m) {
  return m.mismatch_count == 0 && m.train_rollout_logprob_abs_diff == 0 &&
         m.current_rollout_logprob_max_abs_diff == 0 && m.k3_max == 0 && m.k3_nonzero == 0;
}

std::string metrics_json(const Metrics& m) {
  std::ostringstream o;
  o << "{\"total\": " << m.total << ", \"mismatch_count\": " << m.mismatch_count
    << ", \"train_rollout_logprob_abs_diff\": " << num(m.train_rollout_logprob_abs_diff)
    << ", \"current_rollout_logprob_max_abs_diff\": " << num(m.current_rollout_logprob_max_abs_diff)
    << ", \"k3_max\": " << num(m.k3_max) << ", \"k3_mean\": " << num(m.k3_mean) << ", \"k3_nonzero\": " << m.k3_nonzero
    << "}";
  return o.str();
}

}  // namespace

HarnessResult run_rollout_vs_trainer(const HarnessConfig& cfg, std::ostream& log) {
  const int64_t real_vocab = cfg.real_vocab < 0 ? cfg.weight_rows : cfg.real_vocab;
  DETLOGP_CHECK(
      cfg.seqs >= 1 && cfg.max_len >= 1 && cfg.max_batch >= 1 && cfg.tp >= 1 && cfg.cp >= 1 && cfg.rollout_tp >= 1,
      "seqs, max_len, max_batch, tp, cp and rollout_tp must be >= 1");
  DETLOGP_CHECK(real_vocab >= 1 && real_vocab <= cfg.weight_rows,
                "real_vocab=" << real_vocab << " must be in [1, weight_rows=" << cfg.weight_rows << "]");

  // ---- rollout engine: the whole head (TP = 1), loaded on its own.
  const std::vector<uint16_t> rollout_weight = weight_rows(cfg.seed, 0, cfg.weight_rows, cfg.dim);
  const std::string rollout_fp =
      weight_fingerprint({TensorView::matrix(rollout_weight.data(), DType::bf16, cfg.weight_rows, cfg.dim)});
  auto rollout_row = [&](int64_t v) { return rollout_weight.data() + v * cfg.dim; };
  std::vector<Shard> rollout_shards;  // views of the same head, when the engine is TP > 1
  for (auto [start, count] : shard_ranges(cfg.weight_rows, cfg.rollout_tp))
    rollout_shards.push_back(
        {start, TensorView::matrix(rollout_weight.data() + start * cfg.dim, DType::bf16, count, cfg.dim), {}});

  struct Seq {
    int64_t len, arrival;
    float T;
    std::vector<int64_t> tokens;  // tokens[0] = BOS, then one sampled token per position
    std::vector<float> logp, control;
  };
  std::vector<Seq> seqs(static_cast<size_t>(cfg.seqs));
  for (int64_t s = 0; s < cfg.seqs; ++s) {
    Seq& q = seqs[static_cast<size_t>(s)];
    q.len = 1 + static_cast<int64_t>(draw(cfg.seed, kStreamSchedule, 2 * s) % static_cast<uint64_t>(cfg.max_len));
    q.arrival = static_cast<int64_t>(draw(cfg.seed, kStreamSchedule, 2 * s + 1) % static_cast<uint64_t>(cfg.seqs));
    q.T = temperature_of(cfg, s);
    q.tokens.push_back(static_cast<int64_t>(draw(cfg.seed, kStreamBos, s) % static_cast<uint64_t>(real_vocab)));
  }

  SideReadback rollout_rb, trainer_rb;
  int64_t steps = 0, max_active = 0, batch_calls = 0, lse_readback_mismatch = 0;
  std::set<size_t> batch_sizes;
  std::vector<int64_t> active, previous;
  int64_t membership_changes = 0;  // steps whose set of sequences differs from the step before
  for (int64_t step = 0;; ++step) {
    // Join: arrived sequences take free slots in sequence order; leave: finished ones drop out.
    active.erase(std::remove_if(active.begin(), active.end(),
                                [&](int64_t s) {
                                  const Seq& q = seqs[static_cast<size_t>(s)];
                                  return static_cast<int64_t>(q.logp.size()) == q.len;
                                }),
                 active.end());
    bool waiting = false;
    for (int64_t s = 0; s < cfg.seqs; ++s) {
      const Seq& q = seqs[static_cast<size_t>(s)];
      if (!q.logp.empty() || std::find(active.begin(), active.end(), s) != active.end()) continue;
      if (q.arrival <= step && static_cast<int64_t>(active.size()) < cfg.max_batch)
        active.push_back(s);
      else
        waiting = true;
    }
    if (active.empty() && !waiting) break;
    if (active.empty()) continue;
    {
      std::vector<int64_t> now = active;
      std::sort(now.begin(), now.end());
      membership_changes += now != previous ? 1 : 0;
      previous = std::move(now);
    }
    // A different batch order every step (Fisher-Yates keyed by the step).
    std::vector<int64_t> order = active;
    for (size_t i = order.size(); i > 1; --i)
      std::swap(order[i - 1], order[draw(cfg.seed, kStreamSchedule, 1000000 + step * 64 + i) % i]);
    const int64_t b = static_cast<int64_t>(order.size());
    std::vector<uint16_t> hidden(static_cast<size_t>(b * cfg.dim));
    std::vector<float> temps(static_cast<size_t>(b)), logits(static_cast<size_t>(b * cfg.weight_rows));
    std::vector<float> lse(static_cast<size_t>(b)), unused_logp(static_cast<size_t>(b));
    std::vector<int64_t> none(static_cast<size_t>(b), kDefaultIgnoreIndex);
    for (int64_t i = 0; i < b; ++i) {
      const Seq& q = seqs[static_cast<size_t>(order[static_cast<size_t>(i)])];
      const int64_t p = static_cast<int64_t>(q.logp.size());
      model_hidden(cfg, real_vocab, rollout_row, order[static_cast<size_t>(i)], p, q.tokens.back(),
                   hidden.data() + i * cfg.dim);
      temps[static_cast<size_t>(i)] = q.T;
    }
    // One serving-entry call for the step: fp32 logits for the sampler, and lse.
    LinearLogpInputs in;
    in.hidden = TensorView::matrix(hidden.data(), DType::bf16, b, cfg.dim);
    in.weight = TensorView::matrix(rollout_weight.data(), DType::bf16, cfg.weight_rows, cfg.dim);
    in.targets = TensorView::vector(none.data(), DType::i64, b);
    in.temperature_rows = TensorView::vector(temps.data(), DType::f32, b);
    in.real_vocab = real_vocab;
    if (cfg.rollout_tp == 1) {
      rollout_rb.add(
          linear_logp(in,
                      {mutable_vector(unused_logp.data(), DType::f32, b), mutable_vector(lse.data(), DType::f32, b),
                       mutable_matrix(logits.data(), DType::f32, b, cfg.weight_rows)},
                      cfg.rollout_opt));
    } else {  // a TP engine: vocab-parallel serving entry, the logits shards gathered for the sampler
      trainer_tensor_parallel(in, rollout_shards, unused_logp.data(), lse.data(), cfg.rollout_opt, rollout_rb,
                              TpPlacement{cfg.devices}, logits.data());
    }
    ++batch_calls;
    std::vector<int64_t> sampled(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) {
      const Seq& q = seqs[static_cast<size_t>(order[static_cast<size_t>(i)])];
      sampled[static_cast<size_t>(i)] = sample(cfg, logits.data() + i * cfg.weight_rows, real_vocab, q.T,
                                               order[static_cast<size_t>(i)], static_cast<int64_t>(q.logp.size()));
    }
    // The sampled token's logp: the contract reducer over the served logits (portable: the same
    // bits as the fused operator); its lse must equal the fused call's lse bit for bit.
    std::vector<float> logp(static_cast<size_t>(b)), lse2(static_cast<size_t>(b));
    ReduceLogitsInputs r;
    r.logits = TensorView::matrix(logits.data(), DType::f32, b, cfg.weight_rows);
    r.targets = TensorView::vector(sampled.data(), DType::i64, b);
    r.temperature_rows = TensorView::vector(temps.data(), DType::f32, b);
    r.real_vocab = real_vocab;
    reduce_logits(r, mutable_vector(logp.data(), DType::f32, b), mutable_vector(lse2.data(), DType::f32, b));
    for (int64_t i = 0; i < b; ++i) {
      const size_t k = static_cast<size_t>(i);
      lse_readback_mismatch += bits_of(lse[k]) != bits_of(lse2[k]);
      Seq& q = seqs[static_cast<size_t>(order[k])];
      q.tokens.push_back(sampled[k]);
      q.logp.push_back(logp[k]);
      q.control.push_back(materialized_bf16_logp(logits.data() + i * cfg.weight_rows, real_vocab, q.T, sampled[k]));
    }
    ++steps;
    max_active = std::max(max_active, b);
    batch_sizes.insert(static_cast<size_t>(b));
  }

  // ---- trainer: its own copy of the head, loaded rank by rank, TP shards.
  const auto ranges = shard_ranges(cfg.weight_rows, cfg.tp);
  std::vector<std::vector<uint16_t>> trainer_shards;
  std::vector<Shard> shards;
  std::vector<TensorView> shard_views;
  for (auto [start, count] : ranges) trainer_shards.push_back(weight_rows(cfg.seed, start, count, cfg.dim));
  if (cfg.perturb_trainer_weight) trainer_shards.back()[0] ^= 1;  // one bit of the last rank's first row
  for (size_t r = 0; r < ranges.size(); ++r) {
    shard_views.push_back(TensorView::matrix(trainer_shards[r].data(), DType::bf16, ranges[r].second, cfg.dim));
    shards.push_back({ranges[r].first, shard_views.back(), {}});
  }
  const std::string trainer_fp = weight_fingerprint(shard_views);
  auto trainer_row = [&](int64_t v) {
    size_t r = 0;
    while (v >= ranges[r].first + ranges[r].second) ++r;
    return trainer_shards[r].data() + (v - ranges[r].first) * cfg.dim;
  };
  const bool same_weights = trainer_fp == rollout_fp;

  // Packed batch: every sequence's positions in order, the trainer's own forward of the tokens.
  std::vector<uint16_t> packed_hidden;
  std::vector<int64_t> packed_targets;
  std::vector<float> packed_temps, rollout_logp, control_logp;
  std::vector<std::pair<int64_t, int64_t>> where;
  for (int64_t s = 0; s < cfg.seqs; ++s) {
    const Seq& q = seqs[static_cast<size_t>(s)];
    for (int64_t p = 0; p < q.len; ++p) {
      packed_hidden.resize(packed_hidden.size() + static_cast<size_t>(cfg.dim));
      // The trainer's model reads its own copy of the weights.
      const int64_t prev = q.tokens[static_cast<size_t>(p)];
      model_hidden(cfg, real_vocab, trainer_row, s, p, prev, packed_hidden.data() + packed_hidden.size() - cfg.dim);
      packed_targets.push_back(q.tokens[static_cast<size_t>(p + 1)]);
      packed_temps.push_back(q.T);
      rollout_logp.push_back(q.logp[static_cast<size_t>(p)]);
      control_logp.push_back(q.control[static_cast<size_t>(p)]);
      where.emplace_back(s, p);
    }
  }
  const int64_t total = static_cast<int64_t>(packed_targets.size());
  std::vector<float> train_logp(static_cast<size_t>(total)), train_lse(static_cast<size_t>(total));
  HarnessResult res;
  std::vector<double> k3, control_k3;
  if (same_weights) {
    LinearLogpInputs in;
    in.hidden = TensorView::matrix(packed_hidden.data(), DType::bf16, total, cfg.dim);
    in.targets = TensorView::vector(packed_targets.data(), DType::i64, total);
    in.temperature_rows = TensorView::vector(packed_temps.data(), DType::f32, total);
    in.real_vocab = real_vocab;
    // Context parallel: the packed rows in cp contiguous groups, each through its own TP group
    // (its own devices when there are tp * cp of them); no statistic crosses groups.
    const int64_t per_group = (total + cfg.cp - 1) / cfg.cp;
    for (int c = 0; c < cfg.cp; ++c) {
      const int64_t row0 = std::min<int64_t>(total, c * per_group), n = std::min(per_group, total - row0);
      if (n == 0) continue;
      LinearLogpInputs part = in;
      part.hidden = TensorView::matrix(packed_hidden.data() + row0 * cfg.dim, DType::bf16, n, cfg.dim);
      part.targets = TensorView::vector(packed_targets.data() + row0, DType::i64, n);
      part.temperature_rows = TensorView::vector(packed_temps.data() + row0, DType::f32, n);
      TpPlacement placement;
      if (!cfg.devices.empty()) {
        const size_t first = cfg.devices.size() >= static_cast<size_t>(cfg.tp * cfg.cp) ? size_t(c) * cfg.tp : 0;
        placement.devices.assign(cfg.devices.begin() + static_cast<std::ptrdiff_t>(first), cfg.devices.end());
      }
      trainer_tensor_parallel(part, shards, train_logp.data() + row0, train_lse.data() + row0, cfg.trainer_opt,
                              trainer_rb, placement);
    }
    res.compared = true;
    res.metrics = compare(train_logp, rollout_logp, &k3);
    res.control = compare(train_logp, control_logp, &control_k3);
    res.exact = all_zero(res.metrics) && lse_readback_mismatch == 0;
    res.control_drift = res.control.mismatch_count > 0;
  }
  const bool fallback_free = rollout_rb.fallbacks == 0 && trainer_rb.fallbacks == 0;
  res.exact = res.exact && fallback_free;

  // ---- report
  std::string placement_str = cfg.devices.empty() ? "in-process host ranks" : "CUDA devices";
  for (size_t i = 0; i < cfg.devices.size(); ++i) placement_str += (i ? "," : " ") + std::to_string(cfg.devices[i]);
  if (!cfg.devices.empty()) placement_str += " over NCCL";
  std::ostringstream j;
  j << "{\n  \"format\": \"detlogp-validation-report-v1\",\n  \"detlogp_version\": " << json_str(version_string())
    << ",\n  \"config\": {\"seqs\": " << cfg.seqs << ", \"max_len\": " << cfg.max_len
    << ", \"max_batch\": " << cfg.max_batch << ", \"d\": " << cfg.dim << ", \"v\": " << cfg.weight_rows
    << ", \"real_vocab\": " << real_vocab << ", \"tp\": " << cfg.tp << ", \"cp\": " << cfg.cp
    << ", \"rollout_tp\": " << cfg.rollout_tp << ", \"devices\": " << json_str(placement_str)
    << ", \"seed\": " << cfg.seed << ", \"perturb_trainer_weight\": " << (cfg.perturb_trainer_weight ? "true" : "false")
    << "},\n"
    << "  \"rollout\": {\"entry\": \"serving\", \"tp\": " << cfg.rollout_tp
    << ", \"backend\": " << json_str(rollout_rb.backend) << ", \"provenance\": " << json_str(rollout_rb.provenance)
    << ", \"calls\": " << rollout_rb.calls << ", \"fallbacks\": " << rollout_rb.fallbacks
    << ", \"weight_fingerprint\": " << json_str(rollout_fp) << ", \"steps\": " << steps
    << ", \"max_batch_observed\": " << max_active << ", \"distinct_batch_sizes\": " << batch_sizes.size()
    << ", \"membership_changes\": " << membership_changes << ", \"lse_readback_mismatch\": " << lse_readback_mismatch
    << "},\n"
    << "  \"trainer\": {\"entry\": \"trainer\", \"tp\": " << cfg.tp << ", \"cp\": " << cfg.cp
    << ", \"packed_rows\": " << total << ", \"backend\": " << json_str(trainer_rb.backend)
    << ", \"provenance\": " << json_str(trainer_rb.provenance) << ", \"calls\": " << trainer_rb.calls
    << ", \"fallbacks\": " << trainer_rb.fallbacks << ", \"weight_fingerprint\": " << json_str(trainer_fp) << "},\n"
    << "  \"weight_fingerprints_match\": " << (same_weights ? "true" : "false") << ",\n";
  if (res.compared) {
    j << "  \"logp\": " << metrics_json(res.metrics)
      << ",\n  \"negative_control_bf16_logits\": " << metrics_json(res.control)
      << ",\n  \"claim\": {\"logp_exact_zero\": " << (res.exact ? "true" : "false")
      << ", \"negative_control_drift\": " << (res.control_drift ? "true" : "false") << "},\n  \"tokens\": [\n";
    for (int64_t i = 0; i < total; ++i) {
      const size_t k = static_cast<size_t>(i);
      j << "    {\"seq\": " << where[k].first << ", \"pos\": " << where[k].second
        << ", \"token\": " << packed_targets[k] << ", \"T\": " << num(packed_temps[k])
        << ", \"logp_rollout\": " << json_str(hex_bits(rollout_logp[k]))
        << ", \"logp_trainer\": " << json_str(hex_bits(train_logp[k])) << ", \"k3\": " << num(k3[k])
        << ", \"logp_control\": " << json_str(hex_bits(control_logp[k])) << ", \"k3_control\": " << num(control_k3[k])
        << "}" << (i + 1 < total ? "," : "") << "\n";
    }
    j << "  ]\n}\n";
  } else {
    j << "  \"logp\": null,\n  \"negative_control_bf16_logits\": null,\n"
      << "  \"claim\": {\"logp_exact_zero\": false, \"reason\": \"weight fingerprints differ: not compared\"}\n}\n";
  }
  res.json = j.str();

  std::ostringstream md;
  md << "# detlogp validation report: rollout vs trainer (L4/L5)\n\n"
     << "detlogp " << version_string() << "; config: " << cfg.seqs << " sequences, max length " << cfg.max_len
     << ", max batch " << cfg.max_batch << ", D=" << cfg.dim << ", V=" << cfg.weight_rows << " (real " << real_vocab
     << "), rollout TP=" << cfg.rollout_tp << ", trainer TP=" << cfg.tp << " x CP=" << cfg.cp << ", ranks on "
     << placement_str << ", seed " << cfg.seed << ".\n\n"
     << "| side | entry | backend | fallback | weight fingerprint | calls |\n|---|---|---|---|---|---|\n"
     << "| rollout | serving, TP=" << cfg.rollout_tp << ", continuous batching (" << steps
     << " steps, membership changed on " << membership_changes << ", batch 1.." << max_active << ") | `"
     << rollout_rb.backend << "` | " << (rollout_rb.fallbacks ? "**yes**" : "none observed") << " | `"
     << rollout_fp.substr(0, 16) << "` | " << rollout_rb.calls << " |\n"
     << "| trainer | trainer, packed " << total << " rows, TP=" << cfg.tp << " x CP=" << cfg.cp << " | `"
     << trainer_rb.backend << "` | " << (trainer_rb.fallbacks ? "**yes**" : "none observed") << " | `"
     << trainer_fp.substr(0, 16) << "` | " << trainer_rb.calls << " |\n\n"
     << "Provenance (rollout): `" << rollout_rb.provenance << "`\n\nProvenance (trainer): `" << trainer_rb.provenance
     << "`\n\n";
  if (!res.compared) {
    md << "**Weight fingerprints differ (" << rollout_fp << " vs " << trainer_fp
       << "): the logprobs were not compared.**\n";
  } else {
    auto row = [&](const std::string& name, const Metrics& m) {
      md << "| " << name << " | " << num(m.train_rollout_logprob_abs_diff) << " | "
         << num(m.current_rollout_logprob_max_abs_diff) << " | " << m.mismatch_count << " / " << m.total << " | "
         << num(m.k3_max) << " | " << m.k3_nonzero << " |\n";
    };
    md << "| row | train_rollout_logprob_abs_diff (mean) | current_rollout_logprob_max_abs_diff | mismatch_count / "
          "total | K3 max | K3 != 0 |\n|---|---|---|---|---|---|\n";
    row("logp (detlogp both sides)", res.metrics);
    row("negative control (bf16 logits + log_softmax)", res.control);
    md << "\n**logp claim: " << (res.exact ? "exact zero" : "NOT exact") << "**: " << res.metrics.mismatch_count
       << " of " << res.metrics.total << " tokens differ in bits, K3 = rho - 1 - log(rho) is "
       << num(res.metrics.k3_max) << " at most; backed by the readback above: rollout `" << rollout_rb.backend
       << "` and trainer `" << trainer_rb.backend << "`, "
       << (fallback_free ? "no fallback observed" : "A FALLBACK WAS OBSERVED")
       << " on either side, serving lse == reducer lse on " << (total - lse_readback_mismatch) << " / " << total
       << " tokens, weight fingerprint `" << rollout_fp << "` on both sides.\n\n"
       << "Negative control: the same rollout scored the materializing way drifts on " << res.control.mismatch_count
       << " / " << res.control.total << " tokens (max |diff| " << num(res.control.current_rollout_logprob_max_abs_diff)
       << ").\n";
  }
  res.markdown = md.str();
  log << "rollout: " << steps << " steps (membership changed on " << membership_changes << "), " << batch_calls
      << " serving calls, batch sizes 1.." << max_active << ", " << total << " tokens; backend " << rollout_rb.backend
      << "\n";
  log << "trainer: packed " << total << " rows, TP=" << cfg.tp << " x CP=" << cfg.cp
      << " (rollout TP=" << cfg.rollout_tp << "), ranks on " << placement_str << ", backend " << trainer_rb.backend
      << "\n";
  log << "weight fingerprint: rollout " << rollout_fp << ", trainer " << trainer_fp
      << (same_weights ? " (match)" : " (MISMATCH: not compared)") << "\n";
  if (res.compared) {
    log << "logp: mismatch " << res.metrics.mismatch_count << "/" << res.metrics.total << ", abs_diff(mean) "
        << num(res.metrics.train_rollout_logprob_abs_diff) << ", max_abs_diff "
        << num(res.metrics.current_rollout_logprob_max_abs_diff) << ", K3 max " << num(res.metrics.k3_max) << "\n";
    log << "negative control (bf16 logits): mismatch " << res.control.mismatch_count << "/" << res.control.total
        << ", abs_diff(mean) " << num(res.control.train_rollout_logprob_abs_diff) << ", max_abs_diff "
        << num(res.control.current_rollout_logprob_max_abs_diff) << ", K3 max " << num(res.control.k3_max) << "\n";
  }
  return res;
}

}  // namespace detlogp::golden

// Validation ladder L4/L5: a synthetic rollout loop with continuous batching and a sampler, then a
// trainer recomputation (packed, tensor parallel, optionally context parallel) at the same weight
// fingerprint; exact-zero metrics of logp and of the entropy, and a materializing bf16-logits
// negative control. The report is rendered in report.cpp.
#include <algorithm>
#include <cmath>
#include <exception>
#include <numeric>
#include <set>
#include <thread>

#include "detlogp/dist.hpp"
#include "detlogp/fpops.hpp"
#include "golden/generator.hpp"
#include "golden/goldens.hpp"
#include "golden/harness.hpp"
#include "golden/readback.hpp"
#include "golden/report.hpp"

namespace detlogp::golden {

namespace {

constexpr uint64_t kStreamKey = 201, kStreamDominant = 202, kStreamBos = 203, kStreamProgram = 204;

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
    y[static_cast<size_t>(v)] = fp::bf16_to_float(fp::bf16_round(z[v])) / T;
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
    m.mismatch_count += fp::bits(train[i]) != fp::bits(rollout[i]);
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

EntropyMetrics compare_entropy(const std::vector<float>& train, const std::vector<float>& rollout) {
  EntropyMetrics m;
  m.total = static_cast<int64_t>(train.size());
  double sum = 0;
  for (size_t i = 0; i < train.size(); ++i) {
    m.mismatch_count += fp::bits(train[i]) != fp::bits(rollout[i]);
    const double d = std::fabs(static_cast<double>(train[i]) - static_cast<double>(rollout[i]));
    sum += d;
    m.max_abs_diff = std::max(m.max_abs_diff, d);
  }
  m.mean_abs_diff = m.total ? sum / static_cast<double>(m.total) : 0;
  return m;
}

// Whether the backend that `opt` selects serves the entropy output: a call of zero rows selects
// the backend and computes nothing.
bool serves_entropy(const TensorView& weight, int64_t real_vocab, const CallOptions& opt) {
  const int64_t no_target = kDefaultIgnoreIndex;
  float unused = 0.0f;
  LinearLogpInputs in;
  in.hidden = TensorView::matrix(weight.data, DType::bf16, 0, weight.cols);
  in.weight = weight;
  in.targets = TensorView::vector(&no_target, DType::i64, 0);
  in.real_vocab = real_vocab;
  const LinearLogpOutputs out{mutable_vector(&unused, DType::f32, 0), mutable_vector(&unused, DType::f32, 0), {}, {}};
  return !linear_logp(in, out, opt).provenance.entropy_id.empty();
}

bool all_zero(const Metrics& m) {
  return m.mismatch_count == 0 && m.train_rollout_logprob_abs_diff == 0 &&
         m.current_rollout_logprob_max_abs_diff == 0 && m.k3_max == 0 && m.k3_nonzero == 0;
}

struct Seq {
  int64_t len, arrival;
  float T;
  int64_t top_k = 0;  // the sampling program's filters (cfg.sampling)
  float top_p = 1.0f, min_p = 0.0f;
  std::vector<int64_t> tokens;  // tokens[0] = BOS, then one sampled token per position
  std::vector<float> logp, control, entropy;
  std::vector<float> logp_raw;  // cfg.sampling: the raw logp beside the processed one in logp
};

// The temperature the contract reducer scales by: the program's T, 1 for a greedy row (§11.1).
float scale_temperature(float T) { return T == 0.0f ? 1.0f : T; }

// An engine's split of the head for the sampling program: V / tp rows each (the first V % tp ranks
// one more), off the tile grid, as vLLM and Megatron shard a vocabulary.
std::vector<std::pair<int64_t, int64_t>> engine_ranges(int64_t weight_rows, int tp) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t start = 0;
  for (int r = 0; r < tp; ++r) {
    const int64_t count = weight_rows / tp + (r < weight_rows % tp ? 1 : 0);
    out.emplace_back(start, count);
    start += count;
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> ranges_of(const HarnessConfig& cfg, int tp) {
  return cfg.sampling ? engine_ranges(cfg.weight_rows, tp) : shard_ranges(cfg.weight_rows, tp);
}

// Runs call(rank, communicator) on `ranks` in-process host ranks, one thread each; rethrows the
// first rank's error (every rank throws the same one on a refused call).
template <class Call>
void on_host_ranks(int ranks, const Call& call) {
  auto comms = make_local_communicators(ranks, Memory::host);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        call(r, *comms[static_cast<size_t>(r)]);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// The negative control of the sampling program: an engine's own sampler, as engines compute their
// processed logprobs. Logits rounded to bf16 and divided by T (T = 0: the argmax, logp 0), sorted by
// probability, top-k, an fp32 softmax over the kept lanes, top-p on its running sum in sorted order
// (a lane is kept while the mass before it is below top_p), min-p against the largest probability,
// renormalized by a plain sum; the log of the token's probability, -inf where it filtered the token.
float engine_sampler_logp(const float* z, int64_t real_vocab, float T, int64_t top_k, float top_p, float min_p,
                          int64_t t, bool& filtered) {
  std::vector<float> y(static_cast<size_t>(real_vocab));
  for (int64_t v = 0; v < real_vocab; ++v)
    y[static_cast<size_t>(v)] = fp::bf16_to_float(fp::bf16_round(z[v])) / (T == 0.0f ? 1.0f : T);
  std::vector<int64_t> order(static_cast<size_t>(real_vocab));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return y[static_cast<size_t>(a)] > y[static_cast<size_t>(b)]; });
  filtered = false;
  if (T == 0.0f) {
    filtered = order[0] != t;
    return filtered ? -INFINITY : 0.0f;
  }
  const size_t k = top_k > 0 ? static_cast<size_t>(std::min(top_k, real_vocab)) : order.size();
  const float m = y[static_cast<size_t>(order[0])];
  std::vector<float> p(k);
  float sum = 0;
  for (size_t i = 0; i < k; ++i) sum += p[i] = std::exp(y[static_cast<size_t>(order[i])] - m);
  for (float& v : p) v /= sum;
  float before = 0, kept = 0, token_p = 0;
  for (size_t i = 0; i < k; ++i) {
    const bool keep = (top_p >= 1.0f || before < top_p) && p[i] >= min_p * p[0];
    before += p[i];
    if (!keep) continue;
    kept += p[i];
    if (order[i] == t) token_p = p[i];
  }
  filtered = token_p == 0;
  return filtered ? -INFINITY : std::log(token_p / kept);
}

// Each sequence's length, arrival step, temperature and first token.
std::vector<Seq> schedule(const HarnessConfig& cfg, int64_t real_vocab) {
  std::vector<Seq> seqs(static_cast<size_t>(cfg.seqs));
  for (int64_t s = 0; s < cfg.seqs; ++s) {
    Seq& q = seqs[static_cast<size_t>(s)];
    q.len = 1 + static_cast<int64_t>(draw(cfg.seed, kStreamSchedule, 2 * s) % static_cast<uint64_t>(cfg.max_len));
    q.arrival = static_cast<int64_t>(draw(cfg.seed, kStreamSchedule, 2 * s + 1) % static_cast<uint64_t>(cfg.seqs));
    q.T = temperature_of(cfg, s);
    if (cfg.sampling) {  // per-sequence filters, one greedy sequence in eight
      const uint64_t d = draw(cfg.seed, kStreamProgram, static_cast<uint64_t>(s));
      static const int64_t kTopK[] = {0, 1, 20, 50};
      static const float kTopP[] = {1.0f, 0.9f, 0.95f, 0.7f}, kMinP[] = {0.0f, 0.05f, 0.1f};
      q.top_k = kTopK[d % 4];
      q.top_p = kTopP[(d >> 8) % 4];
      q.min_p = kMinP[(d >> 16) % 3];
      if ((d >> 24) % 8 == 0) q.T = 0.0f;
    }
    q.tokens.push_back(static_cast<int64_t>(draw(cfg.seed, kStreamBos, s) % static_cast<uint64_t>(real_vocab)));
  }
  return seqs;
}

// The rollout engine: the whole head (TP = 1), loaded on its own; views of it as shards when the
// engine is TP > 1.
struct RolloutEngine {
  const HarnessConfig& cfg;
  std::vector<uint16_t> weight;
  std::vector<Shard> shards;
  bool serving_entropy = false;  // a TP = 1 engine whose backend serves the entropy output asks for it

  RolloutEngine(const HarnessConfig& c, int64_t real_vocab)
      : cfg(c), weight(weight_rows(c.seed, 0, c.weight_rows, c.dim)) {
    for (auto [start, count] : ranges_of(cfg, cfg.rollout_tp))
      shards.push_back({start, TensorView::matrix(weight.data() + start * cfg.dim, DType::bf16, count, cfg.dim), {}});
    serving_entropy =
        cfg.rollout_tp == 1 && serves_entropy(TensorView::matrix(weight.data(), DType::bf16, cfg.weight_rows, cfg.dim),
                                              real_vocab, cfg.rollout_opt);
  }
  std::string fingerprint() const {
    return weight_fingerprint({TensorView::matrix(weight.data(), DType::bf16, cfg.weight_rows, cfg.dim)});
  }

  // One decoding step for the sequences in `order` (batch row i is sequence order[i]): a
  // serving-entry call for fp32 logits and lse, a sampled token per sequence, its logp.
  void step(const std::vector<int64_t>& order, std::vector<Seq>& seqs, HarnessRun& run) const {
    if (cfg.sampling) return step_sampled(order, seqs, run);
    const int64_t real_vocab = run.real_vocab;
    auto rollout_row = [&](int64_t v) { return weight.data() + v * cfg.dim; };
    const int64_t b = static_cast<int64_t>(order.size());
    std::vector<uint16_t> hidden(static_cast<size_t>(b * cfg.dim));
    std::vector<float> temps(static_cast<size_t>(b)), logits(static_cast<size_t>(b * cfg.weight_rows));
    std::vector<float> lse(static_cast<size_t>(b)), unused_logp(static_cast<size_t>(b));
    std::vector<float> served_entropy(serving_entropy ? static_cast<size_t>(b) : 0);
    std::vector<int64_t> none(static_cast<size_t>(b), kDefaultIgnoreIndex);
    for (int64_t i = 0; i < b; ++i) {
      const Seq& q = seqs[static_cast<size_t>(order[static_cast<size_t>(i)])];
      const int64_t p = static_cast<int64_t>(q.logp.size());
      model_hidden(cfg, real_vocab, rollout_row, order[static_cast<size_t>(i)], p, q.tokens.back(),
                   hidden.data() + i * cfg.dim);
      temps[static_cast<size_t>(i)] = q.T;
    }
    LinearLogpInputs in;
    in.hidden = TensorView::matrix(hidden.data(), DType::bf16, b, cfg.dim);
    in.weight = TensorView::matrix(weight.data(), DType::bf16, cfg.weight_rows, cfg.dim);
    in.targets = TensorView::vector(none.data(), DType::i64, b);
    in.temperature_rows = TensorView::vector(temps.data(), DType::f32, b);
    in.real_vocab = real_vocab;
    if (cfg.rollout_tp == 1) {
      LinearLogpOutputs out{mutable_vector(unused_logp.data(), DType::f32, b),
                            mutable_vector(lse.data(), DType::f32, b),
                            mutable_matrix(logits.data(), DType::f32, b, cfg.weight_rows),
                            {}};
      if (serving_entropy) out.entropy = mutable_vector(served_entropy.data(), DType::f32, b);
      run.rollout.add(linear_logp(in, out, cfg.rollout_opt));
    } else {  // a TP engine: vocab-parallel serving entry, the logits shards gathered for the sampler
      run_tensor_parallel(in, shards, unused_logp.data(), lse.data(), cfg.rollout_opt, run.rollout,
                          TpPlacement{cfg.devices}, logits.data());
    }
    ++run.batch_calls;
    std::vector<int64_t> sampled(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) {
      const Seq& q = seqs[static_cast<size_t>(order[static_cast<size_t>(i)])];
      sampled[static_cast<size_t>(i)] = sample(cfg, logits.data() + i * cfg.weight_rows, real_vocab, q.T,
                                               order[static_cast<size_t>(i)], static_cast<int64_t>(q.logp.size()));
    }
    // The sampled token's logp and the row's entropy: the contract reducer over the served logits
    // (portable: the same bits as the fused operator); its lse, and its entropy where the serving
    // call gave one, must equal the fused call's bit for bit.
    std::vector<float> logp(static_cast<size_t>(b)), lse2(static_cast<size_t>(b)), entropy(static_cast<size_t>(b));
    ReduceLogitsInputs r;
    r.logits = TensorView::matrix(logits.data(), DType::f32, b, cfg.weight_rows);
    r.targets = TensorView::vector(sampled.data(), DType::i64, b);
    r.temperature_rows = TensorView::vector(temps.data(), DType::f32, b);
    r.real_vocab = real_vocab;
    reduce_logits(r, mutable_vector(logp.data(), DType::f32, b), mutable_vector(lse2.data(), DType::f32, b),
                  mutable_vector(entropy.data(), DType::f32, b));
    for (int64_t i = 0; i < b; ++i) {
      const size_t k = static_cast<size_t>(i);
      run.lse_readback_mismatch += fp::bits(lse[k]) != fp::bits(lse2[k]);
      if (serving_entropy) {
        ++run.entropy_readback_checked;
        run.entropy_readback_mismatch += fp::bits(served_entropy[k]) != fp::bits(entropy[k]);
      }
      Seq& q = seqs[static_cast<size_t>(order[k])];
      q.tokens.push_back(sampled[k]);
      q.logp.push_back(logp[k]);
      q.entropy.push_back(entropy[k]);
      q.control.push_back(materialized_bf16_logp(logits.data() + i * cfg.weight_rows, real_vocab, q.T, sampled[k]));
    }
  }

  // One decoding step with the sampling program: `sample` (TP = 1) or sample_tensor_parallel (the
  // engine's ranks), each row's program and key (sequence, position); the token, its processed and
  // raw logp; the reducer over the served logits must give the raw logp and lse bit for bit.
  void step_sampled(const std::vector<int64_t>& order, std::vector<Seq>& seqs, HarnessRun& run) const {
    const int64_t real_vocab = run.real_vocab;
    auto rollout_row = [&](int64_t v) { return weight.data() + v * cfg.dim; };
    const int64_t b = static_cast<int64_t>(order.size());
    const size_t nb = static_cast<size_t>(b);
    std::vector<uint16_t> hidden(nb * static_cast<size_t>(cfg.dim));
    std::vector<float> temps(nb), top_p(nb), min_p(nb), logits(nb * static_cast<size_t>(cfg.weight_rows));
    std::vector<int64_t> top_k(nb), key(nb);
    for (int64_t i = 0; i < b; ++i) {
      const size_t k = static_cast<size_t>(i);
      const Seq& q = seqs[static_cast<size_t>(order[k])];
      const int64_t p = static_cast<int64_t>(q.logp.size());
      model_hidden(cfg, real_vocab, rollout_row, order[k], p, q.tokens.back(), hidden.data() + i * cfg.dim);
      temps[k] = q.T;
      top_k[k] = q.top_k;
      top_p[k] = q.top_p;
      min_p[k] = q.min_p;
      key[k] = (order[k] << 32) | p;
    }
    SampleInputs in;
    in.hidden = TensorView::matrix(hidden.data(), DType::bf16, b, cfg.dim);
    in.real_vocab = real_vocab;
    in.program.temperature_rows = TensorView::vector(temps.data(), DType::f32, b);
    in.program.top_k_rows = TensorView::vector(top_k.data(), DType::i64, b);
    in.program.top_p_rows = TensorView::vector(top_p.data(), DType::f32, b);
    in.program.min_p_rows = TensorView::vector(min_p.data(), DType::f32, b);
    in.seed = cfg.seed;
    in.key = TensorView::vector(key.data(), DType::i64, b);
    std::vector<int64_t> token(nb), support(nb);
    std::vector<float> logp(nb), logp_raw(nb), lse(nb);
    const auto outputs = [&](int64_t* tok, float* lp, float* raw, float* ls, int64_t* sup, float* lg, int64_t cols) {
      SampleOutputs o;
      o.token = mutable_vector(tok, DType::i64, b);
      o.logp = mutable_vector(lp, DType::f32, b);
      o.logp_raw = mutable_vector(raw, DType::f32, b);
      o.lse = mutable_vector(ls, DType::f32, b);
      o.support_size = mutable_vector(sup, DType::i64, b);
      o.logits = mutable_matrix(lg, DType::f32, b, cols);
      return o;
    };
    if (cfg.rollout_tp == 1) {
      in.weight = TensorView::matrix(weight.data(), DType::bf16, cfg.weight_rows, cfg.dim);
      run.rollout.add(sample(in,
                             outputs(token.data(), logp.data(), logp_raw.data(), lse.data(), support.data(),
                                     logits.data(), cfg.weight_rows),
                             cfg.rollout_opt));
    } else {  // the engine's ranks: every rank draws the same tokens; each keeps its logits shard
      const int ranks = static_cast<int>(shards.size());
      std::vector<std::vector<int64_t>> rank_token(shards.size(), token), rank_support(shards.size(), support);
      std::vector<std::vector<float>> rank_f32(shards.size() * 3, logp), rank_logits(shards.size());
      std::vector<CallReport> reports(shards.size());
      on_host_ranks(ranks, [&](int r, Communicator& comm) {
        const size_t k = static_cast<size_t>(r);
        const Shard& sh = shards[k];
        SampleInputs mine = in;
        mine.weight = sh.weight;
        mine.vocab_start = sh.vocab_start;
        rank_logits[k].resize(nb * static_cast<size_t>(sh.weight.rows));
        reports[k] = sample_tensor_parallel(
            mine,
            outputs(rank_token[k].data(), rank_f32[3 * k].data(), rank_f32[3 * k + 1].data(),
                    rank_f32[3 * k + 2].data(), rank_support[k].data(), rank_logits[k].data(), sh.weight.rows),
            comm, cfg.rollout_opt);
      });
      for (size_t r = 0; r < shards.size(); ++r) {
        run.rollout.add(reports[r]);
        for (int64_t i = 0; i < b; ++i)
          std::copy_n(rank_logits[r].data() + i * shards[r].weight.rows, shards[r].weight.rows,
                      logits.data() + i * cfg.weight_rows + shards[r].vocab_start);
        // Every rank must hold the same outputs: a difference counts as a readback mismatch.
        const bool same = rank_token[r] == rank_token[0] && rank_support[r] == rank_support[0] &&
                          std::equal(rank_f32[3 * r].begin(), rank_f32[3 * r].end(), rank_f32[0].begin(),
                                     [](float a, float c) { return fp::bits(a) == fp::bits(c); });
        run.lse_readback_mismatch += same ? 0 : b;
      }
      token = rank_token[0];
      support = rank_support[0];
      logp = rank_f32[0];
      logp_raw = rank_f32[1];
      lse = rank_f32[2];
    }
    ++run.batch_calls;
    // The reducer over the served logits at each row's scale: the raw logp, lse and entropy.
    std::vector<float> scale(nb), red_logp(nb), red_lse(nb), entropy(nb);
    for (size_t k = 0; k < nb; ++k) scale[k] = scale_temperature(temps[k]);
    ReduceLogitsInputs r;
    r.logits = TensorView::matrix(logits.data(), DType::f32, b, cfg.weight_rows);
    r.targets = TensorView::vector(token.data(), DType::i64, b);
    r.temperature_rows = TensorView::vector(scale.data(), DType::f32, b);
    r.real_vocab = real_vocab;
    reduce_logits(r, mutable_vector(red_logp.data(), DType::f32, b), mutable_vector(red_lse.data(), DType::f32, b),
                  mutable_vector(entropy.data(), DType::f32, b));
    for (int64_t i = 0; i < b; ++i) {
      const size_t k = static_cast<size_t>(i);
      run.lse_readback_mismatch +=
          fp::bits(lse[k]) != fp::bits(red_lse[k]) || fp::bits(logp_raw[k]) != fp::bits(red_logp[k]) ? 1 : 0;
      Seq& q = seqs[static_cast<size_t>(order[k])];
      q.tokens.push_back(token[k]);
      q.logp.push_back(logp[k]);
      q.logp_raw.push_back(logp_raw[k]);
      q.entropy.push_back(entropy[k]);
      bool filtered = false;
      q.control.push_back(engine_sampler_logp(logits.data() + i * cfg.weight_rows, real_vocab, q.T, q.top_k, q.top_p,
                                              q.min_p, token[k], filtered));
      run.control_filtered += filtered ? 1 : 0;
    }
  }
};

// Continuous batching until every sequence is done. Join: arrived sequences take free slots in
// sequence order; leave: finished ones drop out. A different batch order every step.
void roll_out(const HarnessConfig& cfg, const RolloutEngine& engine, std::vector<Seq>& seqs, HarnessRun& run) {
  std::set<size_t> batch_sizes;
  std::vector<int64_t> active, previous;
  for (int64_t step = 0;; ++step) {
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
      run.membership_changes += now != previous ? 1 : 0;
      previous = std::move(now);
    }
    // Fisher-Yates keyed by the step.
    std::vector<int64_t> order = active;
    for (size_t i = order.size(); i > 1; --i)
      std::swap(order[i - 1], order[draw(cfg.seed, kStreamSchedule, 1000000 + step * 64 + i) % i]);
    engine.step(order, seqs, run);
    const int64_t b = static_cast<int64_t>(order.size());
    ++run.steps;
    run.max_active = std::max(run.max_active, b);
    batch_sizes.insert(static_cast<size_t>(b));
  }
  run.distinct_batch_sizes = static_cast<int64_t>(batch_sizes.size());
}

// The trainer's entropy of the packed rows: its trainer entry with the entropy output, TP = 1 over
// its own copy of the head (the shards side by side), one call per CP group as for its logprobs.
// The entropy is the same bits at every TP degree (docs/contract.md §10), so the TP = 1 call
// stands for the trainer's vocabulary-parallel group.
void trainer_entropy(const HarnessConfig& cfg, const std::vector<std::vector<uint16_t>>& trainer_shards,
                     const std::vector<uint16_t>& packed_hidden, HarnessRun& run) {
  std::vector<uint16_t> head;
  head.reserve(static_cast<size_t>(cfg.weight_rows * cfg.dim));
  for (const auto& shard : trainer_shards) head.insert(head.end(), shard.begin(), shard.end());
  const int64_t total = run.total(), per_group = (total + cfg.cp - 1) / cfg.cp;
  run.trainer_entropy.assign(static_cast<size_t>(total), 0.0f);
  std::vector<float> logp(static_cast<size_t>(per_group)), lse(static_cast<size_t>(per_group));
  std::vector<float> scale(run.temperatures.size());
  for (size_t k = 0; k < scale.size(); ++k) scale[k] = scale_temperature(run.temperatures[k]);
  for (int c = 0; c < cfg.cp; ++c) {
    const int64_t row0 = std::min<int64_t>(total, c * per_group), n = std::min(per_group, total - row0);
    if (n == 0) continue;
    LinearLogpInputs in;
    in.hidden = TensorView::matrix(packed_hidden.data() + row0 * cfg.dim, DType::bf16, n, cfg.dim);
    in.weight = TensorView::matrix(head.data(), DType::bf16, cfg.weight_rows, cfg.dim);
    in.targets = TensorView::vector(run.tokens.data() + row0, DType::i64, n);
    in.temperature_rows = TensorView::vector(scale.data() + row0, DType::f32, n);
    in.real_vocab = run.real_vocab;
    const LinearLogpOutputs out{mutable_vector(logp.data(), DType::f32, n),
                                mutable_vector(lse.data(), DType::f32, n),
                                {},
                                mutable_vector(run.trainer_entropy.data() + row0, DType::f32, n)};
    run.trainer.add(linear_logp(in, out, cfg.trainer_opt));
  }
  run.trainer_entropy_how = "trainer entry with the entropy output, TP=1 over the trainer's head, per CP group";
}

// The trainer's replay of the sampling program over its packed rows: linear_logp with each row's
// program, through the tensor-parallel replay on its TP ranks (in-process), one call per CP group;
// the processed logp into trainer_logp, the raw one into trainer_logp_raw.
void replay_program(const HarnessConfig& cfg, const std::vector<Shard>& shards,
                    const std::vector<uint16_t>& packed_hidden, HarnessRun& run) {
  const int64_t total = run.total(), per_group = (total + cfg.cp - 1) / cfg.cp;
  run.trainer_logp_raw.assign(static_cast<size_t>(total), 0.0f);
  std::vector<float> lse(static_cast<size_t>(total));
  const int ranks = static_cast<int>(shards.size());
  for (int c = 0; c < cfg.cp; ++c) {
    const int64_t row0 = std::min<int64_t>(total, c * per_group), n = std::min(per_group, total - row0);
    if (n == 0) continue;
    std::vector<std::vector<float>> scratch(static_cast<size_t>(ranks) * 3, std::vector<float>(static_cast<size_t>(n)));
    std::vector<CallReport> reports(static_cast<size_t>(ranks));
    on_host_ranks(ranks, [&](int r, Communicator& comm) {
      const size_t k = static_cast<size_t>(r);
      LinearLogpInputs in;
      in.hidden = TensorView::matrix(packed_hidden.data() + row0 * cfg.dim, DType::bf16, n, cfg.dim);
      in.weight = shards[k].weight;
      in.vocab_start = shards[k].vocab_start;
      in.targets = TensorView::vector(run.tokens.data() + row0, DType::i64, n);
      in.real_vocab = run.real_vocab;
      SamplingProgram program;
      program.temperature_rows = TensorView::vector(run.temperatures.data() + row0, DType::f32, n);
      program.top_k_rows = TensorView::vector(run.top_k.data() + row0, DType::i64, n);
      program.top_p_rows = TensorView::vector(run.top_p.data() + row0, DType::f32, n);
      program.min_p_rows = TensorView::vector(run.min_p.data() + row0, DType::f32, n);
      // Rank 0 writes the trainer's arrays; the others their own (the same bits, checked below).
      float* logp = r == 0 ? run.trainer_logp.data() + row0 : scratch[3 * k].data();
      float* raw = r == 0 ? run.trainer_logp_raw.data() + row0 : scratch[3 * k + 1].data();
      float* ls = r == 0 ? lse.data() + row0 : scratch[3 * k + 2].data();
      SampledLogpOutputs out;
      out.logp = mutable_vector(logp, DType::f32, n);
      out.logp_raw = mutable_vector(raw, DType::f32, n);
      out.lse = mutable_vector(ls, DType::f32, n);
      reports[k] = linear_logp_tensor_parallel(in, program, out, comm, cfg.trainer_opt);
    });
    for (int r = 0; r < ranks; ++r) {
      run.trainer.add(reports[static_cast<size_t>(r)]);
      for (int64_t i = 0; r > 0 && i < n; ++i)
        DETLOGP_CHECK(
            fp::bits(scratch[3 * r][i]) == fp::bits(run.trainer_logp[row0 + i]) &&
                fp::bits(scratch[3 * r + 1][i]) == fp::bits(run.trainer_logp_raw[row0 + i]),
            "the trainer's TP rank " << r << " replayed packed row " << row0 + i << " to other bits than rank 0");
    }
    run.replay_outside_support += reports[0].sampling.outside_support;
  }
}

// The trainer: its own copy of the head, loaded rank by rank as TP shards, and its own forward of
// the rolled-out tokens packed into one batch. Computes the logprobs only when its weight
// fingerprint matches the rollout's.
void recompute(const HarnessConfig& cfg, const std::vector<Seq>& seqs, HarnessRun& run) {
  const auto ranges = ranges_of(cfg, cfg.tp);
  std::vector<std::vector<uint16_t>> trainer_shards;
  std::vector<Shard> shards;
  std::vector<TensorView> shard_views;
  for (auto [start, count] : ranges) trainer_shards.push_back(weight_rows(cfg.seed, start, count, cfg.dim));
  if (cfg.perturb_trainer_weight) trainer_shards.back()[0] ^= 1;  // one bit of the last rank's first row
  for (size_t r = 0; r < ranges.size(); ++r) {
    shard_views.push_back(TensorView::matrix(trainer_shards[r].data(), DType::bf16, ranges[r].second, cfg.dim));
    shards.push_back({ranges[r].first, shard_views.back(), {}});
  }
  run.trainer_fingerprint = weight_fingerprint(shard_views);
  auto trainer_row = [&](int64_t v) {
    size_t r = 0;
    while (v >= ranges[r].first + ranges[r].second) ++r;
    return trainer_shards[r].data() + (v - ranges[r].first) * cfg.dim;
  };

  // Packed batch: every sequence's positions in order.
  std::vector<uint16_t> packed_hidden;
  for (int64_t s = 0; s < cfg.seqs; ++s) {
    const Seq& q = seqs[static_cast<size_t>(s)];
    for (int64_t p = 0; p < q.len; ++p) {
      packed_hidden.resize(packed_hidden.size() + static_cast<size_t>(cfg.dim));
      const int64_t prev = q.tokens[static_cast<size_t>(p)];
      model_hidden(cfg, run.real_vocab, trainer_row, s, p, prev, packed_hidden.data() + packed_hidden.size() - cfg.dim);
      run.tokens.push_back(q.tokens[static_cast<size_t>(p + 1)]);
      run.temperatures.push_back(q.T);
      run.rollout_logp.push_back(q.logp[static_cast<size_t>(p)]);
      run.control_logp.push_back(q.control[static_cast<size_t>(p)]);
      run.rollout_entropy.push_back(q.entropy[static_cast<size_t>(p)]);
      run.where.emplace_back(s, p);
      if (cfg.sampling) {
        run.rollout_logp_raw.push_back(q.logp_raw[static_cast<size_t>(p)]);
        run.top_k.push_back(q.top_k);
        run.top_p.push_back(q.top_p);
        run.min_p.push_back(q.min_p);
      }
    }
  }
  const int64_t total = run.total();
  run.trainer_logp.assign(static_cast<size_t>(total), 0.0f);
  std::vector<float> train_lse(static_cast<size_t>(total));
  if (!run.same_weights()) return;
  if (cfg.sampling) {
    replay_program(cfg, shards, packed_hidden, run);
    if (total > 0 && !run.trainer.entropy_id.empty()) trainer_entropy(cfg, trainer_shards, packed_hidden, run);
    return;
  }
  LinearLogpInputs in;
  in.real_vocab = run.real_vocab;
  // Context parallel: the packed rows in cp contiguous groups, each through its own TP group
  // (its own devices when there are tp * cp of them); no statistic crosses groups.
  const int64_t per_group = (total + cfg.cp - 1) / cfg.cp;
  for (int c = 0; c < cfg.cp; ++c) {
    const int64_t row0 = std::min<int64_t>(total, c * per_group), n = std::min(per_group, total - row0);
    if (n == 0) continue;
    LinearLogpInputs part = in;
    part.hidden = TensorView::matrix(packed_hidden.data() + row0 * cfg.dim, DType::bf16, n, cfg.dim);
    part.targets = TensorView::vector(run.tokens.data() + row0, DType::i64, n);
    part.temperature_rows = TensorView::vector(run.temperatures.data() + row0, DType::f32, n);
    TpPlacement placement;
    if (!cfg.devices.empty()) {
      const size_t first = cfg.devices.size() >= static_cast<size_t>(cfg.tp * cfg.cp) ? size_t(c) * cfg.tp : 0;
      placement.devices.assign(cfg.devices.begin() + static_cast<std::ptrdiff_t>(first), cfg.devices.end());
    }
    run_tensor_parallel(part, shards, run.trainer_logp.data() + row0, train_lse.data() + row0, cfg.trainer_opt,
                        run.trainer, placement);
  }
  if (total > 0 && !run.trainer.entropy_id.empty()) trainer_entropy(cfg, trainer_shards, packed_hidden, run);
}

}  // namespace

HarnessResult run_rollout_vs_trainer(const HarnessConfig& cfg, std::ostream& log) {
  HarnessRun run;
  run.real_vocab = cfg.real_vocab < 0 ? cfg.weight_rows : cfg.real_vocab;
  DETLOGP_CHECK(
      cfg.seqs >= 1 && cfg.max_len >= 1 && cfg.max_batch >= 1 && cfg.tp >= 1 && cfg.cp >= 1 && cfg.rollout_tp >= 1,
      "seqs, max_len, max_batch, tp, cp and rollout_tp must be >= 1");
  DETLOGP_CHECK(run.real_vocab >= 1 && run.real_vocab <= cfg.weight_rows,
                "real_vocab=" << run.real_vocab << " must be in [1, weight_rows=" << cfg.weight_rows << "]");
  DETLOGP_CHECK(!cfg.sampling || cfg.devices.empty(),
                "the sampling program's harness runs in-process host ranks: --devices is not taken with --sampling");
  DETLOGP_CHECK(!cfg.sampling || (cfg.weight_rows >= cfg.tp && cfg.weight_rows >= cfg.rollout_tp),
                "--sampling splits the head V / TP rows a rank: V=" << cfg.weight_rows << " is smaller than TP");

  const RolloutEngine engine(cfg, run.real_vocab);
  run.rollout_fingerprint = engine.fingerprint();
  std::vector<Seq> seqs = schedule(cfg, run.real_vocab);
  roll_out(cfg, engine, seqs, run);
  recompute(cfg, seqs, run);

  HarnessResult res;
  if (run.same_weights()) {
    res.compared = true;
    res.metrics = compare(run.trainer_logp, run.rollout_logp, &run.k3);
    res.control = compare(run.trainer_logp, run.control_logp, &run.control_k3);
    res.exact = all_zero(res.metrics) && run.lse_readback_mismatch == 0;
    if (cfg.sampling) {
      res.raw = compare(run.trainer_logp_raw, run.rollout_logp_raw, nullptr);
      res.exact = res.exact && all_zero(res.raw) && run.replay_outside_support == 0;
    }
    res.control_drift = res.control.mismatch_count > 0;
    if (run.trainer_entropy.empty() && run.total() > 0) {
      res.entropy_note = "the trainer's backend " + run.trainer.backend + " serves no entropy output (no entropy_id)";
    } else {
      res.entropy_compared = true;
      res.entropy = compare_entropy(run.trainer_entropy, run.rollout_entropy);
      res.entropy_exact = res.entropy.mismatch_count == 0 && res.entropy.mean_abs_diff == 0 &&
                          res.entropy.max_abs_diff == 0 && run.entropy_readback_mismatch == 0;
    }
  } else {
    res.entropy_note = "weight fingerprints differ: not compared";
  }
  res.exact = res.exact && run.fallback_free();
  res.entropy_exact = res.entropy_exact && run.fallback_free();
  res.json = report_json(cfg, run, res);
  res.markdown = report_markdown(cfg, run, res);
  log_summary(cfg, run, res, log);
  return res;
}

}  // namespace detlogp::golden

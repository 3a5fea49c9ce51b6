#include "golden/goldens.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "detlogp/dist.hpp"
#include "golden/generator.hpp"
#include "io/sha256.hpp"

namespace detlogp::golden {

const std::vector<GoldenCase>& golden_cases() {
  // name, rows, dim, weight_rows, real_vocab, tp, bias, T, T rows, ignore, i32, serving, gain, seed
  static const std::vector<GoldenCase> cases = {
      {"tiny-v17", 5, 64, 17, 17, 1, false, 1.0f, false, kDefaultIgnoreIndex, false, false, 1.0f, 11},
      {"v17-i32-ignore7", 17, 64, 17, 17, 1, true, 1.0f, false, 7, true, false, 1.0f, 12},
      {"v2053-bias-t0.7", 33, 1024, 2053, 2053, 1, true, 0.7f, false, kDefaultIgnoreIndex, true, false, 1.0f, 13},
      // Same inputs as v2053-bias-t0.7 through two vocabulary shards: same logp|lse digest.
      {"v2053-bias-t0.7-tp2", 33, 1024, 2053, 2053, 2, true, 0.7f, false, kDefaultIgnoreIndex, true, false, 1.0f, 13},
      {"v2053-trows-serving", 20, 1024, 2053, 2053, 1, false, 1.0f, true, kDefaultIgnoreIndex, false, true, 1.0f, 14},
      {"v2112-real2053-t1.3", 16, 1024, 2112, 2053, 1, true, 1.3f, false, kDefaultIgnoreIndex, false, false, 2.0f, 15},
      // Qwen3-8B lm_head as TP=2 shards: D=4096, 2 x 76032 rows (padded 152064), real vocab 151936.
      {"qwen3-8b-tp2", 8, 4096, 152064, 151936, 2, false, 1.0f, false, kDefaultIgnoreIndex, false, false, 1.0f, 16},
  };
  return cases;
}

std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t weight_rows, int tp) {
  const int64_t per = ((weight_rows + tp - 1) / tp + kVocabTile - 1) / kVocabTile * kVocabTile;
  std::vector<std::pair<int64_t, int64_t>> out;  // a rank past the end gets an empty shard
  for (int r = 0; r < tp; ++r) {
    const int64_t begin = std::min<int64_t>(weight_rows, r * per);
    out.emplace_back(begin, std::min<int64_t>(per, weight_rows - begin));
  }
  return out;
}

CaseInputs make_inputs(const GoldenCase& c) {
  CaseInputs in;
  in.c = c;
  in.weight = weight_rows(c.seed, 0, c.weight_rows, c.dim);
  in.hidden.resize(static_cast<size_t>(c.rows * c.dim));
  in.targets.resize(static_cast<size_t>(c.rows));
  for (int64_t n = 0; n < c.rows; ++n) {
    const uint64_t un = static_cast<uint64_t>(n);
    int64_t t = static_cast<int64_t>(draw(c.seed, kStreamTargets, un) % static_cast<uint64_t>(c.real_vocab));
    const bool dominant = n % 8 == 3;
    hidden_row(c.seed, un, c.dim, c.gain, dominant ? in.weight.data() + t * c.dim : nullptr,
               in.hidden.data() + n * c.dim);
    if (n % 16 == 15) t = c.ignore_index;
    in.targets[static_cast<size_t>(n)] = t;
  }
  in.targets32.assign(in.targets.begin(), in.targets.end());
  if (c.bias) {
    in.bias.resize(static_cast<size_t>(c.weight_rows));
    for (int64_t v = 0; v < c.weight_rows; ++v)
      in.bias[static_cast<size_t>(v)] = 0.1f * normal(c.seed, kStreamBias, static_cast<uint64_t>(v));
  }
  if (c.temperature_rows) {
    static const float kTable[] = {0.6f, 0.7f, 0.85f, 1.0f, 1.3f};
    for (int64_t n = 0; n < c.rows; ++n)
      in.temperatures.push_back(kTable[draw(c.seed, kStreamTemperature, static_cast<uint64_t>(n)) % 5]);
  }
  in.weight_fingerprint = weight_fingerprint({TensorView::matrix(in.weight.data(), DType::bf16, c.weight_rows, c.dim)});
  return in;
}

LinearLogpInputs CaseInputs::view(int64_t row_begin, int64_t count) const {
  LinearLogpInputs v;
  v.hidden = TensorView::matrix(hidden.data(), DType::bf16, c.rows, c.dim);
  v.weight = TensorView::matrix(weight.data() + row_begin * c.dim, DType::bf16, count, c.dim);
  if (!bias.empty()) v.bias = TensorView::vector(bias.data() + row_begin, DType::f32, count);
  v.targets = c.targets_i32 ? TensorView::vector(targets32.data(), DType::i32, c.rows)
                            : TensorView::vector(targets.data(), DType::i64, c.rows);
  v.temperature = c.temperature;
  if (!temperatures.empty()) v.temperature_rows = TensorView::vector(temperatures.data(), DType::f32, c.rows);
  v.real_vocab = c.real_vocab;
  v.vocab_start = row_begin;
  v.ignore_index = c.ignore_index;
  return v;
}

std::string CaseInputs::inputs_sha256() const {
  io::Sha256 h;
  h.update(hidden.data(), hidden.size() * 2);
  h.update(targets.data(), targets.size() * 8);
  h.update(bias.data(), bias.size() * 4);
  h.update(temperatures.data(), temperatures.size() * 4);
  h.update(weight_fingerprint.data(), weight_fingerprint.size());
  return io::Sha256::hex(h.finish());
}

namespace {

void same_backend(CallReport& first, const CallReport& r, bool& have) {
  if (!have) {
    first = r;
    have = true;
    return;
  }
  DETLOGP_CHECK(r.provenance.backend_id == first.provenance.backend_id && r.fallback == first.fallback,
                "calls of one case were served by different backends: " << first.provenance.backend_id << " and "
                                                                        << r.provenance.backend_id);
}

// The "entropy" fingerprint (docs/contract.md §10) of a case whose backend serves the entropy
// output: a second call of the case's entry over the whole head with the entropy output asked
// for, beside the first call's fingerprints, which stay as they were. A TP case takes the TP = 1
// call over the whole head: its entropy bits are those of every degree, as its lse bits are. The
// second call's logp and lse (and logits) must equal the first call's bits: the entropy output is
// formed beside them and may not move one.
void add_entropy(const CaseInputs& in, const CallOptions& opt, CaseResult& res, bool& have,
                 const std::vector<float>* first_logits) {
  const GoldenCase& c = in.c;
  std::vector<float> logp(static_cast<size_t>(c.rows)), lse(logp.size()), logits;
  res.entropy.assign(logp.size(), 0.0f);
  LinearLogpOutputs out{mutable_vector(logp.data(), DType::f32, c.rows),
                        mutable_vector(lse.data(), DType::f32, c.rows),
                        {},
                        mutable_vector(res.entropy.data(), DType::f32, c.rows)};
  if (first_logits != nullptr && !first_logits->empty()) {
    logits.resize(first_logits->size());
    out.logits = mutable_matrix(logits.data(), DType::f32, c.rows, c.weight_rows);
  }
  same_backend(res.report, linear_logp(in.view(), out, opt), have);
  DETLOGP_CHECK(std::memcmp(logp.data(), res.logp.data(), logp.size() * 4) == 0 &&
                    std::memcmp(lse.data(), res.lse.data(), lse.size() * 4) == 0,
                "case " << c.name << ": the call with the entropy output gave other logp/lse bits than without it");
  DETLOGP_CHECK(logits.empty() || std::memcmp(logits.data(), first_logits->data(), logits.size() * 4) == 0,
                "case " << c.name << ": the call with the entropy output gave other logits bits than without it");
  io::Sha256 h;
  h.update(res.entropy.data(), res.entropy.size() * 4);
  res.fingerprints.push_back({"entropy", io::Sha256::hex(h.finish())});
}

// One NCCL communicator set per device list, made once per process (ncclCommInitAll costs far
// more than a harness step) and destroyed at exit, before the CUDA runtime tears down (the cache
// is constructed after the first CUDA call, so it is destroyed first).
std::vector<void*> cached_nccl_comms(const std::vector<int>& devices) {
  // Backend probing initializes the CUDA runtime (and registers its teardown) before the cache.
  static const bool runtime_first = (void(list_backends()), true);
  (void)runtime_first;
  struct Cache {
    std::mutex mutex;
    std::map<std::vector<int>, std::vector<void*>> comms;
    ~Cache() {
      for (auto& [d, c] : comms) destroy_nccl_comms(c);
    }
  };
  static Cache cache;
  std::lock_guard<std::mutex> lock(cache.mutex);
  auto it = cache.comms.find(devices);
  if (it == cache.comms.end()) it = cache.comms.emplace(devices, make_nccl_comms(devices)).first;
  return it->second;
}

}  // namespace

void tensor_parallel_logp(const LinearLogpInputs& base, const std::vector<Shard>& shards, float* logp, float* lse,
                          const CallOptions& opt, std::vector<CallReport>* reports, const TpPlacement& placement,
                          float* logits) {
  const int ranks = static_cast<int>(shards.size());
  const int64_t rows = base.hidden.rows;
  const bool on_devices = !placement.devices.empty();
  DETLOGP_CHECK(!on_devices || static_cast<int>(placement.devices.size()) >= ranks,
                ranks << " tensor-parallel ranks need as many CUDA devices; " << placement.devices.size() << " given");
  std::vector<std::unique_ptr<Communicator>> local;
  std::vector<void*> nccl;
  if (on_devices)
    nccl = cached_nccl_comms(std::vector<int>(placement.devices.begin(), placement.devices.begin() + ranks));
  else
    local = make_local_communicators(ranks, Memory::host);
  std::vector<std::vector<float>> out_logp(shards.size(), std::vector<float>(static_cast<size_t>(rows)));
  std::vector<std::vector<float>> out_lse = out_logp;
  std::vector<std::vector<float>> out_logits(shards.size());
  std::vector<CallReport> rank_reports(shards.size());
  std::vector<std::string> errors(shards.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    if (logits) out_logits[r].resize(static_cast<size_t>(rows * shards[r].weight.rows));
    threads.emplace_back([&, r] {
      try {
        LinearLogpInputs in = base;
        in.weight = shards[r].weight;
        in.bias = shards[r].bias;
        in.vocab_start = shards[r].vocab_start;
        float* shard_logits = logits ? out_logits[r].data() : nullptr;
        if (on_devices) {
          tensor_parallel_rank_on_device(in, placement.devices[r], nccl[r], out_logp[r].data(), out_lse[r].data(),
                                         shard_logits, opt, &rank_reports[r]);
        } else {
          LinearLogpOutputs out{mutable_vector(out_logp[r].data(), DType::f32, rows),
                                mutable_vector(out_lse[r].data(), DType::f32, rows),
                                {}};
          if (shard_logits) out.logits = mutable_matrix(shard_logits, DType::f32, rows, in.weight.rows);
          rank_reports[r] = linear_logp_tensor_parallel(in, out, *local[r], opt);
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) DETLOGP_CHECK(errors[r].empty(), "tensor-parallel rank " << r << ": " << errors[r]);
  for (int r = 1; r < ranks; ++r)
    DETLOGP_CHECK(std::memcmp(out_logp[r].data(), out_logp[0].data(), static_cast<size_t>(rows) * 4) == 0 &&
                      std::memcmp(out_lse[r].data(), out_lse[0].data(), static_cast<size_t>(rows) * 4) == 0,
                  "tensor-parallel rank " << r << " ended with other logp/lse bits than rank 0");
  std::copy(out_logp[0].begin(), out_logp[0].end(), logp);
  std::copy(out_lse[0].begin(), out_lse[0].end(), lse);
  if (logits) {
    int64_t width = 0;
    for (const Shard& sh : shards) width += sh.weight.rows;
    int64_t col = 0;
    for (int r = 0; r < ranks; ++r) {
      const int64_t count = shards[r].weight.rows;
      for (int64_t n = 0; n < rows; ++n) std::copy_n(out_logits[r].data() + n * count, count, logits + n * width + col);
      col += count;
    }
  }
  if (reports) reports->insert(reports->end(), rank_reports.begin(), rank_reports.end());
}

CaseResult run_case(const CaseInputs& in, const CallOptions& opt) {
  const GoldenCase& c = in.c;
  CaseResult res;
  res.fingerprints.push_back({"inputs", in.inputs_sha256()});
  res.logp.assign(static_cast<size_t>(c.rows), 0.0f);
  res.lse.assign(static_cast<size_t>(c.rows), 0.0f);
  const MutableTensorView logp = mutable_vector(res.logp.data(), DType::f32, c.rows);
  const MutableTensorView lse = mutable_vector(res.lse.data(), DType::f32, c.rows);
  bool have = false;
  if (c.tp == 1) {
    std::vector<float> logits(c.serving ? static_cast<size_t>(c.rows * c.weight_rows) : 0);
    LinearLogpOutputs out{logp, lse, {}, {}};
    if (c.serving) out.logits = mutable_matrix(logits.data(), DType::f32, c.rows, c.weight_rows);
    same_backend(res.report, linear_logp(in.view(), out, opt), have);
    io::Sha256 h;
    h.update(res.logp.data(), res.logp.size() * 4);
    h.update(res.lse.data(), res.lse.size() * 4);
    h.update(logits.data(), logits.size() * 4);
    res.fingerprints.push_back({c.serving ? "logp|lse|logits" : "logp|lse", io::Sha256::hex(h.finish())});
    if (!res.report.provenance.entropy_id.empty()) add_entropy(in, opt, res, have, &logits);
    return res;
  }
  DETLOGP_CHECK(!c.serving, "case " << c.name << ": the serving entry is a TP=1 case");
  const auto ranges = shard_ranges(c.weight_rows, c.tp);
  std::vector<std::vector<TileSummary>> summaries(ranges.size());
  std::vector<std::vector<float>> target_logit(ranges.size());
  std::vector<std::vector<uint8_t>> owned(ranges.size());
  std::vector<ShardPartials> partials;
  for (size_t r = 0; r < ranges.size(); ++r) {
    ShardPartials p;
    p.rows = c.rows;
    if (ranges[r].second == 0) continue;  // an empty shard owns no tile: nothing to compute or merge
    p.tiles = shard_tiles(ranges[r].second);
    summaries[r].resize(static_cast<size_t>(c.rows * p.tiles));
    target_logit[r].resize(static_cast<size_t>(c.rows));
    owned[r].resize(static_cast<size_t>(c.rows));
    p.summaries = summaries[r].data();
    p.target_logit = target_logit[r].data();
    p.target_owned = owned[r].data();
    same_backend(res.report, linear_logp_partials(in.view(ranges[r].first, ranges[r].second), p, opt), have);
    // Same byte order as `detlogp run` on a shard: tile_max, tile_sum, target_logit, target_owned.
    io::Sha256 h;
    for (const TileSummary& s : summaries[r]) h.update(&s.max, 4);
    for (const TileSummary& s : summaries[r]) h.update(&s.sum, 4);
    h.update(target_logit[r].data(), target_logit[r].size() * 4);
    h.update(owned[r].data(), owned[r].size());
    res.fingerprints.push_back(
        {"rank" + std::to_string(r) + ":tile_max|tile_sum|target_logit|target_owned", io::Sha256::hex(h.finish())});
    partials.push_back(p);
  }
  merge_partials(partials, in.view().targets, c.ignore_index, logp, lse, opt);
  io::Sha256 h;
  h.update(res.logp.data(), res.logp.size() * 4);
  h.update(res.lse.data(), res.lse.size() * 4);
  res.fingerprints.push_back({"logp|lse", io::Sha256::hex(h.finish())});
  // The same rows through the tensor-parallel operator (one thread per rank).
  std::vector<Shard> shards;
  for (auto [start, count] : ranges) {
    if (count == 0) continue;
    const LinearLogpInputs v = in.view(start, count);
    shards.push_back({start, v.weight, v.bias});
  }
  std::vector<float> tp_logp(res.logp.size()), tp_lse(res.lse.size());
  std::vector<CallReport> reports;
  tensor_parallel_logp(in.view(), shards, tp_logp.data(), tp_lse.data(), opt, &reports);
  for (const CallReport& r : reports) same_backend(res.report, r, have);
  io::Sha256 t;
  t.update(tp_logp.data(), tp_logp.size() * 4);
  t.update(tp_lse.data(), tp_lse.size() * 4);
  res.fingerprints.push_back({"tp-operator:logp|lse", io::Sha256::hex(t.finish())});
  if (!res.report.provenance.entropy_id.empty()) add_entropy(in, opt, res, have, nullptr);
  return res;
}

std::map<FingerprintKey, std::string> read_fingerprints(const std::string& path) {
  std::map<FingerprintKey, std::string> out;
  std::ifstream f(path);
  if (!f) return out;
  std::string line;
  int line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> cols;
    std::stringstream ss(line);
    for (std::string col; std::getline(ss, col, '\t');) cols.push_back(col);
    DETLOGP_CHECK(cols.size() == 6 && cols[5].size() == 64,
                  "'" << path << "' line " << line_no << ": expected 6 tab-separated columns ending in a SHA-256");
    FingerprintKey k{std::stoi(cols[0]), cols[1], cols[2], cols[3], cols[4]};
    DETLOGP_CHECK(!out.count(k), "'" << path << "' line " << line_no << ": duplicate entry for " << cols[3] << " "
                                     << cols[4] << " on " << cols[1] << "/" << cols[2]);
    out[k] = cols[5];
  }
  return out;
}

std::string fingerprint_line(const FingerprintKey& k, const std::string& sha) {
  return std::to_string(k.contract_version) + "\t" + k.arch + "\t" + k.cc + "\t" + k.case_name + "\t" + k.scope + "\t" +
         sha;
}

}  // namespace detlogp::golden

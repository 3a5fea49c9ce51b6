// The sampling program over vocabulary shards (docs/contract.md §11.9). Every rank:
//   0. validates its call without throwing and all-gathers a header (shape, shard, digests of the
//      program, seeds, keys and targets, its error if any): every rank then refuses alike, or goes on;
//   per row chunk:
//   1. computes its shard's partials and logits on the backend (the serving entry of
//      linear_logp_partials at the program's temperature), and all-gathers the partials: every rank
//      assembles the row's global tiles (the straddling ones from the edge lanes, core/straddle.hpp)
//      in ascending order and gets the TP = 1 M, S, lse and y_t;
//   2. finds the cut (§11.4-§11.5) by radix selection over the rank keys: per 8-bit digit, each
//      rank's histogram of counts (top-k) or of top-p masses (top-p) over its candidates,
//      all-gathered and summed as integers, the same digit chosen everywhere;
//   3. forms its whole tiles' support summaries and its best Gumbel score (and, with the top-k
//      output, its shard's K largest y and their ids); they are all-gathered,
//      every rank summarizes the straddling tiles' support lanes itself and chains the tiles in
//      ascending order: the TP = 1 S_Sigma, the token is the best of the ranks' bests;
//   4. writes the row through SampleProblem::write_row, the output step of every backend (the top-k
//      output: the ranks' lists offered in rank order, each entry's logp with the TP = 1 lse).
// Only bytes move: tile summaries, scaled logits of edge lanes, integer histograms and each rank's
// best lane. Nothing is reduced in floating point in transit, and every floating-point step runs in
// the order TP = 1 runs it (row_stats over the ascending tiles, the support chain over them).
//
// CUDA memory (NCCL, in-process CUDA ranks): step 1 runs on the device backend; its partials and the
// chunk's logits shard are copied to the host, where steps 2-4 run as above (one protocol for both
// memories). The program's rows, seeds, keys and targets are read to the host once; each gather's
// bytes go host -> device staging -> all_gather on the stream -> host; the outputs are written on
// the host and copied to the caller's tensors at the end (docs/tensor-parallel.md).
#include "tp/tp_sample.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <sstream>
#include <type_traits>
#include <vector>

#include "core/device_ops.hpp"
#include "core/env.hpp"
#include "core/sample.hpp"
#include "core/straddle.hpp"
#include "core/validate.hpp"
#include "detlogp/topk.hpp"
#include "tp/tp_merge.hpp"

namespace detlogp::tp {
namespace {

// "DDLPTS01": the header of the sampling program's exchange.
constexpr uint64_t kSampleMagic = 0x31305354504C4444ull;
constexpr size_t kMessageBytes = 448;
constexpr int kDigitBits = 8;
constexpr int kDigits = 1 << kDigitBits;
constexpr int kPasses = 64 / kDigitBits;

struct SampleHeader {
  uint64_t magic = kSampleMagic;
  int32_t rank = -1;
  int32_t size = 0;
  int64_t rows = 0;
  int64_t dim = 0;
  PartialsLayout layout;  // targets_digest: the replay's targets; temperature_digest: the program's
  uint64_t top_k_digest = 0;
  uint64_t top_p_digest = 0;
  uint64_t min_p_digest = 0;
  uint64_t seed_digest = 0;
  uint64_t key_digest = 0;
  int64_t topk = 0;    // sample: K of the top-k output, 0 without it
  int32_t replay = 0;  // 1: linear_logp with a program; 0: sample
  int32_t error = 0;   // 1: this rank's local validation failed, see message
  char message[kMessageBytes] = {};
};
static_assert(std::is_trivially_copyable_v<SampleHeader>);
static_assert(sizeof(SampleHeader) == 32 + sizeof(PartialsLayout) + 56 + kMessageBytes, "no padding bytes");

// The communicator with where its bytes live: every exchange goes through gather(), which takes
// host buffers and, for a communicator of CUDA memory, stages them through device memory.
class Link {
 public:
  Link(Communicator& comm, void* stream) : comm(comm), stream(stream), cuda(comm.memory() == Memory::cuda) {}
  // Device staging of at least `bytes` per rank, allocated before any gather needs it.
  void reserve(size_t bytes) {
    if (cuda && bytes > slot_bytes_) {
      staging_ = detail::DeviceAllocation(bytes * static_cast<size_t>(comm.size()), comm.device(),
                                          "the tensor-parallel sampling staging buffer");
      slot_bytes_ = bytes;
    }
  }
  // Rank r's `bytes` at recv + r * bytes, recv and send host memory; complete on return.
  void gather(const void* send, void* recv, size_t bytes) {
    if (!cuda) {
      comm.all_gather(send, recv, bytes, stream);
      return;
    }
    DETLOGP_CHECK(bytes <= slot_bytes_, "internal: a gather of " << bytes << " bytes exceeds the staging of "
                                                                 << slot_bytes_ << " bytes a rank");
    uint8_t* dev = static_cast<uint8_t*>(staging_.get());
    uint8_t* mine = dev + bytes * static_cast<size_t>(comm.rank());
    const int device = comm.device();
    detail::device_copy_async(mine, send, bytes, device, stream);
    comm.all_gather(mine, dev, bytes, stream);  // in place, as NCCL allows
    detail::device_copy_async(recv, dev, bytes * static_cast<size_t>(comm.size()), device, stream);
    detail::device_stream_sync(device, stream);
  }
  Communicator& comm;
  void* const stream;
  const bool cuda;

 private:
  detail::DeviceAllocation staging_;
  size_t slot_bytes_ = 0;
};

// CUDA memory: host copies of the values the protocol reads (the program's rows, seeds, keys,
// targets) and of the outputs it writes, copied to the caller's tensors once every row is done.
struct HostMirror {
  std::vector<std::vector<uint64_t>> stores;
  struct Output {
    void* device;
    const void* host;
    size_t bytes;
  };
  std::vector<Output> outputs;
  float* device_logits = nullptr;  // the caller's [N, V_local] logits shard, or null
  std::vector<int64_t> targets;    // the replay's targets

  // Queues the copy of `bytes` of device memory to a new host store (after the stream's work).
  template <class T>
  const T* read(const T* device_ptr, size_t bytes, int device, void* stream) {
    if (device_ptr == nullptr) return nullptr;
    std::vector<uint64_t>& h = stores.emplace_back((bytes + 7) / 8 + 1);
    if (bytes > 0) detail::device_copy_async(h.data(), device_ptr, bytes, device, stream);
    return reinterpret_cast<const T*>(h.data());
  }
  // Points `field` at a host store of `count` values that finish() copies to where it pointed.
  template <class T>
  void output(T*& field, int64_t count) {
    if (field == nullptr) return;
    std::vector<uint64_t>& h = stores.emplace_back((static_cast<size_t>(count) * sizeof(T) + 7) / 8 + 1);
    outputs.push_back({field, h.data(), static_cast<size_t>(count) * sizeof(T)});
    field = reinterpret_cast<T*>(h.data());
  }
  void finish(int device, void* stream) const {
    for (const Output& o : outputs)
      if (o.bytes > 0) detail::device_copy_async(o.device, o.host, o.bytes, device, stream);
    detail::device_stream_sync(device, stream);
  }
};

// One rank's call after its local validation.
struct RankCall {
  SampleHeader header;
  detail::SampleProblem problem;    // the shard's program, keys or targets, and the caller's outputs
  LinearLogpInputs head;            // the shard's head operands for its partials
  std::vector<float> temperatures;  // per row: the program's T, 1 for T = 0 (the partials' scale)
  std::vector<int64_t> no_targets;  // sample: ignore_index on every row
  SamplingBackend* backend = nullptr;
  CallReport report;
  HostMirror mirror;  // CUDA memory only
};

const char* refusal(bool replay) {
  return replay ? "tensor-parallel linear_logp refused on every rank" : "tensor-parallel sample refused on every rank";
}

// A parameter given as a scalar or per row, digested with its form.
template <class F>
uint64_t rows_digest(bool per_row, int64_t rows, uint64_t scalar, F row_bits) {
  Fnv64 h;
  h.add(per_row ? 1u : 0u);
  if (!per_row) h.add(scalar);
  for (int64_t n = 0; per_row && n < rows; ++n) h.add(row_bits(n));
  return h.h;
}

// What every rank must share, from a validated problem, and the backend that serves the partials.
void fill_common(RankCall& c, SamplingBackend& backend, const SamplingProgram& program) {
  const detail::SampleProblem& p = c.problem;
  const detail::ProgramOperands& g = p.program;
  backend.select(p.memory, c.report);
  c.backend = &backend;
  SampleHeader& h = c.header;
  h.layout.vocab_start = p.vocab_start;
  h.layout.vocab_local = p.vocab_local;
  h.layout.real_vocab = p.real_vocab;
  h.layout.ignore_index = p.ignore_index;
  std::vector<float> t_rows(g.temperature_rows ? static_cast<size_t>(p.rows) : 0);
  for (size_t n = 0; n < t_rows.size(); ++n) t_rows[n] = g.temperature_rows[n];
  h.layout.temperature_digest = temperature_digest(program.temperature, t_rows);
  h.layout.backend_digest = backend_digest(c.report.provenance);
  h.top_k_digest = rows_digest(g.top_k_rows != nullptr, p.rows, static_cast<uint64_t>(g.top_k),
                               [&](int64_t n) { return static_cast<uint64_t>(g.top_k_of(n)); });
  h.top_p_digest = rows_digest(g.top_p_rows != nullptr, p.rows, fp::bits(g.top_p),
                               [&](int64_t n) { return fp::bits(g.top_p_rows[n]); });
  h.min_p_digest = rows_digest(g.min_p_rows != nullptr, p.rows, fp::bits(g.min_p),
                               [&](int64_t n) { return fp::bits(g.min_p_rows[n]); });
  c.temperatures.resize(static_cast<size_t>(p.rows));
  for (int64_t n = 0; n < p.rows; ++n) {
    const float t = g.temperature_of(n);
    c.temperatures[static_cast<size_t>(n)] = t == 0.0f ? 1.0f : t;
  }
}

const char* memory_name(Memory m) { return m == Memory::host ? "host" : "CUDA"; }

void check_memory(const TensorView& hidden, const Communicator& comm, const char* entry) {
  DETLOGP_CHECK(hidden.memory == comm.memory(),
                entry << " over vocabulary shards: hidden is in " << memory_name(hidden.memory) << " memory but the "
                      << comm.name() << " communicator gathers " << memory_name(comm.memory()) << " memory");
  DETLOGP_CHECK(comm.memory() == Memory::host || hidden.device == comm.device(),
                entry << " over vocabulary shards: hidden is on CUDA device " << hidden.device
                      << " but the communicator uses device " << comm.device());
}

// CUDA memory: reads the program's rows, the seeds and keys to the host (checked there like host
// rows) and points the outputs at host stores; `problem` then reads and writes host memory only.
void mirror_to_host(RankCall& c, void* stream) {
  detail::SampleProblem& p = c.problem;
  if (p.memory != Memory::cuda) return;
  HostMirror& m = c.mirror;
  detail::ProgramOperands& g = p.program;
  const size_t rows = static_cast<size_t>(p.rows);
  g.temperature_rows = m.read(g.temperature_rows, rows * 4, p.device, stream);
  g.top_k_rows = m.read(static_cast<const uint8_t*>(g.top_k_rows), rows * (g.top_k_i64 ? 8 : 4), p.device, stream);
  g.top_p_rows = m.read(g.top_p_rows, rows * 4, p.device, stream);
  g.min_p_rows = m.read(g.min_p_rows, rows * 4, p.device, stream);
  p.seed_rows = m.read(p.seed_rows, rows * 8, p.device, stream);
  p.key = m.read(p.key, rows * 8, p.device, stream);
  detail::device_stream_sync(p.device, stream);
  detail::check_program_rows(g, p.rows);
  m.output(p.token, p.rows);
  m.output(p.logp, p.rows);
  m.output(p.logp_raw, p.rows);
  m.output(p.lse, p.rows);
  m.output(p.support_size, p.rows);
  m.output(p.lse_support, p.rows);
  m.output(p.support_max, p.rows);
  m.output(p.cut_logit, p.rows);
  m.output(p.cut_id, p.rows);
  m.output(p.topk_ids, p.rows * p.topk);
  m.output(p.topk_logp, p.rows * p.topk);
  m.device_logits = p.logits;  // written on the device by the backend, per chunk
  p.logits = nullptr;
}

void record_error(SampleHeader& h, const std::exception& e) {
  h.error = 1;
  std::strncpy(h.message, e.what(), kMessageBytes - 1);
}

std::vector<SampleHeader> exchange(Link& link, const SampleHeader& mine) {
  std::vector<SampleHeader> all(static_cast<size_t>(link.comm.size()));
  link.gather(&mine, all.data(), sizeof mine);
  return all;
}

// Either every rank returns, or every rank throws the same message (it reads only the gathered headers).
void decide(const std::vector<SampleHeader>& hs, bool replay) {
  const int ranks = static_cast<int>(hs.size());
  std::ostringstream errors;
  for (int r = 0; r < ranks; ++r) {
    DETLOGP_CHECK(hs[r].magic == kSampleMagic,
                  "tensor-parallel sampling header of rank "
                      << r << " is garbled: the ranks do not run the same detlogp version"
                      << " and entry, or the communicator is not a rank-ordered all-gather");
    if (hs[r].error != 0) errors << "\n  rank " << r << ": " << hs[r].message;
  }
  DETLOGP_CHECK(errors.tellp() == 0, refusal(replay) << " (nothing was written):" << errors.str());
  check_headers_in_rank_order(hs);
  const auto field = [&](auto get) { return header_field(hs, get); };
  check_ranks_agree(field([](const SampleHeader& h) { return h.replay; }),
                    "the entry (1: linear_logp replaying a program, 0: sample)");
  check_ranks_agree(field([](const SampleHeader& h) { return h.rows; }), "N (hidden rows)");
  check_ranks_agree(field([](const SampleHeader& h) { return h.dim; }), "D (hidden size)");
  check_ranks_agree(field([](const SampleHeader& h) { return h.topk; }),
                    "topk (the K columns of topk_ids and topk_logp; 0 without them)");
  const auto same = [&](uint64_t SampleHeader::*digest, const char* what) {
    for (int r = 1; r < ranks; ++r)
      DETLOGP_CHECK(hs[r].*digest == hs[0].*digest, "ranks disagree on " << what << " (rank 0 and rank " << r
                                                                         << " digest them differently): every rank "
                                                                            "must pass the same sampling program");
  };
  same(&SampleHeader::top_k_digest, "top_k (the scalar or top_k_rows)");
  same(&SampleHeader::top_p_digest, "top_p (the scalar or top_p_rows)");
  same(&SampleHeader::min_p_digest, "min_p (the scalar or min_p_rows)");
  same(&SampleHeader::seed_digest, "the seeds (seed or seed_rows)");
  same(&SampleHeader::key_digest, "the keys (key)");
  std::vector<PartialsLayout> layouts;
  for (const SampleHeader& h : hs) layouts.push_back(h.layout);
  check_layouts(layouts);
}

// Offsets of the regions of one rank's slot in a gather, each a multiple of 8 bytes.
class Slot {
 public:
  size_t add(size_t bytes) {
    const size_t at = bytes_;
    bytes_ += (bytes + 7) / 8 * 8;
    return at;
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

// One all-gather of every rank's slot: rank r's slot at recv + r * slot bytes.
class Gather {
 public:
  Gather(size_t slot_bytes, int ranks)
      : words_((slot_bytes + 7) / 8), send_(words_ + 1), recv(words_ * static_cast<size_t>(ranks) + 1) {}
  template <class T>
  T* mine(size_t offset) {
    return reinterpret_cast<T*>(reinterpret_cast<uint8_t*>(send_.data()) + offset);
  }
  template <class T>
  const T* of(int rank, size_t offset) const {
    return reinterpret_cast<const T*>(reinterpret_cast<const uint8_t*>(recv.data()) + words_ * 8 * rank + offset);
  }
  void clear() { std::fill(send_.begin(), send_.end(), 0); }
  void run(Link& link) { link.gather(send_.data(), recv.data(), words_ * 8); }

 private:
  size_t words_;
  std::vector<uint64_t> send_;
  std::vector<uint64_t> recv;
};

// A rank's shard as every rank sees it (from the headers).
struct RankShard {
  int64_t vocab_start;
  int64_t vocab_local;
  ShardGeometry g;
};

// Radix selection over the candidates of `active` rows, one 8-bit digit per pass from the top: per
// row, the key at which the descending cumulative weight of the union of the ranks' candidates
// first reaches `target` (the count of top-k; with `top_p`, the threshold of §11.5 from the total
// mass, computed at the first pass). Candidates are (key, weight) pairs, each rank's own.
void radix_select(Link& link, int64_t n, std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& cands,
                  const std::vector<uint8_t>& active, std::vector<uint64_t>& target, const std::vector<float>* top_p,
                  std::vector<uint64_t>& key) {
  const int ranks = link.comm.size();
  Slot slot;
  const size_t hist_at = slot.add(static_cast<size_t>(n) * kDigits * sizeof(uint64_t));
  Gather gather(slot.bytes(), ranks);
  std::vector<uint64_t> total(kDigits);
  for (int64_t i = 0; i < n; ++i) key[static_cast<size_t>(i)] = 0;
  for (int pass = 0; pass < kPasses; ++pass) {
    const int shift = 64 - kDigitBits * (pass + 1);
    gather.clear();
    uint64_t* hist = gather.mine<uint64_t>(hist_at);
    for (int64_t i = 0; i < n; ++i) {
      if (!active[static_cast<size_t>(i)]) continue;
      for (const auto& [k, w] : cands[static_cast<size_t>(i)]) hist[i * kDigits + ((k >> shift) & (kDigits - 1))] += w;
    }
    gather.run(link);
    for (int64_t i = 0; i < n; ++i) {
      if (!active[static_cast<size_t>(i)]) continue;
      std::fill(total.begin(), total.end(), 0);
      for (int r = 0; r < ranks; ++r) {
        const uint64_t* h = gather.of<uint64_t>(r, hist_at) + i * kDigits;
        for (int b = 0; b < kDigits; ++b) total[static_cast<size_t>(b)] += h[b];
      }
      uint64_t& rem = target[static_cast<size_t>(i)];
      if (top_p && pass == 0) {
        uint64_t mass = 0;
        for (uint64_t t : total) mass += t;
        rem = top_p_threshold(mass, (*top_p)[static_cast<size_t>(i)]);
      }
      int b = kDigits - 1;
      while (b > 0 && rem > total[static_cast<size_t>(b)]) rem -= total[static_cast<size_t>(b--)];
      DETLOGP_CHECK(rem >= 1 && rem <= total[static_cast<size_t>(b)],
                    "internal: the radix selection of row " << i << " ran out of candidates (docs/contract.md 11.9)");
      key[static_cast<size_t>(i)] |= static_cast<uint64_t>(b) << shift;
      auto& c = cands[static_cast<size_t>(i)];
      c.erase(std::remove_if(c.begin(), c.end(),
                             [&](const auto& kw) { return ((kw.first >> shift) & (kDigits - 1)) != uint64_t(b); }),
              c.end());
    }
  }
}

// TensorView of `count` f32 / i64 values in host memory.
TensorView host_vector(const void* data, DType dtype, int64_t count) {
  return TensorView::vector(data, dtype, count, Memory::host);
}

TensorView row_slice(const TensorView& t, int64_t row0, int64_t rows) {
  if (!t.present()) return t;
  TensorView s = t;
  s.data = static_cast<const uint8_t*>(t.data) + row0 * t.row_stride * dtype_size(t.dtype);
  s.rows = rows;
  return s;
}

// A device buffer of `count` T (at least one), for the CUDA chunk step.
template <class T>
detail::DeviceAllocation device_buffer(int64_t count, int device, const char* what) {
  return detail::DeviceAllocation(static_cast<size_t>(std::max<int64_t>(1, count)) * sizeof(T), device, what);
}

TensorView on_device(TensorView t, int device) {
  t.memory = Memory::cuda;
  t.device = device;
  return t;
}

CallReport run(RankCall& c, Link& link, const LinearLogpInputs* replay_in) {
  Communicator& comm = link.comm;
  const std::vector<SampleHeader> headers = exchange(link, c.header);
  const bool replay = replay_in != nullptr;
  decide(headers, replay);
  const detail::SampleProblem& p = c.problem;
  const int64_t rows = p.rows;
  if (rows == 0) return c.report;
  const int ranks = comm.size(), me = comm.rank();
  const int device = comm.device();
  const int64_t real_vocab = p.real_vocab;
  const int64_t n_global = detail::ceil_tiles(real_vocab);

  std::vector<RankShard> shards;
  int64_t max_tiles = 1, max_edge = 1, max_local = 1;
  for (const SampleHeader& h : headers) {
    const ShardGeometry g = shard_geometry(h.layout.vocab_start, h.layout.vocab_local, real_vocab);
    shards.push_back({h.layout.vocab_start, h.layout.vocab_local, g});
    max_tiles = std::max(max_tiles, g.tiles);
    max_edge = std::max(max_edge, g.edge_lanes());
    max_local = std::max(max_local, h.layout.vocab_local);
  }
  const RankShard& own = shards[static_cast<size_t>(me)];
  const ShardGeometry& g = own.g;
  const int64_t v_local = own.vocab_local;
  const int64_t local_real = std::clamp<int64_t>(real_vocab - own.vocab_start, 0, v_local);

  // The row chunk, the same on every rank (from the headers): this rank's logits and scaled
  // logits plus every gather's slots within the tensor-parallel workspace.
  const int64_t topk = p.topk;  // the same on every rank (decided from the headers)
  const int64_t per_row_bytes =
      max_local * 8 +
      ranks * (kDigits * 8 + 2 * max_tiles * static_cast<int64_t>(sizeof(TileSummary)) + max_edge * 4 + 64 + topk * 12);
  const int64_t budget = detail::env_tp_workspace_mib() << 20;
  const int64_t chunk = std::clamp<int64_t>(budget / per_row_bytes, 1, rows);

  std::vector<float> z_buffer(p.logits ? 0 : static_cast<size_t>(chunk * v_local));
  std::vector<float> y(static_cast<size_t>(chunk * v_local));
  std::vector<TileSummary> summaries(static_cast<size_t>(std::max<int64_t>(1, chunk * g.tiles)));
  std::vector<float> edge(static_cast<size_t>(std::max<int64_t>(1, chunk * g.edge_lanes())));
  std::vector<float> target_logit(static_cast<size_t>(chunk));
  std::vector<uint8_t> owned(static_cast<size_t>(chunk));

  Slot s1;
  const size_t s1_summaries = s1.add(static_cast<size_t>(chunk * max_tiles) * sizeof(TileSummary));
  const size_t s1_edge = s1.add(static_cast<size_t>(chunk * max_edge) * sizeof(float));
  const size_t s1_target = s1.add(static_cast<size_t>(chunk) * sizeof(float));
  const size_t s1_owned = s1.add(static_cast<size_t>(chunk));
  Gather partials(s1.bytes(), ranks);
  Slot s2;
  const size_t s2_summaries = s2.add(static_cast<size_t>(chunk * max_tiles) * sizeof(TileSummary));
  const size_t s2_size = s2.add(static_cast<size_t>(chunk) * sizeof(int64_t));
  const size_t s2_token = s2.add(static_cast<size_t>(chunk) * sizeof(int64_t));
  const size_t s2_score = s2.add(static_cast<size_t>(chunk) * sizeof(float));
  const size_t s2_token_logit = s2.add(static_cast<size_t>(chunk) * sizeof(float));
  const size_t s2_cut_logit = s2.add(static_cast<size_t>(chunk) * sizeof(float));
  const size_t s2_cut_owned = s2.add(static_cast<size_t>(chunk));
  const size_t s2_topk_y = s2.add(static_cast<size_t>(chunk * topk) * sizeof(float));  // each rank's top-k list
  const size_t s2_topk_id = s2.add(static_cast<size_t>(chunk * topk) * sizeof(int64_t));
  Gather support(s2.bytes(), ranks);
  std::vector<TopkEntry> topk_list(static_cast<size_t>(topk));

  // CUDA memory: the device side of step 1 and the gathers' staging. An allocation can fail on one
  // rank only: the ranks agree on it before the first chunk, like on the call itself.
  detail::DeviceAllocation d_summaries, d_edge, d_target, d_owned, d_z, d_temperatures, d_no_targets;
  if (link.cuda) {
    SampleHeader status = c.header;
    try {
      link.reserve(std::max({s1.bytes(), s2.bytes(), static_cast<size_t>(chunk) * kDigits * sizeof(uint64_t)}) + 8);
      d_summaries = device_buffer<TileSummary>(chunk * g.tiles, device, "the sampling partials' tile summaries");
      d_edge = device_buffer<float>(chunk * g.edge_lanes(), device, "the sampling partials' edge lanes");
      d_target = device_buffer<float>(chunk, device, "the sampling partials' target logits");
      d_owned = device_buffer<uint8_t>(chunk, device, "the sampling partials' owned flags");
      if (c.mirror.device_logits == nullptr)
        d_z = device_buffer<float>(chunk * v_local, device, "the chunk's logits shard");
      d_temperatures = device_buffer<float>(chunk, device, "the chunk's temperatures");
      if (!replay) {
        d_no_targets = device_buffer<int64_t>(chunk, device, "the chunk's (ignored) targets");
        detail::device_copy_async(d_no_targets.get(), c.no_targets.data(), static_cast<size_t>(chunk) * 8, device,
                                  link.stream);
      }
    } catch (const std::exception& e) {
      record_error(status, e);
    }
    decide(exchange(link, status), replay);
  }

  std::vector<TileSummary> tiles(static_cast<size_t>(n_global));
  std::vector<uint8_t> placed(static_cast<size_t>(n_global));
  std::vector<RowStats> stats(static_cast<size_t>(chunk));
  std::vector<float> y_t(static_cast<size_t>(chunk));
  std::vector<SampleRowParams> params(static_cast<size_t>(chunk));
  std::vector<uint8_t> samplable(static_cast<size_t>(chunk)), need_k(static_cast<size_t>(chunk)),
      need_p(static_cast<size_t>(chunk));
  std::vector<uint64_t> target(static_cast<size_t>(chunk)), k_cut(static_cast<size_t>(chunk)),
      p_cut(static_cast<size_t>(chunk));
  std::vector<float> top_p(static_cast<size_t>(chunk));
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> cands(static_cast<size_t>(chunk));
  std::vector<SupportRow> rows_support(static_cast<size_t>(chunk));
  SamplingReport sampling;

  for (int64_t row0 = 0; row0 < rows; row0 += chunk) {
    const int64_t n = std::min(chunk, rows - row0);

    // 1. This rank's partials and logits, gathered; every rank's raw statistics of each row.
    float* z = p.logits ? p.logits + row0 * v_local : z_buffer.data();
    ShardPartials part;
    part.rows = n;
    part.tiles = g.tiles;
    part.summaries = summaries.data();
    part.target_logit = target_logit.data();
    part.target_owned = owned.data();
    part.edge_lanes = g.edge_lanes();
    part.edge_logits = edge.data();
    part.memory = Memory::host;
    part.logits = MutableTensorView{TensorView::matrix(z, DType::f32, n, v_local, Memory::host)};
    LinearLogpInputs part_in = c.head;
    part_in.hidden = row_slice(c.head.hidden, row0, n);
    part_in.targets =
        replay ? row_slice(replay_in->targets, row0, n) : host_vector(c.no_targets.data() + row0, DType::i64, n);
    part_in.temperature = 1.0f;
    part_in.temperature_rows = host_vector(c.temperatures.data() + row0, DType::f32, n);
    if (!link.cuda) {
      detail::LogpProblem problem = detail::make_problem(part_in, nullptr, &part);
      c.backend->run(problem);
    } else {
      // The same chunk on the device, its partials and logits shard then copied to the host buffers.
      ShardPartials dev = part;
      dev.summaries = static_cast<TileSummary*>(d_summaries.get());
      dev.target_logit = static_cast<float*>(d_target.get());
      dev.target_owned = static_cast<uint8_t*>(d_owned.get());
      dev.edge_logits = static_cast<float*>(d_edge.get());
      dev.memory = Memory::cuda;
      dev.device = device;
      float* dz = c.mirror.device_logits ? c.mirror.device_logits + row0 * v_local : static_cast<float*>(d_z.get());
      dev.logits = MutableTensorView{on_device(TensorView::matrix(dz, DType::f32, n, v_local), device)};
      detail::device_copy_async(d_temperatures.get(), c.temperatures.data() + row0, static_cast<size_t>(n) * 4, device,
                                link.stream);
      LinearLogpInputs dev_in = part_in;
      dev_in.targets = replay ? row_slice(replay_in->targets, row0, n)
                              : on_device(TensorView::vector(d_no_targets.get(), DType::i64, n), device);
      dev_in.temperature_rows = on_device(TensorView::vector(d_temperatures.get(), DType::f32, n), device);
      detail::LogpProblem problem = detail::make_problem(dev_in, nullptr, &dev);
      problem.stream = link.stream;
      c.backend->run(problem);
      const auto to_host = [&](void* dst, const void* src, int64_t bytes) {
        if (bytes > 0) detail::device_copy_async(dst, src, static_cast<size_t>(bytes), device, link.stream);
      };
      to_host(summaries.data(), dev.summaries, n * g.tiles * static_cast<int64_t>(sizeof(TileSummary)));
      to_host(edge.data(), dev.edge_logits, n * g.edge_lanes() * 4);
      to_host(target_logit.data(), dev.target_logit, n * 4);
      to_host(owned.data(), dev.target_owned, n);
      to_host(z, dz, n * v_local * 4);
      detail::device_stream_sync(device, link.stream);
    }

    partials.clear();
    std::copy(summaries.begin(), summaries.begin() + n * g.tiles, partials.mine<TileSummary>(s1_summaries));
    std::copy(edge.begin(), edge.begin() + n * g.edge_lanes(), partials.mine<float>(s1_edge));
    std::copy(target_logit.begin(), target_logit.begin() + n, partials.mine<float>(s1_target));
    std::copy(owned.begin(), owned.begin() + n, partials.mine<uint8_t>(s1_owned));
    partials.run(link);

    std::vector<detail::RankEdges> edges;
    for (int r = 0; r < ranks; ++r)
      edges.push_back({shards[static_cast<size_t>(r)].vocab_start, shards[static_cast<size_t>(r)].vocab_local,
                       shards[static_cast<size_t>(r)].g.edge_lanes() > 0 ? partials.of<float>(r, s1_edge) : nullptr});
    const detail::StraddlePlan plan = detail::plan_straddles(edges, real_vocab);
    // Every global tile with a real lane is placed exactly once: whole in one shard, or straddling.
    std::fill(placed.begin(), placed.end(), 0);
    for (const RankShard& r : shards)
      for (int64_t j = 0; j < r.g.tiles; ++j)
        if (r.g.first_tile + j < n_global) ++placed[static_cast<size_t>(r.g.first_tile + j)];
    for (const detail::StraddleTile& t : plan.tiles) ++placed[static_cast<size_t>(t.tile)];
    for (int64_t t = 0; t < n_global; ++t)
      DETLOGP_CHECK(placed[static_cast<size_t>(t)] == 1, "internal: global tile " << t << " is held by "
                                                                                  << int(placed[static_cast<size_t>(t)])
                                                                                  << " shards' partials");

    const auto assemble = [&](int64_t i, const Gather& from, size_t at) {
      for (int r = 0; r < ranks; ++r) {
        const RankShard& s = shards[static_cast<size_t>(r)];
        const TileSummary* src = from.of<TileSummary>(r, at) + i * s.g.tiles;
        for (int64_t j = 0; j < s.g.tiles && s.g.first_tile + j < n_global; ++j)
          tiles[static_cast<size_t>(s.g.first_tile + j)] = src[j];
      }
    };
    bool any_k = false, any_p = false;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = row0 + i;
      assemble(i, partials, s1_summaries);
      for (const detail::StraddleTile& t : plan.tiles)
        tiles[static_cast<size_t>(t.tile)] = detail::straddle_summary<false>(t, plan.runs.data(), i).summary;
      stats[static_cast<size_t>(i)] = row_stats(tiles.data(), n_global);
      y_t[static_cast<size_t>(i)] = 0.0f;
      for (int r = 0; r < ranks; ++r)
        if (partials.of<uint8_t>(r, s1_owned)[i]) y_t[static_cast<size_t>(i)] = partials.of<float>(r, s1_target)[i];
      const SampleRowParams rp = p.program.row(row, real_vocab);
      params[static_cast<size_t>(i)] = rp;
      samplable[static_cast<size_t>(i)] = row_samplable(stats[static_cast<size_t>(i)]) ? 1 : 0;
      const bool cut = samplable[static_cast<size_t>(i)] && has_cut(rp, real_vocab);
      need_k[static_cast<size_t>(i)] = cut && rp.keep < real_vocab ? 1 : 0;
      need_p[static_cast<size_t>(i)] = cut && rp.top_p < 1.0f ? 1 : 0;
      any_k = any_k || need_k[static_cast<size_t>(i)];
      any_p = any_p || need_p[static_cast<size_t>(i)];
      float* yi = y.data() + i * v_local;
      const float* zi = z + i * v_local;
      for (int64_t v = 0; v < local_real; ++v) yi[v] = scale_logit(zi[v], rp.inv_temperature);
    }

    // 2. The cut: top-k by counts, then top-p by masses over the lanes top-k keeps.
    if (any_k) {
      for (int64_t i = 0; i < n; ++i) {
        auto& ci = cands[static_cast<size_t>(i)];
        ci.clear();
        if (!need_k[static_cast<size_t>(i)]) continue;
        const float* yi = y.data() + i * v_local;
        for (int64_t v = 0; v < local_real; ++v) ci.emplace_back(rank_key(yi[v], own.vocab_start + v), 1u);
        target[static_cast<size_t>(i)] = static_cast<uint64_t>(params[static_cast<size_t>(i)].keep);
      }
      radix_select(link, n, cands, need_k, target, nullptr, k_cut);
    }
    if (any_p) {
      for (int64_t i = 0; i < n; ++i) {
        auto& ci = cands[static_cast<size_t>(i)];
        ci.clear();
        if (!need_p[static_cast<size_t>(i)]) continue;
        const float* yi = y.data() + i * v_local;
        const float row_max = stats[static_cast<size_t>(i)].max;
        for (int64_t v = 0; v < local_real; ++v) {
          const uint64_t k = rank_key(yi[v], own.vocab_start + v);
          if (need_k[static_cast<size_t>(i)] && k < k_cut[static_cast<size_t>(i)]) continue;
          const uint64_t q = top_p_mass(relative_weight(yi[v], row_max));
          if (q > 0) ci.emplace_back(k, q);
        }
        top_p[static_cast<size_t>(i)] = params[static_cast<size_t>(i)].top_p;
      }
      radix_select(link, n, cands, need_p, target, &top_p, p_cut);
    }

    // 3. This rank's support: its whole tiles' masked summaries, its support lanes, its best score.
    support.clear();
    TileSummary* masked = support.mine<TileSummary>(s2_summaries);
    int64_t* size = support.mine<int64_t>(s2_size);
    int64_t* token = support.mine<int64_t>(s2_token);
    float* score = support.mine<float>(s2_score);
    float* token_logit = support.mine<float>(s2_token_logit);
    float* cut_logit = support.mine<float>(s2_cut_logit);
    uint8_t* cut_owned = support.mine<uint8_t>(s2_cut_owned);
    float* topk_y = support.mine<float>(s2_topk_y);
    int64_t* topk_id = support.mine<int64_t>(s2_topk_id);
    for (int64_t i = 0; i < n; ++i) {
      // The shard's top-k list (every row, like the output's NaN rows): its K largest y, id -1 past
      // its real lanes.
      if (topk > 0) {
        const float* yi = y.data() + i * v_local;
        int count = 0;
        topk_offer_lanes(topk_list.data(), static_cast<int>(topk), count, yi, local_real, own.vocab_start);
        topk_store_list(topk_list.data(), static_cast<int>(topk), count, topk_y + i * topk, topk_id + i * topk);
      }
      const int64_t row = row0 + i;
      SupportRow sr{stats[static_cast<size_t>(i)].max, no_cut(), params[static_cast<size_t>(i)].min_p};
      if (need_k[static_cast<size_t>(i)] || need_p[static_cast<size_t>(i)]) {
        const uint64_t k =
            need_p[static_cast<size_t>(i)] ? p_cut[static_cast<size_t>(i)] : k_cut[static_cast<size_t>(i)];
        sr.cut = {rank_key_logit(k), rank_key_id(k)};
      }
      rows_support[static_cast<size_t>(i)] = sr;
      token[i] = kNoToken;
      if (!samplable[static_cast<size_t>(i)]) continue;
      const float* yi = y.data() + i * v_local;
      const bool draw = !replay;
      const uint64_t stream = draw ? p.row_stream(row) : 0;
      SupportPass pass{0.0f, 0, kNoToken, 0.0f};
      float best = fp::neg_inf();
      for (int64_t j = 0; j < g.tiles; ++j) {
        const int64_t col = g.head_cols + j * kVocabTile;
        const int real = g.real_lanes(j, real_vocab);
        const uint64_t mask = support_lanes(yi + col, real, own.vocab_start + col, sr, draw, stream, pass, best);
        masked[i * g.tiles + j] = tile_summary_masked(yi + col, mask);
      }
      support_lanes(yi, static_cast<int>(g.head_lanes), own.vocab_start, sr, draw, stream, pass, best);
      const int64_t tail = v_local - g.tail_lanes;
      support_lanes(yi + tail, static_cast<int>(g.tail_lanes), own.vocab_start + tail, sr, draw, stream, pass, best);
      size[i] = pass.size;
      token[i] = pass.token;
      score[i] = best;
      token_logit[i] = pass.token_logit;
      const int64_t cut_col = sr.cut.id - own.vocab_start;
      if (sr.cut.id != kNoCutId && cut_col >= 0 && cut_col < local_real) {
        cut_logit[i] = yi[cut_col];  // the lane's own bits (its key holds -0 as +0)
        cut_owned[i] = 1;
      }
    }
    support.run(link);

    // 4. Every rank: the support chain over the ascending tiles, the best token, the row's outputs.
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = row0 + i;
      SupportRow sr = rows_support[static_cast<size_t>(i)];
      SupportPass pass{0.0f, 0, kNoToken, 0.0f};
      if (samplable[static_cast<size_t>(i)]) {
        for (int r = 0; r < ranks; ++r)
          if (support.of<uint8_t>(r, s2_cut_owned)[i]) sr.cut.logit = support.of<float>(r, s2_cut_logit)[i];
        assemble(i, support, s2_summaries);
        for (const detail::StraddleTile& t : plan.tiles) {
          float lanes[kVocabTile];
          detail::straddle_lanes(t, plan.runs.data(), i, lanes);
          SupportPass unused{0.0f, 0, kNoToken, 0.0f};
          float unused_best = fp::neg_inf();
          const uint64_t mask =
              support_lanes(lanes, t.real_lanes, t.tile * kVocabTile, sr, false, 0, unused, unused_best);
          tiles[static_cast<size_t>(t.tile)] = tile_summary_masked(lanes, mask);
        }
        for (int64_t t = 0; t < n_global; ++t) pass.sum = chain_step(pass.sum, tiles[static_cast<size_t>(t)], sr.max);
        float best = fp::neg_inf();
        for (int r = 0; r < ranks; ++r) {
          pass.size += support.of<int64_t>(r, s2_size)[i];
          const int64_t id = support.of<int64_t>(r, s2_token)[i];
          const float sc = support.of<float>(r, s2_score)[i];
          if (id == kNoToken) continue;
          if (pass.token == kNoToken || score_precedes(sc, id, best, pass.token)) {
            best = sc;
            pass.token = id;
            pass.token_logit = support.of<float>(r, s2_token_logit)[i];
          }
        }
      }
      if (topk > 0) {  // the ranks' lists offered in rank order, then the TP = 1 lse: linear_logp's bits
        int count = 0;
        for (int r = 0; r < ranks; ++r)
          topk_offer_list(topk_list.data(), static_cast<int>(topk), count, support.of<float>(r, s2_topk_y) + i * topk,
                          support.of<int64_t>(r, s2_topk_id) + i * topk);
        for (int64_t j = 0; j < topk; ++j) {  // K <= real_vocab: the merged list is full
          p.topk_ids[row * topk + j] = topk_list[static_cast<size_t>(j)].id;
          p.topk_logp[row * topk + j] =
              target_logp(topk_list[static_cast<size_t>(j)].y, stats[static_cast<size_t>(i)].lse);
        }
      }
      const bool target_read = replay && p.target(row) != p.ignore_index;
      if (p.write_row(row, stats[static_cast<size_t>(i)], sr, pass, target_read ? y_t[static_cast<size_t>(i)] : 0.0f)) {
        if (sampling.outside_support == 0) sampling.first_outside_support = row;
        ++sampling.outside_support;
      }
    }
  }
  if (link.cuda) c.mirror.finish(device, link.stream);
  c.report.sampling = sampling;
  return c.report;
}

}  // namespace

CallReport run_sample_tensor_parallel(const SampleInputs& in, const SampleOutputs& out, Communicator& comm,
                                      void* stream, SamplingBackend& backend) {
  // (A rank that cannot allocate the headers' few bytes of staging cannot take part in any exchange.)
  Link link(comm, stream);
  link.reserve(sizeof(SampleHeader));
  RankCall c;
  c.header.rank = comm.rank();
  c.header.size = comm.size();
  c.header.rows = in.hidden.rows;
  c.header.dim = in.hidden.cols;
  c.header.layout.vocab_start = in.vocab_start;
  c.header.layout.vocab_local = in.weight.rows;
  try {
    detail::check_environment();  // inside the exchange: a rank's bad environment refuses every rank
    check_memory(in.hidden, comm, "sample");
    c.problem = detail::make_sample_problem(in, out, true);
    c.header.topk = c.problem.topk;
    mirror_to_host(c, stream);
    c.head.hidden = in.hidden;
    c.head.weight = in.weight;
    c.head.bias = in.bias;
    c.head.real_vocab = c.problem.real_vocab;
    c.head.vocab_start = in.vocab_start;
    fill_common(c, backend, in.program);
    const detail::SampleProblem& p = c.problem;
    c.header.seed_digest = rows_digest(p.seed_rows != nullptr, p.rows, p.seed,
                                       [&](int64_t n) { return static_cast<uint64_t>(p.seed_rows[n]); });
    c.header.key_digest = rows_digest(true, p.rows, 0, [&](int64_t n) { return static_cast<uint64_t>(p.key[n]); });
    c.no_targets.assign(static_cast<size_t>(p.rows), c.head.ignore_index);
  } catch (const std::exception& e) {  // detlogp::Error, and bad_alloc
    record_error(c.header, e);
  }
  return run(c, link, nullptr);
}

CallReport run_replay_tensor_parallel(const LinearLogpInputs& in, const SamplingProgram& program,
                                      const SampledLogpOutputs& out, Communicator& comm, void* stream,
                                      SamplingBackend& backend) {
  Link link(comm, stream);
  link.reserve(sizeof(SampleHeader));
  RankCall c;
  c.header.replay = 1;
  c.header.rank = comm.rank();
  c.header.size = comm.size();
  c.header.rows = in.hidden.rows;
  c.header.dim = in.hidden.cols;
  c.header.layout.vocab_start = in.vocab_start;
  c.header.layout.vocab_local = in.weight.rows;
  c.header.layout.ignore_index = in.ignore_index;
  try {
    detail::check_environment();
    check_memory(in.hidden, comm, "linear_logp with a sampling program");
    DETLOGP_CHECK(
        in.targets.ndim != 2,
        "targets must be [N] with a sampling program (one target a row), got [N, K] with K=" << in.targets.cols);
    c.problem = detail::make_sampled_logp_problem(in, program, out, true);
    detail::SampleProblem& p = c.problem;
    HostRows host = read_rows(p.targets, p.targets_i64, 1, nullptr, p.rows, p.memory, p.device, stream);
    if (p.memory == Memory::cuda) {  // checked on the host copy, which the protocol then reads
      detail::check_targets_host(host.targets.data(), true, p.rows, p.real_vocab, p.ignore_index, 1, false);
      c.mirror.targets = host.targets;
      p.targets = c.mirror.targets.data();
      p.targets_i64 = true;
    }
    mirror_to_host(c, stream);
    c.head = in;
    c.head.real_vocab = p.real_vocab;
    fill_common(c, backend, program);
    c.header.layout.targets_digest = targets_digest(host.targets, 1);
  } catch (const std::exception& e) {
    record_error(c.header, e);
  }
  return run(c, link, &in);
}

}  // namespace detlogp::tp

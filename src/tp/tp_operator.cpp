// The tensor-parallel protocol: header exchange (every rank takes the same decision), rank-local
// partials, one rank-ordered all-gather of their bytes per row chunk, the owned merge everywhere.
#include "tp/tp_operator.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <sstream>
#include <type_traits>
#include <vector>

#include "core/device_ops.hpp"
#include "core/env.hpp"
#include "core/validate.hpp"
#include "tp/tp_merge.hpp"

namespace detlogp::tp {
namespace {

// "DDLPTP03": the gathered slots carry the edge lanes of shards that are not 64-aligned.
constexpr uint64_t kHeaderMagic = 0x33305054504C4444ull;
constexpr size_t kMessageBytes = 448;

// What every rank tells every other rank before any data moves. Fixed size, trivially copyable.
struct RankHeader {
  uint64_t magic = kHeaderMagic;
  int32_t rank = -1;
  int32_t size = 0;
  int64_t rows = 0;
  int64_t dim = 0;
  PartialsLayout layout;        // this rank's partials as linear_logp_partials would record them
  uint32_t serving = 0;         // logits requested
  uint32_t entropy = 0;         // the entropy output requested: the partials carry usums
  int32_t error = 0;            // 1: this rank's local validation failed, see message
  int32_t targets_per_row = 1;  // K of [N, K] targets (1 for [N])
  int32_t topk = 0;             // K of the top-k output (0: none)
  int32_t reserved = 0;         // keeps the header free of padding bytes
  char message[kMessageBytes] = {};
};
static_assert(std::is_trivially_copyable_v<RankHeader>);
static_assert(sizeof(RankHeader) % 8 == 0);
static_assert(sizeof(RankHeader) == 32 + sizeof(PartialsLayout) + 24 + kMessageBytes, "no padding bytes");

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

template <class T>
T* byte_offset(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

// One rank's slot of the gather buffer for a chunk of `chunk` rows. The edge lanes' region exists
// only when some rank's shard is not 64-aligned (max_edge > 0), so aligned shards gather the same
// bytes as before it existed.
struct SlotLayout {
  size_t summaries = 0;  // offset of [chunk][tiles_r] summaries
  size_t target_logit = 0;
  size_t owned = 0;
  size_t usums = 0;        // offset of [chunk][tiles_r] entropy sums, with the entropy output
  size_t edge_logits = 0;  // offset of [chunk][edge_lanes_r] scaled logits of the rank's edge lanes
  size_t topk_logit = 0;   // offsets of [chunk][topk] top-k lists, with the top-k output
  size_t topk_ids = 0;
  size_t bytes = 0;
};
SlotLayout slot_layout(int64_t chunk, int64_t max_tiles, int64_t max_edge, int64_t per_row, int64_t topk,
                       bool entropy) {
  SlotLayout s;
  s.bytes = round_up(static_cast<size_t>(chunk * max_tiles) * sizeof(TileSummary), 256);
  s.target_logit = s.bytes;
  s.bytes += round_up(static_cast<size_t>(chunk * per_row) * sizeof(float), 256);
  s.owned = s.bytes;
  s.bytes += round_up(static_cast<size_t>(chunk * per_row), 256);
  if (entropy) {
    s.usums = s.bytes;
    s.bytes += round_up(static_cast<size_t>(chunk * max_tiles) * sizeof(float), 256);
  }
  if (max_edge > 0) {
    s.edge_logits = s.bytes;
    s.bytes += round_up(static_cast<size_t>(chunk * max_edge) * sizeof(float), 256);
  }
  if (topk > 0) {
    s.topk_logit = s.bytes;
    s.bytes += round_up(static_cast<size_t>(chunk * topk) * sizeof(float), 256);
    s.topk_ids = s.bytes;
    s.bytes += round_up(static_cast<size_t>(chunk * topk) * sizeof(int64_t), 256);
  }
  return s;
}

// Rank r's partials in its gathered slot `s` (n rows), with its layout (the merge reads the shard's
// geometry from it).
ShardPartials slot_partials(void* s, const SlotLayout& slot, const PartialsLayout& layout, int64_t n, int64_t per_row,
                            int64_t topk, bool entropy, Memory memory, int device) {
  const ShardGeometry g = shard_geometry(layout.vocab_start, layout.vocab_local, layout.real_vocab);
  ShardPartials p;
  p.rows = n;
  p.tiles = g.tiles;
  p.targets_per_row = per_row;
  p.summaries = byte_offset<TileSummary>(s, slot.summaries);
  p.target_logit = byte_offset<float>(s, slot.target_logit);
  p.target_owned = byte_offset<uint8_t>(s, slot.owned);
  if (entropy) p.usums = byte_offset<float>(s, slot.usums);
  p.edge_lanes = g.edge_lanes();
  if (p.edge_lanes > 0) p.edge_logits = byte_offset<float>(s, slot.edge_logits);
  if (topk > 0) {
    p.topk = topk;
    p.topk_logit = byte_offset<float>(s, slot.topk_logit);
    p.topk_ids = byte_offset<int64_t>(s, slot.topk_ids);
  }
  p.memory = memory;
  p.device = device;
  p.layout = layout;
  return p;
}

// Either every rank returns, or every rank throws the same message (the decision reads only the
// gathered headers, which are the same bytes everywhere).
void decide(const std::vector<RankHeader>& hs) {
  const int ranks = static_cast<int>(hs.size());
  std::ostringstream errors;
  for (int r = 0; r < ranks; ++r) {
    DETLOGP_CHECK(hs[r].magic == kHeaderMagic, "tensor-parallel header of rank "
                                                   << r << " is garbled: the ranks do not run the same detlogp version"
                                                   << " or the communicator is not a rank-ordered all-gather");
    if (hs[r].error != 0) errors << "\n  rank " << r << ": " << hs[r].message;
  }
  DETLOGP_CHECK(errors.tellp() == 0,
                "tensor-parallel linear_logp refused on every rank (nothing was written):" << errors.str());
  check_headers_in_rank_order(hs);
  const auto field = [&](auto get) { return header_field(hs, get); };
  check_ranks_agree(field([](const RankHeader& h) { return h.rows; }), "N (hidden rows)");
  check_ranks_agree(field([](const RankHeader& h) { return h.dim; }), "D (hidden size)");
  check_ranks_agree(field([](const RankHeader& h) { return h.serving; }), "the entry (serving: logits requested)");
  check_ranks_agree(field([](const RankHeader& h) { return h.entropy; }), "the entropy output (1: requested)");
  check_ranks_agree(field([](const RankHeader& h) { return h.targets_per_row; }), "K (target ids per row)");
  check_ranks_agree(field([](const RankHeader& h) { return h.topk; }), "the top-k output (its K; 0: none)");
  std::vector<PartialsLayout> layouts;
  for (const RankHeader& h : hs) layouts.push_back(h.layout);
  check_layouts(layouts);
}

// Row view [row0, row0 + rows) of a 1-D or 2-D tensor (no copy).
TensorView row_slice(const TensorView& t, int64_t row0, int64_t rows) {
  if (!t.present()) return t;
  TensorView s = t;
  s.data = static_cast<const uint8_t*>(t.data) + row0 * t.row_stride * dtype_size(t.dtype);
  s.rows = rows;
  return s;
}
MutableTensorView row_slice(const MutableTensorView& t, int64_t row0, int64_t rows) {
  return {row_slice(static_cast<const TensorView&>(t), row0, rows)};
}

// All-gathers one header per rank (staged through `staging`, ranks * sizeof(RankHeader) bytes
// of device memory, when the communicator gathers CUDA memory).
std::vector<RankHeader> exchange(Communicator& comm, const RankHeader& mine, void* staging, void* stream) {
  std::vector<RankHeader> headers(static_cast<size_t>(comm.size()));
  if (comm.memory() == Memory::host) {
    comm.all_gather(&mine, headers.data(), sizeof(RankHeader), stream);
    return headers;
  }
  auto* dev = static_cast<RankHeader*>(staging);
  detail::device_copy_async(dev + comm.rank(), &mine, sizeof mine, comm.device(), stream);
  comm.all_gather(dev + comm.rank(), dev, sizeof(RankHeader), stream);
  detail::device_copy_async(headers.data(), dev, sizeof(RankHeader) * headers.size(), comm.device(), stream);
  detail::device_stream_sync(comm.device(), stream);
  return headers;
}

}  // namespace

CallReport run_tensor_parallel(const LinearLogpInputs& in, const LinearLogpOutputs& out, Communicator& comm,
                               void* stream, PartialsBackend& backend) {
  const int ranks = comm.size(), me = comm.rank();
  DETLOGP_CHECK(ranks >= 1 && ranks <= kMaxTensorParallelRanks,
                "communicator size " << ranks << " is outside [1, " << kMaxTensorParallelRanks << "]");
  DETLOGP_CHECK(me >= 0 && me < ranks, "communicator rank " << me << " is outside [0, " << ranks << ")");
  const Memory memory = comm.memory();
  const int device = comm.device();

  // 1. Local validation, caught: a failing rank still joins the header exchange.
  RankHeader mine;
  mine.rank = me;
  mine.size = ranks;
  mine.rows = in.hidden.rows;
  mine.dim = in.hidden.cols;
  mine.layout.vocab_start = in.vocab_start;
  mine.layout.vocab_local = in.weight.rows;
  mine.layout.ignore_index = in.ignore_index;
  mine.serving = out.logits.present() ? 1 : 0;
  mine.entropy = out.entropy.present() ? 1 : 0;
  mine.targets_per_row = in.targets.ndim == 2 && in.targets.cols >= 1 && in.targets.cols <= kMaxTargetsPerRow
                             ? static_cast<int32_t>(in.targets.cols)
                             : 1;
  mine.topk =
      out.topk_ids.present() && out.topk_ids.ndim == 2 && out.topk_ids.cols >= 1 && out.topk_ids.cols <= kMaxTopk
          ? static_cast<int32_t>(out.topk_ids.cols)
          : 0;
  CallReport report;
  try {
    DETLOGP_CHECK(in.hidden.memory == memory, "hidden is in "
                                                  << (in.hidden.memory == Memory::host ? "host" : "CUDA")
                                                  << " memory but the " << comm.name() << " communicator gathers "
                                                  << (memory == Memory::host ? "host" : "CUDA") << " memory");
    DETLOGP_CHECK(memory == Memory::host || in.hidden.device == device,
                  "hidden is on CUDA device " << in.hidden.device << " but the communicator uses device " << device);
    // A backend that cannot compute the entropy sums refuses here, so every rank refuses together.
    backend.select(memory, mine.entropy != 0, mine.targets_per_row, mine.topk, report);
    // Validation only: the partial buffers come per chunk below; make_problem never reads them.
    static TileSummary validation_summary;
    static float validation_float;
    static uint8_t validation_flag;
    ShardPartials shape;
    shape.rows = in.hidden.rows;
    // The geometry of a shard make_problem accepts (it checks the shard before the partials).
    const int64_t shape_real_vocab = in.real_vocab < 0 ? in.vocab_start + in.weight.rows : in.real_vocab;
    if (in.weight.rows > 0 && in.vocab_start >= 0 && shape_real_vocab > 0) {
      const ShardGeometry g = shard_geometry(in.vocab_start, in.weight.rows, shape_real_vocab);
      shape.tiles = g.tiles;
      shape.edge_lanes = g.edge_lanes();
    }
    shape.summaries = &validation_summary;
    shape.target_logit = &validation_float;
    shape.target_owned = &validation_flag;
    shape.edge_logits = &validation_float;
    shape.targets_per_row = mine.targets_per_row;
    shape.topk = mine.topk;
    static int64_t validation_id;
    shape.topk_logit = &validation_float;
    shape.topk_ids = &validation_id;
    shape.memory = memory;
    shape.device = device;
    shape.logits = out.logits;
    const detail::LogpProblem p = detail::make_problem(in, nullptr, &shape);
    mine.layout.real_vocab = p.real_vocab;
    const auto check_out = [&](const MutableTensorView& t, const char* name) {
      DETLOGP_CHECK(t.ndim == 1 && t.dtype == DType::f32 && t.rows == p.rows,
                    name << " must be [N=" << p.rows << "] f32, got ndim=" << t.ndim << " " << dtype_name(t.dtype)
                         << " with " << t.rows << " elements");
      DETLOGP_CHECK(p.rows == 0 || t.data != nullptr, name << " data pointer is null");
      DETLOGP_CHECK(t.memory == memory && (memory == Memory::host || t.device == device),
                    name << " is not in the communicator's memory");
    };
    if (p.targets_2d) {  // logp [N, K], one entry per target
      detail::check_logp_tensor(out.logp, in.targets, p.rows, p.targets_per_row);
      DETLOGP_CHECK(out.logp.memory == memory && (memory == Memory::host || out.logp.device == device),
                    "logp is not in the communicator's memory");
    } else {
      check_out(out.logp, "logp");
    }
    check_out(out.lse, "lse");
    if (out.entropy.present()) check_out(out.entropy, "entropy");
    detail::check_topk_outputs(out.topk_ids, out.topk_logp, p.rows, p.real_vocab, memory, device);

    // Targets and temperatures: checked on the host (a device copy costs N * 12 bytes), so every
    // rank validates the same values and digests them for the consistency check.
    const HostRows host =
        read_rows(p.targets, p.targets_i64, p.targets_per_row, p.temperature_rows, p.rows, memory, device, stream);
    detail::check_targets_host(host.targets.data(), true, p.rows, p.real_vocab, p.ignore_index, p.targets_per_row,
                               p.targets_2d);
    if (!host.temperatures.empty()) detail::check_temperatures_host(host.temperatures.data(), p.rows);
    mine.layout.targets_digest = targets_digest(host.targets, p.targets_per_row);
    mine.layout.temperature_digest = temperature_digest(p.temperature, host.temperatures);
    // One call's partials must all come from one backend under one contract version, arch and
    // set of frozen choices.
    mine.layout.backend_digest = backend_digest(report.provenance);
  } catch (const std::exception& e) {  // detlogp::Error, and bad_alloc from the host copies
    mine.error = 1;
    std::strncpy(mine.message, e.what(), kMessageBytes - 1);
  }

  // 2. Header exchange: the one collective every rank reaches whatever happened above.
  // (A rank that cannot allocate these few bytes cannot take part in any exchange at all.)
  detail::DeviceAllocation staging;
  if (memory == Memory::cuda)
    staging = detail::DeviceAllocation(sizeof(RankHeader) * static_cast<size_t>(ranks), device, "TP headers");
  const std::vector<RankHeader> headers = exchange(comm, mine, staging.get(), stream);
  decide(headers);

  // 3. Partials by row chunk, all-gathered in rank order, merged on every rank.
  const int64_t rows = mine.rows;
  if (rows == 0) return report;
  int64_t max_tiles = 1, max_edge = 0;
  for (const RankHeader& h : headers) {
    const ShardGeometry g = shard_geometry(h.layout.vocab_start, h.layout.vocab_local, h.layout.real_vocab);
    max_tiles = std::max(max_tiles, g.tiles);
    max_edge = std::max(max_edge, g.edge_lanes());
  }
  const bool entropy = mine.entropy != 0;  // the same on every rank (decide)
  const int64_t tile_bytes = static_cast<int64_t>(sizeof(TileSummary) + (entropy ? sizeof(float) : 0));
  const int64_t per_row = mine.targets_per_row;  // the same on every rank (decide)
  const int64_t topk = mine.topk;                // the same on every rank (decide)
  const int64_t per_row_bytes = ranks * (max_tiles * tile_bytes + max_edge * 4 + 5 * per_row + 12 * topk);
  const int64_t budget = detail::env_tp_workspace_mib() << 20;
  const int64_t chunk = std::min(rows, std::max<int64_t>(64, budget / per_row_bytes / 64 * 64));
  const SlotLayout slot = slot_layout(chunk, max_tiles, max_edge, per_row, topk, entropy);
  const size_t gather_bytes = slot.bytes * static_cast<size_t>(ranks);

  // The gather buffer can fail to allocate on one rank only: agree on that too before gathering.
  std::vector<uint8_t> host_gather;
  detail::DeviceAllocation device_gather;
  void* gather = nullptr;
  RankHeader alloc_status = mine;
  try {
    if (memory == Memory::host) {
      host_gather.resize(gather_bytes);
      gather = host_gather.data();
    } else {
      device_gather = detail::DeviceAllocation(gather_bytes, device, "the tensor-parallel gather buffer");
      gather = device_gather.get();
    }
  } catch (const std::exception& e) {
    alloc_status.error = 1;
    std::strncpy(alloc_status.message, e.what(), kMessageBytes - 1);
  }
  decide(exchange(comm, alloc_status, staging.get(), stream));
  for (int64_t row0 = 0; row0 < rows; row0 += chunk) {
    const int64_t n = std::min(chunk, rows - row0);
    LinearLogpInputs part_in = in;
    part_in.hidden = row_slice(in.hidden, row0, n);
    part_in.targets = row_slice(in.targets, row0, n);
    part_in.temperature_rows = row_slice(in.temperature_rows, row0, n);
    void* my_slot = byte_offset<uint8_t>(gather, slot.bytes * static_cast<size_t>(me));
    ShardPartials part = slot_partials(my_slot, slot, mine.layout, n, per_row, topk, entropy, memory, device);
    if (out.logits.present()) part.logits = row_slice(out.logits, row0, n);
    detail::LogpProblem problem = detail::make_problem(part_in, nullptr, &part);
    problem.stream = stream;
    backend.run(problem);

    comm.all_gather(my_slot, gather, slot.bytes, stream);

    const MutableTensorView logp = row_slice(out.logp, row0, n), lse = row_slice(out.lse, row0, n);
    const MutableTensorView entropy_rows = row_slice(out.entropy, row0, n);
    std::vector<ShardPartials> views;
    for (int r = 0; r < ranks; ++r)
      views.push_back(slot_partials(byte_offset<uint8_t>(gather, slot.bytes * static_cast<size_t>(r)), slot,
                                    headers[r].layout, n, per_row, topk, entropy, memory, device));
    merge_owned(views, part_in.targets, in.ignore_index, logp, lse, stream, entropy_rows,
                row_slice(out.topk_ids, row0, n), row_slice(out.topk_logp, row0, n));
  }
  // The gather buffer is freed on return: finish the merge first (cudaFree would also wait).
  if (memory == Memory::cuda) detail::device_stream_sync(device, stream);
  return report;
}

}  // namespace detlogp::tp

#include "tp/tp_merge.hpp"

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "core/device_ops.hpp"
#include "core/straddle.hpp"
#include "core/validate.hpp"
#include "detlogp/fpops.hpp"

namespace detlogp::tp {
namespace {

using detail::plan_straddles;
using detail::RankEdges;
using detail::straddle_summary;
using detail::StraddlePlan;

std::string hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << std::setw(16) << std::setfill('0') << v;
  return os.str();
}

// Whether a rank's partials hold any tile or lane (a shard of padding inside one tile holds none,
// and owns no target).
bool contributes(const ShardPartials& r) { return r.tiles > 0 || r.edge_lanes > 0; }

// The partials' buffers and rows, and targets/logp/lse (and entropy) beside them: what every merge
// checks, before anything is written.
void check_operands(const std::vector<ShardPartials>& ranks, const TensorView& targets, const MutableTensorView& logp,
                    const MutableTensorView& lse, const MutableTensorView& entropy, const MutableTensorView& topk_ids,
                    const MutableTensorView& topk_logp) {
  DETLOGP_CHECK(!ranks.empty(), "merge_partials needs at least one rank's partials");
  const int64_t rows = ranks.front().rows;
  const Memory memory = ranks.front().memory;
  const int device = ranks.front().device;
  for (size_t r = 0; r < ranks.size(); ++r) {
    DETLOGP_CHECK(ranks[r].memory == memory && (memory == Memory::host || ranks[r].device == device),
                  "rank " << r << " partials are not in the same memory as rank 0's");
    DETLOGP_CHECK(ranks[r].rows == rows, "rank " << r << " has " << ranks[r].rows << " rows, rank 0 has " << rows);
    DETLOGP_CHECK(rows == 0 || ((ranks[r].tiles == 0 || ranks[r].summaries) &&
                                (!contributes(ranks[r]) || (ranks[r].target_logit && ranks[r].target_owned)) &&
                                (ranks[r].edge_lanes == 0 || ranks[r].edge_logits)),
                  "rank " << r << " partials have a null buffer");
    // The entropy needs every tile's u_g: a rank without them would silently drop its tiles' terms.
    DETLOGP_CHECK(!entropy.present() || rows == 0 || ranks[r].tiles == 0 || ranks[r].usums,
                  "the entropy output needs every rank's usums, but rank "
                      << r
                      << " partials carry none (usums is null): compute every rank's partials with "
                         "ShardPartials::usums set (linear_logp_partials fills them)");
  }
  const int64_t per_row = ranks.front().targets_per_row;
  for (size_t r = 0; r < ranks.size(); ++r)
    DETLOGP_CHECK(
        ranks[r].targets_per_row == per_row,
        "rank " << r << " partials have targets_per_row=" << ranks[r].targets_per_row << ", rank 0 has " << per_row);
  if (targets.ndim == 2) {
    DETLOGP_CHECK(targets.rows == rows && targets.cols == per_row && targets.row_stride == per_row &&
                      (targets.dtype == DType::i32 || targets.dtype == DType::i64),
                  "targets must be [N=" << rows << ", K=" << per_row << "] i32 or i64, contiguous (the partials' K)");
  } else {
    DETLOGP_CHECK(
        per_row == 1 && targets.ndim == 1 && targets.rows == rows &&
            (targets.dtype == DType::i32 || targets.dtype == DType::i64),
        "targets must be [N=" << rows << "] i32 or i64" << (per_row > 1 ? " ([N, K] for partials of K > 1)" : ""));
  }
  if (targets.ndim == 2)
    detail::check_logp_tensor(logp, targets, rows, per_row);
  else
    DETLOGP_CHECK(logp.ndim == 1 && logp.rows == rows && logp.dtype == DType::f32,
                  "logp must be [N=" << rows << "] f32");
  DETLOGP_CHECK(lse.ndim == 1 && lse.rows == rows && lse.dtype == DType::f32, "lse must be [N=" << rows << "] f32");
  if (entropy.present()) {
    DETLOGP_CHECK(entropy.ndim == 1 && entropy.rows == rows && entropy.dtype == DType::f32,
                  "entropy must be [N=" << rows << "] f32");
    DETLOGP_CHECK(rows == 0 || entropy.data != nullptr, "entropy data pointer is null");
  }
  for (const TensorView* t : {&targets, static_cast<const TensorView*>(&logp), static_cast<const TensorView*>(&lse)})
    DETLOGP_CHECK(t->memory == memory && (memory == Memory::host || t->device == device),
                  "targets, logp and lse must be in the partials' memory");
  DETLOGP_CHECK(
      !entropy.present() || (entropy.memory == memory && (memory == Memory::host || entropy.device == device)),
      "entropy must be in the partials' memory");
  // The top-k output: from every rank's lists, of the partials' K.
  if (topk_ids.present() || topk_logp.present()) {
    const int64_t k = ranks.front().topk;
    DETLOGP_CHECK(k > 0,
                  "the top-k output needs every rank's top-k lists, but rank 0 partials carry none (topk=0): "
                  "compute every rank's partials with ShardPartials::topk set");
    for (size_t r = 0; r < ranks.size(); ++r)
      DETLOGP_CHECK(ranks[r].topk == k && (rows == 0 || (ranks[r].topk_logit && ranks[r].topk_ids)),
                    "rank " << r << " partials carry topk=" << ranks[r].topk << " lists"
                            << (ranks[r].topk == k ? " with a null buffer" : "") << ", rank 0 has topk=" << k);
    DETLOGP_CHECK(topk_ids.cols == k,
                  "topk_ids has K=" << topk_ids.cols << " columns but the partials carry topk=" << k);
    detail::check_topk_outputs(topk_ids, topk_logp, rows, k, memory, device);
  }
  DETLOGP_CHECK(rows == 0 || targets.data != nullptr, "targets data pointer is null");
}

// The straddling tiles of the ranks' shards (their layouts give the shards), reading the edge lanes
// from the partials' buffers.
StraddlePlan plan_of(const std::vector<ShardPartials>& ranks) {
  std::vector<RankEdges> edges;
  for (const ShardPartials& r : ranks) edges.push_back({r.layout.vocab_start, r.layout.vocab_local, r.edge_logits});
  return plan_straddles(edges, ranks.front().layout.real_vocab);
}

// The merge itself, after check_operands, over checked layouts.
void merge_rows(const std::vector<ShardPartials>& ranks, const TensorView& targets, int64_t ignore_index,
                const MutableTensorView& logp, const MutableTensorView& lse, const MutableTensorView& entropy,
                const MutableTensorView& topk_ids, const MutableTensorView& topk_logp, void* stream) {
  const int64_t rows = ranks.front().rows;
  if (rows == 0) return;
  const bool i64 = targets.dtype == DType::i64;
  float* entropy_out = entropy.present() ? static_cast<float*>(entropy.mutable_data()) : nullptr;
  const StraddlePlan plan = plan_of(ranks);
  if (ranks.front().memory == Memory::cuda) {
    // Ownership lives on the device: exactly one rank's target_owned is 1 per non-ignored row
    // because the shards are contiguous and cover real_vocab, and every rank flagged the same
    // targets (the protocol's header exchange, or merge_partials' layout checks).
    // Ranks that hold no tile or lane own no target and add nothing: left out (their buffers may
    // be null), the plan's rank indices renumbered to the ranks passed.
    std::vector<detail::DeviceMergeRank> views;
    std::vector<int> view_of(ranks.size(), -1);
    for (size_t i = 0; i < ranks.size(); ++i) {
      const ShardPartials& r = ranks[i];
      if (!contributes(r)) continue;
      view_of[i] = static_cast<int>(views.size());
      views.push_back({r.summaries, r.tiles, r.target_logit, r.target_owned, entropy_out ? r.usums : nullptr});
    }
    StraddlePlan device_plan = plan;
    for (detail::StraddleTile& t : device_plan.tiles) t.completed_by = static_cast<int16_t>(view_of[t.completed_by]);
    detail::device_merge(views, rows, targets.data, i64, ignore_index, static_cast<float*>(logp.mutable_data()),
                         static_cast<float*>(lse.mutable_data()), ranks.front().device, stream, entropy_out,
                         &device_plan, ranks.front().targets_per_row);
    if (topk_ids.present()) {
      std::vector<detail::DeviceTopkList> lists;
      for (const ShardPartials& r : ranks) lists.push_back({r.topk_logit, r.topk_ids});
      detail::device_merge_topk(lists, rows, ranks.front().topk, static_cast<const float*>(lse.mutable_data()),
                                static_cast<int64_t*>(topk_ids.mutable_data()),
                                static_cast<float*>(topk_logp.mutable_data()), ranks.front().device, stream);
    }
    return;
  }
  auto target_of = [&](int64_t n) {
    return i64 ? static_cast<const int64_t*>(targets.data)[n] : static_cast<const int32_t*>(targets.data)[n];
  };
  // Validate ownership before writing anything.
  const int64_t per_row = ranks.front().targets_per_row;
  const bool two_d = targets.ndim == 2;
  for (int64_t i = 0; i < rows * per_row; ++i) {
    if (target_of(i) == ignore_index) continue;
    int owners = 0;
    for (const auto& r : ranks) owners += contributes(r) && r.target_owned[i] ? 1 : 0;
    DETLOGP_CHECK(owners == 1, "targets[" << (two_d ? std::to_string(i / per_row) + ", " + std::to_string(i % per_row)
                                                    : std::to_string(i))
                                          << "]=" << target_of(i) << " is owned by " << owners
                                          << " shards; exactly one shard must own each non-ignored target");
  }
  // The straddling tile each rank completes, if any: it goes right before that rank's whole tiles.
  std::vector<int> completes(ranks.size(), -1);
  for (size_t k = 0; k < plan.tiles.size(); ++k)
    completes[static_cast<size_t>(plan.tiles[k].completed_by)] = static_cast<int>(k);
  float* logp_out = static_cast<float*>(logp.mutable_data());
  float* lse_out = static_cast<float*>(lse.mutable_data());
  std::vector<TileEntropySummary> straddles(plan.tiles.size());
  std::vector<TopkEntry> topk_list(static_cast<size_t>(ranks.front().topk));
  for (int64_t n = 0; n < rows; ++n) {
    for (size_t k = 0; k < plan.tiles.size(); ++k)
      straddles[k] = entropy_out ? straddle_summary<true>(plan.tiles[k], plan.runs.data(), n)
                                 : straddle_summary<false>(plan.tiles[k], plan.runs.data(), n);
    float global_max = fp::neg_inf();
    for (const TileEntropySummary& s : straddles) global_max = chain_max(global_max, s.summary.max);
    for (const auto& r : ranks)
      for (int64_t g = 0; g < r.tiles; ++g) global_max = chain_max(global_max, r.summaries[n * r.tiles + g].max);
    // Rank order is ascending global tile order, each straddling tile placed before the whole tiles
    // of the rank that completes it: the same chain steps, in the same order, as
    // reduce_row_summaries and entropy_row_summaries run over one shard's tiles.
    float sum = 0.0f, usum = 0.0f, comp = 0.0f;
    const auto step = [&](const TileSummary& tile, float tile_usum) {
      const float before = sum;
      sum = chain_step(sum, tile, global_max);
      if (entropy_out) {
        comp = compensation_step(comp, before, sum, tile.sum, chain_factor_or_skip(tile, global_max));
        usum = entropy_chain_step(usum, tile, tile_usum, global_max);
      }
    };
    for (size_t i = 0; i < ranks.size(); ++i) {
      const ShardPartials& r = ranks[i];
      if (completes[i] >= 0) step(straddles[completes[i]].summary, straddles[completes[i]].usum);
      for (int64_t g = 0; g < r.tiles; ++g)
        step(r.summaries[n * r.tiles + g], entropy_out ? r.usums[n * r.tiles + g] : 0.0f);
    }
    // Each target's y_t from its owner and its own finalize: the bits of a single-target merge.
    for (int64_t k = 0; k < per_row; ++k) {
      const int64_t i = n * per_row + k;
      float y_t = 0.0f;
      for (const auto& r : ranks)
        if (contributes(r) && r.target_owned[i]) y_t = r.target_logit[i];
      const RowResult res = finalize_row(global_max, sum, y_t, target_of(i) == ignore_index);
      logp_out[i] = res.logp;
      lse_out[n] = res.lse;
    }
    if (entropy_out) entropy_out[n] = finalize_entropy(sum, usum, comp);
    // Top-k: the K first of the ranks' lists, offered rank by rank, each finalized like a target.
    if (topk_ids.present()) {
      const int k = static_cast<int>(ranks.front().topk);
      int count = 0;
      for (const auto& r : ranks) topk_offer_list(topk_list.data(), k, count, r.topk_logit + n * k, r.topk_ids + n * k);
      DETLOGP_CHECK(count == k, "internal: the ranks' top-k lists hold " << count << " ids of row " << n
                                                                         << ", fewer than topk=" << k);
      auto* ids = static_cast<int64_t*>(topk_ids.mutable_data());
      auto* lp = static_cast<float*>(topk_logp.mutable_data());
      for (int j = 0; j < k; ++j) {
        ids[n * k + j] = topk_list[static_cast<size_t>(j)].id;
        lp[n * k + j] = finalize_row(global_max, sum, topk_list[static_cast<size_t>(j)].y, false).logp;
      }
    }
  }
}

}  // namespace

HostRows read_rows(const void* targets, bool targets_i64, int64_t targets_per_row, const float* temperature_rows,
                   int64_t rows, Memory memory, int device, void* stream) {
  HostRows out;
  const int64_t count = rows * targets_per_row;
  out.targets.resize(static_cast<size_t>(count));
  out.temperatures.resize(temperature_rows ? static_cast<size_t>(rows) : 0);
  if (rows == 0) return out;
  if (memory == Memory::host) {
    for (int64_t i = 0; i < count; ++i)
      out.targets[i] = targets_i64 ? static_cast<const int64_t*>(targets)[i] : static_cast<const int32_t*>(targets)[i];
    if (temperature_rows) std::copy(temperature_rows, temperature_rows + rows, out.temperatures.begin());
    return out;
  }
  std::vector<int32_t> t32(targets_i64 ? 0 : static_cast<size_t>(count));
  void* dst = targets_i64 ? static_cast<void*>(out.targets.data()) : static_cast<void*>(t32.data());
  detail::device_copy_async(dst, targets, static_cast<size_t>(count) * (targets_i64 ? 8 : 4), device, stream);
  if (temperature_rows)
    detail::device_copy_async(out.temperatures.data(), temperature_rows, out.temperatures.size() * sizeof(float),
                              device, stream);
  detail::device_stream_sync(device, stream);
  if (!targets_i64) std::copy(t32.begin(), t32.end(), out.targets.begin());
  return out;
}

uint64_t targets_digest(const std::vector<int64_t>& targets, int64_t targets_per_row) {
  Fnv64 h;
  if (targets_per_row > 1) {  // [N, K]: K too, so that no reshaping of the same values digests alike
    h.add(std::string("ids-per-row"));
    h.add(static_cast<uint64_t>(targets_per_row));
  }
  h.add(static_cast<uint64_t>(targets.size()));
  for (int64_t t : targets) h.add(static_cast<uint64_t>(t));
  return h.h;
}

uint64_t temperature_digest(float temperature, const std::vector<float>& rows) {
  Fnv64 h;
  h.add(rows.empty() ? 0u : 1u);
  if (rows.empty()) h.add(fp::bits(temperature));
  for (float t : rows) h.add(fp::bits(t));
  return h.h;
}

uint64_t backend_digest(const Provenance& pv) {
  Fnv64 h;
  for (const std::string* f : {&pv.backend_id, &pv.contract_name, &pv.arch, &pv.n_split_policy, &pv.tree_id,
                               &pv.transcendental_id, &pv.temperature_id, &pv.entropy_id})
    h.add(*f);
  for (int v : {pv.contract_version, pv.cc, pv.vocab_tile, pv.k_slab}) h.add(static_cast<uint64_t>(v));
  return h.h;
}

void check_ranks_agree(const std::vector<int64_t>& values, const char* name) {
  for (size_t r = 1; r < values.size(); ++r)
    DETLOGP_CHECK(values[r] == values[0], "ranks disagree on " << name << ": rank 0 has " << values[0] << ", rank " << r
                                                               << " has " << values[r]);
}

void check_layouts(const std::vector<PartialsLayout>& ls) {
  const int ranks = static_cast<int>(ls.size());
  std::vector<int64_t> real_vocab, ignore_index;
  for (const PartialsLayout& l : ls) {
    real_vocab.push_back(l.real_vocab);
    ignore_index.push_back(l.ignore_index);
  }
  check_ranks_agree(real_vocab, "real_vocab");
  check_ranks_agree(ignore_index, "ignore_index");
  for (int r = 1; r < ranks; ++r) {
    DETLOGP_CHECK(ls[r].targets_digest == ls[0].targets_digest,
                  "ranks disagree on targets (rank 0 and rank "
                      << r << " digest them differently): every rank must pass the same targets");
    DETLOGP_CHECK(ls[r].temperature_digest == ls[0].temperature_digest,
                  "ranks disagree on temperatures (rank 0 and rank "
                      << r
                      << " digest them differently): every rank must pass the same temperature or temperature_rows");
    DETLOGP_CHECK(ls[r].backend_digest == ls[0].backend_digest,
                  "ranks are served by different backends or contracts (rank 0 and rank "
                      << r << "): the partials of one call must come from one backend, contract and arch");
  }
  // Shards in rank order, contiguous from 0 and covering [0, real_vocab): every valid target then
  // has exactly one owner, rank order is ascending global tile order, and every tile that straddles
  // a boundary gets all its real lanes from the ranks that hold them. Boundaries at any id.
  for (int r = 1; r < ranks; ++r)
    DETLOGP_CHECK(ls[r].vocab_start >= ls[r - 1].vocab_start,
                  "rank " << r << " shard starts at vocab_start=" << ls[r].vocab_start << ", before rank " << (r - 1)
                          << "'s vocab_start=" << ls[r - 1].vocab_start
                          << ": shards must be in ascending vocab_start order by rank");
  int64_t covered = 0;
  for (int r = 0; r < ranks; ++r) {
    const int64_t start = ls[r].vocab_start;
    if (r == 0) {
      DETLOGP_CHECK(start == 0, "rank 0 shard starts at vocab_start=" << start << ": vocab ids [0, " << start
                                                                      << ") are owned by no rank; shards must be "
                                                                         "contiguous in rank order from vocab id 0");
    } else {
      DETLOGP_CHECK(start == covered, "rank " << r << " shard starts at vocab_start=" << start << " but rank "
                                              << (r - 1) << " ends at " << covered << ": vocab ids ["
                                              << std::min(start, covered) << ", " << std::max(start, covered)
                                              << ") are "
                                              << (start > covered ? "owned by no rank" : "owned by two ranks")
                                              << "; shards must be contiguous in rank order");
    }
    covered = start + ls[r].vocab_local;
  }
  DETLOGP_CHECK(covered >= ls[0].real_vocab, "the shards cover vocab ids [0, "
                                                 << covered << ") but real_vocab=" << ls[0].real_vocab << ": ids ["
                                                 << covered << ", " << ls[0].real_vocab << ") are owned by no rank");
}

void merge_owned(const std::vector<ShardPartials>& ranks, const TensorView& targets, int64_t ignore_index,
                 const MutableTensorView& logp, const MutableTensorView& lse, void* stream,
                 const MutableTensorView& entropy, const MutableTensorView& topk_ids,
                 const MutableTensorView& topk_logp) {
  check_operands(ranks, targets, logp, lse, entropy, topk_ids, topk_logp);
  merge_rows(ranks, targets, ignore_index, logp, lse, entropy, topk_ids, topk_logp, stream);
}

void merge_partials_checked(const std::vector<ShardPartials>& ranks, const TensorView& targets, int64_t ignore_index,
                            const MutableTensorView& logp, const MutableTensorView& lse,
                            const MutableTensorView& entropy, void* stream, const MutableTensorView& topk_ids,
                            const MutableTensorView& topk_logp) {
  check_operands(ranks, targets, logp, lse, entropy, topk_ids, topk_logp);
  std::vector<PartialsLayout> layouts;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const PartialsLayout& l = ranks[r].layout;
    DETLOGP_CHECK(l.vocab_local > 0, "rank " << r << " partials carry no layout (layout.vocab_local=" << l.vocab_local
                                             << "): compute them with linear_logp_partials, which records the shard, "
                                                "real_vocab, ignore_index and the digests merge_partials checks");
    DETLOGP_CHECK(l.vocab_start >= 0 && l.real_vocab >= 1,
                  "rank " << r << " partials carry a layout with vocab_start=" << l.vocab_start << " and real_vocab="
                          << l.real_vocab << ": linear_logp_partials records vocab_start >= 0 and real_vocab >= 1");
    const ShardGeometry g = shard_geometry(l.vocab_start, l.vocab_local, l.real_vocab);
    DETLOGP_CHECK(ranks[r].tiles == g.tiles, "rank " << r << " partials have tiles=" << ranks[r].tiles
                                                     << " but their layout's shard [" << l.vocab_start << ", "
                                                     << l.vocab_start + l.vocab_local << ") has " << g.tiles
                                                     << " whole tiles (shard_geometry)");
    DETLOGP_CHECK(ranks[r].edge_lanes == g.edge_lanes(),
                  "rank " << r << " partials have edge_lanes=" << ranks[r].edge_lanes << " but their layout's shard ["
                          << l.vocab_start << ", " << l.vocab_start + l.vocab_local << ") has " << g.edge_lanes()
                          << " edge lanes (shard_geometry)");
    layouts.push_back(l);
  }
  check_layouts(layouts);
  const PartialsLayout& computed = layouts.front();
  DETLOGP_CHECK(ignore_index == computed.ignore_index,
                "ignore_index=" << ignore_index << " differs from ignore_index=" << computed.ignore_index
                                << " the partials were computed with: pass merge_partials the ignore_index given to "
                                   "linear_logp_partials");
  const int64_t rows = ranks.front().rows;
  const int64_t per_row = ranks.front().targets_per_row;
  const uint64_t digest = targets_digest(read_rows(targets.data, targets.dtype == DType::i64, per_row, nullptr, rows,
                                                   ranks.front().memory, ranks.front().device, stream)
                                             .targets,
                                         per_row);
  DETLOGP_CHECK(digest == computed.targets_digest,
                "targets differ from those the partials were computed with (targets digest "
                    << hex(digest) << ", the partials' " << hex(computed.targets_digest)
                    << "): pass merge_partials the targets given to linear_logp_partials");
  merge_rows(ranks, targets, ignore_index, logp, lse, entropy, topk_ids, topk_logp, stream);
}

}  // namespace detlogp::tp

// The owned merge over rank-ordered partials, and the layout checks that make its answer the one
// asked for. No floating-point reduction happens in transit: partials are placed side by side in
// rank order, which is ascending global tile order, and the same chain runs as for one shard.
// The protocol (tp_operator.cpp) checks the same layouts through its header exchange and then
// merges without checking them again; merge_partials checks them on every call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "detlogp/error.hpp"

namespace detlogp::tp {

// FNV-1a over 64-bit words: identical inputs on every rank must give identical digests (a
// consistency check between ranks and calls, not a security property).
struct Fnv64 {
  uint64_t h = 0xcbf29ce484222325ull;
  void add(uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xFF;
      h *= 0x100000001b3ull;
    }
  }
  void add(const std::string& s) {
    for (unsigned char c : s) add(static_cast<uint64_t>(c));
  }
};

// The targets ([rows][targets_per_row]) and per-row temperatures of a call, on the host: targets
// widened to int64, temperatures empty when `temperature_rows` is null. CUDA memory is copied on
// `stream` and waited for (the copies queue behind the work already on the stream).
struct HostRows {
  std::vector<int64_t> targets;
  std::vector<float> temperatures;
};
HostRows read_rows(const void* targets, bool targets_i64, int64_t targets_per_row, const float* temperature_rows,
                   int64_t rows, Memory memory, int device, void* stream);

// The digests of a PartialsLayout. targets_digest covers the targets' values and, for K > 1 ids a
// row, K (one id a row digests as before [N, K] targets existed). temperature_digest covers the
// temperatures in effect: the scalar when `rows` is empty, else the row temperatures alone.
uint64_t targets_digest(const std::vector<int64_t>& targets, int64_t targets_per_row = 1);
uint64_t temperature_digest(float temperature, const std::vector<float>& rows);
uint64_t backend_digest(const Provenance& served);

// What the ranks' layouts must satisfy for their merge to be the TP = 1 answer, in rank order:
// the same real_vocab, ignore_index, targets, temperatures and backend, and shards in ascending
// vocab_start order (boundaries at any id), contiguous from vocab id 0 and covering [0,
// real_vocab). Throws naming the rank and the value (a gap or an overlap with the ids it leaves
// unowned or owns twice).
void check_layouts(const std::vector<PartialsLayout>& ranks_in_order);

// Every rank's value equals rank 0's; else throws "ranks disagree on <name>" with both values.
void check_ranks_agree(const std::vector<int64_t>& values, const char* name);

// The gathered headers of a protocol (each with its sender's `rank` and `size`): slot r must hold
// rank r of hs.size(), else the communicator's all-gather is not in rank order.
template <class Header>
void check_headers_in_rank_order(const std::vector<Header>& hs) {
  const int ranks = static_cast<int>(hs.size());
  for (int r = 0; r < ranks; ++r)
    DETLOGP_CHECK(hs[r].rank == r && hs[r].size == ranks, "communicator slot "
                                                              << r << " holds rank " << hs[r].rank << " of "
                                                              << hs[r].size << ": the all-gather is not in rank order");
}

// One field of every rank's header, for check_ranks_agree.
template <class Header, class Get>
std::vector<int64_t> header_field(const std::vector<Header>& hs, Get get) {
  std::vector<int64_t> values;
  values.reserve(hs.size());
  for (const Header& h : hs) values.push_back(static_cast<int64_t>(get(h)));
  return values;
}

// The merge of checked layouts (the protocol's): host memory on the CPU, CUDA memory with the
// device merge on `stream`. Each rank's `layout` gives its shard, whose geometry places its whole
// tiles and edge lanes (the straddling tiles are summarized here, core/straddle.hpp). Checks the
// buffers and tensors, and on the host that every non-ignored target has exactly one owner. `entropy`, when present
// ([N] f32 in the partials' memory), gets each row's entropy from the ranks' usums (every rank must carry them): the
// entropy chain of docs/contract.md §10 runs beside the S chain over the same rank-ordered tiles.
// topk_ids and topk_logp, when present ([N, K] i64 and f32, K the partials' topk, host memory): the
// K first of the ranks' top-k lists (detlogp/topk.hpp's order), each finalized with the merged lse.
void merge_owned(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets, int64_t ignore_index,
                 const MutableTensorView& logp, const MutableTensorView& lse, void* stream,
                 const MutableTensorView& entropy = {}, const MutableTensorView& topk_ids = {},
                 const MutableTensorView& topk_logp = {});

// merge_partials (include/detlogp/detlogp.hpp): check_layouts, then that `targets` and
// `ignore_index` are those the partials were computed with, then merge_owned.
void merge_partials_checked(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets,
                            int64_t ignore_index, const MutableTensorView& logp, const MutableTensorView& lse,
                            const MutableTensorView& entropy, void* stream, const MutableTensorView& topk_ids = {},
                            const MutableTensorView& topk_logp = {});

}  // namespace detlogp::tp

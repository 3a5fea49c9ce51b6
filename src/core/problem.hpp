// The framework-free params struct handed from the API layer to a backend, already validated
// (shapes, dtypes, alignment, host-resident values). Device-resident values (targets,
// per-row temperatures) are validated by the backend without device asserts.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/reduce.hpp"
#include "detlogp/shards.hpp"
#include "detlogp/tensor.hpp"

namespace detlogp::detail {

// The operands every problem built from LinearLogpInputs carries: the head's shape, the input
// pointers and where they live. The weight's row count is named by each problem (V_local, C).
struct HeadOperands {
  int64_t rows = 0;         // N
  int64_t dim = 0;          // D
  int64_t real_vocab = 0;   // V_real (global): ids >= real_vocab are padding
  int64_t vocab_start = 0;  // global id of weight row 0
  int64_t ignore_index = kDefaultIgnoreIndex;

  const uint16_t* hidden = nullptr;  // bf16 bits, [rows][hidden_stride]
  int64_t hidden_stride = 0;         // elements
  const uint16_t* weight = nullptr;  // bf16 bits, [weight rows][weight_stride]
  int64_t weight_stride = 0;
  const float* bias = nullptr;    // [weight rows] or null
  const void* targets = nullptr;  // [rows][targets_per_row]
  bool targets_i64 = false;
  int64_t targets_per_row = 1;  // K of [N, K] targets, 1 for [N]
  bool targets_2d = false;      // [N, K] targets (messages name targets[n, k]; logp is [N, K])
  float temperature = 1.0f;
  const float* temperature_rows = nullptr;  // [rows] or null

  Memory memory = Memory::host;
  int device = 0;
  void* stream = nullptr;
  bool defer_errors = false;  // CallOptions::defer_errors: no wait for the device validation

  DETLOGP_HD int64_t target(int64_t row, int64_t k = 0) const {
    const int64_t i = row * targets_per_row + k;
    return targets_i64 ? static_cast<const int64_t*>(targets)[i] : static_cast<const int32_t*>(targets)[i];
  }
};

struct LogpProblem : HeadOperands {
  int64_t vocab_local = 0;  // V_local: weight rows

  // Full mode: logp [rows][targets_per_row] and lse [rows] (and logits when non-null, row stride vocab_local).
  float* logp = nullptr;
  float* lse = nullptr;
  float* logits = nullptr;
  float* entropy = nullptr;  // [rows] or null: the row's entropy (docs/contract.md §10)
  // The top-k output (docs/contract.md §12), topk > 0: full mode topk_ids and topk_logp [rows][topk];
  // partial mode the shard's lists, topk_ids and topk_logit [rows][topk].
  int64_t topk = 0;
  int64_t* topk_ids = nullptr;
  float* topk_logp = nullptr;
  float* topk_logit = nullptr;
  // Partial mode: tile summaries and target partials instead of logp/lse (also for a shard without
  // whole tiles, whose summaries may be null).
  bool partial = false;
  TileSummary* summaries = nullptr;  // [rows][geometry().tiles] (may be null where that is 0)
  float* target_logit = nullptr;     // [rows][targets_per_row]
  uint8_t* target_owned = nullptr;   // [rows][targets_per_row]
  float* usums = nullptr;            // partial mode: [rows][local_tiles()] entropy sums u_g, or null (§10)
  // Partial mode, a shard that is not 64-aligned: the scaled logits of its edge lanes
  // [rows][geometry().edge_lanes()] (detlogp/shards.hpp); summaries cover geometry().tiles tiles.
  float* edge_logits = nullptr;

  ShardGeometry geometry() const { return shard_geometry(vocab_start, vocab_local, real_vocab); }
  // Local 64-column tiles from column 0: for a 64-aligned shard (every full-mode problem) the global
  // tiles, summarized in place (partial mode too: geometry().tiles equals it then).
  int64_t local_tiles() const { return (vocab_local + kVocabTile - 1) / kVocabTile; }
  // A 64-aligned shard's real lanes of local tile j: a prefix of the tile, 0..64.
  int real_lanes(int64_t tile) const {
    const int64_t first = vocab_start + tile * kVocabTile;
    int64_t end = vocab_start + vocab_local;
    if (real_vocab < end) end = real_vocab;
    const int64_t n = end - first;
    return n <= 0 ? 0 : (n >= kVocabTile ? kVocabTile : static_cast<int>(n));
  }
  // make_problem sets `partial`; a problem built by hand is in partial mode by its summaries.
  bool partial_mode() const { return partial || summaries != nullptr; }
};

}  // namespace detlogp::detail

// detlogp public C++ API: per-token log-probabilities straight from hidden states and the
// lm_head weight, bearing the numeric contract of docs/contract.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "detlogp/config.hpp"
#include "detlogp/error.hpp"
#include "detlogp/provenance.hpp"
#include "detlogp/reduce.hpp"
#include "detlogp/shards.hpp"
#include "detlogp/tensor.hpp"
#include "detlogp/topk.hpp"

namespace detlogp {

// Inputs of one call. All tensors live in the same memory (host, or one CUDA device).
struct LinearLogpInputs {
  TensorView hidden;            // [N, D] bf16, rows may be strided
  TensorView weight;            // [V_local, D] bf16: this rank's lm_head shard
  TensorView bias;              // optional [V_local] f32
  TensorView targets;           // [N] i32 or i64, global vocab ids; or [N, K] (K <= kMaxTargetsPerRow): K ids per row
  float temperature = 1.0f;     // used when temperature_rows is absent
  TensorView temperature_rows;  // optional [N] f32, one T per row
  int64_t real_vocab = -1;      // V_real; ids >= V_real are padding. -1: vocab_start + V_local
  int64_t vocab_start = 0;      // global id of weight row 0 (any id: shards need not be 64-aligned)
  int64_t ignore_index = kDefaultIgnoreIndex;
};

// Outputs: logp [N] f32 ([N, K] for [N, K] targets: entry k the logp of targets[n, k], each
// entry the bits of a call with that single target), lse [N] f32, and on the serving entry logits [N, V_local] f32
// (unscaled z = h.W + b). logits absent = trainer entry, which never allocates [N, V].
// entropy, when present: [N] f32, H = -sum p log p of the row's softmax(y) over the real
// vocabulary, computed in the same pass (docs/contract.md §10; served by backends whose
// provenance names an entropy_id, others refuse it).
// topk_ids and topk_logp, when present: [N, K] i64 and f32 (1 <= K <= kMaxTopk, K <= real_vocab,
// contiguous): the row's K real ids with the largest scaled logits y, in detlogp/topk.hpp's order
// (larger y first, equal y the lower id first), and their logp, each the bits of a call with that
// single target (docs/contract.md §11); from the same pass, no [N, V].
struct LinearLogpOutputs {
  MutableTensorView logp;
  MutableTensorView lse;
  MutableTensorView logits;
  MutableTensorView entropy;
  MutableTensorView topk_ids;
  MutableTensorView topk_logp;
};

// The most target ids per row of [N, K] targets (one pass over the vocabulary for all of them).
inline constexpr int64_t kMaxTargetsPerRow = 64;

struct CallOptions {
  std::string backend;  // "" -> env DETLOGP_BACKEND, else "auto"
  bool strict = false;  // also switched on by env DETLOGP_STRICT=1
  void* cuda_stream = nullptr;
  // CUDA memory only. false: the call waits for its device validation (targets, row temperatures)
  // and throws its error itself. true: the call returns once its kernels are enqueued, so the host
  // can run ahead of the GPU; a bad input still writes nothing, and its error is thrown by this
  // host thread's next CUDA call (of linear_logp or linear_logp_grad_logits) whose check finds
  // that validation done, at the latest when 16 calls are outstanding, or by
  // check_deferred_errors().
  bool defer_errors = false;
};

// Waits for the device validation of this host thread's calls made with defer_errors and throws
// the first error among them (naming the call's entry, the argument, row and value). A no-op when
// none is outstanding, and in builds without CUDA.
void check_deferred_errors();

// The fused operator: logp[n] = min(y_t - lse, 0), lse[n] = M + logc(S) over the whole real
// vocabulary. The shard must cover it (vocab_start == 0, V_local >= real_vocab); for a vocab
// shard use linear_logp_partials and merge_partials.
CallReport linear_logp(const LinearLogpInputs& in, const LinearLogpOutputs& out, const CallOptions& opt = {});

// The logit gradient of one vocabulary chunk, for the backward of linear_logp (the fused backward
// of detlogp.torch): in.weight is the chunk [C, D] (rows vocab_start .. vocab_start + C - 1 of the
// head; vocab_start need not be a multiple of 64 here), real_vocab the global real vocabulary,
// targets global ids. For every row n and chunk column v the logit z = h_n.w_v (+ b_v) is
// recomputed and dz[n][v] = bf16(dL/dz) written, with the fp32 order pinned in detlogp/grad.hpp
// (docs/contract.md, appendix A): padding ids >= real_vocab get +0; otherwise p = expc(y - lse[n]),
// dL/dy = (g_lse - g_logp) * p + g_logp at the target column, dL/dz = dL/dy / T. Ignored rows get
// no g_logp term. Host memory runs on the CPU, CUDA memory on the SM90 kernel (opt.cuda_stream);
// CallOptions.backend is not consulted (the two implementations share the pinned formula; the
// bits are those of the arch's own z, like the serving logits). Bad inputs throw and write nothing.
// With g_entropy, dL/dy gains the entropy term -g_H * p * (y - lse + H) (docs/contract.md,
// appendix A), from the forward's entropy H: one pass for a loss that mixes logp and entropy.
struct GradLogitsArgs {
  TensorView lse;        // [N] f32: the forward's lse
  TensorView g_logp;     // optional [N] f32: dL/dlogp (absent = zeros)
  TensorView g_lse;      // optional [N] f32: dL/dlse (absent = zeros)
  TensorView entropy;    // [N] f32, the forward's entropy: required with g_entropy, else not read
  TensorView g_entropy;  // optional [N] f32: dL/dH (absent: no entropy term, the logp-only bits)
};
// dz: [N, C] bf16, row stride >= C.
CallReport linear_logp_grad_logits(const LinearLogpInputs& in, const GradLogitsArgs& args, const MutableTensorView& dz,
                                   const CallOptions& opt = {});

// The same logit gradient from given logits instead of a recompute: in.logits [N, C] f32 (row
// stride >= C) are the chunk's z, bias included (the serving entry's logits of columns vocab_start
// .. vocab_start + C - 1), and dz[n][v] gets the bits linear_logp_grad_logits gives for that z
// (detlogp/grad.hpp). For a caller that keeps a chunk's logits from the forward (a loss computed
// inside the op, without the recompute's GEMM). dz may overwrite the logits in place: dz.data ==
// logits.data with dz.row_stride == 2 * logits.row_stride (row n's gradient fills the first half
// of its logits' bytes); any other overlap is refused. Host memory runs on the CPU, CUDA memory on
// the SM90 backend's kernel (opt.cuda_stream). Bad inputs throw and write nothing.
struct GradFromLogitsInputs {
  TensorView logits;   // [N, C] f32
  TensorView targets;  // [N] or [N, K] i32/i64 global ids (or ignore_index)
  float temperature = 1.0f;
  TensorView temperature_rows;  // optional [N] f32
  int64_t vocab_start = 0;      // global id of logits column 0
  int64_t real_vocab = -1;      // -1: vocab_start + C
  int64_t ignore_index = kDefaultIgnoreIndex;
};
CallReport linear_logp_grad_from_logits(const GradFromLogitsInputs& in, const GradLogitsArgs& args,
                                        const MutableTensorView& dz, const CallOptions& opt = {});

// What one shard's partials were computed for. linear_logp_partials records it; merge_partials
// checks the ranks' layouts against each other and against its own targets and ignore_index
// before writing anything (docs/tensor-parallel.md). Trivially copyable: gather it with the
// partials' bytes, or store its fields next to them in a file.
struct PartialsLayout {
  int64_t vocab_start = 0;  // global id of the shard's first weight row
  int64_t vocab_local = 0;  // V_local, >= 1; 0: no layout recorded, which merge_partials refuses
  int64_t real_vocab = 0;   // the global real vocabulary
  int64_t ignore_index = kDefaultIgnoreIndex;
  uint64_t targets_digest = 0;      // the N targets as int64 values
  uint64_t temperature_digest = 0;  // the temperatures in effect: the scalar, or the N row temperatures
  uint64_t backend_digest = 0;      // the serving backend: id, contract, arch and its frozen ids
};

// Rank-local partials for tensor parallelism: summaries of the global tiles this shard finishes
// (its whole tiles, detlogp/shards.hpp), the scaled logits of its lanes in the tiles that straddle a
// shard boundary (edge lanes; none for a 64-aligned shard) and, for rows whose target this shard
// owns, the scaled target logit y_t.
struct ShardPartials {
  int64_t rows = 0;
  int64_t tiles = 0;                 // shard_geometry(...).tiles: ceil(V_local / 64) for an aligned shard
  TileSummary* summaries = nullptr;  // [rows][tiles]: global tiles first_tile .. first_tile + tiles - 1
  int64_t targets_per_row = 1;       // K of [N, K] targets (1 for [N] targets)
  float* target_logit = nullptr;     // [rows][targets_per_row]; +0 where not owned or ignored
  uint8_t* target_owned = nullptr;   // [rows][targets_per_row]; 1 where this shard owns the target
  float* usums = nullptr;            // optional [rows][tiles]: the tiles' entropy sums u_g (§10), for a
                                     // merge that writes entropy; filled when non-null
  int64_t edge_lanes = 0;            // shard_geometry(...).edge_lanes(): 0 for an aligned shard
  float* edge_logits = nullptr;      // [rows][edge_lanes]: y of the head lanes, then of the tail lanes
  int64_t topk = 0;                  // K of the top-k output (0: none)
  float* topk_logit = nullptr;       // [rows][topk]: the shard's K largest y of its real ids, in top-k order
  int64_t* topk_ids = nullptr;       // [rows][topk]: their global ids; -1 past the shard's real ids
  Memory memory = Memory::host;
  int device = 0;            // CUDA device of the buffers (memory == cuda)
  MutableTensorView logits;  // optional [rows, V_local] f32: the serving entry's logits shard
  PartialsLayout layout;     // written by linear_logp_partials, with the buffers
};
// Whole tiles of a 64-aligned shard of V_local rows: ceil(V_local / 64). Any shard:
// shard_geometry(vocab_start, V_local, real_vocab) (detlogp/shards.hpp).
int64_t shard_tiles(int64_t vocab_local);
// Fills out's buffers and out.layout (nothing on error): out.tiles and out.edge_lanes must be
// shard_geometry's, out.edge_logits non-null where edge_lanes > 0; out.usums, when non-null, with the tiles'
// entropy sums (served by backends that compute the entropy output, refused by the others). For CUDA memory the targets
// (and temperature_rows) are read back to the host for the layout's digests: one copy of N * 8 (+ N * 4) bytes and a
// wait for the work already on opt.cuda_stream, before the partials are enqueued.
CallReport linear_logp_partials(const LinearLogpInputs& in, ShardPartials& out, const CallOptions& opt = {});

// The owned merge: every rank runs it over the all-gathered partials placed in rank order
// (= ascending global tile order). No floating-point reduction happens in transit; a tile that
// straddles a shard boundary is summarized once, here, from its holders' edge lanes, in rank order
// (docs/contract.md §7). Before writing anything it checks the layouts: ranks in ascending
// vocab_start order (any boundaries, 64-aligned or not), contiguous from 0 and
// covering real_vocab, all agreeing on real_vocab, rows, ignore_index, temperatures and backend,
// and `targets` / `ignore_index` equal to those the partials were computed with. Host memory runs
// on the CPU; CUDA memory (partials, targets, logp and lse on one device) reads the targets back
// for their digest (a wait on opt.cuda_stream), then runs the SM90 combine kernel on that stream.
void merge_partials(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets, int64_t ignore_index,
                    const MutableTensorView& logp, const MutableTensorView& lse, const CallOptions& opt = {});
// The same merge with the entropy output (docs/contract.md §10): entropy [N] f32 in the partials'
// memory, from every rank's usums (each rank's partials must carry them, else it throws naming the
// rank, before writing anything); the bits are linear_logp's entropy at TP = 1. An absent entropy
// view is the merge above.
void merge_partials(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets, int64_t ignore_index,
                    const MutableTensorView& logp, const MutableTensorView& lse, const MutableTensorView& entropy,
                    const CallOptions& opt = {});

// The sampling program (docs/contract.md §11): temperature, then top-k, then top-p, then min-p,
// Gumbel-max noise from (seed, key, global id). Each parameter is one value for every row, or one
// per row when its *_rows view is present ([N], host memory). Off: top_k = 0, top_p = 1, min_p = 0.
struct SamplingProgram {
  float temperature = 1.0f;     // 0: greedy; else inside the range of §3.3
  TensorView temperature_rows;  // optional [N] f32
  int64_t top_k = 0;            // >= 0; >= real_vocab keeps every lane
  TensorView top_k_rows;        // optional [N] i32 or i64
  float top_p = 1.0f;           // in (0, 1]
  TensorView top_p_rows;        // optional [N] f32
  float min_p = 0.0f;           // in [0, 1)
  TensorView min_p_rows;        // optional [N] f32
};

// The rollout side: the head's operands as for linear_logp (no targets, no temperature: the
// program's), the program, and each row's random key.
struct SampleInputs {
  TensorView hidden;        // [N, D] bf16
  TensorView weight;        // [V_local, D] bf16: the whole head (vocab_start = 0, V_local >= real_vocab)
  TensorView bias;          // optional [V_local] f32
  int64_t real_vocab = -1;  // -1: V_local; at most 2^24 (§11.1)
  int64_t vocab_start = 0;
  SamplingProgram program;
  uint64_t seed = 0;     // used when seed_rows is absent
  TensorView seed_rows;  // optional [N] i64: each row's seed, read as its uint64 bits
  TensorView key;        // [N] i64: each row's key (a token position, a request id, ...)
};

// [N] each, host memory: token i64 (kNoToken = -1 for a row without a processed distribution),
// logp f32 (the token's processed log-probability, §11.7), logp_raw f32 (the bits linear_logp gives
// for that token at the row's T; T = 0: at 1), lse f32 (linear_logp's), support_size i64; logits,
// when present, [N, V_local] f32 (the serving logits z). Never an [N, V] buffer otherwise.
// topk_ids and topk_logp, when present: [N, K] i64 and f32 (1 <= K <= kMaxTopk, K <= real_vocab,
// contiguous), an engine's logprobs=K beside the sampled token: the row's K real ids with the
// largest y at the row's T (1 for T = 0, as logp_raw) in detlogp/topk.hpp's order, and their raw
// logp: the ids and bits linear_logp's top-k output gives at that temperature (docs/contract.md
// §12), from the same pass.
struct SampleOutputs {
  MutableTensorView token;
  MutableTensorView logp;
  MutableTensorView logp_raw;
  MutableTensorView lse;
  MutableTensorView support_size;
  MutableTensorView logits;
  MutableTensorView topk_ids;
  MutableTensorView topk_logp;
};

// Draws one token per row with the program. Bad parameters throw naming the argument, the row and
// the value, before anything is written. Served by backends whose provenance names a sample_id.
CallReport sample(const SampleInputs& in, const SampleOutputs& out, const CallOptions& opt = {});

// The trainer side, replaying a program: [N] each, host memory. logp, logp_raw and lse are required;
// the rest optional. logp: the targets' processed log-probability (-inf outside the support, counted
// in CallReport::sampling); logp_raw and lse: linear_logp's bits (at T, or 1 for T = 0);
// lse_support: the support's log-normalizer lse_Sigma; support_size i64; support_max (M), cut_logit
// and cut_id (i64): what a chunked backward needs to decide the support (§11.10).
struct SampledLogpOutputs {
  MutableTensorView logp;
  MutableTensorView logp_raw;
  MutableTensorView lse;
  MutableTensorView lse_support;
  MutableTensorView support_size;
  MutableTensorView support_max;
  MutableTensorView cut_logit;
  MutableTensorView cut_id;
};

// linear_logp replaying a sampling program: the temperature is the program's, so in.temperature
// must stay 1 and in.temperature_rows absent. Seeds and keys do not enter (the processed
// distribution does not depend on the noise). Ignored rows get logp = logp_raw = +0.
CallReport linear_logp(const LinearLogpInputs& in, const SamplingProgram& program, const SampledLogpOutputs& out,
                       const CallOptions& opt = {});

// The logit gradient of one vocabulary chunk for the replay above, its support fixed (the backward
// of detlogp.torch's linear_logp with sampling=): in and the chunk as for linear_logp_grad_logits
// (in.temperature 1, no temperature_rows: the program's), the program, and the replay's outputs.
// Per column, with the global id and the recomputed contract z: dL/dy = onehot(t) (g_logp + g_logp_raw)
// - g_logp [y in support] e^{y - lse_support} + (g_lse - g_logp_raw) e^{y - lse}, dL/dz = dL/dy / T
// (docs/contract.md §11.10; detlogp/grad.hpp sampled_grad_logit). The support is decided per column
// by in_support against the row's (support_max, cut_logit, cut_id, min_p). Rows whose forward logp is
// -inf (a target outside the support) take no g_logp term. Host memory.
struct SampledGradArgs {
  TensorView logp;         // [N] f32: the replay's logp
  TensorView lse;          // [N] f32: the replay's lse
  TensorView lse_support;  // [N] f32
  TensorView support_max;  // [N] f32
  TensorView cut_logit;    // [N] f32
  TensorView cut_id;       // [N] i64
  TensorView g_logp;       // optional [N] f32 (absent: zeros)
  TensorView g_lse;        // optional [N] f32
  TensorView g_logp_raw;   // optional [N] f32
};
CallReport linear_logp_grad_logits(const LinearLogpInputs& in, const SamplingProgram& program,
                                   const SampledGradArgs& args, const MutableTensorView& dz,
                                   const CallOptions& opt = {});

// The same merge into `out`'s logp, lse and, where present, entropy and top-k (topk_ids and
// topk_logp [N, K], K the partials' topk: every rank's partials carry their top-k lists; the merge
// takes the K first of their union in the order of detlogp/topk.hpp, rank by rank, and finalizes
// each with the merged lse). out.logits must be absent.
void merge_partials(const std::vector<ShardPartials>& ranks_in_order, const TensorView& targets, int64_t ignore_index,
                    const LinearLogpOutputs& out, const CallOptions& opt = {});

// The contract reducer applied to logits from anywhere (another backend, a file): z [N, V_local]
// f32 unscaled; temperature, padding and ignore_index as in linear_logp. Host memory.
struct ReduceLogitsInputs {
  TensorView logits;
  TensorView targets;
  float temperature = 1.0f;
  TensorView temperature_rows;
  int64_t real_vocab = -1;
  int64_t ignore_index = kDefaultIgnoreIndex;
};
// entropy, when present: [N] f32 (docs/contract.md §10), the bits linear_logp gives for the same logits.
void reduce_logits(const ReduceLogitsInputs& in, const MutableTensorView& logp, const MutableTensorView& lse,
                   const MutableTensorView& entropy = {});

// The value checks every entry runs on its rows, alone, for a caller that computes without the
// library (detlogp.torch's plain lane): the scalar temperature, targets [N] (or [N, K], K <=
// kMaxTargetsPerRow) i32/i64 each in [0, real_vocab) or ignore_index, and optional
// temperature_rows [N] f32, in the entries' words.
// Host memory.
void check_row_values(const TensorView& targets, int64_t real_vocab, int64_t ignore_index, float temperature,
                      const TensorView& temperature_rows = {});

// In-process simulation of R tensor-parallel ranks (host): the weight is split into R shards of
// ceil(V / R) rows rounded up to 64, each rank's partials computed, gathered in rank order, merged.
// out.entropy, when present, gets the TP = 1 entropy bits (the partials then carry usums).
CallReport simulate_tensor_parallel(const LinearLogpInputs& in, int ranks, const LinearLogpOutputs& out,
                                    const CallOptions& opt = {});
// The same over the shards [bounds[r], bounds[r + 1]) of the weight's rows: bounds ascending from 0
// to V_local, at any ids (an engine's split, e.g. V / R, need not be 64-aligned); R = bounds.size() - 1.
CallReport simulate_tensor_parallel(const LinearLogpInputs& in, const std::vector<int64_t>& bounds,
                                    const LinearLogpOutputs& out, const CallOptions& opt = {});

// Registry view.
struct BackendInfo {
  std::string id;
  bool contract_bearing = false;
  bool available = false;
  std::string detail;  // why unavailable, or the device it would use
  Memory memory = Memory::host;
  Provenance provenance;
  bool multi_targets = false;  // takes [N, K] targets with K > 1
  bool topk = false;           // computes the top-k output (docs/contract.md §12)
};
std::vector<BackendInfo> list_backends();

// Free-axis knobs read from the environment; throws if a DETLOGP_* variable tries to set a
// frozen constant or is unknown.
void check_environment();

std::string version_string();

}  // namespace detlogp

#include "core/validate.hpp"

#include <charconv>
#include <sstream>

#include "core/reduce_logits.hpp"

namespace detlogp::detail {

void check_memory(const TensorView& t, const char* name, Memory expected, int device) {
  DETLOGP_CHECK(t.memory == expected, name << " is in " << (t.memory == Memory::host ? "host" : "CUDA")
                                           << " memory but hidden is in "
                                           << (expected == Memory::host ? "host" : "CUDA")
                                           << " memory; all tensors of a call must live together");
  DETLOGP_CHECK(expected == Memory::host || t.device == device,
                name << " is on CUDA device " << t.device << " but hidden is on device " << device);
}

void check_matrix(const TensorView& t, const char* name, DType dtype) {
  DETLOGP_CHECK(t.ndim == 2, name << " must be 2-D, got ndim=" << t.ndim);
  DETLOGP_CHECK(t.dtype == dtype, name << " must be " << dtype_name(dtype) << ", got " << dtype_name(t.dtype));
  DETLOGP_CHECK(t.rows >= 0 && t.cols >= 0, name << " has a negative extent [" << t.rows << ", " << t.cols << "]");
  DETLOGP_CHECK(t.row_stride >= t.cols, name << " row_stride=" << t.row_stride << " is smaller than its " << t.cols
                                             << " columns (overlapping rows are not supported)");
}

void check_vector(const TensorView& t, const char* name, int64_t n, std::initializer_list<DType> dtypes) {
  DETLOGP_CHECK(t.ndim == 1, name << " must be 1-D, got ndim=" << t.ndim);
  bool ok = false;
  for (DType d : dtypes) ok = ok || t.dtype == d;
  if (!ok) {
    std::ostringstream allowed;
    for (DType d : dtypes) allowed << (allowed.tellp() > 0 ? " or " : "") << dtype_name(d);
    DETLOGP_FAIL(name << " must be " << allowed.str() << ", got " << dtype_name(t.dtype));
  }
  DETLOGP_CHECK(t.rows == n, name << " has " << t.rows << " elements, expected " << n);
  DETLOGP_CHECK(n == 0 || t.data != nullptr, name << " data pointer is null");
}

float* checked_logits(const MutableTensorView& logits, int64_t rows, int64_t vocab_local, Memory mem, int dev) {
  check_matrix(logits, "logits", DType::f32);
  DETLOGP_CHECK(logits.rows == rows && logits.cols == vocab_local,
                "logits must be [N=" << rows << ", V_local=" << vocab_local << "], got [" << logits.rows << ", "
                                     << logits.cols << "]");
  DETLOGP_CHECK(logits.row_stride == vocab_local,
                "logits must be contiguous (row_stride=" << logits.row_stride << ", expected " << vocab_local << ")");
  check_memory(logits, "logits", mem, dev);
  DETLOGP_CHECK(rows == 0 || logits.data != nullptr, "logits data pointer is null");
  return static_cast<float*>(logits.mutable_data());
}

std::string shortest(float t) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, t);
  return std::string(buf, r.ptr);
}

int64_t check_topk_outputs(const TensorView& ids, const TensorView& logp, int64_t rows, int64_t real_vocab,
                           Memory memory, int device) {
  if (!ids.present() && !logp.present()) return 0;
  DETLOGP_CHECK(ids.present() && logp.present(), "the top-k output needs both topk_ids and topk_logp");
  DETLOGP_CHECK(ids.ndim == 2 && ids.dtype == DType::i64,
                "topk_ids must be 2-D i64 [N, K], got ndim=" << ids.ndim << " " << dtype_name(ids.dtype));
  const int64_t k = ids.cols;
  DETLOGP_CHECK(k >= 1 && k <= kMaxTopk,
                "topk=" << k << " (topk_ids has K=" << k << " columns) must be in [1, " << kMaxTopk << "] (kMaxTopk)");
  DETLOGP_CHECK(k <= real_vocab, "topk=" << k << " exceeds real_vocab=" << real_vocab << ": a row has only "
                                         << real_vocab << " real ids");
  DETLOGP_CHECK(ids.rows == rows && ids.row_stride == k,
                "topk_ids must be [N=" << rows << ", K=" << k << "] contiguous, got [" << ids.rows << ", " << ids.cols
                                       << "] with row_stride=" << ids.row_stride);
  DETLOGP_CHECK(
      logp.ndim == 2 && logp.dtype == DType::f32 && logp.rows == rows && logp.cols == k && logp.row_stride == k,
      "topk_logp must be [N=" << rows << ", K=" << k << "] f32, contiguous (like topk_ids)");
  DETLOGP_CHECK(rows == 0 || (ids.data && logp.data), "topk_ids or topk_logp data pointer is null");
  check_memory(ids, "topk_ids", memory, device);
  check_memory(logp, "topk_logp", memory, device);
  return k;
}

std::string temperature_range_message(const char* what, int64_t row, float t) {
  std::ostringstream m;
  m << what;
  if (row >= 0) m << "[" << row << "]";
  m << "=" << shortest(t) << " is outside the temperature range [" << shortest(kMinTemperature) << ", "
    << shortest(kMaxTemperature)
    << "] (2^-126 to 2^126, where T and 1/T are finite normal fp32 numbers; docs/contract.md 3.3)";
  return m.str();
}

void check_temperature_value(float t, const char* what, int64_t row) {
  if (!temperature_in_range(t)) DETLOGP_FAIL(temperature_range_message(what, row, t));
}

void check_temperatures_host(const float* temps, int64_t rows) {
  for (int64_t n = 0; n < rows; ++n) check_temperature_value(temps[n], "temperature_rows", n);
}

namespace {

// targets[n] of [N] targets, targets[n, k] of [N, K], for the flat index i.
std::string target_name(int64_t i, int64_t per_row, bool two_d) {
  std::ostringstream os;
  os << "targets[";
  if (two_d)
    os << i / per_row << ", " << i % per_row;
  else
    os << i;
  os << "]";
  return os.str();
}

}  // namespace

void check_targets_host(const void* targets, bool is_i64, int64_t rows, int64_t real_vocab, int64_t ignore_index,
                        int64_t per_row, bool two_d) {
  for (int64_t i = 0; i < rows * per_row; ++i) {
    const int64_t t = is_i64 ? static_cast<const int64_t*>(targets)[i] : static_cast<const int32_t*>(targets)[i];
    if (t == ignore_index) continue;
    DETLOGP_CHECK(t >= 0, target_name(i, per_row, two_d)
                              << "=" << t << " is negative and not ignore_index=" << ignore_index);
    DETLOGP_CHECK(t < real_vocab, target_name(i, per_row, two_d) << "=" << t << " is >= real_vocab=" << real_vocab);
  }
}

int64_t check_targets_tensor(const TensorView& t, int64_t rows) {
  DETLOGP_CHECK(t.ndim == 1 || t.ndim == 2, "targets must be 1-D [N] or 2-D [N, K], got ndim=" << t.ndim);
  if (t.ndim != 2) {
    check_vector(t, "targets", rows, {DType::i32, DType::i64});
    return 1;
  }
  DETLOGP_CHECK(t.dtype == DType::i32 || t.dtype == DType::i64,
                "targets must be i32 or i64, got " << dtype_name(t.dtype));
  DETLOGP_CHECK(t.rows == rows, "targets has " << t.rows << " rows, expected " << rows);
  DETLOGP_CHECK(
      t.cols >= 1 && t.cols <= kMaxTargetsPerRow,
      "targets has K=" << t.cols << " ids per row; K must be in [1, " << kMaxTargetsPerRow << "] (kMaxTargetsPerRow)");
  DETLOGP_CHECK(t.row_stride == t.cols,
                "targets [N, K] must be contiguous (row_stride=" << t.row_stride << ", expected K=" << t.cols << ")");
  DETLOGP_CHECK(rows == 0 || t.data != nullptr, "targets data pointer is null");
  return t.cols;
}

void check_logp_tensor(const TensorView& logp, const TensorView& targets, int64_t rows, int64_t per_row) {
  if (targets.ndim != 2) {
    check_vector(logp, "logp", rows, {DType::f32});
    return;
  }
  DETLOGP_CHECK(logp.ndim == 2 && logp.dtype == DType::f32 && logp.rows == rows && logp.cols == per_row &&
                    logp.row_stride == per_row,
                "logp must be [N=" << rows << ", K=" << per_row
                                   << "] f32, contiguous (one entry per target), got ndim=" << logp.ndim << " "
                                   << dtype_name(logp.dtype) << " [" << logp.rows << ", " << logp.cols << "]");
  DETLOGP_CHECK(rows == 0 || logp.data != nullptr, "logp data pointer is null");
}

HeadShape check_head(const LinearLogpInputs& in, const char* vocab_name, const char* vocab_role) {
  check_matrix(in.hidden, "hidden", DType::bf16);
  check_matrix(in.weight, "weight", DType::bf16);
  const HeadShape h{in.hidden.rows, in.hidden.cols, in.weight.rows, in.hidden.memory, in.hidden.device};
  DETLOGP_CHECK(h.dim > 0, "hidden has D=0 columns; the hidden size must be >= 1");
  DETLOGP_CHECK(h.vocab > 0,
                "weight has " << vocab_name << "=0 rows; the vocabulary " << vocab_role << " must be non-empty");
  DETLOGP_CHECK(in.weight.cols == h.dim, "weight has D=" << in.weight.cols << " columns but hidden has D=" << h.dim);
  DETLOGP_CHECK(h.rows == 0 || in.hidden.data != nullptr, "hidden data pointer is null");
  DETLOGP_CHECK(in.weight.data != nullptr, "weight data pointer is null");
  check_memory(in.weight, "weight", h.memory, h.device);
  return h;
}

int64_t check_operands(const LinearLogpInputs& in, const char* vocab_name, const char* vocab_role, HeadOperands& p) {
  const HeadShape head = check_head(in, vocab_name, vocab_role);
  const Memory mem = head.memory;
  const int dev = head.device;
  p.rows = head.rows;
  p.dim = head.dim;
  p.memory = mem;
  p.device = dev;

  p.targets_per_row = check_targets_tensor(in.targets, p.rows);
  p.targets_2d = in.targets.ndim == 2;
  check_memory(in.targets, "targets", mem, dev);
  if (in.bias.present()) {
    check_vector(in.bias, "bias", head.vocab, {DType::f32});
    check_memory(in.bias, "bias", mem, dev);
    p.bias = static_cast<const float*>(in.bias.data);
  }
  check_temperature_value(in.temperature, "temperature", -1);
  if (in.temperature_rows.present()) {
    check_vector(in.temperature_rows, "temperature_rows", p.rows, {DType::f32});
    check_memory(in.temperature_rows, "temperature_rows", mem, dev);
    p.temperature_rows = static_cast<const float*>(in.temperature_rows.data);
  }
  DETLOGP_CHECK(in.vocab_start >= 0, "vocab_start=" << in.vocab_start << " must be >= 0");

  p.vocab_start = in.vocab_start;
  p.ignore_index = in.ignore_index;
  p.temperature = in.temperature;
  p.hidden = static_cast<const uint16_t*>(in.hidden.data);
  p.hidden_stride = in.hidden.row_stride;
  p.weight = static_cast<const uint16_t*>(in.weight.data);
  p.weight_stride = in.weight.row_stride;
  p.targets = in.targets.data;
  p.targets_i64 = in.targets.dtype == DType::i64;
  return head.vocab;
}

int64_t checked_real_vocab(const LinearLogpInputs& in, int64_t vocab, const char* vocab_name) {
  DETLOGP_CHECK(in.real_vocab == -1 || in.real_vocab > 0,
                "real_vocab=" << in.real_vocab << " must be > 0 (or -1 for vocab_start + " << vocab_name << ")");
  return in.real_vocab < 0 ? in.vocab_start + vocab : in.real_vocab;
}

void check_host_values(const HeadOperands& p) {
  if (p.memory != Memory::host || p.rows == 0) return;
  check_targets_host(p.targets, p.targets_i64, p.rows, p.real_vocab, p.ignore_index, p.targets_per_row, p.targets_2d);
  if (p.temperature_rows) check_temperatures_host(p.temperature_rows, p.rows);
}

LogpProblem make_problem(const LinearLogpInputs& in, const LinearLogpOutputs* out, const ShardPartials* partials) {
  LogpProblem p;
  p.vocab_local = check_operands(in, "V_local", "shard", p);
  const Memory mem = p.memory;
  const int dev = p.device;
  p.real_vocab = checked_real_vocab(in, p.vocab_local, "V_local");
  const int64_t shard_end = p.vocab_start + p.vocab_local;

  if (partials != nullptr) {
    // Any boundaries: the shard's whole tiles and edge lanes (detlogp/shards.hpp).
    const ShardGeometry g = p.geometry();
    DETLOGP_CHECK(partials->memory == mem, "partials are not in the same memory as hidden");
    DETLOGP_CHECK(partials->rows == p.rows, "partials.rows=" << partials->rows << " but N=" << p.rows);
    DETLOGP_CHECK(partials->tiles == g.tiles, "partials.tiles=" << partials->tiles << " but the shard ["
                                                                << p.vocab_start << ", " << shard_end << ") has "
                                                                << g.tiles << " whole tiles (shard_geometry)");
    DETLOGP_CHECK(partials->targets_per_row == p.targets_per_row,
                  "partials.targets_per_row=" << partials->targets_per_row << " but targets has K=" << p.targets_per_row
                                              << " ids per row");
    DETLOGP_CHECK(partials->edge_lanes == g.edge_lanes(),
                  "partials.edge_lanes=" << partials->edge_lanes << " but the shard [" << p.vocab_start << ", "
                                         << shard_end << ") has " << g.edge_lanes() << " edge lanes (" << g.head_lanes
                                         << " at its start, " << g.tail_lanes << " at its end: shard_geometry)");
    DETLOGP_CHECK(
        p.rows == 0 || ((g.tiles == 0 || partials->summaries) && partials->target_logit && partials->target_owned),
        "partials has a null buffer (summaries, target_logit and target_owned are all required)");
    DETLOGP_CHECK(p.rows == 0 || g.edge_lanes() == 0 || partials->edge_logits,
                  "partials.edge_logits is null but the shard [" << p.vocab_start << ", " << shard_end << ") has "
                                                                 << g.edge_lanes()
                                                                 << " edge lanes per row (a tile straddles its "
                                                                    "boundary): give it [N, edge_lanes] f32");
    p.partial = true;
    p.summaries = partials->summaries;
    p.target_logit = partials->target_logit;
    p.target_owned = partials->target_owned;
    p.usums = partials->usums;
    p.edge_logits = g.edge_lanes() > 0 ? partials->edge_logits : nullptr;
    DETLOGP_CHECK(partials->topk >= 0 && partials->topk <= kMaxTopk,
                  "partials.topk=" << partials->topk << " must be in [0, " << kMaxTopk << "] (kMaxTopk)");
    if (partials->topk > 0) {
      DETLOGP_CHECK(partials->topk <= p.real_vocab,
                    "partials.topk=" << partials->topk << " exceeds real_vocab=" << p.real_vocab);
      DETLOGP_CHECK(p.rows == 0 || (partials->topk_logit && partials->topk_ids),
                    "partials.topk=" << partials->topk << " but topk_logit or topk_ids is null");
      p.topk = partials->topk;
      p.topk_logit = partials->topk_logit;
      p.topk_ids = partials->topk_ids;
    }
    if (partials->logits.present()) p.logits = checked_logits(partials->logits, p.rows, p.vocab_local, mem, dev);
  } else {
    DETLOGP_CHECK(p.vocab_start == 0 && shard_end >= p.real_vocab,
                  "linear_logp needs the whole real vocabulary (vocab_start=0, V_local >= real_vocab); got shard ["
                      << p.vocab_start << ", " << shard_end << ") of real_vocab=" << p.real_vocab
                      << ": use linear_logp_partials + merge_partials for a vocab shard");
    check_logp_tensor(out->logp, in.targets, p.rows, p.targets_per_row);
    check_vector(out->lse, "lse", p.rows, {DType::f32});
    check_memory(out->logp, "logp", mem, dev);
    check_memory(out->lse, "lse", mem, dev);
    p.logp = static_cast<float*>(out->logp.mutable_data());
    p.lse = static_cast<float*>(out->lse.mutable_data());
    if (out->logits.present()) p.logits = checked_logits(out->logits, p.rows, p.vocab_local, mem, dev);
    if (out->entropy.present()) {
      check_vector(out->entropy, "entropy", p.rows, {DType::f32});
      check_memory(out->entropy, "entropy", mem, dev);
      p.entropy = static_cast<float*>(out->entropy.mutable_data());
    }
    p.topk = check_topk_outputs(out->topk_ids, out->topk_logp, p.rows, p.real_vocab, mem, dev);
    if (p.topk > 0) {
      p.topk_ids = static_cast<int64_t*>(out->topk_ids.mutable_data());
      p.topk_logp = static_cast<float*>(out->topk_logp.mutable_data());
    }
  }

  check_host_values(p);
  return p;
}

ReduceLogitsProblem make_reduce_logits_problem(const ReduceLogitsInputs& in, const MutableTensorView& logp,
                                               const MutableTensorView& lse, const MutableTensorView& entropy) {
  const TensorView& z = in.logits;
  DETLOGP_CHECK(z.ndim == 2 && z.dtype == DType::f32,
                "logits must be a 2-D f32 tensor, got ndim=" << z.ndim << " dtype=" << dtype_name(z.dtype));
  DETLOGP_CHECK(z.memory == Memory::host, "reduce_logits runs on host memory; logits are in CUDA memory");
  DETLOGP_CHECK(z.cols > 0, "logits has V=0 columns");
  DETLOGP_CHECK(z.row_stride >= z.cols, "logits row_stride=" << z.row_stride << " < " << z.cols << " columns");
  ReduceLogitsProblem p;
  p.rows = z.rows;
  p.vocab = z.cols;
  p.real_vocab = in.real_vocab < 0 ? p.vocab : in.real_vocab;
  const int64_t rows = p.rows;
  DETLOGP_CHECK(p.real_vocab > 0 && p.real_vocab <= p.vocab,
                "real_vocab=" << in.real_vocab << " must be in [1, V=" << p.vocab << "] (or -1 for V)");
  for (const auto* t : {&in.targets, static_cast<const TensorView*>(&logp), static_cast<const TensorView*>(&lse)})
    DETLOGP_CHECK(t->memory == Memory::host, "reduce_logits needs host memory for targets/logp/lse");
  DETLOGP_CHECK((in.targets.ndim == 1 || in.targets.ndim == 2) &&
                    (in.targets.dtype == DType::i32 || in.targets.dtype == DType::i64) && in.targets.rows == rows,
                "targets must be [N=" << rows << "] or [N=" << rows << ", K] i32 or i64");
  p.targets_per_row = check_targets_tensor(in.targets, rows);
  p.targets_2d = in.targets.ndim == 2;
  if (p.targets_2d)
    check_logp_tensor(logp, in.targets, rows, p.targets_per_row);
  else
    DETLOGP_CHECK(logp.ndim == 1 && logp.dtype == DType::f32 && logp.rows == rows,
                  "logp must be [N=" << rows << "] f32");
  DETLOGP_CHECK(lse.ndim == 1 && lse.dtype == DType::f32 && lse.rows == rows, "lse must be [N=" << rows << "] f32");
  check_temperature_value(in.temperature, "temperature", -1);
  if (in.temperature_rows.present()) {
    DETLOGP_CHECK(in.temperature_rows.ndim == 1 && in.temperature_rows.dtype == DType::f32 &&
                      in.temperature_rows.rows == rows && in.temperature_rows.memory == Memory::host,
                  "temperature_rows must be [N=" << rows << "] f32 in host memory");
    p.temperature_rows = static_cast<const float*>(in.temperature_rows.data);
    check_temperatures_host(p.temperature_rows, rows);
  }
  p.ignore_index = in.ignore_index;
  p.logits = static_cast<const float*>(z.data);
  p.logits_stride = z.row_stride;
  p.targets = in.targets.data;
  p.targets_i64 = in.targets.dtype == DType::i64;
  p.temperature = in.temperature;
  p.logp = static_cast<float*>(logp.mutable_data());
  p.lse = static_cast<float*>(lse.mutable_data());
  if (entropy.present()) {
    DETLOGP_CHECK(
        entropy.ndim == 1 && entropy.dtype == DType::f32 && entropy.rows == rows && entropy.memory == Memory::host,
        "entropy must be [N=" << rows << "] f32 in host memory");
    p.entropy = static_cast<float*>(entropy.mutable_data());
  }
  if (rows > 0)
    check_targets_host(p.targets, p.targets_i64, rows, p.real_vocab, p.ignore_index, p.targets_per_row, p.targets_2d);
  return p;
}

}  // namespace detlogp::detail

// detlogp._detlogp: the Python extension. Arrays cross through DLPack (numpy arrays, torch CPU and
// CUDA tensors alike, never copied); outputs are allocated by the caller (python/detlogp), so the
// C++ library never owns Python memory. No torch headers: the CUDA stream arrives as an integer.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "detlogp/detlogp.hpp"
#include "detlogp/dist.hpp"
#include "detlogp/fpops.hpp"
#include "io/weight_fingerprint.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;
// DLPack device codes (dlpack.h): kDLCPU, kDLCUDA, kDLCUDAHost (pinned host memory).
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;

// A bad argument found by the binding itself (dtype, rank, strides, device): InputError.
struct BindingInputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void value_error(const std::string& msg) { throw BindingInputError(msg); }

std::string dtype_str(nb::dlpack::dtype d) {
  // DLPack's type codes (dlpack.h, DLDataTypeCode), by value.
  static constexpr const char* kCodes[] = {"int", "uint", "float", "handle", "bfloat", "complex", "bool"};
  const char* code = d.code < std::size(kCodes) ? kCodes[d.code] : "?";
  return std::string(code) + std::to_string(d.bits) + (d.lanes != 1 ? "x" + std::to_string(d.lanes) : "");
}

// The detlogp dtype of an array. bf16 arrives as DLPack bfloat16 (torch, ml_dtypes) or as 2-byte
// integer bit patterns (numpy has no bf16; docs/file-formats.md uses the same convention).
detlogp::DType dtype_of(const nb::dlpack::dtype& d, const char* name, bool bf16_allowed) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(d.code);
  if (d.lanes == 1) {
    if (bf16_allowed && d.bits == 16 && (code == C::Bfloat || code == C::UInt || code == C::Int))
      return detlogp::DType::bf16;
    if (code == C::Float && d.bits == 32) return detlogp::DType::f32;
    if (code == C::Int && d.bits == 32) return detlogp::DType::i32;
    if (code == C::Int && d.bits == 64) return detlogp::DType::i64;
  }
  value_error(std::string(name) + " has dtype " + dtype_str(d) + ", which detlogp does not take here");
}

struct Placement {
  detlogp::Memory memory;
  int device;
};

Placement placement_of(int device_type, int device_id, const char* name) {
  if (device_type == kDLCPU || device_type == kDLCUDAHost) return {detlogp::Memory::host, 0};
  if (device_type == kDLCUDA) return {detlogp::Memory::cuda, device_id};
  value_error(std::string(name) + " lives on DLPack device type " + std::to_string(device_type) +
              "; detlogp takes host (CPU) and CUDA memory only");
}

// A TensorView over a DLPack array: 1-D contiguous, or 2-D with unit column stride.
template <typename A>
detlogp::TensorView view_of(const A& a, const char* name, int ndim, bool bf16_allowed) {
  // The library's words (core/validate.cpp, check_matrix and check_vector): a TensorView holds one or two
  // dimensions, so the rank is checked here.
  if (static_cast<int>(a.ndim()) != ndim)
    value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got ndim=" + std::to_string(a.ndim()));
  const detlogp::DType dt = dtype_of(a.dtype(), name, bf16_allowed);
  const Placement pl = placement_of(a.device_type(), a.device_id(), name);
  detlogp::TensorView v;
  v.data = a.data();
  v.dtype = dt;
  v.ndim = ndim;
  v.memory = pl.memory;
  v.device = pl.device;
  if (ndim == 1) {
    v.rows = static_cast<int64_t>(a.shape(0));
    if (v.rows > 1 && a.stride(0) != 1)
      value_error(std::string(name) + " must be contiguous (stride " + std::to_string(a.stride(0)) + ")");
    v.row_stride = 1;
  } else {
    v.rows = static_cast<int64_t>(a.shape(0));
    v.cols = static_cast<int64_t>(a.shape(1));
    if (v.rows == 0 || v.cols == 0) {  // empty: exporters report arbitrary strides
      v.row_stride = v.cols;
      return v;
    }
    if (v.cols > 1 && a.stride(1) != 1)
      value_error(std::string(name) + " must have unit stride along its last dimension (got stride " +
                  std::to_string(a.stride(1)) + ")");
    // One row: no second row is read, so its stride only has to satisfy the backends (the SM90 backend's TMA
    // loads need a multiple of 16 bytes), and exporters may report any (0 for a broadcast axis). The array's own
    // is kept where it spans the row and is such a multiple (a row of a padded matrix), else the width is used.
    // Overlapping rows (a stride below the width, 0 or negative) are the library's to refuse, in its words.
    const bool own_fits = a.stride(0) >= v.cols && (a.stride(0) * static_cast<int64_t>(a.itemsize())) % 16 == 0;
    v.row_stride = v.rows > 1 || own_fits ? a.stride(0) : v.cols;
  }
  return v;
}

detlogp::MutableTensorView out_view(const OutArray& a, const char* name, int ndim) {
  return {view_of(a, name, ndim, false)};
}

// Targets and what is shaped like them (logp, the partials' target logits): [N], or [N, K] for K ids
// a row. Any other rank is refused as not 1-D, in the words of the 1-D case.
template <class A>
int target_rank(const A& a, const char* name) {
  if (a.ndim() == 1 || a.ndim() == 2) return static_cast<int>(a.ndim());
  value_error(std::string(name) + " must be 1-D [N] or 2-D [N, K], got ndim=" + std::to_string(a.ndim()));
}

std::optional<detlogp::TensorView> opt_view(const std::optional<InArray>& a, const char* name, int ndim) {
  if (!a) return std::nullopt;
  return view_of(*a, name, ndim, false);
}

// A Python dict from (key, value) pairs, in their order.
nb::dict dict_of(std::initializer_list<std::pair<const char*, nb::object>> items) {
  nb::dict d;
  for (const auto& [key, value] : items) d[key] = value;
  return d;
}

nb::dict provenance_dict(const detlogp::Provenance& p) {
  return dict_of({{"contract_name", nb::cast(p.contract_name)},
                  {"contract_version", nb::cast(p.contract_version)},
                  {"backend_id", nb::cast(p.backend_id)},
                  {"arch", nb::cast(p.arch)},
                  {"cc", nb::cast(p.cc)},
                  {"vocab_tile", nb::cast(p.vocab_tile)},
                  {"k_slab", nb::cast(p.k_slab)},
                  {"n_split_policy", nb::cast(p.n_split_policy)},
                  {"tree_id", nb::cast(p.tree_id)},
                  {"transcendental_id", nb::cast(p.transcendental_id)},
                  {"temperature_id", nb::cast(p.temperature_id)},
                  {"entropy_id", nb::cast(p.entropy_id)},
                  {"sample_id", nb::cast(p.sample_id)},
                  {"string", nb::cast(detlogp::to_string(p))}});
}

nb::dict report_dict(const detlogp::CallReport& r) {
  return dict_of({{"requested_backend", nb::cast(r.requested_backend)},
                  {"strict", nb::cast(r.strict)},
                  {"fallback", nb::cast(r.fallback)},
                  {"fallback_reason", nb::cast(r.fallback_reason)},
                  {"backend_id", nb::cast(r.provenance.backend_id)},
                  {"contract", nb::cast(r.provenance.contract_version > 0)},
                  {"provenance", provenance_dict(r.provenance)},
                  {"sampling", dict_of({{"outside_support", nb::cast(r.sampling.outside_support)},
                                        {"first_outside_support", nb::cast(r.sampling.first_outside_support)}})}});
}

detlogp::CallOptions options(const std::string& backend, bool strict, uintptr_t stream) {
  detlogp::CallOptions o;
  o.backend = backend;
  o.strict = strict;
  o.cuda_stream = reinterpret_cast<void*>(stream);
  return o;
}

std::string python_type(nb::handle h) { return nb::type_name(h.type()).c_str(); }

// A value as a message shows it (python/detlogp/__init__.py, _shown): at most 40 characters.
std::string shown(std::string text) { return text.size() <= 40 ? text : text.substr(0, 37) + "..."; }

// What a refused scalar argument is, as python/detlogp/__init__.py's _what says it: None, or its type and repr.
std::string described(nb::handle h) {
  if (h.is_none()) return "None";
  return python_type(h) + " " + shown(nb::repr(h).c_str());
}

// The arguments below are parsed here rather than by nanobind's overload resolution, so that a value the
// library cannot take is an InputError naming the argument, in the words of detlogp's Python faces
// (python/detlogp/__init__.py), not a TypeError saying that no overload matched.
InArray array_arg(nb::handle h, const char* name) {
  InArray a;
  if (!nb::try_cast(h, a))
    value_error(std::string(name) +
                " could not be read as an array in host or CUDA memory (DLPack or the buffer protocol), got " +
                python_type(h));
  return a;
}

std::optional<InArray> opt_array_arg(nb::handle h, const char* name) {
  if (h.is_none()) return std::nullopt;
  return array_arg(h, name);
}

int64_t int64_arg(nb::handle h, const char* name) {
  const auto not_integer = [&] { value_error(std::string(name) + " must be an integer, got " + described(h)); };
  if (PyBool_Check(h.ptr()) || !PyIndex_Check(h.ptr())) not_integer();
  const nb::object i = nb::steal(PyNumber_Index(h.ptr()));
  if (!i.is_valid()) {
    PyErr_Clear();
    not_integer();
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    value_error(std::string(name) + "=" + shown(nb::str(i).c_str()) + " is outside the int64 range [-2^63, 2^63 - 1]");
  }
  return v;
}

// A scalar float argument rounded to float32 (IEEE nearest): the temperature, the sampling program's
// top_p and min_p. A value that rounding would turn into 0 or inf is refused here, naming the value
// given; the valid range itself is the library's check.
float float32_arg(nb::handle h, const char* name) {
  if (PyBool_Check(h.ptr()) || !(PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr())))
    value_error(std::string(name) + " must be a float, got " + described(h));
  const std::string given = shown(nb::repr(h).c_str());
  const double d = PyFloat_AsDouble(h.ptr());
  if (d == -1.0 && PyErr_Occurred()) {  // an int beyond the double range
    PyErr_Clear();
    value_error(std::string(name) + "=" + given + " is not representable as float32 (it would round to inf)");
  }
  // |T| <= 2^-150 (half the smallest subnormal, ties to even) rounds to 0; |T| >= 2^128 - 2^103 (halfway past
  // the largest finite float32) to inf, and converting it would be undefined behaviour.
  if (d != 0.0 && std::fabs(d) <= std::ldexp(1.0, -150))
    value_error(std::string(name) + "=" + given + " is not representable as float32 (it would round to 0)");
  if (std::isfinite(d) && std::fabs(d) >= std::ldexp(1.0, 128) - std::ldexp(1.0, 103))
    value_error(std::string(name) + "=" + given + " is not representable as float32 (it would round to inf)");
  return static_cast<float>(d);
}

float temperature_arg(nb::handle h) { return float32_arg(h, "temperature"); }

// The problem every entry takes, passed as one Python tuple: (hidden, weight, targets, bias | None, temperature,
// temperature_rows | None, real_vocab, vocab_start, ignore_index), parsed by inputs(). The arrays' memory belongs
// to the objects in the tuple, which the caller holds for the whole call.
using Problem = nb::tuple;

detlogp::LinearLogpInputs inputs(const Problem& problem) {
  if (problem.size() != 9)
    value_error("the problem tuple has " + std::to_string(problem.size()) + " entries, expected 9");
  detlogp::LinearLogpInputs in;
  in.hidden = view_of(array_arg(problem[0], "hidden"), "hidden", 2, true);
  in.weight = view_of(array_arg(problem[1], "weight"), "weight", 2, true);
  const InArray targets = array_arg(problem[2], "targets");
  in.targets = view_of(targets, "targets", target_rank(targets, "targets"), false);
  if (auto b = opt_view(opt_array_arg(problem[3], "bias"), "bias", 1)) in.bias = *b;
  in.temperature = temperature_arg(problem[4]);
  if (auto t = opt_view(opt_array_arg(problem[5], "temperature_rows"), "temperature_rows", 1)) in.temperature_rows = *t;
  in.real_vocab = int64_arg(problem[6], "real_vocab");
  in.vocab_start = int64_arg(problem[7], "vocab_start");
  in.ignore_index = int64_arg(problem[8], "ignore_index");
  return in;
}

// The logit gradient's per-row inputs: the forward's lse (and entropy), the upstream gradients.
detlogp::GradLogitsArgs grad_args(const InArray& lse, const std::optional<InArray>& g_logp,
                                  const std::optional<InArray>& g_lse, const std::optional<InArray>& entropy,
                                  const std::optional<InArray>& g_entropy) {
  detlogp::GradLogitsArgs args;
  args.lse = view_of(lse, "lse", 1, false);
  if (g_logp) args.g_logp = view_of(*g_logp, "g_logp", target_rank(*g_logp, "g_logp"), false);
  if (auto g = opt_view(g_lse, "g_lse", 1)) args.g_lse = *g;
  if (auto h = opt_view(entropy, "entropy", 1)) args.entropy = *h;
  if (auto g = opt_view(g_entropy, "g_entropy", 1)) args.g_entropy = *g;
  return args;
}

detlogp::LinearLogpOutputs outputs(const OutArray& logp, const OutArray& lse, const std::optional<OutArray>& logits) {
  detlogp::LinearLogpOutputs out{out_view(logp, "logp", target_rank(logp, "logp")), out_view(lse, "lse", 1), {}};
  if (logits) out.logits = out_view(*logits, "logits", 2);
  return out;
}

// The sampling program as Python hands it (python/detlogp/_sampling.py): (temperature,
// temperature_rows | None, top_k, top_k_rows | None, top_p, top_p_rows | None, min_p, min_p_rows | None).
// The arrays belong to the tuple's objects, which the caller holds for the whole call.
detlogp::SamplingProgram program_of(const nb::tuple& t) {
  if (t.size() != 8) value_error("the program tuple has " + std::to_string(t.size()) + " entries, expected 8");
  detlogp::SamplingProgram p;
  const auto rows = [&](size_t i, const char* name) {
    auto v = opt_view(opt_array_arg(t[i], name), name, 1);
    return v ? *v : detlogp::TensorView{};
  };
  p.temperature = float32_arg(t[0], "temperature");
  p.temperature_rows = rows(1, "temperature_rows");
  p.top_k = int64_arg(t[2], "top_k");
  p.top_k_rows = rows(3, "top_k_rows");
  p.top_p = float32_arg(t[4], "top_p");
  p.top_p_rows = rows(5, "top_p_rows");
  p.min_p = float32_arg(t[6], "min_p");
  p.min_p_rows = rows(7, "min_p_rows");
  return p;
}

// A uint64 argument (the sampling seed): an int in [0, 2^64 - 1], not bool.
uint64_t uint64_arg(nb::handle h, const char* name) {
  if (PyBool_Check(h.ptr()) || !PyLong_Check(h.ptr()))
    value_error(std::string(name) + " must be an integer, got " + described(h));
  const unsigned long long v = PyLong_AsUnsignedLongLong(h.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    value_error(std::string(name) + "=" + shown(nb::str(h).c_str()) + " is outside the uint64 range [0, 2^64 - 1]");
  }
  return v;
}

template <class A>
detlogp::MutableTensorView opt_out_view(const std::optional<A>& a, const char* name) {
  return a ? out_view(*a, name, 1) : detlogp::MutableTensorView{};
}

// Runs one library call without the GIL and returns its report.
template <class Call>
detlogp::CallReport run_released(Call&& call) {
  nb::gil_scoped_release release;
  return call();
}

template <class Call>
nb::dict reported(Call&& call) {
  return report_dict(run_released(call));
}

// One shard's partials over three arrays: summaries [N, tiles, 2] f32, target_logit [N] f32,
// target_owned [N] u8 ([N, K] both for [N, K] targets), contiguous, in one memory. `at` names the
// rank in the messages.
template <class A>
detlogp::ShardPartials partials_of(const A& s, const A& tl, const A& own, const std::string& at) {
  if (s.ndim() != 3 || s.shape(2) != 2 || s.dtype() != nb::dtype<float>())
    value_error(at + "summaries must be [N, tiles, 2] float32");
  const size_t k = tl.ndim() == 2 ? tl.shape(1) : 1;
  if ((tl.ndim() != 1 && tl.ndim() != 2) || tl.ndim() != own.ndim() || tl.dtype() != nb::dtype<float>() ||
      own.dtype() != nb::dtype<uint8_t>() || tl.shape(0) != s.shape(0) || own.shape(0) != s.shape(0) ||
      (own.ndim() == 2 && own.shape(1) != k))
    value_error(at + "target_logit must be [N] (or [N, K]) float32 and target_owned the same shape, uint8");
  detlogp::ShardPartials p;
  p.rows = static_cast<int64_t>(s.shape(0));
  p.tiles = static_cast<int64_t>(s.shape(1));
  p.targets_per_row = static_cast<int64_t>(k);
  if (p.rows * p.tiles > 0 && (s.stride(2) != 1 || s.stride(1) != 2 || (p.rows > 1 && s.stride(0) != 2 * p.tiles)))
    value_error(at + "summaries must be contiguous");
  const auto contiguous = [&](const A& a) {
    if (a.ndim() == 1) return p.rows <= 1 || a.stride(0) == 1;
    return p.rows * p.targets_per_row == 0 ||
           ((p.targets_per_row == 1 || a.stride(1) == 1) && (p.rows <= 1 || a.stride(0) == p.targets_per_row));
  };
  if (!contiguous(tl) || !contiguous(own)) value_error(at + "target_logit and target_owned must be contiguous");
  const Placement pl = placement_of(s.device_type(), s.device_id(), "summaries");
  for (const Placement q : {placement_of(tl.device_type(), tl.device_id(), "target_logit"),
                            placement_of(own.device_type(), own.device_id(), "target_owned")})
    if (q.memory != pl.memory || q.device != pl.device) value_error(at + "partials must all live in one memory");
  p.summaries = static_cast<detlogp::TileSummary*>(const_cast<void*>(static_cast<const void*>(s.data())));
  p.target_logit = static_cast<float*>(const_cast<void*>(static_cast<const void*>(tl.data())));
  p.target_owned = static_cast<uint8_t*>(const_cast<void*>(static_cast<const void*>(own.data())));
  p.memory = pl.memory;
  p.device = pl.device;
  return p;
}

// The optional entropy sums of partials `p`: usums [N, tiles] f32, contiguous, in p's memory.
template <class A>
void set_usums(detlogp::ShardPartials& p, const std::optional<A>& usums, const std::string& at) {
  if (!usums) return;
  const A& u = *usums;
  if (u.ndim() != 2 || u.dtype() != nb::dtype<float>() || static_cast<int64_t>(u.shape(0)) != p.rows ||
      static_cast<int64_t>(u.shape(1)) != p.tiles)
    value_error(at + "usums must be [N=" + std::to_string(p.rows) + ", tiles=" + std::to_string(p.tiles) + "] float32");
  if (p.rows * p.tiles > 0 && (u.stride(1) != 1 || (p.rows > 1 && u.stride(0) != p.tiles)))
    value_error(at + "usums must be contiguous");
  const Placement q = placement_of(u.device_type(), u.device_id(), "usums");
  if (q.memory != p.memory || q.device != p.device) value_error(at + "partials must all live in one memory");
  p.usums = static_cast<float*>(const_cast<void*>(static_cast<const void*>(u.data())));
}

// The optional edge lanes of partials `p`: edge_logits [N, edge_lanes] f32, contiguous, in p's
// memory (an unaligned shard's scaled logits of its lanes in the tiles straddling its boundaries).
template <class A>
void set_edge_logits(detlogp::ShardPartials& p, const std::optional<A>& edge, const std::string& at) {
  if (!edge) return;
  const A& e = *edge;
  if (e.ndim() != 2 || e.dtype() != nb::dtype<float>() || static_cast<int64_t>(e.shape(0)) != p.rows)
    value_error(at + "edge_logits must be [N=" + std::to_string(p.rows) + ", edge_lanes] float32");
  p.edge_lanes = static_cast<int64_t>(e.shape(1));
  if (p.rows * p.edge_lanes > 0 && (e.stride(1) != 1 || (p.rows > 1 && e.stride(0) != p.edge_lanes)))
    value_error(at + "edge_logits must be contiguous");
  const Placement q = placement_of(e.device_type(), e.device_id(), "edge_logits");
  if (q.memory != p.memory || q.device != p.device) value_error(at + "partials must all live in one memory");
  p.edge_logits = static_cast<float*>(const_cast<void*>(static_cast<const void*>(e.data())));
}

// The optional top-k lists of partials `p`: topk_logit [N, K] f32 and topk_ids [N, K] i64,
// contiguous, in p's memory.
template <class A>
void set_topk(detlogp::ShardPartials& p, const std::optional<A>& logit, const std::optional<A>& ids,
              const std::string& at) {
  if (!logit && !ids) return;
  if (!logit || !ids) value_error(at + "top-k partials need both topk_logit and topk_ids");
  if (logit->ndim() != 2 || ids->ndim() != 2 || logit->dtype() != nb::dtype<float>() ||
      ids->dtype() != nb::dtype<int64_t>() || static_cast<int64_t>(logit->shape(0)) != p.rows ||
      static_cast<int64_t>(ids->shape(0)) != p.rows || logit->shape(1) != ids->shape(1))
    value_error(at + "topk_logit must be [N=" + std::to_string(p.rows) +
                ", K] float32 and topk_ids the same shape, int64");
  p.topk = static_cast<int64_t>(ids->shape(1));
  for (const A* a : {&*logit, &*ids})
    if (p.rows * p.topk > 0 && (a->stride(1) != 1 || (p.rows > 1 && a->stride(0) != p.topk)))
      value_error(at + "topk_logit and topk_ids must be contiguous");
  p.topk_logit = static_cast<float*>(const_cast<void*>(static_cast<const void*>(logit->data())));
  p.topk_ids = static_cast<int64_t*>(const_cast<void*>(static_cast<const void*>(ids->data())));
}

// A PartialsLayout as Python holds it (detlogp.PartialsLayout): (vocab_start, vocab_local,
// real_vocab, ignore_index, targets_digest, temperature_digest, backend_digest).
using Layout = std::tuple<int64_t, int64_t, int64_t, int64_t, uint64_t, uint64_t, uint64_t>;
Layout layout_tuple(const detlogp::PartialsLayout& l) {
  return {l.vocab_start,    l.vocab_local,        l.real_vocab,    l.ignore_index,
          l.targets_digest, l.temperature_digest, l.backend_digest};
}
// None: no layout, which merge_partials refuses in its own words.
detlogp::PartialsLayout layout_of(const std::optional<Layout>& t) {
  detlogp::PartialsLayout l;
  if (t)
    std::tie(l.vocab_start, l.vocab_local, l.real_vocab, l.ignore_index, l.targets_digest, l.temperature_digest,
             l.backend_digest) = *t;
  return l;
}

// The first `rows` rows of a view (0 for the zero-row check of a tensor-parallel call).
detlogp::TensorView first_rows(detlogp::TensorView t, int64_t rows) {
  if (t.present()) t.rows = rows;
  return t;
}

// A Communicator whose all-gather is a Python callable, gather(send, recv): two uint8 arrays
// (DLPack, in the tensors' memory) of `bytes` and size() * `bytes`; rank r's bytes land at
// recv[r * bytes]. CUDA gathers must be ordered on the caller's current stream, which is the
// stream the operator runs on (torch.distributed orders its collectives that way).
class CallbackCommunicator final : public detlogp::Communicator {
 public:
  CallbackCommunicator(int rank, int size, Placement where, nb::callable gather)
      : rank_(rank), size_(size), where_(where), gather_(std::move(gather)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  detlogp::Memory memory() const override { return where_.memory; }
  int device() const override { return where_.device; }
  void all_gather(const void* send, void* recv, size_t bytes, void*) override {
    nb::gil_scoped_acquire gil;
    gather_(byte_array(const_cast<void*>(send), bytes), byte_array(recv, bytes * static_cast<size_t>(size_)));
  }
  const char* name() const override { return "Python callback"; }

 private:
  nb::object byte_array(void* data, size_t bytes) const {
    const int type = where_.memory == detlogp::Memory::cuda ? kDLCUDA : kDLCPU;
    const nb::ndarray<uint8_t, nb::ndim<1>> a(data, {bytes}, nb::handle(), {}, nb::dtype<uint8_t>(), type,
                                              where_.device);
    return nb::cast(a, nb::rv_policy::reference);
  }
  int rank_, size_;
  Placement where_;
  nb::callable gather_;
};

// The sampling entries' tensor-parallel arguments: tp = None (the whole head) or (rank, size,
// gather) as CallbackCommunicator takes them; check_only: the binding's checks of the arrays alone
// (detlogp.torch runs them before its agreement exchange, so that no rank raises alone later).
struct SamplingTp {
  bool on = false;
  int rank = 0, size = 1;
  nb::object gather;
  explicit SamplingTp(const nb::object& tp) {
    if (tp.is_none()) return;
    const nb::tuple t = nb::cast<nb::tuple>(tp);
    if (t.size() != 3) value_error("tp must be (rank, size, gather), got " + std::to_string(t.size()) + " entries");
    on = true;
    rank = nb::cast<int>(t[0]);
    size = nb::cast<int>(t[1]);
    gather = t[2];
  }
  CallbackCommunicator communicator(const detlogp::TensorView& hidden) const {
    return CallbackCommunicator(rank, size, {hidden.memory, hidden.device}, nb::cast<nb::callable>(gather));
  }
};

// How linear_logp_tensor_parallel's refusal opens (the decision after its header exchange); the
// agreement step of detlogp.torch refuses in the same words (TENSOR_PARALLEL_REFUSAL).
constexpr const char* kTensorParallelRefusal = "tensor-parallel linear_logp refused on every rank";

// Python exception class for a detlogp::Error. The C++ messages name the argument; the class is
// chosen from what the message is about (the tests pin one real message of every class).
const char* error_class(const std::string& what) {
  std::string m = what;
  const std::string prefix = "detlogp error at ";
  if (m.rfind(prefix, 0) == 0) {
    const size_t colon = m.find(": ");
    if (colon != std::string::npos) m = m.substr(colon + 2);
  }
  // A tensor-parallel refusal lists every failing rank ("\n  rank r: <its message>") and takes
  // the class of the first one: every rank raises the same class.
  if (m.rfind(kTensorParallelRefusal, 0) == 0) {
    const size_t first = m.find(": ", m.find("\n  rank "));
    if (first != std::string::npos) return error_class(m.substr(first + 2));
  }
  auto has = [&](const char* s) { return m.find(s) != std::string::npos; };
  if (has("strict mode")) return "StrictModeError";
  if (m.rfind("targets[", 0) == 0) return "TargetIndexError";
  if (has("environment variable") || m.rfind("DETLOGP_", 0) == 0) return "ConfigError";
  if (has("unavailable") || has("served by different backends") || has("CUDA call failed") ||
      has("could not allocate") || has("compute capability") || has("unknown status") || has("cuTensorMapEncode") ||
      has("driver entry point"))
    return "BackendError";
  return "InputError";
}

void raise_as(const char* cls_name, const char* message) {
  PyObject* cls = PyExc_RuntimeError;
  nb::object holder;
  try {
    holder = nb::module_::import_("detlogp._errors").attr(cls_name);
    cls = holder.ptr();
  } catch (...) {
    PyErr_Clear();  // the package is not importable: plain RuntimeError with the same message
  }
  PyErr_SetString(cls, message);
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const BindingInputError& e) {
    raise_as("InputError", e.what());
  } catch (const detlogp::Error& e) {
    raise_as(error_class(e.what()), e.what());
  }
}

// out[i] = f(x[i]) over two contiguous host vectors of one length (the bf16 conversions).
template <class In, class Out, auto f>
void convert(const nb::ndarray<In, nb::ndim<1>, nb::c_contig, nb::device::cpu>& x,
             const nb::ndarray<Out, nb::ndim<1>, nb::c_contig, nb::device::cpu>& out) {
  if (x.shape(0) != out.shape(0)) value_error("out must have as many elements as the input");
  nb::gil_scoped_release release;
  for (size_t i = 0; i < x.shape(0); ++i) out(i) = f(x(i));
}

}  // namespace

NB_MODULE(_detlogp, m) {
  m.doc() = "detlogp C++ core (use the detlogp package, not this module directly)";
  nb::register_exception_translator(translate);

  m.def("version", &detlogp::version_string);
  m.def("check_environment", &detlogp::check_environment);
  m.def("check_deferred_errors", [] {
    nb::gil_scoped_release release;
    detlogp::check_deferred_errors();
  });
  m.def("shard_tiles", &detlogp::shard_tiles, "vocab_local"_a);
  // (first_tile, tiles, head_cols, head_lanes, whole_cols, tail_lanes) of a shard (detlogp/shards.hpp).
  m.def(
      "shard_geometry",
      [](int64_t vocab_start, int64_t vocab_local, int64_t real_vocab) {
        if (vocab_start < 0) value_error("vocab_start=" + std::to_string(vocab_start) + " must be >= 0");
        if (vocab_local < 1) value_error("vocab_local=" + std::to_string(vocab_local) + " must be >= 1");
        if (real_vocab < 1) value_error("real_vocab=" + std::to_string(real_vocab) + " must be >= 1");
        const detlogp::ShardGeometry g = detlogp::shard_geometry(vocab_start, vocab_local, real_vocab);
        return std::make_tuple(g.first_tile, g.tiles, g.head_cols, g.head_lanes, g.whole_cols, g.tail_lanes);
      },
      "vocab_start"_a, "vocab_local"_a, "real_vocab"_a);
  m.def(
      "error_class", [](const std::string& msg) { return std::string(error_class(msg)); }, "message"_a);
  m.attr("TENSOR_PARALLEL_REFUSAL") = kTensorParallelRefusal;

  // The library's bf16 conversions over host arrays (detlogp.to_bf16_bits / from_bf16_bits).
  m.def("bf16_round", &convert<const float, uint16_t, detlogp::fp::bf16_round>, "x"_a, "out"_a);
  m.def("bf16_to_float", &convert<const uint16_t, float, detlogp::fp::bf16_to_float>, "x"_a, "out"_a);

  m.def("contract", [] {
    return dict_of({{"contract_name", nb::cast(detlogp::kContractName)},
                    {"contract_version", nb::cast(detlogp::kContractVersion)},
                    {"vocab_tile", nb::cast(detlogp::kVocabTile)},
                    {"k_slab", nb::cast(detlogp::kKSlab)},
                    {"tree_id", nb::cast(detlogp::kTreeId)},
                    {"transcendental_id", nb::cast(detlogp::kTranscendentalId)},
                    {"n_split_policy", nb::cast(detlogp::kNSplitPolicy)},
                    {"temperature_id", nb::cast(detlogp::kTemperatureId)},
                    {"entropy_id", nb::cast(detlogp::kEntropyId)},
                    {"sample_id", nb::cast(detlogp::kSampleId)},
                    {"default_ignore_index", nb::cast(detlogp::kDefaultIgnoreIndex)},
                    {"max_targets_per_row", nb::cast(detlogp::kMaxTargetsPerRow)},
                    {"max_topk", nb::cast(detlogp::kMaxTopk)}});
  });

  // A call's report held as the library returned it; as_dict() gives the dict every entry returns.
  nb::class_<detlogp::CallReport>(m, "CallReport").def("as_dict", [](const detlogp::CallReport& r) {
    return report_dict(r);
  });

  m.def("list_backends", [] {
    nb::list out;
    for (const detlogp::BackendInfo& b : detlogp::list_backends())
      out.append(dict_of({{"id", nb::cast(b.id)},
                          {"contract", nb::cast(b.contract_bearing)},
                          {"available", nb::cast(b.available)},
                          {"detail", nb::cast(b.detail)},
                          {"memory", nb::cast(b.memory == detlogp::Memory::host ? "host" : "cuda")},
                          {"provenance", provenance_dict(b.provenance)},
                          {"multi_targets", nb::cast(b.multi_targets)},
                          {"topk", nb::cast(b.topk)}}));
    return out;
  });

  m.def(
      "linear_logp",
      [](const Problem& problem, const OutArray& logp, const OutArray& lse, const std::optional<OutArray>& logits,
         const std::string& backend, bool strict, uintptr_t stream, const std::optional<OutArray>& entropy,
         const std::optional<OutArray>& topk_ids, const std::optional<OutArray>& topk_logp, bool defer_errors,
         bool lazy_report) -> nb::object {
        const detlogp::LinearLogpInputs in = inputs(problem);
        detlogp::LinearLogpOutputs out = outputs(logp, lse, logits);
        if (entropy) out.entropy = out_view(*entropy, "entropy", 1);
        if (topk_ids) out.topk_ids = out_view(*topk_ids, "topk_ids", 2);
        if (topk_logp) out.topk_logp = out_view(*topk_logp, "topk_logp", 2);
        detlogp::CallOptions opt = options(backend, strict, stream);
        opt.defer_errors = defer_errors;
        detlogp::CallReport r = run_released([&] { return detlogp::linear_logp(in, out, opt); });
        // lazy_report: the report as a CallReport, whose dict is built only when it is read
        // (detlogp.torch.last_report()): building it is a good part of a decode call's host time.
        return lazy_report ? nb::cast(std::move(r)) : nb::object(report_dict(r));
      },
      "problem"_a, "logp"_a, "lse"_a, "logits"_a.none(), "backend"_a, "strict"_a, "stream"_a,
      "entropy"_a.none() = nb::none(), "topk_ids"_a.none() = nb::none(), "topk_logp"_a.none() = nb::none(),
      "defer_errors"_a = false, "lazy_report"_a = false);

  // Partials of one vocabulary shard: summaries [N, tiles, 2] f32 (max, sum), target_logit [N] f32,
  // target_owned [N] u8, optional logits [N, V_local] f32 (the serving entry), optional usums
  // [N, tiles] f32 (the tiles' entropy sums, for a merge with entropy). Returns (report, layout).
  m.def(
      "linear_logp_partials",
      [](const Problem& problem, const OutArray& summaries, const OutArray& target_logit, const OutArray& target_owned,
         const std::optional<OutArray>& logits, const std::string& backend, bool strict, uintptr_t stream,
         const std::optional<OutArray>& usums, const std::optional<OutArray>& edge_logits,
         const std::optional<OutArray>& topk_logit, const std::optional<OutArray>& topk_ids) {
        const detlogp::LinearLogpInputs in = inputs(problem);
        detlogp::ShardPartials p = partials_of(summaries, target_logit, target_owned, "");
        set_usums(p, usums, "");
        set_edge_logits(p, edge_logits, "");
        set_topk(p, topk_logit, topk_ids, "");
        if (logits) p.logits = out_view(*logits, "logits", 2);
        const detlogp::CallOptions opt = options(backend, strict, stream);
        nb::dict report = reported([&] { return detlogp::linear_logp_partials(in, p, opt); });
        return std::make_tuple(report, layout_tuple(p.layout));
      },
      "problem"_a, "summaries"_a, "target_logit"_a, "target_owned"_a, "logits"_a.none(), "backend"_a, "strict"_a,
      "stream"_a, "usums"_a.none() = nb::none(), "edge_logits"_a.none() = nb::none(),
      "topk_logit"_a.none() = nb::none(), "topk_ids"_a.none() = nb::none());

  // The logit gradient of one vocabulary chunk (detlogp.torch's fused backward): weight is the
  // chunk [C, D] starting at global id vocab_start, dz [N, C] bf16 (row stride >= C) is written.
  // g_entropy (dL/dH) adds the entropy term and needs entropy, the forward's H.
  m.def(
      "linear_logp_grad_logits",
      [](const Problem& problem, const InArray& lse, const std::optional<InArray>& g_logp,
         const std::optional<InArray>& g_lse, const OutArray& dz, uintptr_t stream,
         const std::optional<InArray>& entropy, const std::optional<InArray>& g_entropy) {
        const detlogp::LinearLogpInputs in = inputs(problem);
        const detlogp::GradLogitsArgs args = grad_args(lse, g_logp, g_lse, entropy, g_entropy);
        const detlogp::MutableTensorView out{view_of(dz, "dz", 2, true)};
        const detlogp::CallOptions opt = options("", false, stream);
        return reported([&] { return detlogp::linear_logp_grad_logits(in, args, out, opt); });
      },
      "problem"_a, "lse"_a, "g_logp"_a.none(), "g_lse"_a.none(), "dz"_a, "stream"_a, "entropy"_a.none() = nb::none(),
      "g_entropy"_a.none() = nb::none());

  // The same logit gradient from given logits (detlogp.torch's linear_logp_loss): logits [N, C] f32
  // the chunk's z (row stride >= C), dz [N, C] bf16, which may be the logits' bytes in place (row
  // stride twice theirs). problem = (logits, targets, temperature, temperature_rows | None,
  // real_vocab, vocab_start, ignore_index). defer_errors: CallOptions::defer_errors (CUDA).
  m.def(
      "linear_logp_grad_from_logits",
      [](const nb::tuple& problem, const InArray& lse, const std::optional<InArray>& g_logp,
         const std::optional<InArray>& g_lse, const OutArray& dz, uintptr_t stream,
         const std::optional<InArray>& entropy, const std::optional<InArray>& g_entropy, bool defer_errors) {
        if (problem.size() != 7)
          value_error("the problem tuple has " + std::to_string(problem.size()) + " entries, expected 7");
        detlogp::GradFromLogitsInputs in;
        in.logits = view_of(array_arg(problem[0], "logits"), "logits", 2, true);
        const InArray targets = array_arg(problem[1], "targets");
        in.targets = view_of(targets, "targets", target_rank(targets, "targets"), false);
        in.temperature = temperature_arg(problem[2]);
        if (auto t = opt_view(opt_array_arg(problem[3], "temperature_rows"), "temperature_rows", 1))
          in.temperature_rows = *t;
        in.real_vocab = int64_arg(problem[4], "real_vocab");
        in.vocab_start = int64_arg(problem[5], "vocab_start");
        in.ignore_index = int64_arg(problem[6], "ignore_index");
        const detlogp::GradLogitsArgs args = grad_args(lse, g_logp, g_lse, entropy, g_entropy);
        const detlogp::MutableTensorView out{view_of(dz, "dz", 2, true)};
        detlogp::CallOptions opt = options("", false, stream);
        opt.defer_errors = defer_errors;
        return reported([&] { return detlogp::linear_logp_grad_from_logits(in, args, out, opt); });
      },
      "problem"_a, "lse"_a, "g_logp"_a.none(), "g_lse"_a.none(), "dz"_a, "stream"_a, "entropy"_a.none() = nb::none(),
      "g_entropy"_a.none() = nb::none(), "defer_errors"_a = false);

  // The owned merge over rank-ordered partials: ranks = [(summaries, target_logit, target_owned,
  // layout | None, usums | None, edge_logits | None)]; the library checks the layouts (and that each
  // rank's edge lanes fit its shard), and with `entropy` that every rank carries usums.
  m.def(
      "merge_partials",
      [](const std::vector<std::tuple<InArray, InArray, InArray, std::optional<Layout>, std::optional<InArray>,
                                      std::optional<InArray>, std::optional<InArray>, std::optional<InArray>>>& ranks,
         const InArray& targets, int64_t ignore_index, const OutArray& logp, const OutArray& lse,
         const std::string& backend, bool strict, uintptr_t stream, const std::optional<OutArray>& entropy,
         const std::optional<OutArray>& topk_ids, const std::optional<OutArray>& topk_logp) {
        std::vector<detlogp::ShardPartials> parts;
        for (size_t r = 0; r < ranks.size(); ++r) {
          const auto& [s, tl, own, layout, usums, edge, topk_logit, rank_topk_ids] = ranks[r];
          const std::string at = "rank " + std::to_string(r) + " ";
          parts.push_back(partials_of(s, tl, own, at));
          set_usums(parts.back(), usums, at);
          set_edge_logits(parts.back(), edge, at);
          set_topk(parts.back(), topk_logit, rank_topk_ids, at);
          parts.back().layout = layout_of(layout);
        }
        const detlogp::TensorView t = view_of(targets, "targets", target_rank(targets, "targets"), false);
        const detlogp::MutableTensorView lp = out_view(logp, "logp", target_rank(logp, "logp")),
                                         ls = out_view(lse, "lse", 1);
        detlogp::LinearLogpOutputs out{lp, ls, {}, {}, {}, {}};
        if (entropy) out.entropy = out_view(*entropy, "entropy", 1);
        if (topk_ids) out.topk_ids = out_view(*topk_ids, "topk_ids", 2);
        if (topk_logp) out.topk_logp = out_view(*topk_logp, "topk_logp", 2);
        const detlogp::CallOptions opt = options(backend, strict, stream);
        nb::gil_scoped_release release;
        detlogp::merge_partials(parts, t, ignore_index, out, opt);
      },
      "ranks"_a, "targets"_a, "ignore_index"_a, "logp"_a, "lse"_a, "backend"_a, "strict"_a, "stream"_a,
      "entropy"_a.none() = nb::none(), "topk_ids"_a.none() = nb::none(), "topk_logp"_a.none() = nb::none());

  // What one rank of a tensor-parallel call checks before any collective: the arrays (this
  // binding's checks), then a zero-row partials call with the rank's shard, whose report names
  // the backend that would serve it. Raises what the rank's call would raise; computes nothing.
  m.def(
      "tensor_parallel_local_check",
      [](const Problem& problem, const OutArray& logp, const OutArray& lse, const std::optional<OutArray>& logits,
         const std::string& backend, bool strict, const std::optional<OutArray>& entropy,
         const std::optional<OutArray>& topk_ids, const std::optional<OutArray>& topk_logp) {
        detlogp::LinearLogpInputs in = inputs(problem);
        const detlogp::LinearLogpOutputs out = outputs(logp, lse, logits);
        if (entropy) out_view(*entropy, "entropy", 1);  // this binding's checks of the arrays
        if (topk_ids) out_view(*topk_ids, "topk_ids", 2);
        if (topk_logp) out_view(*topk_logp, "topk_logp", 2);
        in.hidden = first_rows(in.hidden, 0);
        in.targets = first_rows(in.targets, 0);
        in.temperature_rows = first_rows(in.temperature_rows, 0);
        detlogp::ShardPartials none;
        none.targets_per_row = in.targets.ndim == 2 ? in.targets.cols : 1;
        // The geometry of a shard the check accepts (it checks the shard before the partials).
        const int64_t real_vocab = in.real_vocab < 0 ? in.vocab_start + in.weight.rows : in.real_vocab;
        if (in.weight.rows > 0 && in.vocab_start >= 0 && real_vocab > 0) {
          const detlogp::ShardGeometry g = detlogp::shard_geometry(in.vocab_start, in.weight.rows, real_vocab);
          none.tiles = g.tiles;
          none.edge_lanes = g.edge_lanes();
        }
        none.memory = in.hidden.memory;
        none.device = in.hidden.device;
        none.logits = {first_rows(out.logits, 0)};
        // Zero rows: never written, but non-null so the backend is asked for the entropy sums too.
        static float no_usums;
        if (entropy) none.usums = &no_usums;
        // The top-k lists' K, so that a backend without the top-k output refuses here, on every rank.
        if (topk_ids) none.topk = static_cast<int64_t>(topk_ids->shape(1));
        const detlogp::CallOptions opt = options(backend, strict, 0);
        return reported([&] { return detlogp::linear_logp_partials(in, none, opt); });
      },
      "problem"_a, "logp"_a, "lse"_a, "logits"_a.none(), "backend"_a, "strict"_a, "entropy"_a.none() = nb::none(),
      "topk_ids"_a.none() = nb::none(), "topk_logp"_a.none() = nb::none());

  // The C++ tensor-parallel operator (docs/tensor-parallel.md) over a Python all-gather:
  // gather(send, recv) as CallbackCommunicator describes; rank and size of this rank's group.
  m.def(
      "linear_logp_tensor_parallel",
      [](const Problem& problem, const OutArray& logp, const OutArray& lse, const std::optional<OutArray>& logits,
         const std::string& backend, bool strict, uintptr_t stream, int rank, int size, nb::callable gather,
         const std::optional<OutArray>& entropy, const std::optional<OutArray>& topk_ids,
         const std::optional<OutArray>& topk_logp) {
        const detlogp::LinearLogpInputs in = inputs(problem);
        detlogp::LinearLogpOutputs out = outputs(logp, lse, logits);
        if (entropy) out.entropy = out_view(*entropy, "entropy", 1);
        if (topk_ids) out.topk_ids = out_view(*topk_ids, "topk_ids", 2);
        if (topk_logp) out.topk_logp = out_view(*topk_logp, "topk_logp", 2);
        const detlogp::CallOptions opt = options(backend, strict, stream);
        CallbackCommunicator comm(rank, size, {in.hidden.memory, in.hidden.device}, std::move(gather));
        return reported([&] { return detlogp::linear_logp_tensor_parallel(in, out, comm, opt); });
      },
      "problem"_a, "logp"_a, "lse"_a, "logits"_a.none(), "backend"_a, "strict"_a, "stream"_a, "rank"_a, "size"_a,
      "gather"_a, "entropy"_a.none() = nb::none(), "topk_ids"_a.none() = nb::none(), "topk_logp"_a.none() = nb::none());

  // The sampling program's rollout (docs/contract.md §11): head = (hidden, weight, bias | None, real_vocab,
  // vocab_start), program as program_of, seed an int (used without seed_rows) and seed_rows [N] int64 | None,
  // key [N] int64; outputs token [N] i64, logp, logp_raw, lse [N] f32, support_size [N] i64, logits | None;
  // stream: the CUDA stream of CUDA arrays (0: the default stream).
  m.def(
      "sample",
      [](const nb::tuple& head, const nb::tuple& program, nb::handle seed, nb::handle seed_rows, nb::handle key,
         const OutArray& token, const OutArray& logp, const OutArray& logp_raw, const OutArray& lse,
         const OutArray& support_size, const std::optional<OutArray>& logits, const std::string& backend, bool strict,
         uintptr_t stream, const nb::object& tp_arg, bool check_only, const std::optional<OutArray>& topk_ids,
         const std::optional<OutArray>& topk_logp) {
        const SamplingTp tp(tp_arg);
        if (head.size() != 5) value_error("the head tuple has " + std::to_string(head.size()) + " entries, expected 5");
        detlogp::SampleInputs in;
        in.hidden = view_of(array_arg(head[0], "hidden"), "hidden", 2, true);
        in.weight = view_of(array_arg(head[1], "weight"), "weight", 2, true);
        if (auto b = opt_view(opt_array_arg(head[2], "bias"), "bias", 1)) in.bias = *b;
        in.real_vocab = int64_arg(head[3], "real_vocab");
        in.vocab_start = int64_arg(head[4], "vocab_start");
        in.program = program_of(program);
        in.seed = uint64_arg(seed, "seed");
        if (auto r = opt_view(opt_array_arg(seed_rows, "seed_rows"), "seed_rows", 1)) in.seed_rows = *r;
        in.key = view_of(array_arg(key, "key"), "key", 1, false);
        detlogp::SampleOutputs out;
        out.token = out_view(token, "token", 1);
        out.logp = out_view(logp, "logp", 1);
        out.logp_raw = out_view(logp_raw, "logp_raw", 1);
        out.lse = out_view(lse, "lse", 1);
        out.support_size = out_view(support_size, "support_size", 1);
        if (logits) out.logits = out_view(*logits, "logits", 2);
        if (topk_ids) out.topk_ids = out_view(*topk_ids, "topk_ids", 2);
        if (topk_logp) out.topk_logp = out_view(*topk_logp, "topk_logp", 2);
        const detlogp::CallOptions opt = options(backend, strict, stream);
        if (check_only) return nb::dict();
        if (!tp.on) return reported([&] { return detlogp::sample(in, out, opt); });
        CallbackCommunicator comm = tp.communicator(in.hidden);
        return reported([&] { return detlogp::sample_tensor_parallel(in, out, comm, opt); });
      },
      "head"_a, "program"_a, "seed"_a, "seed_rows"_a.none(), "key"_a, "token"_a, "logp"_a, "logp_raw"_a, "lse"_a,
      "support_size"_a, "logits"_a.none(), "backend"_a, "strict"_a, "stream"_a = 0, "tp"_a.none() = nb::none(),
      "check_only"_a = false, "topk_ids"_a.none() = nb::none(), "topk_logp"_a.none() = nb::none());

  // linear_logp replaying a sampling program: problem as linear_logp's (temperature 1, no rows: the
  // program's), outputs logp, logp_raw, lse [N] f32 and the optional lse_support, support_max, cut_logit
  // [N] f32, support_size, cut_id [N] i64. The report's "sampling" counts the targets outside the support.
  m.def(
      "linear_logp_sampled",
      [](const Problem& problem, const nb::tuple& program, const OutArray& logp, const OutArray& logp_raw,
         const OutArray& lse, const std::optional<OutArray>& lse_support, const std::optional<OutArray>& support_size,
         const std::optional<OutArray>& support_max, const std::optional<OutArray>& cut_logit,
         const std::optional<OutArray>& cut_id, const std::string& backend, bool strict, uintptr_t stream,
         const nb::object& tp_arg, bool check_only) {
        const SamplingTp tp(tp_arg);
        const detlogp::LinearLogpInputs in = inputs(problem);
        const detlogp::SamplingProgram prog = program_of(program);
        detlogp::SampledLogpOutputs out;
        out.logp = out_view(logp, "logp", 1);
        out.logp_raw = out_view(logp_raw, "logp_raw", 1);
        out.lse = out_view(lse, "lse", 1);
        out.lse_support = opt_out_view(lse_support, "lse_support");
        out.support_size = opt_out_view(support_size, "support_size");
        out.support_max = opt_out_view(support_max, "support_max");
        out.cut_logit = opt_out_view(cut_logit, "cut_logit");
        out.cut_id = opt_out_view(cut_id, "cut_id");
        const detlogp::CallOptions opt = options(backend, strict, stream);
        if (check_only) return nb::dict();
        if (!tp.on) return reported([&] { return detlogp::linear_logp(in, prog, out, opt); });
        CallbackCommunicator comm = tp.communicator(in.hidden);
        return reported([&] { return detlogp::linear_logp_tensor_parallel(in, prog, out, comm, opt); });
      },
      "problem"_a, "program"_a, "logp"_a, "logp_raw"_a, "lse"_a, "lse_support"_a.none(), "support_size"_a.none(),
      "support_max"_a.none(), "cut_logit"_a.none(), "cut_id"_a.none(), "backend"_a, "strict"_a, "stream"_a = 0,
      "tp"_a.none() = nb::none(), "check_only"_a = false);

  // The replay's logit gradient of one vocabulary chunk (detlogp.torch's backward with sampling=):
  // problem as linear_logp_grad_logits's, the program, the replay's outputs, the upstream gradients.
  m.def(
      "linear_logp_grad_logits_sampled",
      [](const Problem& problem, const nb::tuple& program, const InArray& logp, const InArray& lse,
         const InArray& lse_support, const InArray& support_max, const InArray& cut_logit, const InArray& cut_id,
         const std::optional<InArray>& g_logp, const std::optional<InArray>& g_lse,
         const std::optional<InArray>& g_logp_raw, const OutArray& dz, uintptr_t stream) {
        const detlogp::LinearLogpInputs in = inputs(problem);
        const detlogp::SamplingProgram prog = program_of(program);
        detlogp::SampledGradArgs args;
        args.logp = view_of(logp, "logp", 1, false);
        args.lse = view_of(lse, "lse", 1, false);
        args.lse_support = view_of(lse_support, "lse_support", 1, false);
        args.support_max = view_of(support_max, "support_max", 1, false);
        args.cut_logit = view_of(cut_logit, "cut_logit", 1, false);
        args.cut_id = view_of(cut_id, "cut_id", 1, false);
        if (auto g = opt_view(g_logp, "g_logp", 1)) args.g_logp = *g;
        if (auto g = opt_view(g_lse, "g_lse", 1)) args.g_lse = *g;
        if (auto g = opt_view(g_logp_raw, "g_logp_raw", 1)) args.g_logp_raw = *g;
        const detlogp::MutableTensorView out{view_of(dz, "dz", 2, true)};
        const detlogp::CallOptions opt = options("", false, stream);
        return reported([&] { return detlogp::linear_logp_grad_logits(in, prog, args, out, opt); });
      },
      "problem"_a, "program"_a, "logp"_a, "lse"_a, "lse_support"_a, "support_max"_a, "cut_logit"_a, "cut_id"_a,
      "g_logp"_a.none(), "g_lse"_a.none(), "g_logp_raw"_a.none(), "dz"_a, "stream"_a = 0);

  // The weight-version fingerprint of an lm_head given as its rank-ordered bf16 host shards.
  m.def(
      "weight_fingerprint",
      [](const nb::sequence& shards) {
        std::vector<InArray> arrays;
        std::vector<detlogp::TensorView> views;
        for (size_t r = 0; r < nb::len(shards); ++r) {
          const std::string name = "shards[" + std::to_string(r) + "]";
          arrays.push_back(array_arg(shards[r], name.c_str()));
          views.push_back(view_of(arrays.back(), name.c_str(), 2, true));
        }
        nb::gil_scoped_release release;
        return detlogp::io::weight_fingerprint(views);
      },
      "shards"_a);

  // The library's row-value checks alone (detlogp.torch's plain lane computes without it).
  m.def(
      "check_row_values",
      [](nb::handle targets, nb::handle real_vocab, nb::handle ignore_index, nb::handle temperature,
         nb::handle temperature_rows) {
        const InArray ta = array_arg(targets, "targets");
        const detlogp::TensorView t = view_of(ta, "targets", target_rank(ta, "targets"), false);
        const float temp = temperature_arg(temperature);
        detlogp::TensorView rows;
        if (auto r = opt_view(opt_array_arg(temperature_rows, "temperature_rows"), "temperature_rows", 1)) rows = *r;
        const int64_t rv = int64_arg(real_vocab, "real_vocab"), ii = int64_arg(ignore_index, "ignore_index");
        nb::gil_scoped_release release;
        detlogp::check_row_values(t, rv, ii, temp, rows);
      },
      "targets"_a, "real_vocab"_a, "ignore_index"_a, "temperature"_a, "temperature_rows"_a.none());

  m.def(
      "reduce_logits",
      [](nb::handle logits, nb::handle targets, nb::handle temperature, nb::handle temperature_rows,
         nb::handle real_vocab, nb::handle ignore_index, const OutArray& logp, const OutArray& lse,
         const std::optional<OutArray>& entropy) {
        detlogp::ReduceLogitsInputs in;
        in.logits = view_of(array_arg(logits, "logits"), "logits", 2, false);
        const InArray t = array_arg(targets, "targets");
        in.targets = view_of(t, "targets", target_rank(t, "targets"), false);
        in.temperature = temperature_arg(temperature);
        if (auto t = opt_view(opt_array_arg(temperature_rows, "temperature_rows"), "temperature_rows", 1))
          in.temperature_rows = *t;
        in.real_vocab = int64_arg(real_vocab, "real_vocab");
        in.ignore_index = int64_arg(ignore_index, "ignore_index");
        const detlogp::MutableTensorView lp = out_view(logp, "logp", target_rank(logp, "logp")),
                                         ls = out_view(lse, "lse", 1);
        const detlogp::MutableTensorView h = entropy ? out_view(*entropy, "entropy", 1) : detlogp::MutableTensorView{};
        nb::gil_scoped_release release;
        detlogp::reduce_logits(in, lp, ls, h);
      },
      "logits"_a, "targets"_a, "temperature"_a, "temperature_rows"_a.none(), "real_vocab"_a, "ignore_index"_a, "logp"_a,
      "lse"_a, "entropy"_a.none() = nb::none());
}

// detlogp._detlogp: the Python extension. Arrays cross through DLPack (numpy arrays, torch CPU and
// CUDA tensors alike, never copied); outputs are allocated by the caller (python/detlogp), so the
// C++ library never owns Python memory. No torch headers: the CUDA stream arrives as an integer.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "detlogp/detlogp.hpp"

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
  const char* code = "?";
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Int:
      code = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      code = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      code = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      code = "bfloat";
      break;
    case nb::dlpack::dtype_code::Bool:
      code = "bool";
      break;
    default:
      break;
  }
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
  if (static_cast<int>(a.ndim()) != ndim)
    value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " + std::to_string(a.ndim()) + "-D");
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
    v.row_stride = v.rows > 1 ? a.stride(0) : v.cols;
    if (v.row_stride < v.cols)
      value_error(std::string(name) + " row stride " + std::to_string(v.row_stride) + " is smaller than its " +
                  std::to_string(v.cols) + " columns");
  }
  return v;
}

detlogp::MutableTensorView out_view(const OutArray& a, const char* name, int ndim) {
  return {view_of(a, name, ndim, false)};
}

std::optional<detlogp::TensorView> opt_view(const std::optional<InArray>& a, const char* name, int ndim) {
  if (!a) return std::nullopt;
  return view_of(*a, name, ndim, false);
}

nb::dict provenance_dict(const detlogp::Provenance& p) {
  nb::dict d;
  d["contract_name"] = p.contract_name;
  d["contract_version"] = p.contract_version;
  d["backend_id"] = p.backend_id;
  d["arch"] = p.arch;
  d["cc"] = p.cc;
  d["vocab_tile"] = p.vocab_tile;
  d["k_slab"] = p.k_slab;
  d["n_split_policy"] = p.n_split_policy;
  d["tree_id"] = p.tree_id;
  d["transcendental_id"] = p.transcendental_id;
  d["temperature_id"] = p.temperature_id;
  d["string"] = detlogp::to_string(p);
  return d;
}

nb::dict report_dict(const detlogp::CallReport& r) {
  nb::dict d;
  d["requested_backend"] = r.requested_backend;
  d["strict"] = r.strict;
  d["fallback"] = r.fallback;
  d["fallback_reason"] = r.fallback_reason;
  d["backend_id"] = r.provenance.backend_id;
  d["contract"] = r.provenance.contract_version > 0;
  d["provenance"] = provenance_dict(r.provenance);
  return d;
}

detlogp::CallOptions options(const std::string& backend, bool strict, uintptr_t stream) {
  detlogp::CallOptions o;
  o.backend = backend;
  o.strict = strict;
  o.cuda_stream = reinterpret_cast<void*>(stream);
  return o;
}

detlogp::LinearLogpInputs inputs(const InArray& hidden, const InArray& weight, const InArray& targets,
                                 const std::optional<InArray>& bias, float temperature,
                                 const std::optional<InArray>& temperature_rows, int64_t real_vocab,
                                 int64_t vocab_start, int64_t ignore_index) {
  detlogp::LinearLogpInputs in;
  in.hidden = view_of(hidden, "hidden", 2, true);
  in.weight = view_of(weight, "weight", 2, true);
  in.targets = view_of(targets, "targets", 1, false);
  if (auto b = opt_view(bias, "bias", 1)) in.bias = *b;
  in.temperature = temperature;
  if (auto t = opt_view(temperature_rows, "temperature_rows", 1)) in.temperature_rows = *t;
  in.real_vocab = real_vocab;
  in.vocab_start = vocab_start;
  in.ignore_index = ignore_index;
  return in;
}

// Python exception class for a detlogp::Error. The C++ messages name the argument; the class is
// chosen from what the message is about (the tests pin one real message of every class).
const char* error_class(const std::string& what) {
  std::string m = what;
  const std::string prefix = "detlogp error at ";
  if (m.rfind(prefix, 0) == 0) {
    const size_t colon = m.find(": ");
    if (colon != std::string::npos) m = m.substr(colon + 2);
  }
  auto has = [&](const char* s) { return m.find(s) != std::string::npos; };
  if (has("strict mode")) return "StrictModeError";
  if (m.rfind("targets[", 0) == 0) return "TargetIndexError";
  if (has("environment variable") || m.rfind("DETLOGP_", 0) == 0) return "ConfigError";
  if (has("unavailable") || has("CUDA call failed") || has("could not allocate") || has("compute capability") ||
      has("unknown status") || has("cuTensorMapEncode") || has("driver entry point"))
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

}  // namespace

NB_MODULE(_detlogp, m) {
  m.doc() = "detlogp C++ core (use the detlogp package, not this module directly)";
  nb::register_exception_translator(translate);

  m.def("version", &detlogp::version_string);
  m.def("check_environment", &detlogp::check_environment);
  m.def("shard_tiles", &detlogp::shard_tiles, "vocab_local"_a);
  m.def(
      "error_class", [](const std::string& msg) { return std::string(error_class(msg)); }, "message"_a);

  m.def("contract", [] {
    nb::dict d;
    d["contract_name"] = detlogp::kContractName;
    d["contract_version"] = detlogp::kContractVersion;
    d["vocab_tile"] = detlogp::kVocabTile;
    d["k_slab"] = detlogp::kKSlab;
    d["tree_id"] = detlogp::kTreeId;
    d["transcendental_id"] = detlogp::kTranscendentalId;
    d["n_split_policy"] = detlogp::kNSplitPolicy;
    d["temperature_id"] = detlogp::kTemperatureId;
    d["default_ignore_index"] = detlogp::kDefaultIgnoreIndex;
    return d;
  });

  m.def("list_backends", [] {
    nb::list out;
    for (const detlogp::BackendInfo& b : detlogp::list_backends()) {
      nb::dict d;
      d["id"] = b.id;
      d["contract"] = b.contract_bearing;
      d["available"] = b.available;
      d["detail"] = b.detail;
      d["memory"] = b.memory == detlogp::Memory::host ? "host" : "cuda";
      d["provenance"] = provenance_dict(b.provenance);
      out.append(d);
    }
    return out;
  });

  m.def(
      "linear_logp",
      [](const InArray& hidden, const InArray& weight, const InArray& targets, const std::optional<InArray>& bias,
         float temperature, const std::optional<InArray>& temperature_rows, int64_t real_vocab, int64_t vocab_start,
         int64_t ignore_index, const OutArray& logp, const OutArray& lse, const std::optional<OutArray>& logits,
         const std::string& backend, bool strict, uintptr_t stream) {
        const detlogp::LinearLogpInputs in =
            inputs(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index);
        detlogp::LinearLogpOutputs out{out_view(logp, "logp", 1), out_view(lse, "lse", 1), {}};
        if (logits) out.logits = out_view(*logits, "logits", 2);
        const detlogp::CallOptions opt = options(backend, strict, stream);
        detlogp::CallReport r;
        {
          nb::gil_scoped_release release;
          r = detlogp::linear_logp(in, out, opt);
        }
        return report_dict(r);
      },
      "hidden"_a, "weight"_a, "targets"_a, "bias"_a.none(), "temperature"_a, "temperature_rows"_a.none(),
      "real_vocab"_a, "vocab_start"_a, "ignore_index"_a, "logp"_a, "lse"_a, "logits"_a.none(), "backend"_a, "strict"_a,
      "stream"_a);

  // Partials of one vocabulary shard: summaries [N, tiles, 2] f32 (max, sum), target_logit [N] f32,
  // target_owned [N] u8, optional logits [N, V_local] f32 (the serving entry).
  m.def(
      "linear_logp_partials",
      [](const InArray& hidden, const InArray& weight, const InArray& targets, const std::optional<InArray>& bias,
         float temperature, const std::optional<InArray>& temperature_rows, int64_t real_vocab, int64_t vocab_start,
         int64_t ignore_index, const OutArray& summaries, const OutArray& target_logit, const OutArray& target_owned,
         const std::optional<OutArray>& logits, const std::string& backend, bool strict, uintptr_t stream) {
        const detlogp::LinearLogpInputs in =
            inputs(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index);
        detlogp::ShardPartials p;
        p.rows = in.hidden.rows;
        // Validated here because ShardPartials carries raw pointers, not views.
        if (summaries.ndim() != 3 || summaries.shape(2) != 2 || static_cast<int64_t>(summaries.shape(0)) != p.rows)
          value_error("summaries must be [N=" + std::to_string(p.rows) + ", tiles, 2]");
        if (dtype_of(summaries.dtype(), "summaries", false) != detlogp::DType::f32)
          value_error("summaries must be float32");
        const Placement pl = placement_of(summaries.device_type(), summaries.device_id(), "summaries");
        p.tiles = static_cast<int64_t>(summaries.shape(1));
        if (p.rows * p.tiles > 0 && (summaries.stride(2) != 1 || summaries.stride(1) != 2 ||
                                     (p.rows > 1 && summaries.stride(0) != 2 * p.tiles)))
          value_error("summaries must be contiguous");
        const detlogp::MutableTensorView tl = out_view(target_logit, "target_logit", 1);
        if (tl.dtype != detlogp::DType::f32 || tl.rows != p.rows || tl.memory != pl.memory)
          value_error("target_logit must be [N] float32 in the memory of summaries");
        if (target_owned.ndim() != 1 || static_cast<int64_t>(target_owned.shape(0)) != p.rows ||
            target_owned.dtype() != nb::dtype<uint8_t>() ||
            placement_of(target_owned.device_type(), target_owned.device_id(), "target_owned").memory != pl.memory)
          value_error("target_owned must be [N] uint8 in the memory of summaries");
        p.summaries = static_cast<detlogp::TileSummary*>(summaries.data());
        p.target_logit = static_cast<float*>(target_logit.data());
        p.target_owned = static_cast<uint8_t*>(target_owned.data());
        p.memory = pl.memory;
        p.device = pl.device;
        if (logits) p.logits = out_view(*logits, "logits", 2);
        const detlogp::CallOptions opt = options(backend, strict, stream);
        detlogp::CallReport r;
        {
          nb::gil_scoped_release release;
          r = detlogp::linear_logp_partials(in, p, opt);
        }
        return report_dict(r);
      },
      "hidden"_a, "weight"_a, "targets"_a, "bias"_a.none(), "temperature"_a, "temperature_rows"_a.none(),
      "real_vocab"_a, "vocab_start"_a, "ignore_index"_a, "summaries"_a, "target_logit"_a, "target_owned"_a,
      "logits"_a.none(), "backend"_a, "strict"_a, "stream"_a);

  // The logit gradient of one vocabulary chunk (detlogp.torch's fused backward): weight is the
  // chunk [C, D] starting at global id vocab_start, dz [N, C] bf16 (row stride >= C) is written.
  m.def(
      "linear_logp_grad_logits",
      [](const InArray& hidden, const InArray& weight, const InArray& targets, const std::optional<InArray>& bias,
         float temperature, const std::optional<InArray>& temperature_rows, int64_t real_vocab, int64_t vocab_start,
         int64_t ignore_index, const InArray& lse, const std::optional<InArray>& g_logp,
         const std::optional<InArray>& g_lse, const OutArray& dz, uintptr_t stream) {
        const detlogp::LinearLogpInputs in =
            inputs(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index);
        detlogp::GradLogitsArgs args;
        args.lse = view_of(lse, "lse", 1, false);
        if (auto g = opt_view(g_logp, "g_logp", 1)) args.g_logp = *g;
        if (auto g = opt_view(g_lse, "g_lse", 1)) args.g_lse = *g;
        const detlogp::MutableTensorView out{view_of(dz, "dz", 2, true)};
        const detlogp::CallOptions opt = options("", false, stream);
        detlogp::CallReport r;
        {
          nb::gil_scoped_release release;
          r = detlogp::linear_logp_grad_logits(in, args, out, opt);
        }
        return report_dict(r);
      },
      "hidden"_a, "weight"_a, "targets"_a, "bias"_a.none(), "temperature"_a, "temperature_rows"_a.none(),
      "real_vocab"_a, "vocab_start"_a, "ignore_index"_a, "lse"_a, "g_logp"_a.none(), "g_lse"_a.none(), "dz"_a,
      "stream"_a);

  // The owned merge over rank-ordered partials: ranks = [(summaries, target_logit, target_owned)].
  m.def(
      "merge_partials",
      [](const std::vector<std::tuple<InArray, InArray, InArray>>& ranks, const InArray& targets, int64_t ignore_index,
         const OutArray& logp, const OutArray& lse, const std::string& backend, bool strict, uintptr_t stream) {
        std::vector<detlogp::ShardPartials> parts;
        for (size_t r = 0; r < ranks.size(); ++r) {
          const auto& [s, tl, own] = ranks[r];
          const std::string at = "rank " + std::to_string(r) + " ";
          if (s.ndim() != 3 || s.shape(2) != 2 || s.dtype() != nb::dtype<float>())
            value_error(at + "summaries must be [N, tiles, 2] float32");
          if (tl.ndim() != 1 || tl.dtype() != nb::dtype<float>() || own.ndim() != 1 ||
              own.dtype() != nb::dtype<uint8_t>() || tl.shape(0) != s.shape(0) || own.shape(0) != s.shape(0))
            value_error(at + "target_logit must be [N] float32 and target_owned [N] uint8");
          detlogp::ShardPartials p;
          p.rows = static_cast<int64_t>(s.shape(0));
          p.tiles = static_cast<int64_t>(s.shape(1));
          if (p.rows * p.tiles > 0 &&
              (s.stride(2) != 1 || s.stride(1) != 2 || (p.rows > 1 && s.stride(0) != 2 * p.tiles)))
            value_error(at + "summaries must be contiguous");
          if ((p.rows > 1 && (tl.stride(0) != 1 || own.stride(0) != 1)))
            value_error(at + "target_logit and target_owned must be contiguous");
          const Placement pl = placement_of(s.device_type(), s.device_id(), "summaries");
          for (const Placement q : {placement_of(tl.device_type(), tl.device_id(), "target_logit"),
                                    placement_of(own.device_type(), own.device_id(), "target_owned")})
            if (q.memory != pl.memory || q.device != pl.device)
              value_error(at + "partials must all live in one memory");
          p.summaries = const_cast<detlogp::TileSummary*>(static_cast<const detlogp::TileSummary*>(s.data()));
          p.target_logit = const_cast<float*>(static_cast<const float*>(tl.data()));
          p.target_owned = const_cast<uint8_t*>(static_cast<const uint8_t*>(own.data()));
          p.memory = pl.memory;
          p.device = pl.device;
          parts.push_back(p);
        }
        const detlogp::TensorView t = view_of(targets, "targets", 1, false);
        const detlogp::MutableTensorView lp = out_view(logp, "logp", 1), ls = out_view(lse, "lse", 1);
        const detlogp::CallOptions opt = options(backend, strict, stream);
        nb::gil_scoped_release release;
        detlogp::merge_partials(parts, t, ignore_index, lp, ls, opt);
      },
      "ranks"_a, "targets"_a, "ignore_index"_a, "logp"_a, "lse"_a, "backend"_a, "strict"_a, "stream"_a);

  m.def(
      "reduce_logits",
      [](const InArray& logits, const InArray& targets, float temperature,
         const std::optional<InArray>& temperature_rows, int64_t real_vocab, int64_t ignore_index, const OutArray& logp,
         const OutArray& lse) {
        detlogp::ReduceLogitsInputs in;
        in.logits = view_of(logits, "logits", 2, false);
        in.targets = view_of(targets, "targets", 1, false);
        in.temperature = temperature;
        if (auto t = opt_view(temperature_rows, "temperature_rows", 1)) in.temperature_rows = *t;
        in.real_vocab = real_vocab;
        in.ignore_index = ignore_index;
        const detlogp::MutableTensorView lp = out_view(logp, "logp", 1), ls = out_view(lse, "lse", 1);
        nb::gil_scoped_release release;
        detlogp::reduce_logits(in, lp, ls);
      },
      "logits"_a, "targets"_a, "temperature"_a, "temperature_rows"_a.none(), "real_vocab"_a, "ignore_index"_a, "logp"_a,
      "lse"_a);
}

"""detlogp: per-token log-probabilities straight from hidden states and the lm_head weight, fused
and bitwise deterministic (docs/contract.md).

This module is the array-level API (numpy arrays, or anything host-resident with DLPack);
``detlogp.torch`` is the PyTorch operator with autograd. bf16 arrays without a bf16 dtype (numpy)
are passed as uint16/int16 bit patterns: see ``to_bf16_bits``.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from . import _detlogp as _ext
from . import _sampling
from ._errors import (
    BackendError,
    ConfigError,
    DetlogpError,
    InputError,
    NotImplementedYetError,
    StrictModeError,
    TargetIndexError,
)
from ._sampling import SampleResult, SamplingParams

__all__ = [
    "BackendError",
    "ConfigError",
    "DetlogpError",
    "InputError",
    "NotImplementedYetError",
    "StrictModeError",
    "TargetIndexError",
    "TORCH_BACKEND_ID",
    "Partials",
    "PartialsLayout",
    "ShardGeometry",
    "Result",
    "SampleResult",
    "SamplingParams",
    "backends",
    "contract",
    "from_bf16_bits",
    "linear_logp",
    "linear_logp_partials",
    "merge_partials",
    "provenance",
    "reduce_logits",
    "sample",
    "shard_geometry",
    "shard_tiles",
    "strict_from_env",
    "to_bf16_bits",
    "weight_fingerprint",
]

__version__ = _ext.version()

# The plain-PyTorch lane of detlogp.torch (F.linear + log_softmax): not contract-bearing.
TORCH_BACKEND_ID = "torch-materialized-noncontract"


class Result(NamedTuple):
    logp: Any
    lse: Any
    logits: Any  # None on the trainer entry
    report: dict  # which backend served the call, with its provenance
    entropy: Any = None  # [N] f32 with return_entropy=True (docs/contract.md §10), else None
    # With sampling= (docs/contract.md §11): logp is the processed logp of the targets (-inf outside the
    # support, counted in report["sampling"]), lse linear_logp's, and these three are filled.
    logp_raw: Any = None  # [N] f32: linear_logp's logp of the targets at the program's T (T = 0: at 1)
    lse_support: Any = None  # [N] f32: the support's log-normalizer
    support_size: Any = None  # [N] int64
    topk_ids: Any = None  # [N, K] int64 with topk=K: the K real ids of the largest logits (docs/contract.md §12)
    topk_logp: Any = None  # [N, K] f32 with topk=K: their logp, each a single-target call's bits


class PartialsLayout(NamedTuple):
    """What one shard's partials were computed for (the C++ PartialsLayout); merge_partials checks
    it. Keep it with the arrays when partials travel (gathered, or stored in a file)."""

    vocab_start: int
    vocab_local: int
    real_vocab: int
    ignore_index: int
    targets_digest: int  # the N targets as int64 values
    temperature_digest: int  # the temperatures in effect: the scalar, or the N row temperatures
    backend_digest: int  # the serving backend: id, contract, arch and its frozen ids


class ShardGeometry(NamedTuple):
    """Where a vocabulary shard's partials sit among the global 64-lane tiles (the C++
    ShardGeometry, docs/contract.md §7): its local columns are [0, head_cols) before its first
    whole tile (the first head_lanes of them real), then whole tiles first_tile ..
    first_tile + tiles - 1 (whole_cols columns), then tail_lanes columns of a tile that goes on past
    the shard. A 64-aligned shard has no edge lanes."""

    first_tile: int
    tiles: int
    head_cols: int
    head_lanes: int
    whole_cols: int
    tail_lanes: int

    @property
    def edge_lanes(self) -> int:
        return self.head_lanes + self.tail_lanes


class Partials(NamedTuple):
    summaries: Any  # [N, tiles, 2] float32: (max, sum) of each of the shard's whole global tiles
    target_logit: Any  # [N] ([N, K]) float32: scaled target logit where the shard owns the target, else +0
    target_owned: Any  # [N] ([N, K]) uint8
    logits: Any  # [N, V_local] float32 on the serving entry, else None
    report: dict
    layout: PartialsLayout
    usums: Any = None  # [N, tiles] float32 with return_entropy=True: the tiles' entropy sums u_g, else None
    # [N, edge_lanes] float32: the scaled logits of the shard's lanes in the tiles that straddle its
    # boundaries (head lanes, then tail lanes; shard_geometry), which the merge assembles; [N, 0] for
    # a 64-aligned shard.
    edge_logits: Any = None
    topk_logit: Any = None  # [N, K] float32 with topk=K: the shard's K largest scaled logits, in top-k order
    topk_ids: Any = None  # [N, K] int64 with topk=K: their ids; -1 past the shard's real ids


def contract() -> dict:
    """The frozen constants of the numeric contract this build implements."""
    return _ext.contract()


def strict_from_env() -> bool:
    """DETLOGP_STRICT=1 switches strict mode on for every call (checked like the C++ library)."""
    _ext.check_environment()
    return os.environ.get("DETLOGP_STRICT", "0") == "1"


def _resolve_strict(strict: Optional[bool]) -> bool:
    env = strict_from_env()
    return env if strict is None else bool(strict) or env


def backends() -> list:
    """Every backend of this build (C++ lanes and the plain-PyTorch lane), contract-bearing or not,
    available here or why not."""
    out = list(_ext.list_backends())
    try:
        import torch  # noqa: F401

        torch_ok, why = True, "torch " + torch.__version__
    except ImportError:
        torch_ok, why = False, "torch is not installed"
    out.append(
        {
            "id": TORCH_BACKEND_ID,
            "contract": False,
            "available": torch_ok,
            "detail": why,
            "memory": "host or cuda",
            "provenance": _noncontract_provenance(TORCH_BACKEND_ID),
            "multi_targets": torch_ok,
            "topk": torch_ok,
        }
    )
    return out


def _noncontract_provenance(backend_id: str) -> dict:
    return {
        "contract_name": "none",
        "contract_version": 0,
        "backend_id": backend_id,
        "arch": "torch",
        "cc": 0,
        "vocab_tile": 0,
        "k_slab": 0,
        "n_split_policy": "",
        "tree_id": "",
        "transcendental_id": "",
        "temperature_id": "",
        "entropy_id": "",
        "sample_id": "",
        "string": f"contract=none backend={backend_id}",
    }


def provenance(backend: Optional[str] = None, strict: Optional[bool] = None) -> dict:
    """Readback, not a guess: runs a 1x1x1 host problem with the given backend (None: the
    DETLOGP_BACKEND environment, else auto) and returns that call's report (served backend,
    fallback, full provenance). Raises StrictModeError where strict mode refuses the backend."""
    h = np.zeros((1, 1), np.uint16)
    t = np.zeros(1, np.int64)
    return linear_logp(h, h, t, backend=backend, strict=strict).report


def shard_tiles(vocab_local: int) -> int:
    """Number of 64-wide global vocabulary tiles a 64-aligned shard of vocab_local rows spans (any
    shard: shard_geometry(...).tiles)."""
    return _ext.shard_tiles(vocab_local)


def shard_geometry(vocab_start: int, vocab_local: int, real_vocab: int) -> ShardGeometry:
    """The whole tiles and edge lanes of the shard [vocab_start, vocab_start + vocab_local) of a
    vocabulary of real_vocab real ids: the sizes of its partials (docs/tensor-parallel.md)."""
    return ShardGeometry(*_ext.shard_geometry(_int_arg(vocab_start, "vocab_start"),
                                              _int_arg(vocab_local, "vocab_local"),
                                              _int_arg(real_vocab, "real_vocab")))  # fmt: skip


def to_bf16_bits(x) -> np.ndarray:
    """float32 (or float64, rounded to float32 first) values -> bf16 bit patterns (uint16), the
    library's rounding: to nearest even, every NaN -> the canonical quiet NaN 0x7FC0. The inverse
    is from_bf16_bits."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    out = np.empty(f.shape, np.uint16)
    _ext.bf16_round(f.reshape(-1), out.reshape(-1))
    return out


def from_bf16_bits(b) -> np.ndarray:
    """bf16 bit patterns (uint16/int16) -> float32 values (exact)."""
    u = np.ascontiguousarray(np.asarray(b)).view(np.uint16)
    out = np.empty(u.shape, np.float32)
    _ext.bf16_to_float(u.reshape(-1), out.reshape(-1))
    return out


def weight_fingerprint(weight) -> str:
    """The weight-version fingerprint of an lm_head (docs/validation.md, section 3): the hex SHA-256
    of a header naming its shape and its row-major bf16 bytes. weight: one bf16 host matrix [V, D]
    (uint16 bit patterns for numpy), or a list of its vocabulary shards in rank order, which give the
    whole head's value. detlogp.torch.weight_fingerprint takes torch tensors on any device."""
    shards = list(weight) if isinstance(weight, (list, tuple)) else [weight]
    if not shards:
        raise InputError("weight_fingerprint needs at least one shard")
    return _ext.weight_fingerprint([_host_array(s, f"shards[{i}]") for i, s in enumerate(shards)])


# DLPack device types (dlpack.h) the extension takes: kDLCPU, kDLCUDA, kDLCUDAHost.
_DLPACK_DEVICES = (1, 2, 3)


def _host_array(x, name: str):
    """An array argument of the array API as the extension takes it (numpy, or anything with
    __dlpack__), refused here where the extension could only say that no overload matched."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "OUSVMm":  # object, strings, void, datetimes: no DLPack form
            raise InputError(f"{name} has dtype {x.dtype}, which detlogp does not take here")
        return x
    if not hasattr(x, "__dlpack__"):
        raise InputError(f"{name} must be an array (numpy, or anything with __dlpack__), got {_what(x)}")
    if getattr(x, "requires_grad", False):
        raise InputError(
            f"{name} requires grad; the array API has no autograd (use detlogp.torch.linear_logp, or pass {name}.detach())"
        )
    try:
        device_type = int(x.__dlpack_device__()[0])
    except Exception:  # noqa: BLE001 - the exporter cannot describe its device (e.g. torch meta tensors)
        device_type = None
    if device_type not in _DLPACK_DEVICES:
        where = getattr(x, "device", f"DLPack device type {device_type}")
        raise InputError(f"{name} lives on {where}; detlogp takes host (CPU) and CUDA memory only")
    return x


def _leading(x) -> int:
    """Rows of an array argument (0 for a 0-d one: the extension then names its rank)."""
    shape = getattr(x, "shape", ())
    return int(shape[0]) if len(shape) > 0 else 0


# --- the argument rules every Python face shares (docs/python.md, "Accepted inputs") -----------

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _dtype_facts(dtype):
    """(name, floating, float32) of a numpy or torch dtype; names without the torch. prefix."""
    if isinstance(dtype, np.dtype):
        return str(dtype), dtype.kind == "f", dtype == np.float32
    name = str(dtype).rpartition(".")[2]
    return name, bool(getattr(dtype, "is_floating_point", False)), name == "float32"


def _shown(text: str) -> str:
    """A value as a message shows it: at most 40 characters."""
    return text if len(text) <= 40 else text[:37] + "..."


def _what(x) -> str:
    """What a refused argument is, for the message: None, bool True, str '0.7', shape [1] dtype
    float64, list, ..."""
    if x is None:
        return "None"
    if isinstance(x, (bool, np.bool_)):
        return f"bool {bool(x)}"
    if isinstance(x, (str, bytes)):
        return f"{type(x).__name__} {_shown(repr(x))}"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"shape {list(shape)} dtype {_dtype_facts(dtype)[0]}"
    if isinstance(x, numbers.Number):
        return f"{type(x).__name__} {_shown(repr(x))}"
    return type(x).__name__


def _int_arg(value, name: str) -> int:
    """An integer argument (ignore_index, vocab_start, real_vocab): an int or anything with
    __index__ (numpy integers, 0-d integer arrays and tensors), not bool, within int64. The extension
    checks the same in the same words; the torch face's custom ops would refuse an int beyond int64
    in torch's words before the extension sees it, hence the range check here too."""
    if type(value) is int and _INT64_MIN <= value <= _INT64_MAX:  # the common case, with nothing to convert
        return value
    dtype = getattr(value, "dtype", None)
    if isinstance(value, (bool, np.bool_)) or (dtype is not None and _dtype_facts(dtype)[0] == "bool"):
        raise InputError(f"{name} must be an integer, got {_what(value)}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be an integer, got {_what(value)}") from None
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise InputError(f"{name}={_shown(str(v))} is outside the int64 range [-2^63, 2^63 - 1]")
    return v


def _scalar_temperature(value) -> float:
    """A scalar temperature as the Python float the extension takes: it rounds it to float32 and
    refuses, naming this value, one that the rounding would turn into 0 or inf (the valid range is
    the library's check)."""
    try:
        return float(value)
    except OverflowError:  # an int beyond the double range
        raise InputError(
            f"temperature={_shown(repr(value))} is not representable as float32 (it would round to inf)"
        ) from None


def _split_temperature(temperature, rows: int, shape=None, tensor_type=None, rows_any_float: bool = False):
    """The temperature rules of every Python face, in one place. Returns (scalar, None) or
    (1.0, per_row) where per_row is the caller's array.

    - a Python int or float, or a numpy integer or floating scalar (bool refused): the scalar;
    - a 0-d floating array or tensor: the scalar, read on the host; a 0-d instance of tensor_type
      (the torch face's torch.Tensor) is returned as per_row instead, for the face to expand to
      every row inside its graph (differentiable, never read on the host);
    - an array of `shape` (default [rows]) and dtype float32 (any floating dtype where
      rows_any_float): per_row, with no broadcast (a [1] array for N != 1 is refused) and no cast;
      the torch face takes only tensor_type there;
    - anything else is refused, naming what was given."""
    if type(temperature) is float:  # the common case: the Python float itself
        return temperature, None
    shape = [rows] if shape is None else list(shape)
    forms = f"a float, a 0-d floating array or a float32 array of shape {shape}"
    if isinstance(temperature, (bool, np.bool_)):
        raise InputError(f"temperature must be {forms}, got {_what(temperature)}")
    if isinstance(temperature, (np.integer, np.floating)) or (
        isinstance(temperature, numbers.Real) and not hasattr(temperature, "shape")
    ):
        return _scalar_temperature(temperature), None
    dims, dtype = getattr(temperature, "shape", None), getattr(temperature, "dtype", None)
    if dims is None or dtype is None or not (isinstance(temperature, np.ndarray) or hasattr(temperature, "__dlpack__")):
        raise InputError(f"temperature must be {forms}, got {_what(temperature)}")
    dtype_name, floating, float32 = _dtype_facts(dtype)
    if len(dims) == 0:
        if not floating:
            raise InputError(f"temperature must be {forms}, got {_what(temperature)}")
        if tensor_type is not None and isinstance(temperature, tensor_type):
            return 1.0, temperature
        return _scalar_temperature(temperature.item()), None
    if list(dims) != shape:
        hint = ""
        if math.prod(dims) == 1:
            hint = " (one value per row, no broadcast: pass a float for one temperature of every row)"
        raise InputError(f"temperature must be {forms}, got {_what(temperature)}{hint}")
    if not (float32 or (rows_any_float and floating)):
        raise InputError(f"temperature of shape {shape} must be float32, got {dtype_name} (no silent cast)")
    if tensor_type is not None and not isinstance(temperature, tensor_type):
        raise InputError(
            f"temperature of shape {shape} must be a {tensor_type.__module__}.{tensor_type.__name__} here, got {type(temperature).__name__}"
        )
    return 1.0, temperature


def _backend_arg(backend: Optional[str]) -> str:
    if backend is not None and not isinstance(backend, str):
        raise InputError(f"backend must be a backend id (str) or None, got {_what(backend)}")
    if backend == TORCH_BACKEND_ID:
        raise InputError(f"backend '{TORCH_BACKEND_ID}' is served by detlogp.torch.linear_logp, not the array API")
    return backend or ""


def _per_target(targets, rows: int):
    """The shape of what is shaped like the targets (logp, the partials' target logits): [N] for
    [N] targets, [N, K] for K ids a row."""
    shape = getattr(targets, "shape", ())
    return (rows, int(shape[1])) if len(shape) == 2 else rows


def _problem(hidden, weight, targets, bias, temperature, ignore_index, vocab_start, real_vocab):
    """The extension's problem tuple of one call and its row count."""
    hidden, weight, targets = (
        _host_array(a, n) for a, n in ((hidden, "hidden"), (weight, "weight"), (targets, "targets"))
    )
    bias = None if bias is None else _host_array(bias, "bias")
    rows = _leading(hidden)
    temp, temp_rows = _split_temperature(temperature, rows)
    rv = -1 if real_vocab is None else _int_arg(real_vocab, "real_vocab")
    starts = _int_arg(vocab_start, "vocab_start")
    return (hidden, weight, targets, bias, temp, temp_rows, rv, starts, _int_arg(ignore_index, "ignore_index")), rows


def linear_logp(hidden, weight, targets, bias=None, temperature=1.0, ignore_index: int = -100,
                return_logits: bool = False, vocab_start: int = 0, real_vocab: Optional[int] = None,
                backend: Optional[str] = None, strict: Optional[bool] = None,
                return_entropy: bool = False, sampling: Optional[SamplingParams] = None,
                topk: Optional[int] = None) -> Result:  # fmt: skip
    """logp[n] = y_t - logsumexp(y), y = (h.W^T + b) / T, over the whole real vocabulary.

    hidden [N, D] and weight [V, D] are bf16 (uint16 bit patterns for numpy), targets [N] int32 or
    int64 (or [N, K], K <= 64: K ids a row, logp [N, K], each entry the bits of a call with that
    single target; one pass over the vocabulary), bias [V] float32, temperature a float (or a 0-d floating array) or a [N] float32 array
    (docs/python.md, "Accepted inputs"). Returns
    Result(logp [N] f32, lse [N] f32, logits [N, V] f32 or None, report, entropy [N] f32 or None).
    return_entropy: each row's entropy -sum p log p in the same pass (docs/contract.md §10); served
    by the backends whose provenance names an entropy_id (the CPU backend today), refused by the
    others. topk=K (1 <= K <= 128): also topk_ids [N, K] int64, the K real ids of the largest
    scaled logits (the larger first, equal ones by the lower id), and topk_logp [N, K] their logp,
    from the same pass (docs/contract.md §12; the CPU backend).

    sampling: a SamplingParams replaying the rollout's program (docs/contract.md §11): Result.logp is
    then the targets' log-probability under the processed (filtered, renormalized) distribution, the
    bits detlogp.sample recorded for that token; -inf for a target outside the support, counted in
    report["sampling"]["outside_support"]. Result.logp_raw and Result.lse are the plain call's bits at
    the program's temperature (temperature= stays 1.0: the program's is used), lse_support and
    support_size describe the support. Not with return_logits, return_entropy or topk."""
    if sampling is not None:
        if topk is not None:
            raise InputError("topk= is not taken with sampling= (the replay scores the given targets)")
        return _linear_logp_sampled(hidden, weight, targets, bias, temperature, ignore_index, return_logits,
                                    vocab_start, real_vocab, backend, strict, return_entropy, sampling)  # fmt: skip
    problem, rows = _problem(hidden, weight, targets, bias, temperature, ignore_index, vocab_start, real_vocab)
    logp = np.empty(_per_target(problem[2], rows), np.float32)
    lse = np.empty(rows, np.float32)
    logits = np.empty((rows, _leading(weight)), np.float32) if return_logits else None
    entropy = np.empty(rows, np.float32) if return_entropy else None
    k = _topk_arg(topk)
    topk_ids = np.empty((rows, k), np.int64) if k else None
    topk_logp = np.empty((rows, k), np.float32) if k else None
    report = _ext.linear_logp(problem, logp, lse, logits, _backend_arg(backend), _resolve_strict(strict), 0, entropy,
                              topk_ids, topk_logp)  # fmt: skip
    return Result(logp, lse, logits, report, entropy, topk_ids=topk_ids, topk_logp=topk_logp)


def _topk_arg(topk) -> int:
    """topk=None: no top-k output (0); else K, an integer in [1, kMaxTopk], checked before the [N, K]
    outputs are allocated (K <= real_vocab is the library's check)."""
    if topk is None:
        return 0
    k = _int_arg(topk, "topk")
    if not 1 <= k <= _MAX_TOPK:
        raise InputError(f"topk={k} must be in [1, {_MAX_TOPK}] (kMaxTopk; topk=None: no top-k output)")
    return k


# Read once: detlogp.torch checks topk= in plain Python, which torch.compile traces (no extension call).
_MAX_TOPK = _ext.contract()["max_topk"]


def _sampling_exclusive(temperature, return_logits: bool, return_entropy: bool) -> None:
    """What a replay with sampling= does not take, refused in its own words."""
    if not (isinstance(temperature, numbers.Real) and not isinstance(temperature, (bool, np.bool_))
            and float(temperature) == 1.0):  # fmt: skip
        raise InputError(
            f"temperature={_shown(repr(temperature))}: with sampling= the temperature is the program's "
            "(SamplingParams.temperature); leave temperature at 1.0"
        )
    if return_logits:
        raise InputError("return_logits is not served with sampling= (detlogp.sample returns the serving logits)")
    if return_entropy:
        raise InputError("return_entropy is not served with sampling= (the entropy is the raw distribution's)")


def _linear_logp_sampled(hidden, weight, targets, bias, temperature, ignore_index, return_logits, vocab_start,
                         real_vocab, backend, strict, return_entropy, sampling) -> Result:  # fmt: skip
    _sampling_exclusive(temperature, return_logits, return_entropy)
    problem, rows = _problem(hidden, weight, targets, bias, 1.0, ignore_index, vocab_start, real_vocab)
    program = _sampling.program_tuple(sampling, [rows])
    logp, logp_raw, lse, lse_support = (np.empty(rows, np.float32) for _ in range(4))
    support_size = np.empty(rows, np.int64)
    report = _ext.linear_logp_sampled(
        problem, program, logp, logp_raw, lse, lse_support, support_size, None, None, None, _backend_arg(backend),
        _resolve_strict(strict),
    )  # fmt: skip
    return Result(logp, lse, None, report, None, logp_raw, lse_support, support_size)


def sample(hidden, weight, params: SamplingParams, seed, key, *, bias=None, vocab_start: int = 0,
           real_vocab: Optional[int] = None, return_logits: bool = False, backend: Optional[str] = None,
           strict: Optional[bool] = None, topk: Optional[int] = None) -> SampleResult:  # fmt: skip
    """One token per row drawn with the sampling program (docs/contract.md §11): temperature, top-k,
    top-p, min-p over the contract logits, Gumbel-max noise from a counter hash of (seed, key, id).

    hidden [N, D] and weight [V, D] bf16 (uint16 bit patterns for numpy; the whole head), params a
    SamplingParams, seed an integer in [0, 2^64 - 1] or a uint64/int64 [N] array, key an int64 [N]
    array. Returns SampleResult(token, logp, logp_raw, lse, support_size, logits, report, topk_ids,
    topk_logp): every bit depends only on the row's inputs, params, seed and key.
    linear_logp(..., sampling=params) with targets = token replays logp, logp_raw and lse bit for bit.
    topk=K (1 <= K <= 128, K <= real_vocab): also the K ids with the largest logits at each row's T
    (1 for T = 0) and their raw logp, from the same pass: the ids and bits linear_logp(..., topk=K)
    gives at that temperature (an engine's logprobs=K; docs/contract.md §12)."""
    hidden, weight = _host_array(hidden, "hidden"), _host_array(weight, "weight")
    bias = None if bias is None else _host_array(bias, "bias")
    rows = _leading(hidden)
    program = _sampling.program_tuple(params, [rows])
    seed_scalar, seed_rows = _sampling.seed_args(seed, [rows])
    key = _sampling.key_arg(key, [rows])
    rv = -1 if real_vocab is None else _int_arg(real_vocab, "real_vocab")
    head = (hidden, weight, bias, rv, _int_arg(vocab_start, "vocab_start"))
    token, support_size = np.empty(rows, np.int64), np.empty(rows, np.int64)
    logp, logp_raw, lse = (np.empty(rows, np.float32) for _ in range(3))
    logits = np.empty((rows, _leading(weight)), np.float32) if return_logits else None
    k = _topk_arg(topk)
    topk_ids = np.empty((rows, k), np.int64) if k else None
    topk_logp = np.empty((rows, k), np.float32) if k else None
    report = _ext.sample(
        head, program, seed_scalar, seed_rows, key, token, logp, logp_raw, lse, support_size, logits,
        _backend_arg(backend), _resolve_strict(strict), topk_ids=topk_ids, topk_logp=topk_logp,
    )  # fmt: skip
    return SampleResult(token, logp, logp_raw, lse, support_size, logits, report, topk_ids, topk_logp)


def linear_logp_partials(hidden, weight, targets, bias=None, temperature=1.0, ignore_index: int = -100,
                         return_logits: bool = False, vocab_start: int = 0, real_vocab: Optional[int] = None,
                         backend: Optional[str] = None, strict: Optional[bool] = None,
                         return_entropy: bool = False, topk: Optional[int] = None) -> Partials:  # fmt: skip
    """One vocabulary shard's partials (tensor parallelism): weight is rows
    [vocab_start, vocab_start + V_local) of the lm_head, real_vocab the global real vocabulary.
    return_entropy: the partials also carry usums [N, tiles] f32, the tiles' entropy sums, which
    merge_partials(..., return_entropy=True) needs from every rank (docs/contract.md §10); served by
    the backends that compute the entropy output, refused by the others."""
    problem, rows = _problem(hidden, weight, targets, bias, temperature, ignore_index, vocab_start, real_vocab)
    v_local = _leading(weight)
    start = _int_arg(vocab_start, "vocab_start")
    rv = start + v_local if real_vocab is None else _int_arg(real_vocab, "real_vocab")
    # A shard the library refuses sizes nothing: it names the reason in its own words.
    g = shard_geometry(start, v_local, rv) if start >= 0 and v_local > 0 and rv > 0 else ShardGeometry(0, 0, 0, 0, 0, 0)
    summaries = np.zeros((rows, g.tiles, 2), np.float32)
    target_logit = np.zeros(_per_target(problem[2], rows), np.float32)
    target_owned = np.zeros(_per_target(problem[2], rows), np.uint8)
    logits = np.empty((rows, v_local), np.float32) if return_logits else None
    usums = np.zeros((rows, g.tiles), np.float32) if return_entropy else None
    edge_logits = np.zeros((rows, g.edge_lanes), np.float32)
    k = _topk_arg(topk)
    topk_logit = np.zeros((rows, k), np.float32) if k else None
    topk_ids = np.zeros((rows, k), np.int64) if k else None
    report, layout = _ext.linear_logp_partials(
        problem, summaries, target_logit, target_owned, logits, _backend_arg(backend), _resolve_strict(strict), 0,
        usums, edge_logits, topk_logit, topk_ids,
    )  # fmt: skip
    return Partials(summaries, target_logit, target_owned, logits, report, PartialsLayout(*layout), usums,
                    edge_logits, topk_logit, topk_ids)  # fmt: skip


def merge_partials(ranks_in_order: Sequence[Partials], targets, ignore_index: int = -100,
                   return_entropy: bool = False, return_topk: bool = False):  # fmt: skip
    """The owned merge over every rank's partials in rank (= ascending vocabulary) order: returns
    (logp, lse), the bits of the whole-vocabulary call, or (logp, lse, entropy) with
    return_entropy=True (every rank's partials must then carry usums: linear_logp_partials with
    return_entropy=True). The library first checks the layouts: rank order, contiguous shards
    covering real_vocab, one backend, and that targets and ignore_index are those the partials were
    computed with (docs/tensor-parallel.md).
    return_topk=True appends (topk_ids, topk_logp), the K first of the ranks' top-k lists and their
    logp with the merged lse (every rank's partials computed with the same topk=K)."""
    targets = _host_array(targets, "targets")
    ignore_index = _int_arg(ignore_index, "ignore_index")
    rows = _leading(targets)
    logp = np.empty(_per_target(targets, rows), np.float32)
    lse = np.empty(rows, np.float32)
    entropy = np.empty(rows, np.float32) if return_entropy else None
    parts = [
        (p.summaries, p.target_logit, p.target_owned, _layout_tuple(p), getattr(p, "usums", None),
         getattr(p, "edge_logits", None), getattr(p, "topk_logit", None), getattr(p, "topk_ids", None))
        for p in ranks_in_order
    ]  # fmt: skip
    first = getattr(ranks_in_order[0], "topk_ids", None) if len(ranks_in_order) else None
    k = int(first.shape[1]) if return_topk and first is not None else 0
    topk_ids = np.empty((rows, k), np.int64) if return_topk else None
    topk_logp = np.empty((rows, k), np.float32) if return_topk else None
    _ext.merge_partials(parts, targets, ignore_index, logp, lse, "", False, 0, entropy, topk_ids, topk_logp)
    out = (logp, lse) + ((entropy,) if return_entropy else ()) + ((topk_ids, topk_logp) if return_topk else ())
    return out


def _layout_tuple(partials):
    # No layout (partials made by hand): None, which the library refuses naming the rank.
    layout = getattr(partials, "layout", None)
    return None if layout is None else tuple(layout)


def reduce_logits(logits, targets, temperature=1.0, real_vocab: Optional[int] = None, ignore_index: int = -100,
                  return_entropy: bool = False):  # fmt: skip
    """The contract's reduction applied to float32 logits [N, V] from anywhere: (logp, lse), or
    (logp, lse, entropy) with return_entropy=True (docs/contract.md §10)."""
    logits, targets = _host_array(logits, "logits"), _host_array(targets, "targets")
    rows = _leading(logits)
    temp, temp_rows = _split_temperature(temperature, rows)
    rv = -1 if real_vocab is None else _int_arg(real_vocab, "real_vocab")
    logp = np.empty(_per_target(targets, rows), np.float32)
    lse = np.empty(rows, np.float32)
    entropy = np.empty(rows, np.float32) if return_entropy else None
    _ext.reduce_logits(logits, targets, temp, temp_rows, rv, _int_arg(ignore_index, "ignore_index"), logp, lse, entropy)
    return (logp, lse, entropy) if return_entropy else (logp, lse)

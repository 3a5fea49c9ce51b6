"""The sampling program's Python forms (docs/contract.md §11): SamplingParams, the seed and key
arguments, and the tuples the extension takes. Shared by the numpy face (detlogp.sample,
detlogp.linear_logp(sampling=...)) and the torch face (detlogp.torch)."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import numpy as np

from ._errors import InputError

_UINT64_MAX = (1 << 64) - 1


class SamplingParams:
    """The sampling program: temperature, then top-k, then top-p, then min-p (docs/contract.md §11).

    Each field is one value for every row (a Python or numpy number, or a 0-d array) or one value
    per row (an array shaped like the rows: float32 for temperature, top_p and min_p, int32 or
    int64 for top_k; numpy arrays, or torch tensors on the torch face). Off: top_k = 0,
    top_p = 1, min_p = 0. temperature = 0 is greedy (the token is the lowest id of the largest
    logit, and its processed logp is +0). The values' ranges are the library's to check: it refuses a
    bad one naming the field, the row and the value."""

    __slots__ = ("temperature", "top_k", "top_p", "min_p")

    def __init__(self, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.min_p = min_p

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={_shown_value(getattr(self, name))}" for name in self.__slots__)
        return f"SamplingParams({fields})"


class SampleResult(NamedTuple):
    token: Any  # [N] int64; -1 for a row without a processed distribution (a NaN or all -inf row)
    logp: Any  # [N] float32: the token's log-probability under the processed distribution
    logp_raw: Any  # [N] float32: linear_logp's logp of the token at the row's T (T = 0: at 1)
    lse: Any  # [N] float32: linear_logp's lse
    support_size: Any  # [N] int64: the lanes the filters kept
    logits: Any  # [N, V] float32 with return_logits, else None
    report: dict
    # topk=K: an engine's logprobs=K beside the token, the K ids with the largest logits at the row's
    # T (T = 0: at 1), larger first, equal ones by the lower id, [N, K] int64, and their raw logp
    # [N, K] float32: the bits linear_logp(..., topk=K) gives at that temperature. None otherwise.
    topk_ids: Any = None
    topk_logp: Any = None


def _shown_value(v) -> str:
    shape = getattr(v, "shape", None)
    return f"<array shape {list(shape)}>" if shape is not None and len(shape) > 0 else repr(v)


def _what(x) -> str:
    from . import _what as what

    return what(x)


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", "")).rpartition(".")[2]


def _field(value, name: str, shape, integer: bool, tensor_type=None):
    """(scalar, rows) of one field: rows is None for a scalar, else the caller's array of `shape`
    (no cast, no broadcast)."""
    # The common case first, as the checks below would take it: a Python int (an integer field) or
    # float (a float field); bool is neither type.
    kind = type(value)
    if kind is int and integer:
        return value, None
    if kind is float and not integer:
        return value, None
    kinds = ("int32", "int64") if integer else ("float32",)
    forms = (
        f"an integer or an int32/int64 array of shape {list(shape)}"
        if integer
        else f"a float or a float32 array of shape {list(shape)}"
    )
    if isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be {forms}, got {_what(value)}")
    dims = getattr(value, "shape", None)
    if dims is None:
        if integer and isinstance(value, (numbers.Integral, np.integer)):
            return int(value), None
        if not integer and isinstance(value, (numbers.Real, np.integer, np.floating)):
            return float(value), None
        raise InputError(f"{name} must be {forms}, got {_what(value)}")
    if not (isinstance(value, np.ndarray) or hasattr(value, "__dlpack__")):
        raise InputError(f"{name} must be {forms}, got {_what(value)}")
    dtype = _dtype_name(value)
    if len(dims) == 0:
        ok = dtype.startswith(("int", "uint")) if integer else dtype.startswith(("float", "bfloat"))
        if not ok or dtype == "bool":
            raise InputError(f"{name} must be {forms}, got {_what(value)}")
        item = value.item()
        return (int(item), None) if integer else (float(item), None)
    if list(dims) != list(shape):
        raise InputError(f"{name} must be {forms}, got {_what(value)} (one value per row, no broadcast)")
    if dtype not in kinds:
        raise InputError(f"{name} of shape {list(shape)} must be {' or '.join(kinds)}, got {dtype} (no silent cast)")
    if tensor_type is not None and not isinstance(value, tensor_type):
        raise InputError(f"{name} of shape {list(shape)} must be a torch tensor here, got {type(value).__name__}")
    return (0 if integer else 1.0), value


def program_tuple(params, shape, tensor_type=None, flatten=None):
    """The extension's program tuple (python/src/detlogp_ext.cpp, program_of) for rows of `shape`;
    flatten(array) turns a per-row array into the [N] vector the library reads."""
    if not isinstance(params, SamplingParams):
        raise InputError(f"sampling must be a detlogp.SamplingParams, got {_what(params)}")
    flatten = flatten or (lambda a: a)
    out = []
    for name, integer, default in (("temperature", False, 1.0), ("top_k", True, 0), ("top_p", False, 1.0),
                                   ("min_p", False, 0.0)):  # fmt: skip
        scalar, rows = _field(getattr(params, name), name, shape, integer, tensor_type)
        out += [scalar if rows is None else default, None if rows is None else flatten(rows)]
    return tuple(out)


def seed_args(seed, shape, tensor_type=None, flatten=None):
    """(seed, seed_rows) the extension takes: an integer in [0, 2^64 - 1] for every row, or a uint64 or
    int64 array of `shape` (each row's seed, its 64 bits), passed as int64."""
    if type(seed) is int and 0 <= seed <= _UINT64_MAX:  # the common case, as the checks below take it
        return seed, None
    flatten = flatten or (lambda a: a)
    forms = f"an integer in [0, 2^64 - 1] or a uint64/int64 array of shape {list(shape)}"
    if isinstance(seed, (bool, np.bool_)):
        raise InputError(f"seed must be {forms}, got {_what(seed)}")
    if isinstance(seed, (numbers.Integral, np.integer)):
        if not 0 <= int(seed) <= _UINT64_MAX:
            raise InputError(f"seed={int(seed)} is outside the uint64 range [0, 2^64 - 1]")
        return int(seed), None
    dims = getattr(seed, "shape", None)
    if dims is None or list(dims) != list(shape) or _dtype_name(seed) not in ("uint64", "int64"):
        raise InputError(f"seed must be {forms}, got {_what(seed)}")
    if tensor_type is not None and not isinstance(seed, tensor_type):
        raise InputError(f"seed of shape {list(shape)} must be a torch tensor here, got {type(seed).__name__}")
    if isinstance(seed, np.ndarray):
        seed = np.ascontiguousarray(seed).view(np.int64)
    elif _dtype_name(seed) == "uint64":  # a torch tensor: the same 64 bits as int64
        import torch

        seed = seed.view(torch.int64)
    return 0, flatten(seed)


def key_arg(key, shape, tensor_type=None, flatten=None):
    """The rows' keys: an int64 array of `shape` (a token position, a request id, ...)."""
    flatten = flatten or (lambda a: a)
    dims = getattr(key, "shape", None)
    if dims is None or not (isinstance(key, np.ndarray) or hasattr(key, "__dlpack__")) or _dtype_name(key) != "int64":
        raise InputError(f"key must be an int64 array of shape {list(shape)}, got {_what(key)}")
    if list(dims) != list(shape):
        raise InputError(f"key must be an int64 array of shape {list(shape)}, got {_what(key)}")
    if tensor_type is not None and not isinstance(key, tensor_type):
        raise InputError(f"key must be a torch tensor here, got {type(key).__name__}")
    return flatten(key)

"""detlogp: per-token log-probabilities straight from hidden states and the lm_head weight, fused
and bitwise deterministic (docs/contract.md).

This module is the array-level API (numpy arrays, or anything host-resident with DLPack);
``detlogp.torch`` is the PyTorch operator with autograd. bf16 arrays without a bf16 dtype (numpy)
are passed as uint16/int16 bit patterns: see ``to_bf16_bits``.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from . import _detlogp as _ext
from ._errors import BackendError, ConfigError, DetlogpError, InputError, StrictModeError, TargetIndexError

__all__ = [
    "BackendError",
    "ConfigError",
    "DetlogpError",
    "InputError",
    "StrictModeError",
    "TargetIndexError",
    "TORCH_BACKEND_ID",
    "Partials",
    "PartialsLayout",
    "Result",
    "backends",
    "contract",
    "from_bf16_bits",
    "linear_logp",
    "linear_logp_partials",
    "merge_partials",
    "provenance",
    "reduce_logits",
    "shard_tiles",
    "strict_from_env",
    "to_bf16_bits",
]

__version__ = _ext.version()

# The plain-PyTorch lane of detlogp.torch (F.linear + log_softmax): not contract-bearing.
TORCH_BACKEND_ID = "torch-materialized-noncontract"


class Result(NamedTuple):
    logp: Any
    lse: Any
    logits: Any  # None on the trainer entry
    report: dict  # which backend served the call, with its provenance


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


class Partials(NamedTuple):
    summaries: Any  # [N, tiles, 2] float32: (max, sum) of each of the shard's global tiles
    target_logit: Any  # [N] float32: scaled target logit where the shard owns the target, else +0
    target_owned: Any  # [N] uint8
    logits: Any  # [N, V_local] float32 on the serving entry, else None
    report: dict
    layout: PartialsLayout


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
    """Number of 64-wide global vocabulary tiles a shard of vocab_local rows spans."""
    return _ext.shard_tiles(vocab_local)


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


def _host_array(x, name: str):
    if hasattr(x, "__dlpack__") or isinstance(x, np.ndarray):
        return x
    raise InputError(f"{name} must be an array (numpy, or anything with __dlpack__), got {type(x).__name__}")


def _split_temperature(temperature, rows: int):
    if np.isscalar(temperature) or isinstance(temperature, (float, int)):
        return float(temperature), None
    t = np.asarray(temperature)
    if t.dtype != np.float32:
        raise InputError(f"temperature rows must be float32, got {t.dtype}")
    if t.shape != (rows,):
        raise InputError(f"temperature rows must be [N={rows}], got shape {list(t.shape)}")
    return 1.0, t


def _backend_arg(backend: Optional[str]) -> str:
    if backend == TORCH_BACKEND_ID:
        raise InputError(f"backend '{TORCH_BACKEND_ID}' is served by detlogp.torch.linear_logp, not the array API")
    return backend or ""


def _problem(hidden, weight, targets, bias, temperature, ignore_index, vocab_start, real_vocab):
    """The extension's problem tuple of one call and its row count."""
    hidden, weight, targets = (_host_array(a, n) for a, n in ((hidden, "hidden"), (weight, "weight"), (targets, "targets")))
    rows = int(hidden.shape[0]) if hasattr(hidden, "shape") else 0
    temp, temp_rows = _split_temperature(temperature, rows)
    rv = -1 if real_vocab is None else int(real_vocab)
    return (hidden, weight, targets, bias, temp, temp_rows, rv, int(vocab_start), int(ignore_index)), rows


def linear_logp(hidden, weight, targets, bias=None, temperature=1.0, ignore_index: int = -100,
                return_logits: bool = False, vocab_start: int = 0, real_vocab: Optional[int] = None,
                backend: Optional[str] = None, strict: Optional[bool] = None) -> Result:  # fmt: skip
    """logp[n] = y_t - logsumexp(y), y = (h.W^T + b) / T, over the whole real vocabulary.

    hidden [N, D] and weight [V, D] are bf16 (uint16 bit patterns for numpy), targets [N] int32 or
    int64, bias [V] float32, temperature a float or a [N] float32 array. Returns
    Result(logp [N] f32, lse [N] f32, logits [N, V] f32 or None, report)."""
    problem, rows = _problem(hidden, weight, targets, bias, temperature, ignore_index, vocab_start, real_vocab)
    logp = np.empty(rows, np.float32)
    lse = np.empty(rows, np.float32)
    logits = np.empty((rows, int(weight.shape[0])), np.float32) if return_logits else None
    report = _ext.linear_logp(problem, logp, lse, logits, _backend_arg(backend), _resolve_strict(strict), 0)
    return Result(logp, lse, logits, report)


def linear_logp_partials(hidden, weight, targets, bias=None, temperature=1.0, ignore_index: int = -100,
                         return_logits: bool = False, vocab_start: int = 0, real_vocab: Optional[int] = None,
                         backend: Optional[str] = None, strict: Optional[bool] = None) -> Partials:  # fmt: skip
    """One vocabulary shard's partials (tensor parallelism): weight is rows
    [vocab_start, vocab_start + V_local) of the lm_head, real_vocab the global real vocabulary."""
    problem, rows = _problem(hidden, weight, targets, bias, temperature, ignore_index, vocab_start, real_vocab)
    tiles = shard_tiles(int(weight.shape[0]))
    summaries = np.zeros((rows, tiles, 2), np.float32)
    target_logit = np.zeros(rows, np.float32)
    target_owned = np.zeros(rows, np.uint8)
    logits = np.empty((rows, int(weight.shape[0])), np.float32) if return_logits else None
    report, layout = _ext.linear_logp_partials(
        problem, summaries, target_logit, target_owned, logits, _backend_arg(backend), _resolve_strict(strict), 0
    )
    return Partials(summaries, target_logit, target_owned, logits, report, PartialsLayout(*layout))


def merge_partials(ranks_in_order: Sequence[Partials], targets, ignore_index: int = -100):
    """The owned merge over every rank's partials in rank (= ascending vocabulary) order: returns
    (logp, lse), the bits of the whole-vocabulary call. The library first checks the layouts: rank
    order, contiguous shards covering real_vocab, one backend, and that targets and ignore_index
    are those the partials were computed with (docs/tensor-parallel.md)."""
    rows = int(np.asarray(targets).shape[0])
    logp = np.empty(rows, np.float32)
    lse = np.empty(rows, np.float32)
    parts = [(p.summaries, p.target_logit, p.target_owned, _layout_tuple(p)) for p in ranks_in_order]
    _ext.merge_partials(parts, targets, int(ignore_index), logp, lse, "", False, 0)
    return logp, lse


def _layout_tuple(partials):
    # No layout (partials made by hand): None, which the library refuses naming the rank.
    layout = getattr(partials, "layout", None)
    return None if layout is None else tuple(layout)


def reduce_logits(logits, targets, temperature=1.0, real_vocab: Optional[int] = None, ignore_index: int = -100):
    """The contract's reduction applied to float32 logits [N, V] from anywhere: (logp, lse)."""
    rows = int(logits.shape[0])
    temp, temp_rows = _split_temperature(temperature, rows)
    logp = np.empty(rows, np.float32)
    lse = np.empty(rows, np.float32)
    _ext.reduce_logits(
        logits, targets, temp, temp_rows, -1 if real_vocab is None else int(real_vocab), int(ignore_index), logp, lse
    )
    return logp, lse

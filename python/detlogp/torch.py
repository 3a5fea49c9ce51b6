"""detlogp.torch: the PyTorch operator, with autograd.

linear_logp(hidden, weight, targets, ...) -> (logp, lse[, entropy][, logits]) runs the contract-bearing
backends (SM90 on CUDA tensors, the CPU backend on CPU tensors) through the C++ library on the
caller's current CUDA stream. It is a torch custom op (``detlogp::linear_logp``) with a fake
implementation, so it traces under torch.compile and replays inside CUDA graphs.

The backward recomputes the logits one vocabulary chunk at a time (never an [N, V] buffer), in a
fixed order, so gradients are deterministic run to run; for CUDA bf16 tensors served by the SM90
backend it is fused (one grad_logits kernel and two GEMMs per chunk). Gradients are not part of the
numeric contract (only logp/lse are). With tp_group, the C++ tensor-parallel operator runs over
torch.distributed. The modules behind this namespace, one role each, are in detlogp._torch.
"""

from __future__ import annotations

import math
import os
import sys
import types
from typing import Optional, Union

import torch
from torch import Tensor

from . import TORCH_BACKEND_ID, _int_arg, _split_temperature, _topk_arg, _what
from . import _detlogp as _ext
from . import weight_fingerprint as _weight_fingerprint
from ._errors import InputError, NotImplementedYetError, StrictModeError
from ._torch import backward as _backward
from ._torch.backward import FUSED_BACKWARD_ENV, SM90_BACKEND_ID, last_backward_path  # noqa: F401 (re-exported)
from ._torch.grad_logits import grad_logits
from ._torch.loss import LOSS_CHUNK_BYTES, LossResult, linear_logp_loss
from ._torch.op import check_errors, last_report, set_deferred_errors
from ._torch.op import eager_operands as _eager_operands
from ._torch.op import linear_logp_op as _linear_logp_op
from ._torch.op import run_op as _run_op
from ._torch.sampling import linear_logp_sampled as _linear_logp_sampled
from ._torch.sampling import sample
from ._torch.tensor_parallel import TensorParallelLinearLogp as _TensorParallelLinearLogp
from ._torch.tensors import check_devices as _check_devices
from ._torch.tensors import check_tensors as _check_tensors

__all__ = [
    "BACKWARD_FUSED_CHUNK_BYTES",
    "BACKWARD_VOCAB_CHUNK",
    "LOSS_CHUNK_BYTES",
    "LossResult",
    "TORCH_BACKEND_ID",
    "check_errors",
    "grad_logits",
    "last_backward_path",
    "last_report",
    "linear_logp",
    "linear_logp_loss",
    "sample",
    "set_deferred_errors",
    "weight_fingerprint",
]

# Read by bench/bench_backward.py: the fused chunk rows and the process-wide backward path record.
_fused_chunk_rows = _backward.fused_chunk_rows
_last_backward = _backward.last_backward


def linear_logp(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Optional[Tensor] = None,
    temperature: Union[float, Tensor] = 1.0,
    ignore_index: int = -100,
    return_logits: bool = False,
    vocab_start: int = 0,
    real_vocab: Optional[int] = None,
    tp_group=None,
    strict: Optional[bool] = None,
    backend: Optional[str] = None,
    return_entropy: bool = False,
    sampling=None,
    return_raw: bool = False,
    topk: Optional[int] = None,
):
    """Per-token log-probabilities: logp[n] = y_t - logsumexp(y), y = (h.W^T + b) / T.

    hidden [..., D] bf16, weight [V_local, D] bf16 (this rank's shard when tp_group is given),
    targets [...] int32/int64 (global ids), bias [V_local] fp32, temperature a float, a 0-d floating
    tensor (every row's, expanded inside the graph) or an fp32 tensor shaped like targets
    (docs/python.md, "Accepted inputs"). Returns (logp, lse) fp32 shaped like targets, plus logits
    [..., V_local] fp32 (unscaled z, the serving entry) when return_logits. return_entropy: each
    row's entropy H = -sum p log p (docs/contract.md §10) from the same call, returned after lse:
    (logp, lse, entropy[, logits]); served by the backends whose provenance names an entropy_id,
    refused by the others. targets [..., K] (hidden [..., D] with the same leading dims, K <= 64):
    K ids a row, logp [..., K], each entry the bits of a call with that single target (ignore_index
    per entry), from one pass. topk=K (1 <= K <= 128): also topk_ids [..., K] int64, the K real ids
    of the largest scaled logits (the larger first, equal ones by the lower id), and topk_logp
    [..., K] their logp (docs/contract.md §12), after lse and entropy:
    (logp, lse[, entropy][, topk_ids, topk_logp][, logits]). Both on the CPU backend (CUDA tensors:
    NotImplementedYetError where no CUDA backend serves them). Differentiable in hidden, weight,
    bias and a temperature tensor (0-d or per row), through every output (topk_logp with its ids
    held constant), in one backward pass. backend: None (DETLOGP_BACKEND,
    else auto), a C++ backend id, or TORCH_BACKEND_ID; strict (or DETLOGP_STRICT=1) refuses every
    non-contract lane. detlogp.torch.last_report() says which backend served the call and which
    operands were copied ("copies": a CUDA view the SM90 backend cannot read in place is copied
    once into aligned storage).

    sampling: a detlogp.SamplingParams replaying the rollout's program (docs/contract.md §11): logp is
    then the targets' processed log-probability (the bits detlogp.torch.sample recorded; -inf outside
    the support, counted in last_report()["sampling"]) and lse the plain call's; return_raw adds
    logp_raw, the plain call's logp: (logp, lse[, logp_raw]). Differentiable in hidden, weight and bias
    with the support held fixed (d logp / d y = onehot - the support's renormalized probabilities).
    temperature stays 1.0 (the program's is used); not with return_logits or return_entropy; with
    tp_group over vocabulary shards (the TP = 1 bits on every rank; docs/python.md). CPU tensors run
    on the CPU backend, CUDA tensors on the SM90 backend, forward and backward."""
    if sampling is not None:
        if topk is not None:
            raise InputError("topk= is not taken with sampling= (the replay scores the given targets)")
        strict_on, backend = _strict_and_backend(strict, backend)
        if backend == TORCH_BACKEND_ID:
            raise InputError(f"sampling= needs a contract backend; '{TORCH_BACKEND_ID}' does not run the program")
        return _linear_logp_sampled(
            hidden, weight, targets, bias, temperature, ignore_index, return_logits, vocab_start, real_vocab, tp_group,
            strict_on, backend, return_entropy, sampling, return_raw,
        )  # fmt: skip
    if return_raw:
        raise InputError("return_raw needs sampling= (without a program logp is already the raw logp)")
    # Plain Python (no extension call) so torch.compile traces it; the library itself re-reads
    # DETLOGP_STRICT and refuses bad DETLOGP_* variables on every call.
    strict_on, backend = _strict_and_backend(strict, backend)
    if not isinstance(backend, str):
        raise InputError(f"backend must be a backend id (str) or None, got {_what(backend)}")
    if backend == TORCH_BACKEND_ID and strict_on:
        raise StrictModeError(
            f"strict mode refuses backend '{TORCH_BACKEND_ID}': it does not bear the detlogp contract "
            "(unset strict / DETLOGP_STRICT, or use a contract backend)"
        )
    if not isinstance(hidden, Tensor) or not isinstance(weight, Tensor) or not isinstance(targets, Tensor):
        raise InputError("hidden, weight and targets must be torch tensors (numpy arrays go to detlogp.linear_logp)")
    if bias is not None and not isinstance(bias, Tensor):
        raise InputError(f"bias must be a torch tensor or None, got {_what(bias)}")
    _check_devices((("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)))
    # K ids a row: targets [..., K] beside hidden [..., D] (as many dims); else one id a row, targets [...].
    per_row = targets.shape[-1] if targets.dim() >= 2 and targets.dim() == hidden.dim() else None
    batch_shape = targets.shape if per_row is None else targets.shape[:-1]
    if targets.dim() == 1 and hidden.dim() == 2 and hidden.shape[0] == targets.shape[0]:
        # The common form, [N, D] and [N], whose leading dims agree: the checks below would pass.
        n, t1 = targets.shape[0], targets
    elif per_row is not None and targets.dim() == 2:
        # The library's own form, [N, D] and [N, K]: it checks the rows and K in its words.
        n, t1 = hidden.shape[0], targets
    else:
        if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != tuple(batch_shape):
            if targets.dim() == 1:  # the library's own form, [N, D] and [N]: its words
                if hidden.dim() != 2:
                    raise InputError(f"hidden must be 2-D, got ndim={hidden.dim()}")
                raise InputError(f"targets has {targets.shape[0]} elements, expected {hidden.shape[0]}")
            # A batch shape (targets [B, T] or [B, T, K], hidden [B, T, D]) is this face's own: the
            # library has no words for it.
            raise InputError(
                f"hidden must be [..., D] with leading dims {list(batch_shape)} (targets {list(targets.shape)}: "
                f"[...] for one id a row, [..., K] beside hidden's dims for K ids a row), got {list(hidden.shape)}"
            )
        n = math.prod(batch_shape)
        if targets.dim() == 1:  # already [N]
            t1 = targets
        else:
            t1 = targets.reshape(n) if per_row is None else targets.reshape(n, per_row)
    # Past the checks above a 2-D hidden is [N, D] with every output in the library's shape already:
    # no reshapes in or out. Else n, not -1: D = 0 reaches the library's own check.
    flat = hidden.dim() == 2
    h2 = hidden if flat else hidden.reshape(n, hidden.shape[-1])
    k = _topk_arg(topk)
    _refuse_unserved_cuda(hidden, backend, per_row, topk is not None)
    contract = backend != TORCH_BACKEND_ID
    temp, temp_rows = _split_temperature(
        temperature, n, shape=batch_shape, tensor_type=Tensor, rows_any_float=not contract
    )
    if temp_rows is not None and temp_rows.dim() == 0:
        # One temperature for every row, kept in the graph and never read on the host here (CUDA graphs,
        # torch.compile): the op expands it to the rows (and sums their gradients into it).
        temp_rows = temp_rows.to(torch.float32) if contract else temp_rows
        if tp_group is not None:
            temp_rows = temp_rows.expand(n)
    elif temp_rows is not None:
        temp_rows = temp_rows.reshape(n)
    ignore_index = _int_arg(ignore_index, "ignore_index")
    vocab_start = _int_arg(vocab_start, "vocab_start")
    v_local = weight.shape[0] if weight.dim() > 0 else 0  # a 0-d weight: the library names its rank
    rv = vocab_start + v_local if real_vocab is None else _int_arg(real_vocab, "real_vocab")
    if tp_group is None:
        if not contract:
            _check_tensors(h2, weight, t1, bias, temp_rows, contract)
        elif temp_rows is not None:  # the contract lanes' check_tensors: the devices; the others' are checked above
            _check_devices((("temperature", temp_rows),))
        # The library's own refusal of a shard would point at linear_logp_partials; here tp_group is the way.
        if weight.dim() == 2 and (vocab_start != 0 or v_local < rv):
            raise InputError(
                f"weight covers vocabulary [{vocab_start}, {vocab_start + v_local}) of real_vocab={rv}: "
                "a vocabulary shard needs tp_group"
            )
        rest = (ignore_index, bool(return_logits), rv, backend, strict_on, bool(return_entropy), k)
        # Eager, with nothing for autograd, tracing or capture to record: the op's body itself, without
        # the dispatcher's per-call cost (the same function on the same tensors: the same bits and errors).
        plain = _eager_operands((h2, weight, t1, bias, temp_rows))
        if plain is not None:
            h_, w_, t_, b_, tr_ = plain
            outs = _run_op(h_, w_, t_, b_, temp, tr_, *rest)
        else:
            outs = _linear_logp_op(h2, weight, t1, bias, temp, temp_rows, *rest)
        logp, lse, logits, entropy, topk_ids, topk_logp = outs
        if flat and not (return_entropy or k or return_logits):
            return logp, lse
    else:
        if not contract:
            raise InputError(f"tp_group needs a contract backend; '{TORCH_BACKEND_ID}' has no tensor-parallel path")
        outs = list(
            _TensorParallelLinearLogp.apply(
                h2, weight, bias, temp_rows, t1, temp, ignore_index, bool(return_logits), vocab_start, rv, backend,
                strict_on, tp_group, bool(return_entropy), k,
            )
        )  # fmt: skip
        logp, lse = outs[:2]
        entropy = outs.pop(2) if return_entropy else None
        topk_ids, topk_logp = (outs.pop(2), outs.pop(2)) if k else (None, None)
        logits = outs[2]
    def shaped(x, tail=()):
        return x if flat else x.reshape(tuple(batch_shape) + tail)

    out = (shaped(logp, () if per_row is None else (per_row,)), shaped(lse))
    if return_entropy:
        out += (shaped(entropy),)
    if k:
        out += (shaped(topk_ids, (k,)), shaped(topk_logp, (k,)))
    if return_logits:
        out += (shaped(logits, (v_local,)),)
    return out


# os.environ's own mapping and codecs (CPython's os._Environ): DETLOGP_STRICT and DETLOGP_BACKEND are
# read on every call, as os.environ.get reads them, without the Mapping machinery (~0.5 us a read).
# An os.environ replaced by another object is read through its get.
_ENVIRON = os.environ
try:
    _ENV_DATA, _ENV_DECODE = _ENVIRON._data, _ENVIRON.decodevalue
    _ENV_STRICT, _ENV_BACKEND = _ENVIRON.encodekey("DETLOGP_STRICT"), _ENVIRON.encodekey("DETLOGP_BACKEND")
    _ENV_ONE = _ENVIRON.encodevalue("1")
    if type(_ENV_DATA) is not dict:  # pragma: no cover
        _ENVIRON = None
except AttributeError:  # pragma: no cover - not CPython's os._Environ
    _ENVIRON = None


def _strict_and_backend(strict, backend):
    """(strict on, backend id): DETLOGP_STRICT=1 or strict; the backend given, else DETLOGP_BACKEND
    (unset: "", auto)."""
    if os.environ is _ENVIRON:
        strict_on = _ENV_DATA.get(_ENV_STRICT) == _ENV_ONE or bool(strict)
        if backend is None:
            value = _ENV_DATA.get(_ENV_BACKEND)
            backend = "" if value is None else _ENV_DECODE(value)
        return strict_on, backend
    strict_on = os.environ.get("DETLOGP_STRICT", "0") == "1" or bool(strict)
    return strict_on, backend if backend is not None else os.environ.get("DETLOGP_BACKEND", "")


_CAPABILITIES: list = [None, None]  # [the list_backends function read, its result]


def _backend_capabilities() -> list:
    """The registry's backend list, read once per process (the capabilities of a build do not
    change; a replaced _ext.list_backends is read again)."""
    if _CAPABILITIES[0] is not _ext.list_backends:
        _CAPABILITIES[:] = [_ext.list_backends, _ext.list_backends()]
    return _CAPABILITIES[1]


def _refuse_unserved_cuda(hidden: Tensor, backend: str, per_row: Optional[int], topk: bool) -> None:
    """[N, K] targets (K > 1) and the top-k output on CUDA tensors: NotImplementedYetError, naming
    what is missing, unless the backend that would serve the call (the requested one; auto: SM90)
    computes them (the registry's capability flags, detlogp.backends())."""
    multi = per_row is not None and per_row > 1
    if not hidden.is_cuda or not (multi or topk) or backend == TORCH_BACKEND_ID:
        return
    wanted = backend or SM90_BACKEND_ID
    for b in _backend_capabilities():
        if b["id"] != wanted or b["memory"] != "cuda":
            continue
        missing = ([f"[N, K] targets (K={per_row})"] if multi and not b["multi_targets"] else []) + (
            ["the top-k output (topk=)"] if topk and not b["topk"] else []
        )
        if missing:
            cpu = next(x["id"] for x in _backend_capabilities() if x["memory"] == "host" and x["topk"])
            raise NotImplementedYetError(
                f"{' and '.join(missing)} on CUDA tensors: not implemented yet by backend '{wanted}' "
                f"(docs/contract.md §12); '{cpu}' computes them on CPU tensors (move hidden, weight, targets "
                "and bias to the CPU), or call once per target column"
            )


def weight_fingerprint(weight) -> str:
    """The weight-version fingerprint (docs/validation.md, section 3) of a bf16 lm_head weight
    [V, D], or of the list of its vocabulary shards in rank order (the whole head's value), on any
    device: a CUDA tensor is copied to the host to be hashed (a synchronization). It names the bytes
    the contract reads: two sides with the same value and the same hidden states get the same logp
    bits."""
    shards = list(weight) if isinstance(weight, (list, tuple)) else [weight]
    for i, s in enumerate(shards):
        if not isinstance(s, Tensor):
            raise InputError(f"weight_fingerprint takes torch tensors here, got {_what(s)} for shard {i}")
        if s.dtype != torch.bfloat16:
            raise InputError(f"weight_fingerprint: shard {i} has dtype {s.dtype}; the fingerprint names bf16 bytes")
    return _weight_fingerprint([s.detach().to("cpu") for s in shards])


def _forwarded(name: str) -> property:
    return property(lambda _: getattr(_backward, name), lambda _, value: setattr(_backward, name, value))


class _Module(types.ModuleType):
    """detlogp.torch itself: its chunk-size knobs are the backward's own, so that setting one here
    (detlogp.torch.BACKWARD_VOCAB_CHUNK = 1024) changes the chunks the backward takes."""

    BACKWARD_VOCAB_CHUNK = _forwarded("BACKWARD_VOCAB_CHUNK")
    BACKWARD_FUSED_CHUNK_BYTES = _forwarded("BACKWARD_FUSED_CHUNK_BYTES")


sys.modules[__name__].__class__ = _Module

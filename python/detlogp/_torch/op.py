"""The forward custom op ``detlogp::linear_logp``: the C++ library's lanes (SM90 on CUDA tensors,
the CPU backend on CPU tensors) on the caller's current CUDA stream, the plain-torch lane, the
fake implementation that lets torch.compile trace it, and the report of the thread's last call."""

from __future__ import annotations

import threading
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import TORCH_BACKEND_ID, _detlogp as _ext, _noncontract_provenance
from .._errors import InputError
from . import backward
from .tensors import (
    aligned_operands, exported_problem, library_problem, out_dtype, rows_of, stream_of, traced_now, vector_copies,
)  # fmt: skip

_tls = threading.local()
_NAN = float("nan")
_deferred = {"enabled": True}


def set_deferred_errors(enabled: bool) -> bool:
    """Whether CUDA calls of detlogp.torch.linear_logp leave their device validation's verdict
    outstanding (the default: the call returns once its kernels are enqueued, as torch ops do)
    instead of waiting for it. A deferred call with a bad target or row temperature writes nothing
    but NaN logp (and entropy) rows, and its error is raised by this thread's next detlogp CUDA call
    that finds the validation done, or by detlogp.torch.check_errors(). Returns the previous setting."""
    if not isinstance(enabled, bool):
        raise InputError(f"enabled must be a bool, got {type(enabled).__name__}")
    previous = _deferred["enabled"]
    _deferred["enabled"] = enabled
    return previous


def check_errors() -> None:
    """Waits for the device validation of this thread's deferred calls and raises the first error
    among them (argument, row and value, and which entry made the call); a no-op when none is
    outstanding. Call it where a training or rollout step must know its inputs were valid."""
    _ext.check_deferred_errors()


def last_report() -> Optional[dict]:
    """The report of this thread's last eager detlogp.torch call: which backend served it and its
    provenance. (A replayed CUDA graph runs no Python, so it reports nothing new.)"""
    pending = getattr(_tls, "pending", None)
    if pending is not None:  # built here, on first read, not on every call
        report, copies = pending
        report = report if isinstance(report, dict) else report.as_dict()  # the extension's CallReport
        _tls.report, _tls.pending = report if copies is None else dict(report, copies=copies), None
    return getattr(_tls, "report", None)


def set_report(report, copies: Optional[list] = None) -> None:
    """Records the thread's last report: the library's dict (or its CallReport, turned into one when
    read), or the lane's, and where given its "copies" entry, which last_report() joins to it."""
    _tls.pending = (report, copies)


def check_lane_values(targets: Tensor, temperature: float, temperature_rows: Optional[Tensor], real_vocab: int,
                      ignore_index: int) -> None:
    """The library's own value checks, for the plain-torch lane, which computes without the library:
    the scalar temperature (the extension's float32 rounding refusal, then the range of
    docs/contract.md 3.3), every target in [0, real_vocab) or ignore_index, every row temperature in
    range, in the words every face gives (detlogp::check_row_values). A 0-d temperature tensor is
    checked as the scalar `temperature` (also at N = 0).
    CUDA targets and temperatures are read back to the host for it (one copy of each: a sync);
    while the stream is capturing a CUDA graph there is no read and no check, as the SM90 backend
    skips its wait for the validation verdict (torch.compile is unaffected: the op is opaque)."""
    if targets.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    rows = None
    if temperature_rows is not None and temperature_rows.dim() == 0:
        temperature = temperature_rows.detach().to("cpu", torch.float32).item()
    elif temperature_rows is not None:
        rows = temperature_rows.detach().to("cpu", torch.float32).contiguous().numpy()
    t = targets.detach().to("cpu").contiguous().numpy()
    _ext.check_row_values(t, real_vocab, ignore_index, temperature, rows)


def _torch_lane(hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, real_vocab,
                return_entropy, topk):  # fmt: skip
    """The plain, non-contract lane: F.linear + log_softmax in fp32 (fp64 for fp64 inputs); the
    entropy -sum p log p in torch too (not the contract's bits), 0 * log 0 taken as 0; [N, K]
    targets by a gather; the top-k by a stable descending sort (the contract's order: equal logits
    by the lower id, NaN first)."""
    cd = out_dtype(hidden)
    if temperature_rows is not None and temperature_rows.dim() == 0:
        temperature_rows = temperature_rows.expand(hidden.shape[0])
    z = F.linear(hidden.to(cd), weight.to(cd), None if bias is None else bias.to(cd))
    inv_t = (1.0 / temperature_rows.to(cd))[:, None] if temperature_rows is not None else 1.0 / temperature
    y = z * inv_t
    if real_vocab < weight.shape[0]:
        y = y.masked_fill(torch.arange(weight.shape[0], device=y.device) >= real_vocab, float("-inf"))
    lse = torch.logsumexp(y, dim=1)
    t2 = targets if targets.dim() == 2 else targets[:, None]
    ignored = t2 == ignore_index
    y_t = y.gather(1, torch.where(ignored, 0, t2).long())
    logp = torch.where(ignored, 0.0, y_t - lse[:, None]).to(lse.dtype)
    logp = logp if targets.dim() == 2 else logp[:, 0]
    logits = z if return_logits else z.new_empty((0,))
    entropy = lse.new_empty((0,))
    if return_entropy:
        x = y - lse[:, None]
        p = x.exp()
        entropy = -torch.where(p == 0, 0.0, p * x).sum(1)
    topk_ids = targets.new_empty((0,), dtype=torch.int64)
    topk_logp = lse.new_empty((0,))
    if topk:
        topk_ids = torch.sort(y.detach(), dim=1, descending=True, stable=True).indices[:, :topk].contiguous()
        topk_logp = y.gather(1, topk_ids) - lse[:, None]
    return logp, lse, logits, entropy, topk_ids, topk_logp


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def eager_operands(tensors) -> Optional[list]:
    """The tensors (None kept) as run_op may take them when the call needs nothing of torch's
    dispatcher, else None: no torch.compile tracing, no autograd (grad mode off or no tensor that
    requires grad), no tensor subclass (fake, functional, wrapped), no dispatch or function mode, no
    functorch transform, no CUDA-graph capture. A tensor that requires grad under grad mode off is
    detached, as the op's own dispatch hands it over."""
    if traced_now() or (_dispatch_modes is not None and _dispatch_modes() > 0):
        return None
    if (_function_modes is not None and _function_modes()) or (_functorch_active is not None and _functorch_active()):
        return None
    grad = torch.is_grad_enabled()
    out = []
    cuda = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN_TYPES:
                return None
            if t.requires_grad:
                if grad:
                    return None
                t = t.detach()
            cuda = cuda or t.is_cuda
        out.append(t)
    if cuda and torch.cuda.is_current_stream_capturing():
        return None
    return out


def run_op(hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, real_vocab,
           backend, strict, return_entropy, topk, logits_out=None):  # fmt: skip
    """The body of ``detlogp::linear_logp`` on real tensors, for the op and for detlogp.torch's eager
    path that needs no dispatcher (no autograd, no tracing, no capture): the same outputs, except that
    an output the call does not ask for (logits, entropy, the top-k pair) is None here, which the op
    replaces by its (0,) placeholder. logits_out: a contiguous [N, V] f32 tensor the logits are
    written into (with return_logits) instead of a new one."""
    if backend == TORCH_BACKEND_ID:
        _ext.check_environment()  # the C++ lanes check it in the library; this lane here
        check_lane_values(targets, temperature, temperature_rows, real_vocab, ignore_index)
        if topk > real_vocab:  # the library's check of the top-k output, in its words
            raise InputError(f"topk={topk} exceeds real_vocab={real_vocab}: a row has only {real_vocab} real ids")
        out = _torch_lane(
            hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, real_vocab,
            return_entropy, topk,
        )  # fmt: skip
        set_report(
            {
                "requested_backend": backend,
                "strict": False,
                "fallback": False,
                "fallback_reason": "",
                "backend_id": TORCH_BACKEND_ID,
                "contract": False,
                "provenance": _noncontract_provenance(TORCH_BACKEND_ID),
            },
            [],
        )
        return out
    n, v = rows_of(hidden), rows_of(weight)
    # A deferred call (CUDA, not capturing) that meets a bad input writes nothing: its logp (and
    # entropy) rows stay NaN, so a loss built on them shows it before the error is raised.
    defer = _deferred["enabled"] and hidden.is_cuda and not torch.cuda.is_current_stream_capturing()
    if defer:
        logp = hidden.new_full(per_target_shape(targets, n), _NAN, dtype=torch.float32)
    else:
        logp = hidden.new_empty(per_target_shape(targets, n), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    logits = None
    if return_logits:
        logits = hidden.new_empty((n, v), dtype=torch.float32) if logits_out is None else logits_out
    entropy = None
    if return_entropy:
        entropy = (hidden.new_full((n,), _NAN, dtype=torch.float32) if defer
                   else hidden.new_empty((n,), dtype=torch.float32))  # fmt: skip
    topk_ids = hidden.new_empty((n, topk), dtype=torch.int64) if topk else None
    topk_logp = hidden.new_empty((n, topk), dtype=torch.float32) if topk else None
    # Here, on the real tensors (also under torch.compile, which traces the fake below): the autograd
    # graph keeps the caller's tensors, and the backward makes its own aligned copies where it needs them.
    hidden, weight, copies = aligned_operands(hidden, weight, backend)
    if bias is not None or temperature_rows is not None or not targets.is_contiguous():  # else none to copy
        copies += vector_copies((("targets", targets), ("bias", bias), ("temperature_rows", temperature_rows)))
    if temperature_rows is not None and temperature_rows.dim() == 0:
        # One temperature for every row (a 0-d tensor). A host value is also handed over as the scalar,
        # which the library checks first (as `temperature`, at N = 0 too); a CUDA one stays on the device
        # (no sync, capturable), where the library's validation sees it as the rows it is expanded to.
        if not temperature_rows.is_cuda:
            temperature = temperature_rows.item()
        temperature_rows = temperature_rows.expand(n)
    problem = library_problem(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, 0, ignore_index)
    # The tensors as DLPack capsules where torch's __dlpack__ would export them as they are. `problem`
    # and the outputs keep the tensors alive through the call: the extension releases a capsule's
    # hold on its tensor once it has read the array, before the library runs.
    c_problem, (c_logp, c_lse, c_logits, c_entropy, c_ids, c_topk) = exported_problem(
        problem, (logp, lse, logits, entropy, topk_ids, topk_logp)
    )
    report = _ext.linear_logp(
        c_problem, c_logp, c_lse, c_logits, backend, strict, stream_of(hidden), c_entropy, c_ids, c_topk,
        defer_errors=defer, lazy_report=True,
    )  # fmt: skip
    set_report(report, copies)
    return logp, lse, logits, entropy, topk_ids, topk_logp


@torch.library.custom_op("detlogp::linear_logp", mutates_args=())
def linear_logp_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    temperature: float,
    temperature_rows: Optional[Tensor],
    ignore_index: int,
    return_logits: bool,
    real_vocab: int,
    backend: str,
    strict: bool,
    return_entropy: bool,
    topk: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logp, lse, logits, entropy, topk_ids, topk_logp); logp shaped like targets ([N] or [N, K]),
    logits [N, V_local] with return_logits, entropy [N] with return_entropy (docs/contract.md §10),
    topk_ids int64 and topk_logp [N, topk] with topk > 0 (§12), each of shape (0,) otherwise."""
    outs = run_op(
        hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, real_vocab, backend,
        strict, return_entropy, topk,
    )  # fmt: skip
    if all(o is not None for o in outs):
        return outs
    # The op's schema returns six tensors: (0,) placeholders, each its own (outputs may not alias).
    empty = {2: torch.float32, 3: torch.float32, 4: torch.int64, 5: torch.float32}
    return tuple(o if o is not None else hidden.new_empty((0,), dtype=empty[i]) for i, o in enumerate(outs))


@linear_logp_op.register_fake
def _(hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, real_vocab, backend, strict,
      return_entropy, topk):  # fmt: skip
    n, v = rows_of(hidden), rows_of(weight)
    dt = out_dtype(hidden) if backend == TORCH_BACKEND_ID else torch.float32
    logits_shape = (n, v) if return_logits else (0,)
    topk_shape = (n, topk) if topk else (0,)
    return (
        hidden.new_empty(per_target_shape(targets, n), dtype=dt), hidden.new_empty((n,), dtype=dt),
        hidden.new_empty(logits_shape, dtype=dt), hidden.new_empty((n,) if return_entropy else (0,), dtype=dt),
        hidden.new_empty(topk_shape, dtype=torch.int64), hidden.new_empty(topk_shape, dtype=dt),
    )  # fmt: skip


def per_target_shape(targets: Tensor, n: int) -> Tuple[int, ...]:
    """The shape of logp: [N] for [N] targets, [N, K] for K ids a row."""
    return (n, targets.shape[1]) if targets.dim() == 2 else (n,)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, _rl, real_vocab, _b, _s, _re, _k = inputs
    ctx.save_for_backward(hidden, weight, targets, bias, temperature_rows, output[1], output[3], output[4])
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.real_vocab = real_vocab
    # An output the loss does not use gets None, not zeros: an unused entropy adds no term, so the
    # gradient has the logp-only bits (zeros for logp, lse or logits give the same as None).
    ctx.set_materialize_grads(False)


def _backward(ctx, g_logp, g_lse, g_logits, g_entropy, _g_topk_ids, g_topk_logp):
    hidden, weight, targets, bias, temperature_rows, lse, entropy, topk_ids = ctx.saved_tensors
    need = (
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
        bias is not None and ctx.needs_input_grad[3],
        temperature_rows is not None and ctx.needs_input_grad[5],
    )
    n, cd = hidden.shape[0], out_dtype(hidden)
    shared = temperature_rows is not None and temperature_rows.dim() == 0
    if shared:  # a 0-d temperature: the rows it was expanded to, whose gradients sum into it
        temperature_rows = temperature_rows.expand(n)
    inv_t = backward.inverse_temperature(ctx.temperature, temperature_rows, n, cd, hidden.device)
    if g_entropy is not None and g_entropy.numel() == 0:  # no entropy output (return_entropy=False)
        g_entropy = None
    if g_topk_logp is not None and g_topk_logp.numel() == 0:  # no top-k output
        g_topk_logp = None
    gh, gw, gb, gty = backward.chunked_grads(
        hidden, weight, bias, targets, inv_t, lse, g_logp, g_lse, g_logits, 0, ctx.real_vocab, ctx.ignore_index, need,
        ctx.temperature, temperature_rows, entropy=None if g_entropy is None else entropy, g_entropy=g_entropy,
        topk_ids=None if g_topk_logp is None else topk_ids, g_topk_logp=g_topk_logp,
    )  # fmt: skip
    g_temp = None if gty is None else (-gty * inv_t[:, 0]).to(temperature_rows.dtype)
    if g_temp is not None and shared:
        g_temp = g_temp.sum()
    return (
        None if gh is None else gh.to(hidden.dtype), gw, None, gb, None, g_temp, None, None, None, None, None, None,
        None,
    )  # fmt: skip


linear_logp_op.register_autograd(_backward, setup_context=_setup_context)

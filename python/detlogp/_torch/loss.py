"""detlogp.torch.linear_logp_loss: a loss of each row's logp, lse (and entropy) computed inside the op,
forward and backward in one pass over row chunks, without the backward's recompute of the logits.

linear_logp + loss.backward() runs four GEMMs of the forward's size: the forward, then in the
backward the logits recomputed (the upstream gradient is only known once the loss is), dz @ W and
dz^T @ h. Here the loss comes into the op, so a chunk's upstream gradient is known as soon as its lse
is: per chunk of rows the serving forward writes the chunk's fp32 logits z, loss_fn runs on the
chunk's logp / lse (torch autograd on [rows] tensors gives dL/dlogp, dL/dlse, dL/dH), the pinned
logit gradient of docs/contract.md appendix A is applied to the kept z (dz, the bits
linear_logp_grad_logits gives for that z), then grad_hidden = dz @ W and grad_weight += dz^T @ h.
Three GEMMs. The chunk's dz overwrites its own logits (bf16, in place), so the extra memory is one
[rows, V] fp32 chunk besides the gradients, which are computed in the forward and held until the
backward scales them by the loss's upstream gradient.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from .. import _detlogp as _ext, _int_arg, _split_temperature, _what
from .._errors import InputError
from .backward import mm_fp32
from .op import check_lane_values, run_op
from .tensors import check_devices, library_problem, stream_of, vec

# fp32 logits per chunk at most this many bytes (rows a multiple of 64, at least 64): the entry's
# extra memory besides the gradients it returns (its bf16 dz is written over these logits).
LOSS_CHUNK_BYTES = 416 << 20
LOSS_CHUNK_ENV = "DETLOGP_TORCH_LOSS_CHUNK_BYTES"


class LossResult(NamedTuple):
    """loss: the sum of loss_fn over the chunks, in chunk order (0-d fp32, differentiable in hidden,
    weight and bias); logp, lse [N] fp32 and entropy [N] (None unless return_entropy): the forward's
    values, detached (the same bits as detlogp.torch.linear_logp gives)."""

    loss: Tensor
    logp: Tensor
    lse: Tensor
    entropy: Optional[Tensor]


def loss_chunk_rows(n: int, v: int) -> int:
    """Rows per chunk: fp32 logits of at most LOSS_CHUNK_BYTES (DETLOGP_TORCH_LOSS_CHUNK_BYTES), a
    multiple of 64 and at least 64, then evened out over the chunks that takes (no small tail)."""
    budget = int(os.environ.get(LOSS_CHUNK_ENV, LOSS_CHUNK_BYTES))
    r_max = max(64, budget // max(1, 4 * v) // 64 * 64)
    if n <= r_max:
        return max(1, n)
    chunks = (n + r_max - 1) // r_max
    even = (n + chunks - 1) // chunks
    return min(r_max, (even + 63) // 64 * 64)


def linear_logp_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    loss_fn: Callable[..., Tensor],
    *,
    bias: Optional[Tensor] = None,
    temperature: Union[float, Tensor] = 1.0,
    ignore_index: int = -100,
    real_vocab: Optional[int] = None,
    return_entropy: bool = False,
    chunk_rows: Optional[int] = None,
) -> LossResult:
    """A loss of the rows' logp and lse (and entropy), its gradients computed in the same pass.

    hidden [..., D] and weight [V, D] bf16 (CPU: the CPU backend; CUDA: the SM90 backend), targets
    [...] int ids (or ignore_index), bias [V] fp32, temperature a float or a [...] / 0-d fp32 tensor
    (not differentiated). A batch [B, S, ...] is taken as the N rows of its row-major flattening: the
    chunks are those rows, rows slices them (index flattened per-row data), and logp / lse / entropy
    come back in the batch shape. loss_fn(logp, lse, rows) -- with return_entropy loss_fn(logp, lse, entropy,
    rows) -- gets one chunk's [rows] fp32 tensors and rows, the chunk's slice of the N rows (to index
    per-row data: advantages, old logprobs, masks), and returns that chunk's 0-d contribution; the
    loss is their sum in chunk order. So loss_fn must be a sum over rows of terms that depend only on
    each row's own values (every per-token RL objective: policy gradient, PPO's clipped ratio, KL to
    a reference, an entropy bonus; a token mean divides by a count fixed before the call). Gradients
    flow to hidden, weight and bias only, not to other tensors loss_fn reads. An ignored row's logp
    is 0 and takes no logp gradient (as in linear_logp).

    Returns LossResult(loss, logp, lse, entropy). loss.backward() hands the gradients computed in the
    forward to autograd, scaled by the loss's upstream gradient. grad_hidden has dz @ W of each chunk
    in one GEMM (one rounding to bf16); grad_weight accumulates dz^T @ h over the chunks in ascending
    order in weight's dtype (one rounding a chunk: chunk_rows sets how many); grad_bias the column
    sums in fp32. Deterministic run to run for a given N and chunk_rows. Memory besides the returned
    gradients: one [chunk_rows, V] fp32 buffer (default: LOSS_CHUNK_BYTES of it)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, Tensor):
            raise InputError(f"{name} must be a torch tensor, got {_what(t)}")
    if bias is not None and not isinstance(bias, Tensor):
        raise InputError(f"bias must be a torch tensor or None, got {_what(bias)}")
    if not callable(loss_fn):
        raise InputError(f"loss_fn must be callable (logp, lse[, entropy], rows) -> 0-d tensor, got {_what(loss_fn)}")
    if hidden.dtype != torch.bfloat16 or hidden.dim() < 2:
        raise InputError(f"hidden must be a [..., D] bf16 tensor (the contract's operands), got {hidden.dim()}-D "
                         f"{hidden.dtype}")  # fmt: skip
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise InputError(
            f"weight must be a 2-D bf16 tensor (the contract's operands), got {weight.dim()}-D {weight.dtype}"
        )
    batch_shape = tuple(hidden.shape[:-1])
    if tuple(targets.shape) != batch_shape:
        raise InputError(f"targets must have hidden's batch shape {list(batch_shape)}, got {list(targets.shape)}")
    if hidden.dim() > 2:  # the rows of the flattened batch, row-major (a copy only for a view reshape cannot keep)
        hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    check_devices((("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)))
    n, v = hidden.shape[0], weight.shape[0]
    if chunk_rows is not None:
        chunk_rows = _int_arg(chunk_rows, "chunk_rows")
        if chunk_rows < 1:
            raise InputError(f"chunk_rows={chunk_rows} must be >= 1")
    temp, temp_rows = _split_temperature(temperature, n, shape=batch_shape, tensor_type=Tensor)
    if temp_rows is not None:
        if temp_rows.requires_grad:
            raise InputError("linear_logp_loss does not differentiate the temperature: pass it detached")
        check_devices((("temperature", temp_rows),))
        temp_rows = temp_rows.to(torch.float32).expand(n) if temp_rows.dim() == 0 else temp_rows.float().reshape(n)
        temp_rows = temp_rows.contiguous()
    ignore_index = _int_arg(ignore_index, "ignore_index")
    rv = v if real_vocab is None else _int_arg(real_vocab, "real_vocab")
    if rv > v or rv < 1:
        raise InputError(f"real_vocab={rv} must be in [1, V={v}] (the weight covers the whole vocabulary here)")
    # The values, once, before anything is computed (CUDA: one read-back of targets, a sync).
    check_lane_values(targets, temp, temp_rows, rv, ignore_index)
    config = (loss_fn, targets, temp, temp_rows, ignore_index, rv, bool(return_entropy),
              chunk_rows or loss_chunk_rows(n, v))  # fmt: skip
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not grad:
        with torch.no_grad():
            loss, logp, lse, entropy = _run(hidden, weight, bias, config, (False, False, False))[:4]
    else:
        loss, logp, lse, entropy = _LossFunction.apply(hidden, weight, bias, config)
    shaped = [x.reshape(batch_shape) for x in (logp, lse)]
    return LossResult(loss, *shaped, entropy.reshape(batch_shape) if return_entropy else None)


class _LossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, config):
        need = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        loss, logp, lse, entropy, grads = _run(hidden, weight, bias, config, need)
        ctx.grads = grads
        ctx.mark_non_differentiable(logp, lse, entropy)
        return loss, logp, lse, entropy

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_lse, _g_entropy):
        grads, ctx.grads = ctx.grads, None  # a second backward through this graph has nothing left
        if grads is None:
            raise RuntimeError("linear_logp_loss: backward ran twice; its gradients were handed over already")
        if g_loss is None:
            return None, None, None, None
        scale_in_place([g for g in grads if g is not None], g_loss)
        return grads[0], grads[1], grads[2], None


def scale_in_place(grads, factor: Tensor) -> None:
    """grads *= factor, in place (the entry owns them), skipped where factor is 1 (x * 1 is x, bit
    for bit): loss.backward() of a plain sum or mean hands 1. The factor is read on the host: one sync
    (the forward already makes one, reading the targets back), so the product runs as torch's
    vectorized multiply by a host scalar (fp32 product, one rounding). mul_ by the 0-d CUDA tensor
    itself runs torch's strided, un-vectorized kernel: 2.4 ms on the 8B head's weight gradient, whose
    one read and write takes 0.83 ms (H100)."""
    value = float(factor)
    if value == 1.0:
        return
    for g in grads:
        g.mul_(value)


def _chunk_loss(loss_fn, logp, lse, entropy, rows: slice, with_entropy: bool):
    """(this chunk's loss, dL/dlogp, dL/dlse, dL/dH): loss_fn under autograd on detached leaves."""
    leaves = [logp.detach().requires_grad_(), lse.detach().requires_grad_()]
    if with_entropy:
        leaves.append(entropy.detach().requires_grad_())
    with torch.enable_grad():
        out = loss_fn(*leaves, rows)
        if not isinstance(out, Tensor) or out.dim() != 0:
            shape = list(out.shape) if isinstance(out, Tensor) else _what(out)
            raise InputError(f"loss_fn must return a 0-d tensor (the chunk's loss), got {shape} for rows {rows}")
        gs = torch.autograd.grad(out, leaves, allow_unused=True) if out.requires_grad else [None] * len(leaves)
    gs = [None if g is None else g.float().contiguous() for g in gs]
    return out.detach(), gs[0], gs[1], (gs[2] if with_entropy else None)


def _run(hidden, weight, bias, config, need):
    """The chunk loop: (loss, logp, lse, entropy, (grad_hidden, grad_weight, grad_bias))."""
    loss_fn, targets, temp, temp_rows, ignore_index, rv, with_entropy, rows_per = config
    need_h, need_w, need_b = need
    any_grad = need_h or need_w or need_b
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    hidden_d, weight_d = hidden.detach(), weight.detach()
    bias_d = None if bias is None else bias.detach()
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=dev)
    grad_h = torch.empty_like(hidden_d) if need_h else None
    grad_w = None
    grad_b = torch.zeros(v, dtype=torch.float32, device=dev) if need_b else None
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    buf = torch.empty((min(rows_per, n), v), dtype=torch.float32, device=dev) if any_grad and n > 0 else None
    stream = stream_of(hidden_d)
    for r0 in range(0, n, rows_per):
        r1 = min(n, r0 + rows_per)
        rows = slice(r0, r1)
        h_c, t_c = hidden_d[rows], targets[rows]
        tr_c = None if temp_rows is None else temp_rows[rows]
        z = None if buf is None else buf[: r1 - r0]
        lp, ls, _, ent, _, _ = run_op(
            h_c, weight_d, t_c, bias_d, temp, tr_c, ignore_index, z is not None, rv, "", False, with_entropy, 0,
            logits_out=z,
        )  # fmt: skip
        logp[rows], lse[rows] = lp, ls
        if with_entropy:
            entropy[rows] = ent
        c_loss, g_logp, g_lse, g_ent = _chunk_loss(loss_fn, lp, ls, ent, rows, with_entropy)
        loss += c_loss.float()
        if z is None:
            continue
        # dz over the chunk's own logits: row n's bf16 gradient fills the first half of its fp32 bytes.
        dz = z.view(torch.bfloat16)[:, :v]
        problem = (z, t_c, temp, tr_c, rv, 0, ignore_index)
        # The values were checked before the loop, so the CUDA call need not wait for its verdict.
        _ext.linear_logp_grad_from_logits(
            problem, ls, vec(g_logp), vec(g_lse), dz, stream, vec(ent) if g_ent is not None else None, vec(g_ent),
            defer_errors=dz.is_cuda,
        )  # fmt: skip
        if need_h and dz.is_cuda:
            torch.mm(dz, weight_d, out=grad_h[rows])  # cuBLAS: fp32 inside, one rounding to bf16
        elif need_h:
            grad_h[rows] = _mm(dz, weight_d, hidden_d.dtype)
        if need_w:
            if grad_w is None:
                grad_w = _mm(dz.t(), h_c, weight_d.dtype)
            elif dz.is_cuda:
                grad_w.addmm_(dz.t(), h_c)  # cuBLAS: fp32 inside, one rounding to weight's dtype
            else:
                grad_w.copy_(grad_w.float() + mm_fp32(dz.t(), h_c))
        if need_b:
            grad_b += dz.sum(0, dtype=torch.float32)
    if need_w and grad_w is None:  # N = 0
        grad_w = torch.zeros_like(weight_d)
    if need_h and n == 0:
        grad_h = torch.zeros_like(hidden_d)
    grads = (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype))
    return loss, logp, lse, entropy, grads


def _mm(a: Tensor, b: Tensor, dtype) -> Tensor:
    """a @ b rounded once to dtype: cuBLAS's bf16 GEMM on CUDA (fp32 accumulation inside), fp32 on CPU."""
    if a.is_cuda:
        return torch.mm(a, b)
    return mm_fp32(a, b).to(dtype)

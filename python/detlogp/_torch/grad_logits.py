"""The custom op ``detlogp::grad_logits``: the logit gradient dz of one vocabulary chunk (the
fused backward's kernel; the CPU implementation for CPU tensors, the SM90 kernel for CUDA)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .. import _detlogp as _ext
from .tensors import library_problem, stream_of, vec


def grad_logits(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    lse: Tensor,
    g_logp: Optional[Tensor] = None,
    g_lse: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    temperature: Union[float, Tensor] = 1.0,
    ignore_index: int = -100,
    vocab_start: int = 0,
    real_vocab: Optional[int] = None,
    out: Optional[Tensor] = None,
) -> Tensor:
    """dL/dz [N, C] bf16 of one vocabulary chunk (the fused backward's kernel, CPU or SM90):
    weight [C, D] bf16 is rows vocab_start .. vocab_start + C - 1 of the head, lse [N] fp32 the
    forward's, g_logp / g_lse [N] fp32 the upstream gradients (None = zeros), temperature a float
    or an [N] fp32 tensor. Per element, with the fp32 order pinned in docs/contract.md appendix A:
    0 for padding ids >= real_vocab, else ((g_lse - g_logp) * exp(y - lse) + g_logp [at the
    target]) / T, rounded to bf16. out: an [N, C] bf16 tensor (row stride >= C) to write into."""
    c = weight.shape[0]
    temp_rows = None
    temp = 1.0
    if isinstance(temperature, Tensor):
        temp_rows = temperature.reshape(-1)
    else:
        temp = float(temperature)
    rv = int(vocab_start) + c if real_vocab is None else int(real_vocab)
    if out is None:
        return grad_logits_op(
            hidden, weight, targets, bias, temp, temp_rows, rv, int(vocab_start), int(ignore_index), lse, g_logp, g_lse
        )
    _grad_logits_into(
        hidden, weight, targets, bias, temp, temp_rows, rv, int(vocab_start), int(ignore_index), lse, g_logp, g_lse, out
    )
    return out


def _grad_logits_into(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start,
                      ignore_index, lse, g_logp, g_lse, dz):  # fmt: skip
    problem = library_problem(
        hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index
    )
    _ext.linear_logp_grad_logits(problem, lse.contiguous(), vec(g_logp), vec(g_lse), dz, stream_of(hidden))


@torch.library.custom_op("detlogp::grad_logits", mutates_args=())
def grad_logits_op(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor], temperature: float,
                   temperature_rows: Optional[Tensor], real_vocab: int, vocab_start: int, ignore_index: int,
                   lse: Tensor, g_logp: Optional[Tensor], g_lse: Optional[Tensor]) -> Tensor:  # fmt: skip
    dz = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.bfloat16, device=hidden.device)
    _grad_logits_into(
        hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index, lse,
        g_logp, g_lse, dz,
    )  # fmt: skip
    return dz


@grad_logits_op.register_fake
def _(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index, lse, g_logp,
      g_lse):  # fmt: skip
    return hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.bfloat16)

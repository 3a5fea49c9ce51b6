"""The custom op ``detlogp::grad_logits``: the logit gradient dz of one vocabulary chunk (the
fused backward's kernel; the CPU implementation for CPU tensors, the SM90 kernel for CUDA)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .. import _detlogp as _ext, _int_arg, _split_temperature
from .._errors import InputError
from .tensors import check_devices, library_problem, rows_of, stream_of, vec


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
    entropy: Optional[Tensor] = None,
    g_entropy: Optional[Tensor] = None,
) -> Tensor:
    """dL/dz [N, C] bf16 of one vocabulary chunk (the fused backward's kernel, CPU or SM90):
    weight [C, D] bf16 is rows vocab_start .. vocab_start + C - 1 of the head, lse [N] fp32 the
    forward's, g_logp / g_lse [N] fp32 the upstream gradients (None = zeros), temperature a float,
    a 0-d floating tensor or an [N] fp32 tensor (linear_logp's rules). Per element, with the fp32
    order pinned in docs/contract.md appendix A: 0 for padding ids >= real_vocab, else
    ((g_lse - g_logp) * exp(y - lse) + g_logp [at the target]) / T, rounded to bf16. g_entropy
    [N] fp32 (dL/dH, with entropy [N] fp32 the forward's H) adds the entropy term: p's factor gains
    -g_entropy * (y - lse + H), skipped where p == 0; without it the bits are those without entropy
    (an entropy given alone is not read). out: an [N, C]
    bf16 tensor (row stride >= C) to write into. A matrix without unit stride along D and a
    vector whose stride is not 1 are copied (contiguous) first, as by linear_logp, without a report
    (grad_logits keeps none); nothing else is: a view the SM90 backend's TMA loads cannot read is
    refused, as by the C++ library."""
    named = (("hidden", hidden), ("weight", weight), ("targets", targets), ("lse", lse), ("g_logp", g_logp),
             ("g_lse", g_lse), ("bias", bias), ("out", out), ("entropy", entropy),
             ("g_entropy", g_entropy))  # fmt: skip
    if lse is None:  # the library's words (an absent lse never reaches it: the op needs a tensor)
        raise InputError("lse is required (the forward's [N] f32 lse)")
    for name, t in named:
        if (t is not None or name in ("hidden", "weight", "targets")) and not isinstance(t, Tensor):
            raise InputError(f"{name} must be a torch tensor, got {type(t).__name__}")
    check_devices(named)
    n = rows_of(hidden)  # shapes, dtypes and placement are the library's to refuse, in its words
    temp, temp_rows = _split_temperature(temperature, n, tensor_type=Tensor)
    if temp_rows is not None:
        temp_rows = temp_rows.to(torch.float32).expand(n) if temp_rows.dim() == 0 else temp_rows
        check_devices((("temperature", temp_rows),))
    vocab_start = _int_arg(vocab_start, "vocab_start")
    ignore_index = _int_arg(ignore_index, "ignore_index")
    rv = vocab_start + rows_of(weight) if real_vocab is None else _int_arg(real_vocab, "real_vocab")
    if out is None:
        return grad_logits_op(
            hidden, weight, targets, bias, temp, temp_rows, rv, vocab_start, ignore_index, lse, g_logp, g_lse, entropy,
            g_entropy,
        )  # fmt: skip
    _grad_logits_into(
        hidden, weight, targets, bias, temp, temp_rows, rv, vocab_start, ignore_index, lse, g_logp, g_lse, entropy,
        g_entropy, out,
    )  # fmt: skip
    return out


def _grad_logits_into(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start,
                      ignore_index, lse, g_logp, g_lse, entropy, g_entropy, dz):  # fmt: skip
    problem = library_problem(
        hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index
    )
    _ext.linear_logp_grad_logits(
        problem, lse.contiguous(), vec(g_logp), vec(g_lse), dz, stream_of(hidden), vec(entropy), vec(g_entropy)
    )


@torch.library.custom_op("detlogp::grad_logits", mutates_args=())
def grad_logits_op(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor], temperature: float,
                   temperature_rows: Optional[Tensor], real_vocab: int, vocab_start: int, ignore_index: int,
                   lse: Tensor, g_logp: Optional[Tensor], g_lse: Optional[Tensor], entropy: Optional[Tensor],
                   g_entropy: Optional[Tensor]) -> Tensor:  # fmt: skip
    dz = torch.empty((rows_of(hidden), rows_of(weight)), dtype=torch.bfloat16, device=hidden.device)
    _grad_logits_into(
        hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index, lse,
        g_logp, g_lse, entropy, g_entropy, dz,
    )  # fmt: skip
    return dz


@grad_logits_op.register_fake
def _(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index, lse, g_logp,
      g_lse, entropy, g_entropy):  # fmt: skip
    return hidden.new_empty((rows_of(hidden), rows_of(weight)), dtype=torch.bfloat16)

"""Argument checks of detlogp.torch and the tensor forms the C++ library takes."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import TORCH_BACKEND_ID
from .._errors import InputError


def stream_of(t: Tensor) -> int:
    """The caller's current CUDA stream on t's device (0 for host tensors): the library runs there."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def out_dtype(hidden: Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def contiguous_rows(t: Tensor) -> Tensor:
    # The library takes row-strided matrices with unit column stride; anything else is copied once.
    return t if t.stride(-1) == 1 else t.contiguous()


def vec(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def library_problem(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start,
                    ignore_index):  # fmt: skip
    """The extension's problem tuple (python/src/detlogp_ext.cpp, Problem) of one call."""
    return (
        contiguous_rows(hidden), contiguous_rows(weight), targets.contiguous(), vec(bias), temperature,
        vec(temperature_rows), real_vocab, vocab_start, ignore_index,
    )  # fmt: skip


def check_tensors(hidden, weight, targets, bias, temperature_rows, contract: bool):
    if hidden.dim() != 2 or weight.dim() != 2:
        raise InputError(f"hidden must be [N, D] and weight [V, D]; got {list(hidden.shape)} and {list(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise InputError(f"weight has D={weight.shape[1]} columns but hidden has D={hidden.shape[1]}")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise InputError(f"targets must be [N={hidden.shape[0]}], got {list(targets.shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise InputError(f"targets must be int32 or int64, got {targets.dtype}")
    named = [("weight", weight), ("targets", targets), ("bias", bias), ("temperature", temperature_rows)]
    for name, t in named:
        if t is not None and t.device != hidden.device:
            raise InputError(f"{name} is on {t.device} but hidden is on {hidden.device}; all tensors must live together")
    if contract:
        for name, t in (("hidden", hidden), ("weight", weight)):
            if t.dtype != torch.bfloat16:
                raise InputError(
                    f"{name} must be torch.bfloat16 for the contract backends, got {t.dtype} "
                    f"(backend='{TORCH_BACKEND_ID}' takes other float dtypes)"
                )
        for name, t in (("bias", bias), ("temperature", temperature_rows)):
            if t is not None and t.dtype != torch.float32:
                raise InputError(f"{name} must be torch.float32 for the contract backends, got {t.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise InputError(f"bias must be [V={weight.shape[0]}], got {list(bias.shape)}")
    if temperature_rows is not None and (temperature_rows.dim() != 1 or temperature_rows.shape[0] != hidden.shape[0]):
        raise InputError(f"temperature must be a float or [N={hidden.shape[0]}], got {list(temperature_rows.shape)}")

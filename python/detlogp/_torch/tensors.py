"""Argument checks of detlogp.torch and the tensor forms the C++ library takes."""

from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import TORCH_BACKEND_ID
from .._errors import InputError

# The backend whose TMA loads need aligned operands (detlogp.torch copies misaligned ones for it).
SM90_BACKEND_ID = "cuda-fused-linear-logp-sm90-contract-v1"


# The raw handle of a device's current stream, without building a torch.cuda.Stream object (absent
# from builds without CUDA, whose tensors are never CUDA ones).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(t: Tensor) -> int:
    """The caller's current CUDA stream on t's device (0 for host tensors): the library runs there."""
    if not t.is_cuda:
        return 0
    return _raw_stream(t.get_device()) if _raw_stream is not None else torch.cuda.current_stream(t.device).cuda_stream


def out_dtype(hidden: Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def contiguous_rows(t: Tensor) -> Tensor:
    # The library takes row-strided matrices with unit column stride; anything else is copied once.
    return t if t.dim() == 0 or t.stride(-1) == 1 else t.contiguous()


def vec(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def vector_copies(named) -> List[dict]:
    """The report's "copies" entries of the vectors library_problem copies (contiguous): each 1-D tensor
    of more than one element whose stride is not 1 (the library reads vectors contiguously)."""
    return [
        {"argument": name, "reason": f"its stride is {t.stride(0)}, not 1 (the library reads vectors contiguously)"}
        for name, t in named
        if t is not None and t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1
    ]


def library_problem(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start,
                    ignore_index):  # fmt: skip
    """The extension's problem tuple (python/src/detlogp_ext.cpp, Problem) of one call."""
    return (
        contiguous_rows(hidden), contiguous_rows(weight), targets.contiguous(), vec(bias), temperature,
        vec(temperature_rows), real_vocab, vocab_start, ignore_index,
    )  # fmt: skip


def exported_problem(problem, outputs):
    """(problem, outputs) as the extension is handed them: the problem tuple of library_problem with
    its tensors (hidden, weight, targets, bias, temperature_rows) and the outputs as dlpack_exports
    gives them, in one pass. The caller keeps `problem` and the outputs alive through the call."""
    h, w, t, b, temp, tr, rv, vs, ii = problem
    c = dlpack_exports((h, w, t, b, tr, *outputs))
    return (c[0], c[1], c[2], c[3], temp, c[4], rv, vs, ii), c[5:]


_to_dlpack = torch._C._to_dlpack
_has_torch_function_unary = torch._C._has_torch_function_unary
_EXPORTED_TYPES = (Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


def _dlpack_syncs_cuda() -> bool:
    """Whether this torch's Tensor.__dlpack__(), called without a stream as nanobind calls it, may
    order streams for a CUDA tensor (a default other than -1, "no synchronization")."""
    try:
        return inspect.signature(Tensor.__dlpack__).parameters["stream"].default != -1
    except (KeyError, TypeError, ValueError):
        return True


_DLPACK_SYNCS_CUDA = _dlpack_syncs_cuda()


def dlpack_exports(tensors) -> list:
    """The tensors (None kept) as the extension is handed them: the DLPack capsule of each one that
    Tensor.__dlpack__ would export as it is (torch._C._to_dlpack, the function its checks lead to),
    else the tensor itself. nanobind imports a tensor by calling __dlpack__, whose Python checks
    cost ~2 us a tensor; here they cost a few attribute reads. A tensor those checks refuse (one
    that requires grad, has the conjugate bit, another layout, lives on a CUDA device other than
    the current one), one with a torch-function override or a __dlpack__ of its own, a CUDA tensor
    under a torch whose __dlpack__ may order streams, and one whose export raises go to nanobind
    as before, which imports (or refuses) them in the same way and words. A capsule is imported
    once (each call gets fresh ones) and does not keep its tensor alive past its import: the caller
    holds the tensors until the extension returns."""
    out = []
    device = None
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        if (
            type(t) in _EXPORTED_TYPES
            and not _has_torch_function_unary(t)
            and not t.requires_grad
            and t.layout is _STRIDED
            and not t.is_conj()
        ):
            if t.is_cuda:
                if _DLPACK_SYNCS_CUDA:
                    out.append(t)
                    continue
                if device is None:
                    try:
                        device = torch.cuda.current_device()
                    except Exception:  # noqa: BLE001 - __dlpack__ would raise it: no CUDA tensor is exported here
                        device = -1
                if t.get_device() != device:
                    out.append(t)
                    continue
            try:
                t = _to_dlpack(t)
            except Exception:  # noqa: BLE001 - __dlpack__ would raise the same: nanobind's import decides
                pass
        out.append(t)
    return out


def check_devices(named) -> None:
    """Every tensor argument lives on the CPU or a CUDA device (meta and other devices have no
    memory the library can read)."""
    for name, t in named:
        if t is not None and not (t.is_cpu or t.is_cuda):
            raise InputError(f"{name} is on {t.device}; detlogp.torch takes CPU and CUDA tensors")


try:
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # pragma: no cover - older torch
    _is_fake = None
_is_compiling = getattr(torch.compiler, "is_compiling", None)


def traced_now() -> bool:
    """True while torch.compile traces (dynamo's frame evaluation or its export)."""
    return _is_compiling is not None and _is_compiling()


def traced(t: Tensor) -> bool:
    """True for a tensor being traced (torch.compile: fake or functional), which has no pointer."""
    if traced_now():
        return True
    return _is_fake is not None and bool(_is_fake(t))


def library_row_stride(t: Tensor) -> int:
    """The row stride the extension passes for matrix t (python/src/detlogp_ext.cpp, view_of): its
    own, except for a single row, whose own is kept only where it spans the row and is a multiple
    of 16 bytes (else the width)."""
    rows, cols, stride = t.shape[0], t.shape[1], t.stride(0)
    if rows > 1:
        return stride
    return stride if stride >= cols and (stride * t.element_size()) % 16 == 0 else cols


def tma_misalignment(t: Tensor) -> Optional[str]:
    """Why the SM90 kernels' TMA loads cannot read matrix t in place (None: they can): they need
    a unit column stride, a 16-byte aligned base and a row stride of a multiple of 16 bytes. A
    traced tensor has no pointer: its storage offset decides (allocator blocks are aligned)."""
    es = t.element_size()
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return f"its column stride is {t.stride(-1)}, not 1"
    stride = library_row_stride(t)
    if (stride * es) % 16 != 0:
        return f"its row stride of {stride} elements ({stride * es} bytes) is not a multiple of 16 bytes"
    if (t.storage_offset() * es) % 16 != 0:
        off = t.storage_offset()
        return f"it starts at element {off} of its storage (byte {off * es}), not on a 16-byte boundary"
    if not traced(t) and t.data_ptr() % 16 != 0:
        return f"its base address 0x{t.data_ptr():x} is not 16-byte aligned"
    return None


def copy_reason(t: Tensor, tma: bool) -> Optional[str]:
    """Why detlogp.torch copies matrix t before the library reads it (None: it does not). Every
    device: a column stride other than 1. tma (CUDA under the auto or SM90 backend): a bf16 matrix
    its TMA loads cannot read in place (tma_misalignment). Empty matrices are the library's to
    judge."""
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        return None
    if t.stride(-1) != 1 and t.shape[1] > 1:
        return f"its column stride is {t.stride(-1)}, not 1 (the library reads rows with unit stride)"
    if tma and t.dtype == torch.bfloat16:
        why = tma_misalignment(t)
        if why is not None:
            return f"{why} (TMA requirement of the SM90 backend)"
    return None


def aligned_copy(t: Tensor) -> Tensor:
    """t in fresh storage whose rows start on 16-byte boundaries: contiguous when a row is a
    multiple of 16 bytes, else rows padded with zeros to one (a view of the first D columns; the
    library's own host-to-GPU staging pads the same way). A torch op: autograd goes through it."""
    d = t.shape[1]
    pad = -d % (16 // t.element_size())
    return F.pad(t, (0, pad))[:, :d] if pad else t.clone(memory_format=torch.contiguous_format)


def tma_possible(hidden: Tensor, backend: str) -> bool:
    """Whether the SM90 backend may serve a call with these tensors: CUDA, auto or SM90 requested."""
    return hidden.is_cuda and backend in ("", SM90_BACKEND_ID)


def aligned_operands(hidden: Tensor, weight: Tensor, backend: str) -> Tuple[Tensor, Tensor, List[dict]]:
    """hidden and weight as the library can read them in place: each one copy_reason names is
    copied once (aligned_copy where the SM90 backend may serve, else contiguous). Returns the
    operands and the report's "copies" entry: {"argument", "reason"} of every copy (empty: none).
    Called on real tensors (inside the ops), never while tracing."""
    tma = tma_possible(hidden, backend)
    if not tma and hidden.is_contiguous() and weight.is_contiguous():
        return hidden, weight, []  # copy_reason: a contiguous matrix has unit column stride
    copies: List[dict] = []
    out = []
    for name, t in (("hidden", hidden), ("weight", weight)):
        why = copy_reason(t, tma)
        if why is not None:
            t = aligned_copy(t) if tma and t.dtype == torch.bfloat16 else t.contiguous()
            copies.append({"argument": name, "reason": why})
        out.append(t)
    return out[0], out[1], copies


def rows_of(t: Tensor) -> int:
    """t's first extent (0 for a 0-d tensor, whose rank the library refuses in its own words)."""
    return t.shape[0] if t.dim() > 0 else 0


def _memory(t: Tensor) -> str:
    return "CUDA" if t.is_cuda else "host"


def check_tensors(hidden, weight, targets, bias, temperature_rows, contract: bool):
    """The checks before a call without tp_group. The contract backends: only what the library cannot
    see (the device types); the library refuses the rest in its own words. The torch lane computes in
    torch: the library's shape and placement rules, in its words (its targets and temperature values
    get the library's own check inside the op, op.check_lane_values)."""
    check_devices((("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias),
                   ("temperature", temperature_rows)))  # fmt: skip
    if contract:
        return
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.dim() != 2:
            raise InputError(f"{name} must be 2-D, got ndim={t.dim()}")
    if hidden.shape[1] == 0:
        raise InputError("hidden has D=0 columns; the hidden size must be >= 1")
    if weight.shape[0] == 0:
        raise InputError("weight has V_local=0 rows; the vocabulary shard must be non-empty")
    if weight.shape[1] != hidden.shape[1]:
        raise InputError(f"weight has D={weight.shape[1]} columns but hidden has D={hidden.shape[1]}")
    for name, t in (("weight", weight), ("targets", targets), ("bias", bias), ("temperature_rows", temperature_rows)):
        if t is None:
            continue
        if t.is_cuda != hidden.is_cuda:
            raise InputError(
                f"{name} is in {_memory(t)} memory but hidden is in {_memory(hidden)} memory; "
                "all tensors of a call must live together"
            )
        if t.is_cuda and t.device != hidden.device:
            raise InputError(f"{name} is on CUDA device {t.device.index} but hidden is on device {hidden.device.index}")
    if bias is not None and bias.dim() != 1:
        raise InputError(f"bias must be 1-D, got ndim={bias.dim()}")
    if bias is not None and bias.shape[0] != weight.shape[0]:
        raise InputError(f"bias has {bias.shape[0]} elements, expected {weight.shape[0]}")

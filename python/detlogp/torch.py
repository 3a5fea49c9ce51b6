"""detlogp.torch: the PyTorch operator, with autograd.

linear_logp(hidden, weight, targets, ...) -> (logp, lse[, logits]) runs the contract-bearing
backends (SM90 on CUDA tensors, the CPU backend on CPU tensors) through the C++ library on the
caller's current CUDA stream. It is a torch custom op (``detlogp::linear_logp``) with a fake
implementation, so it traces under torch.compile and replays inside CUDA graphs.

The backward recomputes the logits one vocabulary chunk at a time (never an [N, V] buffer), in a
fixed order, so gradients are deterministic run to run. For CUDA bf16 tensors served by the SM90
backend it is fused: one kernel per chunk (linear_logp_grad_logits) recomputes the chunk's logits
and writes the bf16 logit gradient dz directly, then two GEMMs (dz @ W_c into an fp32 hidden
gradient, dz^T @ h for the weight chunk). Elsewhere (CPU, other dtypes, a temperature gradient,
a gradient through the returned logits, or DETLOGP_TORCH_FUSED_BACKWARD=0) the chunk loop is
written in torch with BACKWARD_VOCAB_CHUNK rows per chunk. Gradients are not part of the numeric
contract (only logp/lse are).
"""

from __future__ import annotations

import math
import os
import threading
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import TORCH_BACKEND_ID, _detlogp as _ext, _noncontract_provenance, shard_tiles
from ._errors import BackendError, ConfigError, DetlogpError, InputError, StrictModeError, TargetIndexError

__all__ = [
    "BACKWARD_FUSED_CHUNK_BYTES",
    "BACKWARD_VOCAB_CHUNK",
    "TORCH_BACKEND_ID",
    "grad_logits",
    "last_backward_path",
    "last_report",
    "linear_logp",
]

# Vocabulary rows per backward chunk. The backward's extra memory, besides the gradients it
# returns, is about N*C*6 + N*D*8 + C*D*6 bytes for C = BACKWARD_VOCAB_CHUNK: the fp32 logits chunk
# and its bf16 copy, the fp32 hidden-gradient accumulator and one GEMM result, the fp32 weight-
# gradient chunk and its cast. Never [N, V].
BACKWARD_VOCAB_CHUNK = 4096

# The fused backward's chunk: C vocabulary rows with the bf16 dz chunk [N, C] at most this many
# bytes (C a multiple of 256, at least 256). Its extra memory besides the gradients is about
# N*C*2 + N*D*8 bytes: dz, the fp32 hidden-gradient accumulator and one GEMM result.
BACKWARD_FUSED_CHUNK_BYTES = 256 << 20

# DETLOGP_TORCH_FUSED_BACKWARD=0 keeps the torch chunk loop on CUDA too (for comparison).
FUSED_BACKWARD_ENV = "DETLOGP_TORCH_FUSED_BACKWARD"
SM90_BACKEND_ID = "cuda-fused-linear-logp-sm90-contract-v1"

_tls = threading.local()


def last_report() -> Optional[dict]:
    """The report of this thread's last eager detlogp.torch call: which backend served it and its
    provenance. (A replayed CUDA graph runs no Python, so it reports nothing new.)"""
    return getattr(_tls, "report", None)


# Process-wide, not thread-local: autograd runs CUDA backward passes on its own worker threads.
_last_backward = {"path": None}


def last_backward_path() -> Optional[str]:
    """How the process's most recent detlogp.torch backward computed its chunks: "fused" (the SM90
    grad-logits kernel + two GEMMs per chunk) or "torch" (the torch chunk loop); None before any.
    (Autograd runs CUDA backward passes on its own threads, so this is not per calling thread.)"""
    return _last_backward["path"]


def _stream_of(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _out_dtype(hidden: Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


# --- forward lanes ---------------------------------------------------------------------------


def _torch_lane(hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, real_vocab):
    """The plain, non-contract lane: F.linear + log_softmax in fp32 (fp64 for fp64 inputs)."""
    cd = _out_dtype(hidden)
    z = F.linear(hidden.to(cd), weight.to(cd), None if bias is None else bias.to(cd))
    inv_t = (1.0 / temperature_rows.to(cd))[:, None] if temperature_rows is not None else 1.0 / temperature
    y = z * inv_t
    if real_vocab < weight.shape[0]:
        y = y.masked_fill(torch.arange(weight.shape[0], device=y.device) >= real_vocab, float("-inf"))
    lse = torch.logsumexp(y, dim=1)
    ignored = targets == ignore_index
    y_t = y.gather(1, torch.where(ignored, 0, targets).long()[:, None])[:, 0]
    logp = torch.where(ignored, torch.zeros_like(lse), y_t - lse)
    logits = z if return_logits else z.new_empty((0,))
    return logp, lse, logits


def _check_tensors(hidden, weight, targets, bias, temperature_rows, contract: bool):
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


def _contiguous_rows(t: Tensor) -> Tensor:
    # The library takes row-strided matrices with unit column stride; anything else is copied once.
    return t if t.stride(-1) == 1 else t.contiguous()


def _vec(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


@torch.library.custom_op("detlogp::linear_logp", mutates_args=())
def _linear_logp_op(
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
) -> Tuple[Tensor, Tensor, Tensor]:
    if backend == TORCH_BACKEND_ID:
        _ext.check_environment()  # the C++ lanes check it in the library; this lane here
        out = _torch_lane(
            hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, real_vocab
        )
        _tls.report = {
            "requested_backend": backend,
            "strict": False,
            "fallback": False,
            "fallback_reason": "",
            "backend_id": TORCH_BACKEND_ID,
            "contract": False,
            "provenance": _noncontract_provenance(TORCH_BACKEND_ID),
        }
        return out
    n, v = hidden.shape[0], weight.shape[0]
    logp = hidden.new_empty((n,), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    logits = hidden.new_empty((n, v) if return_logits else (0,), dtype=torch.float32)
    _tls.report = _ext.linear_logp(
        _contiguous_rows(hidden), _contiguous_rows(weight), targets.contiguous(), _vec(bias), temperature,
        _vec(temperature_rows), real_vocab, 0, ignore_index, logp, lse, logits if return_logits else None,
        backend, strict, _stream_of(hidden),
    )  # fmt: skip
    return logp, lse, logits


@_linear_logp_op.register_fake
def _(hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, real_vocab, backend, strict):
    n, v = hidden.shape[0], weight.shape[0]
    dt = _out_dtype(hidden) if backend == TORCH_BACKEND_ID else torch.float32
    logits_shape = (n, v) if return_logits else (0,)
    return hidden.new_empty((n,), dtype=dt), hidden.new_empty((n,), dtype=dt), hidden.new_empty(logits_shape, dtype=dt)


# --- backward --------------------------------------------------------------------------------


# aten::mm.dtype (bf16 x bf16 -> fp32 on CUDA) exists from torch 2.8 on; older: upcast.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with an fp32 (or fp64) result. bf16 operands on CUDA stay bf16 (fp32 accumulate and
    output, tensor cores); elsewhere they are upcast."""
    if a.dtype == torch.float64 or b.dtype == torch.float64:
        return torch.mm(a.double(), b.double())
    if a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


_SM90_AVAILABLE: Optional[bool] = None


def _sm90_available() -> bool:
    global _SM90_AVAILABLE
    if _SM90_AVAILABLE is None:
        _SM90_AVAILABLE = any(b["id"] == SM90_BACKEND_ID and b["available"] for b in _ext.list_backends())
    return _SM90_AVAILABLE


def _tma_ok(t: Tensor) -> bool:
    """What the SM90 kernel's TMA loads need: unit column stride, 16-byte base and row stride.
    A traced (fake) tensor has no pointer: its storage offset decides (allocator blocks are
    aligned)."""
    es = t.element_size()
    if t.stride(-1) != 1 or (t.shape[0] > 1 and (t.stride(0) * es) % 16 != 0):
        return False
    if (t.storage_offset() * es) % 16 != 0:
        return False
    return _traced(t) or t.data_ptr() % 16 == 0


def _traced(t: Tensor) -> bool:
    """True for a tensor being traced (torch.compile: fake or functional), which has no pointer."""
    f = getattr(torch.compiler, "is_compiling", None)
    if f is not None and f():
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake

        return bool(is_fake(t))
    except ImportError:  # pragma: no cover - older torch
        return False


def _fused_backward_ok(hidden: Tensor, weight: Tensor, need_t: bool, g_logits: Optional[Tensor]) -> bool:
    if os.environ.get(FUSED_BACKWARD_ENV, "1") == "0" or need_t:
        return False
    if g_logits is not None and g_logits.numel() > 0:
        return False
    if not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
        return False
    return hidden.shape[1] % 8 == 0 and _tma_ok(hidden) and _tma_ok(weight) and _sm90_available()


def _fused_chunk_rows(n: int, v: int) -> int:
    """Vocabulary rows per fused chunk: at most BACKWARD_FUSED_CHUNK_BYTES of bf16 dz (a multiple of
    256, at least 256), then evened out over the chunks that takes (no small tail chunk)."""
    c_max = min(v, max(256, BACKWARD_FUSED_CHUNK_BYTES // max(1, 2 * n) // 256 * 256))
    chunks = (v + c_max - 1) // c_max
    if chunks == 1:
        return c_max
    even = (v + chunks - 1) // chunks
    return min(c_max, (even + 255) // 256 * 256)


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
        return _grad_logits_op(
            hidden, weight, targets, bias, temp, temp_rows, rv, int(vocab_start), int(ignore_index), lse, g_logp, g_lse
        )
    _grad_logits_into(
        hidden, weight, targets, bias, temp, temp_rows, rv, int(vocab_start), int(ignore_index), lse, g_logp, g_lse, out
    )
    return out


def _grad_logits_into(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start,
                      ignore_index, lse, g_logp, g_lse, dz):  # fmt: skip
    _ext.linear_logp_grad_logits(
        _contiguous_rows(hidden), _contiguous_rows(weight), targets.contiguous(), _vec(bias), temperature,
        _vec(temperature_rows), real_vocab, vocab_start, ignore_index, lse.contiguous(), _vec(g_logp), _vec(g_lse), dz,
        _stream_of(hidden),
    )  # fmt: skip


@torch.library.custom_op("detlogp::grad_logits", mutates_args=())
def _grad_logits_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    temperature: float,
    temperature_rows: Optional[Tensor],
    real_vocab: int,
    vocab_start: int,
    ignore_index: int,
    lse: Tensor,
    g_logp: Optional[Tensor],
    g_lse: Optional[Tensor],
) -> Tensor:
    dz = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.bfloat16, device=hidden.device)
    _grad_logits_into(
        hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index, lse,
        g_logp, g_lse, dz,
    )  # fmt: skip
    return dz


@_grad_logits_op.register_fake
def _(hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index, lse, g_logp,
      g_lse):  # fmt: skip
    return hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def _fused_chunked_grads(hidden, weight, bias, targets, temperature, temperature_rows, lse, g_logp, g_lse,
                         vocab_start, real_vocab, ignore_index, need):  # fmt: skip
    """The fused backward of a vocabulary shard: per chunk, the SM90 kernel writes dz [N, C] bf16,
    then grad_hidden += dz @ W_c (fp32 accumulation across chunks, fixed order), grad_weight chunk
    = dz^T @ h (bf16), grad_bias chunk = sum_n dz in fp32."""
    need_h, need_w, need_b, _ = need
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    c_max = _fused_chunk_rows(n, v)
    grad_h = torch.zeros((n, d), dtype=torch.float32, device=dev) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.empty_like(bias) if need_b else None
    lse = lse.float()
    g_logp = None if g_logp is None else g_logp.float()
    g_lse = None if g_lse is None else g_lse.float()
    t_rows = None if temperature_rows is None else temperature_rows.float()
    for c0 in range(0, v, c_max):
        c1 = min(v, c0 + c_max)
        w_c = weight[c0:c1]
        dz = _grad_logits_op(
            hidden, w_c, targets, None if bias is None else bias[c0:c1], float(temperature), t_rows, int(real_vocab),
            int(vocab_start) + c0, int(ignore_index), lse, g_logp, g_lse,
        )  # fmt: skip
        if need_h:
            grad_h += _mm_fp32(dz, w_c)
        if need_w:
            torch.mm(dz.t(), hidden, out=grad_w[c0:c1])
        if need_b:
            grad_b[c0:c1] = dz.sum(0, dtype=torch.float32).to(bias.dtype)
        del dz  # free this chunk before the next one is allocated
    _last_backward["path"] = "fused"
    return grad_h, grad_w, grad_b, None


def _chunked_grads(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    inv_t: Tensor,  # [N, 1] in the compute dtype
    lse: Tensor,
    g_logp: Optional[Tensor],
    g_lse: Optional[Tensor],
    g_logits: Optional[Tensor],
    vocab_start: int,
    real_vocab: int,
    ignore_index: int,
    need: Tuple[bool, bool, bool, bool],
    temperature: float = 1.0,
    temperature_rows: Optional[Tensor] = None,
):
    """Gradients of this vocabulary shard: (grad_hidden partial in the compute dtype, grad_weight,
    grad_bias, sum_v grad_y * y per row for the temperature). y = z * inv_t, p = exp(y - lse),
    dlogp/dy = onehot(t) - p, dlse/dy = p, dz = dy * inv_t; ignored rows carry no logp gradient.
    CUDA bf16 on SM90 (no temperature gradient, no logits gradient): the fused path."""
    need_h, need_w, need_b, need_t = need
    if _fused_backward_ok(hidden, weight, need_t, g_logits):
        return _fused_chunked_grads(
            hidden, weight, bias, targets, temperature, temperature_rows, lse, g_logp, g_lse, vocab_start, real_vocab,
            ignore_index, need,
        )  # fmt: skip
    _last_backward["path"] = "torch"
    n, d = hidden.shape
    v = weight.shape[0]
    cd = inv_t.dtype
    dev = hidden.device
    ignored = targets == ignore_index
    gl = torch.zeros(n, dtype=cd, device=dev) if g_logp is None else torch.where(ignored, 0.0, g_logp.to(cd))
    gs = torch.zeros(n, dtype=cd, device=dev) if g_lse is None else g_lse.to(cd)
    coef_z = (gs - gl)[:, None] * inv_t
    gl_z = gl[:, None] * inv_t
    neg_lse = -lse.to(cd)[:, None]
    t_local = torch.where(ignored, -1, targets.long() - vocab_start)[:, None]
    grad_h = torch.zeros((n, d), dtype=cd, device=dev) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.empty_like(bias) if need_b else None
    grad_ty = torch.zeros(n, dtype=cd, device=dev) if need_t else None
    low_precision = hidden.dtype == torch.bfloat16 and hidden.is_cuda
    for c0 in range(0, v, BACKWARD_VOCAB_CHUNK):
        c1 = min(v, c0 + BACKWARD_VOCAB_CHUNK)
        w_c = weight[c0:c1]
        z = _mm_fp32(hidden, w_c.t())
        if bias is not None:
            z += bias[c0:c1].to(cd)
        z_keep = z.clone() if need_t else None
        # Few passes over the [N, C] chunk, in place: p = exp(z * inv_t - lse), then
        # dz = p * (g_lse - g_logp) * inv_t, plus g_logp * inv_t at the target column.
        p = torch.addcmul(neg_lse, z, inv_t, out=z).exp_()
        pad_from = real_vocab - vocab_start - c0  # padding rows (global id >= real_vocab) get p = 0
        if pad_from < c1 - c0:
            p[:, max(pad_from, 0) :] = 0.0
        gz = p.mul_(coef_z)
        # The target term: at most one column per row, so a gather/scatter pair writes each
        # element once (deterministic, O(N) extra memory; rows without a target here add +0).
        in_chunk = (t_local >= c0) & (t_local < c1)
        col = (t_local - c0).clamp(0, c1 - c0 - 1)
        gz.scatter_(1, col, gz.gather(1, col) + torch.where(in_chunk, gl_z, 0.0))
        if need_t:
            # dL/dT = sum_v dL/dy_v * (-y_v / T) = -inv_t * sum_v dz_v * z_v
            grad_ty += (gz * z_keep).sum(1)
        if g_logits is not None and g_logits.numel() > 0:
            gz += g_logits[:, c0:c1].to(cd)
        gz_op = gz.to(torch.bfloat16) if low_precision else gz
        if need_h:
            grad_h += _mm_fp32(gz_op, w_c)
        if need_w:
            grad_w[c0:c1] = _mm_fp32(gz_op.t(), hidden).to(weight.dtype)
        if need_b:
            grad_b[c0:c1] = gz.sum(0).to(bias.dtype)
        del z, p, gz, gz_op, z_keep  # free this chunk before the next one is allocated
    return grad_h, grad_w, grad_b, grad_ty


def _inv_t(temperature: float, temperature_rows: Optional[Tensor], n: int, cd, device) -> Tensor:
    if temperature_rows is not None:
        return (1.0 / temperature_rows.to(cd))[:, None]
    return torch.full((n, 1), 1.0 / temperature, dtype=cd, device=device)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, _rl, real_vocab, _b, _s = inputs
    ctx.save_for_backward(hidden, weight, targets, bias, temperature_rows, output[1])
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.real_vocab = real_vocab


def _backward(ctx, g_logp, g_lse, g_logits):
    hidden, weight, targets, bias, temperature_rows, lse = ctx.saved_tensors
    need = (
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
        bias is not None and ctx.needs_input_grad[3],
        temperature_rows is not None and ctx.needs_input_grad[5],
    )
    cd = _out_dtype(hidden)
    inv_t = _inv_t(ctx.temperature, temperature_rows, hidden.shape[0], cd, hidden.device)
    gh, gw, gb, gty = _chunked_grads(
        hidden, weight, bias, targets, inv_t, lse, g_logp, g_lse, g_logits, 0, ctx.real_vocab, ctx.ignore_index, need,
        ctx.temperature, temperature_rows,
    )  # fmt: skip
    g_temp = None if gty is None else (-gty * inv_t[:, 0]).to(temperature_rows.dtype)
    return (
        None if gh is None else gh.to(hidden.dtype), gw, None, gb, None, g_temp, None, None, None, None, None,
    )  # fmt: skip


_linear_logp_op.register_autograd(_backward, setup_context=_setup_context)


# --- tensor parallel -------------------------------------------------------------------------

_ERROR_CODES = [None, InputError, TargetIndexError, StrictModeError, BackendError, ConfigError, DetlogpError]
_HEADER = 10  # err, N, D, vocab_start, V_local, real_vocab, tiles, ignore_index, targets checksum, temp checksum


def _align16(x: int) -> int:
    return (x + 15) // 16 * 16


def _checksum(t: Optional[Tensor]) -> Tensor:
    """A position-weighted integer checksum of the raw bits, computed on the device (no sync)."""
    if t is None or t.numel() == 0:
        return torch.zeros((), dtype=torch.int64)
    bits = t.view(torch.int32) if t.dtype == torch.float32 else t
    w = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.int64)
    return (bits.to(torch.int64) * w).sum()


def _tp_forward(
    hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, vocab_start, real_vocab,
    backend, strict, group,
):  # fmt: skip
    """Partials of this rank's shard, a header exchange so every rank takes the same decision,
    one all-gather of the partial bytes in rank order, then the owned merge on every rank."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = hidden.device
    n, d, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
    tiles = shard_tiles(v) if v > 0 else 0
    summaries = torch.zeros((n, tiles, 2), dtype=torch.float32, device=dev)
    target_logit = torch.zeros(n, dtype=torch.float32, device=dev)
    owned = torch.zeros(n, dtype=torch.uint8, device=dev)
    logits = torch.empty((n, v), dtype=torch.float32, device=dev) if return_logits else None
    err, msg, report = 0, "", None
    try:
        _check_tensors(hidden, weight, targets, bias, temperature_rows, contract=True)
        report = _ext.linear_logp_partials(
            _contiguous_rows(hidden), _contiguous_rows(weight), targets.contiguous(), _vec(bias), temperature,
            _vec(temperature_rows), real_vocab, vocab_start, ignore_index, summaries, target_logit, owned, logits,
            backend, strict, _stream_of(hidden),
        )  # fmt: skip
    except DetlogpError as e:
        err = next(i for i, c in enumerate(_ERROR_CODES) if c is not None and type(e) is c)
        msg = str(e)
    header = torch.zeros(_HEADER, dtype=torch.int64, device=dev)
    header[:8] = torch.tensor([err, n, d, vocab_start, v, real_vocab, tiles, ignore_index], dtype=torch.int64)
    header[8] = _checksum(targets).to(dev)
    header[9] = _checksum(temperature_rows).to(dev)
    # Flat receive buffers: gloo takes only [world * numel] (NCCL takes both).
    headers = torch.empty(world * _HEADER, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(headers, header, group=group)
    hs = headers.view(world, _HEADER).cpu().tolist()
    if any(h[0] for h in hs):
        msgs = [None] * world
        dist.all_gather_object(msgs, msg, group=group)
        bad = next(r for r in range(world) if hs[r][0])
        raise _ERROR_CODES[hs[bad][0]](f"tensor-parallel rank {bad}: {msgs[bad]}")
    problems = []
    for r in range(1, world):
        for i, what in ((1, "N"), (2, "D"), (5, "real_vocab"), (7, "ignore_index"), (8, "targets"), (9, "temperature")):
            if hs[r][i] != hs[0][i]:
                problems.append(f"rank {r} has a different {what} than rank 0")
        if hs[r][3] != hs[r - 1][3] + hs[r - 1][4]:
            problems.append(f"rank {r} shard starts at {hs[r][3]}, not where rank {r - 1}'s ends ({hs[r - 1][3] + hs[r - 1][4]})")
    if hs[0][3] != 0:
        problems.append(f"rank 0 shard starts at vocab_start={hs[0][3]}, not 0")
    if hs[-1][3] + hs[-1][4] < real_vocab:
        problems.append(f"the shards end at {hs[-1][3] + hs[-1][4]} < real_vocab={real_vocab}")
    if problems:
        raise InputError("tensor-parallel shards do not fit together: " + "; ".join(problems))
    max_tiles = max(h[6] for h in hs)
    off_tl = _align16(n * max_tiles * 8)
    off_own = off_tl + _align16(n * 4)
    size = off_own + _align16(n)
    send = torch.zeros(size, dtype=torch.uint8, device=dev)
    send[: n * tiles * 8].view(torch.float32).copy_(summaries.reshape(-1))
    send[off_tl : off_tl + n * 4].view(torch.float32).copy_(target_logit)
    send[off_own : off_own + n].copy_(owned)
    recv = torch.empty(world * size, dtype=torch.uint8, device=dev)
    dist.all_gather_into_tensor(recv, send, group=group)
    recv = recv.view(world, size)
    ranks = []
    for r in range(world):
        t_r = hs[r][6]
        ranks.append(
            (
                recv[r, : n * t_r * 8].view(torch.float32).view(n, t_r, 2),
                recv[r, off_tl : off_tl + n * 4].view(torch.float32),
                recv[r, off_own : off_own + n],
            )
        )
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    _ext.merge_partials(ranks, targets.contiguous(), ignore_index, logp, lse, backend, strict, _stream_of(hidden))
    _tls.report = dict(report, tensor_parallel={"ranks": world, "rank": rank})
    return logp, lse, logits


class _TPLinearLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, temperature_rows, targets, temperature, ignore_index, return_logits,
                vocab_start, real_vocab, backend, strict, group):  # fmt: skip
        logp, lse, logits = _tp_forward(
            hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, vocab_start,
            real_vocab, backend, strict, group,
        )  # fmt: skip
        ctx.save_for_backward(hidden, weight, targets, bias, temperature_rows, lse)
        ctx.args = (temperature, ignore_index, vocab_start, real_vocab, group)
        if logits is None:
            logits = hidden.new_empty((0,), dtype=torch.float32)
            ctx.mark_non_differentiable(logits)
        return logp, lse, logits

    @staticmethod
    def backward(ctx, g_logp, g_lse, g_logits):
        import torch.distributed as dist

        hidden, weight, targets, bias, temperature_rows, lse = ctx.saved_tensors
        temperature, ignore_index, vocab_start, real_vocab, group = ctx.args
        need = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
            temperature_rows is not None and ctx.needs_input_grad[3],
        )
        cd = torch.float32
        inv_t = _inv_t(temperature, temperature_rows, hidden.shape[0], cd, hidden.device)
        gh, gw, gb, gty = _chunked_grads(
            hidden, weight, bias, targets, inv_t, lse, g_logp, g_lse, g_logits, vocab_start, real_vocab,
            ignore_index, need, temperature, temperature_rows,
        )  # fmt: skip
        world = dist.get_world_size(group)

        def rank_ordered_sum(x: Tensor) -> Tensor:
            # Gather, then add in rank order: every rank gets the same bits (no all-reduce order).
            parts = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(parts, x.contiguous().view(-1), group=group)
            parts = parts.view((world,) + tuple(x.shape))
            total = parts[0].clone()
            for r in range(1, world):
                total += parts[r]
            return total

        if gh is not None:
            gh = rank_ordered_sum(gh).to(hidden.dtype)
        g_temp = None
        if gty is not None:
            g_temp = (-rank_ordered_sum(gty) * inv_t[:, 0]).to(temperature_rows.dtype)
        return (gh, gw, gb, g_temp) + (None,) * 9


# --- the public entry ------------------------------------------------------------------------


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
):
    """Per-token log-probabilities: logp[n] = y_t - logsumexp(y), y = (h.W^T + b) / T.

    hidden [..., D] bf16, weight [V_local, D] bf16 (this rank's shard when tp_group is given),
    targets [...] int32/int64 (global ids), bias [V_local] fp32, temperature a float or a per-row
    fp32 tensor. Returns (logp, lse) fp32 shaped like targets, plus logits [..., V_local] fp32
    (unscaled z, the serving entry) when return_logits. Differentiable in hidden, weight, bias and
    a temperature tensor. backend: None (DETLOGP_BACKEND, else auto), a C++ backend id, or
    TORCH_BACKEND_ID; strict (or DETLOGP_STRICT=1) refuses every non-contract lane.
    detlogp.torch.last_report() says which backend served the call."""
    # Plain Python (no extension call) so torch.compile traces it; the library itself re-reads
    # DETLOGP_STRICT and refuses bad DETLOGP_* variables on every call.
    strict_on = os.environ.get("DETLOGP_STRICT", "0") == "1" or bool(strict)
    backend = backend if backend is not None else os.environ.get("DETLOGP_BACKEND", "")
    if backend == TORCH_BACKEND_ID and strict_on:
        raise StrictModeError(
            f"strict mode refuses backend '{TORCH_BACKEND_ID}': it does not bear the detlogp contract "
            "(unset strict / DETLOGP_STRICT, or use a contract backend)"
        )
    if not isinstance(hidden, Tensor) or not isinstance(weight, Tensor) or not isinstance(targets, Tensor):
        raise InputError("hidden, weight and targets must be torch tensors (numpy arrays go to detlogp.linear_logp)")
    batch_shape = targets.shape
    if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != tuple(batch_shape):
        raise InputError(f"hidden must be [..., D] with leading dims {list(batch_shape)} (targets), got {list(hidden.shape)}")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    temp_rows = None
    temp = 1.0
    if isinstance(temperature, Tensor):
        if temperature.dim() == 0:
            temp = float(temperature)
        else:
            if tuple(temperature.shape) != tuple(batch_shape):
                raise InputError(f"temperature must be a float or shaped like targets {list(batch_shape)}, got {list(temperature.shape)}")
            temp_rows = temperature.reshape(-1)
    else:
        temp = float(temperature)
    rv = int(vocab_start) + weight.shape[0] if real_vocab is None else int(real_vocab)
    contract = backend != TORCH_BACKEND_ID
    if tp_group is None:
        _check_tensors(h2, weight, t1, bias, temp_rows, contract)
        if vocab_start != 0 or weight.shape[0] < rv:
            raise InputError(
                f"weight covers vocabulary [{vocab_start}, {vocab_start + weight.shape[0]}) of real_vocab={rv}: "
                "a vocabulary shard needs tp_group"
            )
        if not contract and not (math.isfinite(temp) and temp > 0):
            raise InputError(f"temperature={temp} must be finite and > 0")
        logp, lse, logits = _linear_logp_op(h2, weight, t1, bias, temp, temp_rows, int(ignore_index), bool(return_logits), rv, backend, strict_on)
    else:
        if not contract:
            raise InputError(f"tp_group needs a contract backend; '{TORCH_BACKEND_ID}' has no tensor-parallel path")
        logp, lse, logits = _TPLinearLogp.apply(
            h2, weight, bias, temp_rows, t1, temp, int(ignore_index), bool(return_logits), int(vocab_start), rv,
            backend, strict_on, tp_group,
        )  # fmt: skip
    logp = logp.reshape(batch_shape)
    lse = lse.reshape(batch_shape)
    if return_logits:
        return logp, lse, logits.reshape(tuple(batch_shape) + (weight.shape[0],))
    return logp, lse

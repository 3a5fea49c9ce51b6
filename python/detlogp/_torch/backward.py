"""The backward of detlogp::linear_logp: the logits recomputed one vocabulary chunk at a time (never
an [N, V] buffer), in a fixed order, so gradients are deterministic run to run.

For CUDA bf16 tensors served by the SM90 backend it is fused: one kernel per chunk (grad_logits)
recomputes the chunk's logits and writes the bf16 logit gradient dz directly, then two GEMMs (dz @
W_c into an fp32 hidden gradient, dz^T @ h for the weight chunk). Elsewhere (CPU, other dtypes, a
temperature gradient, a gradient through the returned logits, or DETLOGP_TORCH_FUSED_BACKWARD=0)
the chunk loop is written in torch with BACKWARD_VOCAB_CHUNK rows per chunk. A gradient through the
entropy output joins the same pass (the kernel's entropy term, or its torch form in the chunk loop).
Gradients are not part of the numeric contract (only logp/lse are).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _detlogp as _ext
from .._errors import InputError
from .grad_logits import grad_logits_op
from .tensors import SM90_BACKEND_ID, aligned_copy, tma_misalignment

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

# Process-wide, not thread-local: autograd runs CUDA backward passes on its own worker threads.
last_backward = {"path": None}


def last_backward_path() -> Optional[str]:
    """How the process's most recent detlogp.torch backward computed its chunks: "fused" (the SM90
    grad-logits kernel + two GEMMs per chunk) or "torch" (the torch chunk loop); with sampling=,
    "sampled-fused" (the kernel's sampled epilogue, CUDA) or "sampled" (the CPU implementation);
    None before any.
    (Autograd runs CUDA backward passes on its own threads, so this is not per calling thread.)"""
    return last_backward["path"]


# aten::mm.dtype (bf16 x bf16 -> fp32 on CUDA) exists from torch 2.8 on; older: upcast.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def mm_fp32(a: Tensor, b: Tensor) -> Tensor:
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


def _fused_backward_ok(hidden: Tensor, weight: Tensor, need_t: bool, g_logits: Optional[Tensor]) -> bool:
    if os.environ.get(FUSED_BACKWARD_ENV, "1") == "0" or need_t:
        return False
    if g_logits is not None and g_logits.numel() > 0:
        return False
    if not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
        return False
    return hidden.shape[1] % 8 == 0 and _sm90_available()


def fused_chunk_rows(n: int, v: int) -> int:
    """Vocabulary rows per fused chunk: at most BACKWARD_FUSED_CHUNK_BYTES of bf16 dz (a multiple of
    256, at least 256), then evened out over the chunks that takes (no small tail chunk)."""
    c_max = min(v, max(256, BACKWARD_FUSED_CHUNK_BYTES // max(1, 2 * n) // 256 * 256))
    chunks = (v + c_max - 1) // c_max
    if chunks == 1:
        return c_max
    even = (v + chunks - 1) // chunks
    return min(c_max, (even + 255) // 256 * 256)


def _fused_chunked_grads(hidden, weight, bias, targets, temperature, temperature_rows, lse, g_logp, g_lse,
                         vocab_start, real_vocab, ignore_index, need, entropy=None, g_entropy=None):  # fmt: skip
    """The fused backward of a vocabulary shard: per chunk, the SM90 kernel writes dz [N, C] bf16,
    then grad_hidden += dz @ W_c (fp32 accumulation across chunks, fixed order), grad_weight chunk
    = dz^T @ h (bf16), grad_bias chunk = sum_n dz in fp32. g_entropy (dL/dH, with entropy the
    forward's H): the kernel adds the entropy term (docs/contract.md, appendix A)."""
    need_h, need_w, need_b, _ = need
    _check_entropy_pair(entropy, g_entropy)
    # The kernel's TMA loads read hidden and weight in place: a view they cannot read is copied once,
    # as the forward did, and the GEMMs take the same aligned copies.
    hidden = aligned_copy(hidden) if tma_misalignment(hidden) is not None else hidden
    weight = aligned_copy(weight) if tma_misalignment(weight) is not None else weight
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    c_max = fused_chunk_rows(n, v)
    grad_h = torch.zeros((n, d), dtype=torch.float32, device=dev) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.empty_like(bias) if need_b else None
    lse = lse.float()
    g_logp = None if g_logp is None else g_logp.float()
    g_lse = None if g_lse is None else g_lse.float()
    h_rows = None if g_entropy is None else entropy.float()
    g_entropy = None if g_entropy is None else g_entropy.float()
    t_rows = None if temperature_rows is None else temperature_rows.float()
    for c0 in range(0, v, c_max):
        c1 = min(v, c0 + c_max)
        w_c = weight[c0:c1]
        dz = grad_logits_op(
            hidden, w_c, targets, None if bias is None else bias[c0:c1], float(temperature), t_rows, int(real_vocab),
            int(vocab_start) + c0, int(ignore_index), lse, g_logp, g_lse, h_rows, g_entropy,
        )  # fmt: skip
        if need_h:
            grad_h += mm_fp32(dz, w_c)
        if need_w:
            torch.mm(dz.t(), hidden, out=grad_w[c0:c1])
        if need_b:
            grad_b[c0:c1] = dz.sum(0, dtype=torch.float32).to(bias.dtype)
        del dz  # free this chunk before the next one is allocated
    last_backward["path"] = "fused"
    return grad_h, grad_w, grad_b, None


def chunked_grads(
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
    entropy: Optional[Tensor] = None,
    g_entropy: Optional[Tensor] = None,
    topk_ids: Optional[Tensor] = None,
    g_topk_logp: Optional[Tensor] = None,
):
    """Gradients of this vocabulary shard: (grad_hidden partial in the compute dtype, grad_weight,
    grad_bias, sum_v grad_y * y per row for the temperature). y = z * inv_t, p = exp(y - lse),
    dlogp/dy = onehot(t) - p, dlse/dy = p, dz = dy * inv_t; ignored rows carry no logp gradient.
    [N, K] targets (g_logp [N, K]) and the top-k output (topk_ids, g_topk_logp [N, K'], the ids
    held constant) are entries of the same form: dL/dy_v = sum_e g_e (1[v == id_e] - p_v) + g_lse p_v
    over the row's entries e (targets first, then the top-k ids; an ignored target has g_e = 0),
    the target terms added to their columns one entry at a time in that order (deterministic, also
    for repeated ids). g_entropy (dL/dH per row, with entropy the forward's H; None: no term, the
    logp-only bits): dH/dy = -p (x + H) with x = y - lse, taken as 0 where p == 0, in every row (H
    does not depend on the target). CUDA bf16 on SM90 (one target a row, no temperature gradient,
    no logits gradient): the fused path."""
    need_h, need_w, need_b, need_t = need
    _check_entropy_pair(entropy, g_entropy)
    single = targets.dim() == 1 and g_topk_logp is None
    if single and _fused_backward_ok(hidden, weight, need_t, g_logits):
        return _fused_chunked_grads(
            hidden, weight, bias, targets, temperature, temperature_rows, lse, g_logp, g_lse, vocab_start, real_vocab,
            ignore_index, need, entropy=entropy, g_entropy=g_entropy,
        )  # fmt: skip
    last_backward["path"] = "torch"
    n, d = hidden.shape
    v = weight.shape[0]
    cd = inv_t.dtype
    dev = hidden.device
    ids, gl = _entries(targets, g_logp, ignore_index, topk_ids, g_topk_logp, cd)
    gl_sum = gl[:, 0].clone()  # sum_e g_e, in entry order
    for e in range(1, gl.shape[1]):
        gl_sum += gl[:, e]
    gs = torch.zeros(n, dtype=cd, device=dev) if g_lse is None else g_lse.to(cd)
    coef_z = (gs - gl_sum)[:, None] * inv_t
    gl_z = gl * inv_t
    with_entropy = g_entropy is not None
    if with_entropy:
        neg_gh_z = -g_entropy.to(cd)[:, None] * inv_t
        h_col = entropy.to(cd)[:, None]
    neg_lse = -lse.to(cd)[:, None]
    t_local = torch.where(ids < 0, -1, ids - vocab_start)  # -1 (or below the shard): no column here
    grad_h = torch.zeros((n, d), dtype=cd, device=dev) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.empty_like(bias) if need_b else None
    grad_ty = torch.zeros(n, dtype=cd, device=dev) if need_t else None
    low_precision = hidden.dtype == torch.bfloat16 and hidden.is_cuda
    for c0 in range(0, v, BACKWARD_VOCAB_CHUNK):
        c1 = min(v, c0 + BACKWARD_VOCAB_CHUNK)
        w_c = weight[c0:c1]
        z = mm_fp32(hidden, w_c.t())
        if bias is not None:
            z += bias[c0:c1].to(cd)
        z_keep = z.clone() if need_t else None
        # Few passes over the [N, C] chunk, in place: p = exp(z * inv_t - lse), then
        # dz = p * (g_lse - g_logp) * inv_t, plus g_logp * inv_t at the target column.
        pad_from = real_vocab - vocab_start - c0  # padding rows (global id >= real_vocab) get p = 0
        if with_entropy:
            # x = y - lse kept beside p: p's factor gains -g_H (x + H), and is 0 where p == 0 (x may
            # be -inf there, where the product would be 0 * inf).
            x = torch.addcmul(neg_lse, z, inv_t, out=z)
            p = x.exp()
            if pad_from < c1 - c0:
                p[:, max(pad_from, 0) :] = 0.0
            factor = x.add_(h_col).mul_(neg_gh_z).add_(coef_z).masked_fill_(p == 0, 0.0)
            gz = p.mul_(factor)
            del x, factor
        else:
            p = torch.addcmul(neg_lse, z, inv_t, out=z).exp_()
            if pad_from < c1 - c0:
                p[:, max(pad_from, 0) :] = 0.0
            gz = p.mul_(coef_z)
        # The target terms: one column per row and entry, so each gather/scatter pair writes each
        # element once (deterministic, O(N) extra memory; rows without the entry here add +0), and
        # the entries follow one another (a repeated id adds its terms in entry order).
        for e in range(t_local.shape[1]):
            t_e = t_local[:, e : e + 1]
            in_chunk = (t_e >= c0) & (t_e < c1)
            col = (t_e - c0).clamp(0, c1 - c0 - 1)
            gz.scatter_(1, col, gz.gather(1, col) + torch.where(in_chunk, gl_z[:, e : e + 1], 0.0))
        if need_t:
            # dL/dT = sum_v dL/dy_v * (-y_v / T) = -inv_t * sum_v dz_v * z_v
            grad_ty += (gz * z_keep).sum(1)
        if g_logits is not None and g_logits.numel() > 0:
            gz += g_logits[:, c0:c1].to(cd)
        gz_op = gz.to(torch.bfloat16) if low_precision else gz
        if need_h:
            grad_h += mm_fp32(gz_op, w_c)
        if need_w:
            grad_w[c0:c1] = mm_fp32(gz_op.t(), hidden).to(weight.dtype)
        if need_b:
            grad_b[c0:c1] = gz.sum(0).to(bias.dtype)
        del z, p, gz, gz_op, z_keep  # free this chunk before the next one is allocated
    return grad_h, grad_w, grad_b, grad_ty


def _entries(targets: Tensor, g_logp: Optional[Tensor], ignore_index: int, topk_ids: Optional[Tensor],
             g_topk_logp: Optional[Tensor], cd) -> Tuple[Tensor, Tensor]:
    """The row's logp entries [N, E]: (global ids, -1 for an ignored target; dL/dlogp of each, +0
    for an ignored target or an absent gradient): the targets ([N] or [N, K]) first, then the
    top-k ids when their logp has a gradient."""
    t2 = targets[:, None] if targets.dim() == 1 else targets
    ignored = t2 == ignore_index
    ids = [torch.where(ignored, -1, t2.long())]
    if g_logp is None:
        gl = [torch.zeros(t2.shape, dtype=cd, device=t2.device)]
    else:
        gl = [torch.where(ignored, 0.0, g_logp.reshape(t2.shape).to(cd))]
    if g_topk_logp is not None:
        ids.append(topk_ids.long())
        gl.append(g_topk_logp.to(cd))
    return torch.cat(ids, 1), torch.cat(gl, 1)


def _check_entropy_pair(entropy: Optional[Tensor], g_entropy: Optional[Tensor]) -> None:
    if g_entropy is not None and entropy is None:
        raise InputError("g_entropy needs entropy (the forward's [N] entropy)")


def inverse_temperature(temperature: float, temperature_rows: Optional[Tensor], n: int, cd, device) -> Tensor:
    if temperature_rows is not None:
        return (1.0 / temperature_rows.to(cd))[:, None]
    return torch.full((n, 1), 1.0 / temperature, dtype=cd, device=device)

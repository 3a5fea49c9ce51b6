"""``tp_group`` calls: the C++ tensor-parallel operator (``linear_logp_tensor_parallel``,
docs/tensor-parallel.md) driven from Python, its one collective (a rank-ordered all-gather of
bytes) done by torch.distributed, and the backward's rank-ordered gradient sums.

Before the operator runs, one small exchange (agree) makes every rank check what the operator's
header does not: that no rank failed its torch-side checks or the extension's checks of its
arrays (either would raise on that rank alone, before the operator's first collective), and that
all ranks would be served by the same backend under the same contract: backend id, contract name
and version, arch (the header carries only a hash of the backend id). Every rank decides from the
same gathered bytes, so either all raise the same error or all go on; the operator's header
exchange then checks the layout (N, D, shards, real_vocab, ignore_index, the entry, targets and
temperatures) the same way.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _detlogp as _ext, _errors
from .._errors import BackendError, DetlogpError
from . import backward
from .op import per_target_shape, set_report
from .tensors import aligned_operands, check_tensors, library_problem, rows_of, stream_of, vector_copies

# What every rank must share with rank 0: the provenance fields of the backend that would serve it.
AGREED_FIELDS = ("backend_id", "contract_name", "contract_version", "arch")

# One rank's record of the agreement exchange, a fixed-size UTF-8 string of fields joined by
# RECORD_SEPARATOR: ("ok", *AGREED_FIELDS values) or ("error", class name, message). The message
# comes last, so cutting a long one at RECORD_BYTES only shortens it.
RECORD_BYTES = 1024
RECORD_SEPARATOR = "\x1f"


def gather_in_rank_order(group, send: Tensor, recv: Tensor) -> None:
    """All-gather of one flat tensor: rank r's `send` lands at recv[r * send.numel():], for every
    rank the same bytes. CUDA tensors: ordered on the current stream (as every torch.distributed
    collective). `send` may lie inside `recv` (the operator gathers its slot in place)."""
    if dist.get_backend(group) != "nccl" and _overlap(send, recv):
        send = send.clone()  # NCCL documents the in-place all-gather; other backends get a copy
    dist.all_gather_into_tensor(recv, send, group=group)


def _overlap(a: Tensor, b: Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_agreement(records: Sequence[Sequence[str]], refusal: str = "") -> None:
    """The decision of the agreement exchange over every rank's record, in rank order: raises the
    same error on every rank when a rank failed its local checks (the class of the first failing
    rank, every failing rank's message) or when the ranks would be served differently. `refusal`
    opens the message (the C++ entry's words; the operator's by default)."""
    failed = [(r, rec) for r, rec in enumerate(records) if rec[0] != "ok"]
    if failed:
        cls = getattr(_errors, failed[0][1][1], DetlogpError)
        cls = cls if isinstance(cls, type) and issubclass(cls, DetlogpError) else DetlogpError
        ranks = "".join(f"\n  rank {r}: {rec[2]}" for r, rec in failed)
        raise cls(f"{refusal or _ext.TENSOR_PARALLEL_REFUSAL} (nothing was written):{ranks}")
    differ = [r for r, rec in enumerate(records) if list(rec) != list(records[0])]
    if differ:
        served = "; ".join(
            f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in zip(AGREED_FIELDS, records[r][1:])) for r in [0] + differ
        )
        raise BackendError(
            f"tensor-parallel ranks would be served by different backends or contracts ({served}): the partials "
            "of one call must come from one backend under one contract (refused on every rank, nothing was written)"
        )


def _encode(record: Sequence[str], device) -> Tensor:
    raw = RECORD_SEPARATOR.join(record).encode("utf-8")[:RECORD_BYTES]
    buf = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def _decode(row: Tensor) -> List[str]:
    text = bytes(row.tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
    kind, _, rest = text.partition(RECORD_SEPARATOR)
    if kind == "ok":
        return [kind] + rest.split(RECORD_SEPARATOR)
    cls, _, message = rest.partition(RECORD_SEPARATOR)
    return [kind, cls, message or f"unreadable agreement record {text[:64]!r}"]


def agree(group, record: Sequence[str], device, refusal: str = "") -> None:
    """Gathers every rank's record and decides (check_agreement) on every rank alike."""
    world = dist.get_world_size(group)
    recv = torch.empty(world * RECORD_BYTES, dtype=torch.uint8, device=device)
    gather_in_rank_order(group, _encode(record, device), recv)
    check_agreement([_decode(row) for row in recv.view(world, RECORD_BYTES).cpu()], refusal)


def agreement_device(group, hidden):
    """Where a rank's agreement record travels: hidden's device, or (hidden not a tensor, so the rank
    refuses) the device its group's backend gathers (NCCL: the current CUDA device)."""
    if isinstance(hidden, Tensor):
        return hidden.device
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"


def rank_gather(group):
    """The callable gather(send, recv) the extension's tensor-parallel entries call: its arrays alias
    the C++ buffers (DLPack), gathered in rank order by torch.distributed."""

    def gather(send, recv):
        gather_in_rank_order(group, torch.from_dlpack(send), torch.from_dlpack(recv))

    return gather


def _forward(hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, vocab_start,
             real_vocab, backend, strict, group, return_entropy=False, topk=0):  # fmt: skip
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n, v = rows_of(hidden), rows_of(weight)
    logp = hidden.new_empty(per_target_shape(targets, n), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    logits = hidden.new_empty((n, v), dtype=torch.float32) if return_logits else None
    # The entropy travels as the tiles' entropy sums beside the summaries (docs/tensor-parallel.md);
    # a backend that cannot compute them refuses in the local check, so every rank refuses alike.
    entropy = hidden.new_empty((n,), dtype=torch.float32) if return_entropy else None
    # The top-k lists travel with the partials and are merged rank by rank (docs/contract.md §12).
    topk_ids = hidden.new_empty((n, topk), dtype=torch.int64) if topk else None
    topk_logp = hidden.new_empty((n, topk), dtype=torch.float32) if topk else None
    problem = None
    copies = []
    try:
        check_tensors(hidden, weight, targets, bias, temperature_rows, contract=True)
        hidden, weight, copies = aligned_operands(hidden, weight, backend)
        # Rows of stride 0 are a 0-d temperature that linear_logp expanded: its own, not a copy of the caller's.
        rows = temperature_rows if temperature_rows is None or temperature_rows.stride(0) != 0 else None
        copies += vector_copies((("targets", targets), ("bias", bias), ("temperature_rows", rows)))
        problem = library_problem(
            hidden, weight, targets, bias, temperature, temperature_rows, real_vocab, vocab_start, ignore_index
        )
        served = _ext.tensor_parallel_local_check(
            problem, logp, lse, logits, backend, strict, entropy, topk_ids, topk_logp
        )["provenance"]
        record = ["ok"] + [str(served[k]) for k in AGREED_FIELDS]
    except DetlogpError as e:
        record = ["error", type(e).__name__, str(e)]
    agree(group, record, hidden.device)

    report = _ext.linear_logp_tensor_parallel(
        problem, logp, lse, logits, backend, strict, stream_of(hidden), rank, world, rank_gather(group), entropy,
        topk_ids, topk_logp,
    )  # fmt: skip
    set_report(dict(report, tensor_parallel={"ranks": world, "rank": rank}, copies=copies))
    return logp, lse, logits, entropy, topk_ids, topk_logp


def rank_ordered_sum(x: Tensor, group) -> Tensor:
    # Gather, then add in rank order: every rank gets the same bits (no all-reduce order).
    world = dist.get_world_size(group)
    parts = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    gather_in_rank_order(group, x.contiguous().view(-1), parts)
    parts = parts.view((world,) + tuple(x.shape))
    total = parts[0].clone()
    for r in range(1, world):
        total += parts[r]
    return total


class TensorParallelLinearLogp(torch.autograd.Function):
    """apply(hidden, weight, bias, temperature_rows, targets, temperature, ignore_index, return_logits,
    vocab_start, real_vocab, backend, strict, group, return_entropy=False, topk=0): (logp, lse[,
    entropy][, topk_ids, topk_logp], logits), logp shaped like targets ([N] or [N, K]); entropy with
    return_entropy (the merged entropy, the TP = 1 bits; its gradient reaches hidden, weight and bias
    through the backward's entropy term), topk_ids / topk_logp [N, topk] with topk > 0 (the merged
    lists, the TP = 1 ids and bits; topk_logp's gradient with the ids held constant). An output the
    loss does not use gets no gradient term."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, temperature_rows, targets, temperature, ignore_index, return_logits,
                vocab_start, real_vocab, backend, strict, group, return_entropy=False, topk=0):  # fmt: skip
        return_entropy = bool(return_entropy)
        logp, lse, logits, entropy, topk_ids, topk_logp = _forward(
            hidden, weight, targets, bias, temperature, temperature_rows, ignore_index, return_logits, vocab_start,
            real_vocab, backend, strict, group, return_entropy, int(topk),
        )  # fmt: skip
        ctx.save_for_backward(hidden, weight, targets, bias, temperature_rows, lse, entropy, topk_ids)
        ctx.args = (temperature, ignore_index, vocab_start, real_vocab, group)
        ctx.return_entropy = return_entropy
        ctx.topk = int(topk)
        ctx.set_materialize_grads(False)
        if logits is None:
            logits = hidden.new_empty((0,), dtype=torch.float32)
            ctx.mark_non_differentiable(logits)
        out = (logp, lse) + ((entropy,) if return_entropy else ())
        if topk:
            ctx.mark_non_differentiable(topk_ids)
            out += (topk_ids, topk_logp)
        return out + (logits,)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        g_logp, g_lse = grads[:2]
        g_entropy = grads.pop(2) if ctx.return_entropy else None
        g_topk_logp = (grads.pop(2), grads.pop(2))[1] if ctx.topk else None
        g_logits = grads[2]
        hidden, weight, targets, bias, temperature_rows, lse, entropy, topk_ids = ctx.saved_tensors
        temperature, ignore_index, vocab_start, real_vocab, group = ctx.args
        # Every rank's shard term uses the merged lse and entropy, which are the same bits on every
        # rank, so the shard gradients are those of the whole-vocabulary backward restricted to the
        # shard (a target or top-k id outside the shard has no column here).
        entropy_args = {} if g_entropy is None else {"entropy": entropy, "g_entropy": g_entropy}
        topk_args = {} if g_topk_logp is None else {"topk_ids": topk_ids, "g_topk_logp": g_topk_logp}
        need = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
            temperature_rows is not None and ctx.needs_input_grad[3],
        )
        n = hidden.shape[0]
        inv_t = backward.inverse_temperature(temperature, temperature_rows, n, torch.float32, hidden.device)
        gh, gw, gb, gty = backward.chunked_grads(
            hidden, weight, bias, targets, inv_t, lse, g_logp, g_lse, g_logits, vocab_start, real_vocab,
            ignore_index, need, temperature, temperature_rows, **entropy_args, **topk_args,
        )  # fmt: skip
        if gh is not None:
            gh = rank_ordered_sum(gh, group).to(hidden.dtype)
        g_temp = None
        if gty is not None:
            g_temp = (-rank_ordered_sum(gty, group) * inv_t[:, 0]).to(temperature_rows.dtype)
        return (gh, gw, gb, g_temp) + (None,) * 11

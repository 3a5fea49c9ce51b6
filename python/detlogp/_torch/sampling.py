"""The sampling program on the torch face (docs/contract.md §11): ``sample`` (the rollout) and the
replay behind ``linear_logp(..., sampling=params)``, an autograd Function whose backward holds the
support fixed: one vocabulary chunk at a time, the library recomputes the contract logits, decides
each column's membership by the forward's (max, cut, min_p) and writes the bf16 logit gradient
(detlogp/grad.hpp, sampled_grad_logit); two GEMMs per chunk take it to hidden, weight and bias.

CPU tensors run on the CPU backend; CUDA tensors on the SM90 backend (src/sm90/sample.cu for the
forward, the grad-logits kernel's sampled epilogue for the backward), on the caller's current CUDA
stream, outputs on the tensors' device.

With tp_group, weight/bias are this rank's vocabulary shard at vocab_start, and the C++ entries
(sample_tensor_parallel, the replay's linear_logp_tensor_parallel, docs/tensor-parallel.md) run
over torch.distributed as detlogp.torch.linear_logp's operator does (tensor_parallel.py): one
agreement all-gather of every rank's torch-side and array checks first, then the C++ protocol,
whose every collective is a rank-ordered all-gather of bytes. Every rank gets the TP = 1 bits. The
replay's backward: each rank's shard gradient from the merged (same on every rank) statistics, the
hidden gradient summed over the ranks in rank order."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _detlogp as _ext, _int_arg, _sampling, _topk_arg, _what
from .._errors import DetlogpError, InputError
from .._sampling import SampleResult, SamplingParams
from . import backward
from .op import set_report
from .tensors import (
    aligned_operands, check_devices, contiguous_rows, dlpack_exports, exported_problem, library_problem, rows_of,
    stream_of, vec,
)  # fmt: skip

# How the C++ entries' refusals open (src/tp/tp_sample.cpp); the agreement step refuses in the same words.
SAMPLE_REFUSAL = "tensor-parallel sample refused on every rank"
REPLAY_REFUSAL = "tensor-parallel linear_logp refused on every rank"


def _tensor_parallel(group, hidden, call, refusal: str):
    """Runs call(tp) on every rank of `group`: call(None) first runs the torch-side and array checks
    alone (check_only), whose failure would otherwise raise on this rank alone; the agreement
    exchange makes every rank raise alike or go on; then call((rank, size, gather)) runs the C++
    entry over torch.distributed. Returns the call's report with the ranks."""
    import torch.distributed as dist

    from .tensor_parallel import agree, agreement_device, rank_gather

    record = ["ok"]
    try:
        call(None)
    except DetlogpError as e:
        record = ["error", type(e).__name__, str(e)]
    agree(group, record, agreement_device(group, hidden), refusal)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    report = call((rank, world, rank_gather(group)))
    return dict(report, tensor_parallel={"ranks": world, "rank": rank})


def _head_operands(hidden: Tensor, weight: Tensor, backend: str):
    """hidden [N, D] and weight as the library reads them in place (an aligned copy of a view the SM90
    backend's TMA loads cannot read, as linear_logp makes) and the report's "copies" entries."""
    return aligned_operands(contiguous_rows(hidden), contiguous_rows(weight), backend or "")


def _no_grad(t: Tensor) -> Tensor:
    """t as the rollout reads it, outside autograd (a detached view only where t requires grad)."""
    return t.detach() if t.requires_grad else t


def _tensors(named) -> None:
    for name, t in named:
        if t is not None and not isinstance(t, Tensor):
            raise InputError(f"{name} must be a torch tensor, got {_what(t)}")
    check_devices(named)


def sample(hidden: Tensor, weight: Tensor, params: SamplingParams, seed, key: Tensor, *, bias: Optional[Tensor] = None,
           vocab_start: int = 0, real_vocab: Optional[int] = None, tp_group=None, return_logits: bool = False,
           backend: Optional[str] = None, strict: Optional[bool] = None,
           topk: Optional[int] = None) -> SampleResult:  # fmt: skip
    """One token per row with the sampling program (docs/contract.md §11). hidden [..., D] bf16,
    weight [V, D] bf16 (the whole head; with tp_group this rank's shard [V_local, D] at vocab_start,
    real_vocab the global real vocabulary), params a detlogp.SamplingParams (per-row fields shaped
    like key), seed an integer or a uint64/int64 tensor shaped like key, key an int64 tensor of the
    rows' shape. Returns detlogp.SampleResult of tensors shaped like key (logits [..., V_local] with
    return_logits: the rank's shard) on hidden's device, the same bits on every rank of tp_group as
    at TP = 1; not differentiable (the rollout side). CPU tensors run on the CPU backend, CUDA
    tensors on the SM90 backend, on the current CUDA stream. topk=K (1 <= K <= 128): also topk_ids
    and topk_logp, shaped like key plus [K], the K ids with the largest logits at each row's T (1 for
    T = 0) and their raw logp, the bits linear_logp(..., topk=K) gives at that temperature (an
    engine's logprobs=K), from the same pass."""
    k = _topk_arg(topk)
    arguments = (hidden, weight, params, seed, key, bias, vocab_start, real_vocab, return_logits, backend, strict, k)
    if tp_group is None:
        return _sample(*arguments)
    prepared = []

    def call(tp):
        if tp is None:
            prepared.append(_sample(*arguments, check_only=True))
            return {}
        return prepared[0][1](tp)

    report = _tensor_parallel(tp_group, hidden, call, SAMPLE_REFUSAL)
    result = prepared[0][0]
    report = dict(report, copies=result.report["copies"])
    set_report(report)
    return result._replace(report=report)


def _sample(hidden, weight, params, seed, key, bias, vocab_start, real_vocab, return_logits, backend, strict, topk,
            check_only=False):  # fmt: skip
    """sample's body. check_only: every check, then (the result's output tensors, run(tp) -> report)."""
    _tensors((("hidden", hidden), ("weight", weight), ("key", key), ("bias", bias)))
    shape = tuple(key.shape)
    if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != shape:
        raise InputError(f"hidden must be [..., D] with leading dims {list(shape)} (key), got {list(hidden.shape)}")
    n = key.numel()
    one_dim = len(shape) == 1  # the common [N] rows: no views to make

    def flat(t):
        return t if one_dim and t.is_contiguous() else t.reshape(n).contiguous()

    program = _sampling.program_tuple(params, shape, Tensor, flat)
    seed_scalar, seed_rows = _sampling.seed_args(seed, shape, Tensor, flat)
    rv = -1 if real_vocab is None else _int_arg(real_vocab, "real_vocab")
    rows = _no_grad(hidden) if hidden.dim() == 2 else _no_grad(hidden).reshape(n, hidden.shape[-1])
    h2, w2, copies = _head_operands(rows, _no_grad(weight), backend)
    head = (h2, w2, vec(None if bias is None else _no_grad(bias)), rv, _int_arg(vocab_start, "vocab_start"))
    v = rows_of(weight)
    dev = hidden.device
    token = torch.empty(n, dtype=torch.int64, device=dev)
    support_size = torch.empty(n, dtype=torch.int64, device=dev)
    logp, logp_raw, lse = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(3))
    logits = torch.empty((n, v), dtype=torch.float32, device=dev) if return_logits else None
    topk_ids = torch.empty((n, topk), dtype=torch.int64, device=dev) if topk else None
    topk_logp = torch.empty((n, topk), dtype=torch.float32, device=dev) if topk else None
    args = (
        head, program, seed_scalar, seed_rows, flat(key), token, logp, logp_raw, lse, support_size, logits,
        backend or "", bool(strict), stream_of(hidden),
    )  # fmt: skip
    extra = {"topk_ids": topk_ids, "topk_logp": topk_logp}
    if one_dim:
        out = [token, logp, logp_raw, lse, support_size]
        logits_out, topk_out = logits, [topk_ids, topk_logp]
    else:
        out = [t.reshape(shape) for t in (token, logp, logp_raw, lse, support_size)]
        logits_out = None if logits is None else logits.reshape(shape + (v,))
        topk_out = [None if t is None else t.reshape(shape + (topk,)) for t in (topk_ids, topk_logp)]
    if check_only:
        _ext.sample(*args, check_only=True, **extra)
        return (SampleResult(*out, logits_out, {"copies": copies}, *topk_out),
                lambda tp: _ext.sample(*args, tp=tp, **extra))  # fmt: skip
    # One call: the tensors as DLPack capsules where torch's __dlpack__ would export them as they
    # are (each capsule is imported once; the names above keep the tensors alive through the call).
    c = dlpack_exports(
        (head[0], head[1], head[2], args[4], seed_rows) + program
        + (token, logp, logp_raw, lse, support_size, logits, topk_ids, topk_logp)
    )  # fmt: skip
    c_h, c_w, c_b, c_key, c_seed = c[:5]
    c_program, c_outs = tuple(c[5:13]), c[13:]
    report = _ext.sample(
        (c_h, c_w, c_b) + head[3:], c_program, seed_scalar, c_seed, c_key, *c_outs[:6], *args[11:],
        topk_ids=c_outs[6], topk_logp=c_outs[7],
    )  # fmt: skip
    set_report(dict(report, copies=copies))
    return SampleResult(*out, logits_out, report, *topk_out)


class SampledLinearLogp(torch.autograd.Function):
    """(logp, lse, logp_raw) of the replay; differentiable in hidden, weight and bias with the
    support fixed (docs/contract.md §11.10). With `group` (tp_group) weight/bias are this rank's shard
    at vocab_start: the forward is the C++ replay over vocabulary shards, the backward this shard's
    gradients, the hidden gradient summed over the ranks in rank order."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, program, real_vocab, ignore_index, backend, strict,
                vocab_start=0, group=None):  # fmt: skip
        n = rows_of(hidden)
        dev = hidden.device
        logp, logp_raw, lse, lse_support, support_max, cut_logit = (
            torch.empty(n, dtype=torch.float32, device=dev) for _ in range(6)
        )
        support_size, cut_id = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(2))
        prepared = []

        def call(tp, check_only=False):
            if not prepared:
                h, w, copies = _head_operands(hidden, weight, backend)
                problem = library_problem(h, w, targets, bias, 1.0, None, real_vocab, vocab_start, ignore_index)
                prepared.append((h, w, copies, problem))
            # DLPack capsules (fresh each call: one import each) instead of nanobind's __dlpack__ calls;
            # `prepared` and the outputs keep the tensors alive through the call.
            c_problem, c_out = exported_problem(
                prepared[0][3], (logp, logp_raw, lse, lse_support, support_size, support_max, cut_logit, cut_id)
            )
            return _ext.linear_logp_sampled(
                c_problem, program, *c_out, backend, strict, stream_of(hidden), tp=tp, check_only=check_only
            )

        if group is None:
            report = call(None)
        else:
            report = _tensor_parallel(group, hidden, lambda tp: call(tp, check_only=tp is None), REPLAY_REFUSAL)
        h, w, copies, _ = prepared[0]
        set_report(dict(report, copies=copies))
        # The backward reads the operands the forward read (its aligned copies where it made any).
        ctx.save_for_backward(h, w, bias, targets, logp, lse, lse_support, support_max, cut_logit, cut_id)
        ctx.program = program
        ctx.real_vocab = real_vocab
        ctx.ignore_index = ignore_index
        ctx.vocab_start = vocab_start
        ctx.group = group
        ctx.mark_non_differentiable(support_size)
        ctx.set_materialize_grads(False)
        return logp, lse, logp_raw, support_size

    @staticmethod
    def backward(ctx, g_logp, g_lse, g_logp_raw, _g_support):
        hidden, weight, bias, targets, logp, lse, lse_support, support_max, cut_logit, cut_id = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n, d = hidden.shape
        v = weight.shape[0]
        dev = hidden.device
        cuda = hidden.is_cuda
        # CUDA: the fused backward's chunk (bf16 dz of at most BACKWARD_FUSED_CHUNK_BYTES) and GEMMs;
        # host: the torch loop's chunk.
        chunk = backward.fused_chunk_rows(n, v) if cuda else backward.BACKWARD_VOCAB_CHUNK
        grad_h = torch.zeros((n, d), dtype=torch.float32, device=dev) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        grads = tuple(None if g is None else g.float().contiguous() for g in (g_logp, g_lse, g_logp_raw))
        stream = stream_of(hidden)
        for c0 in range(0, v, chunk):
            c1 = min(v, c0 + chunk)
            w_c = weight[c0:c1]
            b_c = None if bias is None else bias[c0:c1].contiguous()
            problem = library_problem(
                hidden, w_c, targets, b_c, 1.0, None, ctx.real_vocab, ctx.vocab_start + c0, ctx.ignore_index
            )
            dz = torch.empty((n, c1 - c0), dtype=torch.bfloat16, device=dev)
            _ext.linear_logp_grad_logits_sampled(
                problem, ctx.program, logp, lse, lse_support, support_max, cut_logit, cut_id, *grads, dz, stream
            )
            if need_h:
                grad_h += backward.mm_fp32(dz, w_c)
            if need_w:
                if cuda:
                    torch.mm(dz.t(), hidden, out=grad_w[c0:c1])
                else:
                    grad_w[c0:c1] = backward.mm_fp32(dz.t(), hidden).to(weight.dtype)
            if need_b:
                grad_b[c0:c1] = (dz.sum(0, dtype=torch.float32) if cuda else dz.float().sum(0)).to(bias.dtype)
            del dz  # free this chunk before the next one is allocated
        if grad_h is not None and ctx.group is not None:
            from .tensor_parallel import rank_ordered_sum

            grad_h = rank_ordered_sum(grad_h, ctx.group)
        backward.last_backward["path"] = "sampled-fused" if cuda else "sampled"
        gh = None if grad_h is None else grad_h.to(hidden.dtype)
        return gh, grad_w, grad_b, None, None, None, None, None, None, None, None


def linear_logp_sampled(hidden, weight, targets, bias, temperature, ignore_index, return_logits, vocab_start,
                        real_vocab, tp_group, strict_on, backend, return_entropy, sampling, return_raw):  # fmt: skip
    """detlogp.torch.linear_logp with sampling=: (logp, lse) or, with return_raw, (logp, lse, logp_raw),
    shaped like targets (docs/contract.md §11.10)."""
    from .. import _sampling_exclusive

    _sampling_exclusive(temperature, return_logits, return_entropy)
    if not isinstance(hidden, Tensor) or not isinstance(weight, Tensor) or not isinstance(targets, Tensor):
        raise InputError("hidden, weight and targets must be torch tensors (numpy arrays go to detlogp.linear_logp)")
    try:
        _tensors((("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)))
        shape = tuple(targets.shape)
        if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != shape:
            raise InputError(
                f"hidden must be [..., D] with leading dims {list(shape)} (targets), got {list(hidden.shape)}"
            )
        vocab_start = _int_arg(vocab_start, "vocab_start")
        if tp_group is None and vocab_start != 0:
            raise InputError(
                "vocab_start must be 0 with sampling= without tp_group (a vocabulary shard needs tp_group)"
            )
        n = targets.numel()
        flat = lambda t: t.reshape(n).contiguous()  # noqa: E731
        program = _sampling.program_tuple(sampling, shape, Tensor, flat)
        v_local = weight.shape[0] if weight.dim() > 0 else 0
        rv = vocab_start + v_local if real_vocab is None else _int_arg(real_vocab, "real_vocab")
        ignore_index = _int_arg(ignore_index, "ignore_index")
        h2 = contiguous_rows(hidden.reshape(n, hidden.shape[-1]))
    except DetlogpError as e:
        if tp_group is None:
            raise
        # Every other rank reaches the forward's agreement exchange: join it, so that all raise alike.
        from .tensor_parallel import agree, agreement_device

        agree(tp_group, ["error", type(e).__name__, str(e)], agreement_device(tp_group, hidden), REPLAY_REFUSAL)
        raise  # not reached: the agreement raises this rank's error on every rank
    logp, lse, logp_raw, _ = SampledLinearLogp.apply(
        h2, weight, bias, targets.reshape(n).contiguous(), program, rv, ignore_index, backend, strict_on, vocab_start,
        tp_group,
    )  # fmt: skip
    out = (logp.reshape(shape), lse.reshape(shape))
    return out + (logp_raw.reshape(shape),) if return_raw else out

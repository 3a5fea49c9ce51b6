"""The loss entry's chunk loop with a compact dz buffer (docs/perf.md, 2026-12-07 (d)), against
detlogp.torch.linear_logp_loss as it is, timed in one run.

linear_logp_loss keeps a chunk's bf16 dz in the first half of each of its fp32 logits rows, so a
grad_weight pass gets only as many rows (its GEMM's K) as the logits buffer holds. Here serving runs
of `serve` rows write their fp32 logits into a small buffer and their dz into a compact [group, V]
bf16 buffer; once `group` rows of dz are there, grad_hidden = dz @ W and grad_weight += dz^T h run
over all of them. Memory besides the gradients: 4 * serve * V + 2 * group * V bytes; the default
entry's is 4 * rows * V. At V = 151936, serve = 256 and group = 896 take the 428 MB of the default
704-row chunks, with five grad_weight passes at N = 4096 instead of six.

    PYTHONPATH=build/python python3 bench/experiments/loss_compact_dz.py [--configs 256x896,128x1152]

First it checks the variant against the entry: the same logp / lse bits, and how far the
gradients are (on a CPU grad_hidden has the same bits, each row's dz and its one fp32 product
being the same; cuBLAS may pick another split of K for another M; grad_weight differs by the
bf16 roundings of the other chunking). On a CPU (no CUDA device) it runs a small shape and checks
only. On a GPU it prints a table of median ms, the ratio to the entry and to torch's materializing
path, and the peak extra memory.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import detlogp.torch as dt
from detlogp import _detlogp as _ext
from detlogp._torch.backward import mm_fp32
from detlogp._torch.loss import _chunk_loss, _mm
from detlogp._torch.op import run_op
from detlogp._torch.tensors import stream_of, vec
from detlogp.bench.data import make_inputs
from detlogp.bench.harness import Timer, peak_extra_bytes, round_robin


def compact_loss(h, w, t, g, serve: int, group: int):
    """(loss, logp, lse, grad_hidden, grad_weight) of loss = sum(logp * g), the dz of `group` rows
    kept compact for each pair of backward GEMMs."""
    n, v = h.shape[0], w.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=h.device)
    lse = torch.empty_like(logp)
    grad_h = torch.empty_like(h)
    grad_w = None
    z = torch.empty((min(serve, n), v), dtype=torch.float32, device=h.device)
    dz_all = torch.empty((min(group, n), v), dtype=torch.bfloat16, device=h.device)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    stream = stream_of(h)
    fn = lambda lp, _lse, rows: (lp * g[rows]).sum()  # noqa: E731
    for g0 in range(0, n, group):
        g1 = min(n, g0 + group)
        for r0 in range(g0, g1, serve):
            r1 = min(g1, r0 + serve)
            rows = slice(r0, r1)
            zc = z[: r1 - r0]
            lp, ls, _, _, _, _ = run_op(h[rows], w, t[rows], None, 1.0, None, -100, True, v, "", False, False, 0,
                                        logits_out=zc)  # fmt: skip
            logp[rows], lse[rows] = lp, ls
            c_loss, g_logp, g_lse, _ = _chunk_loss(fn, lp, ls, None, rows, False)
            loss += c_loss.float()
            dz = dz_all[r0 - g0 : r1 - g0]
            _ext.linear_logp_grad_from_logits((zc, t[rows], 1.0, None, v, 0, -100), ls, vec(g_logp), vec(g_lse), dz,
                                              stream, None, None, defer_errors=dz.is_cuda)  # fmt: skip
        dzg, hg = dz_all[: g1 - g0], h[g0:g1]
        grad_h[g0:g1] = _mm(dzg, w, h.dtype)  # the entry's GEMMs: cuBLAS, or fp32 products on a CPU
        if grad_w is None:
            grad_w = _mm(dzg.t(), hg, w.dtype)
        elif h.is_cuda:
            grad_w.addmm_(dzg.t(), hg)
        else:
            grad_w.copy_(grad_w.float() + mm_fp32(dzg.t(), hg))
    return loss, logp, lse, grad_h, grad_w


def entry_loss(h, w, t, g):
    hp, wp = h.detach().requires_grad_(), w.detach().requires_grad_()
    r = dt.linear_logp_loss(hp, wp, t, lambda lp, _lse, rows: (lp * g[rows]).sum())
    r.loss.backward()
    return r.loss, r.logp, r.lse, hp.grad, wp.grad


def torch_loss(h, w, t, g):
    hp, wp = h.detach().requires_grad_(), w.detach().requires_grad_()
    logp = torch.log_softmax(F.linear(hp, wp).float(), dim=-1).gather(1, t[:, None])[:, 0]
    (logp * g).sum().backward()
    return hp.grad, wp.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--configs", default="256x896,128x1152,192x1024", help="serve x group rows, comma-separated")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    n, d, v = (args.rows, args.dim, args.vocab) if cuda else (300, 64, 2053)
    inputs = make_inputs(n, d, v, dev, seed=0)
    h, w, t, g = inputs.hidden, inputs.weight, inputs.targets, inputs.grad
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    if not cuda:
        configs = [(32, 96), (64, 128), (50, 150)]

    want = entry_loss(h, w, t, g)
    for serve, group in configs:
        got = compact_loss(h, w, t, g, serve, group)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), "logp / lse bits differ"
        rel = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got[3:], want[3:])]
        same_h = "bit-identical" if torch.equal(got[3], want[3]) else f"max rel diff {rel[0]:.2e}"
        print(f"{serve}x{group}: logp, lse bit-identical to the entry; grad_hidden {same_h}; "
              f"grad_weight max rel diff {rel[1]:.2e}")
    if not cuda:
        print("CPU: checks only (no timing)")
        return

    cases = {"torch materializing": lambda: torch_loss(h, w, t, g), "linear_logp_loss": lambda: entry_loss(h, w, t, g)}
    for serve, group in configs:
        cases[f"compact {serve}x{group}"] = lambda s=serve, gr=group: compact_loss(h, w, t, g, s, gr)
    times = round_robin(cases, args.iters, 2, cuda=True, timer=Timer(dev))
    med = {k: statistics.median(x) for k, x in times.items()}
    print(f"{torch.cuda.get_device_name()}, N={n} D={d} V={v}, median of {args.iters} (L2 flushed, round-robin)")
    print(f"{'case':28s} {'ms':>8s} {'/entry':>8s} {'/torch':>8s} {'peak MiB':>9s}")
    for k in cases:
        peak = peak_extra_bytes(cases[k]) / 2**20
        print(f"{k:28s} {med[k]:8.2f} {med[k] / med['linear_logp_loss']:8.3f} {med[k] / med['torch materializing']:8.3f}"
              f" {peak:9.0f}")


if __name__ == "__main__":
    main()

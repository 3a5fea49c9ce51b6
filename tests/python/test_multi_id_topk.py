"""[N, K] targets and the top-k output (docs/contract.md §6 step 6, §12) on every Python face: the
numpy Result, detlogp.torch.linear_logp (forward bits, batch shapes, errors, autograd against
float64, determinism, tp_group over gloo) and the CUDA refusal. Skipped (with the reason) where
torch is not installed."""

import os
import pathlib
import re
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the torch tests need it)")
import detlogp  # noqa: E402
from conftest import free_port  # noqa: E402
import detlogp.torch as dt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
CPU = "cpu-linear-logp-contract-v1"


def bits(x):
    return x.contiguous().view(torch.int32) if isinstance(x, torch.Tensor) else np.asarray(x).view(np.int32)


def same(a, b):
    return torch.equal(bits(a), bits(b))


def problem(n, d, v, k=4, seed=0, dtype=torch.bfloat16, real_vocab=None, ties=False):
    """hidden, weight, bias, [n, k] targets (with ignored entries and a repeated id), per-row T.
    ties=True makes weight rows 3 and 5 (and 8 and 9) equal: their logits tie in every row."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * 0.3).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(torch.float64 if dtype == torch.float64 else torch.float32)
    if ties:
        w[5], w[9] = w[3], w[8]
        b[5], b[9] = b[3], b[8]
    t = torch.randint(0, real_vocab or v, (n, k), generator=g)
    t[1, 0] = -100
    t[2, k - 1] = -100
    if k > 2:
        t[3, 2] = t[3, 1]  # an id twice in one row
    temp = (torch.rand(n, generator=g) + 0.5).to(b.dtype)
    return h, w, b, t, temp


def test_multi_id_entries_are_single_target_calls():
    """Each entry of [N, K] targets has the bits of a call with that single target (ignored
    entries +0, the row's lse unchanged), int32 or int64, with bias, per-row T and padding rows."""
    h, w, b, t, temp = problem(9, 32, 300, k=5, real_vocab=250)
    for targets in (t, t.int()):
        logp, lse = dt.linear_logp(h, w, targets, bias=b, temperature=temp, real_vocab=250)
        assert logp.shape == (9, 5) and logp.dtype == torch.float32 and lse.shape == (9,)
        # Host tensors: the CPU backend, or the SM90 backend where a GPU is present (auto).
        backend = dt.last_report()["backend_id"]
        assert backend in (CPU, "cuda-fused-linear-logp-sm90-contract-v1")
        for k in range(5):
            lp1, lse1 = dt.linear_logp(h, w, targets[:, k].contiguous(), bias=b, temperature=temp, real_vocab=250)
            assert dt.last_report()["backend_id"] == backend
            assert same(logp[:, k], lp1) and same(lse, lse1), k
    assert bits(logp[1, 0]).item() == 0 and bits(logp[2, 4]).item() == 0  # +0.0 exactly
    assert same(logp[3, 2], logp[3, 1])
    # The numpy face: the same bits.
    r = detlogp.linear_logp(detlogp.to_bf16_bits(h.float().numpy()), detlogp.to_bf16_bits(w.float().numpy()),
                            t.numpy(), bias=b.numpy(), temperature=temp.numpy(), real_vocab=250)  # fmt: skip
    assert np.array_equal(bits(r.logp), bits(logp).numpy()) and np.array_equal(bits(r.lse), bits(lse).numpy())


def test_multi_id_batch_shapes():
    """targets [..., K] beside hidden [..., D]: logp [..., K]; one id a row keeps targets [...]."""
    h, w, b, t, temp = problem(12, 16, 200, k=3)
    flat, lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    logp3, lse3 = dt.linear_logp(h.view(3, 4, 16), w, t.view(3, 4, 3), bias=b, temperature=temp.view(3, 4))
    assert logp3.shape == (3, 4, 3) and lse3.shape == (3, 4)
    assert same(logp3.reshape(12, 3), flat) and same(lse3.reshape(12), lse)
    single, _ = dt.linear_logp(h.view(3, 4, 16), w, t[:, 0].reshape(3, 4), bias=b, temperature=temp.view(3, 4))
    assert single.shape == (3, 4) and same(single.reshape(12), flat[:, 0])
    one, _ = dt.linear_logp(h, w, t[:, :1].contiguous(), bias=b, temperature=temp)
    assert one.shape == (12, 1) and same(one[:, 0], flat[:, 0])


def contract_y(h, w, b, temp, real_vocab):
    """The scaled contract logits y = fl(z * fl(1 / T)) of the CPU backend's serving entry (the top-k
    output's backend on host tensors; docs/contract.md §3.3)."""
    z = dt.linear_logp(h, w, torch.zeros(len(h), dtype=torch.long), bias=b, temperature=temp, real_vocab=real_vocab,
                       return_logits=True, backend=CPU)[2]  # fmt: skip
    inv_t = (torch.ones((), dtype=torch.float32) / temp.float())[:, None]
    return (z * inv_t)[:, :real_vocab]


@pytest.mark.parametrize("k", [1, 7, 128])
def test_topk_is_a_full_sort_of_the_contract_logits(k):
    """topk_ids: a stable descending sort of the contract logits (equal logits by the lower id,
    never a padding id); topk_logp: the bits of single-target calls for those ids; after logp and
    lse (and entropy), before logits."""
    real = 200
    h, w, b, t, temp = problem(6, 24, 260, k=2, real_vocab=real, ties=True)
    # The top-k output runs on the CPU backend: every call of the comparison there (auto may take
    # the SM90 backend for host tensors where a GPU is present, with its own logits' bits).
    out = dt.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=real, topk=k, return_entropy=True,
                         return_logits=True, backend=CPU)  # fmt: skip
    logp, lse, entropy, ids, topk_logp, logits = out
    assert ids.dtype == torch.int64 and ids.shape == (6, k) and topk_logp.shape == (6, k) and logits.shape == (6, 260)
    y = contract_y(h, w, b, temp, real)
    want = torch.sort(y, dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, want)
    if k >= 7:  # the tied pairs sit where the sort puts them, the lower id first
        for row in range(6):
            pos = {int(i): j for j, i in enumerate(ids[row])}
            for lo, hi in ((3, 5), (8, 9)):
                if lo in pos and hi in pos:
                    assert pos[lo] < pos[hi]
    for j in range(0, k, 64):  # at most 64 targets a row
        part = ids[:, j : j + 64].contiguous()
        single, lse1 = dt.linear_logp(h, w, part, bias=b, temperature=temp, real_vocab=real, backend=CPU)
        assert same(topk_logp[:, j : j + 64], single) and same(lse, lse1)
    plain = dt.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=real, return_entropy=True, backend=CPU)
    for a, c in zip(plain, (logp, lse, entropy)):
        assert same(a, c)  # the top-k output changes no other bit


def test_topk_numpy_result_and_batch_shapes():
    real = 300
    h, w, b, t, temp = problem(8, 16, 320, real_vocab=real)
    logp, lse, ids, topk_logp = dt.linear_logp(h, w, t[:, 0].contiguous(), bias=b, temperature=temp, real_vocab=real,
                                               topk=5)  # fmt: skip
    r = detlogp.linear_logp(detlogp.to_bf16_bits(h.float().numpy()), detlogp.to_bf16_bits(w.float().numpy()),
                            t[:, 0].contiguous().numpy(), bias=b.numpy(), temperature=temp.numpy(), real_vocab=real,
                            topk=5)  # fmt: skip
    assert r.topk_ids.dtype == np.int64 and r.topk_logp.dtype == np.float32
    assert np.array_equal(r.topk_ids, ids.numpy()) and np.array_equal(bits(r.topk_logp), bits(topk_logp).numpy())
    out3 = dt.linear_logp(h.view(2, 4, 16), w, t.view(2, 4, 4), bias=b, temperature=temp.view(2, 4), real_vocab=real,
                          topk=5)  # fmt: skip
    assert [tuple(x.shape) for x in out3] == [(2, 4, 4), (2, 4), (2, 4, 5), (2, 4, 5)]
    assert torch.equal(out3[2].reshape(8, 5), ids) and same(out3[3].reshape(8, 5), topk_logp)


def test_invariant_across_batch_composition():
    """A row's logp [K], lse and top-k do not depend on the rows around it (N, position)."""
    h, w, b, t, temp = problem(40, 32, 700, k=6)
    full = dt.linear_logp(h, w, t, bias=b, temperature=temp, topk=9)
    for rows in (torch.tensor([17]), torch.arange(5, 12), torch.tensor([39, 0, 22, 3])):
        sub = dt.linear_logp(h[rows], w, t[rows], bias=b, temperature=temp[rows], topk=9)
        for a, c in zip(sub, full):
            assert torch.equal(bits(a) if a.is_floating_point() else a, bits(c[rows]) if c.is_floating_point() else c[rows])


def test_errors_name_argument_row_and_value():
    h, w, b, t, temp = problem(6, 16, 123, k=3)
    bad = t.clone()
    bad[4, 2] = 123
    with pytest.raises(detlogp.TargetIndexError, match=re.escape("targets[4, 2]=123 is >= real_vocab=123")):
        dt.linear_logp(h, w, bad)
    bad[4, 2] = -7
    with pytest.raises(detlogp.TargetIndexError, match=re.escape("targets[4, 2]=-7 is negative and not ignore_index=-100")):
        dt.linear_logp(h, w, bad)
    wide = torch.zeros(6, 65, dtype=torch.long)
    with pytest.raises(detlogp.InputError, match=re.escape("targets has K=65 ids per row; K must be in [1, 64]")):
        dt.linear_logp(h, w, wide)
    with pytest.raises(detlogp.InputError, match=re.escape("targets has 5 rows, expected 6")):
        dt.linear_logp(h, w, t[:5])
    with pytest.raises(detlogp.InputError, match=re.escape("hidden must be [..., D] with leading dims [3, 2] (targets [3, 2, 3]")):
        dt.linear_logp(h.view(2, 3, 16), w, t.view(3, 2, 3))
    for k, message in ((129, "topk=129 must be in [1, 128] (kMaxTopk"), (0, "topk=0 must be in [1, 128]"),
                       (-1, "topk=-1 must be in [1, 128]"), (10**12, "topk=1000000000000 must be in [1, 128]"),
                       (124, "topk=124 exceeds real_vocab=123: a row has only 123 real ids")):  # fmt: skip
        for lane in (None, dt.TORCH_BACKEND_ID):
            with pytest.raises(detlogp.InputError, match=re.escape(message)):
                dt.linear_logp(h, w, t, topk=k, backend=lane)
        if k != 124:
            with pytest.raises(detlogp.InputError, match=re.escape(message)):
                detlogp.linear_logp(detlogp.to_bf16_bits(h.float().numpy()), detlogp.to_bf16_bits(w.float().numpy()),
                                    t.numpy(), topk=k)  # fmt: skip
    with pytest.raises(detlogp.InputError, match="topk must be an integer, got float 2.5"):
        dt.linear_logp(h, w, t, topk=2.5)
    with pytest.raises(detlogp.InputError, match=re.escape("topk= is not taken with sampling=")):
        dt.linear_logp(h, w, t[:, 0].contiguous(), sampling=detlogp.SamplingParams(), topk=3)
    # The plain lane checks [N, K] targets in the library's words too.
    bad[4, 2] = 123
    with pytest.raises(detlogp.TargetIndexError, match=re.escape("targets[4, 2]=123 is >= real_vocab=123")):
        dt.linear_logp(h, w, bad, backend=dt.TORCH_BACKEND_ID)
    with pytest.raises(detlogp.InputError, match=re.escape("targets has K=65 ids per row")):
        dt.linear_logp(h, w, wide, backend=dt.TORCH_BACKEND_ID)


def test_cuda_tensors_raise_not_implemented_yet(monkeypatch):
    """CUDA tensors with [N, K] targets or topk=: NotImplementedYetError naming what is missing and
    the backend, unless the backend that would serve them says it computes them. (Exercised on the
    face's check itself: this machine may have no GPU.)"""
    from detlogp import torch as face

    cuda_like = types.SimpleNamespace(is_cuda=True)
    face._refuse_unserved_cuda(cuda_like, "", 4, False)  # the SM90 backend takes [N, K] targets
    face._refuse_unserved_cuda(cuda_like, "", 4, True)  # and computes the top-k output
    with pytest.raises(detlogp.NotImplementedYetError) as e:
        face._refuse_unserved_cuda(cuda_like, "cuda-cublas-materialized", None, True)
    assert isinstance(e.value, NotImplementedError)
    assert "the top-k output (topk=) on CUDA tensors: not implemented yet by backend 'cuda-cublas-materialized'" in str(
        e.value
    )
    with pytest.raises(detlogp.NotImplementedYetError, match=r"\[N, K\] targets \(K=2\) and the top-k output"):
        face._refuse_unserved_cuda(cuda_like, "cuda-cublas-materialized", 2, True)
    with pytest.raises(detlogp.NotImplementedYetError, match="the top-k output .* backend 'cuda-cublas-materialized'"):
        face._refuse_unserved_cuda(cuda_like, "cuda-cublas-materialized", None, True)
    face._refuse_unserved_cuda(cuda_like, "", 1, False)  # one id a row as [N, 1]: served as today
    face._refuse_unserved_cuda(cuda_like, dt.TORCH_BACKEND_ID, 4, True)  # the plain lane computes both
    face._refuse_unserved_cuda(types.SimpleNamespace(is_cuda=False), "", 4, True)
    listed = face._ext.list_backends()
    served = [dict(b, multi_targets=True, topk=True) if b["memory"] == "cuda" else b for b in listed]
    monkeypatch.setattr(face._ext, "list_backends", lambda: served)
    face._refuse_unserved_cuda(cuda_like, "", 4, True)  # a CUDA backend that serves them: no refusal
    caps = {b["id"]: (b["multi_targets"], b["topk"]) for b in listed}
    assert caps[CPU] == (True, True) and caps["cuda-fused-linear-logp-sm90-contract-v1"] == (True, True)
    assert caps["cuda-cublas-materialized"] == (False, False)


# --- CUDA tensors on the SM90 backend (skipped without an SM90 GPU) ------------------------------

SM90 = "cuda-fused-linear-logp-sm90-contract-v1"


def _why_not_sm90():
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    sm90 = next(b for b in detlogp.backends() if b["id"] == SM90)
    return None if sm90["available"] else f"SM90 backend unavailable: {sm90['detail']}"


needs_sm90 = pytest.mark.skipif(_why_not_sm90() is not None, reason=str(_why_not_sm90()))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("v, k", [(17, 2), (123, 8), (2053, 8), (2053, 64), (151936, 8)])
def test_cuda_multi_id_entries_are_single_target_calls(v, k):
    """CUDA [N, K] targets on the SM90 backend: each entry has the bits of the single-target call
    for that id (ignored entries too), the same lse and entropy, int32 and int64, with bias and
    per-row T, trainer and serving (logits) entries; batch shapes [..., K]."""
    n = 6 if v == 151936 else 11
    h, w, b, t, temp = problem(n, 64, v, k=k, seed=v + k)
    h, w, b, t, temp = (x.cuda() for x in (h, w, b, t, temp))
    for targets in (t, t.int()):
        for logits in (False, True):
            out = dt.linear_logp(h, w, targets, bias=b, temperature=temp, return_entropy=True, return_logits=logits)
            logp, lse, ent = out[:3]
            assert logp.shape == (n, k) and logp.is_cuda and dt.last_report()["backend_id"] == SM90
            for j in range(k):
                one = dt.linear_logp(
                    h, w, targets[:, j].contiguous(), bias=b, temperature=temp, return_entropy=True,
                    return_logits=logits,
                )  # fmt: skip
                assert same(logp[:, j].cpu(), one[0].cpu()), (v, k, j, targets.dtype, logits)
                if j == 0:
                    assert same(lse.cpu(), one[1].cpu()) and same(ent.cpu(), one[2].cpu())
                    if logits:
                        assert same(out[3].cpu(), one[3].cpu())
    lp3, lse3 = dt.linear_logp(h.reshape(1, n, 64), w, t.reshape(1, n, k), bias=b, temperature=temp.reshape(1, n))
    lp2, lse2 = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    assert lp3.shape == (1, n, k) and same(lp3.reshape(n, k).cpu(), lp2.cpu()) and same(lse3.reshape(n).cpu(), lse2.cpu())


@pytest.mark.gpu
@needs_sm90
def test_cuda_multi_id_matches_the_cpu_sm90_model():
    """The SM90 backend's [N, K] bits are those of the CPU model of its logits
    (cpu-sm90-emulated-contract-v1) for every entry."""
    h, w, b, t, temp = problem(13, 64, 700, k=6, seed=3)
    lp_gpu, lse_gpu = dt.linear_logp(h.cuda(), w.cuda(), t.cuda(), bias=b.cuda(), temperature=temp.cuda())
    lp_cpu, lse_cpu = dt.linear_logp(h, w, t, bias=b, temperature=temp, backend="cpu-sm90-emulated-contract-v1")
    assert same(lp_gpu.cpu(), lp_cpu) and same(lse_gpu.cpu(), lse_cpu)


@pytest.mark.gpu
@needs_sm90
def test_cuda_multi_id_backward_runs_the_torch_path():
    """Autograd of CUDA [N, K] targets: the fused backward takes one target a row, so the gradient
    runs the torch path (as on CPU tensors) and matches float64."""
    from detlogp._torch import backward

    h, w, b, t, temp = problem(7, 32, 300, k=3, seed=5)
    hc, wc = h.cuda().requires_grad_(), w.cuda().requires_grad_()
    logp, lse = dt.linear_logp(hc, wc, t.cuda(), bias=b.cuda(), temperature=temp.cuda())
    g = loss_weights(logp.shape, 1).float().cuda()
    (logp * g).sum().backward()
    assert backward.last_backward["path"] == "torch"
    (h64, w64, _, _), ref, _, _ = reference(h, w, b, t, temp)
    (ref * g.double().cpu()).sum().backward()
    torch.testing.assert_close(hc.grad.double().cpu(), h64.grad, rtol=0.05, atol=0.05)


# --- gradients ----------------------------------------------------------------------------------


def reference(h, w, b, t, temp, ids=None, real_vocab=None, ignore_index=-100):
    """float64 autograd of log_softmax over the same (bf16-valued) inputs: logp [N, K] of the
    targets, lse, and the logp of the constant ids [N, K'] (the top-k)."""
    h64, w64, b64, T64 = (x.detach().double().requires_grad_() for x in (h, w, b, temp))
    y = (h64 @ w64.T + b64) / T64[:, None]
    if real_vocab is not None:
        y = y.masked_fill(torch.arange(w.shape[0]) >= real_vocab, float("-inf"))
    lse = torch.logsumexp(y, 1)
    ignored = t == ignore_index
    logp = torch.where(ignored, 0.0, y.gather(1, t.clamp(min=0)) - lse[:, None])
    topk_logp = None if ids is None else y.gather(1, ids) - lse[:, None]
    return (h64, w64, b64, T64), logp, lse, topk_logp


def loss_weights(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("with_topk", [False, True])
def test_gradients_match_float64(monkeypatch, with_topk):
    """d/d(hidden, weight, bias, T) of a loss over logp [N, K] (random weights per entry; ignored
    entries and a repeated id), lse and topk_logp (ids held constant) against float64 autograd;
    chunks of 64 vocabulary rows."""
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 64)
    real = 280
    h, w, b, t, temp = problem(11, 40, 300, k=5, seed=3, real_vocab=real)
    args = [x.clone().requires_grad_() for x in (h, w, b, temp)]
    out = dt.linear_logp(*args[:2], t, bias=args[2], temperature=args[3], real_vocab=real,
                         topk=6 if with_topk else None)  # fmt: skip
    a, c = loss_weights(t.shape, 1), loss_weights((11, 6), 2)
    loss = (out[0].double() * a).sum() + 0.3 * out[1].double().sum()
    if with_topk:
        loss = loss + (out[3].double() * c).sum()
    loss.backward()
    leaves, logp, lse, topk_logp = reference(h, w, b, t, temp, ids=out[2] if with_topk else None, real_vocab=real)
    assert (out[0].double() - logp).abs().max() < 1e-5
    ref = (logp * a).sum() + 0.3 * lse.sum() + ((topk_logp * c).sum() if with_topk else 0.0)
    ref.backward()
    for name, x, r in zip(("hidden", "weight", "bias", "temperature"), args, leaves):
        err = ((x.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item()
        assert err < 1e-2, (name, err)  # bf16 hidden/weight gradients


def test_gradcheck_float64_plain_lane(monkeypatch):
    """torch.autograd.gradcheck of the backward's entry terms (multi-id with ignored and repeated
    ids, and topk_logp), through the plain lane in float64, chunks of 8 rows."""
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 8)
    h, w, b, t, temp = problem(4, 5, 19, k=3, seed=5, dtype=torch.float64, real_vocab=17)
    args = [x.clone().requires_grad_() for x in (h, w, b, temp)]

    def f(h, w, b, temp):
        logp, lse, _, topk_logp = dt.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=17, topk=4,
                                                 backend=dt.TORCH_BACKEND_ID)  # fmt: skip
        return logp, lse, topk_logp

    assert torch.autograd.gradcheck(f, args)


def test_ignored_entries_and_entry_gradients_compose():
    """An ignored entry adds no gradient; K entries give the gradient of K single-target calls
    summed (same loss), up to rounding; a gradient through topk_logp equals one through logp of
    [N, K] targets that are those ids."""
    h, w, b, t, temp = problem(7, 24, 150, k=3, seed=8)
    t[:, 1] = -100

    def grads(targets, weights, topk=None):
        hh = h.clone().requires_grad_()
        out = dt.linear_logp(hh, w, targets, bias=b, temperature=temp, topk=topk)
        (out[0 if topk is None else 3] * weights).sum().backward()
        return hh.grad.float(), out

    a = loss_weights(t.shape, 4).float()
    g_multi, _ = grads(t, a)
    kept = t[:, [0, 2]].contiguous()
    g_kept, _ = grads(kept, a[:, [0, 2]])
    assert torch.equal(g_multi, g_kept)  # the ignored column changes no bit
    g_sum = sum(grads(t[:, k].contiguous(), a[:, k])[0] for k in (0, 2))
    assert ((g_multi - g_sum).abs().max() / g_sum.abs().max()).item() < 1e-2
    c = loss_weights((7, 4), 5).float()
    g_topk, out = grads(t, c, topk=4)
    g_ids, _ = grads(out[2], c)
    assert torch.equal(g_topk, g_ids)


def test_backward_is_bitwise_deterministic():
    h, w, b, t, temp = problem(16, 32, 500, k=4, seed=9)
    runs = []
    for _ in range(2):
        args = [x.clone().requires_grad_() for x in (h, w, b)]
        logp, lse, _, topk_logp = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp, topk=8)
        (logp.sum() + 0.5 * lse.sum() - topk_logp[:, :3].sum()).backward()
        runs.append([x.grad.clone() for x in args])
    for g1, g2 in zip(*runs):
        assert torch.equal(g1.view(torch.int16) if g1.dtype == torch.bfloat16 else bits(g1),
                           g2.view(torch.int16) if g2.dtype == torch.bfloat16 else bits(g2))  # fmt: skip


def test_plain_lane_matches_the_contract_lane():
    """The plain-torch lane's [N, K] logp and top-k agree with the contract lane's (values to fp32
    rounding, the same ids where no two logits are near)."""
    h, w, b, t, temp = problem(5, 16, 90, k=3, seed=11)
    c = dt.linear_logp(h, w, t, bias=b, temperature=temp, topk=5)
    p = dt.linear_logp(h, w, t, bias=b, temperature=temp, topk=5, backend=dt.TORCH_BACKEND_ID)
    assert (c[0] - p[0]).abs().max() < 1e-4 and (c[3] - p[3]).abs().max() < 1e-4
    assert torch.equal(c[2], p[2])


@pytest.mark.slow
def test_torch_compile_multi_id_and_topk():
    h, w, b, t, temp = problem(6, 16, 130, k=3, seed=12)

    def f(h, w):
        logp, lse, ids, topk_logp = dt.linear_logp(h, w, t, bias=b, temperature=0.8, topk=4)
        return logp.sum() + topk_logp.sum(), logp, ids

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    l1, lp1, ids1 = f(hh, ww)
    l1.backward()
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    l2, lp2, ids2 = torch.compile(f, fullgraph=True)(hc, wc)
    l2.backward()
    assert same(lp1, lp2) and torch.equal(ids1, ids2)
    assert torch.equal(hh.grad.view(torch.int16), hc.grad.view(torch.int16))


# --- tensor parallelism ----------------------------------------------------------------------


@pytest.mark.parametrize("world, split", [(2, "engine"), (3, "engine"), (2, "tile")])
def test_tensor_parallel_multi_id_and_topk_gloo(world, split):
    """tp_group (gloo, CPU processes) with [N, K] targets and topk=: the TP = 1 ids and bits on
    every rank, gradients as at TP = 1 (tests/python/tp_worker.py --multi)."""
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), str(HERE / "tp_worker.py"), "--device", "cpu",
           "--rows", "21", "--dim", "64", "--vocab", "517", "--split", split, "--multi"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETLOGP_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("TP_OK") == world, out[-4000:]
    assert "FAIL" not in out and out.count("PASS multi") >= world * 6, out[-4000:]


# --- the vLLM-style response example ---------------------------------------------------------


def test_vllm_logprobs_example_runs_and_its_ranks_are_the_contract_order():
    """examples/vllm_logprobs.py: the sampled token's logprob (SampleResult.logp_raw's bits, which
    the example asserts) plus the top-k with 1-based ranks in the contract's order; run as a script
    too (docs/python.md and docs/integrations.md show it)."""
    import importlib.util

    path = HERE.parents[1] / "examples" / "vllm_logprobs.py"
    spec = importlib.util.spec_from_file_location("vllm_logprobs", path)
    ex = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ex  # its dataclass looks its module up
    spec.loader.exec_module(ex)
    k = 4
    response = ex.main(["--rows", "6", "--topk", str(k), "--temperature", "1.5"])
    hidden, weight = ex.tiny_head(6, 64, 500, 1234)
    y = contract_y(hidden, weight, None, torch.full((6,), 1.5), 500)
    order = torch.sort(y, dim=1, descending=True, stable=True).indices
    outside = 0
    for n, row in enumerate(response):
        token = next(iter(row))  # the sampled token first
        ranks = {i: lp.rank for i, lp in row.items()}
        assert ranks[token] == int((order[n] == token).nonzero()) + 1
        assert sorted(r for i, r in ranks.items() if i != token or ranks[token] <= k) == list(range(1, k + 1))
        for i, lp in row.items():
            assert int(order[n, lp.rank - 1]) == i and lp.decoded_token == f"<tok{i}>"
        outside += ranks[token] > k
    assert len(response) == 6 and outside > 0  # some sampled token lies outside the top-k: k + 1 entries
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, str(path), "--rows", "2", "--topk", "3"], capture_output=True, text=True,
                          env={k: v for k, v in env.items() if not k.startswith("DETLOGP_")}, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("rank=1") == 2 and "backend: cpu-linear-logp-contract-v1" in proc.stdout, proc.stdout


def test_grad_logits_of_several_targets_a_row():
    """detlogp.torch.grad_logits with [N, K] targets and g_logp [N, K] (the CPU implementation of
    docs/contract.md appendix A): against the float64 formula (ignored entries, a repeated id, a
    chunk at vocab_start > 0); with every entry but the first ignored, the [N] call's bits; g_logp
    shaped otherwise is refused by name."""
    h, w, b, t, temp = problem(9, 32, 260, k=5, seed=21)
    logp, lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    g = torch.Generator().manual_seed(22)
    g_logp, g_lse = torch.randn(9, 5, generator=g), torch.randn(9, generator=g)
    y = (h.double() @ w.double().T + b.double()) / temp.double()[:, None]
    p = torch.exp(y - lse.double()[:, None])
    gl = torch.where(t == -100, 0.0, g_logp.double())
    ref = p * (g_lse.double() - gl.sum(1))[:, None]
    for j in range(5):
        ref.scatter_add_(1, t[:, j : j + 1].clamp(min=0), gl[:, j : j + 1])
    ref = ref / temp.double()[:, None]
    for start in (0, 100):
        dz = dt.grad_logits(h, w[start:], t, lse, g_logp, g_lse, bias=b[start:], temperature=temp, vocab_start=start,
                            real_vocab=260)  # fmt: skip
        err = ((dz.double() - ref[:, start:]).abs().max() / ref.abs().max()).item()
        assert err < 4e-3, (start, err)  # bf16 dz
    kept = torch.full_like(t, -100)
    kept[:, 0] = t[:, 0]
    multi = dt.grad_logits(h, w, kept, lse, g_logp, g_lse, bias=b, temperature=temp)
    single = dt.grad_logits(h, w, t[:, 0].contiguous(), lse, g_logp[:, 0].contiguous(), g_lse, bias=b, temperature=temp)
    assert torch.equal(multi.view(torch.int16), single.view(torch.int16))
    with pytest.raises(detlogp.InputError, match=re.escape("g_logp must be [N=9, K=5] f32, contiguous")):
        dt.grad_logits(h, w, t, lse, g_logp[:, 0].contiguous(), g_lse, bias=b, temperature=temp)

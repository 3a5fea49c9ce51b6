"""The entropy output of the array API (docs/contract.md §10) on the CPU backend: the logp/lse bits
unchanged by asking for it, serving == trainer == reduce_logits of the serving logits, float64
accuracy, row invariance, ignored rows, and the backends that refuse it."""

import numpy as np
import pytest
from conftest import make_problem

import detlogp

CPU = "cpu-linear-logp-contract-v1"


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def entropy_f64(h, w, b, temp):
    z = detlogp.from_bf16_bits(h).astype(np.float64) @ detlogp.from_bf16_bits(w).astype(np.float64).T
    if b is not None:
        z = z + b.astype(np.float64)
    y = z / (np.asarray(temp, np.float64)[:, None] if np.ndim(temp) else np.float64(temp))
    y = y - y.max(1, keepdims=True)
    e = np.exp(y)
    s = e.sum(1)
    return np.log(s) - (e * y).sum(1) / s


@pytest.mark.parametrize("v", [17, 123, 2053])
def test_entropy_beside_unchanged_logp_and_lse(v):
    h, w, t, b, temp = make_problem(21, 48, v, seed=v, bias=True, temp_rows=True, ignore_every=4, weight_scale=0.3)
    plain = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, backend=CPU)
    assert plain.entropy is None
    r = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, backend=CPU, return_entropy=True)
    assert np.array_equal(bits(r.logp), bits(plain.logp)) and np.array_equal(bits(r.lse), bits(plain.lse))
    assert r.entropy.dtype == np.float32 and r.entropy.shape == (21,)
    want = entropy_f64(h, w, b, temp)
    assert np.all(np.abs(r.entropy - want) <= 1e-4 * np.maximum(1.0, want))
    assert np.all(np.isfinite(r.entropy[3::4]))  # ignored rows report it, like lse
    assert r.report["provenance"]["entropy_id"] == detlogp.contract()["entropy_id"] != ""


def test_serving_trainer_and_reduce_logits_give_the_same_entropy_bits():
    h, w, t, b, temp = make_problem(13, 64, 2053, seed=5, bias=True, weight_scale=0.3)
    trainer = detlogp.linear_logp(h, w, t, bias=b, temperature=0.8, backend=CPU, return_entropy=True)
    serving = detlogp.linear_logp(h, w, t, bias=b, temperature=0.8, backend=CPU, return_entropy=True,
                                  return_logits=True)  # fmt: skip
    assert np.array_equal(bits(trainer.entropy), bits(serving.entropy))
    logp, lse, entropy = detlogp.reduce_logits(serving.logits, t, temperature=0.8, return_entropy=True)
    assert np.array_equal(bits(entropy), bits(trainer.entropy))
    assert np.array_equal(bits(logp), bits(trainer.logp)) and np.array_equal(bits(lse), bits(trainer.lse))
    assert len(detlogp.reduce_logits(serving.logits, t, temperature=0.8)) == 2


def test_a_rows_entropy_does_not_depend_on_the_batch():
    h, w, t, _, _ = make_problem(17, 32, 123, seed=9, weight_scale=0.5)
    full = detlogp.linear_logp(h, w, t, backend=CPU, return_entropy=True).entropy
    picks = [16, 3, 3, 0]
    sub = detlogp.linear_logp(h[picks], w, t[picks], backend=CPU, return_entropy=True).entropy
    assert np.array_equal(bits(sub), bits(full[picks]))


def test_backends_without_it_refuse_it():
    h, w, t, _, _ = make_problem(4, 16, 17)
    with pytest.raises(detlogp.DetlogpError, match="entropy"):
        detlogp.linear_logp(h, w, t, backend="reference-materialized", return_entropy=True)
    assert detlogp.linear_logp(h, w, t, backend="reference-materialized").report["provenance"]["entropy_id"] == ""


# --- detlogp.torch.linear_logp(..., return_entropy=True) on the CPU ------------------------------

try:
    import torch
    import detlogp.torch as dt
except ImportError:  # the array API's tests above run without torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (the torch tests need it)")


def torch_problem(n, d, v, seed=0, dtype=None, ignore=(1,), real_vocab=None):
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.bfloat16
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * 0.3).to(dtype)
    fdt = torch.float64 if dtype == torch.float64 else torch.float32
    b = (torch.randn(v, generator=g) * 0.5).to(fdt)
    t = torch.randint(0, real_vocab or v, (n,), generator=g)
    for i in ignore:
        t[i] = -100
    temp = (torch.rand(n, generator=g) + 0.5).to(fdt)
    # The loss's coefficients: L = sum a * logp + b * lse + c * H.
    coef = [(torch.rand(n, generator=g) * span + lo).to(fdt) for span, lo in ((2.0, -0.5), (1.0, -0.5), (1.5, -0.75))]
    return h, w, b, t, temp, coef


def mixed_loss(logp, lse, entropy, coef):
    a, b, c = (x.to(logp.dtype) for x in coef)
    return (a * logp + b * lse + c * entropy).sum()


def float64_mixed(h, w, b, t, temp, coef, real_vocab=None, ignore_index=-100):
    """float64 autograd of the mixed loss over the same inputs: log_softmax over the real vocabulary
    (the padding columns left out, so no -inf enters the entropy's p log p). Returns (logp, lse, H,
    grads of hidden, weight, bias, temperature)."""
    h64, w64, b64, T64 = (x.detach().double().requires_grad_() for x in (h, w, b, temp))
    rv = real_vocab or w.shape[0]
    y = ((h64 @ w64.T + b64) / (T64[:, None] if T64.dim() else T64))[:, :rv]
    logsm = torch.log_softmax(y, 1)
    lse = torch.logsumexp(y, 1)
    ignored = t == ignore_index
    logp = torch.where(ignored, 0.0, logsm.gather(1, t.clamp(min=0)[:, None])[:, 0])
    entropy = -(logsm.exp() * logsm).sum(1)
    mixed_loss(logp, lse, entropy, [c.double() for c in coef]).backward()
    return logp.detach(), lse.detach(), entropy.detach(), [x.grad for x in (h64, w64, b64, T64)]


def rel_err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def i32(x):
    return x.contiguous().view(torch.int32)


@needs_torch
def test_torch_entropy_bits_equal_the_array_api_and_the_output_order():
    h, w, t, b, temp = make_problem(17, 64, 2053, seed=11, bias=True, temp_rows=True, ignore_every=4)
    r = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, backend=CPU, return_entropy=True, return_logits=True)
    th = torch.from_numpy(h.view(np.int16)).view(torch.bfloat16)
    tw = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    kw = dict(bias=torch.from_numpy(b), temperature=torch.from_numpy(temp), backend=CPU)
    logp, lse, entropy = dt.linear_logp(th, tw, torch.from_numpy(t), return_entropy=True, **kw)
    assert dt.last_report()["provenance"]["entropy_id"] == detlogp.contract()["entropy_id"]
    assert entropy.dtype == torch.float32 and entropy.shape == (17,)
    assert np.array_equal(bits(entropy.numpy()), bits(r.entropy))
    assert np.array_equal(bits(logp.numpy()), bits(r.logp)) and np.array_equal(bits(lse.numpy()), bits(r.lse))
    # With the logits too: logits come last.
    out = dt.linear_logp(th, tw, torch.from_numpy(t), return_entropy=True, return_logits=True, **kw)
    assert len(out) == 4 and out[3].shape == (17, 2053)
    assert np.array_equal(bits(out[2].numpy()), bits(r.entropy))
    assert np.array_equal(bits(out[3].numpy()), bits(r.logits))
    # Asking for it leaves logp/lse/logits alone; without it the outputs are as before.
    plain = dt.linear_logp(th, tw, torch.from_numpy(t), return_logits=True, **kw)
    assert len(plain) == 3 and torch.equal(i32(plain[0]), i32(logp)) and torch.equal(i32(plain[2]), i32(out[3]))
    # A batch shape: entropy shaped like the targets.
    shaped = dt.linear_logp(th[:16].view(4, 4, 64), tw, torch.from_numpy(t[:16]).view(4, 4), return_entropy=True,
                            bias=kw["bias"], temperature=kw["temperature"][:16].view(4, 4), backend=CPU)  # fmt: skip
    assert shaped[2].shape == (4, 4) and torch.equal(i32(shaped[2].reshape(-1)), i32(entropy[:16]))


@needs_torch
@pytest.mark.parametrize("v,real_vocab", [(17, None), (123, 100), (2053, 2000)])
def test_torch_entropy_gradients_match_float64(monkeypatch, v, real_vocab):
    """A loss mixing logp, lse and entropy, differentiated in hidden, weight, bias and the per-row
    temperature (the torch chunk loop, chunks of 64 rows), against float64 autograd."""
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 64)
    h, w, b, t, temp, coef = torch_problem(13, 48, v, seed=v, ignore=(2, 7), real_vocab=real_vocab)
    args = [x.clone().requires_grad_() for x in (h, w, b, temp)]
    logp, lse, entropy = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=args[3], real_vocab=real_vocab,
                                        return_entropy=True, backend=CPU)  # fmt: skip
    mixed_loss(logp, lse, entropy, coef).backward()
    assert dt.last_backward_path() == "torch"
    ref_logp, ref_lse, ref_h, ref_grads = float64_mixed(h, w, b, t, temp, coef, real_vocab)
    assert (entropy.double() - ref_h).abs().max() < 1e-4
    for name, a, r in zip(("hidden", "weight", "bias", "temperature"), args, ref_grads):
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-4  # bf16 gradients: 2^-8 relative rounding
        assert rel_err(a.grad, r) < tol, (name, rel_err(a.grad, r))
    if real_vocab is not None:  # padding rows of the head: no gradient
        assert torch.count_nonzero(args[1].grad[real_vocab:]) == 0 and torch.count_nonzero(args[2].grad[real_vocab:]) == 0


@needs_torch
def test_torch_entropy_gradient_of_a_zero_d_temperature():
    h, w, b, t, _, coef = torch_problem(11, 32, 300, seed=3, ignore=(4,))
    t0 = torch.tensor(0.8125, requires_grad=True)
    hh = h.clone().requires_grad_()
    logp, lse, entropy = dt.linear_logp(hh, w, t, bias=b, temperature=t0, return_entropy=True, backend=CPU)
    mixed_loss(logp, lse, entropy, coef).backward()
    _, _, _, (g_h, _, _, g_t) = float64_mixed(h, w, b, t, torch.tensor(0.8125), coef)
    assert t0.grad.shape == () and abs(t0.grad.item() - g_t.item()) <= 1e-4 * abs(g_t.item())
    assert rel_err(hh.grad, g_h) < 1e-2


@needs_torch
def test_torch_entropy_of_ignored_rows_still_has_a_gradient():
    h, w, b, t, temp, coef = torch_problem(9, 32, 123, seed=2, ignore=(0, 4, 8))
    hh = h.clone().requires_grad_()
    _, _, entropy = dt.linear_logp(hh, w, t, bias=b, temperature=temp, return_entropy=True, backend=CPU)
    assert torch.all(torch.isfinite(entropy[[0, 4, 8]])) and torch.all(entropy > 0)
    entropy.sum().backward()
    assert torch.count_nonzero(hh.grad[[0, 4, 8]]) > 0  # H does not depend on the target
    zero = [torch.zeros(9), torch.zeros(9), torch.ones(9)]
    _, _, _, (g_h, _, _, _) = float64_mixed(h, w, b, t, temp, zero)
    assert rel_err(hh.grad, g_h) < 1e-2
    # logp of ignored rows: no gradient, even beside an entropy term of other rows.
    hh2 = h.clone().requires_grad_()
    logp, _, entropy = dt.linear_logp(hh2, w, t, bias=b, temperature=temp, return_entropy=True, backend=CPU)
    (logp.sum() + (entropy * torch.tensor([0.0, 1, 1, 1, 0, 1, 1, 1, 0])).sum()).backward()
    assert torch.count_nonzero(hh2.grad[[0, 4, 8]]) == 0


@needs_torch
def test_an_unused_entropy_leaves_the_gradient_bits_alone(monkeypatch):
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 64)
    h, w, b, t, temp, _ = torch_problem(13, 48, 300, seed=5, ignore=(2,))
    grads = []
    for return_entropy in (False, True):
        args = [x.clone().requires_grad_() for x in (h, w, b, temp)]
        out = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=args[3], return_entropy=return_entropy,
                            backend=CPU)  # fmt: skip
        (out[0].sum() + 0.25 * out[1].sum()).backward()
        grads.append([a.grad for a in args])
    for g1, g2 in zip(*grads):
        assert torch.equal(g1.view(torch.int16) if g1.dtype == torch.bfloat16 else i32(g1),
                           g2.view(torch.int16) if g2.dtype == torch.bfloat16 else i32(g2))  # fmt: skip


@needs_torch
@pytest.mark.parametrize("v,real_vocab", [(17, None), (123, 100)])
def test_torch_entropy_gradcheck_float64(monkeypatch, v, real_vocab):
    """gradcheck of the chunked backward with the entropy term (hidden, weight, bias, per-row and 0-d
    temperature, ignored rows, padding rows) through the plain lane in float64; chunks of 8 rows."""
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 8)
    h, w, b, t, temp, _ = torch_problem(5, 6, v, dtype=torch.float64, ignore=(1, 3), real_vocab=real_vocab)
    args = [x.clone().requires_grad_() for x in (h, w, b, temp)]

    def f(h, w, b, temp):
        return dt.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=real_vocab, return_entropy=True,
                              backend=dt.TORCH_BACKEND_ID)  # fmt: skip

    assert torch.autograd.gradcheck(f, args)

    def f_entropy_only(h, w, temp):
        return dt.linear_logp(h, w, t, temperature=temp, real_vocab=real_vocab, return_entropy=True,
                              backend=dt.TORCH_BACKEND_ID)[2]  # fmt: skip

    t0 = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f_entropy_only, [args[0], args[1], t0])

    def f_logits(h, w, b):
        return dt.linear_logp(h, w, t, bias=b, temperature=0.7, return_logits=True, real_vocab=real_vocab,
                              return_entropy=True, backend=dt.TORCH_BACKEND_ID)  # fmt: skip

    assert torch.autograd.gradcheck(f_logits, args[:3])


@needs_torch
def test_torch_entropy_under_torch_compile():
    h, w, b, t, temp, coef = torch_problem(8, 32, 123, seed=4)

    def loss(h, w, b):
        logp, lse, entropy = dt.linear_logp(h, w, t, bias=b, temperature=0.8, return_entropy=True, backend=CPU)
        return mixed_loss(logp, lse, entropy, coef), entropy

    eager = [x.clone().requires_grad_() for x in (h, w, b)]
    comp = [x.clone().requires_grad_() for x in (h, w, b)]
    l1, e1 = loss(*eager)
    l1.backward()
    l2, e2 = torch.compile(loss, fullgraph=True)(*comp)
    l2.backward()
    assert torch.equal(i32(e1), i32(e2))  # the op's bits, compiled or not
    for a, c in zip(eager, comp):
        assert rel_err(c.grad.float(), a.grad.double()) < 1e-2

"""detlogp.torch.grad_logits (linear_logp_grad_logits) and the fused backward's chunk loop on the
CPU: the op against a float64 formula, its errors, the DETLOGP_TORCH_FUSED_BACKWARD knob, and the
fused chunk loop (forced onto the CPU op) against float64 autograd, deterministic and traceable.
The SM90 kernel itself is covered by tests/gpu/test_sm90_grad_logits.cpp and test_torch_gpu.py."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the torch tests need it)")
import detlogp  # noqa: E402
import detlogp.torch as dt  # noqa: E402
from detlogp._torch import backward  # noqa: E402



def expect_compiled_grads_equal(loss, *tensors):
    """loss(*tensors) backward, eager and under torch.compile(fullgraph=True): the same gradient bits."""
    eager = [x.clone().requires_grad_() for x in tensors]
    comp = [x.clone().requires_grad_() for x in tensors]
    loss(*eager).backward()
    torch.compile(loss, fullgraph=True)(*comp).backward()
    for a, c in zip(eager, comp):
        assert torch.equal(a.grad, c.grad)

def problem(n, d, v, seed=0, real_vocab=None, ignore=(1,)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * 0.3).bfloat16()
    b = torch.randn(v, generator=g) * 0.5
    t = torch.randint(0, real_vocab or v, (n,), generator=g)
    for i in ignore:
        t[i] = -100
    temp = torch.rand(n, generator=g) + 0.5
    g_logp = torch.rand(n, generator=g) * 2 - 0.5
    g_lse = torch.rand(n, generator=g) - 0.5
    return h, w, b, t, temp, g_logp, g_lse


def reference_dz(h, w, b, t, temp, lse, g_logp, g_lse, vocab_start, real_vocab, ignore_index=-100):
    """float64 dL/dz of the chunk w (global ids vocab_start ..), from the forward's lse."""
    c = w.shape[0]
    z = h.double() @ w.double().T + (0 if b is None else b.double())
    inv_t = 1.0 / (temp.double()[:, None] if isinstance(temp, torch.Tensor) else temp)
    p = torch.exp(z * inv_t - lse.double()[:, None])
    ids = torch.arange(vocab_start, vocab_start + c)
    p = torch.where(ids[None, :] < real_vocab, p, 0.0)
    ignored = t == ignore_index
    gl = torch.where(ignored, 0.0, g_logp.double()) if g_logp is not None else torch.zeros(len(t), dtype=torch.float64)
    gs = g_lse.double() if g_lse is not None else torch.zeros(len(t), dtype=torch.float64)
    d = (gs - gl)[:, None] * p + (ids[None, :] == t[:, None]) * gl[:, None]
    return d * inv_t


@pytest.mark.parametrize(
    "n,d,v,vocab_start,c,real_vocab",
    [(1, 64, 17, 0, 17, 17), (77, 200, 300, 64, 236, 250), (33, 96, 2053, 37, 2016, 2000), (13, 48, 123, 0, 123, 123)],
)
def test_grad_logits_matches_float64(n, d, v, vocab_start, c, real_vocab):
    h, w, b, t, temp, g_logp, g_lse = problem(n, d, v, seed=n + c, real_vocab=real_vocab, ignore=(0,) if n > 1 else ())
    if n > 3:
        t[2] = vocab_start + c // 2 if vocab_start + c // 2 < real_vocab else 0
        t[3] = real_vocab - 1
    _, lse = dt.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=real_vocab)
    wc, bc = w[vocab_start : vocab_start + c], b[vocab_start : vocab_start + c]
    dz = dt.grad_logits(h, wc, t, lse, g_logp, g_lse, bias=bc, temperature=temp, vocab_start=vocab_start,
                        real_vocab=real_vocab)  # fmt: skip
    assert dz.dtype == torch.bfloat16 and dz.shape == (n, c)
    ref = reference_dz(h, wc, bc, t, temp, lse, g_logp, g_lse, vocab_start, real_vocab)
    scale = (g_logp.abs() + g_lse.abs()).double()[:, None] / temp.double()[:, None]
    err = (dz.double() - ref).abs()
    assert torch.all(err <= 2**-8 * ref.abs() + 1e-6 * scale), err.max()
    pad = torch.arange(vocab_start, vocab_start + c) >= real_vocab
    assert torch.all(dz[:, pad].view(torch.int16) == 0)  # padding columns: exactly +0


def test_grad_logits_into_strided_out_and_absent_upstream():
    h, w, b, t, temp, g_logp, _ = problem(9, 64, 200, seed=3)
    _, lse = dt.linear_logp(h, w, t, temperature=0.7)
    buf = torch.full((9, 210), float("nan"), dtype=torch.bfloat16)
    out = buf[:, :200]
    assert dt.grad_logits(h, w, t, lse, g_logp, None, temperature=0.7, out=out) is out
    ref = reference_dz(h, w, None, t, 0.7, lse, g_logp, None, 0, 200)
    assert ((out.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-6).all()
    assert torch.isnan(buf[:, 200:]).all()  # past C: never written
    zeros = dt.grad_logits(h, w, t, lse)
    assert torch.count_nonzero(zeros) == 0


def test_grad_logits_errors_name_the_argument():
    h, w, b, t, temp, g_logp, g_lse = problem(6, 32, 100, seed=4)
    _, lse = dt.linear_logp(h, w, t)
    bad = t.clone()
    bad[2] = 100
    with pytest.raises(IndexError, match=r"targets\[2\]=100 is >= real_vocab=100"):
        dt.grad_logits(h, w, bad, lse, g_logp)
    with pytest.raises(ValueError, match=r"lse has 5 elements, expected 6"):
        dt.grad_logits(h, w, t, lse[:5], g_logp)
    with pytest.raises(ValueError, match=r"dz must be \[N=6, C=100\]"):
        dt.grad_logits(h, w, t, lse, out=torch.empty(6, 99, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dz"):
        dt.grad_logits(h, w, t, lse, out=torch.empty(6, 100, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"temperature_rows\[1\]=0"):
        dt.grad_logits(h, w, t, lse, temperature=torch.tensor([1.0, 0.0, 1, 1, 1, 1]))
    out = torch.full((6, 100), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(detlogp.TargetIndexError):
        dt.grad_logits(h, w, bad, lse, g_logp, out=out)
    assert torch.isnan(out).all()  # nothing written


def test_fused_backward_knob(monkeypatch):
    h, w, b, t, temp, _, _ = problem(5, 16, 70, seed=5)
    for value in ("0", "1"):
        monkeypatch.setenv("DETLOGP_TORCH_FUSED_BACKWARD", value)
        dt.linear_logp(h, w, t)  # accepted by the library's environment check
    monkeypatch.setenv("DETLOGP_TORCH_FUSED_BACKWARD", "2")
    with pytest.raises(detlogp.ConfigError, match="DETLOGP_TORCH_FUSED_BACKWARD=2 must be 0 or 1"):
        dt.linear_logp(h, w, t)
    monkeypatch.delenv("DETLOGP_TORCH_FUSED_BACKWARD")
    hh = h.clone().requires_grad_()
    dt.linear_logp(hh, w, t)[0].sum().backward()
    assert dt.last_backward_path() == "torch"  # CPU tensors: the torch chunk loop


def _force_fused(monkeypatch, chunk_rows):
    """The fused chunk loop on the CPU op (on CUDA it is the SM90 kernel), chunk_rows per chunk."""
    monkeypatch.setattr(backward, "_fused_backward_ok", lambda hidden, weight, need_t, g_logits: not need_t and (
        g_logits is None or g_logits.numel() == 0))  # fmt: skip
    monkeypatch.setattr(dt, "BACKWARD_FUSED_CHUNK_BYTES", chunk_rows * 2 * 13)


def test_fused_chunk_loop_matches_float64(monkeypatch):
    _force_fused(monkeypatch, 256)  # 13 rows: chunks of 256 vocabulary rows
    n, d, v, real_vocab = 13, 48, 700, 650
    h, w, b, t, temp, _, _ = problem(n, d, v, seed=6, real_vocab=real_vocab, ignore=(2, 7))
    args = [x.clone().requires_grad_() for x in (h, w, b)]
    logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp, real_vocab=real_vocab)
    (logp * torch.linspace(0.5, 1.5, n) + 0.25 * lse).sum().backward()
    assert dt.last_backward_path() == "fused"
    ref = [x.detach().double().requires_grad_() for x in (h, w, b)]
    y = (ref[0] @ ref[1].T + ref[2]) / temp.double()[:, None]
    y = y.masked_fill(torch.arange(v) >= real_vocab, float("-inf"))
    lse64 = torch.logsumexp(y, 1)
    lp64 = torch.where(t == -100, 0.0, y.gather(1, t.clamp(min=0)[:, None])[:, 0] - lse64)
    (lp64 * torch.linspace(0.5, 1.5, n).double() + 0.25 * lse64).sum().backward()
    for name, a, r in zip(("hidden", "weight", "bias"), args, ref):
        err = ((a.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item()
        assert err < 2e-2, (name, err)
    assert torch.count_nonzero(args[1].grad[real_vocab:]) == 0  # padding rows of the head: no gradient


def test_fused_chunk_loop_deterministic(monkeypatch):
    h, w, b, t, temp, _, _ = problem(13, 32, 1000, seed=7)
    runs = []
    for chunk in (256, 256, 512):
        _force_fused(monkeypatch, chunk)
        args = [x.clone().requires_grad_() for x in (h, w, b)]
        logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=0.8)
        (logp.sum() + 0.1 * lse.sum()).backward()
        runs.append([a.grad for a in args])
    for g1, g2 in zip(runs[0], runs[1]):
        assert torch.equal(g1, g2)
    # Another chunking changes the GEMM shapes and the order of the fp32 hidden-gradient sum: close.
    for g1, g2 in zip(runs[0], runs[2]):
        assert (g1.float() - g2.float()).abs().max() <= 1e-2 * g1.float().abs().max()


def test_fused_chunk_loop_under_torch_compile(monkeypatch):
    _force_fused(monkeypatch, 256)
    h, w, b, t, temp, _, _ = problem(13, 32, 600, seed=8)

    def loss(h, w, b):
        logp, lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
        return logp.sum() + 0.1 * lse.sum()

    expect_compiled_grads_equal(loss, h, w, b)


# --- the entropy term (g_entropy with the forward's entropy) ------------------------------------


def reference_dz_entropy(h, w, b, t, temp, lse, entropy, g_logp, g_lse, g_entropy, vocab_start, real_vocab):
    """float64 dL/dz with the entropy term: p's factor gains -g_H (x + H), x = y - lse."""
    c = w.shape[0]
    z = h.double() @ w.double().T + (0 if b is None else b.double())
    inv_t = 1.0 / (temp.double()[:, None] if isinstance(temp, torch.Tensor) else temp)
    x = z * inv_t - lse.double()[:, None]
    ids = torch.arange(vocab_start, vocab_start + c)
    p = torch.where(ids[None, :] < real_vocab, torch.exp(x), 0.0)
    ignored = t == -100
    gl = torch.where(ignored, 0.0, g_logp.double()) if g_logp is not None else torch.zeros(len(t), dtype=torch.float64)
    gs = g_lse.double() if g_lse is not None else torch.zeros(len(t), dtype=torch.float64)
    factor = (gs - gl)[:, None] - g_entropy.double()[:, None] * (x + entropy.double()[:, None])
    d = p * factor + (ids[None, :] == t[:, None]) * gl[:, None]
    return d * inv_t, p * (x.abs() + entropy.double()[:, None] + 1) * g_entropy.double().abs()[:, None] * inv_t


@pytest.mark.parametrize(
    "n,d,v,vocab_start,c,real_vocab", [(1, 64, 17, 0, 17, 17), (77, 200, 300, 64, 236, 250), (33, 96, 2053, 37, 2016, 2000)]
)
def test_grad_logits_entropy_term_matches_float64(n, d, v, vocab_start, c, real_vocab):
    h, w, b, t, temp, g_logp, g_lse = problem(n, d, v, seed=n + c + 1, real_vocab=real_vocab, ignore=(0,) if n > 1 else ())
    _, lse, entropy = dt.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=real_vocab, return_entropy=True,
                                     backend="cpu-linear-logp-contract-v1")  # fmt: skip
    g_entropy = torch.rand(n, generator=torch.Generator().manual_seed(n)) * 1.5 - 0.75
    wc, bc = w[vocab_start : vocab_start + c], b[vocab_start : vocab_start + c]
    kw = dict(bias=bc, temperature=temp, vocab_start=vocab_start, real_vocab=real_vocab)
    dz = dt.grad_logits(h, wc, t, lse, g_logp, g_lse, entropy=entropy, g_entropy=g_entropy, **kw)
    ref, term = reference_dz_entropy(h, wc, bc, t, temp, lse, entropy, g_logp, g_lse, g_entropy, vocab_start,
                                     real_vocab)  # fmt: skip
    scale = (g_logp.abs() + g_lse.abs() + g_entropy.abs()).double()[:, None] / temp.double()[:, None]
    err = (dz.double() - ref).abs()
    assert torch.all(err <= 2**-8 * ref.abs() + 1e-5 * term + 1e-6 * scale), err.max()
    pad = torch.arange(vocab_start, vocab_start + c) >= real_vocab
    assert torch.all(dz[:, pad].view(torch.int16) == 0)  # padding columns: exactly +0
    # Without g_entropy: the logp-only bits (an entropy given alone is not read).
    plain = dt.grad_logits(h, wc, t, lse, g_logp, g_lse, **kw)
    alone = dt.grad_logits(h, wc, t, lse, g_logp, g_lse, entropy=torch.full_like(entropy, float("nan")), **kw)
    assert torch.equal(plain.view(torch.int16), alone.view(torch.int16))


def test_grad_logits_g_entropy_needs_entropy():
    h, w, b, t, temp, g_logp, g_lse = problem(6, 32, 100, seed=4)
    _, lse = dt.linear_logp(h, w, t)
    out = torch.full((6, 100), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"g_entropy needs entropy"):
        dt.grad_logits(h, w, t, lse, g_logp, g_entropy=torch.ones(6), out=out)
    assert torch.isnan(out).all()  # nothing written
    with pytest.raises(ValueError, match=r"g_entropy has 5 elements, expected 6"):
        dt.grad_logits(h, w, t, lse, g_logp, entropy=torch.ones(6), g_entropy=torch.ones(5))
    with pytest.raises(detlogp.InputError, match="g_entropy needs entropy"):
        backward.chunked_grads(h, w, None, t, torch.ones(6, 1), lse, None, None, None, 0, 100, -100,
                               (True, False, False, False), g_entropy=torch.ones(6))  # fmt: skip


def _float64_mixed_grads(h, w, b, t, temp, coef, real_vocab):
    ref = [x.detach().double().requires_grad_() for x in (h, w, b)]
    y = ((ref[0] @ ref[1].T + ref[2]) / temp.double()[:, None])[:, :real_vocab]
    logsm = torch.log_softmax(y, 1)
    lp64 = torch.where(t == -100, 0.0, logsm.gather(1, t.clamp(min=0)[:, None])[:, 0])
    h64 = -(logsm.exp() * logsm).sum(1)
    a, bb, c = (x.double() for x in coef)
    (a * lp64 + bb * torch.logsumexp(y, 1) + c * h64).sum().backward()
    return [x.grad for x in ref]


def test_fused_chunk_loop_with_entropy_matches_float64(monkeypatch):
    """The fused chunk loop (forced onto the CPU op) hands entropy and g_entropy to grad_logits: one
    pass for a loss mixing logp, lse and entropy, against float64 autograd."""
    _force_fused(monkeypatch, 256)
    n, d, v, real_vocab = 13, 48, 700, 650
    h, w, b, t, temp, _, _ = problem(n, d, v, seed=16, real_vocab=real_vocab, ignore=(2, 7))
    coef = (torch.linspace(0.5, 1.5, n), torch.full((n,), 0.25), torch.linspace(-0.8, 0.6, n))
    calls = []
    real_op = backward.grad_logits_op
    monkeypatch.setattr(backward, "grad_logits_op", lambda *a: calls.append(a[-1] is not None) or real_op(*a))
    args = [x.clone().requires_grad_() for x in (h, w, b)]
    logp, lse, entropy = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp, real_vocab=real_vocab,
                                        return_entropy=True, backend="cpu-linear-logp-contract-v1")  # fmt: skip
    (coef[0] * logp + coef[1] * lse + coef[2] * entropy).sum().backward()
    assert dt.last_backward_path() == "fused" and calls == [True, True, True]  # 3 chunks, each with the term
    ref = _float64_mixed_grads(h, w, b, t, temp, coef, real_vocab)
    for name, a, r in zip(("hidden", "weight", "bias"), args, ref):
        err = ((a.grad.double() - r).abs().max() / r.abs().max()).item()
        assert err < 2e-2, (name, err)
    assert torch.count_nonzero(args[1].grad[real_vocab:]) == 0
    # The entropy unused: no term passed, the logp-only bits.
    calls.clear()
    runs = []
    for return_entropy in (False, True):
        a2 = [x.clone().requires_grad_() for x in (h, w, b)]
        out = dt.linear_logp(a2[0], a2[1], t, bias=a2[2], temperature=temp, real_vocab=real_vocab,
                             return_entropy=return_entropy, backend="cpu-linear-logp-contract-v1")  # fmt: skip
        (out[0].sum() + 0.25 * out[1].sum()).backward()
        runs.append([x.grad for x in a2])
    assert calls == [False] * 6
    for g1, g2 in zip(*runs):
        assert torch.equal(g1, g2)


def test_fused_chunk_loop_with_entropy_under_torch_compile(monkeypatch):
    _force_fused(monkeypatch, 256)
    h, w, b, t, temp, _, _ = problem(13, 32, 600, seed=17)

    def loss(h, w, b):
        logp, lse, entropy = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True,
                                            backend="cpu-linear-logp-contract-v1")  # fmt: skip
        return logp.sum() + 0.1 * lse.sum() - 0.3 * entropy.sum()

    expect_compiled_grads_equal(loss, h, w, b)

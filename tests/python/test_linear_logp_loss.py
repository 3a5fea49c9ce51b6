"""detlogp.torch.linear_logp_loss on the CPU backend: the forward's logp / lse / entropy bits equal
linear_logp's at every chunk size; the logit gradient from the kept logits (in place) equals
linear_logp_grad_logits's bits; the gradients of policy-gradient, PPO-style and entropy-bonus losses
against float64 autograd; the upstream gradient's scaling; deterministic reruns; errors by name.
The CUDA path (the SM90 serving run, the in-place kernel, cuBLAS) is in test_torch_gpu.py."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the torch tests need it)")
import detlogp  # noqa: E402
import detlogp.torch as dt  # noqa: E402
from detlogp import InputError, TargetIndexError  # noqa: E402
from detlogp import _detlogp as ext  # noqa: E402


def problem(n=150, d=96, v=333, seed=0, peaked=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    h = (h / h.pow(2).mean(1, keepdim=True).sqrt()).bfloat16()
    w = (torch.randn(v, d, generator=g) * 0.15).bfloat16()
    b = torch.randn(v, generator=g) * 0.3
    t = torch.randint(0, v, (n,), generator=g)
    if peaked:  # a few rows whose target dominates
        for i in range(0, n, 7):
            t[i] = int((h[i].float() @ w.float().t()).argmax())
    if n > 5:
        t[5] = -100
    adv = torch.randn(n, generator=g)
    old = torch.randn(n, generator=g) * 0.1 - 3.0
    return h, w, b, t, adv, old


def pg_loss(adv):
    return lambda logp, lse, rows: -(logp * adv[rows]).sum()


def ppo_entropy_loss(adv, old, coef=0.01):
    def fn(logp, lse, entropy, rows):
        ratio = torch.exp(logp - old[rows])
        a = adv[rows]
        clipped = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
        return -(clipped.sum() + coef * entropy.sum()) / 150 + 1e-3 * (lse**2).sum()

    return fn


def float64_grads(h, w, b, t, temp, loss_of):
    """Gradients of loss_of(logp, lse, entropy) in float64 autograd over the materialized logits."""
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    y = (h64 @ w64.t() + b64) / temp
    lse = torch.logsumexp(y, 1)
    ignored = t == -100
    logp = torch.where(ignored, 0.0, y.gather(1, t.clamp(min=0)[:, None])[:, 0] - lse)
    x = y - lse[:, None]
    entropy = -(x.exp() * x).sum(1)
    loss_of(logp, lse, entropy).backward()
    return h64.grad, w64.grad, b64.grad


def expect_close(got, want, rel, what):
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel * scale + 1e-6, f"{what}: max |err| {err:.3g} against max |ref| {scale:.3g}"


@pytest.mark.parametrize("chunk_rows", [None, 64, 37, 1000])
def test_forward_outputs_are_linear_logp_bits(chunk_rows):
    h, w, b, t, adv, old = problem()
    temp = torch.rand(h.shape[0]) + 0.5
    r = dt.linear_logp_loss(h, w, t, ppo_entropy_loss(adv, old), bias=b, temperature=temp, return_entropy=True,
                            chunk_rows=chunk_rows)  # fmt: skip
    logp, lse, entropy = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True)
    assert torch.equal(r.logp, logp) and torch.equal(r.lse, lse) and torch.equal(r.entropy, entropy)
    assert r.logp[5] == 0  # the ignored row


def test_gradient_from_logits_in_place_is_the_recomputed_bits():
    h, w, b, t, adv, _ = problem(n=40, v=300)
    temp = torch.rand(40) + 0.5
    logp, lse, entropy = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True)
    g = torch.Generator().manual_seed(3)
    g_logp, g_lse, g_h = (torch.rand(40, generator=g) - 0.5 for _ in range(3))
    want = dt.grad_logits(h, w, t, lse, g_logp, g_lse, bias=b, temperature=temp, entropy=entropy, g_entropy=g_h)
    z = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_logits=True)[2].contiguous()
    own = torch.empty(40, 300, dtype=torch.bfloat16)
    ext.linear_logp_grad_from_logits((z, t, 1.0, temp, 300, 0, -100), lse, g_logp, g_lse, own, 0, entropy, g_h)
    assert torch.equal(own.view(torch.int16), want.view(torch.int16))
    dz = z.view(torch.bfloat16)[:, :300]  # over the logits, row n in the first half of its bytes
    ext.linear_logp_grad_from_logits((z, t, 1.0, temp, 300, 0, -100), lse, g_logp, g_lse, dz, 0, entropy, g_h)
    assert torch.equal(dz.contiguous().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradients_against_float64(with_entropy):
    h, w, b, t, adv, old = problem()
    temp = 0.8
    hp, wp, bp = (x.clone().requires_grad_() for x in (h, w, b))
    if with_entropy:
        r = dt.linear_logp_loss(hp, wp, t, ppo_entropy_loss(adv, old), bias=bp, temperature=temp,
                                return_entropy=True, chunk_rows=64)  # fmt: skip
        ref = float64_grads(h, w, b, t, temp, lambda lp, ls, e: ppo_entropy_loss(adv.double(), old.double())(
            lp, ls, e, slice(None)))  # fmt: skip
    else:
        r = dt.linear_logp_loss(hp, wp, t, pg_loss(adv), bias=bp, temperature=temp, chunk_rows=64)
        ref = float64_grads(h, w, b, t, temp, lambda lp, ls, e: pg_loss(adv.double())(lp, ls, slice(None)))
    r.loss.backward()
    assert hp.grad.dtype == torch.bfloat16 and wp.grad.dtype == torch.bfloat16 and bp.grad.dtype == torch.float32
    # bf16 dz (2^-9), bf16 gradients, and grad_weight rounded once a chunk (3 chunks here).
    expect_close(hp.grad, ref[0], 2e-2, "grad_hidden")
    expect_close(wp.grad, ref[1], 2e-2, "grad_weight")
    expect_close(bp.grad, ref[2], 2e-2, "grad_bias")


def test_close_to_linear_logp_backward_and_deterministic():
    h, w, b, t, adv, _ = problem()
    grads = []
    for _ in range(2):
        hp, wp = h.clone().requires_grad_(), w.clone().requires_grad_()
        dt.linear_logp_loss(hp, wp, t, pg_loss(adv), chunk_rows=50).loss.backward()
        grads.append((hp.grad, wp.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    hp, wp = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, _ = dt.linear_logp(hp, wp, t)
    (-(logp * adv).sum()).backward()
    expect_close(grads[0][0], hp.grad.double(), 2e-2, "grad_hidden vs linear_logp")
    expect_close(grads[0][1], wp.grad.double(), 2e-2, "grad_weight vs linear_logp")


def test_upstream_gradient_scales_and_no_grad_skips_the_gradients():
    h, w, b, t, adv, _ = problem(n=70)
    hp = h.clone().requires_grad_()
    r = dt.linear_logp_loss(hp, w, t, pg_loss(adv))
    r.loss.backward()
    once = hp.grad.clone()
    hp.grad = None
    (3 * dt.linear_logp_loss(hp, w, t, pg_loss(adv)).loss).backward()
    assert torch.equal(hp.grad, (once.float() * 3).bfloat16())
    # A factor that is not a small integer (a loss averaged over accumulation steps): one rounding of
    # the fp32 product; the weight gradient (another dtype's path in some torch builds) too.
    wp = w.clone().requires_grad_()
    dt.linear_logp_loss(hp, wp, t, pg_loss(adv)).loss.backward()
    once_w = wp.grad.clone()
    hp.grad, wp.grad = None, None
    (dt.linear_logp_loss(hp, wp, t, pg_loss(adv)).loss / 3).backward()
    third = torch.tensor(1.0, dtype=torch.float32) / 3
    assert torch.equal(hp.grad, (once.float() * third).bfloat16())
    assert torch.equal(wp.grad, (once_w.float() * third).bfloat16())
    with torch.no_grad():
        r2 = dt.linear_logp_loss(hp, w, t, pg_loss(adv))
    assert r2.loss.grad_fn is None and torch.equal(r2.loss, r.loss.detach())
    assert r2.entropy is None


def test_loss_is_the_chunk_sum_and_rows_index_the_batch():
    h, w, b, t, adv, _ = problem(n=130)
    seen = []

    def fn(logp, lse, rows):
        seen.append((rows.start, rows.stop, logp.shape[0]))
        return -(logp * adv[rows]).sum()

    r = dt.linear_logp_loss(h.clone().requires_grad_(), w, t, fn, chunk_rows=64)
    assert seen == [(0, 64, 64), (64, 128, 64), (128, 130, 2)]
    logp, _ = dt.linear_logp(h, w, t)
    want = -(logp[:64] * adv[:64]).sum() - (logp[64:128] * adv[64:128]).sum() - (logp[128:] * adv[128:]).sum()
    assert torch.equal(r.loss, want)


def test_the_chunk_budget_from_the_environment_sets_the_chunks(monkeypatch):
    h, w, b, t, adv, _ = problem(n=130, v=333)
    seen = []

    def fn(logp, lse, rows):
        seen.append((rows.start, rows.stop))
        return -(logp * adv[rows]).sum()

    # 64 rows of fp32 logits a chunk (a multiple of 64): 130 rows in chunks of 64, 64 and 2.
    monkeypatch.setenv("DETLOGP_TORCH_LOSS_CHUNK_BYTES", str(64 * 4 * 333))
    dt.linear_logp_loss(h.clone().requires_grad_(), w, t, fn)
    assert seen == [(0, 64), (64, 128), (128, 130)]
    monkeypatch.setenv("DETLOGP_TORCH_LOSS_CHUNK_BYTES", "0")
    with pytest.raises(detlogp.ConfigError, match="DETLOGP_TORCH_LOSS_CHUNK_BYTES=0 must be an integer"):
        dt.linear_logp_loss(h.clone().requires_grad_(), w, t, fn)


def test_default_chunks_keep_the_qwen3_8b_head_under_its_memory_goal(monkeypatch):
    # The Qwen3-8B head (V = 151936, D = 4096) at N = 4096: 704-row chunks, whose fp32 logits with
    # the returned gradients (bf16 grad_weight and grad_hidden) stay under 1.6 GiB.
    from detlogp._torch.loss import loss_chunk_rows

    monkeypatch.delenv("DETLOGP_TORCH_LOSS_CHUNK_BYTES", raising=False)
    n, d, v = 4096, 4096, 151936
    rows = loss_chunk_rows(n, v)
    assert rows == 704
    assert rows * v * 4 + (v * d + n * d) * 2 < 1.6 * (1 << 30)
    assert loss_chunk_rows(100, v) == 100  # one chunk when the rows fit


def test_errors_name_the_argument():
    h, w, b, t, adv, _ = problem(n=20, v=50)
    hp = h.clone().requires_grad_()
    bad = t.clone()
    bad[7] = 50
    with pytest.raises(TargetIndexError, match=r"targets\[7\]=50"):
        dt.linear_logp_loss(hp, w, bad, pg_loss(adv))
    assert hp.grad is None
    with pytest.raises(InputError, match="0-d tensor"):
        dt.linear_logp_loss(hp, w, t, lambda logp, lse, rows: logp * 2)
    with pytest.raises(InputError, match=r"hidden must be a \[\.\.\., D\] bf16 tensor"):
        dt.linear_logp_loss(h.float(), w, t, pg_loss(adv))
    with pytest.raises(InputError, match=r"targets must have hidden's batch shape \[20\], got \[19\]"):
        dt.linear_logp_loss(hp, w, t[:19], pg_loss(adv))
    with pytest.raises(InputError, match="chunk_rows=0"):
        dt.linear_logp_loss(hp, w, t, pg_loss(adv), chunk_rows=0)
    with pytest.raises(InputError, match="does not differentiate the temperature"):
        dt.linear_logp_loss(hp, w, t, pg_loss(adv), temperature=torch.ones(20, requires_grad=True))
    with pytest.raises(InputError, match="loss_fn must be callable"):
        dt.linear_logp_loss(hp, w, t, None)
    with pytest.raises(InputError, match=r"temperature_rows\[3\]"):
        temp = torch.ones(20)
        temp[3] = float("nan")
        dt.linear_logp_loss(hp, w, t, pg_loss(adv), temperature=temp)
    z = torch.zeros(4, 10)
    with pytest.raises(InputError, match="dz overlaps logits but is not their in-place layout"):
        ext.linear_logp_grad_from_logits((z, t[:4], 1.0, None, 10, 0, -100), torch.zeros(4), None, None,
                                         z.view(torch.bfloat16)[:, 1:11], 0)  # fmt: skip


def test_empty_batch():
    h, w, b, t, adv, _ = problem(n=0, v=40)
    hp, wp = h.clone().requires_grad_(), w.clone().requires_grad_()
    r = dt.linear_logp_loss(hp, wp, t, pg_loss(adv))
    r.loss.backward()
    assert r.loss.item() == 0 and hp.grad.shape == (0, 96) and torch.count_nonzero(wp.grad) == 0


def test_under_torch_compile_it_runs_eagerly_with_the_same_bits():
    h, w, b, t, adv, _ = problem(n=60, v=200)

    def step(h, w):
        r = dt.linear_logp_loss(h * 1.0, w, t, lambda logp, lse, rows: -(logp * adv[rows]).sum(), chunk_rows=16)
        return r.loss * 2

    grads = []
    for fn in (step, torch.compile(step)):
        hp, wp = h.clone().requires_grad_(), w.clone().requires_grad_()
        fn(hp, wp).backward()
        grads.append((hp.grad, wp.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_a_batch_shape_is_its_flattened_rows():
    h, w, b, t, adv, _ = problem(n=60, v=200)
    temp = torch.rand(60) + 0.5
    flat, batched = [], []
    for shape, out in (((60,), flat), ((3, 20), batched)):
        hp, wp = h.clone().reshape(*shape, -1).requires_grad_(), w.clone().requires_grad_()
        r = dt.linear_logp_loss(hp, wp, t.reshape(shape), lambda lp, ls, e, rows: -(lp * adv[rows] + e).sum(),
                                temperature=temp.reshape(shape), return_entropy=True, chunk_rows=16)  # fmt: skip
        r.loss.backward()
        assert r.logp.shape == shape and r.lse.shape == shape and r.entropy.shape == shape
        out.extend([r.logp.reshape(-1), r.lse.reshape(-1), r.entropy.reshape(-1), hp.grad.reshape(60, -1), wp.grad])
    for a, c in zip(flat, batched):
        assert torch.equal(a, c)

"""detlogp.torch on the CPU: autograd against float64, determinism, errors, strict mode, TP=2 over
gloo. Skipped (with the reason) where torch is not installed."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import INTEGER_CASES, TEMPERATURE_CASES, free_port, make_problem

torch = pytest.importorskip("torch", reason="torch is not installed (the torch tests need it)")
import detlogp  # noqa: E402
import detlogp.torch as dt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def problem(n, d, v, seed=0, dtype=torch.bfloat16, ignore=(1,), real_vocab=None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * 0.3).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(torch.float64 if dtype == torch.float64 else torch.float32)
    t = torch.randint(0, real_vocab or v, (n,), generator=g)
    for i in ignore:
        t[i] = -100
    temp = (torch.rand(n, generator=g) + 0.5).to(b.dtype)
    return h, w, b, t, temp


def reference_grads(h, w, b, t, temp, real_vocab=None, g_lse=0.25, ignore_index=-100):
    """float64 autograd of log_softmax over the same (bf16-valued) inputs."""
    h64, w64, b64, T64 = (x.detach().double().requires_grad_() for x in (h, w, b, temp))
    y = (h64 @ w64.T + b64) / T64[:, None]
    if real_vocab is not None:
        y = y.masked_fill(torch.arange(w.shape[0]) >= real_vocab, float("-inf"))
    lse = torch.logsumexp(y, 1)
    ignored = t == ignore_index
    logp = torch.where(ignored, 0.0, y.gather(1, t.clamp(min=0)[:, None])[:, 0] - lse)
    (logp.sum() + g_lse * lse.sum()).backward()
    return logp.detach(), lse.detach(), [x.grad for x in (h64, w64, b64, T64)]


def rel_err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("v,real_vocab", [(17, None), (123, 100)])
def test_gradcheck_float64(monkeypatch, v, real_vocab):
    """torch.autograd.gradcheck of the chunked backward (hidden, weight, bias, per-row temperature,
    ignore_index, padding rows), through the plain lane in float64; chunks of 8 vocabulary rows
    exercise the chunk loop."""
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 8)
    h, w, b, t, temp = problem(5, 6, v, dtype=torch.float64, ignore=(1, 3), real_vocab=real_vocab)
    args = [x.clone().requires_grad_() for x in (h, w, b, temp)]

    def f(h, w, b, temp):
        return dt.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=real_vocab, backend=dt.TORCH_BACKEND_ID)

    assert torch.autograd.gradcheck(f, args)

    def f_logits(h, w, b):
        return dt.linear_logp(h, w, t, bias=b, temperature=0.7, return_logits=True, real_vocab=real_vocab,
                              backend=dt.TORCH_BACKEND_ID)  # fmt: skip

    assert torch.autograd.gradcheck(f_logits, args[:3])


@pytest.mark.parametrize("v", [17, 123, 2053])
def test_contract_grads_match_float64(monkeypatch, v):
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 64)
    h, w, b, t, temp = problem(13, 48, v, seed=v, ignore=(2, 7))
    args = [x.clone().requires_grad_() for x in (h, w, b, temp)]
    logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=args[3])
    # "auto" serves CPU tensors with the SM90 backend where one is present (staging), else the CPU.
    assert dt.last_report()["backend_id"] in ("cpu-linear-logp-contract-v1", "cuda-fused-linear-logp-sm90-contract-v1")
    (logp.sum() + 0.25 * lse.sum()).backward()
    ref_logp, ref_lse, ref_grads = reference_grads(h, w, b, t, temp)
    assert (logp.double() - ref_logp).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5
    for name, a, r in zip(("hidden", "weight", "bias", "temperature"), args, ref_grads):
        # hidden/weight gradients come back in bf16 (their dtype): 2^-8 relative rounding.
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-5
        assert rel_err(a.grad, r) < tol, name


def test_backward_deterministic_and_chunk_bounded(monkeypatch):
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 128)
    h, w, b, t, temp = problem(64, 96, 1000, seed=9)
    grads = []
    for _ in range(2):
        args = [x.clone().requires_grad_() for x in (h, w, b, temp)]
        logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=args[3])
        (logp * torch.linspace(0.5, 1.5, 64)).sum().backward()
        grads.append([a.grad.clone() for a in args])
    for g1, g2 in zip(*grads):
        assert torch.equal(g1.view(torch.int16 if g1.dtype == torch.bfloat16 else torch.int32),
                           g2.view(torch.int16 if g2.dtype == torch.bfloat16 else torch.int32))  # fmt: skip


def test_ignore_index_contributes_no_gradient():
    h, w, b, t, _ = problem(9, 32, 123, seed=2, ignore=(0, 4, 8))
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    logp, _ = dt.linear_logp(hh, ww, t, ignore_index=-100)
    logp.sum().backward()
    assert torch.all(logp[[0, 4, 8]] == 0)
    assert torch.count_nonzero(hh.grad[[0, 4, 8]]) == 0
    keep = torch.tensor([i for i in range(9) if i not in (0, 4, 8)])
    w2 = w.clone().requires_grad_()
    dt.linear_logp(h[keep], w2, t[keep])[0].sum().backward()
    assert rel_err(ww.grad.float(), w2.grad.double()) < 1e-2
    assert torch.count_nonzero(hh.grad[keep]) > 0


def test_torch_cpu_bits_equal_numpy_path():
    h, w, t, b, temp = make_problem(17, 64, 2053, seed=11, bias=True, temp_rows=True, ignore_every=4)
    r = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, return_logits=True)
    th = torch.from_numpy(h.view(np.int16)).view(torch.bfloat16)
    tw = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    logp, lse, logits = dt.linear_logp(th, tw, torch.from_numpy(t), bias=torch.from_numpy(b),
                                       temperature=torch.from_numpy(temp), return_logits=True)  # fmt: skip
    assert np.array_equal(logp.numpy().view(np.uint32), r.logp.view(np.uint32))
    assert np.array_equal(lse.numpy().view(np.uint32), r.lse.view(np.uint32))
    assert np.array_equal(logits.numpy().view(np.uint32), r.logits.view(np.uint32))


def test_batch_dims_and_int32_targets():
    h, w, b, t, _ = problem(12, 32, 123, seed=3)
    flat = dt.linear_logp(h, w, t)
    shaped = dt.linear_logp(h.view(3, 4, 32), w, t.view(3, 4).int())
    assert shaped[0].shape == (3, 4)
    assert torch.equal(shaped[0].reshape(-1).view(torch.int32), flat[0].view(torch.int32))


def test_torch_lane_readback_and_strict(monkeypatch):
    h, w, b, t, _ = problem(6, 16, 123)
    logp, lse = dt.linear_logp(h, w, t, backend=dt.TORCH_BACKEND_ID)
    rep = dt.last_report()
    assert rep["backend_id"] == dt.TORCH_BACKEND_ID and not rep["contract"]
    contract_logp, _ = dt.linear_logp(h, w, t)
    assert dt.last_report()["contract"]
    assert (logp - contract_logp).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="strict mode refuses backend 'torch-materialized-noncontract'") as e:
        dt.linear_logp(h, w, t, backend=dt.TORCH_BACKEND_ID, strict=True)
    assert isinstance(e.value, detlogp.StrictModeError)
    monkeypatch.setenv("DETLOGP_STRICT", "1")
    with pytest.raises(detlogp.StrictModeError):
        dt.linear_logp(h, w, t, backend=dt.TORCH_BACKEND_ID)
    with pytest.raises(detlogp.StrictModeError):
        dt.linear_logp(h, w, t, backend="reference-materialized")
    monkeypatch.setenv("DETLOGP_STRICT", "0")
    monkeypatch.setenv("DETLOGP_BACKEND", dt.TORCH_BACKEND_ID)
    dt.linear_logp(h, w, t)
    assert dt.last_report()["backend_id"] == dt.TORCH_BACKEND_ID


def test_torch_errors():
    h, w, b, t, _ = problem(6, 16, 123)
    bad = t.clone()
    bad[2] = 123
    with pytest.raises(IndexError, match=r"targets\[2\]=123 is >= real_vocab=123"):
        dt.linear_logp(h, w, bad)
    with pytest.raises(ValueError, match="weight has D=8 columns but hidden has D=16"):
        dt.linear_logp(h, w[:, :8], t)
    with pytest.raises(ValueError, match="a vocabulary shard needs tp_group"):
        dt.linear_logp(h, w, t, vocab_start=64, real_vocab=500)
    with pytest.raises(ValueError, match=r"temperature_rows\[0\]=-1 is outside the temperature range"):
        dt.linear_logp(h, w, t, temperature=-torch.ones(6))


def test_deferred_errors_setting():
    """CPU tensors raise in the call itself whatever the setting (host memory is checked on the
    host); check_errors() with nothing outstanding is a no-op; the setting takes a bool only."""
    h, w, b, t, _ = problem(6, 16, 123)
    bad = t.clone()
    bad[2] = 123
    dt.check_errors()
    assert dt.set_deferred_errors(True) is True
    with pytest.raises(detlogp.TargetIndexError, match=r"targets\[2\]=123 is >= real_vocab=123"):
        dt.linear_logp(h, w, bad)
    dt.check_errors()
    with pytest.raises(detlogp.InputError, match="enabled must be a bool, got int"):
        dt.set_deferred_errors(1)
    assert dt.set_deferred_errors(True) is True


def test_contract_refusals_are_the_librarys_words():
    """The contract lanes let the C++ validation refuse shapes, dtypes and the bias, with its message
    (the one the numpy face and the CLI give), instead of words of their own."""
    h, w, b, t, _ = problem(6, 16, 123)
    cases = [
        (lambda: dt.linear_logp(h.float(), w, t), "hidden must be bf16, got f32"),
        (lambda: dt.linear_logp(h, w.float(), t), "weight must be bf16, got f32"),
        (lambda: dt.linear_logp(h.double(), w, t), "hidden has dtype float64, which detlogp does not take here"),
        (lambda: dt.linear_logp(h, w, t.float()), "targets must be i32 or i64, got f32"),
        (lambda: dt.linear_logp(h, w, t.short()), "targets has dtype int16, which detlogp does not take here"),
        (lambda: dt.linear_logp(h, w, t, bias=b.double()), "bias has dtype float64, which detlogp does not take here"),
        (lambda: dt.linear_logp(h, w, t, bias=b.int()), "bias must be f32, got i32"),
        (lambda: dt.linear_logp(h, w, t, bias=b[:5]), "bias has 5 elements, expected 123"),
        (lambda: dt.linear_logp(h, w, t, bias=b.view(3, 41)), "bias must be 1-D, got ndim=2"),
        (lambda: dt.linear_logp(h, w[0], t), "weight must be 2-D, got ndim=1"),
        (lambda: dt.linear_logp(h, w[0, 0], t), "weight must be 2-D, got ndim=0"),
        (lambda: dt.linear_logp(h.view(2, 3, 16), w, t), "hidden must be 2-D, got ndim=3"),
        (lambda: dt.linear_logp(h[:4], w, t), "targets has 6 elements, expected 4"),
        (lambda: dt.grad_logits(h, w[0, 0], t, torch.zeros(6)), "weight must be 2-D, got ndim=0"),
        (lambda: dt.grad_logits(h[0], w, t, torch.zeros(6)), "hidden must be 2-D, got ndim=1"),
        (lambda: dt.grad_logits(h.float(), w, t, torch.zeros(6)), "hidden must be bf16, got f32"),
    ]  # fmt: skip
    for i, (call, message) in enumerate(cases):
        with pytest.raises(detlogp.InputError) as e:
            call()
        assert str(e.value).endswith(message), (i, str(e.value))
    # The same inputs through the numpy face: the same words.
    hb = detlogp.to_bf16_bits(h.float().numpy())
    wb = detlogp.to_bf16_bits(w.float().numpy())
    with pytest.raises(detlogp.InputError, match="bias has 5 elements, expected 123"):
        detlogp.linear_logp(hb, wb, t.numpy(), bias=b[:5].numpy())
    with pytest.raises(detlogp.InputError, match="targets must be i32 or i64, got f32"):
        detlogp.linear_logp(hb, wb, t.float().numpy())


@pytest.mark.parametrize("lane", [None, dt.TORCH_BACKEND_ID])
def test_zero_d_temperature_is_named_temperature(lane):
    """A 0-d temperature tensor is one temperature: a bad one is refused as `temperature` (not as row
    0 of the rows it is expanded to), also at N = 0 (CPU tensors: their value is on the host)."""
    h, w, b, t, _ = problem(6, 16, 123)
    if lane:
        h, w = h.float(), w.float()
    for n in (6, 0):
        with pytest.raises(detlogp.InputError) as e:
            dt.linear_logp(h[:n], w, t[:n], temperature=torch.tensor(-2.0), backend=lane)
        assert str(e.value).endswith("temperature=-2 is outside the temperature range [1.1754944e-38, 8.507059e+37] "
                                     "(2^-126 to 2^126, where T and 1/T are finite normal fp32 numbers; "
                                     "docs/contract.md 3.3)"), (n, str(e.value))  # fmt: skip
    # A good one still carries a gradient (the sum of its rows').
    temp = torch.tensor(0.7, requires_grad=True)
    logp, _ = dt.linear_logp(h, w, t, temperature=temp, backend=lane)
    logp.sum().backward()
    rows = torch.full((6,), 0.7, requires_grad=True)
    logp_rows, _ = dt.linear_logp(h, w, t, temperature=rows, backend=lane)
    logp_rows.sum().backward()
    assert temp.grad.shape == () and torch.equal(logp, logp_rows)
    assert torch.allclose(temp.grad, rows.grad.sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "make,exc,message",
    [
        (lambda t: t.index_fill(0, torch.tensor([2]), 123), detlogp.TargetIndexError, "targets[2]=123 is >= real_vocab=123"),
        (lambda t: t.index_fill(0, torch.tensor([3]), 500), detlogp.TargetIndexError, "targets[3]=500 is >= real_vocab=123"),
        (lambda t: t.index_fill(0, torch.tensor([1]), -5), detlogp.TargetIndexError, "targets[1]=-5 is negative and not ignore_index=-100"),
        (lambda t: t.float(), detlogp.InputError, "targets must be i32 or i64, got f32"),
    ],
)  # fmt: skip
def test_torch_lane_checks_targets_like_the_library(make, exc, message):
    """The plain-torch lane refuses a bad target with the library's check and message (before: torch's
    own index error, or -inf for a padding id), exactly as the contract lane does."""
    h, w, b, t, _ = problem(6, 16, 123)
    for backend in (None, dt.TORCH_BACKEND_ID):
        hh, ww = (h.float(), w.float()) if backend else (h, w)
        with pytest.raises(exc) as e:
            dt.linear_logp(hh, ww, make(t), backend=backend)
        assert str(e.value).endswith(message), (backend, str(e.value))
    # A padding id (in [real_vocab, V_local)) was -inf without an error; now it is refused.
    with pytest.raises(detlogp.TargetIndexError) as e:
        dt.linear_logp(h.float(), w.float(), t.index_fill(0, torch.tensor([0]), 120), real_vocab=100,
                       backend=dt.TORCH_BACKEND_ID)  # fmt: skip
    assert str(e.value).endswith("targets[0]=120 is >= real_vocab=100")
    ignored = t.index_fill(0, torch.tensor([0]), -100)
    logp, _ = dt.linear_logp(h.float(), w.float(), ignored, backend=dt.TORCH_BACKEND_ID)
    assert logp[0].item() == 0.0


def test_torch_lane_checks_temperature_tensors_like_the_library():
    """Per-row and 0-d temperature tensors on the plain-torch lane get the library's range check (before:
    NaN or inf rows), in its words; any floating dtype is checked as its float32 value."""
    h, w, b, t, _ = problem(6, 16, 123)
    h, w = h.float(), w.float()
    rows = torch.ones(6, dtype=torch.float64)
    rows[4] = 0.0
    with pytest.raises(detlogp.InputError) as e:
        dt.linear_logp(h, w, t, temperature=rows, backend=dt.TORCH_BACKEND_ID)
    assert "temperature_rows[4]=0 is outside the temperature range" in str(e.value)
    rows[4] = float("inf")
    with pytest.raises(detlogp.InputError, match=r"temperature_rows\[4\]=inf is outside"):
        dt.linear_logp(h, w, t, temperature=rows, backend=dt.TORCH_BACKEND_ID)
    with pytest.raises(detlogp.InputError, match="temperature=nan is outside"):
        dt.linear_logp(h, w, t, temperature=torch.tensor(float("nan")), backend=dt.TORCH_BACKEND_ID)


def test_torch_lane_refusals_in_the_librarys_words():
    """The plain-torch lane's own shape checks speak the library's words."""
    h, w, b, t, _ = problem(6, 16, 123)
    h, w = h.float(), w.float()
    cases = [
        (lambda: dt.linear_logp(h, w[0], t, backend=dt.TORCH_BACKEND_ID), "weight must be 2-D, got ndim=1"),
        (lambda: dt.linear_logp(h, w, t, bias=b[:5], backend=dt.TORCH_BACKEND_ID), "bias has 5 elements, expected 123"),
        (lambda: dt.linear_logp(h, w, t, bias=b.view(3, 41), backend=dt.TORCH_BACKEND_ID), "bias must be 1-D, got ndim=2"),
        (lambda: dt.linear_logp(h[:4], w, t, backend=dt.TORCH_BACKEND_ID), "targets has 6 elements, expected 4"),
    ]  # fmt: skip
    for i, (call, message) in enumerate(cases):
        with pytest.raises(detlogp.InputError) as e:
            call()
        assert str(e.value).endswith(message), (i, str(e.value))


def test_strided_vectors_are_reported_as_copies():
    """A vector whose stride is not 1 is copied (contiguous) before the library reads it, and the report
    says so, as for the matrices."""
    h, w, b, t, _ = problem(6, 16, 123)
    t2 = torch.stack([t, t], 1)[:, 0]
    b2 = torch.stack([b, b], 1)[:, 0]
    r2 = torch.full((6, 2), 0.9)[:, 0]
    logp = dt.linear_logp(h, w, t2, bias=b2, temperature=r2)[0]
    assert dt.last_report()["copies"] == [
        {"argument": name, "reason": "its stride is 2, not 1 (the library reads vectors contiguously)"}
        for name in ("targets", "bias", "temperature_rows")
    ]
    assert torch.equal(logp, dt.linear_logp(h, w, t, bias=b, temperature=r2.contiguous())[0])
    assert dt.last_report()["copies"] == []
    dt.linear_logp(h, w, t, temperature=torch.tensor(0.9))  # the rows a 0-d tensor is expanded to: ours
    assert dt.last_report()["copies"] == []


@pytest.mark.parametrize(
    "value,message",
    [
        (0.0, "temperature=0 is outside the temperature range"),
        (-1.0, "temperature=-1 is outside the temperature range"),
        (float("nan"), "temperature=nan is outside the temperature range"),
        (1e-39, "temperature=1e-39 is outside the temperature range"),  # subnormal: 1/T overflows fp32
        (2.0**127, "temperature=1.7014118e+38 is outside the temperature range"),
        (1e-50, "temperature=1e-50 is not representable as float32 (it would round to 0)"),
    ],
)
def test_torch_lane_checks_a_scalar_temperature_like_the_library(value, message):
    """The plain-torch lane computes without the library, yet refuses a scalar temperature exactly
    where and as the contract lanes do (the library's own check and message), instead of returning
    NaN or inf rows."""
    h, w, b, t, _ = problem(6, 16, 123)
    for backend in (None, dt.TORCH_BACKEND_ID):
        with pytest.raises(detlogp.InputError) as e:
            dt.linear_logp(h.float() if backend else h, w.float() if backend else w, t, temperature=value,
                           backend=backend)  # fmt: skip
        assert message in str(e.value), (backend, str(e.value))
    lane = dt.linear_logp(h.float(), w.float(), t, temperature=2.0**-126, backend=dt.TORCH_BACKEND_ID)[0]
    assert lane.shape == (6,)  # the smallest valid temperature passes


def test_torch_compile_cpu():
    h, w, b, t, _ = problem(8, 32, 123, seed=4)

    def loss(h, w, b):
        logp, lse = dt.linear_logp(h, w, t, bias=b, temperature=0.8)
        return logp.sum() + 0.1 * lse.sum(), logp

    eager_args = [x.clone().requires_grad_() for x in (h, w, b)]
    comp_args = [x.clone().requires_grad_() for x in (h, w, b)]
    l1, lp1 = loss(*eager_args)
    l1.backward()
    l2, lp2 = torch.compile(loss, fullgraph=True)(*comp_args)
    l2.backward()
    assert torch.equal(lp1.view(torch.int32), lp2.view(torch.int32))  # the op's bits, compiled or not
    for a, c in zip(eager_args, comp_args):
        assert rel_err(c.grad.float(), a.grad.double()) < 1e-2


@pytest.mark.parametrize("world, split", [(2, "tile"), (3, "tile"), (2, "engine"), (3, "engine")])
def test_tensor_parallel_gloo(world, split):
    """TP through torch.distributed (gloo, CPU processes; three ranks: uneven shards) gives the
    TP=1 bits, and every refusal (one rank's bad input, disagreeing backends or contracts) is the
    same exception on every rank. split="engine": V / world rows per rank (517 / 2 = 259 + 258,
    517 / 3 = 173 + 172 + 172), boundaries off the 64-lane tile grid."""
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), str(HERE / "tp_worker.py"), "--device", "cpu",
           "--rows", "33", "--dim", "64", "--vocab", "517", "--split", split]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETLOGP_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("TP_OK") == world, out[-4000:]
    assert "FAIL" not in out, out[-4000:]


def test_tensor_parallel_agreement_decision():
    """The decision every rank takes from the gathered agreement records, in one process."""
    from detlogp._torch.tensor_parallel import check_agreement

    cpu = ["ok", "cpu-linear-logp-contract-v1", "detlogp-linear-logp-contract", "1", "cpu"]
    check_agreement([cpu, cpu, cpu])  # agreeing ranks go on
    for i, other in ((1, "cuda-fused-linear-logp-sm90-contract-v1"), (2, "other"), (3, "2"), (4, "sm90a")):
        rec = list(cpu)
        rec[i] = other
        with pytest.raises(detlogp.BackendError, match=f"rank 0: .*; rank 2: .*={other}") as e:
            check_agreement([cpu, cpu, rec])
        assert "rank 1" not in str(e.value)  # only the ranks that differ from rank 0 are named
    failed = [cpu, ["error", "TargetIndexError", "targets[1]=9 is >= real_vocab=3"], ["error", "InputError", "bad D"]]
    refusal = r"refused on every rank .*\n  rank 1: targets.*\n  rank 2: bad D"
    with pytest.raises(detlogp.TargetIndexError, match=refusal):
        check_agreement(failed)  # the class of the first failing rank, every failing rank's message
    with pytest.raises(detlogp.DetlogpError, match="rank 1: garbled"):
        check_agreement([cpu, ["error", "NotAnError", "garbled"]])


def test_backward_allocates_no_vocab_sized_buffer():
    """CPU memory profile of the backward: its largest allocation is one logits chunk
    [N, BACKWARD_VOCAB_CHUNK] fp32 (or the weight gradient itself), never [N, V]."""
    from torch.profiler import ProfilerActivity, profile

    n, d, v = 256, 64, 20000
    h, w, b, t, _ = problem(n, d, v, seed=12)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, _ = dt.linear_logp(hh, ww, t)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logp.sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.events())
    allowed = max(n * dt.BACKWARD_VOCAB_CHUNK * 4, v * d * 2, n * d * 4)
    assert largest <= allowed < n * v * 4 / 4, (largest, allowed, n * v * 4)


# --- a 0-d temperature tensor -------------------------------------------------------------------


def test_zero_d_temperature_is_differentiable_like_the_per_row_form(monkeypatch):
    """A 0-d temperature tensor is every row's temperature, expanded inside the graph: the same
    bits as a float and as the [N] tensor of that value, and its gradient is the [N] form's
    gradient summed over the rows (bit for bit: expand's backward is that sum)."""
    monkeypatch.setattr(dt, "BACKWARD_VOCAB_CHUNK", 64)
    h, w, b, t, _ = problem(13, 48, 300, seed=21, ignore=(2, 7))
    value = 0.8125
    t0 = torch.tensor(value, requires_grad=True)
    rows = torch.full((13,), value, requires_grad=True)
    (l0, s0), (lr, sr) = (dt.linear_logp(h, w, t, bias=b, temperature=x) for x in (t0, rows))
    lf, sf = dt.linear_logp(h, w, t, bias=b, temperature=value)
    for a in (l0, s0):
        assert a.requires_grad and a.grad_fn is not None
    assert torch.equal(l0.view(torch.int32), lr.view(torch.int32)) and torch.equal(
        s0.view(torch.int32), sr.view(torch.int32)
    )
    assert torch.equal(l0.view(torch.int32), lf.view(torch.int32)) and torch.equal(
        s0.view(torch.int32), sf.view(torch.int32)
    )
    weights = torch.linspace(0.5, 1.5, 13)
    ((l0 * weights).sum() + 0.25 * s0.sum()).backward()
    ((lr * weights).sum() + 0.25 * sr.sum()).backward()
    assert t0.grad.shape == () and torch.equal(t0.grad, rows.grad.sum())
    # against float64 autograd of log_softmax with one temperature
    ref = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    y = (h.double() @ w.double().T + b.double()) / ref
    lse = torch.logsumexp(y, 1)
    logp = torch.where(t == -100, 0.0, y.gather(1, t.clamp(min=0)[:, None])[:, 0] - lse)
    ((logp * weights.double()).sum() + 0.25 * lse.sum()).backward()
    assert abs(t0.grad.item() - ref.grad.item()) <= 1e-4 * abs(ref.grad.item())


def test_zero_d_temperature_gradcheck_float64():
    """gradcheck of the 0-d form (torch lane, float64: the same backward as the contract lanes)."""
    h, w, b, t, _ = problem(5, 6, 17, dtype=torch.float64, ignore=(1,))
    args = [x.clone().requires_grad_() for x in (h, w, b)] + [
        torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    ]

    def f(h, w, b, temp):
        return dt.linear_logp(h, w, t, bias=b, temperature=temp, backend=dt.TORCH_BACKEND_ID)

    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_zero_d_temperature_of_other_float_dtypes(dtype):
    """A 0-d floating tensor of any dtype is converted to float32 in the graph; its gradient comes
    back in its own dtype."""
    h, w, b, t, _ = problem(6, 32, 123, seed=22)
    t0 = torch.tensor(0.75, dtype=dtype, requires_grad=True)
    logp, _ = dt.linear_logp(h, w, t, temperature=t0)
    ref, _ = dt.linear_logp(h, w, t, temperature=0.75)
    assert torch.equal(logp.view(torch.int32), ref.view(torch.int32))
    logp.sum().backward()
    assert t0.grad.dtype == dtype and t0.grad.shape == ()


def test_zero_d_temperature_under_torch_compile():
    """The 0-d form traces (fullgraph: its value is never read on the host) and gives the eager bits
    and gradient."""
    h, w, b, t, _ = problem(8, 32, 123, seed=23)

    def loss(h, temp):
        logp, lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
        return logp.sum() + 0.1 * lse.sum(), logp

    eager = [h.clone().requires_grad_(), torch.tensor(0.9, requires_grad=True)]
    comp = [h.clone().requires_grad_(), torch.tensor(0.9, requires_grad=True)]
    l1, lp1 = loss(*eager)
    l1.backward()
    l2, lp2 = torch.compile(loss, fullgraph=True)(*comp)
    l2.backward()
    assert torch.equal(lp1.view(torch.int32), lp2.view(torch.int32))
    assert comp[1].grad is not None and abs(comp[1].grad.item() - eager[1].grad.item()) <= 1e-5 * abs(
        eager[1].grad.item()
    )
    assert rel_err(comp[0].grad.float(), eager[0].grad.double()) < 1e-2


# --- the argument rules shared with the array API (conftest.py's tables) ------------------------


def torch_tensor(values, dtype):
    return torch.tensor(values, dtype=getattr(torch, dtype))


def _torch_entries(h, w, t):
    """The detlogp.torch entries that take a temperature, as f(**kw) -> their first output."""
    _, lse = dt.linear_logp(h, w, t)
    return {
        "linear_logp": lambda **kw: dt.linear_logp(h, w, t, **kw)[0],
        "grad_logits": lambda **kw: dt.grad_logits(h, w, t, lse, torch.ones(5), None, **kw),
    }


def _same_bits(a, b):
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize("entry", ["linear_logp", "grad_logits"])
@pytest.mark.parametrize("case", TEMPERATURE_CASES, ids=[c[0] for c in TEMPERATURE_CASES])
def test_temperature_forms_torch(entry, case):
    """The array API's table, through detlogp.torch: the same forms accepted (the bits of the
    float32 value given as a float) and refused with the same messages."""
    _, build, value, message = case
    h, w, b, t, _ = problem(5, 32, 123, seed=24)
    call = _torch_entries(h, w, t)[entry]
    if message is None:
        assert _same_bits(call(temperature=build(torch_tensor)), call(temperature=float(np.float32(value))))
    else:
        with pytest.raises(detlogp.InputError) as e:
            call(temperature=build(torch_tensor))
        assert str(e.value) == message


def test_temperature_forms_only_torch_has():
    h, w, b, t, _ = problem(12, 32, 123, seed=25)
    ref = dt.linear_logp(h, w, t, temperature=0.6)[0]
    # a 0-d numpy array is a scalar on every face; a per-row temperature is a torch tensor here
    assert _same_bits(dt.linear_logp(h, w, t, temperature=np.array(0.6))[0], ref)
    with pytest.raises(detlogp.InputError) as e:
        dt.linear_logp(h, w, t, temperature=np.full(12, 0.6, np.float32))
    assert str(e.value) == "temperature of shape [12] must be a torch.Tensor here, got ndarray"
    # per row: shaped like targets, whatever their batch dims
    shaped = dt.linear_logp(h.view(3, 4, 32), w, t.view(3, 4), temperature=torch.full((3, 4), 0.6))[0]
    assert _same_bits(shaped.reshape(-1), ref)
    with pytest.raises(detlogp.InputError) as e:
        dt.linear_logp(h.view(3, 4, 32), w, t.view(3, 4), temperature=torch.full((12,), 0.6))
    assert str(e.value) == (
        "temperature must be a float, a 0-d floating array or a float32 array of shape [3, 4], got shape [12] dtype float32"
    )
    # the non-contract torch lane takes per-row temperatures of any float dtype (it computes in theirs)
    lane = dt.linear_logp(h.double(), w.double(), t, temperature=torch.full((12,), 0.6, dtype=torch.float64),
                          backend=dt.TORCH_BACKEND_ID)[0]  # fmt: skip
    assert lane.dtype == torch.float64


@pytest.mark.parametrize("name", ["ignore_index", "vocab_start", "real_vocab"])
@pytest.mark.parametrize("case", INTEGER_CASES, ids=[c[0] for c in INTEGER_CASES])
def test_integer_arguments_torch(name, case):
    _, value, message = case
    if name == "real_vocab" and value is None:
        return  # real_vocab=None is its default: vocab_start + the weight's rows
    h, w, b, t, _ = problem(5, 32, 123, seed=26)
    if message is None:
        if name == "ignore_index":
            assert _same_bits(dt.linear_logp(h, w, t, ignore_index=value)[0], dt.linear_logp(h, w, t)[0])
            ref = dt.grad_logits(h, w, t, dt.linear_logp(h, w, t)[1], torch.ones(5))
            assert _same_bits(_torch_entries(h, w, t)["grad_logits"](ignore_index=value), ref)
        return
    for entry, call in _torch_entries(h, w, t).items():
        with pytest.raises(detlogp.InputError) as e:
            call(**{name: value})
        assert str(e.value) == message.format(name=name), entry
    with pytest.raises(detlogp.InputError) as e:  # the tensor-parallel path parses them before any collective
        dt.linear_logp(h, w, t, tp_group=object(), **{name: value})
    assert str(e.value) == message.format(name=name)


def test_torch_refusals_are_detlogp_errors():
    """D = 0, meta tensors and arguments of the wrong kind raise detlogp's classes, with messages
    naming the argument (D = 0 in the C++ library's words on every lane)."""
    h, w, b, t, _ = problem(6, 16, 123)
    meta = "is on meta; detlogp.torch takes CPU and CUDA tensors"
    d0 = "hidden has D=0 columns; the hidden size must be >= 1"
    h0, w0 = torch.zeros(6, 0, dtype=torch.bfloat16), torch.zeros(123, 0, dtype=torch.bfloat16)
    cases = [
        (lambda: dt.linear_logp(h0, w0, t), d0),
        (lambda: dt.linear_logp(h0.view(2, 3, 0), w0, t.view(2, 3)), d0),
        (lambda: dt.linear_logp(h0[:0], w0, t[:0]), d0),
        (lambda: dt.linear_logp(h0.float(), w0.float(), t, backend=dt.TORCH_BACKEND_ID), d0),
        (lambda: dt.grad_logits(h0, w0, t, torch.zeros(6)), d0),
        (lambda: dt.linear_logp(h.to("meta"), w.to("meta"), t.to("meta")), "hidden " + meta),
        (lambda: dt.linear_logp(h, w.to("meta"), t), "weight " + meta),
        (lambda: dt.linear_logp(h, w, t.to("meta")), "targets " + meta),
        (lambda: dt.linear_logp(h, w, t, bias=b.to("meta")), "bias " + meta),
        (lambda: dt.linear_logp(h, w, t, temperature=torch.tensor(0.5, device="meta")), "temperature " + meta),
        (lambda: dt.linear_logp(h, w, t, temperature=torch.ones(6, device="meta")), "temperature " + meta),
        (lambda: dt.linear_logp(h.to("meta"), w.to("meta"), t.to("meta"), backend=dt.TORCH_BACKEND_ID), "hidden " + meta),
        (lambda: dt.grad_logits(h, w, t, torch.zeros(6, device="meta")), "lse " + meta),
        (lambda: dt.linear_logp(h, w, t, bias=np.zeros(123, np.float32)), "bias must be a torch tensor or None, got shape [123] dtype float32"),
        (lambda: dt.linear_logp(h, w, t, backend=5), "backend must be a backend id (str) or None, got int 5"),
        (lambda: dt.grad_logits(h, w, t, [0.0] * 6), "lse must be a torch tensor, got list"),
        (lambda: dt.grad_logits(h, w, t, None), "lse is required (the forward's [N] f32 lse)"),
        (lambda: dt.grad_logits(None, w, t, torch.zeros(6)), "hidden must be a torch tensor, got NoneType"),
    ]  # fmt: skip
    for i, (call, message) in enumerate(cases):
        with pytest.raises(detlogp.InputError) as e:
            call()
        assert str(e.value).endswith(message), (i, str(e.value))


# --- operands copied before the library reads them (the decision; the SM90 runs are GPU tests) ---


def test_copy_decision_for_tma():
    from detlogp._torch.tensors import aligned_copy, copy_reason, library_row_stride, tma_misalignment

    tma = "(TMA requirement of the SM90 backend)"
    flat = torch.randn(4 * 64 + 8).bfloat16()
    aligned = flat[: 4 * 64].view(4, 64)
    odd = flat[1 : 1 + 4 * 64].view(4, 64)  # x.view(-1)[1:].view(...): starts 2 bytes in
    wide = torch.randn(5, 100).bfloat16()  # rows of 200 bytes
    assert copy_reason(aligned, tma=True) is None
    assert (
        copy_reason(odd, tma=True) == f"it starts at element 1 of its storage (byte 2), not on a 16-byte boundary {tma}"
    )
    assert copy_reason(odd, tma=False) is None  # not on CUDA, or another backend asked for: no copy
    assert (
        copy_reason(wide[1:], tma=True)
        == f"its row stride of 100 elements (200 bytes) is not a multiple of 16 bytes {tma}"
    )
    assert (
        copy_reason(wide[:1], tma=True)
        == f"its row stride of 100 elements (200 bytes) is not a multiple of 16 bytes {tma}"
    )
    assert copy_reason(odd.float(), tma=True) is None  # not bf16: the backend's dtype check speaks
    assert copy_reason(aligned[:0], tma=True) is None and copy_reason(torch.zeros(4, 0).bfloat16(), tma=True) is None
    strided = torch.randn(4, 128).bfloat16()[:, ::2]
    reason = "its column stride is 2, not 1 (the library reads rows with unit stride)"
    assert copy_reason(strided, tma=False) == reason and copy_reason(strided, tma=True) == reason
    for t in (odd, wide[1:], wide[:1], wide, strided):
        c = aligned_copy(t)
        assert torch.equal(c.view(torch.int16), t.view(torch.int16)) and tma_misalignment(c) is None, t.shape
        assert library_row_stride(c) % 8 == 0 and c.data_ptr() % 16 == 0
    # A copy is a torch op: the gradient reaches the caller's tensor.
    x = wide[1:].float().requires_grad_()
    g = torch.randn(4, 100)
    (aligned_copy(x) * g).sum().backward()
    assert torch.equal(x.grad, g)


def _force_tma_copies(monkeypatch):
    """Takes CPU tensors for tensors the SM90 backend may serve, so that the copy path runs here."""
    from detlogp._torch import tensors

    monkeypatch.setattr(tensors, "tma_possible", lambda hidden, backend: backend in ("", tensors.SM90_BACKEND_ID))


@pytest.mark.parametrize(
    "d,which,copied",
    [(64, ["hidden"], ["hidden"]), (64, ["weight"], ["weight"]), (64, ["hidden", "weight"], ["hidden", "weight"]),
     (100, [], ["hidden", "weight"])],  # D = 100: rows of 200 bytes, copied even where contiguous
)  # fmt: skip
def test_copied_operands_same_bits_and_gradients(monkeypatch, d, which, copied):
    """With the copy path forced onto the CPU: the call reports each copy, gives the bits of the same
    values in aligned storage, and its gradients are the caller's tensors' (equal to those of the
    aligned call)."""
    _force_tma_copies(monkeypatch)
    h, w, b, t, temp = problem(9, d, 300, seed=27)

    def odd(x):  # the same values in a view that starts 2 bytes into its storage, leaf of the graph
        return torch.cat([torch.zeros(1).bfloat16(), x.reshape(-1)])[1:].view(x.shape).requires_grad_()

    args = [odd(x) if name in which else x.clone().requires_grad_() for name, x in (("hidden", h), ("weight", w))]
    logp, lse = dt.linear_logp(args[0], args[1], t, bias=b, temperature=temp)
    report = dt.last_report()
    assert [c["argument"] for c in report["copies"]] == copied
    assert all(c["reason"].endswith("(TMA requirement of the SM90 backend)") for c in report["copies"])
    ref_args = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    ref_logp, ref_lse = dt.linear_logp(ref_args[0], ref_args[1], t, bias=b, temperature=temp)
    assert _same_bits(logp, ref_logp) and _same_bits(lse, ref_lse)
    (logp.sum() + 0.25 * lse.sum()).backward()
    (ref_logp.sum() + 0.25 * ref_lse.sum()).backward()
    for a, r in zip(args, ref_args):
        assert a.grad is not None and a.grad.shape == a.shape
        assert rel_err(a.grad.float(), r.grad.double()) < 1e-6


def test_no_copy_no_note(monkeypatch):
    _force_tma_copies(monkeypatch)
    h, w, b, t, _ = problem(8, 64, 123, seed=28)
    dt.linear_logp(h, w, t)
    assert dt.last_report()["copies"] == []
    dt.linear_logp(h[1:], w, t[1:])  # a view 128 bytes in: aligned
    assert dt.last_report()["copies"] == []
    dt.linear_logp(h, w, t, backend=dt.TORCH_BACKEND_ID)
    assert dt.last_report()["copies"] == []


def test_copied_operands_under_torch_compile(monkeypatch):
    """The decision traces (a fake tensor's storage offset decides) and the report says it at run
    time."""
    _force_tma_copies(monkeypatch)
    h, w, b, t, _ = problem(8, 64, 123, seed=29)
    odd = torch.cat([torch.zeros(1).bfloat16(), h.reshape(-1)])[1:].view(8, 64)

    def f(h):
        return dt.linear_logp(h, w, t, bias=b, temperature=0.8)[0]

    ref = f(h)
    got = torch.compile(f, fullgraph=True)(odd)
    assert _same_bits(got, ref)
    assert [c["argument"] for c in dt.last_report()["copies"]] == ["hidden"]

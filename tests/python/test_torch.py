"""detlogp.torch on the CPU: autograd against float64, determinism, errors, strict mode, TP=2 over
gloo. Skipped (with the reason) where torch is not installed."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import make_problem

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
    with pytest.raises(ValueError, match="hidden must be torch.bfloat16"):
        dt.linear_logp(h.float(), w, t)
    with pytest.raises(ValueError, match="weight has D=8 columns but hidden has D=16"):
        dt.linear_logp(h, w[:, :8], t)
    with pytest.raises(ValueError, match="targets must be int32 or int64"):
        dt.linear_logp(h, w, t.float())
    with pytest.raises(ValueError, match="bias must be torch.float32"):
        dt.linear_logp(h, w, t, bias=b.double())
    with pytest.raises(ValueError, match="a vocabulary shard needs tp_group"):
        dt.linear_logp(h, w, t, vocab_start=64, real_vocab=500)
    with pytest.raises(ValueError, match=r"temperature_rows\[0\]=-1 must be finite"):
        dt.linear_logp(h, w, t, temperature=-torch.ones(6))


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


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_gloo(world):
    """TP through torch.distributed (gloo, CPU processes; three ranks: uneven shards) gives the
    TP=1 bits, and every refusal (one rank's bad input, disagreeing backends or contracts) is the
    same exception on every rank."""
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(29515 + world), str(HERE / "tp_worker.py"), "--device", "cpu", "--rows", "33", "--dim", "64", "--vocab",
           "517"]  # fmt: skip
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

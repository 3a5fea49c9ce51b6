"""The top-k output on CUDA tensors (marker `gpu`): detlogp.torch.linear_logp(..., topk=K) on the
SM90 backend against cpu-sm90-emulated-contract-v1 on the same inputs (that backend reproduces the
SM90 serving logits bit for bit, so the same ids and bits, docs/contract.md §12), with per-row
temperatures, a bias, padding past real_vocab, every entry (trainer, serving, entropy); the
gradient through topk_logp (ids held constant) against the same loss on the emulated backend.
Skipped with the reason without torch, CUDA or the SM90 backend. Run by
scripts/gpu_python_check.sh."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests need it)")
import detlogp  # noqa: E402
import detlogp.torch as dt  # noqa: E402

pytestmark = pytest.mark.gpu

SM90 = "cuda-fused-linear-logp-sm90-contract-v1"
EMULATED = "cpu-sm90-emulated-contract-v1"


@pytest.fixture(autouse=True)
def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    sm90 = next(b for b in detlogp.backends() if b["id"] == SM90)
    if not sm90["available"]:
        pytest.skip(f"SM90 backend unavailable: {sm90['detail']}")


def bits(x):
    return x.detach().cpu().contiguous().view(torch.int32)


def problem(n, d, v, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * 0.08).bfloat16()
    b = torch.randn(v, generator=g) * 0.5
    t = torch.randint(0, v, (n,), generator=g)
    temps = 0.5 + torch.rand(n, generator=g)
    return h, w, b, t, temps


@pytest.mark.parametrize("n,d,v,real,k", [(37, 64, 17, 17, 5), (29, 72, 123, 123, 20), (67, 64, 2112, 2053, 128),
                                          (5, 128, 151936, 151936, 20)])
def test_ids_and_bits_are_the_emulated_backends(n, d, v, real, k):
    h, w, b, t, temps = problem(n, d, v, seed=v)
    t = t % real
    for kwargs in ({}, {"return_logits": True}, {"return_entropy": True}):
        dev = dt.linear_logp(h.cuda(), w.cuda(), t.cuda(), bias=b.cuda(), temperature=temps.cuda(), real_vocab=real,
                             topk=k, backend=SM90, **kwargs)  # fmt: skip
        ref = dt.linear_logp(h, w, t, bias=b, temperature=temps, real_vocab=real, topk=k, backend=EMULATED, **kwargs)
        assert len(dev) == len(ref)
        for i, (a, e) in enumerate(zip(dev, ref)):
            if a.dtype == torch.int64:
                assert torch.equal(a.cpu(), e), f"{kwargs} output {i}: ids differ"
                assert bool((a < real).all()) and bool((a >= 0).all())
            else:
                assert torch.equal(bits(a), bits(e)), f"{kwargs} output {i}: bits differ"


def test_auto_serves_cuda_tensors_on_sm90_and_the_gradient_flows():
    h, w, b, t, temps = problem(48, 64, 2053, seed=5)
    hc, wc = h.cuda().requires_grad_(), w.cuda().requires_grad_()
    logp, lse, ids, tlp = dt.linear_logp(hc, wc, t.cuda(), bias=b.cuda(), temperature=temps.cuda(), topk=8)
    assert dt.last_report()["backend_id"] == SM90
    g = torch.linspace(-1.0, 1.0, 8, device="cuda")
    (logp.sum() + (tlp * g).sum()).backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp_r, _, ids_r, tlp_r = dt.linear_logp(hr, wr, t, bias=b, temperature=temps, topk=8, backend=EMULATED)
    assert torch.equal(ids.cpu(), ids_r) and torch.equal(bits(tlp), bits(tlp_r))
    (logp_r.sum() + (tlp_r * g.cpu()).sum()).backward()
    # The CUDA backward rounds its logit gradient to bf16 before the GEMMs (the CPU one keeps fp32),
    # and the gradients are bf16: close to a few bf16 steps of the largest entry.
    for dev_grad, ref_grad in ((hc.grad, hr.grad), (wc.grad, wr.grad)):
        scale = float(ref_grad.float().abs().max())
        torch.testing.assert_close(dev_grad.float().cpu(), ref_grad.float(), rtol=2e-2, atol=2e-2 * scale)

"""The sampling program on CUDA tensors (marker `gpu`): detlogp.torch.sample and the replay
linear_logp(..., sampling=) on the SM90 backend, against the CPU backends given the same logits
(docs/contract.md §11): cpu-sm90-emulated-contract-v1 reproduces the SM90 serving logits bit for
bit, so its program gives the same tokens and bits; with logits a GEMM computes exactly (one-hot
hidden) the CPU contract backend gives them too, and the replay's logit gradient (visible exactly in
grad_weight = dz^T @ one-hot) equals the CPU implementation's. Gradients against float64 with the
same support, run-to-run determinism, the current stream; both over an NCCL tp_group
(tp_sample_worker.py: one rank per visible GPU, up to 2). Skipped with the reason without torch,
CUDA or the SM90 backend. Run by scripts/gpu_python_check.sh."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests need it)")
import detlogp  # noqa: E402
from conftest import free_port  # noqa: E402
import detlogp.torch as dt  # noqa: E402

pytestmark = pytest.mark.gpu

SM90 = "cuda-fused-linear-logp-sm90-contract-v1"
EMULATED = "cpu-sm90-emulated-contract-v1"
CPU = "cpu-linear-logp-contract-v1"


def _why_not_gpu():
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    sm90 = next(b for b in detlogp.backends() if b["id"] == SM90)
    if not sm90["available"]:
        return f"SM90 backend unavailable: {sm90['detail']}"
    return None


@pytest.fixture(autouse=True)
def _need_gpu():
    why = _why_not_gpu()
    if why:
        pytest.skip(why)


def i32(x):
    return x.view(torch.int32)


def problem(n, d, v, seed=0, scale=0.08):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * scale).bfloat16()
    b = torch.randn(v, generator=g) * 0.5
    return h, w, b


def varied(n, device):
    """Per-row programs: greedy rows, top-k, top-p, min-p and rows with every filter off."""
    r = torch.arange(n)
    return detlogp.SamplingParams(
        temperature=torch.where(r % 7 == 3, 0.0, 0.5 + 0.25 * (r % 5)).float().to(device),
        top_k=torch.where(r % 4 == 0, 0, 1 + (r * 13) % 60).long().to(device),
        top_p=torch.where(r % 3 == 0, 1.0, 0.6 + 0.1 * (r % 4)).float().to(device),
        min_p=torch.where(r % 5 == 0, 0.0, 0.01 * (r % 4)).float().to(device),
    )


def expect_same_draw(a, b, rows=slice(None)):
    """a's outputs equal rows `rows` of b's, bit for bit."""
    assert torch.equal(a.token.cpu(), b.token.cpu()[rows])
    assert torch.equal(a.support_size.cpu(), b.support_size.cpu()[rows])
    for name in ("logp", "logp_raw", "lse"):
        assert torch.equal(i32(getattr(a, name).cpu()), i32(getattr(b, name).cpu()[rows])), name


def test_cuda_sample_is_the_emulated_cpu_program_bit_for_bit():
    n, d, v = 37, 128, 4099
    h, w, b = problem(n, d, v, seed=1)
    key = torch.arange(n) * 5 + 11
    seed = torch.arange(n, dtype=torch.int64) * 977 + 3
    gpu = dt.sample(h.cuda(), w.cuda(), varied(n, "cuda"), seed.cuda(), key.cuda(), bias=b.cuda(), return_logits=True)
    rep = gpu.report
    assert rep["backend_id"] == SM90 and rep["provenance"]["sample_id"] == "sample/v1"
    assert gpu.token.is_cuda and gpu.token.dtype == torch.int64 and gpu.logits.shape == (n, v)
    assert (gpu.token >= 0).all() and (gpu.support_size >= 1).all()
    emu = dt.sample(h, w, varied(n, "cpu"), seed, key, bias=b, return_logits=True, backend=EMULATED, strict=True)
    assert emu.report["backend_id"] == EMULATED
    assert torch.equal(i32(gpu.logits.cpu()), i32(emu.logits))  # the SM90 serving logits, reproduced
    expect_same_draw(gpu, emu)
    # lse is linear_logp's over the same logits (at T; at 1 for the greedy rows).
    temp = varied(n, "cpu").temperature
    t_eff = torch.where(temp == 0, 1.0, temp)
    r_logp, r_lse = detlogp.reduce_logits(gpu.logits.cpu().numpy(), gpu.token.cpu().numpy(), temperature=t_eff.numpy())
    assert np.array_equal(r_lse.view(np.int32), i32(gpu.lse.cpu()).numpy())
    assert np.array_equal(r_logp.view(np.int32), i32(gpu.logp_raw.cpu()).numpy())
    # Greedy rows: the argmax, logp = +0.
    greedy = (temp == 0).nonzero()[:, 0]
    assert torch.equal(gpu.token.cpu()[greedy], gpu.logits.cpu()[greedy].argmax(1))
    assert (i32(gpu.logp.cpu()[greedy]) == 0).all()
    # A row's bits do not depend on the batch, and the call runs on the current stream.
    p = varied(n, "cuda")
    rows = slice(5, 9)
    part = detlogp.SamplingParams(*(getattr(p, f)[rows] for f in ("temperature", "top_k", "top_p", "min_p")))
    sub = dt.sample(h[rows].cuda(), w.cuda(), part, seed[rows].cuda(), key[rows].cuda(), bias=b.cuda())
    expect_same_draw(sub, gpu, rows)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        again = dt.sample(h.cuda(), w.cuda(), varied(n, "cuda"), seed.cuda(), key.cuda(), bias=b.cuda())
    side.synchronize()
    expect_same_draw(again, gpu)


def test_cuda_sample_with_every_filter_off_and_a_misaligned_view():
    n, d, v = 9, 72, 700
    h, w, b = problem(n, d, v, seed=3)
    wide = torch.zeros(v, d + 3, dtype=torch.bfloat16)
    wide[:, 1:] = torch.cat([w, torch.zeros(v, 2, dtype=torch.bfloat16)], 1)
    view = wide.cuda()[:, 1 : d + 1]  # not 16-byte aligned: copied once for the TMA loads
    r = dt.sample(h.cuda(), view, detlogp.SamplingParams(), 7, torch.arange(n).cuda(), bias=b.cuda())
    assert {c["argument"] for c in dt.last_report()["copies"]} == {"weight"}
    assert torch.equal(i32(r.logp), i32(r.logp_raw)) and (r.support_size == v).all()
    plain_logp, plain_lse = dt.linear_logp(h.cuda(), w.cuda(), r.token, bias=b.cuda())
    assert torch.equal(i32(plain_logp), i32(r.logp_raw)) and torch.equal(i32(plain_lse), i32(r.lse))


def test_cuda_sample_bad_parameter_names_the_row():
    h, w, _ = problem(6, 64, 300, seed=4)
    top_p = torch.full((6,), 0.9).cuda()
    top_p[4] = 0.0
    with pytest.raises(detlogp.InputError, match=r"top_p_rows\[4\]=0 is outside \(0, 1\]"):
        dt.sample(h.cuda(), w.cuda(), detlogp.SamplingParams(top_p=top_p), 0, torch.arange(6).cuda())
    with pytest.raises(detlogp.InputError, match=r"min_p_rows\[1\]=1 is outside \[0, 1\)"):
        min_p = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0]).cuda()
        dt.linear_logp(h.cuda(), w.cuda(), torch.zeros(6, dtype=torch.int64).cuda(),
                       sampling=detlogp.SamplingParams(min_p=min_p))  # fmt: skip


def test_cuda_sample_topk_is_linear_logps_topk_and_the_emulated_cpu_bits():
    n = 40
    h, w, b = problem(n, 64, 2053, seed=5)
    g = torch.Generator().manual_seed(3)
    temps = torch.where(torch.arange(n) % 7 == 3, 0.0, 0.5 + torch.rand(n, generator=g))

    def params(dev):
        return detlogp.SamplingParams(temperature=temps.to(dev), top_k=torch.full((n,), 50).to(dev),
                                      top_p=torch.full((n,), 0.9).to(dev))  # fmt: skip

    key = torch.arange(n)
    r = dt.sample(h.cuda(), w.cuda(), params("cuda"), 11, key.cuda(), bias=b.cuda(), topk=20)
    emu = dt.sample(h, w, params("cpu"), 11, key, bias=b, topk=20, backend="cpu-sm90-emulated-contract-v1")
    assert torch.equal(r.token.cpu(), emu.token)
    assert torch.equal(r.topk_ids.cpu(), emu.topk_ids)
    assert torch.equal(r.topk_logp.cpu().view(torch.int32), emu.topk_logp.view(torch.int32))
    t1 = torch.where(temps == 0, 1.0, temps).cuda()
    _, _, ids, lps = dt.linear_logp(h.cuda(), w.cuda(), r.token.clamp(min=0), bias=b.cuda(), temperature=t1, topk=20)
    assert torch.equal(r.topk_ids, ids)
    assert torch.equal(r.topk_logp.view(torch.int32), lps.view(torch.int32))


def test_cuda_replay_gives_the_rollout_bits_and_counts_outside_targets():
    n, d, v = 37, 128, 4099
    h, w, b = problem(n, d, v, seed=5)
    hc, wc, bc = h.cuda(), w.cuda(), b.cuda()
    params = varied(n, "cuda")
    r = dt.sample(hc, wc, params, 1234, torch.arange(n).cuda(), bias=bc)
    logp, lse, raw = dt.linear_logp(hc, wc, r.token, bias=bc, sampling=params, return_raw=True)
    rep = dt.last_report()
    assert rep["backend_id"] == SM90 and rep["sampling"]["outside_support"] == 0
    assert logp.is_cuda
    assert torch.equal(i32(logp), i32(r.logp)) and torch.equal(i32(raw), i32(r.logp_raw))
    assert torch.equal(i32(lse), i32(r.lse))
    # Moved targets: outside a small support they get -inf, counted; the emulated CPU replay agrees.
    t = r.token.clone()
    t[1::4] = (t[1::4] + v // 2) % v
    t[2] = -100
    logp2, _ = dt.linear_logp(hc, wc, t, bias=bc, sampling=params)
    outside = int((logp2 == -torch.inf).sum())
    assert outside > 0 and dt.last_report()["sampling"]["outside_support"] == outside
    assert logp2[2] == 0
    emu, _ = dt.linear_logp(h, w, t.cpu(), bias=b, sampling=varied(n, "cpu"), backend=EMULATED, strict=True)
    assert torch.equal(i32(emu), i32(logp2.cpu()))


def exact_problem(n, v, seed):
    """hidden = one-hot rows (D = n), weight = z^T with bf16-exact z: every GEMM computes z exactly,
    so the CPU contract backend and the SM90 backend see the same logits."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=g) * 3).bfloat16()
    return torch.eye(n, dtype=torch.bfloat16), z.t().contiguous()


def test_cuda_on_exact_logits_is_the_cpu_contract_backend_forward_and_logit_gradient():
    n, v = 32, 1000
    h, w = exact_problem(n, v, seed=6)
    params_cpu, params_gpu = varied(n, "cpu"), varied(n, "cuda")
    key = torch.arange(n) + 100
    gpu = dt.sample(h.cuda(), w.cuda(), params_gpu, 5, key.cuda())
    cpu = dt.sample(h, w, params_cpu, 5, key, backend=CPU, strict=True)
    expect_same_draw(gpu, cpu)
    t = gpu.token.clone()
    t[1::5] = (t[1::5] + v // 2) % v
    t[3] = -100
    g = torch.Generator().manual_seed(7)
    gl, gs, gr = (torch.randn(n, generator=g) for _ in range(3))
    grads = []
    for dev, params in (("cuda", params_gpu), ("cpu", params_cpu)):
        ww = w.to(dev).requires_grad_()
        logp, lse, raw = dt.linear_logp(h.to(dev), ww, t.to(dev), sampling=params, return_raw=True)
        loss = (torch.where(torch.isfinite(logp), logp, 0) * gl.to(dev)).sum()
        (loss + (lse * gs.to(dev)).sum() + (raw * gr.to(dev)).sum()).backward()
        grads.append((logp.cpu(), ww.grad.cpu()))
    assert detlogp.torch.last_backward_path() == "sampled"
    assert torch.equal(i32(grads[0][0]), i32(grads[1][0]))
    # grad_weight[v, j] = dz[j, v] * 1 exactly (one-hot hidden): the logit gradients agree (a -0 may
    # come out +0 after the GEMM's zero terms, so values, not bits).
    assert torch.equal(grads[0][1], grads[1][1])
    assert (grads[0][1] != 0).sum() > n  # not vacuous


def _support_mask(h, w, b, params, n, v):
    """Lane v of row n is in the support iff the replay gives it a finite logp (every row repeated
    once per lane: a row's bits do not depend on the batch)."""
    rows = torch.arange(n, device=h.device).repeat_interleave(v)
    rep = detlogp.SamplingParams(*(getattr(params, f)[rows] for f in ("temperature", "top_k", "top_p", "min_p")))
    q, _ = dt.linear_logp(h[rows], w, torch.arange(v, device=h.device).repeat(n), bias=b, sampling=rep)
    return torch.isfinite(q).reshape(n, v)


def test_cuda_replay_gradient_matches_float64_with_the_support_fixed_and_is_deterministic():
    n, d, v = 24, 256, 700
    h, w, b = problem(n, d, v, seed=8, scale=0.1)
    params_gpu = varied(n, "cuda")
    r = dt.sample(h.cuda(), w.cuda(), params_gpu, 9, torch.arange(n).cuda(), bias=b.cuda())
    t = r.token.clone()
    t[1::4] = (t[1::4] + v // 2) % v
    t[2] = -100
    g = torch.Generator().manual_seed(10)
    gl, gs, gr = (torch.randn(n, generator=g).cuda() for _ in range(3))

    def run():
        xs = [x.cuda().requires_grad_() for x in (h, w, b)]
        logp, lse, raw = dt.linear_logp(xs[0], xs[1], t, bias=xs[2], sampling=params_gpu, return_raw=True)
        loss = (torch.where(torch.isfinite(logp), logp, 0) * gl).sum() + (lse * gs).sum() + (raw * gr).sum()
        loss.backward()
        assert detlogp.torch.last_backward_path() == "sampled-fused"
        return logp, [x.grad for x in xs]

    logp, got = run()
    _, again = run()
    for a, c in zip(got, again):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else i32(a),
                           c.view(torch.int16) if c.dtype == torch.bfloat16 else i32(c))  # fmt: skip
    # float64 with the same support: logp = y_t - logsumexp over the support, raw over every lane.
    mask = _support_mask(h.cuda(), w.cuda(), b.cuda(), params_gpu, n, v)
    h64, w64, b64 = (x.cuda().double().requires_grad_() for x in (h, w, b))
    temp = params_gpu.temperature.double()
    y = (h64 @ w64.T + b64) / torch.where(temp == 0, 1.0, temp)[:, None]
    ignored = t == -100
    tt = t.clamp(min=0)[:, None]
    y_t = y.gather(1, tt)[:, 0]
    lse64 = torch.logsumexp(y, 1)
    lse_s = torch.logsumexp(y.masked_fill(~mask, -torch.inf), 1)
    in_s = mask.gather(1, tt)[:, 0] & ~ignored
    assert torch.equal(in_s | ignored, torch.isfinite(logp))
    assert (logp.double() - (y_t - lse_s))[in_s].abs().max() < 1e-4
    loss = (torch.where(in_s, y_t - lse_s, 0) * gl).sum() + (lse64 * gs).sum()
    loss = loss + (torch.where(ignored, 0, y_t - lse64) * gr).sum()
    loss.backward()
    for name, a, ref in zip(("hidden", "weight", "bias"), got, (h64.grad, w64.grad, b64.grad)):
        err = ((a.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (name, err)


def test_tensor_parallel_nccl():
    """detlogp.torch.sample and linear_logp(sampling=) with an NCCL tp_group (one rank per GPU, up to
    2; with one GPU a group of one rank still runs the CUDA path of the C++ entries): the TP = 1 bits
    on every rank, every refusal alike (tp_sample_worker.py)."""
    import os
    import pathlib
    import subprocess
    import sys

    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    world = min(2, torch.cuda.device_count())
    here = pathlib.Path(__file__).resolve().parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(free_port()),
           str(here / "tp_sample_worker.py"), "--device", "cuda"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETLOGP_")}
    env["NCCL_NVLS_ENABLE"] = "0"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("TP_OK") == world, out[-4000:]
    assert "FAIL" not in out, out[-4000:]

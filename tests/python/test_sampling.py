"""The sampling program's Python faces (docs/contract.md §11): detlogp.sample and
detlogp.linear_logp(sampling=) on numpy arrays, detlogp.torch.sample and
detlogp.torch.linear_logp(sampling=) on CPU tensors with the support held fixed in the backward, and
both over tp_group (gloo, CPU processes: tp_sample_worker.py) (CUDA tensors: test_sampling_gpu.py)."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import free_port, make_problem

import detlogp

CPU = "cpu-linear-logp-contract-v1"


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def exact_logits(z):
    """hidden/weight whose logits are exactly the rows of z (bf16-exact values): D = N, one-hot hidden."""
    z = np.asarray(z, np.float32)
    n, v = z.shape
    h = detlogp.to_bf16_bits(np.eye(n, dtype=np.float32))
    w = detlogp.to_bf16_bits(z.T.copy())
    assert np.array_equal(detlogp.from_bf16_bits(w), z.T)
    return h, w


def varied(n):
    return detlogp.SamplingParams(
        temperature=np.where(np.arange(n) % 5 == 2, 0.0, 0.6 + 0.2 * (np.arange(n) % 4)).astype(np.float32),
        top_k=((np.arange(n) * 7) % 30).astype(np.int64),
        top_p=np.where(np.arange(n) % 3 == 0, 1.0, 0.8).astype(np.float32),
        min_p=np.where(np.arange(n) % 4 == 1, 0.05, 0.0).astype(np.float32),
    )


# ----------------------------------------------------------------------------------------- numpy


def test_sample_replays_bit_for_bit_and_raw_is_linear_logp():
    h, w, _, b, _ = make_problem(24, 32, 300, seed=1, bias=True, weight_scale=0.5)
    params = varied(24)
    r = detlogp.sample(h, w, params, 99, np.arange(24, dtype=np.int64), bias=b, backend=CPU)
    assert r.report["provenance"]["sample_id"] == detlogp.contract()["sample_id"] == "sample/v1"
    assert r.token.dtype == np.int64 and (r.token >= 0).all()
    q = detlogp.linear_logp(h, w, r.token, b, sampling=params, backend=CPU)
    assert np.array_equal(bits(q.logp), bits(r.logp))
    assert np.array_equal(bits(q.logp_raw), bits(r.logp_raw))
    assert np.array_equal(bits(q.lse), bits(r.lse))
    assert np.array_equal(q.support_size, r.support_size)
    assert q.report["sampling"] == {"outside_support": 0, "first_outside_support": -1}
    temp = np.where(params.temperature == 0, 1.0, params.temperature).astype(np.float32)
    plain = detlogp.linear_logp(h, w, r.token, b, temperature=temp, backend=CPU)
    assert np.array_equal(bits(plain.logp), bits(r.logp_raw))
    assert np.array_equal(bits(plain.lse), bits(r.lse))
    assert (r.logp >= r.logp_raw).all()


def test_topk_beside_the_draw_is_linear_logps_topk_at_the_rows_temperature():
    """topk=K with the draw (an engine's logprobs=K): the ids and bits of linear_logp(..., topk=K) at
    each row's T (1 for a greedy row), the sampled token's entry its logp_raw; refused out of range."""
    n = 24
    h, w, _, b, _ = make_problem(n, 32, 300, seed=11, bias=True, weight_scale=0.5)
    params = varied(n)
    r = detlogp.sample(h, w, params, 7, np.arange(n, dtype=np.int64), bias=b, backend=CPU, topk=12)
    assert r.topk_ids.shape == (n, 12) and r.topk_ids.dtype == np.int64 and r.topk_logp.dtype == np.float32
    temp = np.where(params.temperature == 0, 1.0, params.temperature).astype(np.float32)
    plain = detlogp.linear_logp(h, w, r.token, b, temperature=temp, backend=CPU, topk=12)
    assert np.array_equal(r.topk_ids, plain.topk_ids)
    assert np.array_equal(bits(r.topk_logp), bits(plain.topk_logp))
    hit = r.topk_ids == r.token[:, None]
    assert hit.any(axis=1).sum() > n // 2
    assert np.array_equal(bits(r.topk_logp[hit]), bits(r.logp_raw[hit.any(axis=1)]))
    assert detlogp.sample(h, w, params, 7, np.arange(n, dtype=np.int64), bias=b).topk_ids is None
    with pytest.raises(detlogp.InputError, match=r"topk=129 must be in \[1, 128\]"):
        detlogp.sample(h, w, params, 7, np.arange(n, dtype=np.int64), topk=129)
    with pytest.raises(detlogp.InputError, match="topk=51 exceeds real_vocab=50"):
        detlogp.sample(h, w[:50], params, 7, np.arange(n, dtype=np.int64), topk=51)


def test_every_filter_off_gives_logp_equal_to_logp_raw():
    h, w, _, _, _ = make_problem(9, 16, 130, seed=2)
    r = detlogp.sample(h, w, detlogp.SamplingParams(temperature=0.7), 1, np.arange(9, dtype=np.int64))
    assert np.array_equal(bits(r.logp), bits(r.logp_raw))
    assert (r.support_size == 130).all()


def test_bits_do_not_depend_on_batch_or_position():
    h, w, _, _, _ = make_problem(16, 16, 200, seed=3, weight_scale=0.4)
    params = varied(16)
    key = np.arange(100, 116, dtype=np.int64)
    seed = np.arange(16, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # above 2^63 too
    base = detlogp.sample(h, w, params, seed, key, return_logits=True)
    picks = np.array([15, 2, 2, 9, 0])
    sub = detlogp.SamplingParams(*(getattr(params, f)[picks] for f in ("temperature", "top_k", "top_p", "min_p")))
    r = detlogp.sample(h[picks], w, sub, seed[picks], key[picks])
    assert np.array_equal(r.token, base.token[picks])
    assert np.array_equal(bits(r.logp), bits(base.logp[picks]))
    assert np.array_equal(r.support_size, base.support_size[picks])
    full = detlogp.linear_logp(h, w, base.token, return_logits=True, backend=CPU)  # sample's backend on host data
    assert np.array_equal(bits(base.logits), bits(full.logits))


def test_greedy_ties_and_a_target_outside_the_support():
    h, w = exact_logits([[1, 7, 3, 7], [2, 2, 2, 2]])
    g = detlogp.sample(h, w, detlogp.SamplingParams(temperature=0.0), 0, np.arange(2, dtype=np.int64))
    assert g.token.tolist() == [1, 0]
    assert bits(g.logp).tolist() == [0, 0]
    q = detlogp.linear_logp(h, w, np.array([3, 0]), sampling=detlogp.SamplingParams(temperature=0.0))
    assert q.logp[0] == -np.inf and bits(q.logp[1:]).tolist() == [0]
    assert q.report["sampling"] == {"outside_support": 1, "first_outside_support": 0}


def test_top_p_boundary_and_ties_on_exact_logits():
    h, w = exact_logits([[2, 2, 2, 2, -100]])
    for top_p, support in ((0.5, 2), (float(np.nextafter(np.float32(0.5), np.float32(1))), 3), (0.25, 1)):
        r = detlogp.sample(h, w, detlogp.SamplingParams(top_p=top_p), 0, np.zeros(1, np.int64))
        assert r.support_size[0] == support
        assert r.token[0] < support  # ties go to the lower ids


def test_token_frequencies_match_the_processed_distribution():
    z = [[1.5, 0.25, -0.5, 2.0, 0.0, -1.0]]
    h, w = exact_logits(z)
    params = detlogp.SamplingParams(temperature=1.2, top_k=5, top_p=0.95)
    n = 20000
    r = detlogp.sample(np.repeat(h, n, 0), w, params, 5, np.arange(n, dtype=np.int64))
    q = detlogp.linear_logp(np.repeat(h, 6, 0), w, np.arange(6), sampling=params)
    p = np.exp(q.logp.astype(np.float64))
    assert abs(p.sum() - 1) < 1e-5
    counts = np.bincount(r.token, minlength=6)
    assert (counts[p == 0] == 0).all()
    keep = p > 0
    chi2 = (((counts[keep] - n * p[keep]) ** 2) / (n * p[keep])).sum()
    assert chi2 < 23.51  # the chi-square 1 - 1e-4 quantile for 4 degrees of freedom (5 lanes)
    assert keep.sum() == r.support_size[0] == 5


@pytest.mark.parametrize(
    "params,message",
    [
        (detlogp.SamplingParams(top_p=0.0), "top_p=0 is outside (0, 1]"),
        (detlogp.SamplingParams(min_p=1.0), "min_p=1 is outside [0, 1)"),
        (detlogp.SamplingParams(top_k=-3), "top_k=-3 must be >= 0"),
        (detlogp.SamplingParams(temperature=-0.5), "temperature=-0.5 is outside the sampling temperature range"),
        (detlogp.SamplingParams(top_p=np.array([1, 1, 0.5, np.nan], np.float32)), "top_p_rows[3]=nan is outside"),
        (detlogp.SamplingParams(top_k=np.array([0, -1, 0, 0], np.int32)), "top_k_rows[1]=-1 must be >= 0"),
        (detlogp.SamplingParams(top_p=np.ones(4)), "top_p of shape [4] must be float32, got float64"),
        (detlogp.SamplingParams(top_k=np.zeros(3, np.int64)), "top_k must be an integer or an int32/int64 array"),
        (detlogp.SamplingParams(min_p=True), "min_p must be a float"),
        (detlogp.SamplingParams(temperature="0.5"), "temperature must be a float"),
    ],
)
def test_bad_parameters_are_refused_naming_them(params, message):
    h, w, t, _, _ = make_problem(4, 8, 50, seed=4)
    with pytest.raises(detlogp.InputError) as e:
        detlogp.sample(h, w, params, 0, np.arange(4, dtype=np.int64))
    assert message in str(e.value)
    with pytest.raises(detlogp.InputError) as e:
        detlogp.linear_logp(h, w, t, sampling=params)
    assert message in str(e.value)


def test_bad_seed_key_and_combinations_are_refused():
    h, w, t, _, _ = make_problem(4, 8, 50, seed=5)
    p = detlogp.SamplingParams()
    key = np.arange(4, dtype=np.int64)
    for seed, message in ((-1, "seed=-1 is outside the uint64 range"), (1 << 64, "is outside the uint64 range"),
                          (np.zeros(4, np.int32), "seed must be an integer in [0, 2^64 - 1] or a uint64/int64 array"),
                          (True, "seed must be")):  # fmt: skip
        with pytest.raises(detlogp.InputError, match=message.replace("[", r"\[").replace("^", r"\^")):
            detlogp.sample(h, w, p, seed, key)
    with pytest.raises(detlogp.InputError, match="key must be an int64 array of shape"):
        detlogp.sample(h, w, p, 0, key.astype(np.int32))
    with pytest.raises(detlogp.InputError, match="key must be an int64 array of shape"):
        detlogp.sample(h, w, p, 0, key[:3])
    with pytest.raises(detlogp.InputError, match="the temperature is the program's"):
        detlogp.linear_logp(h, w, t, temperature=0.5, sampling=p)
    with pytest.raises(detlogp.InputError, match="return_entropy is not served with sampling="):
        detlogp.linear_logp(h, w, t, sampling=p, return_entropy=True)
    with pytest.raises(detlogp.InputError, match="sampling must be a detlogp.SamplingParams"):
        detlogp.linear_logp(h, w, t, sampling={"top_k": 5})
    with pytest.raises(detlogp.InputError, match="does not run the sampling program"):
        detlogp.sample(h, w, p, 0, key, backend="reference-materialized")


# ----------------------------------------------------------------------------------------- torch

torch = pytest.importorskip("torch", reason="torch is not installed (the torch sampling tests need it)")
import detlogp.torch as dt  # noqa: E402


def torch_problem(n, d, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * 0.4).bfloat16()
    b = torch.randn(v, generator=g) * 0.5
    return h, w, b


def torch_params(n):
    p = varied(n)
    fields = ("temperature", "top_k", "top_p", "min_p")
    return detlogp.SamplingParams(*(torch.from_numpy(getattr(p, f)) for f in fields))


def test_torch_sample_is_the_numpy_sample_and_replays():
    h, w, b = torch_problem(12, 16, 150, seed=6)
    params = torch_params(12)
    key = torch.arange(12) * 3
    r = dt.sample(h, w, params, 2**63 + 5, key, bias=b, return_logits=True)
    ref = detlogp.sample(h.view(torch.int16).numpy(), w.view(torch.int16).numpy(), varied(12), 2**63 + 5,
                         key.numpy(), bias=b.numpy())  # fmt: skip
    assert np.array_equal(r.token.numpy(), ref.token)
    assert np.array_equal(bits(r.logp.numpy()), bits(ref.logp))
    assert r.logits.shape == (12, 150)
    logp, lse, raw = dt.linear_logp(h, w, r.token, bias=b, sampling=params, return_raw=True)
    assert torch.equal(logp.view(torch.int32), r.logp.view(torch.int32))
    assert torch.equal(raw.view(torch.int32), r.logp_raw.view(torch.int32))
    assert torch.equal(lse.view(torch.int32), r.lse.view(torch.int32))
    assert dt.last_report()["sampling"]["outside_support"] == 0
    # A batch shape: key [B, T], hidden [B, T, D], per-row params shaped like key.
    r2 = dt.sample(h.reshape(3, 4, 16), w, detlogp.SamplingParams(top_k=torch.full((3, 4), 5)), 0, key.reshape(3, 4),
                   bias=b)  # fmt: skip
    assert r2.token.shape == (3, 4) and (r2.support_size == 5).all()


def test_torch_sample_takes_grad_tensors_and_strided_rows():
    # Weights that require grad (an nn.Parameter) and strided per-row tensors give the bits of plain
    # contiguous ones: the rollout reads them outside autograd, the strided ones as contiguous copies.
    h, w, b = torch_problem(12, 16, 150, seed=7)
    params = torch_params(12)
    key = torch.arange(12) * 7
    ref = dt.sample(h, w, params, 11, key, bias=b)
    wide = {f: torch.stack([getattr(params, f), getattr(params, f)], 1) for f in ("temperature", "top_k", "top_p",
                                                                                     "min_p")}  # fmt: skip
    strided = detlogp.SamplingParams(**{f: a[:, 0] for f, a in wide.items()})
    assert not strided.temperature.is_contiguous()
    key2 = torch.stack([key, key], 1)[:, 1]
    r = dt.sample(h.clone().requires_grad_(), torch.nn.Parameter(w.clone()), strided, 11, key2,
                  bias=b.clone().requires_grad_())  # fmt: skip
    for name in ("token", "support_size"):
        assert torch.equal(getattr(r, name), getattr(ref, name))
    for name in ("logp", "logp_raw", "lse"):
        assert torch.equal(getattr(r, name).view(torch.int32), getattr(ref, name).view(torch.int32))
        assert not getattr(r, name).requires_grad


def test_torch_sample_topk_is_the_numpy_sample_topk():
    h, w, b = torch_problem(12, 16, 150, seed=9)
    params = torch_params(12)
    key = torch.arange(12) * 5
    r = dt.sample(h.reshape(3, 4, 16), w, detlogp.SamplingParams(
        *(getattr(params, f).reshape(3, 4) for f in ("temperature", "top_k", "top_p", "min_p"))), 3, key.reshape(3, 4),
        bias=b, topk=6)  # fmt: skip
    ref = detlogp.sample(h.view(torch.int16).numpy(), w.view(torch.int16).numpy(), varied(12), 3, key.numpy(),
                         bias=b.numpy(), topk=6)  # fmt: skip
    assert r.topk_ids.shape == (3, 4, 6) and r.topk_logp.shape == (3, 4, 6)
    assert np.array_equal(r.topk_ids.reshape(12, 6).numpy(), ref.topk_ids)
    assert np.array_equal(bits(r.topk_logp.reshape(12, 6).numpy()), bits(ref.topk_logp))
    assert dt.sample(h, w, params, 3, key, bias=b).topk_ids is None
    with pytest.raises(detlogp.InputError, match="topk=0 must be in"):
        dt.sample(h, w, params, 3, key, topk=0)


def _support_mask(h, w, b, params_np, n, v):
    """Lane v of row n is in the support iff the replay gives it a finite logp."""
    rows = np.repeat(np.arange(n), v)
    per_row = {f: getattr(params_np, f) for f in ("temperature", "top_k", "top_p", "min_p")}
    rep = detlogp.SamplingParams(**{f: a[rows] for f, a in per_row.items()})
    q = detlogp.linear_logp(h.view(torch.int16).numpy()[rows], w.view(torch.int16).numpy(), np.tile(np.arange(v), n),
                            b.numpy(), sampling=rep)  # fmt: skip
    return torch.from_numpy(np.isfinite(q.logp).reshape(n, v))


def test_torch_gradient_holds_the_support_fixed():
    n, d, v = 7, 16, 90
    h, w, b = torch_problem(n, d, v, seed=7)
    params_np = varied(n)
    params = torch_params(n)
    r = dt.sample(h, w, params, 3, torch.arange(n), bias=b)
    targets = r.token.clone()
    targets[2] = -100
    targets[4] = int(torch.argmin(h[4].float() @ w.float().T + b))  # the least likely lane: outside the support
    mask = _support_mask(h, w, b, params_np, n, v)
    assert not mask[4, targets[4]]
    hh, ww, bb = (x.detach().clone().requires_grad_() for x in (h, w, b))
    logp, lse, raw = dt.linear_logp(hh, ww, targets, bias=bb, sampling=params, return_raw=True)
    assert logp[4] == -np.inf and dt.last_report()["sampling"]["outside_support"] == 1
    gl, gs, gr = (torch.linspace(-1, 1, n) * s for s in (1.0, 0.5, 0.25))
    (torch.where(torch.isfinite(logp), logp, 0) * gl).sum().backward(retain_graph=True)
    ((lse * gs).sum() + (raw * gr).sum()).backward()
    # float64 with the same support: logp = y_t - logsumexp over the support, raw over every lane.
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    temp = torch.from_numpy(np.where(params_np.temperature == 0, 1.0, params_np.temperature)).double()
    y = (h64 @ w64.T + b64) / temp[:, None]
    ignored = targets == -100
    t = targets.clamp(min=0)[:, None]
    y_t = y.gather(1, t)[:, 0]
    lse64 = torch.logsumexp(y, 1)
    lse_s = torch.logsumexp(y.masked_fill(~mask, -np.inf), 1)
    in_s = mask.gather(1, t)[:, 0] & ~ignored
    loss = (torch.where(in_s, y_t - lse_s, 0) * gl).sum() + (lse64 * gs).sum()
    loss = loss + (torch.where(ignored, 0, y_t - lse64) * gr).sum()
    loss.backward()
    for got, ref in ((hh.grad, h64.grad), (ww.grad, w64.grad), (bb.grad, b64.grad)):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, err
    assert detlogp.torch.last_backward_path() == "sampled"


def test_torch_refusals():
    h, w, b = torch_problem(4, 8, 40, seed=8)
    p = detlogp.SamplingParams(top_k=3)
    t = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(detlogp.InputError, match="a vocabulary shard needs tp_group"):
        dt.linear_logp(h, w[8:], t, sampling=p, vocab_start=8, real_vocab=40)
    with pytest.raises(detlogp.InputError, match="needs a contract backend"):
        dt.linear_logp(h, w, t, sampling=p, backend=detlogp.TORCH_BACKEND_ID)
    with pytest.raises(detlogp.InputError, match="return_raw needs sampling="):
        dt.linear_logp(h, w, t, return_raw=True)
    with pytest.raises(detlogp.InputError, match="top_k of shape"):
        dt.sample(h, w, detlogp.SamplingParams(top_k=np.zeros(4, np.int64)), 0, torch.arange(4))
    with pytest.raises(detlogp.InputError, match="top_p=1.5 is outside"):
        dt.sample(h, w, detlogp.SamplingParams(top_p=1.5), 0, torch.arange(4))


@pytest.mark.parametrize("world", [2, 3])
def test_torch_sampling_tensor_parallel_gloo(world):
    """detlogp.torch.sample and linear_logp(sampling=) with tp_group over torch.distributed (gloo, CPU
    processes, an engine split V / world off the tile grid): every rank's draw and replay are the
    TP = 1 bits, the logits shard the TP = 1 columns, the replay's gradients those of TP = 1 (the
    hidden gradient the same bits on every rank), and every refusal the same exception on every rank."""
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    here = pathlib.Path(__file__).resolve().parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), str(here / "tp_sample_worker.py"), "--device", "cpu", "--rows", "41", "--dim", "64",
           "--vocab", "701"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETLOGP_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("TP_OK") == world, out[-4000:]
    assert "FAIL" not in out, out[-4000:]

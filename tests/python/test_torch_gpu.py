"""detlogp.torch on an SM90 GPU (marker `gpu`): contract forward, gradients against float64,
backward determinism and peak memory, torch.compile, CUDA-graph replay. Skipped with the reason
without torch, CUDA or the SM90 backend. Run by scripts/gpu_python_check.sh."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests need it)")
import detlogp  # noqa: E402
import detlogp.torch as dt  # noqa: E402
from detlogp._torch import backward  # noqa: E402

pytestmark = pytest.mark.gpu

SM90 = "cuda-fused-linear-logp-sm90-contract-v1"


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


def problem(n, d, v, seed=0, ignore_every=16, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * scale).bfloat16()
    b = torch.randn(v, generator=g) * 0.1
    t = torch.randint(0, v, (n,), generator=g)
    t[ignore_every - 1 :: ignore_every] = -100
    temp = torch.rand(n, generator=g) + 0.5
    return [x.cuda() for x in (h, w, b, t, temp)]


def i32(x):
    return x.view(torch.int32)


def i16(x):
    return x.view(torch.int16)


def test_contract_forward_on_sm90_and_reduce_logits():
    h, w, b, t, temp = problem(300, 512, 2053)
    logp, lse, z = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_logits=True)
    rep = dt.last_report()
    assert rep["backend_id"] == SM90 and rep["contract"] and rep["provenance"]["cc"] == 90
    trainer_logp, trainer_lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    assert torch.equal(i32(logp), i32(trainer_logp)) and torch.equal(i32(lse), i32(trainer_lse))
    # The contract: the backend's own fp32 logits, re-reduced on the host, give the same bits.
    r_logp, r_lse = detlogp.reduce_logits(z.cpu().numpy(), t.cpu().numpy(), temperature=temp.cpu().numpy())
    assert torch.equal(i32(torch.from_numpy(r_logp)), i32(logp.cpu()))
    assert torch.equal(i32(torch.from_numpy(r_lse)), i32(lse.cpu()))
    # Row bits do not depend on the batch.
    sub_logp, _ = dt.linear_logp(h[7:9], w, t[7:9], bias=b, temperature=temp[7:9])
    assert torch.equal(i32(sub_logp), i32(logp[7:9]))


def test_grads_match_float64_on_gpu():
    h, w, b, t, temp = problem(96, 256, 5000, seed=1, scale=0.2)
    args = [x.clone().requires_grad_() for x in (h, w, b, temp)]
    logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=args[3])
    (logp.sum() + 0.25 * lse.sum()).backward()
    ref = [x.detach().double().requires_grad_() for x in (h, w, b, temp)]
    y = (ref[0] @ ref[1].T + ref[2]) / ref[3][:, None]
    lse64 = torch.logsumexp(y, 1)
    ignored = t == -100
    lp64 = torch.where(ignored, 0.0, y.gather(1, t.clamp(min=0)[:, None])[:, 0] - lse64)
    (lp64.sum() + 0.25 * lse64.sum()).backward()
    assert (logp.double() - lp64).abs().max().item() < 1e-4
    for name, a, r in zip(("hidden", "weight", "bias", "temperature"), args, ref):
        err = ((a.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item()
        print(f"{name}: max relative error vs float64 {err:.2e}")
        assert err < 2e-2, name


def test_ignore_index_zero_grad_gpu():
    h, w, b, t, _ = problem(64, 256, 3000, seed=2, ignore_every=4)
    hh = h.clone().requires_grad_()
    logp, _ = dt.linear_logp(hh, w, t)
    logp.sum().backward()
    assert torch.count_nonzero(hh.grad[t == -100]) == 0 and torch.all(logp[t == -100] == 0)


def test_backward_deterministic_gpu():
    h, w, b, t, temp = problem(1024, 1024, 32000, seed=3)
    grads = []
    for _ in range(3):
        args = [x.clone().requires_grad_() for x in (h, w, b, temp)]
        logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=args[3])
        (logp.sum() + 0.1 * lse.sum()).backward()
        grads.append([a.grad for a in args])
    for run in grads[1:]:
        assert torch.equal(i16(run[0]), i16(grads[0][0])) and torch.equal(i16(run[1]), i16(grads[0][1]))
        assert torch.equal(i32(run[2]), i32(grads[0][2])) and torch.equal(i32(run[3]), i32(grads[0][3]))


def test_backward_peak_memory_bounded():
    """Peak extra memory of forward + backward, over inputs and gradient outputs, stays within the
    chunk workspace and far below one [N, V] fp32 buffer."""
    n, d, v = 2048, 1024, 131072
    h, w, _, t, _ = problem(n, d, v, seed=4)
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    hh.grad = torch.zeros_like(hh)
    ww.grad = torch.zeros_like(ww)  # gradient buffers exist before the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp, lse = dt.linear_logp(hh, ww, t)
    logp.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads_out = v * d * 2 + n * d * 2  # the new gradient tensors (bf16), accumulated into .grad
    accumulators = n * d * 4 + n * d * 4  # fp32 hidden-gradient accumulator and one GEMM result
    path = dt.last_backward_path()
    if path == "fused":
        chunk = n * backward.fused_chunk_rows(n, v) * 2  # the bf16 dz chunk (<= BACKWARD_FUSED_CHUNK_BYTES)
    else:
        c = dt.BACKWARD_VOCAB_CHUNK
        chunk = n * c * 4 + n * c * 2 + c * d * 4 + c * d * 2  # fp32 logits chunk, its bf16 copy, dW chunk
    bound = grads_out + accumulators + chunk + (16 << 20)
    print(f"{path} backward: peak extra {extra / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, "
          f"[N,V] fp32 {n * v * 4 / 2**20:.0f} MiB")  # fmt: skip
    assert extra <= bound
    assert extra < n * v * 4 * (0.6 if path == "fused" else 0.5)


def test_torch_compile_gpu():
    h, w, b, t, temp = problem(256, 512, 4099, seed=5)

    def loss(h, w, b):
        logp, lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
        return logp.sum() + 0.1 * lse.sum(), logp

    eager = [x.clone().requires_grad_() for x in (h, w, b)]
    comp = [x.clone().requires_grad_() for x in (h, w, b)]
    l1, lp1 = loss(*eager)
    l1.backward()
    l2, lp2 = torch.compile(loss, fullgraph=True)(*comp)
    l2.backward()
    assert torch.equal(i32(lp1), i32(lp2))
    for a, c in zip(eager, comp):
        err = ((c.grad.float() - a.grad.float()).abs().max() / a.grad.float().abs().max()).item()
        assert err < 1e-2


def test_cuda_graph_replay_identical_bits():
    h, w, b, t, temp = problem(512, 1024, 16384, seed=6)
    static_h = h.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up on a side stream, as CUDA-graph capture requires
            dt.linear_logp(static_h, w, t, bias=b, temperature=temp)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_logp, g_lse = dt.linear_logp(static_h, w, t, bias=b, temperature=temp)
    eager_logp, eager_lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(i32(g_logp), i32(eager_logp)) and torch.equal(i32(g_lse), i32(eager_lse))
    # New inputs copied into the static buffer: the replay gives the eager bits of the new rows.
    h2 = problem(512, 1024, 16384, seed=7)[0]
    static_h.copy_(h2)
    graph.replay()
    torch.cuda.synchronize()
    e2_logp, _ = dt.linear_logp(h2, w, t, bias=b, temperature=temp)
    assert torch.equal(i32(g_logp), i32(e2_logp))


def test_gpu_errors():
    h, w, b, t, _ = problem(32, 128, 1000)
    bad = t.clone()
    bad[3] = 5000
    with pytest.raises(IndexError, match=r"targets\[3\]=5000 is >= real_vocab=1000"):
        dt.linear_logp(h, w, bad)
        dt.check_errors()  # the device validation's verdict is deferred by default
    with pytest.raises(detlogp.InputError) as e:  # the library's words, on every lane
        dt.linear_logp(h, w, t.cpu())
    assert str(e.value).endswith("targets is in host memory but hidden is in CUDA memory; all tensors of a call must "
                                 "live together")  # fmt: skip
    with pytest.raises(detlogp.InputError) as e:
        dt.linear_logp(h.float(), w.float(), t.cpu(), backend=dt.TORCH_BACKEND_ID)
    assert str(e.value).endswith("targets is in host memory but hidden is in CUDA memory; all tensors of a call must "
                                 "live together")  # fmt: skip


def test_deferred_errors():
    """A CUDA call returns once its kernels are enqueued: a bad target's error is raised by the
    thread's next call that finds the validation done, or by check_errors(); the bad call writes
    nothing (its logp rows stay NaN) and the calls after the error are served again."""
    h, w, b, t, _ = problem(32, 128, 1000)
    ref, ref_lse = dt.linear_logp(h, w, t)
    dt.check_errors()  # nothing outstanding: a no-op
    bad = t.clone()
    bad[3] = 5000
    logp, _ = dt.linear_logp(h, w, bad)
    torch.cuda.synchronize()
    assert torch.isnan(logp).all()
    with pytest.raises(detlogp.TargetIndexError, match=r"targets\[3\]=5000 is >= real_vocab=1000 \(checked on the "
                       r"device for an earlier linear_logp call"):  # fmt: skip
        dt.linear_logp(h, w, t)
    again, again_lse = dt.linear_logp(h, w, t)
    dt.check_errors()
    assert torch.equal(again.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(again_lse.view(torch.int32), ref_lse.view(torch.int32))
    # More bad calls than the ring of verdicts holds: a call waits for the oldest at the latest and
    # raises it, having read the others (none is left to raise again).
    with pytest.raises(detlogp.TargetIndexError, match="earlier linear_logp call"):
        for _ in range(40):
            dt.linear_logp(h, w, bad)
    dt.check_errors()
    # Immediate errors on request.
    previous = dt.set_deferred_errors(False)
    try:
        assert previous is True
        with pytest.raises(detlogp.TargetIndexError, match=r"targets\[3\]=5000 is >= real_vocab=1000 \(checked on the "
                           r"device; nothing was written\)"):  # fmt: skip
            dt.linear_logp(h, w, bad)
    finally:
        dt.set_deferred_errors(previous)
    assert torch.equal(dt.linear_logp(h, w, t)[0].view(torch.int32), ref.view(torch.int32))
    dt.check_errors()


def test_torch_lane_checks_cuda_targets_and_temperatures():
    """The plain-torch lane reads CUDA targets and temperatures back for the library's host check: the
    library's messages (before: a device-side index assert, or -inf / NaN rows)."""
    h, w, b, t, temp = problem(32, 128, 1000)
    h, w = h.float(), w.float()
    bad = t.clone()
    bad[3] = 999
    with pytest.raises(detlogp.TargetIndexError) as e:
        dt.linear_logp(h, w, bad, real_vocab=990, backend=dt.TORCH_BACKEND_ID)
    assert str(e.value).endswith("targets[3]=999 is >= real_vocab=990")
    rows = temp.clone()
    rows[7] = -1.0
    with pytest.raises(detlogp.InputError, match=r"temperature_rows\[7\]=-1 is outside the temperature range"):
        dt.linear_logp(h, w, t, temperature=rows, backend=dt.TORCH_BACKEND_ID)
    with pytest.raises(detlogp.InputError, match="temperature=-1 is outside the temperature range"):
        dt.linear_logp(h, w, t, temperature=torch.tensor(-1.0, device="cuda"), backend=dt.TORCH_BACKEND_ID)


def test_zero_d_cuda_temperature_stays_on_the_device():
    """A 0-d CUDA temperature on a contract lane is never read on the host: a bad one is named as the
    row the device validation finds (documented in docs/inputs.md), and N = 0 checks nothing."""
    h, w, b, t, _ = problem(32, 128, 1000)
    with pytest.raises(detlogp.InputError, match=r"temperature_rows\[0\]=-1 is outside the temperature range"):
        dt.linear_logp(h, w, t, temperature=torch.tensor(-1.0, device="cuda"))
        dt.check_errors()
    logp, _ = dt.linear_logp(h[:0], w, t[:0], temperature=torch.tensor(-1.0, device="cuda"))
    assert logp.shape == (0,)


# --- the fused backward (SM90 grad-logits kernel + two GEMMs per chunk) ----------------------


def _float64_grads(h, w, b, t, temp, real_vocab=None, g_lse=0.25):
    ref = [x.detach().double().requires_grad_() for x in (h, w, b)]
    y = (ref[0] @ ref[1].T + ref[2]) / (temp.double()[:, None] if isinstance(temp, torch.Tensor) else temp)
    if real_vocab is not None:
        y = y.masked_fill(torch.arange(w.shape[0], device=y.device) >= real_vocab, float("-inf"))
    lse64 = torch.logsumexp(y, 1)
    lp64 = torch.where(t == -100, 0.0, y.gather(1, t.clamp(min=0)[:, None])[:, 0] - lse64)
    (lp64.sum() + g_lse * lse64.sum()).backward()
    return [x.grad for x in ref]


@pytest.mark.parametrize("chunk_rows", [None, 1024])
def test_fused_backward_matches_float64(monkeypatch, chunk_rows):
    n, d, v, real_vocab = 300, 512, 5000, 4900
    if chunk_rows:  # several chunks, the last one partial and ending in padding rows
        monkeypatch.setattr(dt, "BACKWARD_FUSED_CHUNK_BYTES", n * 2 * chunk_rows)
    h, w, b, t, temp = problem(n, d, v, seed=11, scale=0.2)
    t = torch.where(t >= real_vocab, t - 200, t)
    args = [x.clone().requires_grad_() for x in (h, w, b)]
    logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp, real_vocab=real_vocab)
    (logp.sum() + 0.25 * lse.sum()).backward()
    assert dt.last_backward_path() == "fused"
    ref = _float64_grads(h, w, b, t, temp, real_vocab)
    for name, a, r in zip(("hidden", "weight", "bias"), args, ref):
        err = ((a.grad.double() - r).abs().max() / r.abs().max()).item()
        print(f"fused {name}: max relative error vs float64 {err:.2e}")
        assert err < 2e-2, name
    assert torch.count_nonzero(args[1].grad[real_vocab:]) == 0 and torch.count_nonzero(args[2].grad[real_vocab:]) == 0


def test_fused_backward_deterministic_gpu(monkeypatch):
    n, d, v = 1024, 1024, 32000
    monkeypatch.setattr(dt, "BACKWARD_FUSED_CHUNK_BYTES", n * 2 * 8192)  # 4 chunks
    h, w, b, t, temp = problem(n, d, v, seed=12)
    grads = []
    for _ in range(3):
        args = [x.clone().requires_grad_() for x in (h, w, b)]
        logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp)
        (logp.sum() + 0.1 * lse.sum()).backward()
        assert dt.last_backward_path() == "fused"
        grads.append([a.grad for a in args])
    for run in grads[1:]:
        assert torch.equal(i16(run[0]), i16(grads[0][0])) and torch.equal(i16(run[1]), i16(grads[0][1]))
        assert torch.equal(i32(run[2]), i32(grads[0][2]))


def test_fused_and_torch_loop_agree(monkeypatch):
    h, w, b, t, temp = problem(512, 1024, 16384, seed=13, scale=0.1)
    out = {}
    for knob in ("1", "0"):
        monkeypatch.setenv("DETLOGP_TORCH_FUSED_BACKWARD", knob)
        args = [x.clone().requires_grad_() for x in (h, w, b)]
        logp, lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=0.7)
        (logp.sum() + 0.25 * lse.sum()).backward()
        out[dt.last_backward_path()] = [a.grad.float() for a in args]
    assert set(out) == {"fused", "torch"}
    for a, r in zip(out["fused"], out["torch"]):
        assert ((a - r).abs().max() / r.abs().max()).item() < 1e-2


def test_temperature_gradient_keeps_the_torch_loop():
    h, w, b, t, temp = problem(64, 256, 3000, seed=14)
    tt = temp.clone().requires_grad_()
    hh = h.clone().requires_grad_()
    dt.linear_logp(hh, w, t, temperature=tt)[0].sum().backward()
    assert dt.last_backward_path() == "torch" and tt.grad is not None


def test_grad_logits_op_gpu_close_to_cpu():
    h, w, b, t, temp = problem(77, 256, 2053, seed=15, scale=0.2)
    _, lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    g_logp = torch.rand(77, device="cuda")
    g_lse = torch.rand(77, device="cuda") - 0.5
    wc, bc = w[64:2053], b[64:2053]
    gpu = dt.grad_logits(h, wc, t, lse, g_logp, g_lse, bias=bc, temperature=temp, vocab_start=64, real_vocab=2000)
    cpu = dt.grad_logits(*(x.cpu() for x in (h, wc, t, lse, g_logp, g_lse)), bias=bc.cpu(), temperature=temp.cpu(),
                         vocab_start=64, real_vocab=2000)  # fmt: skip
    scale = ((g_logp.abs() + g_lse.abs()) / temp).cpu()[:, None]
    diff = (gpu.cpu().double() - cpu.double()).abs()
    assert torch.all(diff <= 2**-7 * cpu.double().abs() + 1e-5 * scale)  # the z of each arch, then bf16
    assert torch.all(gpu[:, 2000 - 64 :].view(torch.int16) == 0)


def test_grad_logits_gpu_errors_write_nothing():
    h, w, b, t, _ = problem(32, 128, 1000)
    _, lse = dt.linear_logp(h, w, t)
    bad = t.clone()
    bad[3] = 5000
    out = torch.full((32, 1000), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(IndexError, match=r"targets\[3\]=5000 is >= real_vocab=1000"):
        dt.grad_logits(h, w, bad, lse, out=out)
    assert torch.isnan(out).all()
    with pytest.raises(ValueError, match="16-byte"):
        dt.grad_logits(h[:, 1:121], w[:, 1:121], t, lse)


# --- a 0-d temperature tensor on the GPU -------------------------------------------------------


def test_zero_d_temperature_gradient_gpu():
    """A 0-d CUDA temperature is every row's, inside the graph: the [N] form's bits, and its gradient
    is that form's gradient summed (bit for bit)."""
    h, w, b, t, _ = problem(128, 256, 3000, seed=30)
    t0 = torch.tensor(0.8125, device="cuda", requires_grad=True)
    rows = torch.full((128,), 0.8125, device="cuda", requires_grad=True)
    l0, s0 = dt.linear_logp(h, w, t, bias=b, temperature=t0)
    lr, sr = dt.linear_logp(h, w, t, bias=b, temperature=rows)
    lf, _ = dt.linear_logp(h, w, t, bias=b, temperature=0.8125)
    assert dt.last_report()["backend_id"] == SM90
    assert torch.equal(i32(l0), i32(lr)) and torch.equal(i32(s0), i32(sr)) and torch.equal(i32(l0), i32(lf))
    (l0.sum() + 0.25 * s0.sum()).backward()
    (lr.sum() + 0.25 * sr.sum()).backward()
    assert torch.equal(t0.grad, rows.grad.sum())


def test_zero_d_temperature_in_a_cuda_graph():
    """Never read on the host: a 0-d CUDA temperature is captured by reference, so a replay after
    changing its value gives the eager bits at the new value."""
    h, w, b, t, _ = problem(256, 512, 8192, seed=31)
    temp = torch.tensor(0.7, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            dt.linear_logp(h, w, t, bias=b, temperature=temp)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_logp, _ = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    temp.fill_(0.9)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(i32(g_logp), i32(dt.linear_logp(h, w, t, bias=b, temperature=0.9)[0]))


# --- operands the SM90 backend cannot read in place: copied once, said in the report ----------


def _offset_view(x, elements=1):
    """The same values in a view that starts `elements` elements (2 bytes each) into its storage."""
    flat = torch.empty(x.numel() + elements, dtype=x.dtype, device=x.device)
    v = flat[elements:].view(x.shape)
    v.copy_(x)
    return v


@pytest.mark.parametrize("which", [["hidden"], ["weight"], ["hidden", "weight"]])
def test_misaligned_views_copied_once_same_bits_and_grads(which):
    h, w, b, t, temp = problem(300, 512, 2053, seed=32, scale=0.2)
    ref = [x.clone().requires_grad_() for x in (h, w, b)]
    ref_logp, ref_lse, ref_z = dt.linear_logp(ref[0], ref[1], t, bias=ref[2], temperature=temp, return_logits=True)
    assert dt.last_report()["copies"] == []
    # The gradients through the trainer entry (no logits output), the fused backward's case.
    grad_logp, grad_lse = dt.linear_logp(ref[0], ref[1], t, bias=ref[2], temperature=temp)
    (grad_logp.sum() + 0.25 * grad_lse.sum()).backward()
    assert dt.last_backward_path() == "fused"
    args = [
        (_offset_view(x) if name in which else x.clone()).requires_grad_() for name, x in (("hidden", h), ("weight", w))
    ]
    args.append(b.clone().requires_grad_())
    assert all(a.data_ptr() % 16 != 0 for name, a in zip(("hidden", "weight"), args) if name in which)
    logp, lse, z = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp, return_logits=True)
    rep = dt.last_report()
    assert rep["backend_id"] == SM90 and [c["argument"] for c in rep["copies"]] == which
    for c in rep["copies"]:
        assert (
            c["reason"]
            == "it starts at element 1 of its storage (byte 2), not on a 16-byte boundary (TMA requirement of the SM90 backend)"
        )
    assert (
        torch.equal(i32(logp), i32(ref_logp))
        and torch.equal(i32(lse), i32(ref_lse))
        and torch.equal(i32(z), i32(ref_z))
    )
    grad_logp, grad_lse = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp)
    (grad_logp.sum() + 0.25 * grad_lse.sum()).backward()
    assert dt.last_backward_path() == "fused"  # the backward copies the same views for its kernel
    for a, r in zip(args, ref):  # the caller's tensors get the gradients, the aligned call's bits
        assert a.grad is not None and torch.equal(a.grad.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                                                  r.grad.view(torch.int16 if r.dtype == torch.bfloat16 else torch.int32))  # fmt: skip


@pytest.mark.parametrize("n", [1, 64])
def test_rows_not_a_multiple_of_16_bytes_are_padded(n):
    """D = 100 (rows of 200 bytes): hidden and weight are copied into rows padded to 208 bytes, and
    the SM90 backend gives the bits it gives for the same host tensors, which its staging pads alike
    (the SM90 logits are its own, not the CPU backend's: docs/contract.md §3.1)."""
    h, w, b, t, temp = problem(n, 100, 1000, seed=33, ignore_every=8 if n > 1 else 1000)
    logp, lse = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    rep = dt.last_report()
    assert rep["backend_id"] == SM90 and [c["argument"] for c in rep["copies"]] == ["hidden", "weight"]
    assert "row stride of 100 elements (200 bytes) is not a multiple of 16 bytes" in rep["copies"][1]["reason"]
    host_logp, host_lse = dt.linear_logp(h.cpu(), w.cpu(), t.cpu(), bias=b.cpu(), temperature=temp.cpu(), backend=SM90)
    assert dt.last_report()["backend_id"] == SM90
    assert torch.equal(i32(logp.cpu()), i32(host_logp)) and torch.equal(i32(lse.cpu()), i32(host_lse))


def test_misaligned_views_keep_their_error_in_the_array_api():
    """The C++ library (here through the extension directly) keeps refusing what TMA cannot read."""
    h, w, b, t, _ = problem(32, 128, 1000)
    hh = _offset_view(h)
    logp, lse = torch.empty(32, device="cuda"), torch.empty(32, device="cuda")
    problem_tuple = (hh, w, t, None, 1.0, None, -1, 0, -100)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(detlogp.InputError, match="hidden base pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        detlogp._ext.linear_logp(problem_tuple, logp, lse, None, "", False, stream)


def test_misaligned_view_under_compile_and_in_a_cuda_graph():
    h, w, b, t, temp = problem(256, 512, 4099, seed=34)
    ref, _ = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    hh = _offset_view(h)

    def f(x):
        return dt.linear_logp(x, w, t, bias=b, temperature=temp)[0]

    assert torch.equal(i32(torch.compile(f, fullgraph=True)(hh)), i32(ref))
    assert [c["argument"] for c in dt.last_report()["copies"]] == ["hidden"]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            f(hh)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_logp = f(hh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(i32(g_logp), i32(ref))


def test_gpu_refusals_are_detlogp_errors():
    h, w, b, t, _ = problem(32, 128, 1000)
    with pytest.raises(detlogp.InputError, match="hidden has D=0 columns"):
        dt.linear_logp(h[:, :0], w[:, :0], t)
    with pytest.raises(detlogp.InputError, match="ignore_index=18446744073709551616 is outside the int64 range"):
        dt.linear_logp(h, w, t, ignore_index=2**64)
    with pytest.raises(detlogp.InputError, match="temperature is on meta"):
        dt.linear_logp(h, w, t, temperature=torch.tensor(1.0, device="meta"))


# --- the entropy output (return_entropy) and its gradient on the GPU -----------------------------


def _need_sm90_entropy():
    sm90 = next(b for b in detlogp.backends() if b["id"] == SM90)
    if not sm90["provenance"]["entropy_id"]:
        pytest.skip("the SM90 backend does not serve the entropy output (its provenance names no entropy_id)")


def _float64_mixed_grads(h, w, b, t, temp, coef, real_vocab=None):
    """float64 autograd of sum(a logp + b lse + c H), log_softmax over the real vocabulary."""
    ref = [x.detach().double().requires_grad_() for x in (h, w, b)]
    y = (ref[0] @ ref[1].T + ref[2]) / (temp.double()[:, None] if isinstance(temp, torch.Tensor) else temp)
    y = y[:, : real_vocab or w.shape[0]]
    logsm = torch.log_softmax(y, 1)
    lp64 = torch.where(t == -100, 0.0, logsm.gather(1, t.clamp(min=0)[:, None])[:, 0])
    h64 = -(logsm.exp() * logsm).sum(1)
    a, bb, c = (x.double() for x in coef)
    (a * lp64 + bb * torch.logsumexp(y, 1) + c * h64).sum().backward()
    return h64.detach(), [x.grad for x in ref]


def _coef(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, generator=g) * s + lo).cuda() for s, lo in ((2.0, -0.5), (1.0, -0.5), (1.5, -0.75))]


def test_entropy_forward_on_sm90_equals_reduce_logits():
    _need_sm90_entropy()
    h, w, b, t, temp = problem(300, 512, 2053, seed=21, scale=0.2)
    logp, lse, entropy, z = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True, return_logits=True)
    rep = dt.last_report()
    assert rep["backend_id"] == SM90 and rep["provenance"]["entropy_id"] == detlogp.contract()["entropy_id"]
    assert entropy.is_cuda and entropy.dtype == torch.float32 and entropy.shape == (300,)
    # The contract: the backend's own fp32 logits, re-reduced on the host, give the same entropy bits.
    r_logp, r_lse, r_entropy = detlogp.reduce_logits(z.cpu().numpy(), t.cpu().numpy(), temperature=temp.cpu().numpy(),
                                                     return_entropy=True)  # fmt: skip
    assert torch.equal(i32(torch.from_numpy(r_entropy)), i32(entropy.cpu()))
    assert torch.equal(i32(torch.from_numpy(r_logp)), i32(logp.cpu()))
    # Serving = trainer, and asking for it leaves logp/lse alone.
    trainer = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True)
    plain = dt.linear_logp(h, w, t, bias=b, temperature=temp)
    assert torch.equal(i32(trainer[2]), i32(entropy))
    assert torch.equal(i32(plain[0]), i32(logp)) and torch.equal(i32(plain[1]), i32(lse))


@pytest.mark.parametrize("chunk_rows", [None, 1024])
def test_fused_backward_with_entropy_matches_float64(monkeypatch, chunk_rows):
    _need_sm90_entropy()
    n, d, v, real_vocab = 300, 512, 5000, 4900
    if chunk_rows:  # several chunks, the last one partial and ending in padding rows
        monkeypatch.setattr(dt, "BACKWARD_FUSED_CHUNK_BYTES", n * 2 * chunk_rows)
    h, w, b, t, temp = problem(n, d, v, seed=22, scale=0.2)
    t = torch.where(t >= real_vocab, t - 200, t)
    coef = _coef(n, 22)
    args = [x.clone().requires_grad_() for x in (h, w, b)]
    logp, lse, entropy = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp, real_vocab=real_vocab,
                                        return_entropy=True)  # fmt: skip
    (coef[0] * logp + coef[1] * lse + coef[2] * entropy).sum().backward()
    assert dt.last_backward_path() == "fused"
    h64, ref = _float64_mixed_grads(h, w, b, t, temp, coef, real_vocab)
    assert (entropy.double() - h64).abs().max().item() < 1e-3
    for name, a, r in zip(("hidden", "weight", "bias"), args, ref):
        err = ((a.grad.double() - r).abs().max() / r.abs().max()).item()
        print(f"fused with entropy {name}: max relative error vs float64 {err:.2e}")
        assert err < 2e-2, name
    assert torch.count_nonzero(args[1].grad[real_vocab:]) == 0 and torch.count_nonzero(args[2].grad[real_vocab:]) == 0


def test_fused_and_torch_loop_agree_with_entropy(monkeypatch):
    _need_sm90_entropy()
    h, w, b, t, temp = problem(512, 1024, 16384, seed=23, scale=0.1)
    coef = _coef(512, 23)
    out = {}
    for knob in ("1", "0"):
        monkeypatch.setenv("DETLOGP_TORCH_FUSED_BACKWARD", knob)
        args = [x.clone().requires_grad_() for x in (h, w, b)]
        logp, lse, entropy = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=0.7, return_entropy=True)
        (coef[0] * logp + coef[1] * lse + coef[2] * entropy).sum().backward()
        out[dt.last_backward_path()] = [a.grad.float() for a in args]
    assert set(out) == {"fused", "torch"}
    for a, r in zip(out["fused"], out["torch"]):
        assert ((a - r).abs().max() / r.abs().max()).item() < 1e-2


def test_entropy_unused_keeps_the_fused_bits_and_a_temperature_gradient_the_torch_loop(monkeypatch):
    _need_sm90_entropy()
    h, w, b, t, temp = problem(128, 256, 3000, seed=24, scale=0.2)
    runs = []
    for return_entropy in (False, True):
        args = [x.clone().requires_grad_() for x in (h, w, b)]
        out = dt.linear_logp(args[0], args[1], t, bias=args[2], temperature=temp, return_entropy=return_entropy)
        (out[0].sum() + 0.25 * out[1].sum()).backward()
        assert dt.last_backward_path() == "fused"
        runs.append([a.grad for a in args])
    assert torch.equal(i16(runs[0][0]), i16(runs[1][0])) and torch.equal(i16(runs[0][1]), i16(runs[1][1]))
    assert torch.equal(i32(runs[0][2]), i32(runs[1][2]))
    tt = temp.clone().requires_grad_()
    hh = h.clone().requires_grad_()
    _, _, entropy = dt.linear_logp(hh, w, t, temperature=tt, return_entropy=True)
    entropy.sum().backward()
    assert dt.last_backward_path() == "torch" and tt.grad is not None and torch.isfinite(tt.grad).all()


def test_entropy_under_torch_compile_and_in_a_cuda_graph():
    _need_sm90_entropy()
    h, w, b, t, temp = problem(256, 512, 4099, seed=25)

    def loss(h, w, b):
        logp, lse, entropy = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True)
        return logp.sum() + 0.1 * lse.sum() - 0.2 * entropy.sum(), entropy

    eager = [x.clone().requires_grad_() for x in (h, w, b)]
    comp = [x.clone().requires_grad_() for x in (h, w, b)]
    l1, e1 = loss(*eager)
    l1.backward()
    l2, e2 = torch.compile(loss, fullgraph=True)(*comp)
    l2.backward()
    assert torch.equal(i32(e1), i32(e2))
    for a, c in zip(eager, comp):
        err = ((c.grad.float() - a.grad.float()).abs().max() / a.grad.float().abs().max()).item()
        assert err < 1e-2
    static_h = h.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            dt.linear_logp(static_h, w, t, bias=b, temperature=temp, return_entropy=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = dt.linear_logp(static_h, w, t, bias=b, temperature=temp, return_entropy=True)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(i32(g_out[2]), i32(e1))


def test_grad_logits_op_gpu_with_entropy_close_to_cpu():
    """The SM90 kernel's entropy term (the bits: tests/gpu/test_sm90_grad_logits.cpp) close to the CPU
    op's, with H from reduce_logits of the SM90 serving logits (no entropy forward needed)."""
    h, w, b, t, temp = problem(77, 256, 2053, seed=26, scale=0.2)
    t = torch.where(t >= 2000, t - 100, t)  # every target real under real_vocab=2000
    _, lse, z = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_logits=True)
    _, _, ent = detlogp.reduce_logits(z.cpu().numpy(), t.cpu().numpy(), temperature=temp.cpu().numpy(),
                                      return_entropy=True)  # fmt: skip
    entropy = torch.from_numpy(ent).cuda()
    g_logp = torch.rand(77, device="cuda")
    g_lse = torch.rand(77, device="cuda") - 0.5
    g_entropy = torch.rand(77, device="cuda") * 1.5 - 0.75
    wc, bc = w[64:2053], b[64:2053]
    kw = dict(vocab_start=64, real_vocab=2000)
    gpu = dt.grad_logits(h, wc, t, lse, g_logp, g_lse, bias=bc, temperature=temp, entropy=entropy, g_entropy=g_entropy,
                         **kw)  # fmt: skip
    cpu = dt.grad_logits(*(x.cpu() for x in (h, wc, t, lse, g_logp, g_lse)), bias=bc.cpu(), temperature=temp.cpu(),
                         entropy=entropy.cpu(), g_entropy=g_entropy.cpu(), **kw)  # fmt: skip
    scale = ((g_logp.abs() + g_lse.abs() + 20 * g_entropy.abs()) / temp).cpu()[:, None]
    diff = (gpu.cpu().double() - cpu.double()).abs()
    assert torch.all(diff <= 2**-7 * cpu.double().abs() + 1e-5 * scale)  # the z of each arch, then bf16
    assert torch.all(gpu[:, 2000 - 64 :].view(torch.int16) == 0)
    plain = dt.grad_logits(h, wc, t, lse, g_logp, g_lse, bias=bc, temperature=temp, **kw)
    alone = dt.grad_logits(h, wc, t, lse, g_logp, g_lse, bias=bc, temperature=temp, entropy=entropy, **kw)
    assert torch.equal(i16(plain), i16(alone))  # no g_entropy: the logp-only bits
    with pytest.raises(ValueError, match="g_entropy needs entropy"):
        dt.grad_logits(h, wc, t, lse, g_logp, g_lse, bias=bc, temperature=temp, g_entropy=g_entropy, **kw)


def test_linear_logp_loss_on_sm90():
    """detlogp.torch.linear_logp_loss on CUDA: the serving run's logp / lse / entropy bits equal
    linear_logp's, the gradients are close to linear_logp's backward and equal run to run, and the
    peak extra memory is the gradients plus one fp32 chunk of logits (dz written over them), far
    below one [N, V] fp32 buffer. The second run is measured (the first allocates cuBLAS's workspace)."""
    n, d, v = 4096, 256, 20011
    h, w, b, t, temp = problem(n, d, v, seed=12)
    adv = torch.randn(n, device="cuda")

    def fn(logp, lse, entropy, rows):
        return -(logp * adv[rows]).sum() - 0.01 * entropy.sum()

    runs = []
    for _ in range(2):
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        r = dt.linear_logp_loss(hh, ww, t, fn, bias=bb, temperature=temp, return_entropy=True, chunk_rows=256)
        r.loss.backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        runs.append((r, hh.grad, ww.grad, bb.grad, extra))
    r, gh, gw, gb, extra = runs[1]
    logp, lse, entropy = dt.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True)
    assert torch.equal(i32(r.logp), i32(logp)) and torch.equal(i32(r.lse), i32(lse))
    assert torch.equal(i32(r.entropy), i32(entropy))
    for a, c in zip(runs[0][1:4], runs[1][1:4]):
        assert torch.equal(a, c)
    hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
    logp2, lse2, ent2 = dt.linear_logp(hh, ww, t, bias=bb, temperature=temp, return_entropy=True)
    fn(logp2, lse2, ent2, slice(None)).backward()
    for got, want, name in ((gh, hh.grad, "hidden"), (gw, ww.grad, "weight"), (gb, bb.grad, "bias")):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 2e-2 * want.float().abs().max().item() + 1e-6, f"grad_{name}: max |err| {err}"
    grads = n * d * 2 + v * d * 2 + v * 4 * 2  # bf16 grad_hidden, grad_weight; the bias gradient and its sum
    bound = 2 * grads + 256 * v * 4 + (16 << 20)  # the gradients, a copy autograd may make, the chunk
    print(f"linear_logp_loss: peak extra {extra / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, "
          f"[N, V] fp32 {n * v * 4 / 2**20:.0f} MiB")  # fmt: skip
    assert extra <= bound and extra < 0.35 * n * v * 4

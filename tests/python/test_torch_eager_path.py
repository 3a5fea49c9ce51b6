"""detlogp.torch.linear_logp's eager path: where nothing needs torch's dispatcher (no autograd, no
tracing, no mode, no capture) it runs the op's body directly. These tests pin which path a call
takes and that both give the same bits, the same reports and the same errors."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the torch tests need it)")
import detlogp.torch as dt  # noqa: E402
from detlogp import InputError  # noqa: E402
from detlogp._torch import op as op_mod  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _problem(device, n=5, d=72, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(v, d, generator=g) * 0.1).to(torch.bfloat16).to(device)
    t = torch.randint(0, v, (n,), generator=g).to(device)
    b = torch.randn(v, generator=g).to(device)
    return h, w, t, b


@pytest.fixture
def route(monkeypatch):
    """Counts the calls of each path: "eager" (the body alone) and "op" (through the dispatcher)."""
    seen = {"eager": 0, "op": 0}
    real_run, real_op = dt._run_op, dt._linear_logp_op

    def run(*a):
        seen["eager"] += 1
        return real_run(*a)

    def op(*a):
        seen["op"] += 1
        return real_op(*a)

    monkeypatch.setattr(dt, "_run_op", run)
    monkeypatch.setattr(dt, "_linear_logp_op", op)
    return seen


def _through_dispatcher(h, w, t, b=None, temperature=1.0, return_logits=False, return_entropy=False):
    v = w.shape[0]
    return torch.ops.detlogp.linear_logp(h, w, t, b, temperature, None, -100, return_logits, v, "", False,
                                         return_entropy, 0)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_eager_path_taken_without_autograd(device, route):
    h, w, t, _ = _problem(device)
    dt.linear_logp(h, w, t)
    assert route == {"eager": 1, "op": 0}
    with torch.no_grad():  # a weight that requires grad, with grad mode off: still eager
        dt.linear_logp(h, torch.nn.Parameter(w.clone()), t)
    assert route == {"eager": 2, "op": 0}


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher_taken_for_autograd_and_modes(device, route):
    h, w, t, _ = _problem(device)
    hg = h.clone().requires_grad_(True)
    logp, _ = dt.linear_logp(hg, w, t)
    assert route == {"eager": 0, "op": 1}
    assert logp.grad_fn is not None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        dt.linear_logp(h, w, t)
    assert route == {"eager": 0, "op": 2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("extra", [{}, {"return_logits": True}, {"return_entropy": True}])
def test_eager_path_same_bits_and_report_as_dispatcher(device, extra):
    h, w, t, b = _problem(device)
    fast = dt.linear_logp(h, w, t, bias=b, temperature=0.7, **extra)
    fast_report = dt.last_report()
    slow = _through_dispatcher(h, w, t, b, 0.7, **extra)
    slow_report = dt.last_report()
    assert fast_report == slow_report
    assert fast_report["copies"] == []
    picked = [slow[0], slow[1]] + ([slow[3]] if extra.get("return_entropy") else [])
    picked += [slow[2]] if extra.get("return_logits") else []
    assert len(fast) == len(picked)
    for a, s in zip(fast, picked):
        assert torch.equal(a.view(torch.int32), s.view(torch.int32))


def test_eager_path_copies_reported_as_dispatcher():
    h, w, t, _ = _problem("cpu")
    wide = torch.zeros(w.shape[0], 2 * w.shape[1], dtype=w.dtype)
    wide[:, ::2] = w
    view = wide[:, ::2]  # column stride 2: copied once, and reported
    fast = dt.linear_logp(h, view, t)
    fast_copies = dt.last_report()["copies"]
    slow = _through_dispatcher(h, view, t)
    assert fast_copies == dt.last_report()["copies"] == [
        {"argument": "weight", "reason": "its column stride is 2, not 1 (the library reads rows with unit stride)"}
    ]
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


@pytest.mark.parametrize("device", DEVICES)
def test_eager_path_same_errors_as_dispatcher(device):
    h, w, t, _ = _problem(device)
    bad = t.clone()
    bad[2] = w.shape[0] + 7
    if device == "cuda":
        dt.check_errors()  # no earlier test's deferred error is raised here
    previous = dt.set_deferred_errors(False)  # raised by the call itself on either device
    try:
        with pytest.raises(Exception) as fast:
            dt.linear_logp(h, w, bad)
        with pytest.raises(Exception) as slow:
            _through_dispatcher(h, w, bad)
    finally:
        dt.set_deferred_errors(previous)
    assert type(fast.value) is type(slow.value) and str(fast.value) == str(slow.value)
    assert f"targets[2]={w.shape[0] + 7}" in str(fast.value)


def test_last_report_keeps_the_last_successful_call():
    h, w, t, _ = _problem("cpu")
    # The CPU backend pinned: auto may serve host tensors on the SM90 backend where a GPU is present.
    dt.linear_logp(h, w, t, backend="cpu-linear-logp-contract-v1")
    before = dt.last_report()
    with pytest.raises(InputError):
        dt.linear_logp(h, w, t, temperature=-1.0)
    assert dt.last_report() is before
    assert dt.last_report()["backend_id"] == "cpu-linear-logp-contract-v1"


SM90 = "cuda-fused-linear-logp-sm90-contract-v1"


def _need_sm90():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    import detlogp

    sm90 = next(b for b in detlogp.backends() if b["id"] == SM90)
    if not sm90["available"]:
        pytest.skip(f"SM90 backend unavailable: {sm90['detail']}")


@pytest.mark.gpu
def test_capture_takes_the_dispatcher(route):
    _need_sm90()
    h, w, t, _ = _problem("cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = dt.linear_logp(h, w, t)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = dt.linear_logp(h, w, t)
    g.replay()
    torch.cuda.synchronize()
    assert route["op"] == 1
    assert torch.equal(eager[0], captured[0]) and torch.equal(eager[1], captured[1])


def test_eager_operands_detaches_only_under_no_grad():
    h, w, t, _ = _problem("cpu")
    p = torch.nn.Parameter(w.clone())
    assert op_mod.eager_operands((h, p, t, None, None)) is None
    with torch.no_grad():
        out = op_mod.eager_operands((h, p, t, None, None))
    assert out[0] is h and out[2] is t and out[3] is None and out[4] is None
    assert not out[1].requires_grad and out[1].data_ptr() == p.data_ptr()



class _Logged(torch.Tensor):
    """A tensor subclass with its own __torch_function__ (its __dlpack__ goes through it)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def _facts(x):
    return x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack_exports_are_what_dunder_dlpack_gives(device):
    """The op body hands the extension capsules of the tensors __dlpack__ would export as they are,
    each one the array __dlpack__ gives (pointer, shape, strides, dtype, device), and every other
    object itself, for nanobind to import or refuse as before."""
    from detlogp._torch.tensors import dlpack_exports

    h, w, t, b = _problem(device)
    plain = [h, w, t, b, h[:, 8:40], w.t(), t[::2], torch.empty(0, device=device),
             torch.nn.Parameter(w.clone(), requires_grad=False), torch.tensor(0.5, device=device)]  # fmt: skip
    out = dlpack_exports(plain)
    for x, c in zip(plain, out):
        assert type(c).__name__ == "PyCapsule"
        assert _facts(torch.from_dlpack(c)) == _facts(torch.from_dlpack(x.__dlpack__()))
    refused = [None, torch.nn.Parameter(w.clone()), h.float().requires_grad_(),
               torch.randn(3, 4, dtype=torch.complex64, device=device).conj(), t.cpu().to_sparse(),
               h.as_subclass(_Logged), 1.0]  # fmt: skip
    for x, c in zip(refused, dlpack_exports(refused)):
        assert c is x


@pytest.mark.gpu
def test_cached_tensor_maps_follow_buffers_and_shapes():
    """The SM90 backend keeps the last 16 tensor maps: calls that cycle through more (pointer,
    shape) pairs than that, in both orders (hits where a pair is still cached, misses where it was
    evicted), each give the bits of the same values in fresh copies (a map of another buffer or
    shape would read other values)."""
    _need_sm90()
    g = torch.Generator().manual_seed(3)
    d, v = 136, 1000
    weights = [(torch.randn(v, d, generator=g) * 0.1).to(torch.bfloat16).cuda() for _ in range(2)]
    cases = []
    for i, n in enumerate((1, 8, 64, 3, 1, 8, 5, 64, 2, 1, 8, 64)):
        h = torch.randn(n, d, generator=g).to(torch.bfloat16).cuda()
        t = torch.randint(0, v, (n,), generator=g).cuda()
        cases.append((h, weights[i % 2], t))
    want = []
    for h, w, t in cases:
        logp, lse = dt.linear_logp(h.clone(), w.clone(), t.clone())
        want.append((logp.clone(), lse.clone()))
    order = list(range(len(cases)))
    for idx in order + order[::-1] + order:
        h, w, t = cases[idx]
        logp, lse = dt.linear_logp(h, w, t)
        assert dt.last_report()["backend_id"] == SM90
        assert torch.equal(logp.view(torch.int32), want[idx][0].view(torch.int32)), idx
        assert torch.equal(lse.view(torch.int32), want[idx][1].view(torch.int32)), idx
    assert not torch.equal(want[0][1], want[4][1])  # same shape, other values: other bits
    dt.check_errors()

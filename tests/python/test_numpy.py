"""The array API on the CPU backend (numpy only; runs in CI)."""

import subprocess

import numpy as np
import pytest
from conftest import INTEGER_CASES, TEMPERATURE_CASES, make_problem, read_safetensors, reference_f64

import detlogp

CPU = "cpu-linear-logp-contract-v1"


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("v", [17, 123, 2053])
@pytest.mark.parametrize("with_bias,temp_rows", [(False, False), (True, True)])
def test_odd_vocab_matches_float64(v, with_bias, temp_rows):
    h, w, t, b, temp = make_problem(19, 40, v, seed=v, bias=with_bias, temp_rows=temp_rows, ignore_every=5)
    r = detlogp.linear_logp(h, w, t, bias=b, temperature=temp if temp_rows else 0.7, backend=CPU)
    ref_logp, ref_lse = reference_f64(h, w, t, b, temp if temp_rows else 0.7)
    assert r.report["backend_id"] == CPU and r.report["contract"]
    assert r.logp.dtype == np.float32 and r.logp.shape == (19,)
    np.testing.assert_allclose(r.lse, ref_lse, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(r.logp, ref_logp, rtol=2e-6, atol=2e-5)
    assert np.all(bits(r.logp[4::5]) == 0)  # ignored rows: +0.0 exactly


def cli_serving_run(cli, tmp_path, h, w, t, b, temp, backend):
    """`detlogp run --return-logits` on the .npy form of the inputs: its output tensors."""
    for name, a in (("h", h), ("w", w), ("t", t), ("b", b), ("T", temp)):
        np.save(tmp_path / f"{name}.npy", a)
    out = tmp_path / "out.safetensors"
    cmd = [cli, "run", "--hidden", tmp_path / "h.npy", "--weight", tmp_path / "w.npy", "--targets",
           tmp_path / "t.npy", "--bias", tmp_path / "b.npy", "--temperatures", tmp_path / "T.npy",
           "--backend", backend, "--return-logits", "--out", out]  # fmt: skip
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return read_safetensors(out)


@pytest.mark.parametrize("v", [17, 123, 2053])
def test_bits_equal_cli(cli, tmp_path, v):
    """The numpy path and the C++ CLI give the same bytes for the same .npy inputs."""
    h, w, t, b, temp = make_problem(21, 72, v, seed=3, bias=True, temp_rows=True, ignore_every=4)
    cli_out = cli_serving_run(cli, tmp_path, h, w, t, b, temp, CPU)
    r = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, return_logits=True, backend=CPU)
    assert np.array_equal(bits(r.logp), bits(cli_out["logp"]))
    assert np.array_equal(bits(r.lse), bits(cli_out["lse"]))
    assert np.array_equal(bits(r.logits), bits(cli_out["logits"]))


def test_serving_equals_trainer_and_reduce_logits():
    h, w, t, b, _ = make_problem(33, 64, 2053, seed=1, bias=True, ignore_every=7)
    trainer = detlogp.linear_logp(h, w, t, bias=b, temperature=0.9)
    serving = detlogp.linear_logp(h, w, t, bias=b, temperature=0.9, return_logits=True)
    assert trainer.logits is None and serving.logits.shape == (33, 2053)
    assert np.array_equal(bits(trainer.logp), bits(serving.logp))
    assert np.array_equal(bits(trainer.lse), bits(serving.lse))
    logp, lse = detlogp.reduce_logits(serving.logits, t, temperature=0.9)
    assert np.array_equal(bits(logp), bits(trainer.logp)) and np.array_equal(bits(lse), bits(trainer.lse))


def test_batch_invariance_and_strided_rows():
    """A row's bits do not depend on the batch around it, nor on its row stride (DLPack views)."""
    h, w, t, _, _ = make_problem(40, 96, 123, seed=2)
    full = detlogp.linear_logp(h, w, t)
    sub = detlogp.linear_logp(h[5:6], w, t[5:6])
    assert bits(sub.logp)[0] == bits(full.logp)[5]
    strided = detlogp.linear_logp(h[::3], w, t[::3].copy())  # row stride 3*D, no copy of hidden
    assert np.array_equal(bits(strided.logp), bits(full.logp[::3]))
    padded = np.zeros((40, 128), np.uint16)
    padded[:, :96] = h
    wide = detlogp.linear_logp(padded[:, :96], w, t)
    assert np.array_equal(bits(wide.lse), bits(full.lse))


@pytest.mark.parametrize("ranks", [2, 3])
def test_partials_merge_equals_full(ranks):
    v, real = 2053, 2000
    h, w, t, b, temp = make_problem(17, 64, v, seed=4, bias=True, temp_rows=True, ignore_every=3)
    t = np.where(t >= real, t % real, t)
    full = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=real)
    shard = -(-(-(-v // ranks)) // 64) * 64
    parts = []
    for r in range(ranks):
        lo, hi = r * shard, min(v, (r + 1) * shard)
        parts.append(
            detlogp.linear_logp_partials(h, w[lo:hi], t, bias=b[lo:hi], temperature=temp, vocab_start=lo, real_vocab=real)
        )
    logp, lse = detlogp.merge_partials(parts, t)
    assert np.array_equal(bits(logp), bits(full.logp)) and np.array_equal(bits(lse), bits(full.lse))
    assert sum(int(p.target_owned.sum()) for p in parts) == int((t != -100).sum())


def test_padding_rows_change_nothing():
    h, w, t, _, _ = make_problem(9, 32, 123, seed=5)
    base = detlogp.linear_logp(h, w, t)
    extra = np.concatenate([w, detlogp.to_bf16_bits(np.full((13, 32), 50.0, np.float32))])
    padded = detlogp.linear_logp(h, extra, t, real_vocab=123)
    assert np.array_equal(bits(padded.logp), bits(base.logp)) and np.array_equal(bits(padded.lse), bits(base.lse))


def test_int32_targets_same_bits():
    h, w, t, _, _ = make_problem(8, 32, 17, seed=6)
    a = detlogp.linear_logp(h, w, t)
    b = detlogp.linear_logp(h, w, t.astype(np.int32))
    assert np.array_equal(bits(a.logp), bits(b.logp))


def test_backends_and_provenance():
    ids = {b["id"]: b for b in detlogp.backends()}
    assert ids[CPU]["contract"] and ids[CPU]["available"]
    assert not ids["reference-materialized"]["contract"]
    assert not ids[detlogp.TORCH_BACKEND_ID]["contract"]
    assert ids["cuda-fused-linear-logp-sm90-contract-v1"]["contract"]
    c = detlogp.contract()
    p = detlogp.provenance(backend=CPU)
    assert p["backend_id"] == CPU and not p["fallback"]
    for key in ("contract_name", "contract_version", "vocab_tile", "k_slab", "tree_id", "transcendental_id"):
        assert p["provenance"][key] == c[key]
    assert c["vocab_tile"] == 64 and c["k_slab"] == 32 and c["contract_version"] == 1


def test_noncontract_lane_reports_itself():
    h, w, t, _, _ = make_problem(6, 32, 123, seed=7)
    r = detlogp.linear_logp(h, w, t, backend="reference-materialized")
    assert r.report["backend_id"] == "reference-materialized" and not r.report["contract"]
    assert r.report["provenance"]["contract_version"] == 0
    ref_logp, _ = reference_f64(h, w, t)
    np.testing.assert_allclose(r.logp, ref_logp, rtol=1e-5, atol=1e-5)


def test_strict_refuses_noncontract_lane(monkeypatch):
    h, w, t, _, _ = make_problem(4, 32, 17)
    with pytest.raises(RuntimeError, match="strict mode refuses backend 'reference-materialized'") as e:
        detlogp.linear_logp(h, w, t, backend="reference-materialized", strict=True)
    assert isinstance(e.value, detlogp.StrictModeError)
    monkeypatch.setenv("DETLOGP_STRICT", "1")
    with pytest.raises(detlogp.StrictModeError):
        detlogp.linear_logp(h, w, t, backend="reference-materialized")
    with pytest.raises(detlogp.StrictModeError):
        detlogp.provenance(backend="reference-materialized")
    assert detlogp.linear_logp(h, w, t).report["strict"] is True


def test_error_mapping_targets():
    h, w, t, _, _ = make_problem(5, 32, 123)
    t[3] = 123
    with pytest.raises(IndexError, match=r"targets\[3\]=123 is >= real_vocab=123") as e:
        detlogp.linear_logp(h, w, t)
    assert isinstance(e.value, detlogp.TargetIndexError)
    t[3] = -7
    with pytest.raises(IndexError, match=r"targets\[3\]=-7 is negative"):
        detlogp.linear_logp(h, w, t)
    t[3] = -7
    assert detlogp.linear_logp(h, w, t, ignore_index=-7).logp[3] == 0.0


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda h, w, t: (h, w[:, :16], t), r"weight has D=16 columns but hidden has D=32"),
        (lambda h, w, t: (h.astype(np.float32), w, t), r"hidden must be bf16, got f32"),
        (lambda h, w, t: (h[None], w, t), r"hidden must be 2-D"),
        (lambda h, w, t: (h[:, ::2], w[:, ::2], t), r"hidden must have unit stride"),
        (lambda h, w, t: (h, w, t[:4]), r"targets has 4 elements, expected 5"),
        (lambda h, w, t: (h, w, t.astype(np.float64)), r"targets has dtype float64"),
    ],
)
def test_error_mapping_shapes_dtypes(mutate, match):
    h, w, t, _, _ = make_problem(5, 32, 123)
    with pytest.raises(ValueError, match=match) as e:
        detlogp.linear_logp(*mutate(h, w, t))
    assert isinstance(e.value, detlogp.DetlogpError)


RANGE = (
    r" is outside the temperature range \[1.1754944e-38, 8.507059e\+37\] \(2\^-126 to 2\^126, where T and 1/T are "
    r"finite normal fp32 numbers; docs/contract.md 3.3\)$"
)


def test_error_mapping_values():
    h, w, t, _, _ = make_problem(5, 32, 123)
    with pytest.raises(ValueError, match=r"temperature=0" + RANGE):
        detlogp.linear_logp(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match=r"temperature_rows\[1\]=-1" + RANGE):
        detlogp.linear_logp(h, w, t, temperature=np.array([1, -1, 1, 1, 1], np.float32))
    with pytest.raises(ValueError, match=r"temperature=1e-39" + RANGE):  # subnormal: checked at N = 0 too
        detlogp.linear_logp(h[:0], w, t[:0], temperature=1e-39)
    with pytest.raises(ValueError, match=r"vocab_start=-10 must be >= 0"):
        detlogp.linear_logp_partials(h, w, t % 50, vocab_start=-10, real_vocab=500)
    with pytest.raises(ValueError, match=r"unknown backend 'nope'"):
        detlogp.linear_logp(h, w, t, backend="nope")
    h, w, t, _, _ = make_problem(5, 32, 128)
    with pytest.raises(ValueError, match=r"use linear_logp_partials \+ merge_partials for a vocab shard"):
        detlogp.linear_logp(h, w, t, real_vocab=500)


def test_error_mapping_environment(monkeypatch):
    h, w, t, _, _ = make_problem(2, 32, 17)
    monkeypatch.setenv("DETLOGP_VOCAB_TILE", "128")
    with pytest.raises(RuntimeError, match="DETLOGP_VOCAB_TILE") as e:
        detlogp.linear_logp(h, w, t)
    assert isinstance(e.value, detlogp.ConfigError)


def test_error_class_of_backend_messages():
    """Messages that only a GPU machine produces are classified like the ones tested above."""
    cls = detlogp._ext.error_class
    assert cls("detlogp error at a.cu:1: SM90 backend unavailable: no device") == "BackendError"
    assert cls("detlogp error at a.cu:1: CUDA call failed: cudaMalloc -> x") == "BackendError"
    assert cls("detlogp error at a.cu:1: targets[0]=9 is >= real_vocab=3") == "TargetIndexError"
    assert cls("detlogp error at a.cu:1: hidden base pointer 0x1 is not 16-byte aligned") == "InputError"
    assert cls("detlogp error at r.cpp:1: strict mode forbids fallback: x") == "StrictModeError"
    # A tensor-parallel refusal takes the class of its first failing rank's message.
    refusal = "detlogp error at tp.cpp:1: tensor-parallel linear_logp refused on every rank (nothing was written):"
    assert cls(f"{refusal}\n  rank 1: detlogp error at v.cpp:1: targets[5]=9 is >= real_vocab=3\n  rank 2: x") == (
        "TargetIndexError"
    )
    assert cls(f"{refusal}\n  rank 0: detlogp error at r.cpp:1: strict mode refuses backend 'x'") == "StrictModeError"
    assert cls(f"{refusal}\n  rank 3: detlogp error at v.cpp:1: hidden has D=0 columns") == "InputError"
    assert cls("detlogp error at tp.cpp:1: ranks would be served by different backends (rank 0 and rank 1)") == (
        "BackendError"
    )


def test_bf16_helpers_round_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], np.float32)
    b = detlogp.to_bf16_bits(x)
    # 1 + 2^-8 is a tie -> even (1.0); 1 + 3*2^-8 is a tie -> even (1 + 2^-6)
    assert list(b) == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80]
    assert np.array_equal(detlogp.from_bf16_bits(b), np.array([1.0, 1.0, 1.015625, -2.5, np.inf], np.float32))
    assert np.isnan(detlogp.from_bf16_bits(detlogp.to_bf16_bits(np.array([np.nan], np.float32))))[0]


def test_bf16_rounding_is_the_librarys():
    """to_bf16_bits is fp::bf16_round: every NaN (either sign, quiet or signalling, any payload)
    becomes the canonical 0x7FC0; everything else rounds to nearest even on the bits, overflow to
    inf, subnormals kept. from_bf16_bits is exact."""
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA5A5A5], np.uint32)
    assert list(detlogp.to_bf16_bits(nans.view(np.float32))) == [0x7FC0] * len(nans)
    u = np.random.default_rng(3).integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    edges = [0x7F7FFFFF, 0x7F7F8000, 0x00008000, 0x00018000, 0x80000000, 0xFF800000]  # overflow, ties, -0, -inf
    u = np.concatenate([u, np.array(edges, np.uint32)])
    f = u.view(np.float32)
    u64 = u.astype(np.uint64)
    expect = np.where(np.isnan(f), 0x7FC0, (u64 + 0x7FFF + ((u64 >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(detlogp.to_bf16_bits(f), expect)
    b = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(detlogp.from_bf16_bits(b).view(np.uint32), b.astype(np.uint32) << 16)
    assert detlogp.to_bf16_bits(np.ones((3, 5), np.float64)).shape == (3, 5)


def test_empty_batch():
    w = make_problem(1, 8, 17)[1]
    r = detlogp.linear_logp(np.zeros((0, 8), np.uint16), w, np.zeros(0, np.int64), return_logits=True)
    assert r.logp.shape == (0,) and r.lse.shape == (0,) and r.logits.shape == (0, 17)
    # "auto" serves host arrays with the SM90 backend where one is present (staging), else the CPU.
    assert r.report["contract"] and r.report["backend_id"] in (CPU, "cuda-fused-linear-logp-sm90-contract-v1")


def test_strict_refuses_every_noncontract_lane_of_this_build():
    """Whatever non-contract C++ lanes this build has (reference-materialized, and
    cuda-cublas-materialized where built), strict mode refuses each by name, available or not."""
    h, w, t, _, _ = make_problem(2, 32, 17)
    lanes = [b["id"] for b in detlogp.backends() if not b["contract"] and b["id"] != detlogp.TORCH_BACKEND_ID]
    assert "reference-materialized" in lanes
    for lane in lanes:
        with pytest.raises(detlogp.StrictModeError, match=f"strict mode refuses backend '{lane}'"):
            detlogp.linear_logp(h, w, t, backend=lane, strict=True)


# --- the argument rules shared with detlogp.torch (conftest.py's tables) ------------------------


def np_array(values, dtype):
    return np.array(values, dtype=dtype)


def _entries(h, w, t):
    """Every array-API entry that takes a temperature, as f(temperature=..., ignore_index=...) ->
    its first output."""
    z = detlogp.linear_logp(h, w, t, return_logits=True).logits
    return {
        "linear_logp": lambda **kw: detlogp.linear_logp(h, w, t, **kw).logp,
        "linear_logp_partials": lambda **kw: detlogp.linear_logp_partials(h, w, t, **kw).summaries,
        "reduce_logits": lambda **kw: detlogp.reduce_logits(z, t, **kw)[0],
    }


@pytest.mark.parametrize("entry", ["linear_logp", "linear_logp_partials", "reduce_logits"])
@pytest.mark.parametrize("case", TEMPERATURE_CASES, ids=[c[0] for c in TEMPERATURE_CASES])
def test_temperature_forms(entry, case):
    """Every temperature form is accepted (with the bits of its float32 value given as a float) or
    refused with the shared message, on every entry; nothing reaches the library as something else."""
    _, build, value, message = case
    h, w, t, _, _ = make_problem(5, 32, 123, seed=8)
    call = _entries(h, w, t)[entry]
    if message is None:
        got = call(temperature=build(np_array))
        assert np.array_equal(bits(got), bits(call(temperature=float(np.float32(value)))))
    else:
        with pytest.raises(detlogp.InputError) as e:
            call(temperature=build(np_array))
        assert str(e.value) == message


@pytest.mark.parametrize("name", ["ignore_index", "vocab_start", "real_vocab"])
@pytest.mark.parametrize("case", INTEGER_CASES, ids=[c[0] for c in INTEGER_CASES])
def test_integer_arguments(name, case):
    _, value, message = case
    if name == "real_vocab" and value is None:
        return  # real_vocab=None is its default: the weight's rows
    h, w, t, _, _ = make_problem(5, 32, 123, seed=9)
    t[1] = -100
    if message is None:
        if name == "ignore_index":
            assert np.array_equal(bits(detlogp.linear_logp(h, w, t, ignore_index=value).logp),
                                  bits(detlogp.linear_logp(h, w, t).logp))  # fmt: skip
        return
    entries = _entries(h, w, t)
    for entry in ("linear_logp", "linear_logp_partials") + (("reduce_logits",) if name != "vocab_start" else ()):
        with pytest.raises(detlogp.InputError) as e:
            entries[entry](**{name: value})
        assert str(e.value) == message.format(name=name), entry


def test_refused_arrays_name_the_argument():
    h, w, t, _, _ = make_problem(5, 32, 123)
    cases = [
        (dict(hidden=np.zeros((5, 0), np.uint16), weight=np.zeros((123, 0), np.uint16)),
         "hidden has D=0 columns; the hidden size must be >= 1"),
        (dict(targets=np.array([None] * 5)), "targets has dtype object, which detlogp does not take here"),
        (dict(bias=[0.0] * 123), "bias must be an array (numpy, or anything with __dlpack__), got list"),
        (dict(hidden=None), "hidden must be an array (numpy, or anything with __dlpack__), got None"),
        (dict(hidden=np.zeros((), np.uint16)), "hidden must be 2-D, got ndim=0"),
        (dict(hidden=h[None]), "hidden must be 2-D, got ndim=3"),
        (dict(targets=t[:, None, None]), "targets must be 1-D [N] or 2-D [N, K], got ndim=3"),
        (dict(hidden=np.broadcast_to(h[0], h.shape)),
         "hidden row_stride=0 is smaller than its 32 columns (overlapping rows are not supported)"),
        (dict(hidden=h[::-1]),
         "hidden row_stride=-32 is smaller than its 32 columns (overlapping rows are not supported)"),
        (dict(backend=5), "backend must be a backend id (str) or None, got int 5"),
    ]  # fmt: skip
    for change, message in cases:
        args = dict(hidden=h, weight=w, targets=t)
        args.update(change)
        with pytest.raises(detlogp.InputError) as e:
            detlogp.linear_logp(**args)
        assert str(e.value).endswith(message), (change, str(e.value))


def test_extension_names_the_argument_it_cannot_take():
    """The extension parses its problem tuple itself: what the Python layer would have refused is an
    InputError naming the argument there too, never nanobind's "incompatible function arguments"."""
    h, w, t, _, _ = make_problem(2, 32, 17)
    lp, ls = np.empty(2, np.float32), np.empty(2, np.float32)

    def call(**change):
        fields = dict(hidden=h, weight=w, targets=t, bias=None, temperature=1.0, temperature_rows=None, real_vocab=-1,
                      vocab_start=0, ignore_index=-100)  # fmt: skip
        fields.update(change)
        with pytest.raises(detlogp.InputError) as e:
            detlogp._ext.linear_logp(tuple(fields.values()), lp, ls, None, "", False, 0)
        return str(e.value)

    assert call(ignore_index=2**64) == "ignore_index=18446744073709551616 is outside the int64 range [-2^63, 2^63 - 1]"
    assert call(vocab_start=1.5) == "vocab_start must be an integer, got float 1.5"
    assert call(real_vocab=True) == "real_vocab must be an integer, got bool True"
    assert call(temperature="1") == "temperature must be a float, got str '1'"
    assert call(temperature=1e-50) == "temperature=1e-50 is not representable as float32 (it would round to 0)"
    assert call(temperature=-1e39) == "temperature=-1e+39 is not representable as float32 (it would round to inf)"
    assert call(hidden=[1, 2]).startswith("hidden could not be read as an array in host or CUDA memory")
    assert call(temperature_rows="x").startswith("temperature_rows could not be read as an array")
    with pytest.raises(detlogp.InputError, match="ignore_index=36893488147419103232 is outside the int64 range"):
        detlogp._ext.reduce_logits(np.zeros((2, 17), np.float32), t, 1.0, None, -1, 2**65, lp, ls)


def test_float32_rounding_edges_of_a_scalar_temperature():
    """The extension refuses exactly the doubles that round to 0 or inf in float32 (numpy's
    rounding says which), and passes the others on as their float32 value."""
    h, w, t, _, _ = make_problem(2, 32, 17)
    tiny, big = 2.0**-150, 2.0**128 - 2.0**103
    assert np.float32(tiny) == 0 and np.float32(np.nextafter(tiny, 1)) > 0
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(big)) and np.isfinite(np.float32(np.nextafter(big, 0)))
    for value, to in ((tiny, "0"), (-tiny, "0"), (big, "inf"), (-big, "inf")):
        with pytest.raises(detlogp.InputError) as e:
            detlogp.linear_logp(h, w, t, temperature=value)
        assert str(e.value) == f"temperature={value!r} is not representable as float32 (it would round to {to})"
    # The largest finite value passes the conversion (the library's own range check then decides).
    below = float(np.nextafter(big, 0))
    try:
        detlogp.linear_logp(h, w, t, temperature=below)
    except detlogp.InputError as e:
        assert "not representable as float32" not in str(e)


def test_torch_tensors_through_the_array_api():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    h, w, t, _, _ = make_problem(3, 32, 17)
    th = torch.from_numpy(h.view(np.int16)).view(torch.bfloat16)
    with pytest.raises(
        detlogp.InputError, match=r"^hidden lives on meta; detlogp takes host \(CPU\) and CUDA memory only$"
    ):
        detlogp.linear_logp(th.to("meta"), w, t)
    with pytest.raises(detlogp.InputError, match=r"^hidden requires grad; the array API has no autograd"):
        detlogp.linear_logp(th.float().requires_grad_(), w, t)
    ref = detlogp.linear_logp(h, w, t, temperature=0.5).logp
    assert np.array_equal(bits(detlogp.linear_logp(th, w, t, temperature=torch.tensor(0.5)).logp), bits(ref))


EMULATED = "cpu-sm90-emulated-contract-v1"


def test_sm90_emulated_backend_is_selectable_and_keyed_as_sm90(cli, tmp_path):
    """The SM90 logits on the host (docs/contract.md 3.1.1): listed, contract-bearing, keyed arch
    sm90a / cc 90, the same bytes as the CLI, its statistics the reducer's over its logits, and other
    logits than the CPU backend's fp32 chain."""
    ids = {b["id"]: b for b in detlogp.backends()}
    assert ids[EMULATED]["contract"] and ids[EMULATED]["available"]
    p = detlogp.provenance(backend=EMULATED, strict=True)
    assert p["backend_id"] == EMULATED and not p["fallback"]
    assert p["provenance"]["arch"] == "sm90a" and p["provenance"]["cc"] == 90
    h, w, t, b, temp = make_problem(9, 384, 517, seed=12, bias=True, temp_rows=True, ignore_every=4)
    r = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, return_logits=True, backend=EMULATED)
    assert r.report["backend_id"] == EMULATED
    logp, lse = detlogp.reduce_logits(r.logits, t, temperature=temp)
    assert np.array_equal(bits(logp), bits(r.logp)) and np.array_equal(bits(lse), bits(r.lse))
    cpu = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, return_logits=True, backend=CPU)
    assert np.count_nonzero(bits(cpu.logits) != bits(r.logits)) > 0
    cli_out = cli_serving_run(cli, tmp_path, h, w, t, b, temp, EMULATED)
    for key in ("logp", "lse", "logits"):
        assert np.array_equal(bits(getattr(r, key)), bits(cli_out[key])), key


def test_weight_fingerprint_is_the_documented_hash_and_split_free():
    """docs/validation.md section 3: SHA-256 of the header and the row-major bf16 bytes; rank-ordered
    shards give the whole head's value; one changed bit changes it; non-bf16 and empty input refused."""
    import hashlib

    w = detlogp.to_bf16_bits(np.random.default_rng(3).standard_normal((300, 32), dtype=np.float32))
    expect = hashlib.sha256(b"detlogp-weight-v1 bf16 rows=300 cols=32\n" + w.tobytes()).hexdigest()
    assert detlogp.weight_fingerprint(w) == expect
    assert detlogp.weight_fingerprint([w[:128], w[128:256], w[256:]]) == expect
    padded = np.zeros((300, 40), np.uint16)
    padded[:, :32] = w
    assert detlogp.weight_fingerprint(padded[:, :32]) == expect  # a row stride is not part of the bytes
    w2 = w.copy()
    w2[299, 31] ^= 1
    assert detlogp.weight_fingerprint(w2) != expect
    with pytest.raises(detlogp.InputError, match="shard 0 is not a bf16 matrix"):
        detlogp.weight_fingerprint(np.zeros((2, 2), np.float32))
    with pytest.raises(detlogp.InputError, match="at least one shard"):
        detlogp.weight_fingerprint([])

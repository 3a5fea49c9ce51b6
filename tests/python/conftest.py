"""Shared fixtures of the Python tests: problem generation, the CLI, GPU skips."""

import json
import os
import pathlib
import socket
import struct

import numpy as np
import pytest

import detlogp

ROOT = pathlib.Path(__file__).resolve().parents[2]


def make_problem(n, d, v, seed=0, bias=False, temp_rows=False, ignore_every=0, weight_scale=0.1):
    """hidden/weight as bf16 bit patterns (uint16), targets int64, optional bias/temperatures."""
    rng = np.random.default_rng(seed)
    h = detlogp.to_bf16_bits(rng.standard_normal((n, d), dtype=np.float32))
    w = detlogp.to_bf16_bits(rng.standard_normal((v, d), dtype=np.float32) * np.float32(weight_scale))
    t = rng.integers(0, v, n).astype(np.int64)
    if ignore_every:
        t[ignore_every - 1 :: ignore_every] = -100
    b = (rng.standard_normal(v, dtype=np.float32) * np.float32(0.5)) if bias else None
    temp = (rng.random(n, dtype=np.float32) + np.float32(0.5)) if temp_rows else 1.0
    return h, w, t, b, temp


def reference_f64(h, w, t, b=None, temp=1.0, ignore_index=-100, real_vocab=None):
    """float64 log-softmax of the same bf16 inputs (the accuracy reference, not bitwise)."""
    z = detlogp.from_bf16_bits(h).astype(np.float64) @ detlogp.from_bf16_bits(w).astype(np.float64).T
    if b is not None:
        z = z + b.astype(np.float64)
    y = z / (np.asarray(temp, np.float64)[:, None] if np.ndim(temp) else np.float64(temp))
    if real_vocab is not None:
        y[:, real_vocab:] = -np.inf
    m = y.max(1, keepdims=True)
    lse = (m + np.log(np.exp(y - m).sum(1, keepdims=True)))[:, 0]
    ignored = t == ignore_index
    logp = np.where(ignored, 0.0, y[np.arange(len(t)), np.where(ignored, 0, t)] - lse)
    return logp, lse


def read_safetensors(path):
    raw = pathlib.Path(path).read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    data = raw[8 + hlen :]
    dtypes = {"F32": np.float32, "U8": np.uint8, "I64": np.int64, "I32": np.int32}
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])
    return out


@pytest.fixture(scope="session")
def cli():
    """The detlogp CLI of a built tree: $PYTEST_DETLOGP_CLI, else build/detlogp. (Not a DETLOGP_*
    name: the library refuses unknown DETLOGP_* variables.)"""
    path = os.environ.get("PYTEST_DETLOGP_CLI") or str(ROOT / "build" / "detlogp")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no detlogp CLI at {path} (build the tree or set PYTEST_DETLOGP_CLI)")
    return path


@pytest.fixture(autouse=True)
def _clean_detlogp_env(monkeypatch):
    # Tests set DETLOGP_* themselves; a caller's DETLOGP_STRICT/BACKEND must not leak in.
    for k in list(os.environ):
        if k.startswith("DETLOGP_"):
            monkeypatch.delenv(k)


# --- the argument rules every Python face shares (docs/python.md, "Accepted inputs") ------------
# One table for numpy and torch: each case builds its value with `arr(values, dtype_name)` (the
# face's array constructor) and expects either acceptance (None: the bits of the float32 value
# `same_as`) or an InputError with exactly this message. N = 5 rows.

TEMPERATURE_FORMS = "a float, a 0-d floating array or a float32 array of shape [5]"
TEMPERATURE_CASES = [
    # (id, build(arr), accepted float32 value or None, refusal message or None)
    ("float", lambda arr: 0.7, 0.7, None),
    ("int", lambda arr: 2, 2.0, None),
    ("numpy-float32-scalar", lambda arr: np.float32(0.7), 0.7, None),
    ("numpy-int64-scalar", lambda arr: np.int64(2), 2.0, None),
    ("0d-float32", lambda arr: arr(0.7, "float32"), 0.7, None),
    ("0d-float64", lambda arr: arr(0.7, "float64"), 0.7, None),
    ("0d-float16", lambda arr: arr(0.5, "float16"), 0.5, None),
    ("rows-float32", lambda arr: arr([0.7] * 5, "float32"), 0.7, None),
    ("str", lambda arr: "0.7", None, f"temperature must be {TEMPERATURE_FORMS}, got str '0.7'"),
    ("None", lambda arr: None, None, f"temperature must be {TEMPERATURE_FORMS}, got None"),
    ("bool", lambda arr: True, None, f"temperature must be {TEMPERATURE_FORMS}, got bool True"),
    ("numpy-bool", lambda arr: np.bool_(False), None, f"temperature must be {TEMPERATURE_FORMS}, got bool False"),
    ("list", lambda arr: [0.7] * 5, None, f"temperature must be {TEMPERATURE_FORMS}, got list"),
    ("complex", lambda arr: 1j, None, f"temperature must be {TEMPERATURE_FORMS}, got complex 1j"),
    (
        "0d-int64",
        lambda arr: arr(2, "int64"),
        None,
        f"temperature must be {TEMPERATURE_FORMS}, got shape [] dtype int64",
    ),
    (
        "0d-bool",
        lambda arr: arr(True, "bool"),
        None,
        f"temperature must be {TEMPERATURE_FORMS}, got shape [] dtype bool",
    ),
    (
        "one-for-five-rows",
        lambda arr: arr([0.7], "float32"),
        None,
        f"temperature must be {TEMPERATURE_FORMS}, got shape [1] dtype float32 "
        "(one value per row, no broadcast: pass a float for one temperature of every row)",
    ),
    (
        "2d",
        lambda arr: arr([[0.7]] * 5, "float32"),
        None,
        f"temperature must be {TEMPERATURE_FORMS}, got shape [5, 1] dtype float32",
    ),
    (
        "rows-float64",
        lambda arr: arr([0.7] * 5, "float64"),
        None,
        "temperature of shape [5] must be float32, got float64 (no silent cast)",
    ),
    (
        "rows-int32",
        lambda arr: arr([1] * 5, "int32"),
        None,
        "temperature of shape [5] must be float32, got int32 (no silent cast)",
    ),
    ("underflow", lambda arr: 1e-50, None, "temperature=1e-50 is not representable as float32 (it would round to 0)"),
    ("overflow", lambda arr: 1e39, None, "temperature=1e+39 is not representable as float32 (it would round to inf)"),
    (
        "huge-int",
        lambda arr: 10**400,
        None,
        "temperature=" + "1" + "0" * 36 + "... is not representable as float32 (it would round to inf)",
    ),
]

INTEGER_CASES = [
    # (id, value, refusal message with {name}, or None: accepted as -100)
    ("int", -100, None),
    ("numpy-int64", np.int64(-100), None),
    ("0d-int-array", np.array(-100), None),
    ("2^64", 2**64, "{name}=18446744073709551616 is outside the int64 range [-2^63, 2^63 - 1]"),
    ("2^63", 2**63, "{name}=9223372036854775808 is outside the int64 range [-2^63, 2^63 - 1]"),
    ("-2^63-1", -(2**63) - 1, "{name}=-9223372036854775809 is outside the int64 range [-2^63, 2^63 - 1]"),
    ("float", 1.5, "{name} must be an integer, got float 1.5"),
    ("integral-float", -100.0, "{name} must be an integer, got float -100.0"),
    ("str", "-100", "{name} must be an integer, got str '-100'"),
    ("None", None, "{name} must be an integer, got None"),
    ("bool", True, "{name} must be an integer, got bool True"),
]


def free_port() -> int:
    """A TCP port free on this machine now, for a torchrun rendezvous: a fixed port can still be held
    (TIME_WAIT, another run) and fail the launch."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

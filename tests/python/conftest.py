"""Shared fixtures of the Python tests: problem generation, the CLI, GPU skips."""

import json
import os
import pathlib
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

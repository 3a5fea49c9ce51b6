#!/usr/bin/env python3
"""Derive the polynomial coefficients of the contract transcendentals (docs/contract.md §4).

Run once by hand (needs numpy and mpmath); its output is pinned in
include/detlogp/transcendentals.hpp and checked exhaustively by tests/cpu/test_transcendentals.cpp.
Changing a printed value changes bits: that needs a contract version bump.

expc: e^r on |r| <= ln2/2 as 1 + r + r^2 * q(r), q of degree 4 (c2..c6), fitted in relative error.
logc: log1p(f) = f - f^2/2 + s*(f^2/2 + R(z)), s = f/(2+f), z = s^2, R of degree 4 without constant.
"""
import mpmath as mp
import numpy as np

mp.mp.dps = 60


def to_f32(v):
    return float(np.float32(float(v)))


def chebyshev_nodes(a, b, n):
    return [mp.mpf(a + b) / 2 + mp.mpf(b - a) / 2 * mp.cos(mp.pi * (2 * i + 1) / (2 * n)) for i in range(n)]


def weighted_fit(xs, targets, weights, powers):
    a = np.array([[float(w * x**p) for p in powers] for x, w in zip(xs, weights)])
    b = np.array([float(w * t) for t, w in zip(targets, weights)])
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    return coef


def fit_expc():
    half_ln2 = float(mp.log(2) / 2) * 1.0005
    xs = [x for x in chebyshev_nodes(-half_ln2, half_ln2, 400) if abs(x) > 1e-6]
    # q(r) = (e^r - 1 - r) / r^2; weight by r^2 / e^r so the residual is relative to e^r.
    targets = [(mp.exp(x) - 1 - x) / x**2 for x in xs]
    weights = [x**2 / mp.exp(x) for x in xs]
    coef = weighted_fit(xs, targets, weights, range(5))
    return [to_f32(c) for c in coef]


def fit_logc():
    lo, hi = float(mp.sqrt(mp.mpf(1) / 2) - 1), float(mp.sqrt(2) - 1)
    s_max = max(abs(lo / (2 + lo)), hi / (2 + hi)) * 1.0005
    zs = [z for z in chebyshev_nodes(0, s_max**2, 400) if z > 1e-12]
    targets, weights = [], []
    for z in zs:
        s = mp.sqrt(z)
        f = 2 * s / (1 - s)
        hfsq = f * f / 2
        targets.append((mp.log1p(f) - f + hfsq) / s - hfsq)
        weights.append(s / mp.log1p(f))  # error in R enters the result as s * dR
    coef = weighted_fit(zs, targets, weights, range(1, 5))
    return [to_f32(c) for c in coef]


def hexf(v):
    return float(v).hex()


if __name__ == "__main__":
    for i, c in enumerate(fit_expc()):
        print(f"expc c{i + 2} = {hexf(c)}  ({c!r})")
    for i, c in enumerate(fit_logc()):
        print(f"logc r{i + 1} = {hexf(c)}  ({c!r})")
    ln2 = mp.log(2)
    # ln2 split: hi keeps 16 significant bits so k * hi is exact for |k| < 2^8.
    hi16 = float(mp.nint(ln2 * 2**16) / 2**16)
    print("ln2_hi16 =", hexf(hi16), " ln2_lo16 =", hexf(to_f32(ln2 - hi16)))
    hi24 = to_f32(ln2)
    print("ln2_hi24 =", hexf(hi24), " ln2_lo24 =", hexf(to_f32(ln2 - hi24)))
    print("log2e =", hexf(to_f32(1 / ln2)))

"""The entropy output of the array API (docs/contract.md §10) on the CPU backend: the logp/lse bits
unchanged by asking for it, serving == trainer == reduce_logits of the serving logits, float64
accuracy, row invariance, ignored rows, and the backends that refuse it."""

import numpy as np
import pytest
from conftest import make_problem

import detlogp

CPU = "cpu-linear-logp-contract-v1"


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def entropy_f64(h, w, b, temp):
    z = detlogp.from_bf16_bits(h).astype(np.float64) @ detlogp.from_bf16_bits(w).astype(np.float64).T
    if b is not None:
        z = z + b.astype(np.float64)
    y = z / (np.asarray(temp, np.float64)[:, None] if np.ndim(temp) else np.float64(temp))
    y = y - y.max(1, keepdims=True)
    e = np.exp(y)
    s = e.sum(1)
    return np.log(s) - (e * y).sum(1) / s


@pytest.mark.parametrize("v", [17, 123, 2053])
def test_entropy_beside_unchanged_logp_and_lse(v):
    h, w, t, b, temp = make_problem(21, 48, v, seed=v, bias=True, temp_rows=True, ignore_every=4, weight_scale=0.3)
    plain = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, backend=CPU)
    assert plain.entropy is None
    r = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, backend=CPU, return_entropy=True)
    assert np.array_equal(bits(r.logp), bits(plain.logp)) and np.array_equal(bits(r.lse), bits(plain.lse))
    assert r.entropy.dtype == np.float32 and r.entropy.shape == (21,)
    want = entropy_f64(h, w, b, temp)
    assert np.all(np.abs(r.entropy - want) <= 1e-4 * np.maximum(1.0, want))
    assert np.all(np.isfinite(r.entropy[3::4]))  # ignored rows report it, like lse
    assert r.report["provenance"]["entropy_id"] == detlogp.contract()["entropy_id"] != ""


def test_serving_trainer_and_reduce_logits_give_the_same_entropy_bits():
    h, w, t, b, temp = make_problem(13, 64, 2053, seed=5, bias=True, weight_scale=0.3)
    trainer = detlogp.linear_logp(h, w, t, bias=b, temperature=0.8, backend=CPU, return_entropy=True)
    serving = detlogp.linear_logp(h, w, t, bias=b, temperature=0.8, backend=CPU, return_entropy=True,
                                  return_logits=True)  # fmt: skip
    assert np.array_equal(bits(trainer.entropy), bits(serving.entropy))
    logp, lse, entropy = detlogp.reduce_logits(serving.logits, t, temperature=0.8, return_entropy=True)
    assert np.array_equal(bits(entropy), bits(trainer.entropy))
    assert np.array_equal(bits(logp), bits(trainer.logp)) and np.array_equal(bits(lse), bits(trainer.lse))
    assert len(detlogp.reduce_logits(serving.logits, t, temperature=0.8)) == 2


def test_a_rows_entropy_does_not_depend_on_the_batch():
    h, w, t, _, _ = make_problem(17, 32, 123, seed=9, weight_scale=0.5)
    full = detlogp.linear_logp(h, w, t, backend=CPU, return_entropy=True).entropy
    picks = [16, 3, 3, 0]
    sub = detlogp.linear_logp(h[picks], w, t[picks], backend=CPU, return_entropy=True).entropy
    assert np.array_equal(bits(sub), bits(full[picks]))


def test_backends_without_it_refuse_it():
    h, w, t, _, _ = make_problem(4, 16, 17)
    with pytest.raises(detlogp.DetlogpError, match="entropy"):
        detlogp.linear_logp(h, w, t, backend="reference-materialized", return_entropy=True)
    assert detlogp.linear_logp(h, w, t, backend="reference-materialized").report["provenance"]["entropy_id"] == ""

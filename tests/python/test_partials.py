"""detlogp.linear_logp_partials + detlogp.merge_partials (numpy, CPU backend): the partials carry
their layout, and the merge refuses (through the C++ checks, in their words, writing nothing)
shards out of rank order, gaps, overlaps, other targets, another ignore_index, real_vocab,
temperature or backend; a valid merge gives the whole-vocabulary bits, at 64-aligned boundaries and
at any other (the partials then carry their edge lanes)."""

import re

import numpy as np
import pytest
from conftest import INTEGER_CASES, make_problem

import detlogp

CPU = "cpu-linear-logp-contract-v1"
V, REAL = 2112, 2053


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture
def problem():
    h, w, t, b, temp = make_problem(23, 64, V, seed=11, bias=True, temp_rows=True, ignore_every=4)
    t = np.where(t >= REAL, t % REAL, t)
    return h, w, t, b, temp


def shard(problem, lo, hi, targets=None, temperature=None, real_vocab=REAL, ignore_index=-100):
    h, w, t, b, temp = problem
    return detlogp.linear_logp_partials(
        h, w[lo:hi], t if targets is None else targets, bias=b[lo:hi], temperature=temp if temperature is None else temperature,
        ignore_index=ignore_index, vocab_start=lo, real_vocab=real_vocab, backend=CPU,
    )  # fmt: skip


def shards(problem, bounds):
    return [shard(problem, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def refused(parts, targets, match, ignore_index=-100, cls=detlogp.InputError):
    with pytest.raises(cls, match=re.escape(match)) as e:
        detlogp.merge_partials(parts, targets, ignore_index=ignore_index)
    assert isinstance(e.value, detlogp.DetlogpError)
    return str(e.value)


def test_valid_merge_gives_the_whole_vocabulary_bits(problem):
    h, w, t, b, temp = problem
    full = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=REAL, backend=CPU)
    for bounds in ([0, V], [0, 1024, V], [0, 64, 128, 1984, V]):
        logp, lse = detlogp.merge_partials(shards(problem, bounds), t)
        assert np.array_equal(bits(logp), bits(full.logp)) and np.array_equal(bits(lse), bits(full.lse)), bounds
    # The same target values as int32: the same digest, the same bits.
    logp, _ = detlogp.merge_partials(shards(problem, [0, 1024, V]), t.astype(np.int32))
    assert np.array_equal(bits(logp), bits(full.logp))


def test_partials_carry_their_layout(problem):
    parts = shards(problem, [0, 1024, V])
    for p, (lo, hi) in zip(parts, [(0, 1024), (1024, V)]):
        assert isinstance(p.layout, detlogp.PartialsLayout)
        assert (p.layout.vocab_start, p.layout.vocab_local, p.layout.real_vocab, p.layout.ignore_index) == (
            lo, hi - lo, REAL, -100)  # fmt: skip
    a, b = (p.layout for p in parts)
    assert (a.targets_digest, a.temperature_digest, a.backend_digest) == (b.targets_digest, b.temperature_digest,
                                                                          b.backend_digest)  # fmt: skip
    other = problem[2].copy()
    other[0] = (other[0] + 1) % REAL
    assert shard(problem, 0, 1024, targets=other).layout.targets_digest != a.targets_digest


def test_shards_out_of_rank_order_are_refused(problem):
    parts = shards(problem, [0, 1024, V])
    refused(parts[::-1], problem[2], "rank 1 shard starts at vocab_start=0, before rank 0's vocab_start=1024")


def test_gap_and_overlap_are_refused_naming_the_ids(problem):
    # Every target in [0, 64): each still has one owner, only the layout shows the missing or
    # doubled tiles.
    t = problem[2]
    low = np.where(t == -100, t, t % 64)
    p = problem[:2] + (low,) + problem[3:]
    gap = [shard(p, 0, 128), shard(p, 1024, V)]
    refused(gap, low, "vocab ids [128, 1024) are owned by no rank")
    overlap = [shard(p, 0, 1088), shard(p, 1024, V)]
    refused(overlap, low, "vocab ids [1024, 1088) are owned by two ranks")
    refused([shard(p, 0, 128), shard(p, 128, 1024)], low, "the shards cover vocab ids [0, 1024) but real_vocab=2053")


def test_other_targets_or_ignore_index_are_refused(problem):
    parts = shards(problem, [0, 1024, V])
    other = problem[2].copy()
    other[5] = (other[5] + 1) % REAL
    msg = refused(parts, other, "targets differ from those the partials were computed with")
    assert "pass merge_partials the targets given to linear_logp_partials" in msg
    refused(parts, problem[2], "ignore_index=-1 differs from ignore_index=-100 the partials were computed with",
            ignore_index=-1)  # fmt: skip


def test_partials_that_disagree_are_refused(problem):
    t = problem[2]
    refused([shard(problem, 0, 1024), shard(problem, 1024, V, real_vocab=2100)], t,
            "ranks disagree on real_vocab: rank 0 has 2053, rank 1 has 2100")  # fmt: skip
    hotter = problem[4].copy()
    hotter[0] *= 2
    refused([shard(problem, 0, 1024), shard(problem, 1024, V, temperature=hotter)], t,
            "ranks disagree on temperatures (rank 0 and rank 1 digest them differently)")  # fmt: skip
    parts = shards(problem, [0, 1024, V])
    forged = parts[1]._replace(layout=parts[1].layout._replace(backend_digest=parts[1].layout.backend_digest ^ 1))
    refused([parts[0], forged], t, "ranks are served by different backends or contracts (rank 0 and rank 1)",
            cls=detlogp.BackendError)  # fmt: skip


def test_partials_without_a_layout_are_refused(problem):
    parts = shards(problem, [0, 1024, V])
    bare = parts[0]._replace(layout=None)
    refused([bare, parts[1]], problem[2], "rank 0 partials carry no layout (layout.vocab_local=0)")
    short = parts[0]._replace(layout=parts[0].layout._replace(vocab_local=960))
    refused([short, parts[1]], problem[2],
            "rank 0 partials have tiles=16 but their layout's shard [0, 960) has 15 whole tiles")  # fmt: skip


@pytest.mark.parametrize("case", INTEGER_CASES, ids=[c[0] for c in INTEGER_CASES])
def test_merge_takes_ignore_index_by_the_shared_rules(problem, case):
    """merge_partials parses ignore_index as every other entry does (conftest.py's table): an
    integral float or a string is refused, not truncated or parsed, and a value beyond int64 is an
    InputError naming it, not nanobind's TypeError."""
    _, value, message = case
    parts = shards(problem, [0, 1024, V])
    if message is None:
        logp, lse = detlogp.merge_partials(parts, problem[2], ignore_index=value)
        ref_logp, ref_lse = detlogp.merge_partials(parts, problem[2])
        assert np.array_equal(bits(logp), bits(ref_logp)) and np.array_equal(bits(lse), bits(ref_lse))
        return
    with pytest.raises(detlogp.InputError) as e:
        detlogp.merge_partials(parts, problem[2], ignore_index=value)
    assert str(e.value) == message.format(name="ignore_index")


def test_merge_takes_targets_by_the_shared_rules(problem):
    """merge_partials' targets are an array argument like every entry's: refused naming it, in the
    words of linear_logp, never a raw IndexError or TypeError."""
    parts = shards(problem, [0, 1024, V])
    cases = [
        (list(problem[2]), "targets must be an array (numpy, or anything with __dlpack__), got list"),
        (None, "targets must be an array (numpy, or anything with __dlpack__), got None"),
        (np.array(3), "targets must be 1-D [N] or 2-D [N, K], got ndim=0"),
        (problem[2][:, None, None], "targets must be 1-D [N] or 2-D [N, K], got ndim=3"),
        (np.repeat(problem[2][:, None], 2, axis=1),
         f"targets must be [N={len(problem[2])}, K=1] i32 or i64, contiguous (the partials' K)"),
        (problem[2].astype(np.float64), "targets has dtype float64, which detlogp does not take here"),
    ]
    for targets, message in cases:
        with pytest.raises(detlogp.InputError) as e:
            detlogp.merge_partials(parts, targets)
        assert str(e.value).endswith(message), (message, str(e.value))


def entropy_shards(problem, bounds):
    h, w, t, b, temp = problem
    return [
        detlogp.linear_logp_partials(h, w[lo:hi], t, bias=b[lo:hi], temperature=temp, vocab_start=lo, real_vocab=REAL,
                                     backend=CPU, return_entropy=True)
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]  # fmt: skip


def test_merge_with_entropy_gives_the_whole_vocabulary_bits(problem):
    """The tiles' entropy sums travel with the partials; the merge's entropy is linear_logp's at
    TP = 1, and logp/lse keep their bits (docs/contract.md §10)."""
    h, w, t, b, temp = problem
    full = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=REAL, backend=CPU, return_entropy=True)
    for bounds in ([0, V], [0, 1024, V], [0, 64, 128, 1984, V], [0, 2048, V]):
        parts = entropy_shards(problem, bounds)
        for p, plain, (lo, hi) in zip(parts, shards(problem, bounds), zip(bounds[:-1], bounds[1:])):
            assert p.usums.shape == (len(t), detlogp.shard_tiles(hi - lo)) and p.usums.dtype == np.float32
            assert np.array_equal(bits(p.summaries), bits(plain.summaries)), bounds
        logp, lse, entropy = detlogp.merge_partials(parts, t, return_entropy=True)
        assert np.array_equal(bits(logp), bits(full.logp)) and np.array_equal(bits(lse), bits(full.lse)), bounds
        assert np.array_equal(bits(entropy), bits(full.entropy)), bounds
        # Without return_entropy the same partials merge to (logp, lse), the usums unread.
        logp2, lse2 = detlogp.merge_partials(parts, t)
        assert np.array_equal(bits(logp2), bits(full.logp)) and np.array_equal(bits(lse2), bits(full.lse))
    assert shards(problem, [0, V])[0].usums is None


def test_merge_with_entropy_needs_every_ranks_usums(problem):
    t = problem[2]
    with_usums = entropy_shards(problem, [0, 1024, V])
    without = shards(problem, [0, 1024, V])
    for parts, rank in (([with_usums[0], without[1]], 1), ([without[0], with_usums[1]], 0), (without, 0)):
        with pytest.raises(detlogp.InputError, match=re.escape(f"rank {rank} partials carry none (usums is null)")):
            detlogp.merge_partials(parts, t, return_entropy=True)
    short = with_usums[0]._replace(usums=with_usums[0].usums[:, :3].copy())
    with pytest.raises(detlogp.InputError, match=re.escape(f"rank 0 usums must be [N={len(t)}, tiles=16] float32")):
        detlogp.merge_partials([short, with_usums[1]], t, return_entropy=True)


def test_shards_at_any_boundary_merge_to_the_whole_vocabulary_bits(problem):
    """Engines split the vocabulary as V / TP, off the 64-lane tile grid: the partials then carry the
    scaled logits of their edge lanes, and the merge assembles the straddling tiles (docs/contract.md
    §7): logp, lse and entropy keep the TP = 1 bits. A shard narrower than a tile, one lane, and one
    of padding only included."""
    h, w, t, b, temp = problem
    full = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=REAL, backend=CPU, return_entropy=True)
    for bounds in ([0, 704, 1408, V], [0, 1000, 1001, 1030, 2050, V], [0, 37, 2052, 2060, V], [0, 1056, V]):
        parts = entropy_shards(problem, bounds)
        for p, (lo, hi) in zip(parts, zip(bounds[:-1], bounds[1:])):
            g = detlogp.shard_geometry(lo, hi - lo, REAL)
            assert p.summaries.shape == (len(t), g.tiles, 2) and p.edge_logits.shape == (len(t), g.edge_lanes)
        logp, lse, entropy = detlogp.merge_partials(parts, t, return_entropy=True)
        assert np.array_equal(bits(logp), bits(full.logp)) and np.array_equal(bits(lse), bits(full.lse)), bounds
        assert np.array_equal(bits(entropy), bits(full.entropy)), bounds
    # The edge lanes are the whole call's scaled logits of those ids.
    served = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=REAL, backend=CPU, return_logits=True)
    p = shard(problem, 1000, 1030)
    assert detlogp.shard_geometry(1000, 30, REAL) == (16, 0, 24, 24, 0, 6)
    y = (served.logits * (np.float32(1) / temp)[:, None]).astype(np.float32)
    assert np.array_equal(bits(p.edge_logits), bits(np.concatenate([y[:, 1000:1024], y[:, 1024:1030]], axis=1)))
    assert shards(problem, [0, 1024, V])[0].edge_logits.shape == (len(t), 0)  # aligned: none


def test_edge_lanes_that_do_not_fit_the_shard_are_refused(problem):
    t = problem[2]
    parts = shards(problem, [0, 1000, V])
    cut = parts[0]._replace(edge_logits=parts[0].edge_logits[:, :5].copy())
    refused([cut, parts[1]], t, "rank 0 partials have edge_lanes=5 but their layout's shard [0, 1000) has 40 edge lanes")
    refused([parts[0]._replace(edge_logits=None), parts[1]], t, "rank 0 partials have edge_lanes=0")
    with pytest.raises(detlogp.InputError, match=re.escape("vocab_local=0 must be >= 1")):
        detlogp.shard_geometry(0, 0, 10)


def test_several_ids_a_row_give_each_single_target_bits(problem):
    """targets [N, K]: logp [N, K] from one pass, entry k the bits of the call with targets[:, k];
    ignore_index per entry; through linear_logp, reduce_logits and the partials' merge (shards on
    and off the tile grid)."""
    h, w, t, b, temp = problem
    rng = np.random.default_rng(5)
    k = 6
    ids = rng.integers(0, REAL, size=(len(t), k)).astype(np.int64)
    ids[:, 0] = np.where(t == -100, 7, t)
    ids[::3, 2] = -100
    ids[:, 3] = REAL - 1
    full = detlogp.linear_logp(h, w, ids, bias=b, temperature=temp, real_vocab=REAL, backend=CPU, return_entropy=True)
    assert full.logp.shape == (len(t), k)
    for j in range(k):
        one = detlogp.linear_logp(h, w, ids[:, j].copy(), bias=b, temperature=temp, real_vocab=REAL, backend=CPU,
                                  return_entropy=True)  # fmt: skip
        assert np.array_equal(bits(full.logp[:, j].copy()), bits(one.logp)), j
        assert np.array_equal(bits(full.lse), bits(one.lse)) and np.array_equal(bits(full.entropy), bits(one.entropy))
    assert np.all(full.logp[::3, 2] == 0)
    served = detlogp.linear_logp(h, w, ids, bias=b, temperature=temp, real_vocab=REAL, backend=CPU, return_logits=True)
    logp, lse = detlogp.reduce_logits(served.logits, ids, temperature=temp, real_vocab=REAL)
    assert np.array_equal(bits(logp), bits(full.logp)) and np.array_equal(bits(lse), bits(full.lse))
    for bounds in ([0, 1024, V], [0, 700, 1401, V]):
        parts = [
            detlogp.linear_logp_partials(h, w[lo:hi], ids, bias=b[lo:hi], temperature=temp, vocab_start=lo,
                                         real_vocab=REAL, backend=CPU)
            for lo, hi in zip(bounds[:-1], bounds[1:])
        ]  # fmt: skip
        assert parts[0].target_logit.shape == (len(t), k) and parts[0].target_owned.shape == (len(t), k)
        logp, lse = detlogp.merge_partials(parts, ids)
        assert np.array_equal(bits(logp), bits(full.logp)) and np.array_equal(bits(lse), bits(full.lse)), bounds
    bad = ids.copy()
    bad[4, 5] = REAL
    with pytest.raises(detlogp.TargetIndexError, match=re.escape(f"targets[4, 5]={REAL} is >= real_vocab={REAL}")):
        detlogp.linear_logp(h, w, bad, bias=b, temperature=temp, real_vocab=REAL, backend=CPU)


def test_topk_is_the_full_sort_and_merges_across_shards(problem):
    """topk=K: the K real ids of the largest scaled logits (ties to the lower id) and their
    single-target logp bits, the same through the shards' merge, on and off the tile grid
    (docs/contract.md §11)."""
    h, w, t, b, temp = problem
    k = 20
    full = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=REAL, backend=CPU, topk=k)
    served = detlogp.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=REAL, backend=CPU, return_logits=True)
    y = (served.logits[:, :REAL] * (np.float32(1) / temp)[:, None]).astype(np.float32)
    want = np.argsort(-y, axis=1, kind="stable")[:, :k]
    assert np.array_equal(full.topk_ids, want)
    single = detlogp.linear_logp(h, w, want.copy(), bias=b, temperature=temp, real_vocab=REAL, backend=CPU)
    assert np.array_equal(bits(full.topk_logp), bits(single.logp))
    for bounds in ([0, 1024, V], [0, 700, 1401, V]):
        parts = [
            detlogp.linear_logp_partials(h, w[lo:hi], t, bias=b[lo:hi], temperature=temp, vocab_start=lo,
                                         real_vocab=REAL, backend=CPU, topk=k)
            for lo, hi in zip(bounds[:-1], bounds[1:])
        ]  # fmt: skip
        logp, lse, ids, topk_logp = detlogp.merge_partials(parts, t, return_topk=True)
        assert np.array_equal(ids, full.topk_ids) and np.array_equal(bits(topk_logp), bits(full.topk_logp)), bounds
        assert np.array_equal(bits(logp), bits(full.logp)), bounds
    with pytest.raises(detlogp.InputError, match=re.escape("topk=129 must be in [1, 128] (kMaxTopk")):
        detlogp.linear_logp(h, w, t, bias=b, temperature=temp, real_vocab=REAL, backend=CPU, topk=129)
    with pytest.raises(detlogp.InputError, match=re.escape("the top-k output needs every rank's top-k lists")):
        detlogp.merge_partials(shards(problem, [0, 1024, V]), t, return_topk=True)

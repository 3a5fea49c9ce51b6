"""A CPU model of the SM90 row kernels' listing pass (list_largest in src/sm90/device/block_select.cuh)
with the selection after it (sort_listed, the certainty test, the gather), checked against a full
sort of the row's keys, and a count of the warp insertions each way of setting the floor costs.

A thread lists its 8 largest keys in registers; offering a lane costs its warp the 64-bit insertion
whenever one thread of the warp inserts, so the count that matters is of (warp, round, lane place)
events with at least one insertion (for `masked`, the insertion loop's turns). The ways of setting the
floor below which no lane is offered, and of offering:
  before:  the first round offered whole, then the k-th of the threads' maxima over that round;
  first:   the floor from the first round's maxima before that round is offered;
  raised:  as `first`, then raised after rounds 2, 4, 8, 16 from the threads' largest listed keys,
           as the k-th of the keys' upper 32 bits;
  masked:  as `raised`, each round's lanes at or above the bar (the floor and the thread's last
           listed key) when the round is read gathered in a mask and offered by one insertion loop
           (pending/0003): a warp runs it as often as its busiest thread has lanes there.

    python3 bench/experiments/listing_model.py [--lanes 151936] [--k 1,20,50,128,256]

Needs numpy. Rows: Gaussian, peaked, tied (7 values), clustered (the top lanes in three threads),
signed zeros, -inf with three finite lanes, and a few NaN lanes.
"""

import argparse

import numpy as np

THREADS = 256
LISTED = 8
VECTORS = 8
ROUND = 4 * VECTORS * THREADS  # one round of float4 loads


def rank_ord(y):
    """rank_ord of detlogp/rank.hpp (order-preserving image of y, -0 and +0 one value)."""
    y = np.where(y == 0, np.float32(0), y).astype(np.float32)
    b = y.view(np.uint32).astype(np.uint64)
    return np.where(b & 0x80000000, (~b) & 0xFFFFFFFF, b | 0x80000000)


def row_keys(y):
    ids = np.arange(len(y), dtype=np.uint64)
    return (rank_ord(y) << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - ids)


def key_logit(key):
    o = np.uint32(int(key) >> 32)
    b = (o & 0x7FFFFFFF) if (o & 0x80000000) else (~o) & 0xFFFFFFFF
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def visit_order(lanes, first_round_partial):
    """Each thread's lanes in the kernel's visiting order, with (round, place in the round)."""
    lanes_of = [[] for _ in range(THREADS)]
    place_of = [[] for _ in range(THREADS)]
    if first_round_partial and lanes < ROUND:
        for t in range(THREADS):
            for i in range(VECTORS):
                for c in range(4):
                    v = 4 * (i * THREADS + t) + c
                    if v < lanes:
                        lanes_of[t].append(v)
                        place_of[t].append((0, 4 * i + c))
        return lanes_of, place_of
    v0 = r = 0
    while v0 + ROUND <= lanes:
        for t in range(THREADS):
            for i in range(VECTORS):
                for c in range(4):
                    lanes_of[t].append(v0 + 4 * (i * THREADS + t) + c)
                    place_of[t].append((r, 4 * i + c))
        v0 += ROUND
        r += 1
    scalars = 16 * THREADS
    while v0 + scalars <= lanes:
        for t in range(THREADS):
            for i in range(16):
                lanes_of[t].append(v0 + i * THREADS + t)
                place_of[t].append((r, i))
        v0 += scalars
        r += 1
    for t in range(THREADS):
        for v in range(v0 + t, lanes, THREADS):
            lanes_of[t].append(v)
            place_of[t].append((r, 100 + (v - v0 - t) // THREADS))
    return lanes_of, place_of


class Listed:
    def __init__(self):
        self.key = [0] * LISTED
        self.last_y = np.float32("nan")

    def offer(self, y, key):
        if y < self.last_y or key <= self.key[-1]:
            return False
        self.key[-1] = key
        self.key.sort(reverse=True)
        self.last_y = key_logit(self.key[-1])
        return True


def max_nan_free(a, b):
    """fmaxf: the larger, the other where one is NaN."""
    if np.isnan(a):
        return b
    if np.isnan(b):
        return a
    return max(a, b)


def kth_nonzero(values, k):
    nonzero = sorted([v for v in values if v != 0], reverse=True)
    return nonzero[k - 1] if len(nonzero) >= k else 0


def kth_upper_bits_floor(keys, k):
    return key_logit(sorted([int(x) >> 32 for x in keys], reverse=True)[k - 1] << 32)


def run(y, k, way):
    """(same top k as a full sort, the certainty test's verdict, warp insertion events)."""
    lanes = len(y)
    keys = row_keys(y)
    lanes_of, place_of = visit_order(lanes, way in ("raised", "masked"))
    lists = [Listed() for _ in range(THREADS)]
    events = set()
    passing = {}  # (warp, round) -> {thread: lanes at or above its bar when the round was read}

    def offer(t, v, place, floor):
        if floor is not None and y[v] < floor:
            return
        if lists[t].offer(y[v], int(keys[v])):
            events.add((t // 32,) + place)

    by_round = {}
    for t in range(THREADS):
        for v, p in zip(lanes_of[t], place_of[t]):
            by_round.setdefault(p[0], []).append((t, v, p))
    rounds = max(by_round) + 1 if by_round else 0
    if way in ("first", "raised", "masked") and 1 <= k <= THREADS and lanes > (ROUND if way == "first" else THREADS):
        reps = []
        for t in range(THREADS):
            first = [v for v, p in zip(lanes_of[t], place_of[t]) if p[0] == 0]
            if not first:
                reps.append(0)
                continue
            best = first[0]
            for v in first[1:]:
                if y[v] > y[best]:
                    best = v
            reps.append(int(keys[best]))
        floor = kth_upper_bits_floor(reps, k)
        for r in range(rounds):
            if way in ("raised", "masked") and r >= 2 and (r & (r - 1)) == 0:
                floor = kth_upper_bits_floor([lst.key[0] for lst in lists], k)
            bars = [max_nan_free(floor, lst.last_y) for lst in lists]
            for t, v, p in by_round[r]:
                if not y[v] < bars[t]:
                    key = (t // 32, r)
                    passing.setdefault(key, {}).setdefault(t, 0)
                    passing[key][t] += 1
            for t, v, p in by_round[r]:
                offer(t, v, p, floor)
    else:
        for t, v, p in by_round.get(0, []):
            offer(t, v, p, None)
        floor = key_logit(kth_nonzero([lst.key[0] for lst in lists], k)) if 1 <= k <= THREADS else np.float32("nan")
        for r in range(1, rounds):
            for t, v, p in by_round[r]:
                offer(t, v, p, floor)
    # sort_listed's bound, the listed k-th, the certainty test, else the gather of the lanes above it.
    bound = max(kth_nonzero([lst.key[0] for lst in lists], k) if k <= THREADS else 0, 1)
    listed = sorted([x for lst in lists for x in lst.key if x >= bound], reverse=True)
    kth_listed = listed[k - 1] if len(listed) >= k else 0
    uncertain = any(lst.key[-1] != 0 and lst.key[-1] >= kth_listed for lst in lists)
    if kth_listed == 0:
        got = None
    elif not uncertain:
        got = listed[:k]
    else:
        got = sorted([int(x) for x in keys if int(x) >= kth_listed], reverse=True)[:k]
    want = sorted([int(x) for x in keys], reverse=True)[:k]
    masked = sum(max(per_thread.values()) for per_thread in passing.values())
    return got == want, uncertain, masked if way == "masked" else len(events)


def make_row(kind, rng, lanes):
    if kind == "gaussian":
        y = rng.normal(0, 1.5, lanes)
    elif kind == "peaked":
        y = rng.normal(0, 1.5, lanes)
        y[rng.integers(lanes)] = 30
    elif kind == "tied":
        y = (np.arange(lanes) % 7 - 3).astype(float)
    elif kind == "clustered":
        y = rng.normal(0, 1, lanes)
        for t in range(3):
            for i in range(40):
                v = 4 * t + ROUND * (i % 18) + i // 18
                if v < lanes:
                    y[v] = 20 + 0.1 * i + t
    elif kind == "zeros":
        y = np.zeros(lanes)
        y[::2] = -0.0
    elif kind == "neginf":
        y = np.full(lanes, -np.inf)
        y[rng.integers(lanes, size=3)] = 1
    else:
        y = rng.normal(0, 1, lanes)
        y[rng.integers(lanes, size=5)] = np.nan
    return y.astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lanes", type=int, default=151936)
    ap.add_argument("--k", default="1,20,50,128,256")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    wrong = 0
    print(f"lanes = {args.lanes}: warp insertion events a row (and whether the top k equals a full sort's)")
    print(f"{'row':10s} {'k':>4s} {'before':>12s} {'first':>12s} {'raised':>12s} {'masked':>12s}")
    for kind in ["gaussian", "peaked", "tied", "clustered", "zeros", "neginf", "nan"]:
        for k in [int(x) for x in args.k.split(",")]:
            y = make_row(kind, rng, args.lanes)
            cells = []
            for way in ("before", "first", "raised", "masked"):
                ok, _, events = run(y, k, way)
                wrong += 0 if ok else 1
                cells.append(f"{events:7d} {'ok' if ok else 'WRONG'}")
            print(f"{kind:10s} {k:4d} " + " ".join(f"{c:>12s}" for c in cells))
    print("every top k equals a full sort's" if wrong == 0 else f"{wrong} WRONG")
    raise SystemExit(1 if wrong else 0)


if __name__ == "__main__":
    main()

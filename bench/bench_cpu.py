"""The CPU backend's trainer entry against numpy's and torch's fp32 matmul + logsumexp, on the same
data in the same run (docs/perf.md, "CPU backend").

    PYTHONPATH=build/pysite python3 bench/bench_cpu.py [--shape 64,1024,32000 ...] [--reps 15]
                                                       [--csv out.csv]

Methods, each computing logp[n] = z[n, t_n] - logsumexp(z[n]) with z = h W^T:
- detlogp: detlogp.linear_logp on the CPU contract backend (cpu-linear-logp-contract-v1, strict),
  from bf16 h and W, as a user calls it;
- numpy: fp32 h @ W.T (numpy's BLAS), then max, exp, sum, log and the target pick in numpy;
- torch: fp32 torch.matmul, then torch.logsumexp and gather.
The references get their fp32 copies of h and W made before timing (W once, outside the loop),
which is the most favourable setup for them; detlogp widens bf16 to fp32 inside the call.

Timing: wall clock (time.perf_counter) of one call; every method runs once per repetition, in a
fresh shuffled order (fixed seed), after --warmup calls each, and its figure is the median over
--reps repetitions. GFLOP/s counts 2 N D V. The ratios divide detlogp's throughput by each
reference's, from the medians of the same run. Every library runs with its default thread count
(printed). The 1-minute load average is printed before and after: on a shared machine other jobs
take cores, and interleaving is what keeps the ratios comparable; run it several times and take
the median of the ratios.

run(shapes, reps, warmup, seed) returns the rows (dicts) that the CLI prints and writes, so another
benchmark can call it.
"""

import argparse
import csv
import os
import platform
import random
import statistics
import sys
import time

import numpy as np

import detlogp

CPU_BACKEND = "cpu-linear-logp-contract-v1"
DEFAULT_SHAPES = [(64, 1024, 32000)]


def _data(n, d, v, seed):
    """RMS-normalized hidden rows and an N(0, 0.02) head, bf16; targets uniform in [0, V)."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, d), dtype=np.float32)
    h /= np.sqrt((h * h).mean(axis=1, keepdims=True))
    w = 0.02 * rng.standard_normal((v, d), dtype=np.float32)
    t = rng.integers(0, v, n, dtype=np.int64)
    h_bits, w_bits = detlogp.to_bf16_bits(h), detlogp.to_bf16_bits(w)
    return h_bits, w_bits, t


def _methods(h_bits, w_bits, t):
    h32 = detlogp.from_bf16_bits(h_bits)
    w32 = detlogp.from_bf16_bits(w_bits)
    rows = np.arange(len(t))

    def detlogp_cpu():
        return detlogp.linear_logp(h_bits, w_bits, t, backend=CPU_BACKEND, strict=True).logp

    def numpy_fp32():
        z = h32 @ w32.T
        m = z.max(axis=1)
        lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
        return z[rows, t] - lse

    methods = {"detlogp": detlogp_cpu, "numpy": numpy_fp32}
    try:
        import torch
    except ImportError as e:  # the benchmark still runs, and says what it skipped
        print(f"torch: skipped ({e})")
        return methods, None
    th, tw, tt = torch.from_numpy(h32), torch.from_numpy(w32), torch.from_numpy(t)

    def torch_fp32():
        with torch.no_grad():
            z = torch.matmul(th, tw.T)
            return z.gather(1, tt[:, None])[:, 0] - torch.logsumexp(z, dim=1)

    methods["torch"] = torch_fp32
    return methods, torch


def run(shapes=DEFAULT_SHAPES, reps=15, warmup=2, seed=0, log=print):
    """Times every method at each (N, D, V); returns one row per (shape, method)."""
    out = []
    for n, d, v in shapes:
        h_bits, w_bits, t = _data(n, d, v, seed)
        methods, torch = _methods(h_bits, w_bits, t)
        # The same logprobs, so that no method is timed doing something else.
        got = {name: np.asarray(f()) for name, f in methods.items()}
        for name, logp in got.items():
            err = float(np.abs(logp.astype(np.float64) - got["detlogp"]).max())
            if err > 1e-3:
                raise RuntimeError(f"{name} differs from detlogp by {err} at N={n} D={d} V={v}")
        for f in methods.values():
            for _ in range(warmup):
                f()
        times = {name: [] for name in methods}
        order = list(methods)
        shuffle = random.Random(seed)
        load_before = os.getloadavg()[0]
        for _ in range(reps):
            shuffle.shuffle(order)
            for name in order:
                start = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - start)
        load_after = os.getloadavg()[0]
        flop = 2.0 * n * d * v
        med = {name: statistics.median(ts) for name, ts in times.items()}
        gflops = {name: flop / med[name] / 1e9 for name in methods}
        log(f"N={n} D={d} V={v}, {reps} reps, load average {load_before:.1f} -> {load_after:.1f}")
        for name in methods:
            ratio = {f"detlogp_over_{ref}": gflops["detlogp"] / gflops[ref] for ref in methods if ref != "detlogp"}
            row = {
                "n": n,
                "d": d,
                "v": v,
                "method": name,
                "median_ms": med[name] * 1e3,
                "min_ms": min(times[name]) * 1e3,
                "gflops": gflops[name],
                "reps": reps,
                "load_before": load_before,
                "load_after": load_after,
            }
            if name == "detlogp":
                row.update(ratio)
            out.append(row)
            log(f"  {name:8s} median {med[name] * 1e3:8.2f} ms  min {min(times[name]) * 1e3:8.2f} ms  "
                f"{gflops[name]:7.1f} GFLOP/s")  # fmt: skip
        for ref in methods:
            if ref != "detlogp":
                log(f"  detlogp / {ref}: {gflops['detlogp'] / gflops[ref]:.3f}x its throughput")
        if torch is not None:
            log(f"  threads: detlogp {detlogp_threads()}, torch {torch.get_num_threads()}, numpy: its BLAS default")
    return out


def detlogp_threads():
    return int(os.environ.get("DETLOGP_CPU_THREADS", os.cpu_count() or 1))


def _shape(text):
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape wants N,D,V (positive integers), got {text!r}")
    return tuple(int(p) for p in parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=_shape, action="append", help="N,D,V (repeatable; default 64,1024,32000)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", help="write the rows to this CSV file")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        ap.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {detlogp.__name__} from "
          f"{os.path.dirname(detlogp.__file__)}")  # fmt: skip
    rows = run(args.shape or DEFAULT_SHAPES, args.reps, args.warmup, args.seed)
    if args.csv:
        keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

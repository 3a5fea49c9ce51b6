"""Where a decode-size call spends its host time: detlogp.torch.linear_logp (trainer and serving)
against F.linear at N = 1 / 8 / 64, at a given head.

    PYTHONPATH=build/python python3 bench/host_overhead.py [--dim 4096 --vocab 151936] [--iters 200]
    PYTHONPATH=build/python python3 bench/host_overhead.py --breakdown-only   # the layers of one call
    DETLOGP_CPU_THREADS=1 PYTHONPATH=build/python python3 bench/host_overhead.py --cpu   # the same on CPU tensors

Three figures per case, each a median:
  host us     the call's host time alone: the wall time of `iters` back-to-back calls with the GPU
              kept busy ahead of them (a long sleep kernel first), over iters; what an eager loop
              pays on the CPU per call;
  eager us    CUDA events around one call after an L2 flush (the users' method), the host work
              before the first kernel included;
  graph us    the same call replayed from a CUDA graph: the kernels alone.
Then the torch profiler's CPU self times and cProfile's Python self times of eager trainer calls
at N = 1 (the top entries), which name the host steps that remain.

--cpu: the breakdown alone on CPU tensors (no GPU needed; default head D = 64, V = 256, so that the
CPU backend's own work is small: with DETLOGP_CPU_THREADS=1 it is also steady). The Python layers
are the GPU path's, less its CUDA-only steps (the NaN fill, the stream, the TMA checks).
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import detlogp.torch as dt

FLUSH_BYTES = 256 << 20


def busy_gpu(us: float) -> None:
    torch.cuda._sleep(int(us * 1.98e3))  # ~cycles at ~1.98 GHz: keeps the queue ahead of the host


def host_time(fn, iters: int) -> float:
    torch.cuda.synchronize()
    busy_gpu(iters * 2000)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def host_time_ahead(fn, calls: int = 10, reps: int = 20, cuda: bool = True) -> float:
    """The host time of a call that neither waits nor is waited for: `calls` calls (fewer than the
    16 verdicts a thread holds) enqueued behind a sleeping GPU; the median over reps. cuda=False
    (CPU tensors): the calls alone, and the lower decile over reps (on a shared CPU box other load
    only adds time)."""
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            busy_gpu(calls * 1500)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        if cuda:
            torch.cuda.synchronize()
    return statistics.median(times) if cuda else sorted(times)[len(times) // 10]


def breakdown(w, h, t) -> None:
    """The host time of one trainer call, peeled layer by layer: the public function (its eager path,
    no dispatcher), the custom op through torch's dispatcher (the path of autograd, torch.compile and
    capture), the op's body alone (run_op), the eager path's check of its operands, the problem tuple,
    the extension call alone (its problem tuple built once; the report kept as the library's
    CallReport, then as a dict), the extension call waiting for the verdict, and last_report()'s read
    of a call's lazy report; the top-k output's call and the sampling call with the bench's programs beside them. Then the layers as differences of those medians. The extension call is
    made as run_op makes it: with the tensors' DLPack capsules, made for each call (a capsule is
    imported once), where this build's run_op hands over capsules."""
    from detlogp import _detlogp as ext
    from detlogp._torch import op as op_mod
    from detlogp._torch import tensors as tensors_mod
    from detlogp._torch.tensors import library_problem, stream_of

    cuda = h.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n, v = h.shape[0], w.shape[0]
    logp = torch.empty(n, device=h.device)
    lse = torch.empty(n, device=h.device)
    problem = library_problem(h, w, t, None, 1.0, None, v, 0, -100)
    stream = stream_of(h)
    run_op = getattr(op_mod, "run_op", None)
    eager_operands = getattr(op_mod, "eager_operands", None)
    exports = getattr(tensors_mod, "dlpack_exports", None)

    def handed():  # (problem, logp, lse) as run_op hands them to the extension
        if exports is None:
            return problem, logp, lse
        c_h, c_w, c_t, c_logp, c_lse = exports((problem[0], problem[1], problem[2], logp, lse))
        return (c_h, c_w, c_t) + problem[3:], c_logp, c_lse

    from detlogp import SamplingParams

    key = torch.arange(n, dtype=torch.int64, device=h.device)
    program = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.05)

    def public_then_report():
        dt.linear_logp(h, w, t)
        dt.last_report()

    cases = {
        "F.linear": lambda: F.linear(h, w),
        "torch.empty x4": lambda: [torch.empty(n, device=h.device) for _ in range(4)],
        "dt.linear_logp": lambda: dt.linear_logp(h, w, t),
        "dt.linear_logp + last_report()": public_then_report,
        "dt.linear_logp(topk=20)": lambda: dt.linear_logp(h, w, t, topk=20),
        "dt.sample (every filter on)": lambda: dt.sample(h, w, program, 1234, key),
        "torch.ops.detlogp.linear_logp": lambda: torch.ops.detlogp.linear_logp(
            h, w, t, None, 1.0, None, -100, False, v, "", False, False, 0),
        "op body (run_op)": (lambda: run_op(h, w, t, None, 1.0, None, -100, False, v, "", False, False, 0))
        if run_op else None,
        "eager_operands": (lambda: eager_operands((h, w, t, None, None))) if eager_operands else None,
        "library_problem": lambda: library_problem(h, w, t, None, 1.0, None, v, 0, -100),
        "dlpack_exports": (lambda: exports((problem[0], problem[1], problem[2], logp, lse))) if exports else None,
        "_ext.linear_logp, the tensors": lambda: ext.linear_logp(problem, logp, lse, None, "", False, stream,
                                                                 defer_errors=True, lazy_report=True),
        "_ext.linear_logp deferred, lazy": lambda: ext.linear_logp(*handed(), None, "", False, stream,
                                                                   defer_errors=True, lazy_report=True),
        "_ext.linear_logp deferred, dict": lambda: ext.linear_logp(*handed(), None, "", False, stream,
                                                                   defer_errors=True),
        "_ext.linear_logp waiting": lambda: ext.linear_logp(*handed(), None, "", False, stream),
    }
    print(f"host time per call, N = {n}, " + ("calls enqueued ahead of a busy GPU (median us):" if cuda else
                                               "CPU tensors (lower decile, us):"))
    got = {}
    for name, fn in cases.items():
        if fn is None:
            print(f"  {name:<34} n/a")
            continue
        try:
            fn()
            sync()
            got[name] = host_time_ahead(fn, cuda=cuda) if cuda else host_time_ahead(fn, 100, 101, cuda=False)
            print(f"  {name:<34} {got[name]:>9.1f}", flush=True)
        except Exception as e:  # a signature this build does not have: say so, measure the rest
            print(f"  {name:<34} failed: {type(e).__name__}: {e}")
    layers = [
        ("public wrapper (args, eager check)", "dt.linear_logp", "op body (run_op)"),
        ("dispatcher over the op body", "torch.ops.detlogp.linear_logp", "op body (run_op)"),
        ("op body outside the extension", "op body (run_op)", "_ext.linear_logp deferred, lazy"),
        ("import of the tensors themselves", "_ext.linear_logp, the tensors", "_ext.linear_logp deferred, lazy"),
        ("report as a dict, in the call", "_ext.linear_logp deferred, dict", "_ext.linear_logp deferred, lazy"),
        ("last_report() after a call", "dt.linear_logp + last_report()", "dt.linear_logp"),
    ]
    print("layers (differences of the medians above, us):")
    for label, a, b in layers:
        if a in got and b in got:
            print(f"  {label:<34} {got[a] - got[b]:>9.1f}")
    if "_ext.linear_logp deferred, lazy" in got:
        print(f"  {'library call (extension, deferred)':<34} {got['_ext.linear_logp deferred, lazy']:>9.1f}")


def eager_time(fn, flush, iters: int) -> float:
    times = []
    for _ in range(iters):
        flush.fill_(1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def graph_time(fn, flush, iters: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return eager_time(g.replay, flush, iters)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--breakdown-only", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="the breakdown alone, on CPU tensors (default D=64, V=256)")
    args = ap.parse_args()
    if args.cpu:
        g = torch.Generator().manual_seed(0)
        dim = 64 if "--dim" not in sys.argv else args.dim
        vocab = 256 if "--vocab" not in sys.argv else args.vocab
        w = (torch.randn(vocab, dim, generator=g) * 0.02).to(torch.bfloat16)
        h = torch.randn(1, dim, generator=g).to(torch.bfloat16)
        breakdown(w, h, torch.randint(0, vocab, (1,), generator=g))
        return
    if not torch.cuda.is_available():
        print("host_overhead: skipped, no CUDA device")
        return
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(args.vocab, args.dim, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    hb = torch.randn(1, args.dim, device=dev, generator=g).to(torch.bfloat16)
    breakdown(w, hb, torch.randint(0, args.vocab, (1,), device=dev, generator=g))
    if args.breakdown_only:
        return
    print(f"{'N':>5} {'case':<22} {'host us':>9} {'eager us':>9} {'graph us':>9} {'eager/F.linear':>15}")
    for n in [int(x) for x in args.rows.split(",")]:
        h = torch.randn(n, args.dim, device=dev, generator=g)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        t = torch.randint(0, args.vocab, (n,), device=dev, generator=g)
        cases = {
            "F.linear": lambda: F.linear(h, w),
            "detlogp trainer": lambda: dt.linear_logp(h, w, t),
            "detlogp serving": lambda: dt.linear_logp(h, w, t, return_logits=True),
        }
        ref = None
        for name, fn in cases.items():
            fn()
            ht = host_time(fn, args.iters)
            et = eager_time(fn, flush, args.iters)
            gt = graph_time(fn, flush, args.iters)
            ref = et if ref is None else ref
            print(f"{n:>5} {name:<22} {ht:>9.1f} {et:>9.1f} {gt:>9.1f} {et / ref:>15.3f}", flush=True)
    h1 = h[:1].contiguous()
    t1 = t[:1].contiguous()
    for _ in range(3):
        dt.linear_logp(h1, w, t1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            dt.linear_logp(h1, w, t1)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        dt.linear_logp(h1, w, t1)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

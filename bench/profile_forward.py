"""Where a forward call's time goes, under the same power and clock state as the benchmark: the
cuBLAS bf16 GEMM (F.linear, the reference of docs/perf.md's ratios) and detlogp's trainer forward
(detlogp.torch.linear_logp, no logits; with --topk K also the call with the top-k output, with
--sample the rollout's sample and the trainer's replay with the bench's sampling programs), timed
round-robin in a fresh shuffled order per repetition, each call after an L2 flush, with CUDA events around every call and the torch
profiler (CUPTI) recording every kernel of every call.

    PYTHONPATH=build/python python3 bench/profile_forward.py [--rows 1024,4096] [--iters 20]
        [--topk 20] [--sample]

For each N and case it prints the medians of: the events' time of the call ("event ms"), the span
from the call's first kernel start to its last kernel end ("span ms"), the sum of its kernels'
durations ("kernels ms"), and each kernel's duration. The ratios then split the call's ratio to
cuBLAS into kernel time (the fused kernel and the combine, at the clock the power cap allows) and
the rest (host work before the first launch, gaps between kernels). ncu's kernel durations
(`scripts/gpu_check.sh`, PROFILE_KERNELS_N) are taken with the kernels serialized and the GPU idle
between replays, so a cooler, faster clock; these are taken while the GPU runs at its power cap.
"""

import argparse
import contextlib
import random
import statistics

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import detlogp.torch as dt
from detlogp import SamplingParams
from detlogp.bench.harness import FLUSH_BYTES, cuda_kernels
from detlogp.bench.methods import REPLAY_PROGRAM, SAMPLE_PROGRAM, SAMPLE_SEED


def host_profile(cases, flush, calls=5):
    """Each case's host time by operation (self CPU time over `calls` calls, each after a flush):
    where an event time beyond the kernels' span goes (a sync, a copy, an allocation, Python)."""
    for k, fn in cases.items():
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                flush.fill_(1)
                torch.cuda.synchronize()
                fn()
                torch.cuda.synchronize()
        print(f"\n  host side of {k!r} ({calls} calls; self CPU time, the runtime's calls included):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1024,4096", help="comma-separated N")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topk", type=int, default=0, help="also profile linear_logp(..., topk=K) (0: not)")
    ap.add_argument("--sample", action="store_true",
                    help="also profile detlogp.torch.sample and the trainer's replay with the bench's programs")  # fmt: skip
    ap.add_argument("--no-kernels", action="store_true",
                    help="time the calls with CUDA events alone, without the torch profiler (for a run under ncu, "
                         "whose counters cannot share the process with the profiler's CUPTI)")  # fmt: skip
    ap.add_argument("--host", action="store_true",
                    help="also profile each case's host side (torch profiler, CPU activity: its ops and the CUDA "
                         "runtime calls, syncs and copies included), 5 calls after a flush each")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_forward: skipped, no CUDA device")
        return
    dev = "cuda"
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    flush_names = set()
    if not args.no_kernels:
        # The flush kernel's name, from a profile of the flush alone: it separates the calls below.
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            flush.fill_(1)
            torch.cuda.synchronize()
        flush_names = {e.name for e in cuda_kernels(prof)}
        if len(flush_names) != 1:
            raise SystemExit(f"profile_forward: expected one flush kernel, saw {sorted(flush_names)}")

    gen = torch.Generator(device=dev).manual_seed(args.seed)
    w = (torch.randn(args.vocab, args.dim, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, D = {args.dim}, V = {args.vocab}")
    for n in (int(x) for x in args.rows.split(",")):
        h = torch.randn(n, args.dim, device=dev, generator=gen).to(torch.bfloat16)
        t = torch.randint(0, args.vocab, (n,), device=dev, generator=gen)
        cases = {
            "cublas F.linear bf16": lambda: F.linear(h, w),
            "detlogp trainer forward": lambda: dt.linear_logp(h, w, t),
        }
        if args.topk:
            cases[f"detlogp topk={args.topk}"] = lambda: dt.linear_logp(h, w, t, topk=args.topk)
        if args.sample:
            sample_params, replay_params = SamplingParams(**SAMPLE_PROGRAM), SamplingParams(**REPLAY_PROGRAM)
            cases["detlogp sample"] = lambda: dt.sample(h, w, sample_params, SAMPLE_SEED, t)
            cases["detlogp replay"] = lambda: dt.linear_logp(h, w, t, sampling=replay_params)
        with torch.no_grad():
            for fn in cases.values():
                for _ in range(args.warmup):
                    fn()
            torch.cuda.synchronize()
            rng = random.Random(args.seed + n)
            order, events = [], []
            recorder = contextlib.nullcontext() if args.no_kernels else profile(activities=[ProfilerActivity.CUDA])
            with recorder as prof:
                for _ in range(args.iters):
                    keys = list(cases)
                    rng.shuffle(keys)
                    for k in keys:
                        flush.fill_(1)
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        cases[k]()
                        end.record()
                        order.append(k)
                        events.append((start, end))
                torch.cuda.synchronize()
        # Split the kernel stream at the flushes: segment i holds call i's kernels (none without the profiler).
        if args.no_kernels:
            segments = [[] for _ in order]
        else:
            segments, current = [], None
            for e in cuda_kernels(prof):
                if e.name in flush_names:
                    current = []
                    segments.append(current)
                elif current is not None:
                    current.append(e)
        if len(segments) != len(order):
            raise SystemExit(f"profile_forward: {len(segments)} flushes for {len(order)} calls")
        stats = {k: {"event": [], "span": [], "kernels": [], "per": {}} for k in cases}
        for k, seg, (start, end) in zip(order, segments, events):
            s = stats[k]
            s["event"].append(start.elapsed_time(end))
            if not seg:
                continue
            s["span"].append((max(e.time_range.end for e in seg) - seg[0].time_range.start) / 1e3)
            s["kernels"].append(sum(e.time_range.elapsed_us() for e in seg) / 1e3)
            for e in seg:
                s["per"].setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
        med = statistics.median
        ref = stats["cublas F.linear bf16"]
        print(f"\nN = {n}: medians of {args.iters} calls per case")
        print(f"  {'case':28s} {'event ms':>9s} {'span ms':>9s} {'kernels ms':>10s}   event/ref span/ref kern/ref")
        for k, s in stats.items():
            if not s["span"]:  # events only (--no-kernels)
                print(f"  {k:28s} {med(s['event']):9.4f} {'-':>9s} {'-':>10s}   {med(s['event']) / med(ref['event']):9.4f}")
                continue
            print(
                f"  {k:28s} {med(s['event']):9.4f} {med(s['span']):9.4f} {med(s['kernels']):10.4f}"
                f"   {med(s['event']) / med(ref['event']):9.4f} {med(s['span']) / med(ref['span']):8.4f}"
                f" {med(s['kernels']) / med(ref['kernels']):8.4f}"
            )
            for name, times in sorted(s["per"].items(), key=lambda kv: -med(kv[1])):
                print(f"      {med(times):9.4f} ms x{len(times) // args.iters}  {name[:100]}")
        if args.host:
            host_profile(cases, flush)


if __name__ == "__main__":
    main()

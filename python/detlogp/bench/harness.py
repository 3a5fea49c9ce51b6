"""Timing primitives shared by `python -m detlogp.bench` and the diagnostic scripts in bench/:
the L2 flush, one timed call (CUDA events or the wall clock), the shuffled round-robin over cases,
the peak extra memory of one step, a forward (+ backward) step on fresh leaf copies, and the
torch-profiler kernel listing.

Every case of one table is timed once per repetition, in a fresh shuffled order (fixed seed), so
clock and power drift reach every case alike and no case always follows the same predecessor; the
figure of a case is the median of its repetitions, and ratios are taken between cases of the same
round-robin only.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Callable, Dict, Hashable, List, Optional

import torch

FLUSH_BYTES = 256 << 20  # four times the H200's 60 MB L2: a memset of it evicts every weight line


class Timer:
    """Times one call of a step. On a CUDA device: the L2 is flushed (a 256 MiB memset) and the
    device drained before the start event, so the call starts cold and from an idle GPU, and the
    host time a call spends before its first kernel counts (as it does for a user's eager call).
    On the CPU: time.perf_counter around the call (torch's CPU ops return when done)."""

    def __init__(self, device: torch.device, flush: bool = True):
        self.cuda = torch.device(device).type == "cuda"
        self.flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda and flush else None

    def flush(self) -> None:
        if self.flush_buf is not None:
            self.flush_buf.fill_(1)

    def __call__(self, step: Callable[[], object]) -> float:
        """Milliseconds of one call of step."""
        if self.cuda:
            self.flush()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3


def time_once(step: Callable[[], object], cuda: bool) -> float:
    """Milliseconds of one step without an L2 flush: CUDA events on a GPU, wall clock on a CPU."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def round_robin(
    cases: Dict[Hashable, Callable[[], object]],
    iters: int,
    warmup: int,
    cuda: bool = False,
    seed: int = 0,
    timer: Optional[Callable[[Callable[[], object]], float]] = None,
) -> Dict[Hashable, List[float]]:
    """Times every case once per repetition in a fresh shuffled order; returns {key: [ms, ...]}.
    timer: how one call is timed (default time_once, no flush; a Timer flushes the L2 first)."""
    timer = timer or (lambda step: time_once(step, cuda))
    for step in cases.values():
        for _ in range(warmup):
            step()
    if cuda:
        torch.cuda.synchronize()
    rng = random.Random(seed)
    times = {k: [] for k in cases}
    for _ in range(iters):
        order = list(cases)
        rng.shuffle(order)
        for k in order:
            times[k].append(timer(cases[k]))
    return times


def medians(times: Dict[Hashable, List[float]]) -> Dict[Hashable, float]:
    return {k: statistics.median(v) for k, v in times.items() if v}


def paired_ratio(a: List[float], b: List[float]) -> float:
    """The median over the repetitions of each repetition's own ratio a[i] / b[i] (drifts slower
    than one round cancel)."""
    return statistics.median(x / y for x, y in zip(a, b))


def peak_extra_bytes(step: Callable[[], object]) -> int:
    """Peak CUDA memory of one step above what was allocated before it (GPU only): what the step
    allocates and keeps (outputs, gradients) plus its transient buffers at their peak."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def make_step(fn, h, w, t, g, env=None, forward_only=False, module=None, settings_of=None):
    """One forward (+ backward) of fn on fresh leaf copies of h and w, with environment variables
    (env) and attributes of the object settings_of (module: {name: value}) set around it; fn returns
    logp or (logp, extra loss term), the loss is (logp * g).sum() (+ extra). Returns (step, grads)
    where grads() gives the last step's gradients."""
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()

    def step():
        hh.grad = None
        ww.grad = None
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        saved_module = {k: getattr(settings_of, k) for k in (module or {})}
        for k, val in (module or {}).items():
            setattr(settings_of, k, val)
        try:
            out = fn(hh, ww, t)
            logp, extra = out if isinstance(out, tuple) else (out, None)
            if not forward_only:
                loss = (logp * g).sum()
                (loss if extra is None else loss + extra).backward()
        finally:
            for k, val in saved_module.items():
                setattr(settings_of, k, val)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return step, lambda: (hh.grad, ww.grad)


def cuda_kernels(prof):
    """A torch profile's CUDA kernels, in start order."""
    return sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )


def profile_kernels(step, label, top=12):
    """The CUDA kernels of one step (torch profiler): summed per name, longest first, and, for a
    short step, the timeline (start offsets show the gaps between kernels)."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = cuda_kernels(prof)
    if not kernels:
        print(f"{label}: the profiler saw no CUDA kernels")
        return []
    totals = {}
    for e in kernels:
        us, count = totals.get(e.name, (0.0, 0))
        totals[e.name] = (us + e.time_range.elapsed_us(), count + 1)
    busy = sum(us for us, _ in totals.values())
    t0 = kernels[0].time_range.start
    span = max(e.time_range.end for e in kernels) - t0
    print(f"{label}: {len(kernels)} kernels, {busy / 1e3:.3f} ms of kernel time in a {span / 1e3:.3f} ms span")
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / 1e3:8.3f} ms {count:4d}x  {name[:110]}")
    # Idle time between kernels (the device waiting on the host: a sync, a launch the host was late with).
    gaps, end = [], kernels[0].time_range.end
    for prev, e in zip(kernels, kernels[1:]):
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, prev.name, e.name))
        end = max(end, e.time_range.end)
    if gaps:
        print(f"  idle between kernels: {sum(gap for gap, _, _ in gaps) / 1e3:.3f} ms in {len(gaps)} gaps; longest:")
        for gap, before, after in sorted(gaps, reverse=True)[:6]:
            print(f"  {gap / 1e3:8.3f} ms  after {before[:50]}  before {after[:50]}")
    if len(kernels) <= 16:
        print("  timeline (start us, duration us):")
        for e in kernels:
            print(f"  {e.time_range.start - t0:10.1f} {e.time_range.elapsed_us():10.1f}  {e.name[:100]}")
    return [{"kernel": n, "ms": us / 1e3, "count": c} for n, (us, c) in totals.items()]

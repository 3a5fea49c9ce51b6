"""The host timeline of one eager decode call (N = 1 by default), as the bench's decode rows time it
(an L2 flush, a sync, then the call): every operator and CUDA runtime call the torch profiler
records inside the call, in order, with its start (us from the call's start) and duration, for
F.linear and for detlogp.torch.linear_logp (the trainer entry), and the time from the call's start
to the launch of its first GEMM kernel, which an event-timed eager call waits for on an idle GPU.
One call of each is printed (the median one of `--calls` by that launch time); the medians of the
launch time and of the whole call's host time close each block."""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--rows", type=int, default=1)
ap.add_argument("--dim", type=int, default=4096)
ap.add_argument("--vocab", type=int, default=151936)
ap.add_argument("--calls", type=int, default=15)
args = ap.parse_args()

flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
h = torch.randn(args.rows, args.dim, device="cuda", dtype=torch.bfloat16)
w = torch.randn(args.vocab, args.dim, device="cuda", dtype=torch.bfloat16) * 0.02
t = torch.zeros(args.rows, dtype=torch.int64, device="cuda")
cases = {"F.linear": lambda: F.linear(h, w)}
try:
    import detlogp.torch as dt

    cases["detlogp trainer"] = lambda: dt.linear_logp(h, w, t)
except ImportError as e:
    print("detlogp.torch not importable:", e)

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
for name, fn in cases.items():
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            flush.fill_(1)
            torch.cuda.synchronize()
            with record_function("the call"):
                fn()
            torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    calls = [e for e in events if e.name == "the call"]
    timelines = []
    for c in calls:
        inside = [e for e in events if e is not c and c.time_range.start <= e.time_range.start < c.time_range.end
                  and e.device_type == torch.autograd.DeviceType.CPU]  # fmt: skip
        # The GEMM's launch: the first that is not a plain cudaLaunchKernel (torch's fills use that;
        # cuBLAS launches by cuLaunchKernelEx, detlogp's fused kernel by cudaLaunchKernelExC).
        gemm = [e for e in inside if e.name in LAUNCHES and e.name != "cudaLaunchKernel"]
        first = gemm[0].time_range.start - c.time_range.start if gemm else float("nan")
        timelines.append((first, c, inside))
    timelines.sort(key=lambda x: x[0])
    first, c, inside = timelines[len(timelines) // 2]
    print(f"\n{name}: the median call by the GEMM launch's start ({len(calls)} calls)")
    for e in inside:
        print(f"  {e.time_range.start - c.time_range.start:8.1f} us  {e.time_range.end - e.time_range.start:7.1f} us  "
              f"{e.name[:70]}")  # fmt: skip
    print(f"  GEMM launch starts at {statistics.median(x[0] for x in timelines):.1f} us (median); the call's host "
          f"time {statistics.median(x[1].time_range.end - x[1].time_range.start for x in timelines):.1f} us")  # fmt: skip

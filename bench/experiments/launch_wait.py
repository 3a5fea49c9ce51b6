"""Host time of one small launch (a fill, as the deferred call's NaN prefill) on an idle GPU: alone,
after the bench's L2 flush and a sync, and after a detlogp call and a sync; beside the host time of
the calls themselves (F.linear, the trainer entry). The host profile of bench/profile_forward.py
shows the trainer's cudaLaunchKernel calls at ~52 us each against ~19 for F.linear's: this tells
which launch is slow and after what."""
import time

import torch

flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
x = torch.empty(16, dtype=torch.float32, device="cuda")
h = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(151936, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
t = torch.zeros(1, dtype=torch.int64, device="cuda")


def median_us(before, fn, reps=50):
    out = []
    for _ in range(reps):
        before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(out)[reps // 2]


def nothing():
    pass


fill = lambda: x.fill_(float("nan"))  # noqa: E731
prefill = lambda: h.new_full((1,), float("nan"), dtype=torch.float32)  # noqa: E731
linear = lambda: torch.nn.functional.linear(h, w)  # noqa: E731
cases = [("fill, idle", nothing, fill), ("fill, after the flush", lambda: flush.fill_(1), fill),
         ("new_full, idle", nothing, prefill), ("F.linear, after the flush", lambda: flush.fill_(1), linear)]
try:
    import detlogp.torch as dt

    trainer = lambda: dt.linear_logp(h, w, t)  # noqa: E731
    cases += [("trainer, after the flush", lambda: flush.fill_(1), trainer), ("fill, after a trainer call", trainer, fill),
              ("fill, after F.linear", linear, fill)]
except ImportError as e:
    print("detlogp.torch not importable:", e)
for name, before, fn in cases:
    before(), fn()
    print(f"{name:28s} {median_us(before, fn):8.1f} us (host, median of 50)")

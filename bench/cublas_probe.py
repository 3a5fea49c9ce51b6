#!/usr/bin/env python3
"""torch's side of scripts/cublas_probe.sh: which cuBLAS kernel F.linear runs, and how fast, on
both data kinds of bench_sm90 (docs/perf.md, "Method" and the 2026-12-02 entry on the reference).

    python bench/cublas_probe.py --time [--n 1024,4096,16384] [--reps 15] [--csv torch_time.csv]
    python bench/cublas_probe.py --ncu-pass [--n ...]      # one call of each, for ncu / cuBLAS logs
    python bench/cublas_probe.py --ncu-summary NCU.csv --labels a,b,...
    python bench/cublas_probe.py --log-summary CUBLAS.log   # a cuBLAS or cuBLASLt log

Two calls, on the same inputs, in one shuffled round-robin per repetition (CUDA events, a 256 MiB
memset before every timed call, medians and paired ratios, the SM clock and board power sampled
through NVML while each call runs):
  torch-linear   F.linear(h, w), h [N, 4096] and w [151936, 4096] bf16 (torch's own cuBLAS call);
  bench-legacy   the call bench_sm90 made before it copied torch's: cublasGemmEx on a bare handle
                 (cuBLAS's own workspace, CUBLAS_GEMM_DEFAULT, CUBLAS_COMPUTE_32F), through ctypes
                 into the libcublas torch loaded, so the two calls share one library.
Data: "realistic" is python/detlogp/bench/data.py's make_inputs (what `python -m detlogp.bench`
feeds every method); "random" has bench_sm90's random distribution (uniform hidden in [-1, 1),
uniform head in +-9 / sqrt(D)) from torch's generator, so the same distributions as the bench,
not the same bits. --time also profiles one call of each (torch.profiler) for the kernel names.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import importlib.util
import math
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
D, V = 4096, 151936
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 14, 68, -1


def load_data_module():
    """python/detlogp/bench/data.py by path: it needs torch only, not the compiled module."""
    spec = importlib.util.spec_from_file_location("detlogp_bench_data", ROOT / "python/detlogp/bench/data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_inputs(kind, n_max, device):
    import torch

    if kind == "realistic":
        inp = load_data_module().make_inputs(n_max, D, V, device)
        return inp.hidden, inp.weight
    gen = torch.Generator(device=device).manual_seed(1)
    w = ((torch.rand(V, D, device=device, generator=gen) * 2 - 1) * (9.0 / math.sqrt(D))).to(torch.bfloat16)
    h = (torch.rand(n_max, D, device=device, generator=gen) * 2 - 1).to(torch.bfloat16)
    return h, w


def loaded_cublas():
    """(path, version) of the libcublas this process loaded (after a bf16 matmul ran)."""
    path = None
    with open("/proc/self/maps") as f:
        for line in f:
            name = line.split()[-1]
            if "/libcublas.so" in name:
                path = name
                break
    if path is None:
        return None, None, None
    lib = ctypes.CDLL(path)  # already loaded: the same handle
    vals = []
    for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        v = ctypes.c_int(0)
        lib.cublasGetProperty(prop, ctypes.byref(v))
        vals.append(v.value)
    return path, "%d.%d.%d" % tuple(vals), lib


class Nvml:
    """SM clock and board power through libnvidia-ml (ctypes), device 0's bus id."""

    def __init__(self):
        self.dev = None
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self.lib.nvmlInit_v2() != 0:
                return
            import torch

            p = torch.cuda.get_device_properties(0)
            dev = ctypes.c_void_p()
            ok = False
            if hasattr(p, "pci_bus_id"):
                bus = b"%08x:%02x:%02x.0" % (getattr(p, "pci_domain_id", 0), p.pci_bus_id, p.pci_device_id)
                ok = self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(dev)) == 0
            if not ok:
                ok = self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0
            if ok:
                self.dev = dev
        except OSError:
            pass

    def sample(self):
        if self.dev is None:
            return None, None
        mhz, mw = ctypes.c_uint(0), ctypes.c_uint(0)
        c = mhz.value if self.lib.nvmlDeviceGetClockInfo(self.dev, 1, ctypes.byref(mhz)) == 0 else None  # SM clock
        w = mw.value / 1000 if self.lib.nvmlDeviceGetPowerUsage(self.dev, ctypes.byref(mw)) == 0 else None
        return c, w


class LegacyGemm:
    """bench_sm90's former cuBLAS call, through the given libcublas."""

    def __init__(self, lib):
        self.lib = lib
        self.handle = ctypes.c_void_p()
        if lib.cublasCreate_v2(ctypes.byref(self.handle)) != 0:
            raise RuntimeError("cublasCreate_v2 failed")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        f = lib.cublasGemmEx
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_int]  # fmt: skip

    def __call__(self, h, w, out):
        n = h.shape[0]
        st = self.lib.cublasGemmEx(self.handle, CUBLAS_OP_T, CUBLAS_OP_N, V, n, D, ctypes.byref(self.alpha),
                                   w.data_ptr(), CUDA_R_16BF, D, h.data_ptr(), CUDA_R_16BF, D, ctypes.byref(self.beta),
                                   out.data_ptr(), CUDA_R_16BF, V, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)  # fmt: skip
        if st != 0:
            raise RuntimeError(f"cublasGemmEx (legacy call) returned status {st}")


def info_lines(torch, path, version):
    env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "TORCH_BLAS_PREFER_CUBLASLT",
                                          "DISABLE_ADDMM_CUDA_LT", "PYTORCH_TUNABLEOP_ENABLED",
                                          "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE")}  # fmt: skip
    yield f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(0)}"
    yield f"torch cuBLAS: {version} at {path}"
    yield f"torch preferred_blas_library: {torch.backends.cuda.preferred_blas_library()}"
    red = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    yield f"torch allow_bf16_reduced_precision_reduction: {red}; fp32 matmul precision: " + str(
        torch.get_float32_matmul_precision())
    yield "env: " + ", ".join(f"{k}={v}" for k, v in env.items())


def run_time(args):
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    ns = [int(x) for x in args.n.split(",")]
    nmax = max(ns)
    kinds = ["random", "realistic"]
    data = {k: make_inputs(k, nmax, dev) for k in kinds}
    F.linear(data["realistic"][0][:8], data["realistic"][1])  # loads cuBLAS
    torch.cuda.synchronize()
    path, version, lib = loaded_cublas()
    for line in info_lines(torch, path, version):
        print(line)
    if lib is None:
        sys.exit("cublas_probe: no libcublas loaded after a bf16 matmul")
    print(f"torch cuBLAS dir: {os.path.dirname(path)}")
    legacy = LegacyGemm(lib)
    out = torch.empty(nmax, V, dtype=torch.bfloat16, device=dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    nvml = Nvml()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for n in ns:
        calls = []
        for k in kinds:
            h, w = data[k]
            hn = h[:n]
            calls.append(("torch-linear", k, lambda hn=hn, w=w: F.linear(hn, w)))
            calls.append(("bench-legacy", k, lambda hn=hn, w=w: legacy(hn, w, out)))
        for _, _, fn in calls:
            for _ in range(2):
                fn()
        torch.cuda.synchronize()
        times = {i: [] for i in range(len(calls))}
        clk = {i: [] for i in range(len(calls))}
        pw = {i: [] for i in range(len(calls))}
        rng = random.Random(12345)
        order = list(range(len(calls)))
        for r in range(args.reps):
            rng.shuffle(order)
            for j, i in enumerate(order):
                flush.fill_((r + j) & 0xFF)
                a.record()
                calls[i][2]()
                b.record()
                cs, ws = [], []
                while not b.query():
                    c, wt = nvml.sample()
                    if c is not None:
                        cs.append(c)
                    if wt is not None:
                        ws.append(wt)
                b.synchronize()
                times[i].append(a.elapsed_time(b))
                if cs:
                    clk[i].append(statistics.fmean(cs))
                if ws:
                    pw[i].append(statistics.fmean(ws))
        med = {i: statistics.median(t) for i, t in times.items()}

        def idx(name, kind):
            return next(i for i, c in enumerate(calls) if c[0] == name and c[1] == kind)

        def paired(i, j):
            return statistics.median(x / y for x, y in zip(times[i], times[j]))

        for i, (name, kind, _) in enumerate(calls):
            mhz = statistics.fmean(clk[i]) if clk[i] else float("nan")
            watts = statistics.fmean(pw[i]) if pw[i] else float("nan")
            rows.append({"N": n, "method": name, "data": kind, "ms_median": f"{med[i]:.5f}",
                         "tflops": f"{2.0 * n * D * V / (med[i] * 1e-3) / 1e12:.1f}", "sm_mhz_mean": f"{mhz:.0f}",
                         "power_w_mean": f"{watts:.0f}", "cublas": version, "torch": torch.__version__})  # fmt: skip
            print(f"torch N={n} {name:13s} {kind:9s} {med[i]:9.4f} ms  {mhz:5.0f} MHz  {watts:4.0f} W")
        for k in kinds:
            i, j = idx("bench-legacy", k), idx("torch-linear", k)
            print(f"torch-process N={n} data={k}: bench-legacy / torch-linear = {med[i] / med[j]:.3f}x "
                  f"(paired {paired(i, j):.3f}x)")  # fmt: skip
        for name in ("torch-linear", "bench-legacy"):
            i, j = idx(name, "realistic"), idx(name, "random")
            ci = statistics.fmean(clk[i]) if clk[i] else float("nan")
            cj = statistics.fmean(clk[j]) if clk[j] else float("nan")
            pi = statistics.fmean(pw[i]) if pw[i] else float("nan")
            pj = statistics.fmean(pw[j]) if pw[j] else float("nan")
            print(f"torch-process N={n} {name}: realistic / random = {med[i] / med[j]:.3f}x (paired "
                  f"{paired(i, j):.3f}x); SM MHz {ci:.0f} / {cj:.0f}, W {pi:.0f} / {pj:.0f}")  # fmt: skip
        # One profiled call of each: the kernels it launched and their device time.
        from torch.profiler import ProfilerActivity, profile

        for name, kind, fn in calls:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            kernels = []
            for e in prof.events():
                dt = getattr(e, "device_type", None)
                if dt is not None and "CUDA" in str(dt) and e.name:
                    kernels.append(f"{e.name} ({e.time_range.elapsed_us() / 1000:.3f} ms)")
            print(f"profiler N={n} {name} {kind}: " + ("; ".join(kernels) if kernels else "no device events"))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            wr.writeheader()
            wr.writerows(rows)
        print(f"csv: {args.csv}")


def run_ncu_pass(args):
    """One F.linear and one legacy call per N on realistic data, in this order (the labels of
    --ncu-summary), for ncu or the cuBLAS logs."""
    import torch
    import torch.nn.functional as F

    ns = [int(x) for x in args.n.split(",")]
    h, w = make_inputs("realistic", max(ns), torch.device("cuda"))
    torch.cuda.synchronize()
    out = torch.empty(max(ns), V, dtype=torch.bfloat16, device="cuda")
    legacy = None
    for n in ns:
        F.linear(h[:n], w)
        torch.cuda.synchronize()
        if legacy is None:
            path, version, lib = loaded_cublas()
            print(f"torch cuBLAS: {version} at {path}")
            legacy = LegacyGemm(lib)
        legacy(h[:n], w, out)
        torch.cuda.synchronize()
    print("ncu pass order: " + ",".join(f"torch-linear N={n},bench-legacy N={n}" for n in ns))


def run_ncu_summary(args):
    """ncu --csv output (one row per kernel and metric): one line per launch, with its label."""
    launches = {}
    with open(args.ncu_summary, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for r in csv.DictReader(lines):
        key = r.get("ID")
        if key is None:
            continue
        e = launches.setdefault(key, {"name": r.get("Kernel Name", "?"), "grid": r.get("Grid Size", ""),
                                      "block": r.get("Block Size", "")})  # fmt: skip
        e[r.get("Metric Name", "")] = (r.get("Metric Value", ""), r.get("Metric Unit", ""))
    labels = args.labels.split(",") if args.labels else []
    keys = sorted(launches, key=int)
    if labels and len(labels) != len(keys):
        print(f"ncu {args.ncu_summary}: {len(keys)} launches for {len(labels)} labels (labels shown as given)")
    for i, k in enumerate(keys):
        e = launches[k]
        lab = labels[i] if i < len(labels) else f"launch {k}"
        m = "  ".join(f"{name}={val} {unit}" for name, (val, unit) in
                      ((n, e[n]) for n in sorted(e) if "__" in n))  # fmt: skip
        print(f"ncu {lab}: {e['name']} grid {e['grid']} block {e['block']}  {m}")


def run_log_summary(args):
    """cuBLAS's API log (CUBLAS_LOGINFO_DBG): how often each function was called and the arguments
    of the first GEMM call; cuBLASLt's log (CUBLASLT_LOG_MASK): each [level][function] tag's count
    and first line."""
    import re

    try:
        text = open(args.log_summary, errors="replace").read().splitlines()
    except OSError as e:
        print(f"{args.log_summary}: {e}")
        return 0
    calls = [(i, m.group(1)) for i, ln in enumerate(text) if (m := re.search(r"function .*?(cublas\w+)\(", ln))]
    if calls:
        counts = {}
        for _, name in calls:
            counts[name] = counts.get(name, 0) + 1
        print("calls: " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
        for want in ("cublasGemmEx", "cublasLtMatmul"):
            first = next((i for i, name in calls if name.startswith(want)), None)
            if first is None:
                continue
            block = []
            for ln in text[first + 1:]:
                if re.search(r"function .*?cublas\w+\(", ln):
                    break
                block.append(ln.strip()[:160])
            print(f"first {want}: " + " | ".join(block[:24]))
        return 0
    tags = {}  # tag -> lines; every traced matmul is shown (one per GEMM call), else the first line
    for ln in text:
        m = re.search(r"\[(Error|Trace|Hints|Info|Api\w*)\]\[(\w+)\]", ln)
        if m:
            tags.setdefault(f"{m.group(1)}/{m.group(2)}", []).append(ln.strip())
    for key, lines in tags.items():
        shown = lines[:8] if key.startswith("Trace/") and "Matmul" in key else lines[:1]
        for ln in shown:
            print(f"{key} (x{len(lines)}): {ln[:400]}")
    if not tags:
        print(f"{args.log_summary}: {len(text)} lines, none recognized")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time", action="store_true", help="time both calls on both data kinds")
    ap.add_argument("--ncu-pass", action="store_true", help="one call of each per N (for ncu and cuBLAS logs)")
    ap.add_argument("--ncu-summary", metavar="NCU_CSV", help="summarize an ncu --csv log")
    ap.add_argument("--labels", default="", help="with --ncu-summary: a label per launch, in order")
    ap.add_argument("--log-summary", metavar="LOG", help="summarize a cuBLAS or cuBLASLt log")
    ap.add_argument("--n", default="1024,4096,16384")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--csv", default="")
    args = ap.parse_args(argv)
    if args.ncu_summary:
        return run_ncu_summary(args)
    if args.log_summary:
        return run_log_summary(args)
    import torch

    if not torch.cuda.is_available():
        print("SKIP cublas_probe: no CUDA device")
        return 0
    if args.ncu_pass:
        return run_ncu_pass(args)
    if args.time:
        return run_time(args)
    ap.error("give --time, --ncu-pass or --ncu-summary")


if __name__ == "__main__":
    raise SystemExit(main())

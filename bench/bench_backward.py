"""Forward + backward of the lm_head log-probabilities: detlogp.torch.linear_logp against plain
PyTorch (F.linear + log_softmax + autograd), time and peak memory.

Default shapes: Qwen3-8B's head (D = 4096, V = 151936), N = 4096 tokens, bf16. On a GPU:

    PYTHONPATH=build/python python3 bench/bench_backward.py [--json out.json]

Time: CUDA events around forward + backward (median of --iters after --warmup). Peak memory:
torch.cuda.max_memory_allocated() above the inputs, the gradient buffers included (both sides
produce the same gradients). The SM90 forward's own workspace is cudaMalloc'ed by the library and
is reported separately by the library's DETLOGP_SM90_WORKSPACE_MB setting, not here.
On a CPU (--device cpu, small shapes) the script only times, to check that it runs.

The detlogp backward is fused on an SM90 GPU (grad-logits kernel + two GEMMs per vocabulary
chunk); "contract-torchloop" runs the same forward with DETLOGP_TORCH_FUSED_BACKWARD=0, the
torch chunk loop, for comparison (setting that variable for the whole run forces it everywhere);
"contract-nocluster" runs the grad-logits kernel one CTA per weight stage
(DETLOGP_SM90_GRAD_CLUSTER=1) and "contract-1gib" with 1 GiB dz chunks instead of 256 MiB.
The "bwd path" column says which backward served each method. "fwd ms" times the forward alone
in the same harness, "bwd ms" is the difference of the two medians, and "bwd/GEMM" divides it by
the cuBLAS bf16 forward GEMM (F.linear) measured in the same run (issue 6's target: <= 3.3).
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import detlogp.torch as dt


def torch_reference(h, w, t):
    logits = F.linear(h, w)  # [N, V] bf16
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V] fp32
    mask = t != -100
    return logp.gather(1, t.clamp(min=0)[:, None])[:, 0] * mask


def detlogp_contract(h, w, t):
    return dt.linear_logp(h, w, t)[0]


def detlogp_torch_lane(h, w, t):
    return dt.linear_logp(h, w, t, backend=dt.TORCH_BACKEND_ID)[0]


METHODS = {
    "torch F.linear+log_softmax+autograd": torch_reference,
    "detlogp (contract fwd, chunked bwd)": detlogp_contract,
    "detlogp (contract fwd, chunked bwd, grad kernel without clusters)": detlogp_contract,
    "detlogp (contract fwd, chunked bwd, 1 GiB chunks)": detlogp_contract,
    "detlogp (contract fwd, torch chunk loop bwd)": detlogp_contract,
    "detlogp torch lane (fp32 F.linear fwd, chunked bwd)": detlogp_torch_lane,
}
# Module settings of detlogp.torch set around a method's steps (free choices of the backward).
METHOD_MODULE = {
    "detlogp (contract fwd, chunked bwd, 1 GiB chunks)": {"BACKWARD_FUSED_CHUNK_BYTES": 1 << 30},
}
# Environment set around a method's steps.
METHOD_ENV = {
    "detlogp (contract fwd, torch chunk loop bwd)": {dt.FUSED_BACKWARD_ENV: "0"},
    "detlogp (contract fwd, chunked bwd, grad kernel without clusters)": {"DETLOGP_SM90_GRAD_CLUSTER": "1"},
}


def run(fn, h, w, t, g, iters, warmup, cuda, env=None, forward_only=False, module=None):
    hh = h.clone().requires_grad_()
    ww = w.clone().requires_grad_()

    def step():
        hh.grad = None
        ww.grad = None
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        saved_module = {k: getattr(dt, k) for k in (module or {})}
        for k, val in (module or {}).items():
            setattr(dt, k, val)
        try:
            logp = fn(hh, ww, t)
            if not forward_only:
                (logp * g).sum().backward()
        finally:
            for k, val in saved_module.items():
                setattr(dt, k, val)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    for _ in range(warmup):
        step()
    times = []
    peak = None
    if cuda:
        torch.cuda.synchronize()
        hh.grad = None
        ww.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), peak, (hh.grad, ww.grad)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--methods", default="all",
        help="comma-separated subset of: ref, contract, contract-nocluster, contract-1gib, contract-torchloop, lane",
    )  # fmt: skip
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    gen = torch.Generator().manual_seed(0)
    n, d, v = args.rows, args.dim, args.vocab
    h = torch.randn(n, d, generator=gen).bfloat16().to(args.device)
    w = (torch.randn(v, d, generator=gen) * 0.02).bfloat16().to(args.device)
    t = torch.randint(0, v, (n,), generator=gen)
    t[15::16] = -100
    t = t.to(args.device)
    g = torch.rand(n, generator=gen).to(args.device)
    keys = dict(zip(("ref", "contract", "contract-nocluster", "contract-1gib", "contract-torchloop", "lane"),
                    METHODS))  # fmt: skip
    chosen = list(METHODS) if args.methods == "all" else [keys[k] for k in args.methods.split(",")]
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}")
    print(f"N={n} D={d} V={v} bf16, forward + backward (hidden and weight gradients), torch-loop chunk "
          f"{dt.BACKWARD_VOCAB_CHUNK}, fused chunk {dt._fused_chunk_rows(n, v)}")  # fmt: skip
    # The forward GEMM the backward is measured against: cuBLAS bf16 F.linear (what torch calls).
    gemm_ms = None
    if cuda:
        gemm_ms, _, _, _ = run(lambda a, b, _t: F.linear(a, b), h, w, t, g, args.iters, args.warmup, cuda,
                               forward_only=True)  # fmt: skip
        print(f"cuBLAS bf16 forward GEMM (F.linear): {gemm_ms:.2f} ms")
    print(f"{'method':55s} {'median ms':>10s} {'min ms':>9s} {'peak extra MiB':>15s} {'bwd path':>9s} "
          f"{'fwd ms':>7s} {'bwd ms':>7s} {'bwd/GEMM':>8s}")  # fmt: skip
    results = []
    grads = {}
    for name in chosen:
        try:
            dt._last_backward["path"] = None
            med, best, peak, gr = run(METHODS[name], h, w, t, g, args.iters, args.warmup, cuda, METHOD_ENV.get(name),
                                      module=METHOD_MODULE.get(name))  # fmt: skip
            path = dt.last_backward_path() or "-"
            fwd, _, _, _ = run(METHODS[name], h, w, t, g, args.iters, args.warmup, cuda, METHOD_ENV.get(name),
                               forward_only=True, module=METHOD_MODULE.get(name))  # fmt: skip
        except torch.cuda.OutOfMemoryError as e:  # the materialized lanes may not fit
            print(f"{name:55s} out of memory: {str(e).splitlines()[0]}")
            results.append({"method": name, "error": "out of memory"})
            torch.cuda.empty_cache()
            continue
        grads[name] = gr
        peak_s = f"{peak / 2**20:15.0f}" if peak is not None else f"{'n/a':>15s}"
        bwd = med - fwd  # backward alone: forward + backward minus the forward, both medians
        ratio = f"{bwd / gemm_ms:8.2f}" if gemm_ms else f"{'n/a':>8s}"
        print(f"{name:55s} {med:10.2f} {best:9.2f} {peak_s} {path:>9s} {fwd:7.2f} {bwd:7.2f} {ratio}")
        results.append({"method": name, "median_ms": med, "min_ms": best, "peak_extra_bytes": peak,
                        "backward_path": path, "forward_ms": fwd, "backward_ms": bwd,
                        "backward_over_gemm": bwd / gemm_ms if gemm_ms else None})  # fmt: skip
        del gr
    ref_name = chosen[0]
    for name in chosen[1:]:
        if name in grads and ref_name in grads:
            for label, a, r in zip(("hidden", "weight"), grads[name], grads[ref_name]):
                err = ((a.float() - r.float()).abs().max() / r.float().abs().max()).item()
                print(f"grad_{label}: {name} vs {ref_name}: max relative difference {err:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": n, "dim": d, "vocab": v, "device": args.device, "forward_gemm_ms": gemm_ms,
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

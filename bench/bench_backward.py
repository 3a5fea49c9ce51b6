"""Forward + backward of the lm_head log-probabilities: detlogp.torch.linear_logp against plain
PyTorch (F.linear + log_softmax + autograd), time and peak memory.

Default shapes: Qwen3-8B's head (D = 4096, V = 151936), N = 4096 tokens, bf16. On a GPU:

    PYTHONPATH=build/python python3 bench/bench_backward.py [--json out.json]

Time: CUDA events around forward + backward, median of --iters after --warmup. Every timed case
(the cuBLAS forward GEMM, each method's forward + backward and its forward alone) is timed once
per repetition, round-robin in a fresh shuffled order, so all of them run in the same thermal and
power state (a GEMM timed alone on a cool GPU ran ~8 % faster than under the power cap the
backward runs at). Peak memory:
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
the cuBLAS bf16 forward GEMM (F.linear) measured in the same run (today's figure: docs/perf.md);
"ref fwd/fwd" is the torch materializing forward (bf16 F.linear, fp32 log_softmax over [N, V],
gather) over the method's forward, when "ref" is among the methods.
--profile prints the CUDA kernels of one forward, and of one forward + backward, of the contract
method (torch profiler), summed per kernel name, with the timeline of a short step: where the
time goes, and the gaps between kernels.

"contract-entropy" adds an entropy term to the loss, (logp * g).sum() - 0.01 * entropy.sum(),
through linear_logp(h, w, t, return_entropy=True) (docs/contract.md §10): its forward + backward
is printed as the ratio to "contract" (the same loss without the entropy term) timed in the same
round-robin, beside the goal of docs/perf.md (<= 1.05x). Where the installed detlogp.torch has no
return_entropy, or its backend does not serve the entropy, the case is skipped and says why.
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import detlogp.torch as dt
from detlogp.bench import harness
from detlogp.bench.harness import peak_extra_bytes, profile_kernels, round_robin
from detlogp.bench.methods import Context, detlogp_entropy_unavailable


def torch_reference(h, w, t):
    logits = F.linear(h, w)  # [N, V] bf16
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V] fp32
    mask = t != -100
    return logp.gather(1, t.clamp(min=0)[:, None])[:, 0] * mask


def detlogp_contract(h, w, t):
    return dt.linear_logp(h, w, t)[0]


def detlogp_torch_lane(h, w, t):
    return dt.linear_logp(h, w, t, backend=dt.TORCH_BACKEND_ID)[0]


ENTROPY_COEF = 0.01  # the entropy bonus of an RL loss: loss = (logp * g).sum() - ENTROPY_COEF * H.sum()
ENTROPY_GOAL = 1.05  # docs/perf.md: forward + backward with the entropy term over the same without


def detlogp_contract_entropy(h, w, t):
    """(logp, extra loss term): make_step adds the term to the loss."""
    logp, _lse, entropy = dt.linear_logp(h, w, t, return_entropy=True)
    return logp, -ENTROPY_COEF * entropy.sum()


def detlogp_loss(h, w, t):
    """(logp, extra): the loss inside the op (linear_logp_loss, three GEMMs), the same loss as the
    other methods' (logp * g).sum(): the per-token weights ride on loss_fn, and the extra term is
    that loss minus the (logp * g).sum() make_step adds, so the step's total is the op's loss."""
    g = _LOSS_WEIGHTS["g"]
    res = dt.linear_logp_loss(h, w, t, lambda logp, lse, rows: (logp * g[rows]).sum())
    return res.logp.detach(), res.loss - (res.logp.detach() * g).sum()


_LOSS_WEIGHTS = {}  # main() sets "g", the per-token weights of the loss


def make_step(fn, h, w, t, g, env=None, forward_only=False, module=None):
    """harness.make_step with module settings set on detlogp.torch."""
    return harness.make_step(fn, h, w, t, g, env, forward_only, module, settings_of=dt)


def entropy_unavailable(h, w, t):
    """Why the entropy case cannot run here (None when it can): the installed detlogp.torch lacks
    return_entropy, or its backend does not serve it (forward or backward)."""
    cap = torch.cuda.get_device_capability(h.device) if h.is_cuda else None
    return detlogp_entropy_unavailable(Context(h.device, cap))


METHODS = {
    "torch F.linear+log_softmax+autograd": torch_reference,
    "detlogp (contract fwd, chunked bwd)": detlogp_contract,
    "detlogp (contract fwd, chunked bwd, grad kernel without clusters)": detlogp_contract,
    "detlogp (contract fwd, chunked bwd, 1 GiB chunks)": detlogp_contract,
    "detlogp (contract fwd, torch chunk loop bwd)": detlogp_contract,
    "detlogp torch lane (fp32 F.linear fwd, chunked bwd)": detlogp_torch_lane,
    "detlogp (contract fwd, chunked bwd, entropy term in the loss)": detlogp_contract_entropy,
    "detlogp linear_logp_loss (loss inside the op)": detlogp_loss,
    "detlogp linear_logp_loss, 640 MiB chunks": detlogp_loss,
    "detlogp linear_logp_loss, 1280 MiB chunks": detlogp_loss,
}
METHOD_KEYS = dict(zip(("ref", "contract", "contract-nocluster", "contract-1gib", "contract-torchloop", "lane",
                        "contract-entropy", "loss", "loss-640m", "loss-1280m"), METHODS))  # fmt: skip
# Methods whose loss has the entropy term (their gradients are not the other methods').
ENTROPY_METHODS = {METHOD_KEYS["contract-entropy"]}
# Module settings of detlogp.torch set around a method's steps (free choices of the backward).
METHOD_MODULE = {
    "detlogp (contract fwd, chunked bwd, 1 GiB chunks)": {"BACKWARD_FUSED_CHUNK_BYTES": 1 << 30},
}
# Environment set around a method's steps.
METHOD_ENV = {
    "detlogp (contract fwd, torch chunk loop bwd)": {dt.FUSED_BACKWARD_ENV: "0"},
    "detlogp (contract fwd, chunked bwd, grad kernel without clusters)": {"DETLOGP_SM90_GRAD_CLUSTER": "1"},
    "detlogp linear_logp_loss, 640 MiB chunks": {"DETLOGP_TORCH_LOSS_CHUNK_BYTES": str(640 << 20)},
    "detlogp linear_logp_loss, 1280 MiB chunks": {"DETLOGP_TORCH_LOSS_CHUNK_BYTES": str(1280 << 20)},
}


def entropy_ratio(chosen, skipped, med, times):
    """The entropy case against the contract method of the same run: forward + backward (medians,
    and the median of the per-repetition ratios) and the forward alone. Printed with the goal."""
    name, base = METHOD_KEYS["contract-entropy"], METHOD_KEYS["contract"]
    if name not in chosen:
        return None
    if name in skipped:
        print(f"entropy fwd+bwd: SKIPPED ({skipped[name]}), goal <= {ENTROPY_GOAL:.2f}x")
        return {"skipped": skipped[name], "goal": ENTROPY_GOAL}
    if (base, "full") not in med or (name, "full") not in med:
        print(f"entropy fwd+bwd: not measured (needs both contract and contract-entropy timed), "
              f"goal <= {ENTROPY_GOAL:.2f}x")  # fmt: skip
        return None
    full = med[(name, "full")] / med[(base, "full")]
    paired = statistics.median(a / b for a, b in zip(times[(name, "full")], times[(base, "full")]))
    fwd = med[(name, "fwd")] / med[(base, "fwd")]
    verdict = "within" if paired <= ENTROPY_GOAL else "OVER"
    print(f"entropy fwd+bwd: contract-entropy / contract = {full:.3f}x (paired {paired:.3f}x), goal <= "
          f"{ENTROPY_GOAL:.2f}x: {verdict}; forward alone {fwd:.3f}x")  # fmt: skip
    return {"full_ratio": full, "full_ratio_paired": paired, "forward_ratio": fwd, "goal": ENTROPY_GOAL}


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
        help="comma-separated subset of: ref, contract, contract-nocluster, contract-1gib, contract-torchloop, lane, "
        "contract-entropy",
    )  # fmt: skip
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", action="store_true", help="print the kernels of one contract forward + backward")
    ap.add_argument("--profile-loss", action="store_true",
                    help="print the kernels of one linear_logp_loss forward + backward (each chunk size chosen, "
                         "else the default)")
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
    _LOSS_WEIGHTS["g"] = g
    chosen = list(METHODS) if args.methods == "all" else [METHOD_KEYS[k] for k in args.methods.split(",")]
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}")
    print(f"N={n} D={d} V={v} bf16, forward + backward (hidden and weight gradients), torch-loop chunk "
          f"{dt.BACKWARD_VOCAB_CHUNK}, fused chunk {dt._fused_chunk_rows(n, v)}")  # fmt: skip
    # The forward GEMM the backward is measured against: cuBLAS bf16 F.linear (what torch calls).
    cases = {}
    if cuda:
        cases["gemm"], _ = make_step(lambda a, b, _t: F.linear(a, b), h, w, t, g, forward_only=True)
    grads_of, peaks, paths, failed, skipped = {}, {}, {}, set(), {}
    for name in chosen:
        if name in ENTROPY_METHODS:
            why = entropy_unavailable(h, w, t)
            if why:
                print(f"{name}: SKIPPED: {why}")
                skipped[name] = why
                continue
        env, module = METHOD_ENV.get(name), METHOD_MODULE.get(name)
        full, grads_of[name] = make_step(METHODS[name], h, w, t, g, env, module=module)
        fwd_only, _ = make_step(METHODS[name], h, w, t, g, env, forward_only=True, module=module)
        try:
            dt._last_backward["path"] = None
            if cuda:
                peaks[name] = peak_extra_bytes(full)
            else:
                full()  # one step, for the backward path
                peaks[name] = None
            paths[name] = dt.last_backward_path() or "-"
        except torch.cuda.OutOfMemoryError as e:  # the materialized lanes may not fit
            print(f"{name:55s} out of memory: {str(e).splitlines()[0]}")
            failed.add(name)
            torch.cuda.empty_cache()
            continue
        cases[(name, "full")] = full
        cases[(name, "fwd")] = fwd_only
    times = round_robin(cases, args.iters, args.warmup, cuda)
    med = {k: statistics.median(v) for k, v in times.items()}
    gemm_ms = med.get("gemm")
    if gemm_ms is not None:
        print(f"cuBLAS bf16 forward GEMM (F.linear): {gemm_ms:.2f} ms (median, timed round-robin with the methods)")
    ref_fwd = med.get((chosen[0], "fwd")) if chosen[0] == METHOD_KEYS["ref"] else None
    print(f"{'method':55s} {'median ms':>10s} {'min ms':>9s} {'peak extra MiB':>15s} {'bwd path':>9s} "
          f"{'fwd ms':>7s} {'bwd ms':>7s} {'bwd/GEMM':>8s} {'fwd/GEMM':>8s} {'ref fwd/fwd':>11s}")  # fmt: skip
    results = []
    grads = {}
    for name in chosen:
        if name in failed:
            results.append({"method": name, "error": "out of memory"})
            continue
        if name in skipped:
            results.append({"method": name, "skipped": skipped[name]})
            continue
        grads[name] = grads_of[name]()
        full, fwd, best = med[(name, "full")], med[(name, "fwd")], min(times[(name, "full")])
        peak = peaks[name]
        peak_s = f"{peak / 2**20:15.0f}" if peak is not None else f"{'n/a':>15s}"
        bwd = full - fwd  # backward alone: forward + backward minus the forward, both medians
        ratio = f"{bwd / gemm_ms:8.2f}" if gemm_ms else f"{'n/a':>8s}"
        fwd_ratio = f"{fwd / gemm_ms:8.3f}" if gemm_ms else f"{'n/a':>8s}"
        ref_ratio = f"{ref_fwd / fwd:11.3f}" if ref_fwd else f"{'n/a':>11s}"
        print(f"{name:55s} {full:10.2f} {best:9.2f} {peak_s} {paths[name]:>9s} {fwd:7.2f} {bwd:7.2f} {ratio} "
              f"{fwd_ratio} {ref_ratio}")  # fmt: skip
        results.append({"method": name, "median_ms": full, "min_ms": best, "peak_extra_bytes": peak,
                        "backward_path": paths[name], "forward_ms": fwd, "backward_ms": bwd,
                        "backward_over_gemm": bwd / gemm_ms if gemm_ms else None,
                        "forward_over_gemm": fwd / gemm_ms if gemm_ms else None,
                        "ref_forward_over_forward": ref_fwd / fwd if ref_fwd else None})  # fmt: skip
    profile = None
    if args.profile and cuda:
        profile = {
            "forward": profile_kernels(make_step(detlogp_contract, h, w, t, g, forward_only=True)[0],
                                       "contract forward"),
            "forward+backward": profile_kernels(make_step(detlogp_contract, h, w, t, g)[0],
                                                "contract forward + backward"),
        }  # fmt: skip
    if args.profile_loss and cuda:
        profile = dict(profile or {})
        loss_methods = [m for m in chosen if METHODS[m] is detlogp_loss] or [METHOD_KEYS["loss"]]
        for name in loss_methods:  # each chunk size chosen, under its own environment
            profile[name] = profile_kernels(make_step(detlogp_loss, h, w, t, g, METHOD_ENV.get(name))[0],
                                            f"{name}: forward + backward")  # fmt: skip
    entropy = entropy_ratio(chosen, skipped, med, times)
    ref_name = chosen[0]
    for name in chosen[1:]:
        if name in ENTROPY_METHODS or ref_name in ENTROPY_METHODS:
            continue  # another loss: other gradients
        if name in grads and ref_name in grads:
            for label, a, r in zip(("hidden", "weight"), grads[name], grads[ref_name]):
                err = ((a.float() - r.float()).abs().max() / r.float().abs().max()).item()
                print(f"grad_{label}: {name} vs {ref_name}: max relative difference {err:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": n, "dim": d, "vocab": v, "device": args.device, "forward_gemm_ms": gemm_ms,
                       "iters": args.iters, "results": results, "entropy": entropy, "profile": profile}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

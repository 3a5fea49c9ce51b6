"""detlogp.bench: detlogp.torch as a user measures it, against torch's own ops and the installed peers.

    python -m detlogp.bench [--heads qwen3-8b|llama3-8b|qwen3-0.6b|all] [--quick] [--csv out.csv]

Times, in one run and on the same data:
- detlogp.torch.linear_logp: the trainer entry, the serving entry (return_logits=True), the
  entropy output (return_entropy=True) and the trainer's replay of a sampling program
  (sampling=, top-k 50 and top-p 0.95; ratio_vs_ref against the trainer entry);
- detlogp.torch.sample with every filter on (T 0.9, top-k 50, top-p 0.95, min-p 0.05), in the
  decode suite (ratio_vs_ref against the trainer entry);
- torch: F.linear (the bf16 GEMM alone: every ratio_vs_linear divides by it), the fp32-output
  GEMM torch.ops.aten.mm.dtype (the serving entry's reference), and the materializing logprob
  (F.linear -> float -> log_softmax -> gather, with and without the entropy);
- every installed peer: liger-kernel's fused linear cross entropy (Triton), its SM90 fused scaled
  cross entropy (CuTe DSL) with and without the entropy, Apple's cut-cross-entropy. A peer that
  cannot run is listed with the reason (not installed, no GPU, the wrong architecture, the text of
  its import error), in the output and in the CSV (status "skipped").

Suites, per head (--heads; --dim/--vocab for another shape):
- decode-eager: N = 1, 8, 64, 256, each call from an idle GPU, so a call's host time counts;
- decode-graph: the same calls captured in a CUDA graph and replayed (no host time);
- trainer-forward: N = 1024, 4096, 16384;
- forward+backward: N = 4096, the loss sum(logp * g) (minus 0.01 * sum(entropy) for the entropy
  methods), hidden and weight gradients; peak extra memory with the gradients included. The
  torch-linear row there is the forward GEMM alone, the ratios' denominator; a detlogp method's
  ratio_vs_ref divides by the fastest other method with the same loss.

Method: hidden states RMS-normalized, an N(0, 0.02) bf16 head, every third row peaked on its
target (detlogp/bench/data.py); CUDA events; the L2 flushed (256 MiB memset) and the GPU drained
before every timed call; every method of a suite timed once per repetition in a fresh shuffled
order (fixed seed), after warm-up calls; the median of the repetitions, and the median of the
per-repetition ratios ("paired"). Peak memory: torch.cuda.max_memory_allocated() above what was
allocated before one call (outputs, transients and gradients).

Columns besides the time: batch_invariant (are a few rows' output bits the same computed alone, in
N = 64, and in the large batch shifted by one row?), max_abs_err_logp and max_abs_err_entropy (the
first 8 rows against float64 computed from the same bf16 inputs), gflops (2 N D V per forward, 6 N
D V per forward + backward), and the run's metadata on every row (GPU, versions, date, git sha,
the command that reproduces it). The CSV goes to --csv, the plot to --png (matplotlib; the run says
when it skipped it).

Without a CUDA device (or with --device cpu) it runs on the CPU: small shapes (--heads cpu-small,
D = 1024, V = 32000), time.perf_counter medians, no L2 flush, the CUDA-only methods and CUDA
graphs skipped with their reason, plus torch's fp32 matmul + logsumexp as the CPU reference.

Adding a method (another benchmark, e.g. of a backend under work): build a detlogp.bench.Method
and register_method(it) before main() / run(); it is then timed in the suites its modes name, with
the same columns.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import List, Optional

from .data import HEADS, Inputs, fp64_reference, make_inputs
from .methods import (
    DECODE,
    FWDBWD,
    REFERENCE,
    TRAINER,
    Context,
    Method,
    register_method,
    registered_methods,
    unregister_method,
)

__all__ = [
    "DECODE",
    "FWDBWD",
    "HEADS",
    "TRAINER",
    "Context",
    "Inputs",
    "Method",
    "REFERENCE",
    "fp64_reference",
    "main",
    "make_inputs",
    "register_method",
    "registered_methods",
    "run",
    "unregister_method",
]

MAIN_HEADS = ("qwen3-8b", "llama3-8b", "qwen3-0.6b")
# Repetitions per suite: (eager, graph, trainer, fwdbwd).
REPS = {"gpu": (30, 30, 15, 10), "gpu-quick": (10, 10, 6, 5), "cpu": (10, 0, 5, 3), "cpu-quick": (3, 0, 3, 2)}
SIZES = {  # (decode N, trainer N, forward + backward N)
    "gpu": ("1,8,64,256", "1024,4096,16384", "4096"),
    "gpu-quick": ("1,8,64,256", "1024,4096", "4096"),
    "cpu": ("1,8", "64,256", "64"),
    "cpu-quick": ("1", "64", "64"),
}


def _ints(text: str, flag: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}")
    bad = [n for n in out if n < 1]
    if bad:
        raise SystemExit(f"{flag}: every N must be >= 1, got {bad}")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m detlogp.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees a CUDA device; cpu "
                    "times detlogp's CPU backend (unless DETLOGP_BACKEND says otherwise)")  # fmt: skip
    ap.add_argument("--heads", help=f"comma-separated of {', '.join(HEADS)}, or 'all' ({', '.join(MAIN_HEADS)}); "
                    "default qwen3-8b on a GPU, cpu-small on the CPU")  # fmt: skip
    ap.add_argument("--dim", type=int, help="a head of this D (with --vocab) instead of --heads")
    ap.add_argument("--vocab", type=int, help="a head of this V (with --dim) instead of --heads")
    ap.add_argument("--modes", default="decode,graph,trainer,fwdbwd", help="comma-separated of decode, graph, "
                    "trainer, fwdbwd (default all)")  # fmt: skip
    ap.add_argument("--decode-n", help="decode N (default 1,8,64,256; CPU 1,8)")
    ap.add_argument("--trainer-n", help="trainer-forward N (default 1024,4096,16384; --quick 1024,4096; CPU 64,256)")
    ap.add_argument("--fwdbwd-n", help="forward + backward N (default 4096; CPU 64)")
    ap.add_argument("--methods", help="comma-separated method keys (torch-linear is always timed); --list shows them")
    ap.add_argument("--reps", type=int, help="repetitions of every suite (default 30 decode, 15 trainer, 10 "
                    "forward + backward; --quick 10, 6, 5; CPU 10, 5, 3)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls of every method before a suite (default 2)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (and no N = 16384 on a GPU)")
    ap.add_argument("--time-budget", type=float,
                    help="seconds: suites that would start later are skipped (their rows say so)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default="detlogp-bench.csv", help="where the CSV goes (default detlogp-bench.csv)")
    ap.add_argument("--png", help="where the plot goes (default: the CSV's name with .png; 'none': no plot)")
    ap.add_argument("--list", action="store_true", help="list the methods and whether they can run here, then exit")
    ap.add_argument("--table", metavar="CSV", help="print the markdown tables (the README's) of a run's CSV, then exit")
    return ap


def config_from_args(args, argv: List[str]):
    import torch

    from . import report
    from .run import MODE_EAGER, MODE_FWDBWD, MODE_GRAPH, MODE_TRAINER, Config

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    kind = ("gpu" if device.type == "cuda" else "cpu") + ("-quick" if args.quick else "")
    if (args.dim is None) != (args.vocab is None):
        raise SystemExit("--dim and --vocab go together (a custom head)")
    if args.dim is not None:
        if args.dim < 1 or args.vocab < 1:
            raise SystemExit(f"--dim and --vocab must be >= 1, got {args.dim} and {args.vocab}")
        heads = [(f"custom-{args.dim}x{args.vocab}", args.dim, args.vocab)]
    else:
        names = args.heads or ("qwen3-8b" if device.type == "cuda" else "cpu-small")
        names = list(MAIN_HEADS) if names == "all" else [x for x in names.split(",") if x]
        unknown = [x for x in names if x not in HEADS]
        if unknown:
            raise SystemExit(f"--heads: unknown head(s) {unknown}; known: {', '.join(HEADS)}, all")
        heads = [(x, *HEADS[x]) for x in names]
    modes = [x for x in args.modes.split(",") if x]
    bad = [x for x in modes if x not in (DECODE, "graph", TRAINER, FWDBWD)]
    if bad:
        raise SystemExit(f"--modes: unknown mode(s) {bad}; known: decode, graph, trainer, fwdbwd")
    dn, tn, fn = SIZES[kind]
    reps = dict(zip((MODE_EAGER, MODE_GRAPH, MODE_TRAINER, MODE_FWDBWD), REPS[kind]))
    if args.reps is not None:
        if args.reps < 1:
            raise SystemExit(f"--reps must be >= 1, got {args.reps}")
        reps = dict.fromkeys(reps, args.reps)
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    return Config(
        device=device, heads=heads, modes=modes,
        decode_n=_ints(args.decode_n or dn, "--decode-n"), trainer_n=_ints(args.trainer_n or tn, "--trainer-n"),
        fwdbwd_n=_ints(args.fwdbwd_n or fn, "--fwdbwd-n"), reps=reps, warmup=args.warmup,
        only=[x for x in args.methods.split(",") if x] if args.methods else None, seed=args.seed,
        time_budget_s=args.time_budget, meta=report.metadata(device, argv),
    )  # fmt: skip


def run(cfg) -> List[dict]:
    """Runs the suites of a detlogp.bench.run.Config; returns the rows (dicts keyed by the CSV's
    columns)."""
    from .run import Runner

    return Runner(cfg).run()


CPU_BACKEND = "cpu-linear-logp-contract-v1"


@contextlib.contextmanager
def _cpu_run_backend(device):
    """A CPU run times detlogp's CPU backend: on a machine with an SM90 GPU, `auto` would serve the
    host tensors there (through host-to-device copies), which is not what a CPU run measures. A
    DETLOGP_BACKEND already set still chooses."""
    if device.type != "cpu" or os.environ.get("DETLOGP_BACKEND"):
        yield
        return
    os.environ["DETLOGP_BACKEND"] = CPU_BACKEND
    try:
        yield
    finally:
        os.environ.pop("DETLOGP_BACKEND", None)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    from . import report

    if args.table:
        print(report.markdown(report.read_csv(args.table)))
        return 0
    cfg = config_from_args(args, argv)
    with _cpu_run_backend(cfg.device):
        return _main(args, cfg)


def _main(args, cfg) -> int:
    from . import report
    from .run import Runner

    runner = Runner(cfg)
    if args.list:
        for m in runner.methods:
            why = runner.skip.get(m.key)
            print(f"{m.key:28s} {'/'.join(m.modes):22s} {'runs here' if not why else 'skipped: ' + why}")
        return 0
    meta = cfg.meta
    print(f"detlogp.bench: {meta['gpu']}, torch {meta['torch_version']}, detlogp {meta['detlogp_version']}, "
          f"{meta['date']}{', ' + meta['git_sha'] if meta['git_sha'] else ''}")  # fmt: skip
    rows = runner.run()
    report.write_csv(rows, args.csv)
    print(f"wrote {args.csv} ({len(rows)} rows)")
    png = args.png or (args.csv[:-4] if args.csv.endswith(".csv") else args.csv) + ".png"
    if png != "none":
        why = report.write_png(rows, png)
        print(f"wrote {png}" if why is None else f"PNG skipped: {why}")
    print("skipped or failed:")
    report.print_skips(rows)
    print(report.markdown(rows))
    return 0

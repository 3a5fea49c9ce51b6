#!/usr/bin/env python3
"""Time vs N per path from a bench_sm90 CSV (bench/results/*.csv) as a PNG, and the markdown table
the README shows. Reads the CSV as written (with or without the git_sha column).

    python3 bench/plot_bench.py bench/results/h200-2026-11-30-run89.csv --png out.png [--table]
"""
import argparse
import csv
import sys

PATHS = [  # (CSV method, legend)
    ("cublas_gemm_bf16out", "cuBLAS GEMM, bf16 logits (F.linear)"),
    ("cublas_gemm_f32out", "cuBLAS GEMM, fp32 logits"),
    ("cublas_f32+log_softmax", "cuBLAS fp32 logits + log-softmax (materializing)"),
    ("detlogp_trainer", "detlogp trainer entry (fused, no logits)"),
    ("detlogp_serving", "detlogp serving entry (fp32 logits stored)"),
]


def load(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--png", help="write the plot here")
    ap.add_argument("--table", action="store_true", help="print the markdown table")
    args = ap.parse_args(argv)
    rows = load(args.csv)
    if not rows:
        sys.exit(f"{args.csv}: no rows")
    # A --reference-only run may time several data kinds (the data column, absent in older CSVs):
    # one kind is drawn, the first.
    kinds = list(dict.fromkeys(r.get("data") or "" for r in rows))
    if len(kinds) > 1:
        print(f"{args.csv}: data kinds {', '.join(kinds)}; drawing {kinds[0]}", file=sys.stderr)
        rows = [r for r in rows if (r.get("data") or "") == kinds[0]]
    ns = sorted({int(r["N"]) for r in rows})
    ms = {(r["method"], int(r["N"])): float(r["ms_median"]) for r in rows}
    floor = float(rows[0]["hbm_floor_ms"])
    head = rows[0]
    title = (f"{head['gpu']}, D={head['D']} V={head['V']} bf16, {head['date'][:10]}"
             f"{', ' + head['git_sha'] if head.get('git_sha') else ''}")  # fmt: skip
    # Median of the per-repetition ratios (CSVs with the ratio_vs_cublas_bf16out_paired column), else absent.
    paired = {int(r["N"]): float(r["ratio_vs_cublas_bf16out_paired"])
              for r in rows if r["method"] == "detlogp_trainer" and r.get("ratio_vs_cublas_bf16out_paired")}  # fmt: skip
    if args.table:
        extra = " trainer / cuBLAS bf16, paired |" if paired else ""
        print("| N | " + " | ".join(label for _, label in PATHS) + " | trainer / cuBLAS bf16 |" + extra +
              " trainer / HBM floor |")  # fmt: skip
        print("|---" * (len(PATHS) + 3 + (1 if paired else 0)) + "|")
        for n in ns:
            cells = [f"{ms[(m, n)]:.3f}" if (m, n) in ms else "" for m, _ in PATHS]
            t, c = ms.get(("detlogp_trainer", n)), ms.get(("cublas_gemm_bf16out", n))
            ratio = f"{t / c:.2f}" if t and c else ""
            pr = (f" {paired[n]:.3f} |" if n in paired else " |") if paired else ""
            fl = f"{t / floor:.2f}" if t and n <= 64 else ""
            print(f"| {n} | " + " | ".join(cells) + f" | {ratio} |{pr} {fl} |")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
        for m, label in PATHS:
            pts = [(n, ms[(m, n)]) for n in ns if (m, n) in ms]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(floor, color="gray", linestyle=":", label=f"HBM floor (weight bytes / copy rate) {floor:.3f} ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (rows)")
        ax.set_ylabel("time, ms (median, cold L2)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

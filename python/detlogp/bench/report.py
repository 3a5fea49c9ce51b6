"""What a run writes: the CSV (every row with the run's metadata) and the PNG (ratio to F.linear
against N per mode, and forward + backward time and memory, one row of panels per head)."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import shlex
import subprocess
import sys
from typing import Dict, List, Optional

import torch

from .run import COLUMNS, MODE_EAGER, MODE_FWDBWD, MODE_GRAPH, MODE_TRAINER


def git_sha() -> str:
    """BENCH_GIT_SHA when set (a copied tree), else the commit of the checkout this module sits in
    (with -dirty when tracked files differ from it), else empty."""
    env = os.environ.get("BENCH_GIT_SHA")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def metadata(device: torch.device, argv: List[str]) -> Dict[str, str]:
    import detlogp

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        # The load average says how far other work on the machine moved the wall-clock figures.
        load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
        gpu = f"none (CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads{load})"
    return {
        "device": device.type,
        "gpu": gpu,
        "torch_version": torch.__version__,
        "detlogp_version": getattr(detlogp, "__version__", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_sha": git_sha(),
        "command": " ".join(["python", "-m", "detlogp.bench"] + [shlex.quote(a) for a in argv]),
    }


def write_csv(rows: List[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})


def write_png(rows: List[dict], path: str) -> Optional[str]:
    """Writes the plot; returns None, or why it was not written (matplotlib missing, nothing to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e})"
    ok = [r for r in rows if r["status"] == "ok" and r["ms_median"]]
    heads = list(dict.fromkeys(r["head"] for r in ok))
    if not heads:
        return "no timed rows to plot"
    cols = [MODE_EAGER, MODE_TRAINER, MODE_FWDBWD]
    # One colour per method in every panel, in the order the methods first appear.
    tab20 = plt.get_cmap("tab20").colors
    palette = tab20[0::2] + tab20[1::2]  # ten distinct hues first, then their light shades
    color = {k: palette[i % len(palette)] for i, k in enumerate(dict.fromkeys(r["method"] for r in ok))}
    fig, axes = plt.subplots(len(heads), len(cols), figsize=(15, 4.2 * len(heads)), dpi=110, squeeze=False)
    meta = rows[0]
    for i, head in enumerate(heads):
        hr = [r for r in ok if r["head"] == head]
        dv = f"D={hr[0]['D']} V={hr[0]['V']}"
        for j, mode in enumerate(cols):
            ax = axes[i][j]
            if mode == MODE_FWDBWD:
                _bars(ax, [r for r in hr if r["mode"] == mode], f"{head} {dv}: forward + backward", color)
                continue
            modes = [MODE_EAGER, MODE_GRAPH] if mode == MODE_EAGER else [mode]
            for mm in modes:
                by = {}
                for r in hr:
                    if r["mode"] == mm and r["ratio_vs_linear"]:
                        by.setdefault(r["method"], []).append((int(r["N"]), float(r["ratio_vs_linear"])))
                for key, pts in by.items():
                    pts.sort()
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if mm != MODE_GRAPH else "s",
                            linestyle="-" if mm != MODE_GRAPH else "--", color=color[key],
                            label=key + (" (graph)" if mm == MODE_GRAPH else ""))  # fmt: skip
            ax.axhline(1.0, color="gray", linestyle=":")
            ax.set_xscale("log", base=2)
            lo, hi = ax.get_ylim()
            if lo > 0 and hi / lo > 20:
                ax.set_yscale("log")
            ax.set_xlabel("N (rows)")
            ax.set_ylabel("time / torch F.linear (same run)")
            ax.set_title(f"{head} {dv}: {'decode' if mode == MODE_EAGER else 'trainer forward'}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6)
    fig.suptitle(f"{meta['gpu']}, torch {meta['torch_version']}, detlogp {meta['detlogp_version']}, "
                 f"{meta['date'][:10]}{', ' + meta['git_sha'] if meta['git_sha'] else ''} "
                 f"({'median, cold L2' if meta['device'] == 'cuda' else 'median, wall clock'})",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return None


def _bars(ax, rows: List[dict], title: str, color: Dict[str, tuple]) -> None:
    if not rows:
        ax.set_axis_off()
        ax.set_title(title + " (not run)", fontsize=9)
        return
    n = rows[0]["N"]
    rows = [r for r in rows if r["N"] == n]
    keys = [r["method"] for r in rows]
    ms = [float(r["ms_median"]) for r in rows]
    bars = ax.barh(keys, ms, color=[color[k] for k in keys])
    for b, r in zip(bars, rows):
        mib = r.get("peak_extra_mib")
        label = f" {float(r['ms_median']):.4g} ms" + (f", {float(mib) / 1024:.2f} GiB" if mib else "")
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, label, va="center", fontsize=6)
    ax.set_xlabel("ms (median; torch-linear: the forward GEMM alone)")
    ax.set_title(f"{title}, N = {n}", fontsize=9)
    ax.tick_params(axis="y", labelsize=6)


def print_skips(rows: List[dict], out=sys.stdout) -> None:
    seen = set()
    for r in rows:
        if r["status"] in ("skipped", "failed"):
            k = (r["method"], r["status"], r["reason"])
            if k not in seen:
                seen.add(k)
                print(f"  {r['method']} ({r['mode']}{', N=' + str(r['N']) if r['N'] != '' else ''}): {r['status']}: "
                      f"{r['reason']}", file=out)  # fmt: skip


def read_csv(path: str) -> List[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def markdown(rows: List[dict]) -> str:
    """The README's tables from a run's rows, per head: each method's time over F.linear's per
    suite and N (paired ratio in parentheses), then each method's columns that do not depend on N
    (batch invariance, accuracy) and its forward + backward time and peak extra memory."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    meta = rows[0] if rows else {}
    if meta:
        sha = ", " + meta["git_sha"] if meta["git_sha"] else ""
        out.append(f"{meta['gpu']}, torch {meta['torch_version']}, detlogp {meta['detlogp_version']}, "
                   f"{meta['date'][:10]}{sha}: `{meta['command']}`")  # fmt: skip
    for head in dict.fromkeys(r["head"] for r in ok):
        hr = [r for r in ok if r["head"] == head]
        keys = list(dict.fromkeys(r["method"] for r in hr if r["method"] != "torch-linear"))
        out.append(f"\n{head} (D = {hr[0]['D']}, V = {hr[0]['V']}): time / torch F.linear of the same run "
                   "(paired), F.linear in ms\n")  # fmt: skip
        out.append("| suite | N | F.linear ms | " + " | ".join(f"`{k}`" for k in keys) + " |")
        out.append("|---" * (3 + len(keys)) + "|")
        cells = {(r["mode"], r["N"], r["method"]): r for r in hr}
        for mode, n in dict.fromkeys((r["mode"], r["N"]) for r in hr):
            ref = cells.get((mode, n, "torch-linear"))
            line = [mode, n, f"{float(ref['ms_median']):.4g}" if ref else ""]
            for k in keys:
                c = cells.get((mode, n, k))
                line.append(f"{float(c['ratio_vs_linear']):.3f} ({float(c['ratio_vs_linear_paired']):.3f})"
                            if c and c["ratio_vs_linear"] else "")  # fmt: skip
            out.append("| " + " | ".join(line) + " |")
        out.append("\n| method | batch-invariant | max abs logp error vs fp64 | max abs entropy error | "
                   "forward + backward ms (N) | peak extra GiB |")  # fmt: skip
        out.append("|---|---|---|---|---|---|")
        for k in keys:
            mine = [r for r in hr if r["method"] == k]
            fb = next((r for r in mine if r["mode"] == MODE_FWDBWD), None)
            first = mine[0]
            gib = f"{float(fb['peak_extra_mib']) / 1024:.2f}" if fb and fb["peak_extra_mib"] else ""
            out.append(f"| `{k}` | {first['batch_invariant']} | {first['max_abs_err_logp']} | "
                       f"{first['max_abs_err_entropy']} | {fb['ms_median'] + ' (' + fb['N'] + ')' if fb else ''} | "
                       f"{gib} |")  # fmt: skip
    why_not: Dict[str, List[str]] = {}
    for r in rows:
        if r["status"] != "ok" and r["method"] not in why_not.setdefault(r["reason"], []):
            why_not[r["reason"]].append(r["method"])
    if why_not:
        out.append("\nNot timed: " + "; ".join(", ".join(f"`{k}`" for k in ks) + f" ({why})"
                                               for why, ks in why_not.items()) + ".")  # fmt: skip
    return "\n".join(out)

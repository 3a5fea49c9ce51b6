"""The suites of `python -m detlogp.bench` and the rows they produce (one per head, mode, N and
method; one per head, mode and method for a method that was skipped)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import harness
from .data import HEAD_LABELS, fp64_reference, make_inputs
from .methods import DECODE, FWDBWD, REFERENCE, TRAINER, Context, Method, registered_methods

MODE_EAGER, MODE_GRAPH = "decode-eager", "decode-graph"
MODE_TRAINER, MODE_FWDBWD = "trainer-forward", "forward+backward"
COLUMNS = [
    "head", "D", "V", "mode", "N", "method", "label", "status", "reason", "reps", "ms_median", "ms_min",
    "ratio_vs_linear", "ratio_vs_linear_paired", "ref_method", "ratio_vs_ref", "gflops", "peak_extra_mib",
    "batch_invariant", "invariance_detail", "max_abs_err_logp", "max_abs_err_entropy", "detlogp_backend",
    "device", "gpu", "torch_version", "detlogp_version", "date", "git_sha", "command",
]  # fmt: skip
INVARIANCE_ROWS = (0, 1, 2, 5)  # rows checked alone, in a small batch, in a large one and shifted by one
INVARIANCE_MAX_N = 4096  # the large batch of the check: the run's largest N, at most this
ACCURACY_ROWS = 8  # the first rows (every third one peaked) against float64


@dataclass
class Config:
    device: torch.device
    heads: List[Tuple[str, int, int]]  # (name, D, V)
    modes: Sequence[str]  # of "decode", "graph", "trainer", "fwdbwd"
    decode_n: Sequence[int]
    trainer_n: Sequence[int]
    fwdbwd_n: Sequence[int]
    reps: Dict[str, int]  # per mode of MODE_*
    warmup: int = 2
    only: Optional[Sequence[str]] = None  # method keys (None: every registered method)
    seed: int = 0
    time_budget_s: Optional[float] = None
    meta: Dict[str, str] = field(default_factory=dict)  # the metadata columns of every row


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


class Runner:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        dev = cfg.device
        cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        self.ctx = Context(dev, cap)
        self.cuda = dev.type == "cuda"
        self.timer = harness.Timer(dev)
        chosen = registered_methods()
        if cfg.only is not None:
            known = {m.key for m in chosen}
            unknown = [k for k in cfg.only if k not in known]
            if unknown:
                raise ValueError(f"--methods: unknown method(s) {unknown}; known: {sorted(known)}")
            chosen = [m for m in chosen if m.key in cfg.only or m.key == REFERENCE]
        self.methods = chosen
        self.skip: Dict[str, Optional[str]] = {}
        for m in chosen:
            try:
                self.skip[m.key] = m.available(self.ctx)
            except Exception as e:  # noqa: BLE001 - a check that raises skips its method, with its words
                self.skip[m.key] = f"availability check failed: {_reason(e)}"
        self.rows: List[dict] = []
        self.t0 = time.monotonic()

    # ---- rows ----------------------------------------------------------------------------------

    def _row(self, head, mode, n, m: Method, status, reason="", **cols) -> dict:
        name, d, v = head
        row = dict.fromkeys(COLUMNS, "")
        row.update(head=name, D=d, V=v, mode=mode, N="" if n is None else n, method=m.key, label=m.label,
                   status=status, reason=reason)  # fmt: skip
        row.update(cols)
        row.update(self.cfg.meta)
        row = {k: "" if val is None else str(val) for k, val in row.items()}  # as the CSV reads back
        self.rows.append(row)
        return row

    def _skipped_rows(self, head, mode, ms: List[Method], emitted: set, reason_of=None) -> List[Method]:
        """Emits a skipped row for each method that cannot run here (once per head and mode) and
        returns the others."""
        runnable = []
        for m in ms:
            why = reason_of(m) if reason_of else self.skip.get(m.key)
            if why:
                if (mode, m.key) not in emitted:
                    emitted.add((mode, m.key))
                    self._row(head, mode, None, m, "skipped", why)
            else:
                runnable.append(m)
        return runnable

    def _over_budget(self) -> bool:
        b = self.cfg.time_budget_s
        return b is not None and time.monotonic() - self.t0 > b

    # ---- suites --------------------------------------------------------------------------------

    def _timed_suite(self, head, mode, n, cases: Dict[str, callable], trial_rows: Dict[str, dict],
                     by_key: Dict[str, Method], flops: float, ref_of) -> None:  # fmt: skip
        """Round-robin over the cases that passed their trial call, then one row per case."""
        reps = self.cfg.reps[mode]
        times = harness.round_robin(cases, reps, self.cfg.warmup, self.cuda, self.cfg.seed + n, timer=self.timer)
        med = harness.medians(times)
        ref_ms, ref_times = med.get(REFERENCE), times.get(REFERENCE)
        print(f"  {mode} N={n}: {reps} reps" + (f", F.linear {ref_ms:.4f} ms" if ref_ms else ""))
        for key in cases:
            m = by_key[key]
            ms = med[key]
            row = dict(reps=reps, ms_median=f"{ms:.5g}", ms_min=f"{min(times[key]):.5g}",
                       gflops=f"{flops / (ms * 1e-3) / 1e9:.4g}")  # fmt: skip
            if ref_ms:
                row["ratio_vs_linear"] = f"{ms / ref_ms:.4f}"
                row["ratio_vs_linear_paired"] = f"{harness.paired_ratio(times[key], ref_times):.4f}"
            ref_key = ref_of(m, med)
            if ref_key and ref_key in med:
                row["ref_method"] = ref_key
                row["ratio_vs_ref"] = f"{ms / med[ref_key]:.4f}"
            row.update(trial_rows.get(key, {}))
            self._row(head, mode, n, m, "ok", **row)
            extra = f"  {row['ref_method']} x{row['ratio_vs_ref']}" if row.get("ratio_vs_ref") else ""
            mib = f"  peak +{row['peak_extra_mib']} MiB" if row.get("peak_extra_mib") not in (None, "") else ""
            print(f"    {key:28s} {ms:10.4f} ms  x{row.get('ratio_vs_linear', '-'):>7s}{extra}{mib}")

    def _trial(self, head, mode, n, m: Method, step, reset=None) -> Optional[dict]:
        """Two untimed calls: the first compiles, autotunes and allocates, the second gives the peak
        memory on a GPU (an autotuner's trial buffers left out). reset (forward + backward: the
        gradients set to None) runs between them, so that what the step keeps, the gradients
        included, counts in its peak. None and a failed row when one raises."""
        try:
            if self.cuda:
                step()
                if reset is not None:
                    reset()
                peak = harness.peak_extra_bytes(step)
                return {"peak_extra_mib": f"{peak / 2**20:.1f}"}
            step()
            return {}
        except Exception as e:  # noqa: BLE001 - out of memory, a refusal: the row says which
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            self._row(head, mode, n, m, "failed", _reason(e))
            print(f"    {m.key:28s} failed: {_reason(e)}")
            return None

    def _backend_of(self, m: Method) -> str:
        if m.kind != "detlogp":
            return ""
        import detlogp.torch as dt

        rep = dt.last_report()
        return rep.get("backend_id", "") if rep else ""

    def forward_suite(self, head, inp, mode, n, emitted) -> None:
        ms = [m for m in self.methods if (DECODE if mode == MODE_EAGER else TRAINER) in m.modes]
        ms = self._skipped_rows(head, mode, ms, emitted)
        h, w, t = inp.hidden[:n], inp.weight, inp.targets[:n]
        cases, trial, by_key = {}, {}, {}
        with torch.no_grad():
            for m in ms:
                step = (lambda m=m: m.forward(h, w, t))
                res = self._trial(head, mode, n, m, step)
                if res is None:
                    continue
                res["detlogp_backend"] = self._backend_of(m)
                cases[m.key], trial[m.key], by_key[m.key] = step, res, m
            if cases:
                self._timed_suite(head, mode, n, cases, trial, by_key, 2.0 * n * head[1] * head[2],
                                  lambda m, med: m.ratio_ref)  # fmt: skip

    def graph_suite(self, head, inp, n, emitted) -> None:
        ms = [m for m in self.methods if DECODE in m.modes]
        if not self.cuda:
            self._skipped_rows(head, MODE_GRAPH, ms, emitted, lambda m: "CUDA graphs need a CUDA device")
            return
        uncapturable = "not capturable in a CUDA graph (it synchronizes with the host)"
        ms = self._skipped_rows(head, MODE_GRAPH, ms, emitted,
                                lambda m: self.skip.get(m.key) or (None if m.graphable else uncapturable))  # fmt: skip
        h, w, t = inp.hidden[:n], inp.weight, inp.targets[:n]
        cases, trial, by_key, keep = {}, {}, {}, []
        with torch.no_grad():
            for m in ms:
                try:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(2):
                            m.forward(h, w, t)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = m.forward(h, w, t)
                    keep.append(out)
                    graph.replay()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    torch.cuda.synchronize()
                    self._row(head, MODE_GRAPH, n, m, "failed", f"CUDA graph capture or replay failed: {_reason(e)}")
                    print(f"    {m.key:28s} graph failed: {_reason(e)}")
                    continue
                cases[m.key], trial[m.key], by_key[m.key] = graph.replay, {}, m
            if cases:
                self._timed_suite(head, MODE_GRAPH, n, cases, trial, by_key, 2.0 * n * head[1] * head[2],
                                  lambda m, med: m.ratio_ref)  # fmt: skip
        del keep

    def fwdbwd_suite(self, head, inp, n, emitted) -> None:
        ref = next(m for m in self.methods if m.key == REFERENCE)
        ms = self._skipped_rows(head, MODE_FWDBWD, [m for m in self.methods if FWDBWD in m.modes], emitted)
        h, w, t, g = inp.hidden[:n], inp.weight, inp.targets[:n], inp.grad[:n]
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()

        def clear():
            hh.grad = None
            ww.grad = None

        cases, trial, by_key = {}, {}, {}
        with torch.no_grad():
            ref_step = lambda: ref.forward(h, w, t)  # noqa: E731
            res = self._trial(head, MODE_FWDBWD, n, ref, ref_step)
            if res is not None:
                cases[REFERENCE], trial[REFERENCE], by_key[REFERENCE] = ref_step, res, ref
        for m in ms:

            def step(m=m):
                clear()
                m.loss(hh, ww, t, g).backward()

            clear()
            res = self._trial(head, MODE_FWDBWD, n, m, step, reset=clear)
            if res is None:
                continue
            res["detlogp_backend"] = self._backend_of(m)
            cases[m.key], trial[m.key], by_key[m.key] = step, res, m
        clear()

        def ref_of(m: Method, med):
            if m.ratio_ref:
                return m.ratio_ref
            if m.kind != "detlogp":
                return None
            # The fastest other method that computes the same loss (no entropy term).
            others = [k for k, mm in by_key.items()
                      if k != REFERENCE and mm.kind != "detlogp" and mm.entropy_of is None]  # fmt: skip
            return min(others, key=lambda k: med[k]) if others else None

        if cases:
            self._timed_suite(head, MODE_FWDBWD, n, cases, trial, by_key, 6.0 * n * head[1] * head[2], ref_of)

    # ---- checks --------------------------------------------------------------------------------

    def checks(self, head, inp, n_big: int) -> None:
        """Batch invariance and accuracy of every method with a forward that ran on this head; the
        columns go into all of its rows of this head."""
        name = head[0]
        ran = {r["method"] for r in self.rows if r["head"] == name and r["status"] == "ok"}
        ms = [m for m in self.methods if m.forward is not None and m.key in ran]
        if not ms:
            return
        n_big = max(1, min(n_big, inp.hidden.shape[0], INVARIANCE_MAX_N))
        n_small = min(64, n_big)
        rows = [r for r in INVARIANCE_ROWS if r < n_small] or [0]
        acc_rows = list(range(min(ACCURACY_ROWS, n_big)))
        h, w, t = inp.hidden, inp.weight, inp.targets
        ref_logp, ref_entropy = fp64_reference(h[acc_rows], w, t[acc_rows])
        small = f", in N={n_small}" if n_small < n_big else ""
        print(f"  checks: rows {rows} alone{small} and in N={n_big} shifted by one row, against N={n_big}; "
              f"rows 0..{acc_rows[-1]} against float64")  # fmt: skip
        with torch.no_grad():
            for m in ms:
                cols = {}
                try:
                    full = m.forward(h[:n_big], w, t[:n_big])
                    cols.update(self._accuracy(m, full, acc_rows, ref_logp, ref_entropy))
                    cols.update(self._invariance(m, full, rows, n_small, n_big, h, w, t))
                except Exception as e:  # noqa: BLE001
                    cols = {"batch_invariant": "error", "invariance_detail": _reason(e)}
                    if self.cuda:
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                for r in self.rows:
                    if r["head"] == name and r["method"] == m.key and r["status"] == "ok":
                        r.update(cols)
                print(f"    {m.key:28s} invariant: {cols.get('batch_invariant', '')} "
                      f"({cols.get('invariance_detail', '')}); |logp - fp64| {cols.get('max_abs_err_logp', '') or '-'}"
                      f"; |H - fp64| {cols.get('max_abs_err_entropy', '') or '-'}")  # fmt: skip

    @staticmethod
    def _accuracy(m: Method, full, acc_rows, ref_logp, ref_entropy) -> dict:
        cols = {}
        if m.logp_of is not None:
            lp = m.logp_of(full)[acc_rows].double()
            cols["max_abs_err_logp"] = f"{(lp - ref_logp).abs().max().item():.3g}"
        if m.entropy_of is not None:
            en = m.entropy_of(full)[acc_rows].double()
            cols["max_abs_err_entropy"] = f"{(en - ref_entropy).abs().max().item():.3g}"
        return cols

    @staticmethod
    def _invariance(m: Method, full, rows, n_small, n_big, h, w, t) -> dict:
        """Each output row's bits computed alone (N = 1), in the first n_small rows and in the first
        n_big rows shifted down by one row, against the same row in the first n_big rows."""
        variants = []  # (label, {row: outputs of that row})
        for r in rows:
            variants.append(("alone", {r: m.forward(h[r : r + 1], w, t[r : r + 1])}, 0, r))
        if n_small < n_big:
            variants.append((f"N={n_small}", m.forward(h[:n_small], w, t[:n_small]), 0, None))
        if n_big > max(rows) + 1:
            hs, ts = torch.roll(h[:n_big], 1, 0), torch.roll(t[:n_big], 1, 0)
            variants.append(("shifted", m.forward(hs, w, ts), 1, None))
        checked, differ, worst, where = 0, 0, 0.0, []
        for label, out, offset, only in variants:
            for r in rows if only is None else [only]:
                got = out[r] if isinstance(out, dict) else out
                idx = 0 if isinstance(out, dict) else r + offset
                for a, b in zip(got, full):
                    checked += 1
                    x, y = a[idx : idx + 1], b[r : r + 1]
                    if not _same_bits(x, y):
                        differ += 1
                        where.append(f"row {r} {label}")
                        worst = max(worst, (x.double() - y.double()).abs().max().item())
        labels = list(dict.fromkeys(v[0] for v in variants))
        shown = [x if x != "shifted" else f"N={n_big} shifted by one row" for x in labels]
        against = f"against N={n_big}: " + ", ".join(shown)
        if not differ:
            return {"batch_invariant": "yes", "invariance_detail": f"{checked} row outputs bit-identical {against}"}
        return {"batch_invariant": "no",
                "invariance_detail": f"{differ} of {checked} row outputs differ {against}; max |diff| {worst:.3g}: "
                + ", ".join(where[:4])}  # fmt: skip

    # ---- the run -------------------------------------------------------------------------------

    def run(self) -> List[dict]:
        cfg = self.cfg
        skipped = {k: v for k, v in self.skip.items() if v}
        if skipped:
            print("skipped here:")
            for k, why in skipped.items():
                print(f"  {k}: {why}")
        all_n = [n for mode, ns in ((DECODE, cfg.decode_n), ("graph", cfg.decode_n), (TRAINER, cfg.trainer_n),
                                    (FWDBWD, cfg.fwdbwd_n)) if mode in cfg.modes for n in ns]  # fmt: skip
        n_max = max(all_n + [max(INVARIANCE_ROWS) + 2])
        for head in cfg.heads:
            name, d, v = head
            print(f"head {HEAD_LABELS.get(name, name)} (D={d}, V={v}), {cfg.device.type}")
            inp = make_inputs(n_max, d, v, cfg.device, cfg.seed)
            emitted = set()
            plan = []
            if DECODE in cfg.modes:
                plan += [(lambda n=n: self.forward_suite(head, inp, MODE_EAGER, n, emitted), MODE_EAGER, n)
                         for n in cfg.decode_n]  # fmt: skip
            if "graph" in cfg.modes:
                plan += [(lambda n=n: self.graph_suite(head, inp, n, emitted), MODE_GRAPH, n) for n in cfg.decode_n]
            if TRAINER in cfg.modes:
                plan += [(lambda n=n: self.forward_suite(head, inp, MODE_TRAINER, n, emitted), MODE_TRAINER, n)
                         for n in cfg.trainer_n]  # fmt: skip
            if FWDBWD in cfg.modes:
                plan += [(lambda n=n: self.fwdbwd_suite(head, inp, n, emitted), MODE_FWDBWD, n) for n in cfg.fwdbwd_n]
            for suite, mode, n in plan:
                if self._over_budget():
                    tag = {MODE_EAGER: DECODE, MODE_GRAPH: DECODE, MODE_TRAINER: TRAINER, MODE_FWDBWD: FWDBWD}[mode]
                    for m in self.methods:
                        if tag in m.modes or m.key == REFERENCE:
                            self._row(head, mode, n, m, "skipped", f"time budget of {cfg.time_budget_s:g} s spent")
                    print(f"  {mode} N={n}: skipped (time budget)")
                    continue
                suite()
                if self.cuda:
                    torch.cuda.empty_cache()
            self.checks(head, inp, max(all_n))
            plan, inp = None, None  # this head's tensors freed before the next head's are made
            if self.cuda:
                torch.cuda.empty_cache()
        print(f"total {time.monotonic() - self.t0:.1f} s")
        return self.rows


"""python -m detlogp.bench in its CPU mode with tiny shapes: the CSV's columns, the skip reasons of
the methods that cannot run here, the batch-invariance and accuracy columns (checked against
methods registered to fail them), and the method hook. Skipped where torch is not installed."""

import csv
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the benchmark needs it)")
import torch.nn.functional as F  # noqa: E402

import detlogp  # noqa: E402
from detlogp import bench  # noqa: E402
from detlogp.bench.run import COLUMNS  # noqa: E402

TINY = ["--device", "cpu", "--quick", "--dim", "64", "--vocab", "1000", "--decode-n", "1,4", "--trainer-n", "70",
        "--fwdbwd-n", "8", "--reps", "2", "--warmup", "1"]  # fmt: skip
PEERS = ("liger-flce", "liger-sm90", "liger-sm90-entropy", "cce")


def read_rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_quick_cpu_run_writes_the_csv_with_every_column_and_skip_reason(tmp_path, capsys):
    out = tmp_path / "bench.csv"
    proc = subprocess.run([sys.executable, "-m", "detlogp.bench", *TINY, "--csv", str(out)], capture_output=True,
                          text=True, timeout=600, env=os.environ.copy())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header, rows = read_rows(out)
    assert header == COLUMNS
    by = {}
    for r in rows:
        by.setdefault((r["method"], r["mode"]), []).append(r)
    # Every row that did not run says why; the peers are skipped here (not installed, or no CUDA).
    for r in rows:
        assert r["status"] in ("ok", "skipped", "failed"), r
        if r["status"] != "ok":
            assert r["reason"], r
    for peer in PEERS:
        (r,) = by[(peer, "trainer-forward")]
        assert r["status"] == "skipped" and ("not installed" in r["reason"] or "CUDA" in r["reason"]), r
        assert f"{peer}" in proc.stdout
    (mm,) = by[("torch-mm-fp32out", "decode-eager")]
    assert mm["status"] == "skipped" and "torch.ops.aten.mm.dtype" in mm["reason"]
    graph = [r for r in rows if r["mode"] == "decode-graph"]
    assert graph and all(r["status"] == "skipped" and "CUDA graphs" in r["reason"] for r in graph)
    # The timed rows: one per N, the reference at 1.0, detlogp bit-invariant and close to float64.
    for (key, mode), n in (
        (("torch-linear", "decode-eager"), ["1", "4"]),
        (("detlogp-trainer", "decode-eager"), ["1", "4"]),
        (("detlogp-serving", "trainer-forward"), ["70"]),
        (("detlogp-entropy", "trainer-forward"), ["70"]),
        (("torch-materializing", "trainer-forward"), ["70"]),
        (("detlogp-trainer", "forward+backward"), ["8"]),
        (("detlogp-loss", "forward+backward"), ["8"]),
        (("torch-materializing", "forward+backward"), ["8"]),
    ):
        got = by[(key, mode)]
        assert [r["N"] for r in got] == n and all(r["status"] == "ok" for r in got), got
        for r in got:
            assert float(r["ms_median"]) > 0 and float(r["ms_min"]) <= float(r["ms_median"])
            assert float(r["ratio_vs_linear"]) > 0 and float(r["gflops"]) > 0 and r["reps"] == "2"
    assert all(float(r["ratio_vs_linear"]) == 1.0 for r in by[("torch-linear", "trainer-forward")])
    (serving,) = by[("detlogp-serving", "trainer-forward")]
    assert serving["ref_method"] == "torch-mm-fp32out" or serving["ratio_vs_ref"] == ""  # its reference is skipped
    (entropy,) = by[("detlogp-entropy", "trainer-forward")]
    assert entropy["ref_method"] == "detlogp-trainer" and float(entropy["ratio_vs_ref"]) > 0
    (fb,) = by[("detlogp-trainer", "forward+backward")]
    assert fb["ref_method"] == "torch-materializing" and fb["detlogp_backend"].startswith("cpu-")
    (fl,) = by[("detlogp-loss", "forward+backward")]
    assert fl["ref_method"] == "torch-materializing" and fl["batch_invariant"] == "yes", fl
    for key in ("detlogp-trainer", "detlogp-serving", "detlogp-entropy"):
        for r in by[(key, "trainer-forward")]:
            assert r["batch_invariant"] == "yes", r
            assert "bit-identical" in r["invariance_detail"]
            assert float(r["max_abs_err_logp"]) < 1e-4, r
            assert r["detlogp_backend"].startswith("cpu-"), r  # a CPU run, an SM90 GPU present or not
    assert float(entropy["max_abs_err_entropy"]) < 1e-4
    (mat,) = by[("torch-materializing", "trainer-forward")]
    assert 0 < float(mat["max_abs_err_logp"]) < 0.05  # bf16 logits: a visible rounding error
    assert by[("torch-linear", "trainer-forward")][0]["max_abs_err_logp"] == ""  # logits, no logp
    for r in rows:
        assert r["device"] == "cpu" and r["torch_version"] == torch.__version__ and r["detlogp_version"]
        assert r["date"] and "python -m detlogp.bench" in r["command"] and "--dim 64" in r["command"]
    # The README's tables: printed at the end of the run, and again from the CSV by --table.
    assert "| suite | N | F.linear ms |" in proc.stdout and "| `detlogp-trainer` | yes |" in proc.stdout
    assert bench.main(["--table", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.strip() and table.strip() in proc.stdout
    png = out.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "PNG skipped: matplotlib is not installed" in proc.stdout


def test_a_cpu_run_times_the_cpu_backend_unless_detlogp_backend_says_otherwise(monkeypatch):
    """With an SM90 GPU present, auto serves host tensors there; a CPU run pins the CPU backend for
    its duration (and restores the environment), and a DETLOGP_BACKEND already set still chooses."""
    monkeypatch.delenv("DETLOGP_BACKEND", raising=False)
    with bench._cpu_run_backend(torch.device("cpu")):
        assert os.environ["DETLOGP_BACKEND"] == bench.CPU_BACKEND
    assert "DETLOGP_BACKEND" not in os.environ
    with bench._cpu_run_backend(torch.device("cuda")):
        assert "DETLOGP_BACKEND" not in os.environ
    monkeypatch.setenv("DETLOGP_BACKEND", "auto")
    with bench._cpu_run_backend(torch.device("cpu")):
        assert os.environ["DETLOGP_BACKEND"] == "auto"
    assert os.environ["DETLOGP_BACKEND"] == "auto"
    assert bench.CPU_BACKEND in {b["id"] for b in detlogp.backends()}


def _shifted_linear(h, w, t):
    # Batch-dependent on purpose: each row's output moves with the batch's size.
    return (F.linear(h, w).float() + h.shape[0] * 1e-3,)


def _offset_logp(h, w, t):
    logp = torch.log_softmax((h.float() @ w.float().T), -1).gather(1, t[:, None])[:, 0]
    return (logp + 0.5,)


def test_registered_methods_are_timed_and_their_columns_catch_batch_dependence_and_error(tmp_path):
    added = [
        bench.register_method(bench.Method("test-batch-dependent", "batch-dependent logits", (bench.DECODE,),
                                           forward=_shifted_linear)),  # fmt: skip
        bench.register_method(bench.Method("test-offset-logp", "logp + 0.5", (bench.TRAINER,), forward=_offset_logp,
                                           logp_of=lambda out: out[0])),  # fmt: skip
    ]
    try:
        with pytest.raises(ValueError, match="already registered"):
            bench.register_method(added[0])
        with pytest.raises(ValueError, match="need forward"):
            bench.register_method(bench.Method("test-no-forward", "x", (bench.TRAINER,)))
        with pytest.raises(ValueError, match="modes must be among"):
            bench.register_method(bench.Method("test-bad-mode", "x", ("prefill",), forward=_offset_logp))
        out = tmp_path / "hook.csv"
        keys = "test-batch-dependent,test-offset-logp,detlogp-trainer"
        assert bench.main([*TINY, "--modes", "decode,trainer", "--methods", keys, "--csv", str(out), "--png",
                           "none"]) == 0  # fmt: skip
        _, rows = read_rows(out)
        got = {(r["method"], r["mode"], r["N"]): r for r in rows}
        assert {r["method"] for r in rows} == {"torch-linear", *keys.split(",")}
        dep = got[("test-batch-dependent", "decode-eager", "4")]
        assert dep["status"] == "ok" and dep["batch_invariant"] == "no" and "differ" in dep["invariance_detail"]
        off = got[("test-offset-logp", "trainer-forward", "70")]
        assert off["status"] == "ok" and abs(float(off["max_abs_err_logp"]) - 0.5) < 1e-3
        assert got[("detlogp-trainer", "trainer-forward", "70")]["batch_invariant"] == "yes"
        assert not pathlib.Path(out.with_suffix(".png")).exists()
    finally:
        for m in added:
            bench.unregister_method(m.key)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heads", "gpt-9"], "unknown head"),
        (["--dim", "64"], "--dim and --vocab go together"),
        (["--trainer-n", "0"], "every N must be >= 1"),
        (["--modes", "prefill"], "unknown mode"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", *args])
    assert message in str(e.value)

"""The host-side pieces of scripts/cublas_probe.sh and bench/plot_bench.py that need no GPU: the
ncu and cuBLAS log summaries (on logs in the tools' formats) and plot_bench's choice of one data
kind in a CSV that holds two."""

import csv
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROBE = ROOT / "bench" / "cublas_probe.py"
PLOT = ROOT / "bench" / "plot_bench.py"

NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')  # fmt: skip


def run(*args):
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def ncu_row(i, kernel, metric, unit, value):
    return (f'"{i}","7","python3","host","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')  # fmt: skip


def test_ncu_summary_labels_each_launch(tmp_path):
    log = tmp_path / "ncu.log"
    log.write_text("\n".join([
        "==PROF== Connected to process 7",
        NCU_HEADER,
        ncu_row(0, "nvjet_tst_a", "gpu__time_duration.sum", "msecond", "7.21"),
        ncu_row(0, "nvjet_tst_a", "sm__cycles_active.avg", "cycle", "10,123,456"),
        ncu_row(1, "nvjet_tst_b", "gpu__time_duration.sum", "msecond", "7.30"),
    ]) + "\n")  # fmt: skip
    out = run(PROBE, "--ncu-summary", log, "--labels", "first,second")
    assert "ncu first: nvjet_tst_a" in out and "sm__cycles_active.avg=10,123,456 cycle" in out
    assert "ncu second: nvjet_tst_b" in out and "gpu__time_duration.sum=7.30 msecond" in out
    out = run(PROBE, "--ncu-summary", log, "--labels", "only")
    assert "2 launches for 1 labels" in out and "ncu launch 1: nvjet_tst_b" in out


def test_cublas_log_summary(tmp_path):
    api = tmp_path / "cublas.log"
    api.write_text("\n".join([
        "I! cuBLAS (v13.1) function cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void*, size_t) called:",
        "i!  workspaceSizeInBytes: type=size_t; val=33554432",
        "I! cuBLAS (v13.1) function cublasStatus_t cublasGemmEx(cublasContext*, cublasOperation_t) called:",
        "i!  transa: type=cublasOperation_t; val=CUBLAS_OP_T(1)",
        "i!  algo: type=SOME TYPE; val=CUBLAS_GEMM_DEFAULT_TENSOR_OP(99)",
        "I! cuBLAS (v13.1) function cublasStatus_t cublasGemmEx(cublasContext*, cublasOperation_t) called:",
        "i!  transa: type=cublasOperation_t; val=CUBLAS_OP_N(0)",
    ]) + "\n")  # fmt: skip
    out = run(PROBE, "--log-summary", api)
    assert "calls: cublasSetWorkspace_v2 x1, cublasGemmEx x2" in out
    assert "first cublasGemmEx:" in out and "CUBLAS_GEMM_DEFAULT_TENSOR_OP(99)" in out and "CUBLAS_OP_N" not in out
    lt = tmp_path / "cublaslt.log"
    lt.write_text("\n".join([
        "[2026-12-02 19:00:00][cublasLt][7][Trace][cublasLtMatmul] algo=[algoId=66 tile=MATMUL_TILE_256x128]",
        "[2026-12-02 19:00:01][cublasLt][7][Trace][cublasLtMatmul] algo=[algoId=67]",
        "[2026-12-02 19:00:01][cublasLt][7][Info][cublasLtMatmulAlgoGetHeuristic] one",
        "[2026-12-02 19:00:02][cublasLt][7][Info][cublasLtMatmulAlgoGetHeuristic] two",
    ]) + "\n")  # fmt: skip
    out = run(PROBE, "--log-summary", lt)
    assert "algoId=66" in out and "algoId=67" in out  # every traced matmul
    assert "Info/cublasLtMatmulAlgoGetHeuristic (x2): " in out and " one" in out and " two" not in out


def test_plot_bench_draws_one_data_kind(tmp_path):
    cols = ["gpu", "date", "N", "D", "V", "method", "ms_median", "hbm_floor_ms", "ratio_vs_cublas_bf16out_paired",
            "data"]  # fmt: skip
    path = tmp_path / "two.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for kind, ms in (("realistic", 7.0), ("random", 9.0)):
            for method, scale in (("cublas_gemm_bf16out", 1.0), ("detlogp_trainer", 1.04)):
                w.writerow({"gpu": "H200", "date": "2026-12-02", "N": 4096, "D": 4096, "V": 151936, "method": method,
                            "ms_median": ms * scale, "hbm_floor_ms": 0.29, "ratio_vs_cublas_bf16out_paired": 1.04,
                            "data": kind})  # fmt: skip
    out = run(PLOT, path, "--table")
    assert "data kinds realistic, random; drawing realistic" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("| 4096 |"))
    assert "| 7.000 |" in row and "9.000" not in row

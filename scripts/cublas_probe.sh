#!/usr/bin/env bash
# Why torch's F.linear and bench_sm90's cuBLAS reference can differ, in one call on a GPU machine
# (docs/perf.md, "Predictions and outcomes", 2026-12-02, the bench's cuBLAS reference):
#   1. versions: the libcublas torch loaded and the one bench_sm90 links, torch's BLAS settings;
#   2. time, torch's process: F.linear and the bench's former call (ctypes, the same library) on
#      random and realistic data, interleaved; one profiled call each (kernel names);
#   3. time, bench_sm90 --reference-only: the torch-style call and the former call on both data
#      kinds, interleaved; again on torch's libcublas (LD_LIBRARY_PATH) when that is another file;
#   4. kernels under ncu (clocks locked to base, so cycles and time do not depend on the data or
#      the power cap): F.linear, the former call, and bench_sm90's two calls, name and cycles each;
#   5. cuBLAS's own logs (CUBLASLT_LOG_MASK, CUBLAS_LOGINFO_DBG) of one call of each.
# Logs and CSVs go to "$OUT" (else ./out), the lines that answer the question to "$OUT/summary.txt".
#   BENCH_BIN=path/to/bench_sm90 (default build-gpu/bench/bench_sm90, built when missing),
#   PYTHON (python3), PROBE_NS (1024,4096,16384), PROBE_REPS (15), PROBE_BUDGET_S (210: a step
#   that would start later is skipped and says so), PROBE_STEPS (time,bench,ncu,logs),
#   PROBE_PACK=1 ("$OUT" gets only summary.txt, the timing CSVs and logs.tgz with every log, also
#   when the probe is killed: for a device tool that returns few files).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
pack() { :; }
if [[ "${PROBE_PACK:-0}" == 1 ]]; then
  FINAL_OUT="$OUT"
  OUT="$(mktemp -d)"
  # Refreshed after every step, so a probe cut short still leaves what it measured.
  pack() {
    cp -f "$OUT"/summary.txt "$OUT"/*.csv "$FINAL_OUT"/ 2>/dev/null
    tar czf "$FINAL_OUT/logs.tgz.part" -C "$OUT" . 2>/dev/null && mv -f "$FINAL_OUT/logs.tgz.part" "$FINAL_OUT/logs.tgz"
  }
  trap 'pack; rm -rf "$OUT"' EXIT
fi
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
PY="${PYTHON:-python3}"
NS="${PROBE_NS:-1024,4096,16384}"
REPS="${PROBE_REPS:-15}"
BUDGET="${PROBE_BUDGET_S:-210}"
STEPS="${PROBE_STEPS:-time,bench,ncu,logs}"
BENCH="${BENCH_BIN:-$ROOT/build-gpu/bench/bench_sm90}"
[[ "$BENCH" == /* ]] || BENCH="$PWD/$BENCH"  # the bench runs from inside "$OUT"
PROBE="$ROOT/bench/cublas_probe.py"
KERNELS='regex:nvjet|gemm|xmma|cutlass'
METRICS='gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.max,smsp__cycles_elapsed.avg.per_second'
has() {
  [[ ",$STEPS," == *",$1,"* ]] || return 1
  if [[ "$SECONDS" -gt "$BUDGET" ]]; then
    say "$1: skipped (${SECONDS} s elapsed, budget ${BUDGET} s)"
    return 1
  fi
}

# A binary carried from another machine is rebuilt here when its libraries do not resolve.
if [[ -x "$BENCH" ]] && ldd "$BENCH" 2>&1 | grep -q "not found"; then
  say "bench_sm90: $BENCH does not load here ($(ldd "$BENCH" 2>&1 | grep -m1 'not found' | xargs)), rebuilding"
  BENCH="$ROOT/build-gpu/bench/bench_sm90"
  rm -f "$BENCH"
fi
if [[ ! -x "$BENCH" ]]; then
  GEN=()
  command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
  say "build: $BENCH missing, building bench_sm90 (build.log)"
  { cmake -S "$ROOT" -B "$ROOT/build-gpu" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release &&
    cmake --build "$ROOT/build-gpu" --target bench_sm90 -j "${JOBS:-16}"; } >"$OUT/build.log" 2>&1 ||
    { say "BUILD FAILED (build.log)"; tail -20 "$OUT/build.log"; exit 1; }
  BENCH="$ROOT/build-gpu/bench/bench_sm90"
fi

# 1. Versions and settings.
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.sm,temperature.gpu --format=csv \
  >"$OUT/versions.log" 2>&1
BENCH_CUBLAS="$(ldd "$BENCH" | awk '/libcublas\.so/ {print $3; exit}')"
say "gpu: $(tail -1 "$OUT/versions.log")"
say "bench_sm90 cuBLAS: $BENCH_CUBLAS ($(readlink -f "$BENCH_CUBLAS" 2>/dev/null))"

# 2. torch's process.
TORCH_CUBLAS_DIR=""
if has time; then
  "$PY" "$PROBE" --time --n "$NS" --reps "$REPS" --csv "$OUT/torch_time.csv" >"$OUT/torch_time.log" 2>&1
  say "torch timing: rc=$? (torch_time.log, torch_time.csv)"
  grep -E "^(torch |torch-process|profiler|env:|SKIP)" "$OUT/torch_time.log" | grep -v "^torch N=" | sed 's/^/  /' |
    tee -a "$SUMMARY"
  grep -E "^torch N=" "$OUT/torch_time.log" | sed 's/^/  /' >>"$SUMMARY"
  TORCH_CUBLAS_DIR="$(sed -n 's/^torch cuBLAS dir: //p' "$OUT/torch_time.log")"
  pack
fi
if [[ -z "$TORCH_CUBLAS_DIR" ]]; then  # the time step was skipped or failed: ask torch alone
  TORCH_CUBLAS_DIR="$("$PY" - <<'EOF' 2>/dev/null
import torch
a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
(a @ a).sum().item()
for line in open("/proc/self/maps"):
    if "/libcublas.so" in line:
        import os
        print(os.path.dirname(line.split()[-1]))
        break
EOF
)"
fi
SAME_LIB=1  # unknown counts as the same: no run on torch's library then
same="unknown"
if [[ -n "$TORCH_CUBLAS_DIR" ]]; then same=yes; fi
if [[ -n "$TORCH_CUBLAS_DIR" ]] && ! cmp -s "$(readlink -f "$BENCH_CUBLAS")" "$(readlink -f "$TORCH_CUBLAS_DIR"/libcublas.so.* | head -1)"; then
  SAME_LIB=0
  same=no
fi
say "torch cuBLAS dir: ${TORCH_CUBLAS_DIR:-unknown}; same libcublas file as bench_sm90's: $same"

# 3. bench_sm90's calls, its own libcublas, then torch's when that is another file.
bench_ref() {  # bench_ref LABEL CSV [env...]
  local label="$1" csv="$2"
  shift 2
  (cd "$OUT" && env "$@" "$BENCH" --reference-only --data random,realistic --n "$NS" --reps "$REPS" --csv "$csv") \
    >"$OUT/bench_$label.log" 2>&1
  say "bench_sm90 --reference-only ($label): rc=$? (bench_$label.log, $csv)"
  grep -E "^(cuBLAS|data |reference N|SKIP)" "$OUT/bench_$label.log" | sed 's/^/  /' | tee -a "$SUMMARY"
  grep -E "^[0-9]+ +cublas" "$OUT/bench_$label.log" | sed 's/^/  /' >>"$SUMMARY"
  pack
}
if has bench; then
  bench_ref toolkit bench_ref_toolkit.csv
  if [[ $SAME_LIB == 0 ]]; then
    bench_ref torchlib bench_ref_torchlib.csv "LD_LIBRARY_PATH=$TORCH_CUBLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

# 4. Kernels and cycles under ncu, clocks at base.
labels() {  # labels PREFIX COUNT_PER_N: PREFIX N=n #i for every N
  local out="" n i
  for n in ${NS//,/ }; do for ((i = 1; i <= $2; ++i)); do out+="${out:+,}$1 N=$n #$i"; done; done
  echo "$out"
}
NCU="$(command -v ncu || true)"
if has ncu; then
  if [[ -z "$NCU" ]]; then
    say "ncu: not found (kernel names: the profiler lines above)"
  else
    ncu_run() {  # ncu_run NAME LABELS cmd...
      local name="$1" labs="$2"
      shift 2
      if [[ "$SECONDS" -gt "$BUDGET" ]]; then
        say "ncu $name: skipped (${SECONDS} s elapsed, budget ${BUDGET} s)"
        return
      fi
      local clocks=base rc
      "$NCU" --csv --log-file "$OUT/ncu_$name.log" --clock-control base --kernel-name "$KERNELS" --metrics "$METRICS" \
        "$@" >"$OUT/ncu_$name.out" 2>&1
      rc=$?
      if ! grep -q '^"ID"' "$OUT/ncu_$name.log" 2>/dev/null; then  # no launch profiled: try without locking clocks
        clocks=none
        "$NCU" --csv --log-file "$OUT/ncu_$name.log" --clock-control none --kernel-name "$KERNELS" \
          --metrics "$METRICS" "$@" >>"$OUT/ncu_$name.out" 2>&1
        rc=$?
      fi
      say "ncu $name: rc=$rc, clocks $clocks (ncu_$name.log, ncu's CSV; ncu_$name.out)"
      "$PY" "$PROBE" --ncu-summary "$OUT/ncu_$name.log" --labels "$labs" 2>&1 | sed 's/^/  /' | tee -a "$SUMMARY"
      pack
    }
    tl=""
    for n in ${NS//,/ }; do tl+="${tl:+,}torch F.linear N=$n,torch-process bench-legacy N=$n"; done
    ncu_run torch "$tl" "$PY" "$PROBE" --ncu-pass --n "$NS"
    # bench_sm90: 2 warm-up launches and 1 timed one per N (--reps 1), one method a run.
    ncu_run bench_ref "$(labels "bench cublas_gemm_bf16out" 3)" "$BENCH" --reference-only --methods cublas_gemm_bf16out \
      --data realistic --n "$NS" --reps 1 --csv /dev/null
    ncu_run bench_legacy "$(labels "bench cublas_gemm_bf16out_legacy" 3)" "$BENCH" --reference-only \
      --methods cublas_gemm_bf16out_legacy --data realistic --n "$NS" --reps 1 --csv /dev/null
    if [[ $SAME_LIB == 0 ]]; then
      ncu_run bench_ref_torchlib "$(labels "bench cublas_gemm_bf16out on torch's libcublas" 3)" \
        env "LD_LIBRARY_PATH=$TORCH_CUBLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$BENCH" --reference-only \
        --methods cublas_gemm_bf16out --data realistic --n "$NS" --reps 1 --csv /dev/null
    fi
  fi
fi

# 5. cuBLAS's logs of one call of each: the API parameters (cublasGemmEx or cublasLtMatmul, math
# mode, workspace) and cuBLASLt's trace, hints and info (the algorithm it ran).
if has logs; then
  CUBLASLT_LOG_MASK=14 CUBLASLT_LOG_FILE="$OUT/cublaslt_torch.log" CUBLAS_LOGINFO_DBG=1 \
    CUBLAS_LOGDEST_DBG="$OUT/cublas_torch.log" "$PY" "$PROBE" --ncu-pass --n "$NS" >"$OUT/logs_torch.out" 2>&1
  say "cuBLAS logs, torch's process: rc=$? (cublaslt_torch.log, cublas_torch.log)"
  (cd "$OUT" && CUBLASLT_LOG_MASK=14 CUBLASLT_LOG_FILE="$OUT/cublaslt_bench.log" CUBLAS_LOGINFO_DBG=1 \
    CUBLAS_LOGDEST_DBG="$OUT/cublas_bench.log" "$BENCH" --reference-only --data realistic --n "$NS" --reps 1 \
    --csv /dev/null) >"$OUT/logs_bench.out" 2>&1
  say "cuBLAS logs, bench_sm90: rc=$? (cublaslt_bench.log, cublas_bench.log)"
  for f in cublas_torch cublas_bench cublaslt_torch cublaslt_bench; do
    [[ -f "$OUT/$f.log" ]] || { say "  $f.log: none written"; continue; }
    say "  $f.log: $(wc -l <"$OUT/$f.log") lines"
    "$PY" "$PROBE" --log-summary "$OUT/$f.log" 2>&1 | head -24 | sed 's/^/    /' | tee -a "$SUMMARY"
  done
fi
say "probe: ${SECONDS} s"

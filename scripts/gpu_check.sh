#!/usr/bin/env bash
# One-shot check of the SM90 backend on a GPU machine (documented in docs/sm90.md):
# configure + build (Release, -j16), GPU tests (ctest -L gpu) and the quick CPU tests,
# compute-sanitizer memcheck/racecheck/synccheck on a small-shape test, the SASS check, then the
# benchmark; the summary table prints last. Full logs go to "$OUT" (else ./out), at most 8 files.
# Needs nvcc, CMake, ninja (or make); no network (no FetchContent, no package installs).
#   GPU_CHECK_STEPS=build,tests,sanitizer,sass,bench,python,golden[,profile][,pyprofile][,rowprofile][,shapes]
#   [,mainloop][,combine][,cycles][,wgmma] (default: all but profile, pyprofile, rowprofile, shapes, mainloop,
#   combine, cycles and wgmma). wgmma: tests/gpu/sm90_wgmma_proof, the SM90 logits against the wgmma
#   model on this machine's CPUs (WGMMA_PROOF_ARGS, default --quick; "--logits 1e8" for the full
#   proof; WGMMA_PROOF_TIMEOUT_S, default 590), into wgmma_proof_cases.csv and wgmma_proof.csv
#   (every differing element). cycles: scripts/ncu_cycles.sh on the built bench (CYCLES_ARGS). mainloop: bench/experiments/bench_sm90_mainloop,
#   the mainloops alone against cuBLAS (MAINLOOP_ARGS="--n 4096"), into bench_mainloop.csv.
#   combine: bench_sm90_combine, the combine's schedules with a bit check (COMBINE_ARGS). shapes: more
#   model shapes (BENCH_SHAPES="D:V:N-list ...", default Qwen3-8B TP=2 shard, Llama-3-8B, Qwen3-0.6B,
#   and N = 65536) into bench_shapes.csv.
#   BENCH_ARGS="--n 1,4096". GPU_CHECK_BUDGET_S=N: a step that would start after N seconds is
#   skipped (and says so), so a call stays inside the device limit. GPU_CHECK_PACK=1: "$OUT" gets
#   only summary.txt, the CSVs and logs.tgz (all logs), refreshed after every step (the device
#   tool returns at most 8 files). Every step's duration goes to the summary. BENCH_GIT_SHA=<sha>:
#   the commit the CSV rows name (a device copy's .git can lag its files; not a DETLOGP_* name,
#   because the library rejects unknown DETLOGP_* variables). GPU_CHECK_CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=-lineinfo": more
#   configure arguments. GPU_CHECK_TARGETS="t1 t2": build only
#   these targets (a quicker build for a focused run). GPU_CHECK_TESTS=regex: the GPU tests to run
#   (ctest -R; every gtest case is its own ctest test, named <binary>.<Suite>.<Test>).
#   GPU_CHECK_CPU_TESTS=0: the tests step runs the GPU tests alone (CI runs the CPU ones).
#   GPU_CHECK_BENCH_BACKWARD=0: the bench step runs bench_sm90 alone (no torch-level entropy backward).
#   GPU_CHECK_TEST_TIMEOUT_S: per-test limit (default 180 s), so a hang cannot eat the call. The python step runs scripts/gpu_python_check.sh on this build tree
#   (logs under $OUT/python); the build enables the Python module when nanobind is importable.
set -uo pipefail
# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
FINAL_OUT="$OUT"
if [[ "${GPU_CHECK_PACK:-0}" == 1 ]]; then OUT="$(mktemp -d)"; fi
STEPS="${GPU_CHECK_STEPS:-build,tests,sanitizer,sass,bench,python,golden}"
BUDGET="${GPU_CHECK_BUDGET_S:-0}"
BUILD="${BUILD_DIR:-$ROOT/build-gpu}"
JOBS="${JOBS:-16}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
# Copies the summary and CSVs out and packs every log (GPU_CHECK_PACK=1 only).
pack() {
  [[ "$OUT" == "$FINAL_OUT" ]] && return 0
  cp -f "$OUT"/summary.txt "$OUT"/*.csv "$FINAL_OUT"/ 2>/dev/null
  tar czf "$FINAL_OUT/logs.tgz.part" -C "$OUT" . 2>/dev/null && mv -f "$FINAL_OUT/logs.tgz.part" "$FINAL_OUT/logs.tgz"
}
# has STEP: the step was asked for and the time budget allows starting it; records its start.
STEP_NAME=""
STEP_T0=0
has() {
  [[ ",$STEPS," == *",$1,"* ]] || return 1
  if [[ "$BUDGET" -gt 0 && "$SECONDS" -gt "$BUDGET" ]]; then
    say "$1: skipped (${SECONDS} s elapsed, budget ${BUDGET} s)"
    return 1
  fi
  STEP_NAME="$1"
  STEP_T0=$SECONDS
  return 0
}
# done_step: the duration of the step has() last started, then a refreshed pack.
done_step() {
  [[ -n "$STEP_NAME" ]] && say "  ($STEP_NAME: $((SECONDS - STEP_T0)) s)"
  STEP_NAME=""
  pack
}

GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"


mode=""
if has build; then
  { nvidia-smi 2>&1 || true; "$NVCC" --version 2>&1 || true; cmake --version 2>&1 | head -1; } >"$OUT/build.log"
  PYOPT=()
  python3 -c "import nanobind" >/dev/null 2>&1 && PYOPT=(-DDETLOGP_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$(command -v python3)")
  # The mainloop step's binary lives in bench/experiments, built only when asked for.
  [[ ",$STEPS," == *",mainloop,"* ]] && PYOPT+=(-DDETLOGP_BUILD_EXPERIMENTS=ON)
  if cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" "${PYOPT[@]}" ${GPU_CHECK_CMAKE_ARGS:-} >>"$OUT/build.log" 2>&1 &&
     cmake --build "$BUILD" -j "$JOBS" ${GPU_CHECK_TARGETS:+--target $GPU_CHECK_TARGETS} >>"$OUT/build.log" 2>&1; then
    mode="top-level"
  else
    say "BUILD FAILED (see build.log)"; tail -40 "$OUT/build.log"; pack; exit 1
  fi
  say "build: $mode ($BUILD)"
  # Resources of every SM90 kernel (-Xptxas -v): registers, static shared memory, stack, spills.
  awk '/Compiling entry function/ { n = $0; sub(/.*function ./, "", n); sub(/. for .*/, "", n); next }
       /bytes stack frame/ { st = $1; sp = $5 + $9; next }
       /Used [0-9]+ registers/ && n ~ /detlogp4sm90/ {
         k = n; sub(/^_ZN7detlogp4sm90[0-9]*/, "", k); sub(/_GLOBAL__N__[0-9a-f_]*cu_[0-9a-f]*[0-9][0-9]/, "", k);
         sub(/EN?S0_.*FusedParamsEi$/, "", k); sub(/ENS0_.*$/, "", k); sm = "0"; if (match($0, /[0-9]+ bytes smem/)) sm = substr($0, RSTART, RLENGTH - 11);
         printf "  kernel %-72s regs=%-4s static_smem=%-6s stack=%-3s spill_bytes=%s\n", k, $5, sm, st, sp; n = "" }' \
    "$OUT/build.log" | sort -u | tee -a "$SUMMARY" >/dev/null
fi
done_step

find_bin() { find "$BUILD" -type f -name "$1" -perm -u+x 2>/dev/null | head -1; }

# Smoke: a hang or crash in the kernels must not eat the whole run. The GPU tests' shared main
# prints "SM90 device: <device>" or "SM90 device: skipped: <reason>" (gtest skips every test then).
small_bin="$(find_bin test_sm90_small)"
if [[ -n "$small_bin" ]]; then
  echo "== smoke: test_sm90_small" >"$OUT/tests.log"
  timeout 120 "$small_bin" >>"$OUT/tests.log" 2>&1
  rc=$?
  say "smoke (test_sm90_small, 120 s limit): rc=$rc; $(grep -m1 '^SM90 device: ' "$OUT/tests.log")"
  pack
  if [[ $rc -ne 0 ]]; then
    tail -30 "$OUT/tests.log"
    [[ "${GPU_CHECK_CONTINUE:-0}" == 1 ]] || { cat "$SUMMARY"; pack; exit 1; }
  fi
fi

if has tests; then
  (cd "$BUILD" && ctest -L gpu -V --timeout "${GPU_CHECK_TEST_TIMEOUT_S:-180}" ${GPU_CHECK_TESTS:+-R "$GPU_CHECK_TESTS"}) >>"$OUT/tests.log" 2>&1
  rc_gpu=$?
  say "gpu tests: $([[ $rc_gpu -eq 0 ]] && echo PASS || echo FAIL) (ctest -L gpu rc=$rc_gpu)"
  # ctest's line for every test that did not pass (***Failed, ***Skipped, ***Timeout) and the
  # count, each distinct skip reason, the first lines of each gtest failure, then the tests' own
  # report lines.
  {
    grep -E "Test +#[0-9]+: .*\*\*\*|% tests passed" "$OUT/tests.log"
    grep -A1 -E ": Skipped$" "$OUT/tests.log" | grep -vE ": Skipped$|^--$" | sed -E 's/^[0-9]+: //' | sort | uniq -c |
      sed -E 's/^ *([0-9]+) /skip reason (x\1): /'
    grep -A3 -E ": Failure$" "$OUT/tests.log" | grep -vE "^--$" | head -80
    grep -E "(^|: )INFO |(^|: )-- |cross-backend|L1:|rel-L2|subset runs|chunked run|padded vs real|-> detlogp error|valid run after|simulated TP|NCCL TP|negative control" "$OUT/tests.log"
  } | sed -E 's/^[0-9]+: //; s/^ +//' | cut -c1-240 >>"$SUMMARY"
  if [[ -n "${GPU_CHECK_TARGETS:-}" ]]; then
    say "cpu tests: not run (GPU_CHECK_TARGETS built only: $GPU_CHECK_TARGETS)"
  elif [[ "${GPU_CHECK_CPU_TESTS:-1}" == 0 ]]; then
    say "cpu tests: not run (GPU_CHECK_CPU_TESTS=0)"
  elif [[ "$mode" == "top-level" ]]; then
    (cd "$BUILD" && ctest -LE gpu -E exhaustive --timeout 300 -j 8) >>"$OUT/tests.log" 2>&1
    rc_cpu=$?
    say "cpu tests (quick, -E exhaustive): $([[ $rc_cpu -eq 0 ]] && echo PASS || echo FAIL) (rc=$rc_cpu)"
    grep -E "tests passed|tests failed" "$OUT/tests.log" | tail -1 >>"$SUMMARY"
  fi
fi
done_step

if has sass; then
  lib="$(find "$BUILD" -name 'libdetlogp.a' | head -1)"
  "$ROOT/scripts/check_sass.sh" ${lib:+"$lib"} >"$OUT/sass.log" 2>&1
  say "sass: $(tail -1 "$OUT/sass.log")"
fi
done_step

if has bench; then
  bench="$(find_bin bench_sm90)"
  if [[ -z "$bench" ]]; then
    say "bench: bench_sm90 not built"
  else
    (cd "$OUT" && "$bench" --csv "$OUT/bench_sm90.csv" ${BENCH_ARGS:-}) >"$OUT/bench.log" 2>&1
    say "bench: rc=$? (bench.log, bench_sm90.csv)"
    # The trainer with the entropy output over the trainer, per N, with its goal (or why not timed).
    grep -E "^entropy" "$OUT/bench.log" | sed 's/^/  bench_sm90 /' | tee -a "$SUMMARY" >/dev/null
    grep -qE "^entropy" "$OUT/bench.log" || say "  bench_sm90 entropy: no entropy line (N = 1024, 4096, 16384 not in BENCH_ARGS?)"
    # The bench's former cuBLAS call over torch's (the reference), per N.
    grep -E "^reference N" "$OUT/bench.log" | sed 's/^/  bench_sm90 /' | tee -a "$SUMMARY" >/dev/null
  fi
  # Forward + backward with an entropy term in the loss over the same without it (torch level,
  # N = 4096 on the Qwen3-8B head), when this build has the Python module.
  if [[ "${GPU_CHECK_BENCH_BACKWARD:-1}" == 0 ]]; then
    say "bench_backward entropy: not run (GPU_CHECK_BENCH_BACKWARD=0)"
  elif ls "$BUILD"/python/detlogp/_detlogp*.so >/dev/null 2>&1; then
    PYTHONPATH="$BUILD/python" timeout 300 python3 "$ROOT/bench/bench_backward.py" --methods contract,contract-entropy \
      --json "$OUT/bench_backward_entropy.json" >"$OUT/bench_backward_entropy.log" 2>&1
    rc=$?
    say "bench_backward entropy: rc=$rc (bench_backward_entropy.log)"
    grep -E "^entropy|SKIPPED" "$OUT/bench_backward_entropy.log" | sed 's/^/  /' | tee -a "$SUMMARY" >/dev/null
  else
    say "bench_backward entropy: skipped (no Python module in $BUILD/python)"
  fi
fi
done_step

if has shapes; then
  bench="$(find_bin bench_sm90)"
  if [[ -z "$bench" ]]; then
    say "shapes: bench_sm90 not built"
  else
    : >"$OUT/bench_shapes.log"
    rm -f "$OUT/bench_shapes.csv"
    for spec in ${BENCH_SHAPES:-4096:76032:1,64,1024,4096 4096:128256:1,64,1024,4096 1024:151936:1,64,1024,4096 4096:151936:65536}; do
      IFS=: read -r d v ns <<<"$spec"
      echo "== bench_sm90 --d $d --v $v --n $ns" >>"$OUT/bench_shapes.log"
      (cd "$OUT" && "$bench" --d "$d" --v "$v" --n "$ns" --csv "$OUT/shape.csv") >>"$OUT/bench_shapes.log" 2>&1
      rc=$?
      if [[ -f "$OUT/shape.csv" ]]; then
        if [[ -f "$OUT/bench_shapes.csv" ]]; then tail -n +2 "$OUT/shape.csv" >>"$OUT/bench_shapes.csv"; else cp "$OUT/shape.csv" "$OUT/bench_shapes.csv"; fi
        rm -f "$OUT/shape.csv"
      fi
      say "shapes D=$d V=$v N=$ns: rc=$rc"
    done
  fi
fi
done_step

if has python; then
  OUT="$OUT/python" BUILD_DIR="$BUILD" "$ROOT/scripts/gpu_python_check.sh" >"$OUT/python_check.log" 2>&1
  rc=$?
  say "python: $([[ $rc -eq 0 ]] && echo PASS || echo "FAIL rc=$rc") (python_check.log, python/)"
  grep -E "passed|failed|TP_|PASS|FAIL|backward|peak|ms" "$OUT/python_check.log" | cut -c1-200 | head -40 >>"$SUMMARY"
fi
done_step

if has golden; then
  OUT="$OUT" BUILD_DIR="$BUILD" "$ROOT/scripts/gpu_golden_check.sh" >"$OUT/golden_check.log" 2>&1
  rc=$?
  say "golden/L3/L4-L5: $([[ $rc -eq 0 ]] && echo PASS || echo "FAIL rc=$rc") (golden_check.log, golden/)"
  sed -n '/summary =/,$p' "$OUT/golden_check.log" | cut -c1-220 | head -60 >>"$SUMMARY"
fi
done_step

if has wgmma; then
  proof="$(find_bin sm90_wgmma_proof)"
  if [[ -z "$proof" ]]; then
    say "wgmma: sm90_wgmma_proof not built"
  else
    # shellcheck disable=SC2086
    timeout "${WGMMA_PROOF_TIMEOUT_S:-590}" "$proof" ${WGMMA_PROOF_ARGS:---quick} --out "$OUT" >"$OUT/wgmma_proof.log" 2>&1
    rc=$?
    say "wgmma model proof: $([[ $rc -eq 0 ]] && echo PASS || echo "FAIL rc=$rc") (wgmma_proof.log, wgmma_proof_cases.csv, wgmma_proof.csv)"
    grep -E "^(sm90_wgmma_proof|model:|total:|verdict:)|  DIFF" "$OUT/wgmma_proof.log" | head -40 | cut -c1-240 >>"$SUMMARY"
  fi
fi
done_step

if has sanitizer; then
  : >"$OUT/sanitizer.log"
  small="$(find_bin test_sm90_small)"
  CS="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  if [[ -z "$small" || ! -x "$CS" ]]; then
    say "sanitizer: not run (test_sm90_small or compute-sanitizer missing)"
  else
    tp="$(find_bin test_sm90_tp)"
    grad="$(find_bin test_sm90_grad_logits)"
    entropy="$(find_bin test_sm90_entropy)"
    # [N, K] targets: the epilogue's per-entry pick, the combine's and the merge's K finalizes.
    multi="$(find_bin test_sm90_multi_targets)"
    multi_cases="Sm90MultiTargets.IgnoreIndexWorksPerEntry:Sm90MultiTargets.ARowAloneMatchesTheRowInABatch"
    multi_cases+=":Sm90MultiTargets.PartialsAndTheDeviceMergeGiveTheTp1Bits"
    # The combine's schedules over 19 chunks of a row (bits checked against each other): the
    # lanes schedule's stage hand-overs between warps, which the library tests' short rows do not
    # reach.
    combine="$(find_bin bench_sm90_combine)"
    for tool in memcheck racecheck synccheck; do
      combine_target=""
      [[ -n "$combine" ]] && combine_target="$combine --n 70 --tiles 2374 --reps 1"
      for target in "$small" ${tp:+"$tp --small --no-nccl"} ${grad:+"$grad --small"} ${entropy:+"$entropy --small"} \
        ${multi:+"$multi --small --gtest_filter=$multi_cases"} ${combine_target:+"$combine_target"}; do
        echo "== compute-sanitizer --tool $tool $target" >>"$OUT/sanitizer.log"
        # shellcheck disable=SC2086
        timeout 600 "$CS" --tool "$tool" --error-exitcode 3 $target >>"$OUT/sanitizer.log" 2>&1
        rc=$?
        summary_line="$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.log" | tail -1)"
        say "sanitizer $tool $(basename "${target%% *}"): $([[ $rc -eq 0 ]] && echo CLEAN || echo "FAIL rc=$rc") ${summary_line}"
      done
    done
  fi
fi
done_step

if has mainloop; then
  ml="$(find_bin bench_sm90_mainloop)"
  if [[ -z "$ml" ]]; then
    say "mainloop: bench_sm90_mainloop not built"
  else
    # shellcheck disable=SC2086
    (cd "$OUT" && timeout 120 "$ml" --csv "$OUT/bench_mainloop.csv" ${MAINLOOP_ARGS:-}) >"$OUT/bench_mainloop.log" 2>&1
    say "mainloop: rc=$? (bench_mainloop.log, bench_mainloop.csv)"
    grep -E "^(method|cublas|mainloop|pingpong|coop|timeline)" "$OUT/bench_mainloop.log" >>"$SUMMARY"
  fi
fi
done_step

# Optional: SM cycles of the fused trainer kernel against cuBLAS under ncu (scripts/ncu_cycles.sh;
# CYCLES_ARGS="--n 1024,4096 --rounds 1" by default, plus earlier bench_sm90 binaries to compare).
if has cycles; then
  bench="$(find_bin bench_sm90)"
  if [[ -z "$bench" ]]; then
    say "cycles: bench_sm90 not built"
  else
    # shellcheck disable=SC2086
    timeout 300 bash "$ROOT/scripts/ncu_cycles.sh" ${CYCLES_ARGS:---n 1024,4096 --rounds 1} "$bench" >"$OUT/cycles.log" 2>&1
    say "cycles: rc=$? (cycles.log)"
    cat "$OUT/cycles.log" >>"$SUMMARY"
  fi
fi
done_step

if has combine; then
  cb="$(find_bin bench_sm90_combine)"
  if [[ -z "$cb" ]]; then
    say "combine: bench_sm90_combine not built"
  else
    # shellcheck disable=SC2086
    timeout 120 "$cb" ${COMBINE_ARGS:-} >"$OUT/bench_combine.log" 2>&1
    say "combine: rc=$? (bench_combine.log; rc 1: a schedule's bits differ)"
    cat "$OUT/bench_combine.log" >>"$SUMMARY"
  fi
fi
done_step

# Optional: bench/profile_forward.py (torch profiler, power-capped state): the cuBLAS GEMM and the
# trainer forward round-robin, each call split into host time, gaps and kernels
# (PYPROFILE_ARGS="--rows 1024,4096"). Needs the Python module of this build tree.
if has pyprofile; then
  if ls "$BUILD"/python/detlogp/_detlogp*.so >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    PYTHONPATH="$BUILD/python" timeout 300 python3 "$ROOT/bench/profile_forward.py" ${PYPROFILE_ARGS:-} \
      >"$OUT/profile_forward.log" 2>&1
    say "pyprofile: rc=$? (profile_forward.log)"
    grep -vE "^GPU" "$OUT/profile_forward.log" | cut -c1-160 >>"$SUMMARY"
  else
    say "pyprofile: skipped (no Python module in $BUILD/python)"
  fi
fi
done_step

# Optional: hardware counters of the row kernels (top-k, sampling, candidate kernels) as the torch
# face launches them: ncu (clocks left alone) on bench/profile_forward.py's top-k and sampling calls
# at each N of ROWPROFILE_ROWS (default "1024 256": the logits path, the candidate path), the
# kernels matching ROWPROFILE_KERNELS, into rowprofile.log (warp states, issue, memory, occupancy)
# and rowprofile_N_sass.csv.gz (every SASS instruction's counters, for a build with
# -DCMAKE_CUDA_FLAGS=-lineinfo to name source lines).
if has rowprofile; then
  NCU="$(command -v ncu || true)"
  if [[ -n "$NCU" ]] && ls "$BUILD"/python/detlogp/_detlogp*.so >/dev/null 2>&1; then
    rcs=""
    for n in ${ROWPROFILE_ROWS:-1024 256}; do
      echo "== ncu row kernels N=$n" >>"$OUT/rowprofile.log"
      PYTHONPATH="$BUILD/python" timeout 240 "$NCU" --clock-control none \
        --kernel-name "regex:${ROWPROFILE_KERNELS:-sample_rows|topk_rows|topk_merge|topk_candidates}" --launch-count 4 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section SourceCounters \
        --export "$OUT/rowprofile_$n" -f python3 "$ROOT/bench/profile_forward.py" --rows "$n" --topk 20 --sample \
        --iters 1 --warmup 0 --no-kernels >>"$OUT/rowprofile.log" 2>&1
      rcs+=" N=$n:$?"
      timeout 120 "$NCU" --import "$OUT/rowprofile_$n.ncu-rep" --page source --print-source sass --csv 2>/dev/null |
        gzip >"$OUT/rowprofile_${n}_sass.csv.gz"
      rm -f "$OUT/rowprofile_$n.ncu-rep"
    done
    say "rowprofile: rc$rcs (rowprofile.log, rowprofile_*_sass.csv.gz)"
    grep -E "^  [a-z_:<>(), ]*kernel|Duration|Issued Ipc Active|Warp Cycles Per Issued|Achieved Occupancy|DRAM Throughput|Registers Per" \
      "$OUT/rowprofile.log" | cut -c1-160 >>"$SUMMARY"
  else
    say "rowprofile: skipped (no ncu, or no Python module in $BUILD/python)"
  fi
fi
done_step

# Optional: hardware counters (ncu, clocks left alone). PROFILE_JOBS: space-separated
# N:bucket:kernel-regex entries, each profiling the first matching launch of a bench run at N with
# DETLOGP_SM90_BUCKET=bucket ("auto" for the default); cuBLAS kernels match regex "nvjet|gemm".
# PROFILE_JOBS="" skips them. PROFILE_SECTIONS="--section SourceCounters ...": more ncu sections.
# PROFILE_KERNELS_N="1 1024": the N at which every kernel's duration is listed (default 1; "" none);
# PROFILE_CLOCKS="none base": the ncu clock controls of that listing (default none).
if has profile; then
  bench="$(find_bin bench_sm90)"
  NCU="$(command -v ncu || true)"
  if [[ -n "$bench" && -n "$NCU" ]]; then
    rcs=""
    for job in ${PROFILE_JOBS-1:auto:fused_ 4096:auto:fused_}; do
      IFS=: read -r n bucket regex <<<"$job"
      echo "== ncu N=$n bucket=$bucket kernel=$regex" >>"$OUT/profile.log"
      # shellcheck disable=SC2086
      DETLOGP_SM90_BUCKET="$bucket" timeout 300 "$NCU" --clock-control none --kernel-name "regex:$regex" --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --section WarpStateStats --section SchedulerStats ${PROFILE_SECTIONS:-} --print-details all \
        "$bench" --n "$n" --reps 1 --csv /dev/null >>"$OUT/profile.log" 2>&1
      rcs+=" $job=$?"
    done
    # Every kernel's duration and SM cycles at each N of PROFILE_KERNELS_N (default 1; validate,
    # fused, combine; cuBLAS for comparison), serialized by ncu, under each ncu clock control of
    # PROFILE_CLOCKS (default "none": clocks not locked; "base" locks the base clock).
    for clock in ${PROFILE_CLOCKS:-none}; do
      for n in ${PROFILE_KERNELS_N-1}; do
        echo "== kernels N=$n clock-control=$clock" >>"$OUT/profile_kernels.log"
        timeout 300 "$NCU" --clock-control "$clock" \
          --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed \
          "$bench" --n "$n" --reps 1 --csv /dev/null >>"$OUT/profile_kernels.log" 2>&1
        rcs+=" n$n-$clock-kernels=$?"
      done
    done
    say "profile: ncu rc per job:$rcs (profile.log, profile_kernels.log)"
  else
    say "profile: skipped (ncu or bench missing)"
  fi
fi
done_step

echo
echo "================ summary ================"
cat "$SUMMARY"
if [[ -f "$OUT/bench.log" ]]; then
  echo
  sed -n '/^N  *method/,$p' "$OUT/bench.log"
  grep -E "copy:|HBM floor" "$OUT/bench.log" | head -2
fi
pack

#!/usr/bin/env bash
# The Python/PyTorch checks on a GPU machine (SM90, torch with CUDA; 2 GPUs for tensor parallel):
#   1. the Python tests: numpy, torch on the CPU, and the `gpu`-marked SM90 tests;
#   2. tensor parallel TP=2 over NCCL (torchrun, one process per GPU) against TP=1, twice: a small
#      odd shape and Qwen3-8B's head;
#   3. the backward benchmark at Qwen3-8B shapes (N=4096, D=4096, V=151936) against plain PyTorch;
#   4. with --bench: the user-facing benchmark `python -m detlogp.bench` (detlogp.torch against
#      torch's ops and the installed peers; arguments from BENCH_TORCH_ARGS, default the Qwen3-8B
#      head), CSV and PNG into $OUT. --bench-only runs that step alone (after the build).
# Logs go to $OUT (default out/gpu_python). Exit status: non-zero when any step failed.
# A focused run: GPU_PYTHON_TESTS="tests/python/test_sampling_gpu.py" (pytest's arguments, default
# tests/python) and GPU_PYTHON_STEPS=pytest (of pytest,tp,bench; default all three).
#
# The extension: an existing importable tree build/python (CMake -DDETLOGP_BUILD_PYTHON=ON); else
# `--pip` installs the package (pip install --no-build-isolation --no-deps ., no network needed
# where scikit-build-core and nanobind are installed); else build/ is (re)configured with
# -DDETLOGP_BUILD_PYTHON=ON and the module and CLI are built there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${BUILD_DIR:-build}  # scripts/gpu_check.sh passes its own build tree
OUT=${OUT:-out/gpu_python}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # never NVLink multicast
status=0
STEPS=${GPU_PYTHON_STEPS:-pytest,tp,bench}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
step() {  # step NAME COMMAND...: runs, logs to $OUT/NAME.log, remembers a failure
  local name=$1
  shift
  echo "== $name: $*"
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "   ok ($OUT/$name.log)"
  else
    echo "   FAILED (exit $?): tail of $OUT/$name.log"
    tail -n 30 "$OUT/$name.log"
    status=1
  fi
}

pip=0 bench=0 bench_only=0
for arg in "$@"; do
  case "$arg" in
    --pip) pip=1 ;;
    --bench) bench=1 ;;
    --bench-only) bench=1 bench_only=1 ;;
    *)
      echo "gpu_python_check: unknown argument '$arg' (--pip, --bench, --bench-only)" >&2
      exit 2
      ;;
  esac
done

if [ $pip = 1 ]; then
  step pip_install "$PY" -m pip install --no-build-isolation --no-deps -v .
  pypath=""
elif ls "$BUILD"/python/detlogp/_detlogp*.so >/dev/null 2>&1; then
  pypath=$BUILD/python
else
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  step configure cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DDETLOGP_BUILD_PYTHON=ON \
    "-DPython_EXECUTABLE=$(command -v "$PY")"
  step build cmake --build "$BUILD" -j "$(nproc)" --target _detlogp detlogp_cli
  pypath=$BUILD/python
fi
export PYTHONPATH=${pypath}${PYTHONPATH:+:$PYTHONPATH}
[ -x "$BUILD/detlogp" ] && export PYTEST_DETLOGP_CLI=$BUILD/detlogp
"$PY" -c 'import detlogp, torch; print("detlogp", detlogp.__version__, detlogp.__file__); print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), "GPUs"); [print(" ", b["id"], "contract" if b["contract"] else "non-contract", "available" if b["available"] else "unavailable: " + b["detail"]) for b in detlogp.backends()]' |
  tee "$OUT/environment.log"

if [ $bench_only = 1 ]; then STEPS=""; fi  # the user-facing benchmark alone
if has pytest; then
  # shellcheck disable=SC2086 # GPU_PYTHON_TESTS is a list of pytest arguments
  step pytest "$PY" -m pytest -v -rs -p no:cacheprovider ${GPU_PYTHON_TESTS:-tests/python}
  grep -E "passed|failed|SKIPPED" "$OUT/pytest.log" | tail -n 15
fi

ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if ! has tp; then
  echo "== tensor parallel TP=2 not asked for (GPU_PYTHON_STEPS=$STEPS)"
elif [ "$ngpu" -ge 2 ]; then
  step tp2_small "$PY" -m torch.distributed.run --nproc-per-node 2 tests/python/tp_worker.py --device cuda \
    --rows 257 --dim 512 --vocab 5000
  step tp2_qwen3_8b "$PY" -m torch.distributed.run --nproc-per-node 2 tests/python/tp_worker.py --device cuda \
    --rows 1024 --dim 4096 --vocab 151936
  grep -hE "PASS|FAIL|SKIP|TP_" "$OUT"/tp2_*.log | sort | uniq -c | sort -rn | head -n 30
else
  echo "== tensor parallel TP=2 skipped: $ngpu CUDA device(s) visible, 2 needed"
fi

if ! has bench; then
  echo "== backward benchmark not asked for (GPU_PYTHON_STEPS=$STEPS)"
elif "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  step bench_backward "$PY" bench/bench_backward.py --json "$OUT/bench_backward.json"
  cat "$OUT/bench_backward.log"
else
  echo "== backward benchmark skipped: no CUDA device (Qwen3-8B shapes need a GPU)"
  status=1
fi

if [ $bench = 1 ]; then
  # shellcheck disable=SC2086
  step detlogp_bench "$PY" -m detlogp.bench ${BENCH_TORCH_ARGS:-} --csv "$OUT/detlogp-bench.csv" \
    --png "$OUT/detlogp-bench.png"
  sed -n '/^skipped or failed:/,$p' "$OUT/detlogp_bench.log"
fi

echo "gpu_python_check: $([ $status = 0 ] && echo all steps passed || echo SOME STEPS FAILED) (logs in $OUT)"
exit $status

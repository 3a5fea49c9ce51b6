#!/usr/bin/env bash
# Validation ladder L3-L5 on an SM90 machine (docs/validation.md): golden fingerprints recorded
# and replayed for (contract version, sm90a, 90), the L3 two-process check, and the L4/L5
# rollout-vs-trainer harness at Qwen3-8B shapes. Everything goes to "$OUT" (else ./out/golden):
#   fingerprints.tsv   the repository's file plus the SM90 rows recorded here, the entropy rows
#                      among them where the repository lacks them (commit it:
#                      cp "$OUT/fingerprints.tsv" tests/golden/fingerprints.tsv)
#   golden.log, l3.log, harness-*/report.{json,md}, summary.txt
# Reuses $BUILD_DIR (default build-gpu, as scripts/gpu_check.sh) when it holds a detlogp binary,
# else configures and builds it. Exit 0 only when every step passed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}/golden"
mkdir -p "$OUT"
BUILD="${BUILD_DIR:-$ROOT/build-gpu}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
status=0
step() {  # step NAME LOG command...: runs, logs, records PASS/FAIL
  local name="$1" log="$2"
  shift 2
  echo "== $*" >>"$log"
  "$@" >>"$log" 2>&1
  local rc=$?
  say "$name: $([[ $rc -eq 0 ]] && echo PASS || echo "FAIL (rc=$rc, see $(basename "$log"))")"
  [[ $rc -eq 0 ]] || status=1
  return $rc
}

BIN="$BUILD/detlogp"
if [[ ! -x "$BIN" ]]; then
  GEN=()
  command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
  NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j "${JOBS:-16}" --target detlogp_cli >>"$OUT/build.log" 2>&1 ||
    { say "build: FAIL (build.log)"; tail -30 "$OUT/build.log"; exit 1; }
fi
"$BIN" info >"$OUT/info.log" 2>&1
say "$(grep -E '^served by' "$OUT/info.log")"

# 1. Goldens. The CPU rows and the platform-independent "inputs" rows must pass here as on any
# machine. The auto backend (SM90) replays every row the repository has for (1, sm90a, 90) and
# records the ones it lacks (the first run on SM90, or rows added since: the entropy rows) into
# the copy: --record appends only what is missing and still FAILs on any recorded row that differs.
# A second process then replays the copy. Recorded rows are listed in the summary, never passed
# over: commit them with cp "$OUT/fingerprints.tsv" tests/golden/fingerprints.tsv.
cp "$ROOT/tests/golden/fingerprints.tsv" "$OUT/fingerprints.tsv"
step "goldens cpu (repository file)" "$OUT/golden.log" \
  "$BIN" verify --golden --strict --backend cpu-linear-logp-contract-v1
: >"$OUT/golden-auto.log"
step "goldens auto backend (repository rows replayed, missing rows recorded)" "$OUT/golden-auto.log" \
  "$BIN" verify --golden --strict --record --golden-file "$OUT/fingerprints.tsv"
cat "$OUT/golden-auto.log" >>"$OUT/golden.log"
grep -E "^entropy: " "$OUT/golden-auto.log" | sed 's/^/  auto backend /' | tee -a "$SUMMARY" >/dev/null
# Entropy rows recorded for a backend that no longer serves the output would go unchecked: a FAIL.
unchecked=$(sed -nE 's/^entropy: NOT CHECKED: .*; ([0-9]+) entropy rows recorded for .*/\1/p' "$OUT/golden-auto.log")
if [[ "${unchecked:-0}" -gt 0 ]]; then
  say "goldens: FAIL: ${unchecked} recorded entropy rows of the auto backend's key are not checked (it serves no entropy)"
  status=1
fi
new_rows=$(grep -c '^recorded:' "$OUT/golden-auto.log" || true)
new_entropy=$(grep -cP '^recorded: \d+\tsm90a\t\d+\t[^\t]+\tentropy\t' "$OUT/golden-auto.log" || true)
if [[ "${new_rows:-0}" -gt 0 ]]; then
  say "goldens: ${new_rows} rows NOT IN THE REPOSITORY, recorded into $OUT/fingerprints.tsv (commit them: cp that file to tests/golden/fingerprints.tsv)"
  [[ "${new_entropy:-0}" -gt 0 ]] &&
    say "goldens: the SM90 entropy rows were ABSENT from the repository: ${new_entropy} recorded here"
  grep '^recorded:' "$OUT/golden-auto.log" | sed 's/^recorded: /  new row: /' | tee -a "$SUMMARY" >/dev/null
  # A second process replays what the first recorded (run-to-run and process-to-process bits).
  step "goldens auto backend replay of the new rows" "$OUT/golden.log" \
    "$BIN" verify --golden --strict --golden-file "$OUT/fingerprints.tsv"
else
  say "goldens: every auto-backend row is in the repository (none recorded)"
fi

# 2. L3: trainer-shaped and rollout-shaped calls in two processes, every golden case (Qwen3-8B
# TP=2 included), strict mode (so the SM90 backend, no fallback).
step "L3 trainer side" "$OUT/l3.log" "$BIN" harness l3 --side trainer --tp 2 --strict --out "$OUT/l3-trainer.safetensors"
step "L3 rollout side" "$OUT/l3.log" "$BIN" harness l3 --side rollout --strict --out "$OUT/l3-rollout.safetensors"
step "L3 check" "$OUT/l3.log" "$BIN" harness l3-check --a "$OUT/l3-trainer.safetensors" --b "$OUT/l3-rollout.safetensors"
grep -E "^  [a-z0-9.-]+ +(PASS|FAIL)|^side " "$OUT/l3.log" | cut -c1-200 >>"$SUMMARY"

# L3 again with the rollout side in Python (the binding's serving entry, one row at a time), when
# the module is in this build tree (gpu_check.sh builds it where nanobind is importable).
if ls "$BUILD"/python/detlogp/_detlogp*.so >/dev/null 2>&1; then
  mkdir -p "$OUT/l3-inputs"
  step "L3 export inputs" "$OUT/l3.log" "$BIN" harness l3-export --dir "$OUT/l3-inputs"
  step "L3 rollout side (Python binding)" "$OUT/l3.log" env PYTHONPATH="$BUILD/python" python3 "$ROOT/tools/l3_rollout.py" \
    --inputs "$OUT/l3-inputs" --out "$OUT/l3-rollout-python.safetensors" --strict
  step "L3 check (C++ trainer vs Python rollout)" "$OUT/l3.log" "$BIN" harness l3-check --a "$OUT/l3-trainer.safetensors" \
    --b "$OUT/l3-rollout-python.safetensors"
  rm -rf "$OUT/l3-inputs"
else
  say "L3 Python rollout side: skipped (no Python module in $BUILD)"
fi

# 3. L4/L5: small config, then Qwen3-8B shapes (D=4096, V=151936 padded to 152064, trainer TP=2).
step "harness small" "$OUT/harness.log" "$BIN" harness rollout-vs-trainer --strict --seqs 16 --max-len 12 --d 1024 \
  --v 2112 --real-vocab 2053 --tp 2 --out "$OUT/harness-small"
step "harness qwen3-8b" "$OUT/harness.log" "$BIN" harness rollout-vs-trainer --strict --seqs "${SEQS:-32}" \
  --max-len "${MAX_LEN:-16}" --max-batch 8 --d 4096 --v 152064 --real-vocab 151936 --tp 2 --out "$OUT/harness-qwen3-8b"
# On two or more GPUs: the TP ranks on their own GPUs over real NCCL, trainer TP=2 x CP=2 (the
# CP groups take turns on the same two GPUs unless there are four), rollout at TP=1 and TP=2.
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ "${ngpu:-0}" -ge 2 ]]; then
  for rtp in 1 2; do
    step "harness qwen3-8b on GPUs 0,1 (NCCL), trainer TP=2 x CP=2, rollout TP=$rtp" "$OUT/harness.log" \
      "$BIN" harness rollout-vs-trainer --strict --seqs "${SEQS:-32}" --max-len "${MAX_LEN:-16}" --max-batch 8 \
      --d 4096 --v 152064 --real-vocab 151936 --tp 2 --cp 2 --rollout-tp "$rtp" --devices 0,1 \
      --out "$OUT/harness-qwen3-8b-nccl-rtp$rtp"
  done
else
  say "harness on real NCCL: skipped ($ngpu GPU visible, 2 needed)"
fi
grep -E "^(rollout|trainer|weight fingerprint|logp|entropy|negative control|verdict)" "$OUT/harness.log" | cut -c1-220 >>"$SUMMARY"

echo
echo "================ golden / L3 / L4-L5 summary ================"
cat "$SUMMARY"
exit $status

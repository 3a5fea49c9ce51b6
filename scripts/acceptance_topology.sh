#!/usr/bin/env bash
# The seed's acceptance topology (docs/validation.md section 6): Qwen3-8B lm_head (D=4096,
# V=152064 padded, real 151936), bf16 hidden and weights, fp32 logp, on one host.
#   - trainer TP=2 x CP=2 (x DP=2 replicas on 8 GPUs: GPUs 0-3 and 4-7, different seeds, at the
#     same time), rollout at TP=1 and at TP=2: mismatch_count = 0, max_abs_diff = 0, K3 = 0, with
#     the validation reports;
#   - TP in {2, 4, 8} on real NCCL, one GPU per rank, against TP=1 (tests/gpu/test_sm90_tp).
# The launcher is the project's own: one process per replica, one thread per GPU rank, NCCL
# communicators from ncclCommInitAll. With fewer GPUs it runs what fits (2 GPUs: the CP groups take
# turns on GPUs 0,1; TP only up to the GPU count) and names what it skipped. Logs and reports go to
# "$OUT/acceptance" (default ./out/acceptance). Exit 0 only when every step that ran passed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}/acceptance"
BUILD="${BUILD_DIR:-$ROOT/build-gpu}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
status=0

if [[ ! -x "$BUILD/detlogp" || ! -x "$BUILD/tests/gpu/test_sm90_tp" ]]; then
  GEN=()
  command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
  cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j "${JOBS:-32}" --target detlogp_cli test_sm90_tp >>"$OUT/build.log" 2>&1 ||
    { say "build: FAIL (build.log)"; exit 1; }
fi
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
say "GPUs visible: ${ngpu:-0}"

# TP in {2, 4, 8} on real NCCL (as many as the GPUs allow), padded vocabulary, against TP=1.
# A skipped NCCL case (too few GPUs, no NCCL) is "not run", never a pass.
"$BUILD/tests/gpu/test_sm90_tp" --gtest_filter='*Nccl*' >"$OUT/tp_nccl.log" 2>&1
rc=$?
if [[ $rc -eq 0 ]] && grep -q '\[  SKIPPED \]' "$OUT/tp_nccl.log"; then
  say "TP on real NCCL (test_sm90_tp): NOT RUN ($(grep -m1 'NCCL part skipped' "$OUT/tp_nccl.log" | sed 's/.*NCCL part/NCCL part/'))"
  rc=1
else
  say "TP on real NCCL (test_sm90_tp): $([[ $rc -eq 0 ]] && echo PASS || echo "FAIL rc=$rc")"
fi
grep -E "^NCCL TP|NCCL part" "$OUT/tp_nccl.log" | tee -a "$SUMMARY" >/dev/null
[[ $rc -eq 0 ]] || status=1
for tp in 4 8; do
  [[ "${ngpu:-0}" -ge $tp ]] || say "  not run: TP=$tp on real NCCL needs $tp GPUs"
done

# One replica: trainer TP=2 x CP=2 on the given GPUs, rollout at TP=1 then TP=2.
replica() {  # replica NAME DEVICES SEED
  local name=$1 devices=$2 seed=$3 rc=0
  for rtp in 1 2; do
    "$BUILD/detlogp" harness rollout-vs-trainer --strict --seqs "${SEQS:-32}" --max-len "${MAX_LEN:-16}" --max-batch 8 \
      --d 4096 --v 152064 --real-vocab 151936 --tp 2 --cp 2 --rollout-tp "$rtp" --devices "$devices" --seed "$seed" \
      --out "$OUT/$name-rollout-tp$rtp" >"$OUT/$name-rollout-tp$rtp.log" 2>&1 || rc=1
  done
  return $rc
}
if [[ "${ngpu:-0}" -ge 8 ]]; then
  replica dp0 0,1,2,3 0 & p0=$!
  replica dp1 4,5,6,7 1 & p1=$!
  wait $p0 || status=1
  wait $p1 || status=1
  names="dp0 dp1"
elif [[ "${ngpu:-0}" -ge 4 ]]; then
  replica dp0 0,1,2,3 0 || status=1
  names="dp0"
  say "  not run: DP=2 (a second replica on GPUs 4-7) needs 8 GPUs"
elif [[ "${ngpu:-0}" -ge 2 ]]; then
  replica dp0 0,1 0 || status=1
  names="dp0"
  say "  partial: TP=2 x CP=2 with both CP groups on GPUs 0,1 in turn (4 GPUs give each its own); DP=2 needs 8"
else
  names=""
  say "  not run: the harness on real NCCL needs 2 GPUs or more"
  status=1
fi
for n in $names; do
  for rtp in 1 2; do
    log="$OUT/$n-rollout-tp$rtp.log"
    say "replica $n, rollout TP=$rtp: $(grep -E '^verdict' "$log" | tail -1)"
    grep -E "^(trainer|logp|negative control)" "$log" | sed 's/^/  /' | tee -a "$SUMMARY" >/dev/null
  done
done
echo
echo "================ acceptance topology summary ================"
cat "$SUMMARY"
exit $status

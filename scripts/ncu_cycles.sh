#!/usr/bin/env bash
# SM cycles of the fused trainer kernel against cuBLAS's GEMM, under ncu, for A/B of kernel changes.
# ncu's cycle counts repeat within ~0.05 % from launch to launch, where CUDA-event timing of the same
# kernel moves by 1-2 % (H200; docs/perf.md), so a 0.3 % change shows here and not in
# bench_sm90. Clocks are left alone (--clock-control none); ncu flushes the caches before every
# profiled kernel, so effects that live in L2 between kernels (such as an L2 cache policy on the
# tile summaries that the combine reads) do not show.
#
#   scripts/ncu_cycles.sh [--n 1024,4096] [--rounds 2] [--kernel REGEX] BENCH_SM90 [BENCH_SM90 ...]
#
# Each BENCH_SM90 is a bench_sm90 binary (e.g. one per commit). For every N and round it prints one
# line per binary: sm__cycles_active.avg (the mean over the SMs), the executed instructions and the
# ratio to cuBLAS's bf16 GEMM, whose cycles are taken once per N from the first binary. --kernel
# picks the fused kernel (default: fused_cooperative, the trainer's kernel above N = 64 at D = 4096;
# use fused_pingpong for N <= 64). Exit status 1 when a measurement is missing.
set -uo pipefail

ns="1024,4096"
rounds=2
kernel="fused_cooperative"
bins=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --n) ns="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --kernel) kernel="$2"; shift 2 ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) bins+=("$1"); shift ;;
  esac
done
[[ ${#bins[@]} -gt 0 ]] || { echo "ncu_cycles: no bench_sm90 binary given (--help)"; exit 2; }
NCU="$(command -v ncu || true)"
[[ -n "$NCU" ]] || { echo "ncu_cycles: ncu not found"; exit 2; }

# cycles BIN N REGEX -> "cycles instructions" of the first matching launch, or nothing.
cycles() {
  "$NCU" --clock-control none --kernel-name "regex:$3" --launch-count 1 \
    --metrics sm__cycles_active.avg,smsp__inst_executed.sum \
    "$1" --n "$2" --reps 1 --buckets none --csv /dev/null 2>/dev/null |
    awk '/sm__cycles_active.avg/ {gsub(",", "", $3); c = $3}
         /smsp__inst_executed.sum/ {gsub(",", "", $3); i = $3}
         END {if (c != "" && i != "") print c, i}'
}

status=0
for n in ${ns//,/ }; do
  read -r ref _ <<<"$(cycles "${bins[0]}" "$n" nvjet)"
  if [[ -z "${ref:-}" ]]; then
    echo "N=$n: no cuBLAS measurement"; status=1; continue
  fi
  printf 'N=%-6s cuBLAS GEMM (nvjet)        %14.0f cycles\n' "$n" "$ref"
  for ((r = 1; r <= rounds; ++r)); do
    for b in "${bins[@]}"; do
      read -r c i <<<"$(cycles "$b" "$n" "$kernel")"
      if [[ -z "${c:-}" ]]; then
        echo "N=$n round $r $b: no measurement of /$kernel/"; status=1; continue
      fi
      awk -v n="$n" -v r="$r" -v b="$(basename "$b")" -v c="$c" -v i="$i" -v ref="$ref" \
        'BEGIN {printf "N=%-6s round %d %-20s %14.0f cycles %14.0f instructions  %.4fx cuBLAS\n", n, r, b, c, i, c / ref}'
    done
  done
done
exit $status

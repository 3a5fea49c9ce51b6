#!/usr/bin/env bash
# A/B of two bench_sm90 binaries on one GPU in one call: rounds alternate A, B, A, B, ... (so drifts
# of clock and temperature hit both), each round one full bench_sm90 run; then, per (N, method), the
# median over rounds of each binary's paired ratio to its own cuBLAS bf16 GEMM, and B / A.
#   scripts/bench_ab.sh A_BIN B_BIN [ROUNDS=3] [bench_sm90 args, default --reps 20 --buckets none]
# CSVs and logs go to "$OUT" (else ./out): ab_A<r>.csv, ab_B<r>.csv, ab.log; the table prints last.
set -uo pipefail
a="$1" b="$2" rounds="${3:-3}"
shift 3 2>/dev/null || shift $#
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--reps 20 --buckets none)
OUT="${OUT:-$(pwd)/out}"
mkdir -p "$OUT"
for ((r = 1; r <= rounds; ++r)); do
  for side in A B; do
    bin="$a"
    [[ $side == B ]] && bin="$b"
    (cd "$OUT" && "$bin" "${args[@]}" --csv "$OUT/ab_${side}${r}.csv") >>"$OUT/ab.log" 2>&1 || echo "bench_ab: $side round $r failed (ab.log)"
  done
done
python3 - "$OUT" "$rounds" <<'PY'
import csv, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ratios = {}
for side in "AB":
    for r in range(1, rounds + 1):
        try:
            rows = list(csv.DictReader(open(f"{out}/ab_{side}{r}.csv")))
        except OSError:
            continue
        for row in rows:
            if row["method"].startswith("cublas"):
                continue
            key = (int(row["N"]), row["method"])
            ratios.setdefault(key, {}).setdefault(side, []).append(float(row["ratio_vs_cublas_bf16out_paired"]))
print(f"{'N':>6} {'method':<28} {'A paired':>9} {'B paired':>9} {'B/A':>7}  (median over {rounds} rounds each)")
for (n, method), by in sorted(ratios.items()):
    ma = statistics.median(by.get("A", [float("nan")]))
    mb = statistics.median(by.get("B", [float("nan")]))
    print(f"{n:>6} {method:<28} {ma:>9.4f} {mb:>9.4f} {mb / ma:>7.4f}")
PY

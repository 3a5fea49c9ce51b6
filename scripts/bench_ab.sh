#!/usr/bin/env bash
# A/B of bench_sm90 binaries (e.g. one per commit) on one GPU in one call: each round runs every
# binary once, in a fresh shuffled order, so drifts of clock and temperature hit all of them; then,
# per (N, method), the median over rounds of each binary's paired ratio to its own cuBLAS bf16 GEMM,
# and each binary's median over the first one's.
#   [ROUNDS=3] [BENCH_ARGS="--reps 20 --buckets none"] scripts/bench_ab.sh BIN_A BIN_B [BIN_C ...]
# CSVs and the log go to "$OUT" (else ./out): ab_<k>_<round>.csv (k = 0, 1, ... in argument
# order), ab.log; the table prints last.
set -uo pipefail
rounds="${ROUNDS:-3}"
read -r -a args <<<"${BENCH_ARGS:---reps 20 --buckets none}"
bins=()
for b in "$@"; do bins+=("$(realpath "$b")"); done
[[ ${#bins[@]} -ge 2 ]] || { echo "bench_ab: give two or more bench_sm90 binaries"; exit 2; }
OUT="${OUT:-$(pwd)/out}"
mkdir -p "$OUT"
for ((r = 1; r <= rounds; ++r)); do
  for k in $(seq 0 $((${#bins[@]} - 1)) | shuf); do
    (cd "$OUT" && "${bins[$k]}" "${args[@]}" --csv "$OUT/ab_${k}_${r}.csv") >>"$OUT/ab.log" 2>&1 ||
      echo "bench_ab: ${bins[$k]} round $r failed (ab.log)"
  done
done
python3 - "$OUT" "$rounds" "${bins[@]}" <<'PY'
import csv, statistics, sys
out, rounds, bins = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
ratios = {}
for k in range(len(bins)):
    for r in range(1, rounds + 1):
        try:
            rows = list(csv.DictReader(open(f"{out}/ab_{k}_{r}.csv")))
        except OSError:
            continue
        for row in rows:
            if not row["method"].startswith("cublas"):
                key = (int(row["N"]), row["method"])
                ratios.setdefault(key, {}).setdefault(k, []).append(float(row["ratio_vs_cublas_bf16out_paired"]))
for k, b in enumerate(bins):
    print(f"[{k}] {b}")
print(f"{'N':>6} {'method':<18}" + "".join(f" {'[' + str(k) + ']':>8}" for k in range(len(bins)))
      + "".join(f" {'[' + str(k) + ']/[0]':>9}" for k in range(1, len(bins))) + f"  (paired ratio to cuBLAS, median of {rounds})")
for (n, method), by in sorted(ratios.items()):
    med = [statistics.median(by[k]) if k in by else float("nan") for k in range(len(bins))]
    print(f"{n:>6} {method:<18}" + "".join(f" {m:>8.4f}" for m in med) + "".join(f" {m / med[0]:>9.4f}" for m in med[1:]))
PY

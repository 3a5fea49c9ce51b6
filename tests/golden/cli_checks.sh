#!/bin/sh
# CLI checks of the golden layer (run by ctest): cli_checks.sh DETLOGP FINGERPRINTS.tsv MODE
#   record-replay  NOT RECORDED exits 1; --record appends (creating the file and its missing
#                  directories) and exits 0; a replay passes; a missing entropy row is NOT
#                  RECORDED; a backend without entropy says so; a tampered row FAILs and is not
#                  overwritten by --record
#   export-run     l3-export into a directory it creates; those inputs through
#                  `detlogp run --input` give the checked-in digests
set -eu
bin="$1" fingerprints="$2" mode="$3"
d="$(mktemp -d)"
trap 'rm -rf "$d"' EXIT
cpu="--strict --backend cpu-linear-logp-contract-v1"
expect_rc() {  # expect_rc CODE command...
  want="$1"; shift
  set +e; "$@" >"$d/out" 2>&1; rc=$?; set -e
  if [ "$rc" -ne "$want" ]; then cat "$d/out"; echo "expected exit $want, got $rc: $*"; exit 1; fi
}
case "$mode" in
  record-replay)
    f="$d/new/dir/f.tsv"
    expect_rc 1 "$bin" verify --golden $cpu --case tiny-v17 --golden-file "$f"
    grep -q "verdict: NOT RECORDED (0 pass, 0 fail, 3 not recorded)" "$d/out"
    grep -q "(no such file: 0 entries)" "$d/out"
    grep -q "^entropy: checked (entropy_id " "$d/out"
    grep -q "^not recorded: 3 fingerprints (1 of them entropy); --record appends them to " "$d/out"
    [ ! -e "$d/new" ]
    expect_rc 0 "$bin" verify --golden $cpu --case tiny-v17 --golden-file "$f" --record
    [ "$(grep -c '^recorded: ' "$d/out")" -eq 3 ]
    grep -qP '^recorded: 1\tcpu\t0\ttiny-v17\tentropy\t[0-9a-f]{64}$' "$d/out"
    expect_rc 0 "$bin" verify --golden $cpu --case tiny-v17 --golden-file "$f"
    grep -q "verdict: PASS (3 pass, 0 fail, 0 not recorded)" "$d/out"
    grep -q "^entropy: checked (entropy_id .*); 1 entropy rows recorded for cpu/0" "$d/out"
    # A file holding the logp/lse rows alone (as before the entropy rows): the entropy row is NOT
    # RECORDED, never passed over.
    tab="$(printf '\t')"
    grep -v "${tab}entropy${tab}" "$f" >"$d/no-entropy.tsv"
    expect_rc 1 "$bin" verify --golden $cpu --case tiny-v17 --golden-file "$d/no-entropy.tsv"
    grep -q "tiny-v17 entropy \[cpu/0\] .*NOT RECORDED" "$d/out"
    grep -q "verdict: NOT RECORDED (2 pass, 0 fail, 1 not recorded)" "$d/out"
    # A backend without the entropy output says that it checks none.
    expect_rc 1 "$bin" verify --golden --backend reference-materialized --case tiny-v17 --golden-file "$f"
    grep -q "^entropy: NOT CHECKED: reference-materialized serves no entropy output" "$d/out"
    # The recorded rows are the checked-in ones.
    grep -v '^#' "$f" | while IFS= read -r row; do grep -qxF "$row" "$fingerprints"; done
    # Tamper with the last digit of the last row: FAIL, and --record leaves it alone.
    sed -i '$ s/f$/X/; $ s/[0-9a-e]$/f/; $ s/X$/e/' "$f"
    cp "$f" "$d/tampered"
    expect_rc 1 "$bin" verify --golden $cpu --case tiny-v17 --golden-file "$f" --record
    grep -q "FAIL  got" "$d/out"
    cmp -s "$f" "$d/tampered"
    ;;
  export-run)
    e="$d/export/new"
    "$bin" harness l3-export --dir "$e" --case v2053-bias-t0.7,v17-i32-ignore7,v2112-real2053-t1.3 >/dev/null
    for c in v2053-bias-t0.7:-100:2053 v17-i32-ignore7:7:17 v2112-real2053-t1.3:-100:2053; do
      name="${c%%:*}" rest="${c#*:}"
      got="$("$bin" run --input "$e/$name.safetensors" --ignore-index "${rest%%:*}" --real-vocab "${rest#*:}" $cpu |
        sed -n 's/^sha256(logp|lse): //p')"
      want="$(grep -P "^1\tcpu\t0\t$name\tlogp\|lse\t" "$fingerprints" | cut -f6)"
      [ -n "$want" ] && [ "$got" = "$want" ] || { echo "$name: run --input gave $got, golden $want"; exit 1; }
    done
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
echo "$mode: ok"

#!/usr/bin/env bash
# The fresh-machine check: builds a minimal Debian root from Debian's packages (mmdebstrap, else
# debootstrap; variant minbase plus git and ca-certificates, what a user who cloned the repository
# has), clones this repository's HEAD into it and runs the README's two commands there,
# scripts/run.sh and then scripts/test.sh, in a chroot as root with the host's network. So
# install_deps.sh's apt path, the venv and the pip builds run as on a new machine; there is no
# nvcc in the root, so the CPU-only build is what it checks. Run it before any change to the
# set-up scripts is released. Needs root (chroot, mounts) and the network; 20-40 min on 2 cores.
#
# Usage: scripts/fresh_machine_check.sh [--suite SUITE] [--mirror URL] [--dir DIR] [--keep]
#   --suite   Debian release (default: bookworm)
#   --mirror  Debian mirror (default: http://deb.debian.org/debian)
#   --dir     where the root is built (default: build/fresh-machine/root; removed first)
#   --keep    leave the root in place afterwards (its mounts are always removed)
# Logs: build/fresh-machine/{bootstrap,run,test}.log. The summary is printed at the end and
# written to build/fresh-machine/summary.txt; the exit status is 0 only when both commands passed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
suite=bookworm
mirror=http://deb.debian.org/debian
security=http://deb.debian.org/debian-security
out="$ROOT/build/fresh-machine"
dir="$out/root"
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) suite="$2"; shift 2 ;;
    --mirror) mirror="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "fresh_machine_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "fresh_machine_check: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (chroot and mounts); run it with sudo"
if command -v mmdebstrap >/dev/null; then
  bootstrap=mmdebstrap
elif command -v debootstrap >/dev/null; then
  bootstrap=debootstrap
else
  die "needs mmdebstrap or debootstrap (Debian: apt-get install mmdebstrap)"
fi
mkdir -p "$out"
dir="$(realpath -m "$dir")"
case "$dir" in / | /usr | /usr/* | /etc | /etc/* | /bin | /lib | /home | /root) die "--dir $dir: refusing a system folder" ;; esac

mounted_under() {  # the mount points at or below $dir, deepest first
  awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r
}
unmount_all() {
  local m
  for m in $(mounted_under); do umount "$m" 2>/dev/null || umount -l "$m"; done
}
remove_root() {
  unmount_all
  if [ -n "$(mounted_under)" ]; then die "something is still mounted under $dir; not removing it"; fi
  rm -rf --one-file-system "$dir"
}
cleanup() {
  unmount_all
  if [ "$keep" = 0 ] && [ -d "$dir" ]; then remove_root; fi
}
[ -e "$dir" ] && remove_root
trap cleanup EXIT

head_commit="$(git -C "$ROOT" rev-parse HEAD)"
if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ]; then
  echo "fresh_machine_check: warning: uncommitted changes in $ROOT are not part of the check (it clones HEAD)" >&2
fi
started="$(date -u '+%Y-%m-%d %H:%M UTC')"
t0=$SECONDS

echo "fresh_machine_check: $bootstrap $suite (minbase) into $dir (log: $out/bootstrap.log)"
if [ "$bootstrap" = mmdebstrap ]; then
  mmdebstrap --mode=root --variant=minbase --include=git,ca-certificates "$suite" "$dir" \
    "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main" \
    >"$out/bootstrap.log" 2>&1 || { tail -n 30 "$out/bootstrap.log"; die "$bootstrap failed"; }
else
  debootstrap --variant=minbase --include=git,ca-certificates "$suite" "$dir" "$mirror" \
    >"$out/bootstrap.log" 2>&1 || { tail -n 30 "$out/bootstrap.log"; die "$bootstrap failed"; }
  printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s %s-security main\n' \
    "$mirror" "$suite" "$mirror" "$suite" "$security" "$suite" >"$dir/etc/apt/sources.list"
fi
t_bootstrap=$((SECONDS - t0))
release="Debian $(cat "$dir/etc/debian_version") ($suite)"
echo "fresh_machine_check: $release root in ${t_bootstrap} s"

# A clean clone of HEAD, as a user would have it.
git clone --quiet --no-hardlinks "$ROOT" "$dir/root/detlogp"
git -C "$dir/root/detlogp" checkout --quiet --detach "$head_commit"

cp /etc/resolv.conf "$dir/etc/resolv.conf"
# Where this host's network intercepts TLS with a local CA (/usr/local/share/ca-certificates), the
# root trusts it too, for apt and pip alike (pip reads the system store then, not its own bundle),
# as any machine set up on that network would.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$dir/usr/local/share/ca-certificates/"
  chroot "$dir" update-ca-certificates >>"$out/bootstrap.log" 2>&1
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$dir/etc/pip.conf"
  echo "fresh_machine_check: the root trusts this host's local CAs ($(ls /usr/local/share/ca-certificates/*.crt | wc -l) certificates)"
fi
mount -t proc proc "$dir/proc"
mount --rbind /sys "$dir/sys" && mount --make-rslave "$dir/sys"
mount --rbind /dev "$dir/dev" && mount --make-rslave "$dir/dev"

in_root() {  # command, log -> exit status; the output also goes to the terminal
  local st
  set +e
  env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 TERM=dumb \
    chroot "$dir" /bin/bash -c "cd /root/detlogp && $1" 2>&1 | tee "$2"
  st=${PIPESTATUS[0]}
  set -e
  return "$st"
}

echo "fresh_machine_check: scripts/run.sh (log: $out/run.log)"
t1=$SECONDS
run_rc=0
in_root scripts/run.sh "$out/run.log" || run_rc=$?
t_run=$((SECONDS - t1))

echo "fresh_machine_check: scripts/test.sh (log: $out/test.log)"
t2=$SECONDS
test_rc=0
in_root scripts/test.sh "$out/test.log" || test_rc=$?
t_test=$((SECONDS - t2))

verdict() { [ "$1" = 0 ] && echo PASS || echo "FAIL (exit $1)"; }
last() { grep -E "$1" "$2" | tail -n 1 || true; }
built="$(last '^run.sh: built in' "$out/run.log" | sed 's/^run.sh: //')"
served="$(last '^backend:' "$out/run.log")"
ctest_line="$(last 'tests passed, [0-9]+ tests failed out of' "$out/test.log")"
pytest_line="$(last '^=*.*[0-9]+ (passed|failed)' "$out/test.log" | sed 's/=//g; s/^ *//; s/ *$//')"
example_line="$(last '^example: ' "$out/test.log")"
cli_line="$(last '^test.sh: pip install . installed the CLI' "$out/test.log" | sed 's/^test.sh: //')"
{
  echo "fresh_machine_check: summary"
  echo "  date:     $started"
  echo "  commit:   $head_commit"
  echo "  root:     $release, minbase + git + ca-certificates by $bootstrap, ${t_bootstrap} s"
  echo "  run.sh:   $(verdict "$run_rc") in ${t_run} s (install_deps + build + run; ${built:-no build line})"
  echo "            ${served:-no backend line}"
  echo "  test.sh:  $(verdict "$test_rc") in ${t_test} s"
  echo "            ctest: ${ctest_line:-no result line}"
  echo "            pytest: ${pytest_line:-no result line}"
  echo "            ${example_line:-example: no result line}; ${cli_line:-CLI: no result line}"
  echo "  total:    $((SECONDS - t0)) s"
} | tee "$out/summary.txt"
[ "$run_rc" = 0 ] && [ "$test_rc" = 0 ]

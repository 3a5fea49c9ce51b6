#!/usr/bin/env bash
# The main job, from a fresh machine: install, build, run detlogp on its built-in problem
# (the SM90 backend when an H100/H200 is present, else the CPU backend). Arguments go to
# `detlogp run` (e.g. --input file.safetensors --out result.safetensors) and run in the caller's
# directory, so relative paths mean what they say there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install_deps.sh"
if [ -d "$root/build/tools/bin" ]; then export PATH="$root/build/tools/bin:$PATH"; fi

# The build's progress (configure summary and one line per compiled file) goes to stderr; the
# full output, with nvcc's per-kernel register reports, to build/build.log, shown on a failure.
mkdir -p "$root/build"
log="$root/build/build.log"
echo "run.sh: building in $root/build ($(nproc) jobs; full log: $log)" >&2
start=$SECONDS
set +e
"$root/scripts/build.sh" 2>&1 | tee "$log" |
  grep --line-buffered -E '^(\[ *[0-9]+(/[0-9]+|%)\] |-- detlogp:|ninja: no work to do)' >&2
status=("${PIPESTATUS[@]}")
set -e
if [ "${status[0]}" -ne 0 ]; then
  echo "run.sh: the build failed (exit ${status[0]}); the end of $log:" >&2
  tail -n 60 "$log" >&2
  exit "${status[0]}"
fi
echo "run.sh: built in $((SECONDS - start)) s" >&2
"$root/build/detlogp" info
"$root/build/detlogp" run "$@"

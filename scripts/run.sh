#!/usr/bin/env bash
# The main job, from a fresh machine: install, build, run detlogp on its built-in problem
# (the SM90 backend when an H100/H200 is present, else the CPU backend). Arguments go to
# `detlogp run` (e.g. --input file.safetensors --out result.safetensors).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh >/dev/null
build/detlogp info
build/detlogp run "$@"

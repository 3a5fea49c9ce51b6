#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, build, run every test. GPU tests skip
# (and say so) where no SM90 GPU is present; when nvcc is here the CUDA sources are built for
# sm_90a and their SASS is checked.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 1500
if command -v nvcc >/dev/null && [ -x scripts/check_sass.sh ]; then
  scripts/check_sass.sh build
fi

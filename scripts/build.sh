#!/usr/bin/env bash
# Configures and builds detlogp into ./build (Release). Extra arguments go to cmake's configure and
# stay in build/'s cache for later builds, e.g. scripts/build.sh -DDETLOGP_ENABLE_CUDA=OFF for a
# CPU-only build on a machine with nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
# A CMake that install_deps.sh fetched from PyPI (the system's was older than 3.24).
if [ -d build/tools/bin ]; then export PATH="$PWD/build/tools/bin:$PATH"; fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j "$(nproc)"

#!/usr/bin/env bash
# Configures and builds detlogp into ./build (Release). Extra arguments go to cmake's configure.
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j "$(nproc)"

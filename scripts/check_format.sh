#!/usr/bin/env bash
# Fails when a C++/CUDA source differs from .clang-format's style (clang-format 14+).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "check_format: clang-format not found; install it (Debian: clang-format)" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh' 2>/dev/null || find include src tools tests bench -name '*.[ch]pp' -o -name '*.cu' -o -name '*.cuh')
clang-format --dry-run --Werror "${files[@]}"
echo "check_format: ${#files[@]} files formatted"

#!/usr/bin/env bash
# Installs what building and testing detlogp needs on a fresh Debian/Ubuntu machine: a C++20
# compiler, CMake >= 3.24, Ninja, GoogleTest, clang-format, and Python 3 with venv and headers
# (the tests' venv, the nanobind extension). Skips what is already there. Nothing is pip-installed
# outside the project: a newer CMake, where the system's is too old, goes into build/pyvenv and is
# linked from build/tools/bin (scripts/run.sh and test.sh put it on PATH).
# The CUDA toolkit is optional: when nvcc is on PATH the SM90 backend is built too.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

need=()
command -v g++ >/dev/null || need+=(g++)
command -v cmake >/dev/null || [ -x "$root/build/tools/bin/cmake" ] || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
command -v clang-format >/dev/null || need+=(clang-format)
if ! command -v python3 >/dev/null; then
  need+=(python3 python3-venv python3-dev)
else
  # Debian splits venv (ensurepip) and the C headers out of python3.
  python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
  python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
    need+=(python3-dev)
fi

if [ ${#need[@]} -gt 0 ]; then
  echo "install_deps: installing ${need[*]}"
  sudo_cmd=""
  if [ "$(id -u)" != 0 ]; then sudo_cmd="sudo"; fi
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ -d "$root/build/tools/bin" ]; then export PATH="$root/build/tools/bin:$PATH"; fi
cmake_version=$(cmake --version | head -n1 | awk '{print $3}')
if ! printf '3.24\n%s\n' "$cmake_version" | sort -V -C; then
  echo "install_deps: CMake $cmake_version is older than 3.24; installing a newer one from PyPI into build/pyvenv"
  [ -x "$root/build/pyvenv/bin/python" ] || python3 -m venv "$root/build/pyvenv"
  "$root/build/pyvenv/bin/python" -m pip install -q 'cmake>=3.24'
  mkdir -p "$root/build/tools/bin"
  ln -sf ../../pyvenv/bin/cmake ../../pyvenv/bin/ctest -t "$root/build/tools/bin"
  export PATH="$root/build/tools/bin:$PATH"
fi
echo "install_deps: ok (g++ $(g++ -dumpversion), cmake $(cmake --version | head -n1 | awk '{print $3}'), nvcc: $(command -v nvcc >/dev/null && nvcc --version | tail -n1 || echo none))"

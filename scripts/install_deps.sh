#!/usr/bin/env bash
# Installs what building and testing detlogp needs on a fresh Debian/Ubuntu machine:
# a C++20 compiler, CMake >= 3.24, Ninja and GoogleTest. Skips what is already there.
# The CUDA toolkit is optional: when nvcc is on PATH the SM90 backend is built too.
set -euo pipefail

need=()
command -v g++ >/dev/null || need+=(g++)
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
command -v python3 >/dev/null || need+=(python3 python3-pip)
command -v clang-format >/dev/null || need+=(clang-format)
# The Python tests run in a venv (Debian's python3 refuses pip installs outside one).
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)

if [ ${#need[@]} -gt 0 ]; then
  echo "install_deps: installing ${need[*]}"
  sudo_cmd=""
  if [ "$(id -u)" != 0 ]; then sudo_cmd="sudo"; fi
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

cmake_version=$(cmake --version | head -n1 | awk '{print $3}')
if ! printf '3.24\n%s\n' "$cmake_version" | sort -V -C; then
  echo "install_deps: CMake $cmake_version is older than 3.24; installing a newer one from PyPI"
  python3 -m pip install -q 'cmake>=3.24'
fi
echo "install_deps: ok (g++ $(g++ -dumpversion), cmake $(cmake --version | head -n1 | awk '{print $3}'), nvcc: $(command -v nvcc >/dev/null && nvcc --version | tail -n1 || echo none))"

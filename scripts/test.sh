#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, build, run every test. GPU tests skip
# (and say so) where no SM90 GPU is present; when nvcc is here the CUDA sources are built for
# sm_90a and their SASS is checked (HGMMA present, no atomics, no MUFU.EX2/LG2). Then the C++
# package: installed into build/install and examples/cpp built against it and run; then the
# Python package in its venv, build/pyvenv. Every tool this script installs with pip goes into
# that venv (Debian's python3 refuses pip installs outside one).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
# A CMake that install_deps had to fetch from PyPI (older system CMake) is linked here.
if [ -d build/tools/bin ]; then export PATH="$PWD/build/tools/bin:$PATH"; fi
scripts/check_format.sh
scripts/check_layers.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 1500

venv=build/pyvenv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if command -v nvcc >/dev/null; then
  if ! command -v cuobjdump >/dev/null && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump" ] &&
     ! compgen -G "$venv/lib/python3*/site-packages/nvidia/*/bin/cuobjdump" >/dev/null; then
    "$venv/bin/python" -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  fi
  scripts/check_sass.sh build/libdetlogp.a  # finds the venv's cuobjdump
else
  echo "test.sh: no nvcc here; the SM90 sources were not built (SASS check skipped)"
fi

# C++ consumers (README, "C++ API"): the installed CMake package and CLI.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
rm -rf build/install build/example-cpp
cmake --install build --prefix build/install >/dev/null
build/install/bin/detlogp --version
cmake -S examples/cpp -B build/example-cpp "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PWD/build/install" >/dev/null
cmake --build build/example-cpp
build/example-cpp/detlogp_example

# Python package (docs/python.md): built by pip (CPU-only) into the venv, then the numpy and
# torch tests against the CPU backend and the CLI built above. torch comes from its CPU wheel
# index, else from PyPI; where neither answers, the torch tests skip and say so.
"$venv/bin/python" -m pip install -q nanobind scikit-build-core numpy pytest
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --retries 1 --timeout 10 torch --index-url https://download.pytorch.org/whl/cpu ||
    "$venv/bin/python" -m pip install -q torch ||
    echo "test.sh: WARNING: torch could not be installed; the torch tests will be skipped"
fi
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps . \
  -C cmake.define.DETLOGP_ENABLE_CUDA=OFF -C build-dir=build/pip
# pip install . puts the CLI on the environment's PATH.
cli="$(PATH="$PWD/$venv/bin:$PATH" command -v detlogp || true)"
if [ "$cli" != "$PWD/$venv/bin/detlogp" ]; then
  echo "test.sh: FAIL: pip install . did not put the detlogp CLI into $venv/bin (found: '${cli:-nothing}')"
  exit 1
fi
"$cli" info >/dev/null
echo "test.sh: pip install . installed the CLI: $venv/bin/detlogp ($("$cli" --version))"
PYTEST_DETLOGP_CLI=build/detlogp "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python

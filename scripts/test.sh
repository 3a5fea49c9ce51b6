#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, build, run every test. GPU tests skip
# (and say so) where no SM90 GPU is present; when nvcc is here the CUDA sources are built for
# sm_90a and their SASS is checked (HGMMA present, no atomics, no MUFU.EX2/LG2). Then the C++
# package: installed into build/install and examples/cpp built against it and run; then the
# Python package in its venv, build/pyvenv. Every tool this script installs with pip goes into
# that venv (Debian's python3 refuses pip installs outside one).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
scripts/install_deps.sh
# A CMake that install_deps had to fetch from PyPI (older system CMake) is linked here.
if [ -d build/tools/bin ]; then export PATH="$PWD/build/tools/bin:$PATH"; fi
scripts/check_format.sh
scripts/check_layers.sh
build_log="$(mktemp)"
scripts/build.sh 2>&1 | tee "$build_log"
# Each CUDA source gets one -std flag (C++20); two would mean CMake's CUDA standard and the
# project's disagree again, and nvcc would silently compile the last one.
if grep -q "incompatible redefinition for option 'std'" "$build_log"; then
  echo "test.sh: FAIL: nvcc was given two -std flags (see the build output above)"
  exit 1
fi
rm -f "$build_log"
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 1500

# scripts/run.sh (the README's first command) reports the build and resolves relative paths from
# the caller's directory.
run_dir="$(mktemp -d)"
(cd "$run_dir" && mkdir sub && "$repo/scripts/run.sh" --rows 3 --dim 64 --vocab 128 --out sub/r.safetensors \
  >run.out 2>run.err) || { cat "$run_dir/run.err"; echo "test.sh: FAIL: scripts/run.sh"; exit 1; }
grep -q '^run.sh: built in' "$run_dir/run.err" || { cat "$run_dir/run.err"; echo "test.sh: FAIL: run.sh showed no build report"; exit 1; }
[ -s "$run_dir/sub/r.safetensors" ] || { echo "test.sh: FAIL: run.sh --out sub/r.safetensors did not write $run_dir/sub/r.safetensors"; exit 1; }
rm -rf "$run_dir"
echo "test.sh: scripts/run.sh from another directory wrote its relative --out there"

venv=build/pyvenv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# The SASS check wherever the SM90 kernels were built (nvcc here and DETLOGP_ENABLE_CUDA not OFF).
if ar t build/libdetlogp.a | grep -q '^launch_table\.cu\.o$'; then
  if ! command -v cuobjdump >/dev/null && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump" ] &&
     ! compgen -G "$venv/lib/python3*/site-packages/nvidia/*/bin/cuobjdump" >/dev/null; then
    "$venv/bin/python" -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  fi
  scripts/check_sass.sh build/libdetlogp.a  # finds the venv's cuobjdump
else
  echo "test.sh: the SM90 sources were not built (no nvcc, or DETLOGP_ENABLE_CUDA=OFF): SASS check skipped"
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
# index, else from PyPI; where neither answers, the torch tests skip and say so. Then transformers.
"$venv/bin/python" -m pip install -q nanobind scikit-build-core numpy pytest
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --retries 1 --timeout 10 torch --index-url https://download.pytorch.org/whl/cpu ||
    "$venv/bin/python" -m pip install -q torch ||
    echo "test.sh: WARNING: torch could not be installed; the torch tests will be skipped"
fi
# transformers for the integration tests (tests/python/test_transformers.py: a Qwen3 model built from
# a config, no download), where torch is there; without it those tests skip and say so.
if "$venv/bin/python" -c 'import torch' 2>/dev/null && ! "$venv/bin/python" -c 'import transformers' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --retries 3 --timeout 60 "transformers>=4.56,<6" ||
    "$venv/bin/python" -m pip install -q --retries 3 --timeout 60 "transformers>=4.56,<6" ||
    echo "test.sh: WARNING: transformers could not be installed; the transformers integration tests will be skipped"
fi
# --config-settings, not -C: Debian 12's venv has pip 23.0, older than the short form.
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps . \
  --config-settings=cmake.define.DETLOGP_ENABLE_CUDA=OFF --config-settings=build-dir=build/pip
# pip install . puts the CLI on the environment's PATH.
cli="$(PATH="$PWD/$venv/bin:$PATH" command -v detlogp || true)"
if [ "$cli" != "$PWD/$venv/bin/detlogp" ]; then
  echo "test.sh: FAIL: pip install . did not put the detlogp CLI into $venv/bin (found: '${cli:-nothing}')"
  exit 1
fi
"$cli" info >/dev/null
echo "test.sh: pip install . installed the CLI: $venv/bin/detlogp ($("$cli" --version))"
PYTEST_DETLOGP_CLI=build/detlogp "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python

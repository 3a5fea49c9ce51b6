#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, build, run every test. GPU tests skip
# (and say so) where no SM90 GPU is present; when nvcc is here the CUDA sources are built for
# sm_90a and their SASS is checked (HGMMA present, no atomics, no MUFU.EX2/LG2).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/check_format.sh
scripts/check_layers.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 1500
if command -v nvcc >/dev/null; then
  if ! python3 -c 'import glob,site,sys; sys.exit(0 if any(glob.glob(p+"/nvidia/*/bin/cuobjdump") for p in site.getsitepackages()+[site.getusersitepackages()]) else 1)' 2>/dev/null &&
     ! command -v cuobjdump >/dev/null; then
    python3 -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  fi
  scripts/check_sass.sh build/libdetlogp.a
else
  echo "test.sh: no nvcc here; the SM90 sources were not built (SASS check skipped)"
fi
# Python package (docs/python.md): built by pip (CPU-only) into a venv under build/, then the
# numpy and torch tests against the CPU backend and the CLI built above. torch comes from its CPU
# wheel index, else from PyPI; where neither answers, the torch tests skip and say so.
venv=build/pyvenv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q nanobind scikit-build-core numpy pytest
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --retries 1 --timeout 10 torch --index-url https://download.pytorch.org/whl/cpu ||
    "$venv/bin/python" -m pip install -q torch ||
    echo "test.sh: WARNING: torch could not be installed; the torch tests will be skipped"
fi
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps . \
  -C cmake.define.DETLOGP_ENABLE_CUDA=OFF -C build-dir=build/pip
PYTEST_DETLOGP_CLI=build/detlogp "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python

#!/usr/bin/env bash
# SASS check of the SM90 contract kernels; needs no GPU.
#   - every fused kernel (fused_pingpong_kernel<...>, fused_cooperative_kernel<...>) issues HGMMA
#     (wgmma tensor-core path);
#   - no contract kernel (all of namespaces detlogp::sm90 and detlogp::cuda) contains ATOM/RED (no atomics: the
#     reductions are ordered) or MUFU.EX2/MUFU.LG2 (no hardware approximations of exp/log: the
#     contract's expc/logc are built from IEEE fp32 operations);
#   - reports local-memory traffic (LDL/STL) per kernel;
#   - (when it compiles the sources itself) ptxas serialized no kernel's wgmma (C75xx).
# Usage: scripts/check_sass.sh [binary-or-object ...]
#   With no argument it compiles src/sm90/*.cu for sm_90a with nvcc into a temporary directory.
# cuobjdump: $CUOBJDUMP, else PATH, else $CUDA_HOME/bin, else the pip wheels
# nvidia-cuda-cuobjdump/nvidia-cuda-nvdisasm in the project's venv build/pyvenv (where
# scripts/test.sh installs them), else in the python3 on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

find_tool() {  # name -> path or empty
  local name="$1" c
  if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return; fi
  for c in "${CUDA_HOME:-/usr/local/cuda}/bin/$name" /usr/local/cuda/bin/"$name"; do
    [[ -x "$c" ]] && { echo "$c"; return; }
  done
  local py
  for py in "$ROOT/build/pyvenv/bin/python" python3 python; do
    command -v "$py" >/dev/null 2>&1 || continue
    "$py" - "$name" <<'PY' 2>/dev/null && return
import glob, os, sys, site
paths = list(sys.path) + site.getsitepackages() + [site.getusersitepackages()]
for p in paths:
    for c in glob.glob(os.path.join(p, "nvidia", "*", "bin", sys.argv[1])):
        if os.access(c, os.X_OK):
            print(c); sys.exit(0)
sys.exit(1)
PY
  done
  return 0
}

CUOBJDUMP="${CUOBJDUMP:-$(find_tool cuobjdump)}"
[[ -n "$CUOBJDUMP" ]] || { echo "check_sass: cuobjdump not found (scripts/test.sh installs it into build/pyvenv: build/pyvenv/bin/python -m pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"; exit 2; }
if [[ -z "${NVDISASM_PATH:-}" ]] && ! command -v nvdisasm >/dev/null 2>&1; then
  nvd="$(find_tool nvdisasm)"
  [[ -n "$nvd" ]] && export PATH="$(dirname "$nvd"):$PATH"
fi

inputs=("$@")
tmp=""
serialized=0
if [[ ${#inputs[@]} -eq 0 ]]; then
  NVCC="${NVCC:-$(find_tool nvcc)}"
  [[ -n "$NVCC" ]] || { echo "check_sass: nvcc not found and no binary given"; exit 2; }
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  for f in "$ROOT"/src/sm90/*.cu; do
    o="$tmp/$(basename "$f" .cu).o"
    # ptxas reports (C75xx "Potential Performance Loss") when it serializes a kernel's wgmma
    # (e.g. a wgmma accumulator touched on a divergent path): a silent 2x slowdown, so it fails here.
    if ! "$NVCC" -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a --fmad=false -Xptxas -v -I"$ROOT/include" -I"$ROOT/src" \
      -c "$f" -o "$o" 2>"$tmp/nvcc.log"; then
      cat "$tmp/nvcc.log"; exit 1
    fi
    if grep -q "wgmma.mma_async instructions are serialized" "$tmp/nvcc.log"; then
      grep "wgmma.mma_async instructions are serialized" "$tmp/nvcc.log" | cut -c1-300
      serialized=1
    fi
    inputs+=("$o")
  done
fi

sass="$(mktemp)"
for f in "${inputs[@]}"; do "$CUOBJDUMP" -sass "$f"; done >"$sass"

# Per-function counts: name hgmma atom mufu_ex2_lg2 local
awk '
  /Function : / { name = $3; funcs[name] = 1; next }
  name != "" && /HGMMA/ { hg[name]++ }
  name != "" && /[ \t](ATOM|ATOMG|ATOMS|RED|REDG|REDUX)[. ]/ { at[name]++ }
  name != "" && /MUFU\.(EX2|LG2)/ { mu[name]++ }
  name != "" && /[ \t](LDL|STL)[. ]/ { lm[name]++ }
  END { for (f in funcs) printf "%s %d %d %d %d\n", f, hg[f]+0, at[f]+0, mu[f]+0, lm[f]+0 }
' "$sass" | sort >"$sass.tab"
rm -f "$sass"

fail=0; fused=0; contract=0
while read -r fn hg at mu lm; do
  [[ "$fn" == _ZN7detlogp4sm90* || "$fn" == _ZN7detlogp4cuda* ]] || continue
  contract=$((contract + 1))
  short="$(echo "$fn" | sed -E 's/^_ZN7detlogp4(sm90|cuda)//' | cut -c1-90)"
  status="ok"
  if [[ "$fn" == *fused_pingpong_kernel* || "$fn" == *fused_cooperative_kernel* ]]; then
    fused=$((fused + 1))
    if [[ "$hg" -eq 0 ]]; then status="FAIL(no HGMMA)"; fail=1; fi
  fi
  if [[ "$at" -ne 0 ]]; then status="${status/ok/} FAIL(ATOM/RED x$at)"; fail=1; fi
  if [[ "$mu" -ne 0 ]]; then status="${status/ok/} FAIL(MUFU.EX2/LG2 x$mu)"; fail=1; fi
  printf '%-92s HGMMA=%-4s ATOM/RED=%-3s MUFU.EX2/LG2=%-3s LDL/STL=%-4s %s\n' "$short" "$hg" "$at" "$mu" "$lm" "$status"
done <"$sass.tab"
rm -f "$sass.tab"
if [[ "$fused" -eq 0 ]]; then echo "check_sass: FAIL: no fused SM90 kernel found in the inputs"; exit 1; fi
if [[ "$serialized" -ne 0 ]]; then echo "check_sass: FAIL: ptxas serialized the wgmma of a kernel (above)"; exit 1; fi
if [[ "$fail" -ne 0 ]]; then echo "check_sass: FAIL"; exit 1; fi
echo "check_sass: PASS ($contract contract kernels, $fused fused kernels with HGMMA; no ATOM/RED, no MUFU.EX2/LG2)"

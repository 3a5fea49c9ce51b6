#!/usr/bin/env bash
# Fails when a library source includes a folder its layer may not use (the graph is written at
# the library's source list in CMakeLists.txt). A folder always includes itself and detlogp/
# (include/detlogp); an include of another folder must be listed below. src/registry may name
# the SM90 and CUDA backends through their host headers (.hpp) only, never their device code.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A allowed=(
  [api]="registry tp core"
  [registry]="core cpu sm90 cuda"
  [tp]="core"
  [cpu]="core"
  [sm90]="cuda core"
  [cuda]="core"
  [core]=""
  [io]=""
  [golden]="io"
)

# check_folder DIR LAYER: prints one line per include of DIR's sources that LAYER may not make.
check_folder() {
  local dir=$1 layer=$2
  find "$dir" -type f \( -name '*.hpp' -o -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print0 |
    sort -z |
    while IFS= read -r -d '' file; do
      { grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[A-Za-z0-9_]+/' "$file" || true; } |
        sed -E 's/^([0-9]+):[^"]*"([^"]+)".*/\1 \2/' |
        while read -r line path; do
          local target=${path%%/*}
          [[ $target == "$layer" || $target == detlogp ]] && continue
          if [[ $layer != include && " ${allowed[$layer]} " == *" $target "* ]]; then
            [[ $layer == registry && ($target == sm90 || $target == cuda) && $path != *.hpp ]] || continue
          fi
          echo "$file:$line: $layer -> $target (\"$path\") is not an allowed edge"
        done
    done
}

violations=$(
  for dir in src/*/; do
    layer=$(basename "$dir")
    if [[ -z ${allowed[$layer]+set} ]]; then
      echo "$dir: no layering rule for this folder; add one to scripts/check_layers.sh and CMakeLists.txt"
      continue
    fi
    check_folder "$dir" "$layer"
  done
  check_folder include/detlogp include
)
if [[ -n $violations ]]; then
  echo "$violations" >&2
  echo "check_layers: $(grep -c . <<<"$violations") include(s) break the layering" >&2
  exit 1
fi
echo "check_layers: the includes of src/ and include/detlogp follow the layering"

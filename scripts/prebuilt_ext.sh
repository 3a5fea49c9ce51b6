#!/usr/bin/env bash
# The Python extension for a short device call, without the device's library build (docs/sm90.md):
#   scripts/prebuilt_ext.sh --library   here (nvcc, no GPU needed): libdetlogp.a with the SM90 kernels,
#                                       position-independent, into prebuilt/ with the commit it is of
#                                       (build-pic/, Release; ~6 min on 2 cores);
#   scripts/prebuilt_ext.sh --ext [DIR] on the device: nanobind and the bindings compiled against
#                                       prebuilt/libdetlogp.a, the package's .py files beside them, into
#                                       DIR (default build-x/python), for PYTHONPATH=DIR; ~5 s on 16 cores.
# The device call carries the ignored prebuilt/ (run's carry: ["prebuilt"]). --ext refuses a library
# built from other sources than the working tree's: the stamp is a hash of the files under src/,
# include/ and cmake/ and of CMakeLists.txt (their contents, not the commit: a copied working tree
# need not carry the git state it came from). The bindings (python/src/) are compiled by --ext.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp() { find src include cmake CMakeLists.txt -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16; }
case "${1:-}" in
  --library)
    nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    cmake -S . -B build-pic "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DDETLOGP_BUILD_TESTS=OFF >/dev/null
    cmake --build build-pic -j "$(nproc)"
    mkdir -p prebuilt
    cp build-pic/libdetlogp.a prebuilt/
    stamp >prebuilt/COMMIT
    echo "prebuilt/libdetlogp.a of $(cat prebuilt/COMMIT)"
    ;;
  --ext)
    out="${2:-build-x/python}"
    [[ -f prebuilt/libdetlogp.a ]] || { echo "prebuilt_ext: no prebuilt/libdetlogp.a (run --library first, carry prebuilt)" >&2; exit 2; }
    if [[ "$(cat prebuilt/COMMIT 2>/dev/null)" != "$(stamp)" ]]; then
      echo "prebuilt_ext: prebuilt/libdetlogp.a is of $(cat prebuilt/COMMIT 2>/dev/null || echo '?'), the tree is $(stamp)" >&2
      exit 2
    fi
    py="${PYTHON:-python3}"
    nbi="$("$py" -m nanobind --include_dir)"
    nbr="$(dirname "$nbi")"
    pyi="$("$py" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
    suffix="$("$py" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")"
    obj="$(mktemp -d)"
    common=(-O3 -DNDEBUG -fPIC -fvisibility=hidden -ffunction-sections -fdata-sections -fno-stack-protector -std=c++20
      -I"$pyi" -I"$nbi" -isystem "$nbr/ext/robin_map/include")
    # nanobind's static library, as nanobind_add_module(NB_STATIC) builds it.
    for src in "$nbr"/src/*.cpp; do
      name="$(basename "$src" .cpp)"
      [[ "$name" == nb_combined ]] && continue
      c++ "${common[@]}" -fno-strict-aliasing -DNB_BUILD -DNB_COMPACT_ASSERTIONS -c "$src" -o "$obj/nb_$name.o" &
    done
    # The bindings, with python/CMakeLists.txt's flags.
    c++ "${common[@]}" -Os -ffp-contract=off -fno-fast-math -DDETLOGP_VERSION=\"0.1.0\" -Isrc -Iinclude \
      -c python/src/detlogp_ext.cpp -o "$obj/ext.o" &
    wait
    mkdir -p "$out/detlogp"
    cp -r python/detlogp/. "$out/detlogp/"
    libs=()
    # shellcheck disable=SC2054 # the commas are the linker's (-Wl,-rpath,DIR), not array separators
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [[ -d "$d" ]] && libs+=(-L"$d" -Wl,-rpath,"$d"); done
    nccl="$(ldconfig -p | awk '/libnccl\.so/ {print $NF; exit}')"
    [[ -z "$nccl" ]] && nccl="$(find /usr /opt -name 'libnccl.so*' 2>/dev/null | head -1)"
    # shellcheck disable=SC2054
    [[ -n "$nccl" ]] && libs+=("$nccl" -Wl,-rpath,"$(dirname "$nccl")")
    c++ -shared -o "$out/detlogp/_detlogp$suffix" "$obj"/ext.o "$obj"/nb_*.o prebuilt/libdetlogp.a "${libs[@]}" \
      -lcudart -lcublas -lcublasLt -lrt -lpthread -ldl -static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL \
      -Wl,--gc-sections
    rm -rf "$obj"
    echo "$out/detlogp/_detlogp$suffix (nccl: ${nccl:-none})"
    ;;
  *)
    echo "usage: scripts/prebuilt_ext.sh --library | --ext [DIR]" >&2
    exit 2
    ;;
esac

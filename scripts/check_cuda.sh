#!/usr/bin/env bash
# Compile check of the GPU executor without a GPU: every csrc/**/*.cu with nvcc for sm_90a (objects to a temporary
# directory, two at a time), then the host sources of csrc/runtime/cuda/ against the CUDA headers and the pybind11 and
# Python headers torch ships, then the link of mtdeepep._C_cuda from all of them (unresolved symbols fail here) and
# its import (the CUDA runtime is linked statically: no GPU or driver needed to load it). Skips with a message when
# nvcc is absent. MODULE_OUT=<dir>: keep the linked module there (the build tests import it).
# Arguments: .cu files to check instead of all of them (the host sources are then skipped).
# Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc), CHECK_CUDA_PYTHON (the interpreter with
# torch; default: .venv/bin/python when it exists, else python), JOBS (2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -n "${NVCC:-}" && ! -x "$NVCC" ]]; then
    echo "[check_cuda] NVCC=$NVCC is not an executable" >&2
    exit 2
fi
NVCC="${NVCC:-$(command -v nvcc || true)}"
[[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
if [[ -z "$NVCC" ]]; then
    echo "[check_cuda] nvcc not found: skipping the CUDA compile check"
    exit 0
fi
if [[ -n "${CHECK_CUDA_PYTHON:-}" ]]; then
    PYTHON="$CHECK_CUDA_PYTHON"
elif [[ -x .venv/bin/python ]]; then
    PYTHON="$(pwd)/.venv/bin/python"
else
    PYTHON="$(command -v python || command -v python3)"
fi
JOBS="${JOBS:-2}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

if [[ $# -gt 0 ]]; then
    UNITS=("$@")
else
    mapfile -t UNITS < <(find csrc -name '*.cu' | sort)
fi
echo "[check_cuda] $("$NVCC" --version | tail -1): ${#UNITS[@]} .cu files for sm_90a"
export NVCC OUT
# xargs exits non-zero when any compile fails (set -e stops the script with it).
printf '%s\n' "${UNITS[@]}" | xargs -P "$JOBS" -I{} sh -c \
    '"$NVCC" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Icsrc -c "{}" \
       -o "$OUT/$(echo {} | tr / _).o" \
     && echo "  ok {}"'
[[ $# -gt 0 ]] && { echo "[check_cuda] the given files compile"; exit 0; }

# Host sources: the pybind11 module and the buffer (no torch C++ API; pybind11 and Python headers come with torch).
# nvcc may be a wrapper: ask it where its toolkit is (TOP in its verbose output).
CUDA_TOP="$("$NVCC" -v -x cu -E /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
CUDA_INCLUDE="${CUDA_HOME:-${CUDA_TOP:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}}/include"
TORCH_INCLUDE="$("$PYTHON" -c 'import torch.utils.cpp_extension as e; print(e.include_paths()[0])' 2>/dev/null || true)"
PY_INCLUDE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)"
if [[ -n "$TORCH_INCLUDE" && -n "$PY_INCLUDE" && -f "$PY_INCLUDE/Python.h" ]]; then
    for unit in csrc/runtime/cuda/*.cpp; do
        "${CXX:-c++}" -std=c++17 -O1 -fPIC -Wall -Icsrc -I"$CUDA_INCLUDE" -I"$TORCH_INCLUDE" -I"$PY_INCLUDE" \
            -c "$unit" -o "$OUT/$(echo "$unit" | tr / _).o"
        echo "  ok $unit (host, c++)"
    done
    SUFFIX="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
    "$NVCC" -shared -gencode=arch=compute_90a,code=sm_90a -o "$OUT/_C_cuda$SUFFIX" "$OUT"/*.o
    (cd "$OUT" && "$PYTHON" -c 'import _C_cuda as m; assert m.platform == "cuda"; assert "timed out" in m.error_message(m.encode_error(1, 3, 2, 0))')
    echo "  ok _C_cuda$SUFFIX links and imports"
    if [[ -n "${MODULE_OUT:-}" ]]; then
        mkdir -p "$MODULE_OUT" && cp "$OUT/_C_cuda$SUFFIX" "$MODULE_OUT/"
    fi
else
    echo "[check_cuda] the .cu files compile; torch or the Python headers not found: host sources NOT checked"
    exit 0
fi
echo "[check_cuda] all GPU sources compile, the module links and imports"

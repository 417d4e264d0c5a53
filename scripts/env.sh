# Sourced by scripts/bench.sh and scripts/test.sh: creates .venv, installs what is missing, builds mtdeepep._C
# when its sources changed. Safe to run any number of times.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "[env] creating .venv"
    "$PY" -m venv .venv
fi
VENV_PY="$ROOT/.venv/bin/python"

if ! "$VENV_PY" -c "import torch" 2>/dev/null; then
    echo "[env] installing torch (CPU wheel)"
    # The pinned version is the CPU build available here; any other spec pulls CUDA packages.
    "$VENV_PY" -m pip install -q "torch==${MTDEEPEP_TORCH_VERSION:-2.13.0}"
fi
if ! "$VENV_PY" -c "import pybind11, numpy, pytest, pytest_timeout, pytest_benchmark, matplotlib, ruff, clang_format" 2>/dev/null; then
    echo "[env] installing build and test tools"
    "$VENV_PY" -m pip install -q pybind11 numpy pytest pytest-timeout pytest-benchmark matplotlib ruff clang-format \
        setuptools wheel
fi

# Rebuild the extension only when its sources or the build script changed.
stamp="$(cat setup.py $(find csrc -type f | sort) | sha256sum | cut -c1-16)"
if [ "$(cat .venv/.mtdeepep-build 2>/dev/null)" != "$stamp" ] || ! "$VENV_PY" -c "import mtdeepep" 2>/dev/null; then
    echo "[env] building mtdeepep._C"
    "$VENV_PY" -m pip install -q --no-build-isolation --no-deps -e . > .venv/build.log 2>&1 \
        || { tail -n 40 .venv/build.log; exit 1; }
    echo "$stamp" > .venv/.mtdeepep-build
fi
export PATH="$ROOT/.venv/bin:$PATH"

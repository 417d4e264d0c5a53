#!/usr/bin/env bash
# The test command: set-up (scripts/env.sh), lint, then the whole suite. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

echo "[test] ruff"
ruff check .
ruff format --check .
echo "[test] clang-format"
clang-format --dry-run --Werror $(find csrc -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh')
echo "[test] CUDA compile check"
# The module it links is handed to tests/cuda/test_cuda_build.py, which then does not run the same check again.
CHECKED_C_CUDA="$(mktemp -d)"
trap 'rm -rf "$CHECKED_C_CUDA"' EXIT
MODULE_OUT="$CHECKED_C_CUDA" bash "$(dirname "${BASH_SOURCE[0]}")/check_cuda.sh"
export MTDEEPEP_CHECKED_C_CUDA_DIR="$CHECKED_C_CUDA"
echo "[test] Triton compile check (cuda:90, hip:gfx942)"
bash "$(dirname "${BASH_SOURCE[0]}")/check_triton.sh"
echo "[test] pytest"
python -m pytest -q "$@"

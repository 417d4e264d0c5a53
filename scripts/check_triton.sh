#!/usr/bin/env bash
# Compile check of the Triton kernels without a GPU: every kernel module's AOT_SPECS (mtdeepep/kernels/) compiled ahead
# of time for H100/H200 (cuda:90) and MI300X (hip:gfx942) at the production block sizes, and the flag-synchronising
# kernels checked for release / acquire at system scope in the PTX and AMDGCN (mtdeepep/kernels/aot.py). Prints the
# table (kernel, target, registers, spills, shared memory, orderings, ok); fails on any compile or ordering failure.
# Results are cached by Triton under build/triton-aot-cache (TRITON_CACHE_DIR overrides): a rerun without kernel
# changes takes seconds.
# Environment: CHECK_TRITON_PYTHON (default: .venv/bin/python when it exists, else python), JOBS (2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -n "${CHECK_TRITON_PYTHON:-}" ]]; then
    PYTHON="$CHECK_TRITON_PYTHON"
elif [[ -x .venv/bin/python ]]; then
    PYTHON="$(pwd)/.venv/bin/python"
else
    PYTHON="$(command -v python || command -v python3)"
fi
# The compile needs the kernels as JIT functions: never under the interpreter.
env -u TRITON_INTERPRET PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" -m mtdeepep.kernels.aot --jobs "${JOBS:-2}"

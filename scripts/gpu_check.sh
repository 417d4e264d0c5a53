#!/usr/bin/env bash
# The GPU check of issue 14, for a session that has the device machine (the `run` tool: one NVIDIA H100/H200,
# Python 3.12, torch 2.11+cu130, nvcc, no internet). It builds mtdeepep with the device's torch, runs tests/cuda and
# bench/cuda_kernels.py, and copies the logs and the JSON into $OUT (they come back to this machine).
#
# Here, once, before the first call: put the pure-Python wheels the torchtitan test needs where the call carries
# them (.whl/ is ignored by git):
#     bash scripts/gpu_check.sh prepare
# Then two calls of the `run` tool (a command may run 10 minutes; the build is reused when the machine is still warm,
# else the second call builds again, 2-4 minutes):
#     run(command="bash scripts/gpu_check.sh test",  carry=[".whl"], timeout_s=600)   # build + tests/cuda
#     run(command="bash scripts/gpu_check.sh bench", carry=[".whl"], timeout_s=600)   # build + bench
# `all` does both in one command (only if the build is fast). GPU_CHECK_TESTS: the test paths (default tests/cuda),
# e.g. to split the tests over two calls if one runs out of time:
#     GPU_CHECK_TESTS="tests/cuda/test_normal.py tests/cuda/test_killed_peer.py" bash scripts/gpu_check.sh test
#     GPU_CHECK_TESTS="tests/cuda/test_low_latency.py tests/cuda/test_moe_cuda.py tests/cuda/test_moe_ep.py
#                      tests/cuda/test_torchtitan.py" bash scripts/gpu_check.sh test
# Extra pytest arguments: GPU_CHECK_PYTEST_ARGS (e.g. "-x" or "-k graph").
#
# GPU_CHECK_MPS=1 starts NVIDIA's Multi-Process Service daemon for the run (pipe and logs under /tmp/mps) and quits
# it at exit; nothing of the card's settings changes. Without it, the kernels of the ranks (processes) sharing the
# GPU are time-sliced, not concurrent: right for the tests, but the bench then times the scheduler's slices (see
# bench/cuda_kernels.py). Suggested: `GPU_CHECK_MPS=1 bash scripts/gpu_check.sh bench`; if the buffer set-up fails
# under MPS (CUDA IPC between MPS clients), run the bench without it and say so with the numbers.
#
# $OUT gets: env.txt (GPU, driver, torch, nvcc), build.log, and tests.log + junit.xml (test) or bench.log +
# cuda_kernels.json (bench).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STAGE="${1:-all}"
WHEELS=(torchtitan-0.3.0 spmd_types-0.2.3 tyro-1.0.17 docstring_parser-0.18.0 typeguard-4.6.0)

prepare() {
    # Pure-Python wheels (py3-none-any): the same on the device's Python 3.12. From scripts/env.sh's download cache
    # if present, else from PyPI.
    mkdir -p .whl
    for wheel in "${WHEELS[@]}"; do
        name="${wheel%-*}" version="${wheel##*-}"
        if ls .whl/"${name}"-"${version}"-*.whl >/dev/null 2>&1; then continue; fi
        if ls /tmp/pkgs/"${name}"-"${version}"-*.whl >/dev/null 2>&1; then
            cp /tmp/pkgs/"${name}"-"${version}"-*.whl .whl/
        else
            python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "${name//_/-}==${version}"
        fi
    done
    ls -l .whl
}

if [ "$STAGE" = prepare ]; then
    prepare
    exit $?
fi

OUT="${OUT:-$ROOT/bench/results/gpu_check}"
mkdir -p "$OUT"
PY=python3

{
    echo "# $(date -u +%FT%TZ) gpu_check.sh $STAGE"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
    nvcc --version 2>&1 | tail -n 2
    git log -1 --format='commit %H %s' 2>/dev/null || true
} | tee "$OUT/env.txt"

if [ "${GPU_CHECK_MPS:-0}" = 1 ]; then
    if command -v nvidia-cuda-mps-control >/dev/null; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d && echo "[gpu_check] MPS daemon started" | tee -a "$OUT/env.txt"
        trap 'echo quit | nvidia-cuda-mps-control; echo "[gpu_check] MPS daemon stopped"' EXIT
    else
        echo "[gpu_check] GPU_CHECK_MPS=1 but nvidia-cuda-mps-control is not on PATH: running without MPS" \
            | tee -a "$OUT/env.txt"
    fi
fi

# The torchtitan test's packages, installed next to (not into) the device's environment.
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "[gpu_check] installing .whl/ failed"; exit 1; }
    export PYTHONPATH="$ROOT:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "[gpu_check] no .whl/ carried: the torchtitan test will skip (run 'bash scripts/gpu_check.sh prepare' here)"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# The ranks share one GPU over a gloo control group: mtdeepep picks the CUDA executor only when told so.
export MTDEEPEP_DEVICE=cuda

build() {
    # Rebuild only when the sources or setup.py changed since the last build on this machine (a warm machine keeps
    # the build between calls).
    local stamp
    stamp="$(cat setup.py $(find csrc -type f | sort) | sha256sum | cut -c1-16)"
    if [ "$(cat build/.gpu_check_stamp 2>/dev/null)" = "$stamp" ] && $PY -c "import mtdeepep._C_cuda, mtdeepep._cuda_engine" 2>/dev/null; then
        echo "[gpu_check] build is current" | tee -a "$OUT/build.log"
        return 0
    fi
    echo "[gpu_check] building mtdeepep (MAX_JOBS=$(nproc))"
    local start=$SECONDS
    if ! MAX_JOBS="$(nproc)" $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
        tail -n 60 "$OUT/build.log"
        echo "[gpu_check] build FAILED after $((SECONDS - start)) s (full log: build.log)"
        return 1
    fi
    mkdir -p build && echo "$stamp" >build/.gpu_check_stamp
    echo "[gpu_check] built in $((SECONDS - start)) s: $(ls mtdeepep/_C*.so | tr '\n' ' ')"
    # The GPU tests skip rather than fail when the executor cannot be imported: say so loudly here.
    $PY -c "import mtdeepep._C_cuda, mtdeepep._cuda_engine" \
        || echo "[gpu_check] WARNING: mtdeepep._C_cuda does not import: every executor test will skip"
}

run_tests() {
    local tests="${GPU_CHECK_TESTS:-tests/cuda}"
    echo "[gpu_check] pytest $tests"
    local start=$SECONDS
    # -v: the log names every test and its outcome as it goes (a run stopped at the limit still says what passed).
    # The CPU-only checks of tests/cuda (the cases on the CPU executor, the build checks) ran in CI already.
    # shellcheck disable=SC2086
    $PY -m pytest $tests -v -rs -p no:cacheprovider --timeout 300 --junitxml "$OUT/junit.xml" \
        --ignore=tests/cuda/test_cases_on_cpu.py --ignore=tests/cuda/test_cuda_build.py \
        ${GPU_CHECK_PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log"
    local status=${PIPESTATUS[0]}
    echo "[gpu_check] tests/cuda exit $status after $((SECONDS - start)) s"
    return "$status"
}

run_bench() {
    echo "[gpu_check] bench/cuda_kernels.py"
    local start=$SECONDS
    (cd bench && $PY cuda_kernels.py --json "$OUT/cuda_kernels.json") 2>&1 | tee "$OUT/bench.log"
    local status=${PIPESTATUS[0]}
    echo "[gpu_check] bench exit $status after $((SECONDS - start)) s"
    return "$status"
}

build || exit 1
case "$STAGE" in
    test) run_tests ;;
    bench) run_bench ;;
    all)
        run_tests
        tests=$?
        run_bench
        bench=$?
        exit $((tests || bench))
        ;;
    *)
        echo "usage: $0 [prepare|test|bench|all]" >&2
        exit 2
        ;;
esac

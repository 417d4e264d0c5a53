#!/usr/bin/env bash
# The GPU check: everything the GPU machine (the `run` tool: one H100/H200, Python 3.12, torch 2.11+cu130, nvcc,
# compute-sanitizer, no internet; 15 device-minutes a session, 10 a command) must prove, in ONE command, in stages.
# Each stage has its own time limit, clipped to what is left of the whole budget (GPU_CHECK_BUDGET_S, default 540 s),
# so a slow stage costs the stages after it, never the summary. Logs are written as the stages go into $OUT (the
# folder the tool brings back; at most 8 files: summary.txt, build.log, smoke.log, tests.log, sanitizer.log,
# bench.log, bench.json, prebuilt.tar), and the summary table is printed last.
#
# Stages, in order (a failed stage does not stop the next ones; a failed build stops everything):
#   facts       GPU, driver, compute mode, torch, nvcc, whether nvidia-cuda-mps-control and compute-sanitizer exist
#   build       mtdeepep._C and _C_cuda with the device's torch; fails hard if _C_cuda does not import. Extensions whose
#               sources match a carried prebuilt/ (from an earlier run's prebuilt.tar) are reused, not rebuilt
#   triton      the Triton executor (the GPU default; never run on a GPU before): the 2-rank core cases of
#               tests/cuda (normal, low latency, MoE layer) with MTDEEPEP_ENGINE=triton, ranks as processes sharing
#               the GPU through CUDA IPC (its peer table: mtdeepep/engines/peer_table.py); CUDA graphs left out (its
#               host reads the counts)
#   measure     bench/triton_gpu.py (issue 34, point 5): layout, dispatch BF16 / FP8, combine and the FP8 cast as
#               fractions of a device-to-device copy of the same bytes at 4096 tokens x 7168, top-8 of 256, uniform
#               and skewed; low-latency dispatch / combine at 128 tokens in microseconds (into bench.json)
#   smoke       every kernel once with R = 1 then R = 2 ranks in one process (scripts/gpu_smoke.py), PASS/FAIL + time
#   local       tests/cuda/test_local_ranks.py: the GPU cases with the ranks as threads of one process (real
#               concurrency), the 200-round race case, the timeouts and their poison semantics at 3 and 4 ranks
#   sanitizer   compute-sanitizer memcheck, racecheck, synccheck on the smoke at small sizes (2 ranks, one process)
#   bench       bench/cuda_kernels.py (single-process harness: fraction of a copy, SM counts, low latency) and
#               bench/moe_layer_gpu.py (the MoE layer forward+backward: grouped BF16, FP8, against per-expert loops)
#   (the stages below check the hand-written CUDA executor: MTDEEPEP_ENGINE=cuda)
#   core2       the 2-rank core cases with ranks as processes (CUDA IPC): normal, low latency, graphs, MoE layer
#   gemm        tests/cuda/test_moe_cuda.py: grouped GEMM and FP8 experts (torch._grouped_mm, torch._scaled_mm)
#   fail2       2-rank failure paths: a missing rank in dispatch, combine, low latency; a killed peer
#   torchtitan  torchtitan 0.3.0's DeepEP backend unmodified on mtdeepep (wheels carried in .whl/)
#   core4       the 4-rank core cases with ranks as processes
#   fail4       4-rank timeouts (the poison names the missing rank) and the killed peer at 3 ranks, last
#
# Usage (prepare once here: `bash scripts/gpu_check.sh prepare` puts torchtitan's wheels into .whl/):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
#   run(command="GPU_CHECK_STAGES=build,smoke,local bash scripts/gpu_check.sh", carry=[".whl", "prebuilt"])
# GPU_CHECK_STAGES: comma-separated stages to run (facts and build always run). GPU_CHECK_PYTEST_ARGS: extra pytest
# arguments (GPU_CHECK_PER_TEST_S: the per-test timeout, 120 s). GPU_CHECK_LOCAL_K / GPU_CHECK_LOCAL_S: the local stage's -k selection (default: every rank count) and
# limit. GPU_CHECK_SMOKE_ARGS, GPU_CHECK_BENCH_ARGS, GPU_CHECK_MOE_ARGS: arguments of gpu_smoke.py,
# bench/cuda_kernels.py and bench/moe_layer_gpu.py. GPU_CHECK_SANITIZER_TOOLS (default: memcheck racecheck synccheck)
# and GPU_CHECK_SANITIZER_TOOL_S (40 s each).
# `--dry-run` (here, no GPU): the same stages with stand-ins (the pytest stages collect their selections, which must
# not be empty; the Python scripts are compiled; build imports the CPU build) to prove the plumbing: budgets,
# clipping, logs, the summary and the exit status. GPU_CHECK_DRY_SLEEP_S makes each dry stage sleep that long (to
# see the clipping). Exit status: 0 when every stage that ran passed and none was cut or left out, else 1.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS=(torchtitan-0.3.0 spmd_types-0.2.3 tyro-1.0.17 docstring_parser-0.18.0 typeguard-4.6.0)

if [ "${1:-}" = prepare ]; then
    # Pure-Python wheels (py3-none-any): the same on the device's Python 3.12; from env.sh's cache, else PyPI.
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
    exit $?
fi

DRY=0
[ "${1:-}" = --dry-run ] && DRY=1
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
OUT="${OUT:-$ROOT/bench/results/gpu_check}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
if [ "$DRY" = 1 ]; then
    PY="${GPU_CHECK_PYTHON:-$([ -x .venv/bin/python ] && echo "$ROOT/.venv/bin/python" || command -v python3)}"
else
    PY=python3
fi
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
# MTDEEPEP_INSTAFAIL: a failing test's report is printed when it fails (tests/cuda/conftest.py), not at the end.
# CUDA_MODULE_LOADING=EAGER: ranks as threads of one process wait for each other's kernels, and a lazily loaded
# kernel's first launch synchronises the context (seen on the H200: every rank stopped until its timeout).
# MTDEEPEP_ENGINE=cuda: the default on a GPU is the Triton executor; the stages after `measure` check the CUDA one.
export PYTHONUNBUFFERED=1 MTDEEPEP_DEVICE=cuda MTDEEPEP_INSTAFAIL=1 CUDA_MODULE_LOADING=EAGER MTDEEPEP_ENGINE=cuda
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PYTEST=("$PY" -m pytest -q -rfE -p no:cacheprovider ${GPU_CHECK_PYTEST_ARGS:-})
SUMMARY=()
FAILED=0

left() { echo $((BUDGET - (SECONDS - START))); }

wanted() {  # facts and build always run
    [ -z "${GPU_CHECK_STAGES:-}" ] && return 0
    [[ ",$GPU_CHECK_STAGES,facts,build," == *",$1,"* ]]
}

# stage NAME LIMIT LOG COMMAND: runs COMMAND (a bash string) under min(LIMIT, what is left), its output appended to
# $OUT/LOG as it goes; records PASS / FAIL (exit code) / CUT (time limit) and the outcome line it printed.
stage() {
    local name="$1" limit="$2" log="$3" command="$4"
    wanted "$name" || return 0
    local remaining
    remaining="$(left)"
    if ((remaining < 15)); then
        SUMMARY+=("$(printf '%-11s %-8s %6s  %s' "$name" "NOT RUN" "-" "no time left of the ${BUDGET} s budget")")
        FAILED=1
        return 0
    fi
    ((limit > remaining)) && limit=$remaining
    [ "$DRY" = 1 ] && [ -n "${GPU_CHECK_DRY_SLEEP_S:-}" ] && command="sleep ${GPU_CHECK_DRY_SLEEP_S}; $command"
    echo "[gpu_check] $(date -u +%T) stage $name (limit ${limit} s, ${remaining} s left)"
    printf '\n===== stage %s (limit %s s) =====\n' "$name" "$limit" >>"$OUT/$log"
    local t0=$SECONDS status
    # timeout signals the whole process group it starts: rank processes spawned by a stage die with it.
    timeout -k 10 "$limit" bash -c "$command" >"$WORK/$name.out" 2>&1
    status=$?
    cat "$WORK/$name.out" >>"$OUT/$log"
    local outcome verdict
    outcome="$(grep -E '([0-9]+ (passed|failed|error)|every step passed|FAILED|ERROR SUMMARY|rows\)|BUILT|IMPORTS|collected)' \
        "$WORK/$name.out" | tail -n 1 | cut -c1-90)"
    if ((status == 124 || status == 137)); then
        verdict=CUT
        outcome="stopped at its ${limit} s limit; ${outcome}"
    elif ((status == 0)); then
        verdict=PASS
    else
        verdict=FAIL
        [ -z "$outcome" ] && outcome="$(tail -n 1 "$WORK/$name.out" | cut -c1-90)"
    fi
    [ "$verdict" != PASS ] && FAILED=1
    SUMMARY+=("$(printf '%-11s %-8s %5ss  %s' "$name" "$verdict" "$((SECONDS - t0))" "$outcome")")
    echo "[gpu_check] stage $name: $verdict after $((SECONDS - t0)) s"
    return "$status"
}

# pytest selections of the stages (by test ids: R2 / R3 / R4 are the rank counts).
CORE_K='not times_out and not killed and (uniform or test_case or graph or hooks or flex) and not float32'
T_NORMAL=tests/cuda/test_normal.py T_LL=tests/cuda/test_low_latency.py
T_MP="$T_NORMAL $T_LL tests/cuda/test_moe_ep.py"
# pytest_stage NAME LIMIT FILES K: the pytest stage (dry run: collect only, once, and an empty selection fails).
pytest_stage() {
    local name="$1" limit="$2" files="$3" k="$4" per_test="${5:-${GPU_CHECK_PER_TEST_S:-120}}"
    if [ "$DRY" = 1 ]; then
        stage "$name" "$limit" tests.log \
            "collected=\$(${PYTEST[*]} --collect-only $files -k \"$k\"); echo \"\$collected\" | tail -n 3; echo \"\$collected\" | grep -q '::'"
    else
        stage "$name" "$limit" tests.log "${PYTEST[*]} --timeout $per_test $files -k \"$k\""
    fi
}

# ---- facts ----
facts() {
    echo "# $(date -u +%FT%TZ) gpu_check.sh $([ "$DRY" = 1 ] && echo '--dry-run') budget ${BUDGET} s"
    git log -1 --format='commit %H %s' 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,clocks.max.sm --format=csv 2>&1 | head -3
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
    echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1 || echo missing)"
    for tool in nvidia-cuda-mps-control compute-sanitizer; do
        echo "$tool: $(command -v "$tool" || echo missing)"
    done
    echo "cpus: $(nproc)"
}
facts | tee "$OUT/summary.txt"
SUMMARY+=("$(printf '%-11s %-8s %5ss  %s' facts PASS "$((SECONDS - START))" "see the head of summary.txt")")

# ---- build ----
# A stamp per extension (its sources and setup.py): a carried prebuilt/ whose stamp matches is reused.
stamp() { cat setup.py "$@" | sha256sum | cut -c1-16; }
CPU_STAMP="$(stamp $(find csrc -name '*.cpp' -o -name '*.hpp' -o -name '*.h' | grep -v /cuda/ | sort))"
GPU_STAMP="$(stamp $(find csrc -path '*cuda*' -type f | sort) csrc/kernels/cuda/api.hpp)"
build() {
    local todo=()
    if [ "$(cat prebuilt/_C.stamp 2>/dev/null)" = "$CPU_STAMP" ] && cp prebuilt/_C.*.so mtdeepep/ 2>/dev/null; then
        echo "[build] _C reused from prebuilt/"
    else
        todo+=(_C)
    fi
    if [ "$(cat prebuilt/_C_cuda.stamp 2>/dev/null)" = "$GPU_STAMP" ] && cp prebuilt/_C_cuda.*.so mtdeepep/ 2>/dev/null; then
        echo "[build] _C_cuda reused from prebuilt/"
    else
        todo+=(_C_cuda)
    fi
    if ((${#todo[@]})); then
        local list
        list="$(IFS=,; echo "${todo[*]}")"
        echo "[build] building $list (MAX_JOBS=$(nproc))"
        # TORCH_CUDA_ARCH_LIST: only Hopper's sm_90a (torch's builder would add the detected arch as a second target).
        TORCH_CUDA_ARCH_LIST=9.0a MTDEEPEP_REQUIRE_CUDA=1 MTDEEPEP_EXTENSIONS="$list" MAX_JOBS="$(nproc)" \
            "$PY" setup.py build_ext --inplace \
            || { echo "[build] FAILED"; return 1; }
    fi
    "$PY" -c "import mtdeepep._C_cuda as m, mtdeepep; print('IMPORTS: mtdeepep._C_cuda', m.platform)" || return 1
    mkdir -p "$WORK/prebuilt"
    cp mtdeepep/_C.*.so mtdeepep/_C_cuda.*.so "$WORK/prebuilt/"
    echo "$CPU_STAMP" >"$WORK/prebuilt/_C.stamp"
    echo "$GPU_STAMP" >"$WORK/prebuilt/_C_cuda.stamp"
    tar -C "$WORK" -cf "$OUT/prebuilt.tar" prebuilt && echo "BUILT: $(ls mtdeepep/_C*.so | xargs -n1 basename | tr '\n' ' ')"
}
if [ "$DRY" = 1 ]; then
    stage build 240 build.log "$PY -c \"import mtdeepep; print('IMPORTS: mtdeepep (CPU build; dry run)')\""
else
    export -f build
    export CPU_STAMP GPU_STAMP WORK OUT PY
    stage build 240 build.log build
fi
if (($? != 0)) || [[ "${SUMMARY[-1]}" != build*PASS* ]]; then
    printf '%s\n' "" "stage       verdict   time  outcome" "${SUMMARY[@]}" | tee -a "$OUT/summary.txt"
    echo "[gpu_check] the build failed: nothing else can run (build.log)"
    exit 1
fi

# The torchtitan test's packages, next to (not into) the device's environment.
if [ "$DRY" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# ---- the stages ----
# The Triton executor first: it is the GPU default, and nothing of it has run on a GPU yet.
TRITON_K="R2 and not times_out and not killed and not graph and (uniform or test_case or hooks or flex) and not float32"
if [ "$DRY" = 1 ]; then
    pytest_stage triton 120 "$T_MP" "$TRITON_K"
    stage measure 120 bench.log "$PY -m py_compile bench/triton_gpu.py && echo 'every step passed (compiled; dry run)'"
else
    MTDEEPEP_ENGINE=triton pytest_stage triton "${GPU_CHECK_TRITON_S:-150}" "$T_MP" "$TRITON_K"
    # Under MPS when its daemon starts: the ranks are processes on one GPU, and without MPS the GPU time-slices
    # between their contexts, so a rank's spinning wait holds the GPU for its slice while the peer it waits for
    # cannot run (11-28, without MPS: 13-17 ms dispatches, 5 ms low-latency calls: the slices, not the kernels).
    stage measure "${GPU_CHECK_MEASURE_S:-120}" bench.log "if nvidia-cuda-mps-control -d; then trap 'echo quit | nvidia-cuda-mps-control' EXIT; \
export MTDEEPEP_BENCH_MPS=1; echo '[mps] daemon started'; else echo '[mps] not available: time-sliced'; fi; \
$PY bench/triton_gpu.py ${GPU_CHECK_TRITON_BENCH_ARGS:-} --json $WORK/triton_gpu.json \
&& $PY -c \"import json, os; p='$OUT/bench.json'; a=json.load(open(p)) if os.path.exists(p) else {}; \
a['triton_gpu']=json.load(open('$WORK/triton_gpu.json')); json.dump(a, open(p, 'w'), indent=1)\""
fi
if [ "$DRY" = 1 ]; then
    stage smoke 60 smoke.log "$PY -m py_compile scripts/gpu_smoke.py && echo 'every step passed (compiled; dry run)'"
else
    stage smoke 60 smoke.log "$PY scripts/gpu_smoke.py ${GPU_CHECK_SMOKE_ARGS:---ranks 1,2}"
fi
pytest_stage local "${GPU_CHECK_LOCAL_S:-120}" tests/cuda/test_local_ranks.py "${GPU_CHECK_LOCAL_K:-R2 or R3 or R4 or R8}"

SANITIZE="$PY scripts/gpu_smoke.py --ranks 1,2 --small --timeout 120"
if [ "$DRY" = 1 ]; then
    stage sanitizer 110 sanitizer.log "echo 'compute-sanitizer: $(command -v compute-sanitizer || echo missing)'; echo 'ERROR SUMMARY: dry run'"
else
    stage sanitizer 120 sanitizer.log "set -o pipefail; for tool in ${GPU_CHECK_SANITIZER_TOOLS:-memcheck racecheck synccheck}; do \
echo \"--- \$tool\"; timeout ${GPU_CHECK_SANITIZER_TOOL_S:-40} compute-sanitizer --tool \$tool --error-exitcode 3 --print-limit 20 $SANITIZE || s=\$?; \
done; exit \${s:-0}"
fi

BENCH_ARGS="${GPU_CHECK_BENCH_ARGS:-} --json $OUT/bench.json"
if [ "$DRY" = 1 ]; then
    stage bench 120 bench.log "$PY -m py_compile bench/cuda_kernels.py && $PY bench/moe_layer_gpu.py --dry-run --json $WORK/moe.json | tail -n 5"
else
    stage bench 150 bench.log "$PY bench/cuda_kernels.py $BENCH_ARGS; $PY bench/moe_layer_gpu.py ${GPU_CHECK_MOE_ARGS:-} --json $WORK/moe.json \
&& $PY -c \"import json, os; p='$OUT/bench.json'; a=json.load(open(p)) if os.path.exists(p) else {}; \
a['moe_layer_gpu']=json.load(open('$WORK/moe.json')); json.dump(a, open(p, 'w'), indent=1)\""
fi

pytest_stage core2 90 "$T_MP" "R2 and $CORE_K"
pytest_stage gemm 60 tests/cuda/test_moe_cuda.py "test_"
pytest_stage fail2 60 "$T_NORMAL $T_LL tests/cuda/test_killed_peer.py" "R2 and (times_out or killed)"
pytest_stage torchtitan 60 tests/cuda/test_torchtitan.py "test_"
pytest_stage core4 90 "$T_MP" "R4 and $CORE_K"
pytest_stage fail4 90 "$T_NORMAL $T_LL tests/cuda/test_killed_peer.py" "(R4 and times_out) or (R3 and killed)"

# The bench stage rewrote bench.json: the Triton figures go back in.
if [ -f "$WORK/triton_gpu.json" ]; then
    "$PY" -c "import json, os; p='$OUT/bench.json'; a=json.load(open(p)) if os.path.exists(p) else {}; \
a['triton_gpu']=json.load(open('$WORK/triton_gpu.json')); json.dump(a, open(p, 'w'), indent=1)"
fi

# ---- summary ----
{
    echo
    echo "stage       verdict   time  outcome"
    printf '%s\n' "${SUMMARY[@]}"
    echo "total $((SECONDS - START)) s of the ${BUDGET} s budget; files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
} | tee -a "$OUT/summary.txt"
exit "$FAILED"

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
if ! "$VENV_PY" -c "import pybind11, numpy, pytest, pytest_timeout, pytest_benchmark, matplotlib, ruff, clang_format, ninja" 2>/dev/null; then
    echo "[env] installing build and test tools"
    "$VENV_PY" -m pip install -q pybind11 numpy pytest pytest-timeout pytest-benchmark matplotlib ruff clang-format ninja \
        setuptools wheel
fi

# The training example's dependencies (Hugging Face interop, tokenizer, progress bars, the resolved config's TOML); transformers is also the
# reference model of the DeepSeek-V3 tests. None of them pulls torch.
TRAIN_PKGS=(transformers==5.23.0 safetensors tokenizers tqdm tomli-w)
if ! "$VENV_PY" -c "import transformers, safetensors, tokenizers, tqdm, tomli_w; assert transformers.__version__ == '5.23.0'" 2>/dev/null; then
    echo "[env] installing transformers, safetensors, tokenizers, tqdm, tomli-w"
    "$VENV_PY" -m pip install -q "${TRAIN_PKGS[@]}"
fi

# Test dependencies: the DeepEP clients the tests run unmodified on mtdeepep (and megatron-core, the reference of the
# MoE router parity tests). --no-deps: their requirements would pull CUDA torch; --ignore-requires-python:
# megatron-core 0.19.2 declares >= 3.12 but its DeepEP and router code runs on 3.11. The check reads the package
# metadata: `import megatron.core` needs Triton, which the tests stub.
CLIENT_PKGS=(megatron-core==0.19.2 torchtitan==0.3.0 spmd-types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0
    typeguard==4.6.0)
if ! "$VENV_PY" -c "import importlib.metadata as m, sys; sys.exit(any(m.version(p.split('==')[0]) != p.split('==')[1] for p in sys.argv[1:]))" "${CLIENT_PKGS[@]}" 2>/dev/null; then
    echo "[env] installing the DeepEP clients (megatron-core, torchtitan) and their small pure-Python deps"
    "$VENV_PY" -m pip install -q --no-deps --ignore-requires-python "${CLIENT_PKGS[@]}"
fi

# Where users watch a run (moe/trainer/train/loggers.py): tensorboard for --tensorboard-dir; wandb for --wandb-project, optional
# for training (asked for without it, train.py stops with a clear error) but installed for the tests, which run it
# offline and read its transaction log (hence the pin); fastjsonschema (pure Python, no dependencies) checks the
# profiler's traces against the trace-event schema in the tests. None pulls torch.
if ! "$VENV_PY" -c "import tensorboard, wandb, fastjsonschema; assert wandb.__version__ == '0.31.0'" 2>/dev/null; then
    echo "[env] installing tensorboard, wandb and fastjsonschema"
    "$VENV_PY" -m pip install -q tensorboard wandb==0.31.0 fastjsonschema
fi

# Parquet corpora: moe/trainer/data/corpus.py reads .parquet when pyarrow is present, and the tests read one.
if ! "$VENV_PY" -c "import pyarrow" 2>/dev/null; then
    echo "[env] installing pyarrow (parquet corpora)"
    "$VENV_PY" -m pip install -q pyarrow
fi

# The Triton executor (mtdeepep/kernels, mtdeepep/engines/triton.py): its kernels run on the CPU under Triton's
# interpreter in the tests. Triton declares no torch dependency, so it pulls no CUDA wheels.
if ! "$VENV_PY" -c "import triton" 2>/dev/null; then
    echo "[env] installing triton"
    "$VENV_PY" -m pip install -q "triton==3.9.0"
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

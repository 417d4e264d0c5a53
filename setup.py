"""Builds mtdeepep._C (the CPU executor) always, and mtdeepep._C_cuda (the GPU executor) when a CUDA build of torch
and nvcc are present, or the same sources through torch_musa's builder when torch_musa and the MUSA toolkit are
(Moore Threads GPUs).

Environment: MTDEEPEP_DISABLE_CUDA=1 skips the GPU executor. MTDEEPEP_REQUIRE_CUDA=1 makes a missing GPU executor an
error instead of a warning (scripts/gpu_check.sh sets it: on a GPU machine a build without it is broken).
MTDEEPEP_EXTENSIONS=_C_cuda (or _C) builds only the named extensions (the GPU check rebuilds only what changed)."""

import glob
import os
import shutil

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wno-unused-function"]


def sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def musa_available() -> bool:
    try:
        import torch_musa  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mcc") is not None or os.environ.get("MUSA_HOME") is not None


def cuda_available() -> bool:
    if os.environ.get("MTDEEPEP_DISABLE_CUDA") == "1":
        return False
    return torch.version.cuda is not None and shutil.which(os.environ.get("NVCC", "nvcc")) is not None


def musa_sources(gpu_sources: list[str]) -> list[str]:
    """torch_musa's builder hands `.mu` files to mcc: one `.mu` per `.cu` that includes it (the sources stay one)."""
    out_dir = os.path.join(ROOT, "build", "musa_sources")
    os.makedirs(out_dir, exist_ok=True)
    result = []
    for source in gpu_sources:
        if not source.endswith(".cu"):
            result.append(source)
            continue
        wrapper = os.path.join(out_dir, os.path.basename(source)[: -len(".cu")] + ".mu")
        with open(wrapper, "w") as f:
            f.write(f'#include "{os.path.join(ROOT, source)}"\n')
        result.append(os.path.relpath(wrapper, ROOT))
    return result


def gpu_executor_missing(reason: str) -> None:
    """A CUDA build of torch without the GPU executor: an error where it is required, else a loud warning (the tests
    of a GPU machine fail on it anyway)."""
    message = f"mtdeepep: building WITHOUT the CUDA executor (mtdeepep._C_cuda): {reason}"
    if os.environ.get("MTDEEPEP_REQUIRE_CUDA") == "1":
        raise SystemExit(message + " (MTDEEPEP_REQUIRE_CUDA=1)")
    print(f"\n*** {message} ***\n", flush=True)


def wanted(name: str) -> bool:
    chosen = os.environ.get("MTDEEPEP_EXTENSIONS")
    return chosen is None or name in {n.strip() for n in chosen.split(",")}


def make_extensions():
    """`mtdeepep._C` (the CPU executor, always), plus `mtdeepep._C_cuda` (the GPU executor: csrc/kernels/cuda and
    csrc/runtime/cuda) built for MUSA when torch_musa and its toolkit are present, else for CUDA when torch is a CUDA
    build and nvcc exists; neither: the CPU build alone, unchanged."""
    cpu_sources = [p for p in sources("csrc/**/*.cpp") if "/cuda/" not in p and "/musa/" not in p]
    include_dirs = [os.path.join(ROOT, "csrc")]
    extensions = []
    if wanted("_C"):
        extensions.append(
            CppExtension("mtdeepep._C", cpu_sources, include_dirs=include_dirs, extra_compile_args=CXX_FLAGS)
        )
    if not wanted("_C_cuda"):
        return extensions
    gpu_sources = sources("csrc/kernels/cuda/*.cu") + sources("csrc/runtime/cuda/*.cpp")
    if musa_available():
        from torch_musa.utils.musa_extension import MUSAExtension

        extensions.append(
            MUSAExtension(
                "mtdeepep._C_cuda",
                musa_sources(gpu_sources),
                include_dirs=include_dirs,
                define_macros=[("MTDEEPEP_MUSA", "1")],
                extra_compile_args={"cxx": CXX_FLAGS + ["-DMTDEEPEP_MUSA"], "mcc": ["-O3", "-std=c++17"]},
            )
        )
    elif cuda_available():
        # TORCH_CUDA_ARCH_LIST, when set, chooses the targets (torch's builder); else Hopper, as CI checks.
        arch = [] if os.environ.get("TORCH_CUDA_ARCH_LIST") else ["-gencode=arch=compute_90a,code=sm_90a"]
        extensions.append(
            CUDAExtension(
                "mtdeepep._C_cuda",
                gpu_sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", "-std=c++17", *arch]},
            )
        )
    elif torch.version.cuda is not None and os.environ.get("MTDEEPEP_DISABLE_CUDA") != "1":
        gpu_executor_missing(f"torch is a CUDA {torch.version.cuda} build but {os.environ.get('NVCC', 'nvcc')} is "
                             "not on PATH")  # fmt: skip
    return extensions


setup(
    name="mtdeepep",
    version="0.1.0",
    description="DeepEP-compatible expert-parallel communication for MoE training on CPUs, CUDA and MUSA GPUs",
    packages=find_packages(include=["mtdeepep", "mtdeepep.*", "moe", "moe.*"]),
    ext_modules=make_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
)

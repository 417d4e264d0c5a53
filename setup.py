"""Builds mtdeepep._C: the CPU runtime always; CUDA kernels when a CUDA build of torch and nvcc are present;
the same kernels through torch_musa's builder when torch_musa is importable (Moore Threads GPUs)."""

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


def make_extension():
    cpu_sources = [p for p in sources("csrc/**/*.cpp") if "/cuda/" not in p and "/musa/" not in p]
    gpu_sources = sources("csrc/kernels/cuda/**/*.cu")
    include_dirs = [os.path.join(ROOT, "csrc")]
    if gpu_sources and musa_available():
        from torch_musa.utils.musa_extension import MUSAExtension

        return MUSAExtension(
            "mtdeepep._C",
            cpu_sources + gpu_sources,
            include_dirs=include_dirs,
            define_macros=[("MTDEEPEP_WITH_GPU", "1"), ("MTDEEPEP_MUSA", "1")],
            extra_compile_args={"cxx": CXX_FLAGS, "mcc": ["-O3", "-std=c++17"]},
        )
    if gpu_sources and cuda_available():
        return CUDAExtension(
            "mtdeepep._C",
            cpu_sources + gpu_sources,
            include_dirs=include_dirs,
            define_macros=[("MTDEEPEP_WITH_GPU", "1")],
            extra_compile_args={
                "cxx": CXX_FLAGS,
                "nvcc": ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"],
            },
        )
    return CppExtension("mtdeepep._C", cpu_sources, include_dirs=include_dirs, extra_compile_args=CXX_FLAGS)


setup(
    name="mtdeepep",
    version="0.1.0",
    description="DeepEP-compatible expert-parallel communication for MoE training on CPUs, CUDA and MUSA GPUs",
    packages=find_packages(include=["mtdeepep", "mtdeepep.*", "moe", "moe.*"]),
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
)

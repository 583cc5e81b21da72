"""The one list of C++ (and CUDA) sources and flags, shared by setup.py (pip install) and the JIT build (_ext.py).

Plain Python with no imports beyond the standard library, so setup.py can read it before the package exists.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SOURCES = [
    "csrc/module.cpp",
    "csrc/checks.cpp",
    "csrc/mask_ranges.cpp",
    "csrc/workspace.cpp",
    "csrc/testing.cpp",
    "csrc/dispatch.cpp",
    # The readable flash forward, plain scalar C++: compiled once, not per instruction set.
    "csrc/kernels/flash_teaching.cpp",
    # Every kernel, compiled once per instruction set; dispatch.cpp picks one when the module loads.
    "csrc/isa/kernels_amx.cpp",
    "csrc/isa/kernels_avx512_bf16.cpp",
    "csrc/isa/kernels_avx512.cpp",
    "csrc/isa/kernels_avx2.cpp",
    "csrc/isa/kernels_scalar.cpp",
    # The amx kernels with AMX done in software (csrc/isa/amx_emulation.h): tests of the AMX paths anywhere.
    "csrc/isa/kernels_amx_emulated.cpp",
]

# No -march: one build must run on any x86-64. Wider ISAs are switched on per file (csrc/isa/).
CXX_FLAGS = ["-O3", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
# libstdc++ named explicitly: on Ubuntu with GCC 13 and torch 2.11 the default link left the module
# without a dependency on libstdc++.so.6 and with private copies of iostream templates (std::ostream::_M_insert<long>)
# that crashed the first error message formatting an integer: every TORCH_CHECK with a number segfaulted.
LD_FLAGS = ["-fopenmp"] + (["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else [])
# pip's build (setup.py) links stripped: the module a wheel ships carries no symbol table it does not need to load.
RELEASE_LD_FLAGS = ["-s"] if sys.platform.startswith("linux") else []


def without_interpreter_cflags(compiler_so: list) -> list:
    """setuptools' compile command less the CFLAGS of Python's own build (-g, -fwrapv, -DNDEBUG, -O*, warnings, and
    -march/-mtune, which would lift the baseline every ISA file builds on): what is left (the compiler, -fPIC,
    -pthread) plus CXX_FLAGS is the JIT build's command, so both builds agree."""
    dropped = ("-g", "-O", "-W", "-DNDEBUG", "-fwrapv", "-fno-strict-overflow", "-march", "-mtune")
    return [compiler_so[0]] + [f for f in compiler_so[1:] if not f.startswith(dropped)]


def torch_requirement(torch_version: str) -> str:
    """The wheel's torch requirement: the release it was built against ("2.13.0+cpu" -> "torch==2.13.0", which any
    2.13.0 build, CPU or CUDA, satisfies)."""
    return "torch==" + torch_version.split("+")[0]


# CS149GPT_SANITIZE=1 (make sanitize): AddressSanitizer and UBSan, into a build directory of its own (_ext.py).
# -O1 -g keeps the reports' stacks readable; the kernels' SIMD paths are still the ones that run.
SANITIZE = os.environ.get("CS149GPT_SANITIZE") == "1"
if SANITIZE:
    _sanitizers = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    CXX_FLAGS = [f for f in CXX_FLAGS if f != "-O3"] + ["-O1", "-g", *_sanitizers]
    LD_FLAGS = LD_FLAGS + _sanitizers

# The CUDA kernels (csrc/cuda/), built in only where torch has CUDA and nvcc is found (_ext.py, setup.py decide);
# elsewhere the build is the CPU one above, unchanged. The .cu files include no torch header (so
# tests/test_cuda_compile.py compile-checks them with a bare nvcc); flash_api.cpp alone touches Tensors.
CUDA_KERNEL_SOURCES = [
    "csrc/cuda/flash_teaching.cu",
    "csrc/cuda/flash_dispatch.cu",
] + [f"csrc/cuda/flash_{pass_}_hdim{d}_{t}.cu" for pass_ in ("fwd", "bwd") for d in (64, 128) for t in ("bf16", "fp16")]
# The Hopper forward and backward (csrc/cuda/hopper/): wgmma, TMA and setmaxnreg exist only in the sm_90a pass; the
# other passes compile their kernels as empty stubs and their launchers answer cudaErrorNotSupported there.
CUDA_KERNEL_SOURCES += [f"csrc/cuda/hopper/flash_{pass_}_hopper.cu" for pass_ in ("fwd", "bwd")] + [
    f"csrc/cuda/hopper/flash_{pass_}_hopper_hdim{d}_{t}.cu"
    for pass_ in ("fwd", "bwd")
    for d in (64, 128)
    for t in ("bf16", "fp16")
]
# Decoding against a KV cache (attention_with_kvcache on CUDA).
CUDA_KERNEL_SOURCES += ["csrc/cuda/flash_decode.cu", "csrc/cuda/merge.cu"]
CUDA_SOURCES = ["csrc/cuda/flash_api.cpp"] + CUDA_KERNEL_SOURCES

# sm_80 (Ampere: mma.sync, ldmatrix, cp.async) and sm_90a (Hopper). CS149GPT_CUDA_ARCHS="90a" (say) builds one
# only, which halves the build time on a known GPU.
CUDA_ARCHS = os.environ.get("CS149GPT_CUDA_ARCHS", "80;90a").split(";")
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"] + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]


def cuda_build_wanted(torch_cuda_version, cuda_home) -> bool:
    """Whether to build the CUDA kernels: torch was built with CUDA, nvcc is there, and CS149GPT_NO_CUDA is unset."""
    return bool(torch_cuda_version) and bool(cuda_home) and not os.environ.get("CS149GPT_NO_CUDA")


# Headers the sources include: a change to one of them must rebuild the JIT module too.
HEADERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in {".h", ".inc", ".cuh"}) + [
    "csrc/kernels/naive.cpp",
    "csrc/kernels/blocked.cpp",
    "csrc/kernels/fused.cpp",
    "csrc/kernels/flash.cpp",
    "csrc/kernels/flash_bf16.cpp",
    "csrc/kernels/flash_decode.cpp",
]

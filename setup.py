"""The C++ (and CUDA) extension of the package; the rest of its metadata is in pyproject.toml.

    pip install torch==2.13.0 setuptools wheel ninja
    pip install . --no-build-isolation
"""
import runpy
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit("cs149gpt compiles its kernels against the torch already installed, and pip's isolated build "
             "environment has none. Install torch first, then build without isolation:\n"
             "    pip install torch==2.13.0 setuptools wheel ninja    (requirements.txt's torch; or the one you use)\n"
             "    pip install . --no-build-isolation")

build = runpy.run_path("cs149gpt/_build.py")


class BuildWithJitFlags(BuildExtension):
    """torch's BuildExtension, compiling with the JIT build's flags rather than the interpreter's own CFLAGS."""

    def build_extensions(self):
        # setuptools passes every extension the CFLAGS Python itself was built with (e.g. "-DNDEBUG -g -fwrapv -O3
        # -Wall"): their -g made the module 35.7 MB against the JIT build's 3.9 MB.
        self.compiler.set_executable("compiler_so", build["without_interpreter_cflags"](self.compiler.compiler_so))
        super().build_extensions()


# The CUDA kernels only where torch has CUDA and nvcc is found; elsewhere the CPU extension, unchanged.
if build["cuda_build_wanted"](torch.version.cuda, CUDA_HOME):
    extension = CUDAExtension(
        "cs149gpt._C",
        build["SOURCES"] + build["CUDA_SOURCES"],
        extra_compile_args={"cxx": build["CXX_FLAGS"], "nvcc": build["NVCC_FLAGS"]},
        extra_link_args=build["LD_FLAGS"] + build["RELEASE_LD_FLAGS"],
        depends=build["HEADERS"],
    )
else:
    extension = CppExtension(
        "cs149gpt._C",
        build["SOURCES"],
        extra_compile_args=build["CXX_FLAGS"],
        extra_link_args=build["LD_FLAGS"] + build["RELEASE_LD_FLAGS"],
        depends=build["HEADERS"],
    )

setup(
    ext_modules=[extension],
    cmdclass={"build_ext": BuildWithJitFlags},
    # The module links against this torch's C++ API, which changes between releases: it loads with this one only.
    install_requires=[build["torch_requirement"](torch.__version__)],
)

"""pip install -e . --no-build-isolation   (torch must already be installed: see requirements.txt)"""
import runpy

from setuptools import setup
import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

build = runpy.run_path("cs149gpt/_build.py")

# The CUDA kernels only where torch has CUDA and nvcc is found; elsewhere the CPU extension, unchanged.
if build["cuda_build_wanted"](torch.version.cuda, CUDA_HOME):
    extension = CUDAExtension(
        "cs149gpt._C",
        build["SOURCES"] + build["CUDA_SOURCES"],
        extra_compile_args={"cxx": build["CXX_FLAGS"], "nvcc": build["NVCC_FLAGS"]},
        extra_link_args=build["LD_FLAGS"],
        depends=build["HEADERS"],
    )
else:
    extension = CppExtension(
        "cs149gpt._C",
        build["SOURCES"],
        extra_compile_args=build["CXX_FLAGS"],
        extra_link_args=build["LD_FLAGS"],
        depends=build["HEADERS"],
    )

setup(
    name="cs149gpt",
    version="0.1.0",
    description="CPU attention kernels for PyTorch: naive, blocked, fused and flash",
    packages=["cs149gpt"],
    package_data={"cs149gpt": ["models/*.pt", "models/README.md"]},
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    install_requires=["torch>=2.4"],
    python_requires=">=3.9",
)

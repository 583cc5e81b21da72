"""pip install -e . --no-build-isolation   (torch must already be installed: see requirements.txt)"""
import runpy

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

build = runpy.run_path("cs149gpt/_build.py")

setup(
    name="cs149gpt",
    version="0.1.0",
    description="CPU attention kernels for PyTorch: naive, blocked, fused and flash",
    packages=["cs149gpt"],
    package_data={"cs149gpt": ["models/*.pt", "models/README.md"]},
    ext_modules=[
        CppExtension(
            "cs149gpt._C",
            build["SOURCES"],
            extra_compile_args=build["CXX_FLAGS"],
            extra_link_args=build["LD_FLAGS"],
            depends=build["HEADERS"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    install_requires=["torch>=2.4"],
    python_requires=">=3.9",
)

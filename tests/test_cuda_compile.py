"""Compile-checks the CUDA kernels with a bare nvcc, no torch headers and no GPU: sm_80 and sm_90a.

The .cu files under csrc/cuda/ include no torch header (flash_api.cpp alone touches Tensors), so a machine
without a GPU, and CI, can catch a compile error in them. Skipped where nvcc is not on PATH. Compile only, host and device
code both (`-c`, as the JIT build compiles them; `-cubin` alone would miss host-side errors in the launchers), then
one relocatable link of the objects (`ld -r`: a symbol defined twice): nothing runs.
The default run compiles the shipped tile configuration of each kernel (-DCS149GPT_DEFAULT_CONFIG_ONLY, about
30 s on 2 cores); `pytest -m slow` also compiles every configuration the sweep can select (over a minute).
"""
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from cs149gpt import _build

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


# nvcc runs in a clean environment: under `make sanitize` this process has libasan preloaded, which nvcc (not built
# for it) would inherit and crash on.
NVCC_ENV = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}


def compile_all(arch, tmp_path, extra):
    def compile_one(src):
        out = tmp_path / (os.path.basename(src) + ".o")
        cmd = [NVCC, "-std=c++17", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-c",
               *extra, "-o", str(out), str(_build.ROOT / src)]
        return src, subprocess.run(cmd, capture_output=True, text=True, env=NVCC_ENV)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_one, _build.CUDA_KERNEL_SOURCES))
    failed = [f"{src}:\n{r.stderr}" for src, r in results if r.returncode != 0]
    assert not failed, "\n".join(failed)
    # One relocatable link of all the objects, as the extension links them: a kernel or function defined in a header
    # that several files include, without a template or inline, is defined twice.
    ld = shutil.which("ld")
    if ld is not None:
        objects = [str(tmp_path / (os.path.basename(src) + ".o")) for src in _build.CUDA_KERNEL_SOURCES]
        linked = subprocess.run([ld, "-r", "-o", str(tmp_path / "all.o"), *objects], capture_output=True, text=True,
                                env=NVCC_ENV)
        assert linked.returncode == 0, linked.stderr


@pytest.mark.parametrize("arch", ["80", "90a"])
def test_kernels_compile_without_torch(arch, tmp_path):
    compile_all(arch, tmp_path, ["-DCS149GPT_DEFAULT_CONFIG_ONLY"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["80", "90a"])
def test_every_configuration_compiles(arch, tmp_path):
    compile_all(arch, tmp_path, [])


def test_hopper_probe_tells_sm90a_from_sm90(tmp_path):
    """The dispatcher takes the Hopper kernel where the device loads the probe's sm_90a code (flash_fwd_hopper.cu):
    an sm_90 pass without the `a` also reports binaryVersion 90 but compiles the Hopper kernels as empty stubs, so
    the probe must differ there: static shared memory in the sm_90a pass only (ptxas's resource report)."""
    smem = {}
    for arch in ("90", "90a"):
        cmd = [NVCC, "-std=c++17", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-c", "-Xptxas", "-v",
               "-o", str(tmp_path / f"probe_{arch}.o"), str(_build.ROOT / "csrc/cuda/hopper/flash_fwd_hopper.cu")]
        done = subprocess.run(cmd, capture_output=True, text=True, env=NVCC_ENV)
        assert done.returncode == 0, done.stderr
        report = done.stderr.split("sm90a_probe_kernel", 1)[1].split("Compiling entry function", 1)[0]
        used = re.search(r"Used \d+ registers.*", report)
        assert used, report
        found = re.search(r"(\d+) bytes smem", used.group(0))
        smem[arch] = int(found.group(1)) if found else 0
    assert smem["90"] == 0 and smem["90a"] > 0, smem

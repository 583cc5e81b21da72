"""Loads the compiled kernels: the module pip built (cs149gpt/_C), or else, in a source checkout, a JIT build with
ninja."""
import importlib
import os
import sys
from pathlib import Path

import torch  # first: the extension links the OpenMP runtime torch has already loaded

from cs149gpt import _build

_module = None


def _with_cuda() -> bool:
    """Whether this build carries the CUDA kernels: only where torch has CUDA and nvcc is found."""
    from torch.utils.cpp_extension import CUDA_HOME

    return _build.cuda_build_wanted(torch.version.cuda, CUDA_HOME)


def _sources() -> list:
    return _build.SOURCES + (_build.CUDA_SOURCES if _with_cuda() else [])


def _in_checkout() -> bool:
    """Whether the package runs from a source checkout (csrc/ beside it), not from an installed copy (site-packages)."""
    return (_build.ROOT / "csrc" / "module.cpp").is_file()


def _newest_source_mtime() -> float:
    return max(os.path.getmtime(_build.ROOT / f) for f in _sources() + _build.HEADERS)


def _jit_build():
    from torch.utils.cpp_extension import load

    with_cuda = _with_cuda()
    build_dir = _build.ROOT / "build" / f"jit-py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"
    if with_cuda:
        build_dir = build_dir.with_name(build_dir.name + "-cuda")
    if _build.SANITIZE:
        build_dir = build_dir.with_name(build_dir.name + "-sanitize")
    build_dir.mkdir(parents=True, exist_ok=True)
    built = build_dir / "cs149gpt_C.so"
    if not built.exists() or built.stat().st_mtime < _newest_source_mtime():
        what = "C++ and CUDA" if with_cuda else "C++"
        print(f"cs149gpt: compiling the {what} kernels into {build_dir.relative_to(_build.ROOT)} (once, a minute or "
              "more)", file=sys.stderr, flush=True)
    return load(
        name="cs149gpt_C",
        sources=[str(_build.ROOT / s) for s in _sources()],
        extra_cflags=_build.CXX_FLAGS,
        extra_cuda_cflags=_build.NVCC_FLAGS if with_cuda else None,
        extra_ldflags=_build.LD_FLAGS,
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        verbose=False,
    )


def load():
    """The compiled module (also registers torch.ops.cs149gpt.*). In a checkout, builds it on first use if pip did not."""
    global _module
    if _module is None:
        if _build.SANITIZE:  # the pip-built module has no sanitizers: always the JIT build then
            _module = _jit_build()
            return _module
        try:
            _module = importlib.import_module("cs149gpt._C")
        except ImportError as error:
            if not _in_checkout():  # installed: no sources to build from, so say what failed
                raise ImportError(f"cs149gpt's compiled module did not load with torch {torch.__version__} (it loads "
                                  "with the torch it was built against: see `pip show cs149gpt`): "
                                  f"{error}") from error
            _module = _jit_build()
        else:
            if _in_checkout() and Path(_module.__file__).stat().st_mtime < _newest_source_mtime():
                print("cs149gpt: warning: cs149gpt/_C is older than csrc/; rebuild with `pip install -e . "
                      "--no-build-isolation`", file=sys.stderr)
    return _module

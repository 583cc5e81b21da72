"""The one list of C++ sources and flags, shared by setup.py (pip install) and the JIT build (_ext.py).

Plain Python with no imports beyond the standard library, so setup.py can read it before the package exists.
"""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SOURCES = [
    "csrc/module.cpp",
    "csrc/dispatch.cpp",
    # Every kernel, compiled once per instruction set; dispatch.cpp picks one when the module loads.
    "csrc/isa/kernels_amx.cpp",
    "csrc/isa/kernels_avx512_bf16.cpp",
    "csrc/isa/kernels_avx512.cpp",
    "csrc/isa/kernels_avx2.cpp",
    "csrc/isa/kernels_scalar.cpp",
]

# No -march: one build must run on any x86-64. Wider ISAs are switched on per file (csrc/isa/).
CXX_FLAGS = ["-O3", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
LD_FLAGS = ["-fopenmp"]

# CS149GPT_SANITIZE=1 (make sanitize): AddressSanitizer and UBSan, into a build directory of its own (_ext.py).
# -O1 -g keeps the reports' stacks readable; the kernels' SIMD paths are still the ones that run.
SANITIZE = os.environ.get("CS149GPT_SANITIZE") == "1"
if SANITIZE:
    _sanitizers = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    CXX_FLAGS = [f for f in CXX_FLAGS if f != "-O3"] + ["-O1", "-g", *_sanitizers]
    LD_FLAGS = LD_FLAGS + _sanitizers

# Headers the sources include: a change to one of them must rebuild the JIT module too.
HEADERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in {".h", ".inc"}) + [
    "csrc/kernels/naive.cpp",
    "csrc/kernels/blocked.cpp",
    "csrc/kernels/fused.cpp",
    "csrc/kernels/flash.cpp",
    "csrc/kernels/flash_bf16.cpp",
]

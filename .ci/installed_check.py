"""The installed wheel's check (.ci/wheel_check runs it from an empty directory, in a fresh virtualenv):
    python installed_check.py WHEEL
The wheel holds the module and no sources or tests, and requires the torch it was built with; `import cs149gpt`
loads the module from site-packages and compiles nothing; every instruction set the CPU has gives torch's answer."""
import importlib.metadata
import sys
import sysconfig
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.cpp_extension


def no_compile(*args, **kwargs):
    raise AssertionError("cs149gpt tried to compile its kernels: the installed module should load as it is")


torch.utils.cpp_extension.load = no_compile

wheel = Path(sys.argv[1])
names = zipfile.ZipFile(wheel).namelist()
modules = [n for n in names if n.startswith("cs149gpt/_C") and n.endswith(".so")]
assert len(modules) == 1, f"{wheel.name}: one compiled module expected, found {modules}"
so_mb = zipfile.ZipFile(wheel).getinfo(modules[0]).file_size / 2**20
# Stripped and without debug info the module is ~4 MB; with -g it was 35.7 MB.
assert so_mb < 10, f"{modules[0]} is {so_mb:.1f} MB: built with debug info or unstripped?"
sources = [n for n in names if n.endswith((".cpp", ".h", ".cu", ".cuh", ".inc")) or n.startswith("tests/")]
assert not sources, f"{wheel.name} ships sources or tests: {sources}"

import cs149gpt  # noqa: E402  (after no_compile is in place)
from cs149gpt import _ext  # noqa: E402

site = Path(sysconfig.get_paths()["platlib"]).resolve()
module_file = Path(_ext.load().__file__).resolve()
assert module_file.parent == site / "cs149gpt", f"the module came from {module_file}, not from {site}"
assert not (site / "build").exists() and not Path("build").exists(), "a build/ directory appeared"
assert cs149gpt.__version__ == importlib.metadata.version("cs149gpt"), "two version numbers"
required = importlib.metadata.requires("cs149gpt")
assert required == [f"torch=={torch.__version__.split('+')[0]}"], f"requires {required}, runs on torch {torch.__version__}"
print(f"cs149gpt {cs149gpt.__version__} from {module_file} ({so_mb:.1f} MB); torch {torch.__version__}; "
      f"isa {cs149gpt.isa()}; requires {required}")

torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 77, 64, dtype=torch.float64) for _ in range(3))
m = _ext.load()
best = cs149gpt.isa()
checked = []
for isa in ("amx", "avx512_bf16", "avx512", "avx2", "scalar", "amx_emulated"):
    try:
        m._testing.set_isa(isa)
    except (RuntimeError, ValueError):  # not on this CPU
        continue
    for is_causal in (False, True):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        for impl in cs149gpt.IMPLS:
            out = cs149gpt.attention(q.float(), k.float(), v.float(), impl=impl, is_causal=is_causal)
            err = (out.double() - ref).abs().max().item()
            assert err < 1e-4, f"{isa} {impl} causal={is_causal}: max error {err:.2e} against torch"
    checked.append(isa)
m._testing.set_isa(best)
qg, kg, vg = (t.float().requires_grad_() for t in (q, k, v))
cs149gpt.attention(qg, kg, vg, is_causal=True).sum().backward()
q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
F.scaled_dot_product_attention(q64, k64, v64, is_causal=True).sum().backward()
for name, ours, ref in (("dq", qg.grad, q64.grad), ("dk", kg.grad, k64.grad), ("dv", vg.grad, v64.grad)):
    assert (ours.double() - ref).abs().max().item() < 1e-4, f"flash backward {name} differs from torch"
print(f"attention ({', '.join(cs149gpt.IMPLS)}) and the flash backward match torch's SDPA; instruction sets "
      f"checked: {', '.join(checked)}")

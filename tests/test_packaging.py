"""The package as pip installs it, without building a wheel (that takes minutes: .ci/wheel_check, in CI).

An installed copy is cs149gpt/ in site-packages with its compiled module and no csrc/ beside it; here a copy in a
temporary directory, whose _C loads the module this checkout built, stands for it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cs149gpt
from cs149gpt import _build, _ext

ROOT = Path(__file__).resolve().parent.parent

# Loads the module this checkout built as cs149gpt._C, the way the compiled module of a wheel is found.
STUB = """import importlib.util, sys
spec = importlib.util.spec_from_file_location({name!r}, {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.modules["cs149gpt._C"] = module
"""

# Any attempt to compile fails loudly; then the package is used as a user would.
SCRIPT = """import torch, torch.utils.cpp_extension
def no_compile(*a, **k): raise AssertionError("compiled")
torch.utils.cpp_extension.load = no_compile
import cs149gpt
q, k, v = (torch.randn(1, 2, 33, 16, dtype=torch.float64) for _ in range(3))
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
out = cs149gpt.attention(q.float(), k.float(), v.float(), impl="flash", is_causal=True)
assert (out.double() - ref).abs().max() < 1e-4
print(cs149gpt.__version__, cs149gpt.isa(), cs149gpt._ext._module.__file__)
"""


def installed_copy(tmp_path, stub):
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "cs149gpt", site / "cs149gpt", ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    (site / "cs149gpt" / "_C.py").write_text(stub)
    (tmp_path / "elsewhere").mkdir()
    return site


def run_installed(site, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("CS149GPT_SANITIZE", None)
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                          cwd=tmp_path / "elsewhere", timeout=300)


@pytest.mark.skipif(_build.SANITIZE, reason="the sanitizer build runs only with its runtime preloaded")
def test_installed_copy_loads_without_sources_or_compiling(tmp_path):
    built = Path(_ext.load().__file__)
    site = installed_copy(tmp_path, STUB.format(name=built.name.split(".")[0], path=str(built)))
    res = run_installed(site, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "compiling" not in res.stderr
    version, isa, module_file = res.stdout.split()
    assert version == cs149gpt.__version__ and isa == cs149gpt.isa() and module_file == str(built)
    assert not (site / "build").exists() and not (tmp_path / "elsewhere" / "build").exists()


def test_installed_copy_whose_module_fails_says_why(tmp_path):
    site = installed_copy(tmp_path, "raise ImportError('undefined symbol: _ZN3c10...')\n")
    res = run_installed(site, tmp_path)
    assert res.returncode != 0
    assert f"did not load with torch {torch.__version__}" in res.stderr and "undefined symbol" in res.stderr
    assert "compiling" not in res.stderr and "AssertionError: compiled" not in res.stderr


def test_wheel_requires_the_torch_it_was_built_with():
    assert _build.torch_requirement("2.13.0+cpu") == "torch==2.13.0"
    assert _build.torch_requirement("2.12.1+cu128") == "torch==2.12.1"
    assert _build.torch_requirement("2.13.0") == "torch==2.13.0"


def test_pip_build_drops_the_interpreters_cflags():
    # sysconfig's CFLAGS on a pyenv CPython 3.11, as setuptools puts them in its compile command.
    compiler_so = ["gcc", "-Wsign-compare", "-DNDEBUG", "-g", "-fwrapv", "-O3", "-Wall", "-fPIC", "-pthread"]
    assert _build.without_interpreter_cflags(compiler_so) == ["gcc", "-fPIC", "-pthread"]


def test_one_version_number():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cs149gpt.__version__"}
    assert "version=" not in (ROOT / "setup.py").read_text()
    assert cs149gpt.__version__.count(".") == 2

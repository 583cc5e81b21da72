"""Every ```python block of README.md runs as written.

A block runs in a fresh namespace in this process (the extension is loaded once, so the whole file takes seconds);
the examples carry their own asserts against torch. An HTML comment on the line before a block can hold it back:
    <!-- skip-test: REASON -->        never run here (e.g. needs CUDA, or a network), skipped with REASON
    <!-- test-needs: MODULE -->       skipped when MODULE cannot be imported (e.g. transformers)
"""
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_LINES = 300  # a front door, not a manual: the long semantics live in the functions' docstrings

_FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
_MARK = re.compile(r"<!--\s*(skip-test|test-needs):\s*(.*?)\s*-->")


def _blocks():
    """(line number, code, skip reason or None) for each python block of the README."""
    text = README.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        reason = None
        if mark and mark.group(1) == "skip-test":
            reason = mark.group(2)
        elif mark and importlib.util.find_spec(mark.group(2)) is None:
            reason = f"needs {mark.group(2)}, not installed"
        found.append((line, match.group(1), reason))
    return found


BLOCKS = _blocks()


def test_readme_is_short_and_has_examples():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines, more than {MAX_LINES}"
    assert len(BLOCKS) >= 3, "the README's quick start and API examples were not found"


@pytest.mark.parametrize("line, code, skip", BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_readme_example_runs(line, code, skip):
    if skip:
        pytest.skip(skip)
    sdpa = F.scaled_dot_product_attention
    rng = torch.random.get_rng_state()
    try:
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    finally:  # an example may install our SDPA or seed the generator: leave the process as it was
        F.scaled_dot_product_attention = sdpa
        torch.random.set_rng_state(rng)

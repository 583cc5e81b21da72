"""Fixtures shared by the test files (helpers shared by them live in _helpers.py)."""
import pytest
import torch


@pytest.fixture
def restore_threads():
    """Lets a test change torch.set_num_threads (which our kernels obey too) and puts it back afterwards."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _hopper_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=["hopper", "fa2"])
def forward_path(request, monkeypatch):
    """Each test on both kernel families, forward and backward: Hopper's wgmma/TMA ones (csrc/cuda/hopper/, the
    default on sm_90) and FlashAttention-2's (CS149GPT_HOPPER=0, the path of every other GPU)."""
    if request.param == "hopper" and not _hopper_gpu():
        pytest.skip("not a Hopper GPU")
    monkeypatch.setenv("CS149GPT_HOPPER", "1" if request.param == "hopper" else "0")
    return request.param

"""Fixtures shared by the test files (helpers shared by them live in _helpers.py)."""
import pytest
import torch


@pytest.fixture
def restore_threads():
    """Lets a test change torch.set_num_threads (which our kernels obey too) and puts it back afterwards."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)

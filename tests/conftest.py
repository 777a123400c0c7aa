import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _restore_threads():
    """Tests that pin the thread count must not leak it into the next test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)

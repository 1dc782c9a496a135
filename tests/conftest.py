"""Test-suite wide settings."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Small CPU tensors: one intra-op thread avoids oversubscription under pytest -n 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

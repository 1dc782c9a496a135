"""Test-suite wide settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

#: the slow tier (tests/slow_tests.txt, measured; tests/slow_tier.py writes it)
_SLOW = {
    line.strip()
    for line in (Path(__file__).parent / "slow_tests.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


def pytest_collection_modifyitems(config, items):
    """Mark the measured slow tests ``slow``: `make test` runs ``-m "not slow"``, `make test-slow` the rest."""
    for item in items:
        if item.nodeid in _SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _one_thread():
    """Small CPU tensors: one intra-op thread avoids oversubscription under pytest -n 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

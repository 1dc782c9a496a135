"""Test-suite wide settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

#: the slow tier, measured seconds by node id (tests/slow_tests.txt; tests/slow_tier.py writes it)
_SLOW: dict[str, float] = {}
for _line in (Path(__file__).parent / "slow_tests.txt").read_text().splitlines():
    if _line.strip() and not _line.startswith("#"):
        _seconds, _node = _line.split(maxsplit=1)
        _SLOW[_node] = float(_seconds)


def pytest_collection_modifyitems(config, items):
    """Mark the measured slow tests ``slow`` (`make test` runs ``-m "not slow"``, `make test-slow` the
    rest), and run the tests of a minute or more first, then the files with the most measured seconds,
    each file's tests in their order: with two workers, a long test that starts last runs alone at the end."""
    weight: dict[str, float] = {}
    for item in items:
        if item.nodeid in _SLOW:
            item.add_marker(pytest.mark.slow)
        weight[item.nodeid.split("::")[0]] = weight.get(item.nodeid.split("::")[0], 0.0) + _SLOW.get(item.nodeid, 0.0)
    # the few tests of a minute or more go first of all; then by file (stable: a file's tests keep their order)
    items.sort(key=lambda item: (-max(_SLOW.get(item.nodeid, 0.0), 60.0), -weight[item.nodeid.split("::")[0]]))


@pytest.fixture(autouse=True)
def _one_thread():
    """Small CPU tensors: one intra-op thread avoids oversubscription under pytest -n 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

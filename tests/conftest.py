"""Test-suite wide settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# every value the process-wide case cache shares is fingerprinted when kept and checked on every hit:
# a test (or a check) that writes into a shared tensor fails where it happens (properties/case_cache.py)
os.environ.setdefault("FLAMIA_VERIFY_CASE_CACHE_VERIFY", "1")

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
        if _node(item) in _SLOW:
            item.add_marker(pytest.mark.slow)
        weight[_node(item).split("::")[0]] = weight.get(_node(item).split("::")[0], 0.0) + _SLOW.get(_node(item), 0.0)
    # the few tests of a minute or more go first of all; then by file (stable: a file's tests keep their order)
    items.sort(key=lambda item: (-max(_SLOW.get(_node(item), 0.0), 60.0), -weight[_node(item).split("::")[0]]))


def _node(item) -> str:
    """The test's node id without the ``@group`` that pytest-xdist's loadgroup appends to it."""
    nodeid = item.nodeid
    for mark in item.iter_markers("xdist_group"):
        name = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        if nodeid.endswith(f"@{name}"):
            return nodeid[: -len(name) - 1]
    return nodeid


@pytest.fixture(autouse=True)
def _one_thread():
    """Small CPU tensors: one intra-op thread avoids oversubscription under pytest -n 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

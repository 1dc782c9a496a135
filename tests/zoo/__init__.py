"""Planted-bug kernels (tests/zoo/kernels.py), each of which must fail the check that is for it,
and correct kernels from outside the project (tests/zoo/correct.py) that must pass everything."""

from zoo import kernels
from zoo.correct import sdpa_bf16

__all__ = ["kernels", "sdpa_bf16"]

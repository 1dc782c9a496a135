"""Planted-bug kernels (tests/zoo/kernels.py), each of which must fail the check that is for it,
and correct kernels from outside the project (tests/zoo/correct.py) that must pass everything."""

from zoo.correct import sdpa_bf16  # noqa: F401
from zoo.kernels import *  # noqa: F401,F403
from zoo.kernels import BUGS  # noqa: F401

"""Planted-bug kernels (see tests/zoo/kernels.py): each must fail the check that is for it."""

from zoo.kernels import *  # noqa: F401,F403
from zoo.kernels import BUGS, __all__  # noqa: F401

"""The state family: does a kernel that keeps state between calls stay within its recipe when called
as training calls it?

Importing this package registers its checks, in this order (the order they run in):

    sequences  state.training, state.history
"""

from flamia_verify.properties.checks.state import sequences

__all__ = ["sequences"]

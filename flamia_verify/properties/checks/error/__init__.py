"""The error family: how far O, dQ, dK, dV are from the float64 reference, over the recipe's rounding
model.

Importing this package registers its checks, in this order (the order they run in):

    tensors   error.out, error.dq, error.dk, error.dv
    captured  error.captured
"""

# isort: off
# in the order the checks run (an import registers its module's checks)
from flamia_verify.properties.checks.error import tensors
from flamia_verify.properties.checks.error import captured
# isort: on

__all__ = ["tensors", "captured"]

"""The bound family: every element within the recipe's rigorous a-priori bound; the MX roundings and
the accumulation in closed form.

Importing this package registers its checks, in this order (the order they run in):

    tensors   bound.out, bound.grad, bound.shapes
    rounding  bound.rounding, bound.accumulation
    captured  bound.captured
"""

# isort: off
# in the order the checks run (an import registers its module's checks)
from flamia_verify.properties.checks.bound import tensors
from flamia_verify.properties.checks.bound import rounding
from flamia_verify.properties.checks.bound import captured
# isort: on

__all__ = ["tensors", "rounding", "captured"]

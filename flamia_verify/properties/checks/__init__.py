"""The checks, one module per family; importing this package registers them all, in this order.

Only :mod:`flamia_verify.properties.catalog` imports it. The check modules never import each other:
what several of them share is in :mod:`flamia_verify.properties.helpers`.
"""

from flamia_verify.properties.checks import (
    bias,
    bound,
    causal,
    consistency,
    determinism,
    error,
    interface,
    isolation,
    rounding,
    special,
    state,
)

# isort: split
# the checks of the calling convention and of attention's invariances after each family's first checks
from flamia_verify.properties.checks import convention, layout, nonfinite

# isort: split
# fuzzpass last: its check runs after its family's fixed checks
from flamia_verify.properties.checks import fuzzpass

# isort: split
# the checks of a run on a capture (--inputs), in no suite
from flamia_verify.properties.checks import captured

__all__ = [
    "bias",
    "bound",
    "captured",
    "causal",
    "consistency",
    "convention",
    "determinism",
    "error",
    "fuzzpass",
    "interface",
    "isolation",
    "layout",
    "nonfinite",
    "rounding",
    "special",
    "state",
]

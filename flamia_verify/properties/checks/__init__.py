"""The checks, one module per family; importing this package registers them all."""

from flamia_verify.properties.checks import (
    bias,
    bound,
    causal,
    consistency,
    convention,
    determinism,
    error,
    interface,
    isolation,
    layout,
    nonfinite,
    rounding,
    special,
)

# isort: split
# fuzzpass last: its check runs after its family's fixed checks
from flamia_verify.properties.checks import fuzzpass

__all__ = [
    "bias",
    "bound",
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
]

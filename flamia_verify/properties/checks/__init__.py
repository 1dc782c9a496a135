"""The checks, one module per family; importing this package registers them all."""

from flamia_verify.properties.checks import (  # noqa: F401
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
)
from flamia_verify.properties.checks import fuzzpass  # noqa: F401,E402  (last: it runs after its family's fixed checks)

__all__ = ["bias", "bound", "causal", "consistency", "determinism", "error", "fuzzpass", "interface", "isolation", "rounding", "special"]

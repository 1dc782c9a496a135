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
    special,
)

__all__ = ["bias", "bound", "causal", "consistency", "determinism", "error", "interface", "isolation", "special"]

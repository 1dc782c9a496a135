"""The checks, one package per family; importing this package registers them all.

Each family's package imports its modules in the order its checks run (the catalog sorts the checks
by family, then by registration). The packages never import each other (the import-linter contract
"check families independent"): what several families share is in :mod:`.common`. Only the catalog
imports this package to register the checks; the engine and the command line read
:data:`~flamia_verify.properties.checks.common.captured.CAPTURED_CHECKS` and the run-wide interface
checks from it.
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
    special,
    state,
)

__all__ = [
    "bias",
    "bound",
    "causal",
    "consistency",
    "determinism",
    "error",
    "interface",
    "isolation",
    "special",
    "state",
]

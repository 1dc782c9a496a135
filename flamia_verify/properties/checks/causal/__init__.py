"""The causal family: no output or gradient depends on a position it must not see.

Importing this package registers its checks, in this order (the order they run in):

    masking   causal.forward, causal.dq, causal.dk_dv, causal.nan, causal.diagonal
    captured  causal.captured
"""

# isort: off
# in the order the checks run (an import registers its module's checks)
from flamia_verify.properties.checks.causal import masking
from flamia_verify.properties.checks.causal import captured
# isort: on

__all__ = ["masking", "captured"]

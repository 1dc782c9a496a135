"""The consistency family: does the backward differentiate the forward that ran?

Importing this package registers its checks, in this order (the order they run in):

    identities   consistency.conservation_forward, consistency.shift_invariance,
                 consistency.conservation_backward, consistency.weights,
                 consistency.grad_forward_ratio
    homogeneity  consistency.homogeneity (the same base runs, scaled: after the other checks of
                 the family)
"""

# isort: off
# in the order the checks run (an import registers its module's checks)
from flamia_verify.properties.checks.consistency import identities
from flamia_verify.properties.checks.consistency import homogeneity
# isort: on

__all__ = ["identities", "homogeneity"]

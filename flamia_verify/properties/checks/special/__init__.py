"""The special family: the inputs where low-precision kernels break in practice, and those no training
run produces.

Importing this package registers its checks, in this order (the order they run in):

    inputs      special.zero_blocks, special.magnitudes, special.outlier_channels,
                special.attention_sink, special.constant_rows, special.negative_scores,
                special.short_documents
    degenerate  special.degenerate
    nonfinite   special.nonfinite
"""

# isort: off
# in the order the checks run (an import registers its module's checks)
from flamia_verify.properties.checks.special import inputs
from flamia_verify.properties.checks.special import degenerate
from flamia_verify.properties.checks.special import nonfinite
# isort: on

__all__ = ["inputs", "degenerate", "nonfinite"]

"""The determinism family: repeated runs on the same inputs give the same bits.

Importing this package registers its checks, in this order (the order they run in):

    repeat  determinism.repeat
"""

from flamia_verify.properties.checks.determinism import repeat

__all__ = ["repeat"]

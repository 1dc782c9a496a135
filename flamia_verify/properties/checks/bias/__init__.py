"""The bias family: is the error systematic?

Importing this package registers its checks, in this order (the order they run in):

    systematic  bias.gain, bias.mean
"""

from flamia_verify.properties.checks.bias import systematic

__all__ = ["systematic"]

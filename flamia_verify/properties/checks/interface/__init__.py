"""The interface family, the calling convention: what the kernel returns and leaves behind, the other
ways it may be called, the log-sum-exp it returns.

Importing this package registers its checks, in this order (the order they run in):

    contract   interface.output, interface.inputs_unmodified, interface.process_state,
               interface.backward
    arguments  interface.arguments, interface.arguments_bitwise
    lse        interface.lse
"""

# isort: off
# in the order the checks run (an import registers its module's checks)
from flamia_verify.properties.checks.interface import contract
from flamia_verify.properties.checks.interface import arguments
from flamia_verify.properties.checks.interface import lse
# isort: on

__all__ = ["contract", "arguments", "lse"]

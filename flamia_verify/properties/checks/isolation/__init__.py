"""The isolation family: a packed document's results depend on nothing but the document, and a
head's on nothing but its head.

Importing this package registers its checks, in this order (the order they run in):

    neighbours  isolation.neighbours, isolation.nan, isolation.offset, isolation.offset_bitwise
    heads       isolation.heads, isolation.heads_bitwise
    layout      isolation.layout, isolation.layout_bitwise
    nonfinite   isolation.nonfinite
    fuzz        isolation.fuzz (after the fixed checks of the family)
    captured    isolation.captured
"""

# isort: off
# in the order the checks run (an import registers its module's checks)
from flamia_verify.properties.checks.isolation import neighbours
from flamia_verify.properties.checks.isolation import heads
from flamia_verify.properties.checks.isolation import layout
from flamia_verify.properties.checks.isolation import nonfinite
from flamia_verify.properties.checks.isolation import fuzz
from flamia_verify.properties.checks.isolation import captured
# isort: on

__all__ = ["neighbours", "heads", "layout", "nonfinite", "fuzz", "captured"]

"""The known-bad kernels: one record (:class:`KnownBad`) and one registry (:data:`KNOWN_BAD`) that
``flamia-verify mutate``, train-parity's planted kernels and the test suite's zoo all read.

A record names a bug, says why it is wrong, which checks must catch it (and which its bug cannot
reach), what recipe it claims, and how to build it from a correct base kernel
(:mod:`flamia_verify.known_bad.record`). The package registers its families on import:

    table       the source-edit family: one-line edits of the emulation's source
                (``mask.forward+1``, ...; built by :mod:`~flamia_verify.known_bad.edits` from the
                faulty steps of :mod:`~flamia_verify.known_bad.operators`)
    wrapper     the wrapper family: one bug of the calling convention around a correct kernel
                (``wrapper.gqa.modulo``, ...), through the one forwarding wrapper of
                :mod:`~flamia_verify.known_bad.forwarding`
    demos       train-parity's planted kernels and its calibrated ladder

Both mutant families are tagged ``mutant`` (what ``flamia-verify mutate`` runs). The test suite's zoo
(tests/zoo) registers its own records into the same registry, tagged ``zoo``, and builds the
package's records on the bases its tests need. The checks never read this package (an import
contract): they are written without knowing the bugs they are measured on.
"""

# the record and the registry, then the families: each registers its records on import (the source
# edits before the wrappers: the order of `flamia-verify mutate --list`)
from flamia_verify.known_bad.record import JUDGED_BY_THEIR_FAMILY, KNOWN_BAD, Kernel, KnownBad, Registry, base_kernel

from flamia_verify.known_bad.forwarding import Forwarding, around, patched_emulation  # isort: skip
from flamia_verify.known_bad import table  # isort: skip
from flamia_verify.known_bad import wrapper  # isort: skip
from flamia_verify.known_bad import demos  # isort: skip

__all__ = [
    "table",
    "wrapper",
    "demos",
    "KnownBad",
    "Kernel",
    "Registry",
    "KNOWN_BAD",
    "JUDGED_BY_THEIR_FAMILY",
    "base_kernel",
    "Forwarding",
    "around",
    "patched_emulation",
    "mutants",
]


def mutants() -> tuple[KnownBad, ...]:
    """What ``flamia-verify mutate`` runs: the records tagged ``mutant`` (source edits, then wrappers)."""
    return KNOWN_BAD.select(tag="mutant")

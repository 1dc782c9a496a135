"""Mutation testing of the checks: how many realistic bugs does each suite catch, and does it ever
fail a correct design?

The mutants are the known-bad records tagged ``mutant`` (:mod:`flamia_verify.known_bad`): the
source-edit family (the FLAMIA MXFP8 emulation, the executable specification, with one bug planted
from a table: :mod:`flamia_verify.known_bad.table`) and the wrapper family (one bug of the calling
convention around a correct kernel: :mod:`flamia_verify.known_bad.wrapper`). :func:`run_mutants`
(:mod:`flamia_verify.mutation.runner`) runs a suite on each and reports the kill rate per family, and
the false alarms on the correct alternatives; ``flamia-verify mutate`` is the command-line front end.

The names below are the source-edit family's, kept here for code written against this package
before the registry held them.
"""

from flamia_verify.known_bad.edits import Edit, Mutant, MutationError, mutant_kernel
from flamia_verify.known_bad.table import BUGS, CORRECT, MUTANTS, by_name, ci_sample

__all__ = ["Edit", "Mutant", "MutationError", "mutant_kernel", "MUTANTS", "BUGS", "CORRECT", "by_name", "ci_sample"]

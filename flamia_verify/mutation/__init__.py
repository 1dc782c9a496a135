"""Mutation testing of the checks: how many realistic bugs does each suite catch, and does it ever
fail a correct design?

A *mutant* is the FLAMIA MXFP8 emulation (the executable specification) with one bug planted from
a table (:mod:`flamia_verify.mutation.table`); :func:`run_mutants` runs a suite on each and reports
the kill rate per family, and the false alarms on the correct alternative designs of the table.
``flamia-verify mutate`` is the command-line front end. A second family,
:mod:`flamia_verify.mutation.wrapper`, plants its bugs in the wrapper around a correct kernel
(defaults, GQA and cu_seqlens arithmetic, dispatch, strides, dtypes, the lse tuple) instead.
"""

from flamia_verify.mutation.build import Edit, Mutant, MutationError, mutant_kernel
from flamia_verify.mutation.table import BUGS, CORRECT, MUTANTS, by_name, ci_sample

__all__ = ["Edit", "Mutant", "MutationError", "mutant_kernel", "MUTANTS", "BUGS", "CORRECT", "by_name", "ci_sample"]

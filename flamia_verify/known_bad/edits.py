"""The source-edit family's mutants (edits of the emulation's source, changes of a design) and how
one is turned into a kernel.

The emulation (:mod:`flamia_verify.kernels.emulation`) is the executable specification of every
built-in kernel. A mutant is that specification with one realistic bug planted: its source text
with a few exact replacements, each confined to one function (``Edit.scope``), compiled into a
module of its own. The original module is never patched, so the float64 reference, the BF16
baseline and every other kernel in the process keep running the true code, in any thread.

An edit must match exactly once in its scope: when the emulation changes, a stale edit fails
loudly (:class:`MutationError`) instead of silently planting nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
import types
from dataclasses import dataclass
from typing import Any

from flamia_verify.errors import FlamiaVerifyError
from flamia_verify.recipes.operands import Operand

__all__ = [
    "Edit",
    "Mutant",
    "MutationError",
    "SourceEdit",
    "apply_edits",
    "mutated_module",
    "mutant_kernel",
    "EMULATION",
]

EMULATION = "flamia_verify.kernels.emulation"


class MutationError(FlamiaVerifyError):
    """A mutant cannot be built: an edit does not match its scope exactly once, or a field is unknown."""


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` inside the top-level function ``scope`` ("" = the whole module)."""

    scope: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    """One planted change of a built-in design.

    name: unique, ``family.what`` (e.g. ``mask.forward+1``). family: the kind of bug (the table's
    rows are grouped by it). edits: source edits of the emulation. design: changes of the base
    design, each an operand's rounding (``(Operand.DS, Quant("nvfp4", 16))``) or another field
    (``("mma", frozenset())``). correct: True for an alternative *correct*
    design (a false-alarm probe: every check must pass on it), False for a bug every suite should
    catch. why: one line a reader of the kill table needs. Each entry of the table is registered as
    a known-bad record (:mod:`flamia_verify.known_bad.table`) whose ``build`` is :class:`SourceEdit`.
    """

    name: str
    family: str
    why: str
    edits: tuple[Edit, ...] = ()
    design: tuple[tuple[Operand | str, Any], ...] = ()
    base: str = "flamia-mxfp8"
    correct: bool = False


def _scope_span(source: str, tree: ast.Module, scope: str) -> tuple[int, int]:
    if not scope:
        return 0, len(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == scope:
            lines = source.splitlines(keepends=True)
            start = sum(len(x) for x in lines[: node.lineno - 1])
            end = sum(len(x) for x in lines[: node.end_lineno])
            return start, end
    raise MutationError(f"no top-level function or class {scope!r} in {EMULATION}")


def apply_edits(source: str, edits: tuple[Edit, ...], *, name: str = "") -> str:
    """The source with every edit applied; each must match exactly once in its scope."""
    for e in edits:
        tree = ast.parse(source)
        a, b = _scope_span(source, tree, e.scope)
        part = source[a:b]
        n = part.count(e.old)
        if n != 1:
            where = f"function {e.scope}" if e.scope else "the module"
            raise MutationError(f"mutant {name}: edit {e.old!r} matches {n} times in {where} (must be once)")
        source = source[:a] + part.replace(e.old, e.new) + source[b:]
    return source


_MODULES: dict[tuple, types.ModuleType] = {}


def mutated_module(mutant: Mutant) -> types.ModuleType:
    """The emulation module with ``mutant``'s edits, compiled once per process and set of edits."""
    key = (mutant.name, mutant.edits)
    if key in _MODULES:
        return _MODULES[key]
    original = importlib.import_module(EMULATION)
    source = apply_edits(inspect.getsource(original), mutant.edits, name=mutant.name)
    modname = f"flamia_verify.known_bad._mutant_{re.sub(r'[^0-9A-Za-z]+', '_', mutant.name)}_{len(_MODULES)}"
    module = types.ModuleType(modname, original.__doc__)
    module.__file__ = f"<mutant {mutant.name} of {EMULATION}>"
    from flamia_verify.known_bad import operators

    module.__dict__["_mut"] = operators
    sys.modules[modname] = module  # dataclasses resolve annotations through sys.modules
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    except Exception as exc:
        del sys.modules[modname]
        raise MutationError(f"mutant {mutant.name} does not compile: {type(exc).__name__}: {exc}") from exc
    _MODULES[key] = module
    return module


def mutant_design(mutant: Mutant, base=None):
    """The base design (default: the mutant's ``base``) with the mutant's field changes."""
    from flamia_verify.kernels.designs import DESIGNS

    if base is None:
        if mutant.base not in DESIGNS:
            names = ", ".join(DESIGNS)
            raise MutationError(f"mutant {mutant.name}: unknown base design {mutant.base!r}; known: {names}")
        base = DESIGNS[mutant.base]
    quants = {key: value for key, value in mutant.design if isinstance(key, Operand)}
    switches = {key: value for key, value in mutant.design if not isinstance(key, Operand)}
    known = {f.name for f in dataclasses.fields(base)} - {"quants"}
    unknown = sorted(set(switches) - known)
    if unknown:
        raise MutationError(f"mutant {mutant.name}: unknown design field(s) {', '.join(unknown)}")
    return base.with_quants(quants, name=f"mutant:{mutant.name}", **switches)


def mutant_kernel(mutant: Mutant, design=None):
    """A kernel in the varlen calling convention that runs the mutated emulation (any device) of
    ``design`` (default: the mutant's base design)."""
    module = mutated_module(mutant)
    kernel = module.make_kernel(mutant_design(mutant, design))
    kernel.__name__ = "mutant_" + re.sub(r"[^0-9A-Za-z]+", "_", mutant.name)
    kernel.__doc__ = f"mutant {mutant.name} of {mutant.base}: {mutant.why}"
    return kernel


@dataclass(frozen=True)
class SourceEdit:
    """A known-bad record's ``build`` for a source-edit mutant: ``SourceEdit(mutant)(base)`` is the
    mutated emulation of the design the base kernel runs (an emulated built-in: its ``design``)."""

    mutant: Mutant

    def __call__(self, base):
        from flamia_verify.kernels.metadata import kernel_design

        design = kernel_design(base)
        if design is None:
            raise MutationError(f"mutant {self.mutant.name} edits the emulation: its base must be an emulated built-in")
        return mutant_kernel(self.mutant, design)

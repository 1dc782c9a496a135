"""One record of a known-bad kernel (:class:`KnownBad`) and the one registry that holds them
(:data:`KNOWN_BAD`).

A record is a recipe for a bug, not a kernel: ``build(base)`` turns a correct kernel in the calling
convention (the *base*) into the buggy one. The same record can therefore be built on another base
(``record.kernel(base=...)``): a wrapper bug around the emulated ``flamia-mxfp8`` for
``flamia-verify mutate``, around torch SDPA for a test. ``kernel()`` builds it on its own base and
gives the result the attributes the tool and the tests read (``recipe``, ``catches``, ``quiet``,
``why``, ``known_bad``: the record).

What a record promises (``catches``: the checks or families that must report ``fail``; ``quiet``:
the ones its bug cannot reach, which must pass; ``suite``: where) is asserted by the tests that read
it. A record tagged ``mutant`` (the families ``flamia-verify mutate`` runs) or ``ladder``
(train-parity's rungs of known size) need not name a check: a mutant is judged by the kill rule (some
check of the suite fails or errors; its kill rate is measured, survivors included), a rung by
train-parity's gate. A mutant that the test suite also holds to named checks carries them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "KnownBad",
    "Kernel",
    "Registry",
    "KNOWN_BAD",
    "JUDGED_BY_THEIR_FAMILY",
    "base_kernel",
]

#: a kernel in the varlen calling convention (flamia_verify.convention)
Kernel = Callable[..., Any]

#: the tags of records that name no check of their own (see the module's docstring)
JUDGED_BY_THEIR_FAMILY = ("mutant", "ladder")


@functools.cache
def _design_names() -> frozenset[str]:
    from flamia_verify.kernels.designs import DESIGNS

    return frozenset(DESIGNS)


def base_kernel(name: str) -> Kernel:
    """The correct kernel a record is built from: a built-in design's emulation (the same numbers on
    every device) for a design name, else whatever the kernel loader makes of ``name`` (a built-in
    such as ``fp8-delayed``, ``module:function``, ``file.py:function``)."""
    if name in _design_names():
        from flamia_verify.kernels.designs import DESIGNS
        from flamia_verify.kernels.emulation import make_kernel

        return make_kernel(DESIGNS[name])
    from flamia_verify.kernels.loader import load_kernel

    return load_kernel(name).fn


@dataclass(frozen=True)
class KnownBad:
    """One known-bad kernel.

    name: unique in the registry (``wrapper.gqa.modulo``, ``mask.forward+1``, ``detached_k``).
    family: the dimension or family it belongs to (``wrapper.gqa``, ``mask``, ``interface``); the
    kill table of ``flamia-verify mutate`` has one row per family.
    why: what is wrong, in one sentence.
    build: ``build(base) -> kernel``: the buggy kernel around (or made from) the correct ``base``.
    base: the correct kernel it is built from by default (:func:`base_kernel` resolves it).
    recipe: the recipe the buggy kernel claims; None: the base's.
    catches: the checks (or families) that must report ``fail`` on it; quiet: the checks (or
    families) its bug cannot reach, which must pass; suite: where both hold.
    where: the inputs on which it is wrong (the rest of the input space gets the base's answer).
    source: the public bug reports or the kind of kernel it models.
    tags: who reads it: ``mutant`` (``flamia-verify mutate``), ``wrapper`` or ``source-edit`` (its
    mutant family), ``train-demo`` and ``ladder`` (train-parity), ``zoo`` (the test suite), ``plain``
    (a wrapper mutant that leaves a plain call bitwise alone).
    correct: a correct alternative, not a bug (a false-alarm probe: every check must pass on it).
    attrs: further attributes the built kernel carries (what one test family reads, e.g. ``rule``).
    """

    name: str
    family: str
    why: str
    build: Callable[[Kernel], Kernel] = field(repr=False, compare=False)
    base: str = "flamia-mxfp8"
    recipe: str | None = None
    catches: tuple[str, ...] = ()
    quiet: tuple[str, ...] = ()
    suite: str = "quick"
    where: str = ""
    source: str = ""
    tags: tuple[str, ...] = ()
    correct: bool = False
    attrs: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def has(self, tag: str) -> bool:
        return tag in self.tags

    def kernel(self, base: Kernel | None = None) -> Kernel:
        """The buggy kernel built on ``base`` (default: this record's base), carrying the record's
        claims as attributes (``recipe``, ``catches``, ``quiet``, ``why``, ``known_bad``, ...)."""
        if base is None:
            base = base_kernel(self.base)
        fn = self.build(base)
        recipe = self.recipe if self.recipe is not None else getattr(base, "recipe", None)
        if isinstance(recipe, str):
            setattr(fn, "recipe", recipe)  # noqa: B010  # a function attribute (kernels.metadata)
        for key, value in (
            ("catches", self.catches),
            ("quiet", self.quiet),
            ("suite", self.suite),
            ("why", self.why),
            ("where", self.where),
            ("source", self.source),
            ("known_bad", self),
            *self.attrs,
        ):
            setattr(fn, key, value)
        try:
            fn.__doc__ = self.why
        except (AttributeError, TypeError):  # a kernel object whose class fixes its docstring
            pass
        return fn


class Registry:
    """The known-bad records by name, in registration order.

    The package registers its own families on import (:mod:`flamia_verify.known_bad`); the test
    suite's zoo registers its records when its modules are imported. ``origin`` (the registering
    module's file) lets a module that runs twice (a kernel file loaded by path after an import)
    register its records again; any other clash of names is refused."""

    def __init__(self) -> None:
        self._records: dict[str, KnownBad] = {}
        self._origins: dict[str, str] = {}

    def register(self, *records: KnownBad, origin: str = "") -> tuple[KnownBad, ...]:
        if origin.endswith(".py"):  # a module's file, however it was reached (imported, or loaded by path)
            origin = os.path.realpath(origin)
        for r in records:
            if not isinstance(r, KnownBad):
                raise TypeError(f"not a KnownBad record: {r!r}")
            had = self._origins.get(r.name)
            if r.name in self._records and (not origin or had != origin):
                raise ValueError(f"known-bad record {r.name!r} is registered twice ({had or '?'}, {origin or '?'})")
        for r in records:
            self._records[r.name] = r
            self._origins[r.name] = origin
        return records

    def get(self, name: str) -> KnownBad:
        try:
            return self._records[name]
        except KeyError:
            raise KeyError(f"no known-bad record {name!r}") from None

    def kernel(self, name: str, base: Kernel | None = None) -> Kernel:
        """``get(name).kernel(base)``."""
        return self.get(name).kernel(base)

    def select(
        self, *, tag: str | None = None, family: str | None = None, correct: bool | None = None
    ) -> tuple[KnownBad, ...]:
        """The records with ``tag``, of ``family`` (or a family below it: ``wrapper`` selects
        ``wrapper.gqa``), and correct or not, in registration order."""
        return tuple(
            r
            for r in self._records.values()
            if (tag is None or tag in r.tags)
            and (family is None or r.family == family or r.family.startswith(family + "."))
            and (correct is None or r.correct == correct)
        )

    def origin(self, name: str) -> str:
        return self._origins[name]

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[KnownBad]:
        return iter(tuple(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)


#: the one registry of known-bad kernels
KNOWN_BAD = Registry()

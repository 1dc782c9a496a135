"""What a kernel function may carry besides being callable: the attributes the tool reads, in one place.

A kernel is any callable in the calling convention (:mod:`flamia_verify.convention`). The tool reads
these optional attributes of it, always through the accessors below (a missing or ill-typed attribute
reads as None):

==============  ==========================  ===========================================================
attribute       who sets it                 what it means
==============  ==========================  ===========================================================
``recipe``      a user, or a built-in       the recipe (a name in ``flamia_verify.kernels.RECIPES``) the
                                            kernel claims, so that ``--recipe`` may be left out; a
                                            ``--recipe`` given still wins. Read by the kernel loader.
``design``      the built-in kernels        the ``EmulatedDesign`` the kernel runs (``flamia-verify
                                            list`` shows what it runs on CUDA).
``emulated``    the fused dispatch          the PyTorch emulation of the same design that a fused
                                            built-in kernel falls back to (its executable
                                            specification).
``paths``       the built-in kernels        a ``collections.Counter`` of calls per implementation that
                                            ran ("fused Triton", "PyTorch emulation"); the report's
                                            environment lists them as ``kernel_paths``.
==============  ==========================  ===========================================================

``recipe`` is the one attribute meant for users: set it on a function (``attn.recipe = "mxfp8"``) to
declare its recipe. The others describe the built-in kernels and are written with
:func:`mark_builtin`. A kernel that keeps state between calls declares it with the attributes of
:mod:`flamia_verify.kernels.state` (``state_policy``, ``new_instance``, ``state_snapshot``,
``state_restore``, ``state_describe``), read through that module's accessors.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from flamia_verify.kernels.emulation import EmulatedDesign

__all__ = ["BuiltinKernel", "emulated_twin", "kernel_design", "kernel_paths", "kernel_recipe", "mark_builtin"]


class BuiltinKernel(Protocol):
    """A built-in kernel function: callable in the calling convention, with its design and call counts."""

    design: EmulatedDesign
    recipe: str
    paths: collections.Counter[str]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def kernel_recipe(fn: Callable[..., Any]) -> str | None:
    """The recipe a kernel function claims (its ``recipe`` attribute), or None when it claims none."""
    recipe = getattr(fn, "recipe", None)
    return recipe if isinstance(recipe, str) else None


def kernel_design(fn: Callable[..., Any]) -> EmulatedDesign | None:
    """The design a built-in kernel function runs, or None for any other function."""
    return getattr(fn, "design", None)


def emulated_twin(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The PyTorch emulation behind a fused built-in kernel function, or None when it has none."""
    return getattr(fn, "emulated", None)


def kernel_paths(fn: Callable[..., Any]) -> collections.Counter[str] | None:
    """Calls per implementation of a built-in kernel function so far, or None for any other function."""
    paths = getattr(fn, "paths", None)
    return paths if isinstance(paths, collections.Counter) else None


def mark_builtin(
    fn: Callable[..., Any], design: EmulatedDesign, *, emulated: Callable[..., Any] | None = None
) -> BuiltinKernel:
    """Give ``fn`` the attributes of a built-in kernel running ``design``: its design, its recipe, a
    fresh call counter and, for a fused kernel, the emulation it falls back to. Returns ``fn``."""
    marked = cast(BuiltinKernel, fn)
    marked.design = design
    marked.recipe = design.recipe.name  # the attribute a user sets: a recipe's name
    marked.paths = collections.Counter()
    if emulated is not None:
        setattr(marked, "emulated", emulated)  # noqa: B010 (not an attribute of every built-in)
    return marked

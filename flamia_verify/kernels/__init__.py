"""Kernels: the FLAMIA-style emulation (the executable specification), the attributes a kernel
function carries (`metadata`), and the loader (`loader`: the built-in kernels, a user's kernels by module,
file or entry point).
The calling convention's names (`flamia_verify.convention`) and the recipes (`flamia_verify.recipes`) are
re-exported here."""

from flamia_verify.convention import AttentionKernel, first_output, seqlens, validate_varlen_inputs
from flamia_verify.kernels.loader import LoadedKernel, builtin_kernels, load_kernel
from flamia_verify.recipes import RECIPES, Recipe, get_recipe

__all__ = [
    "AttentionKernel",
    "LoadedKernel",
    "RECIPES",
    "Recipe",
    "builtin_kernels",
    "first_output",
    "get_recipe",
    "load_kernel",
    "seqlens",
    "validate_varlen_inputs",
]

"""Kernels: recipes, the FLAMIA-style emulation (the executable specification), the attributes a kernel
function carries (`metadata`), the registry of built-in kernels and the loader for a user's kernels.
The calling convention's names (`flamia_verify.convention`) are re-exported here."""

from flamia_verify.convention import AttentionKernel, first_output, seqlens, validate_varlen_inputs
from flamia_verify.kernels.recipes import RECIPES, Recipe, get_recipe
from flamia_verify.kernels.registry import LoadedKernel, builtin_kernels, load_kernel

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

"""Recipes: which precision a kernel claims for each GEMM operand of attention, and what follows from it.

* :mod:`~flamia_verify.recipes.operands`: the six GEMMs and their twelve operands (:class:`Operand`),
  the key of every per-operand vocabulary;
* :mod:`~flamia_verify.recipes.recipe`: :class:`Recipe` and the built-in :data:`RECIPES`;
  :func:`get_recipe` turns a name (``--recipe``, a kernel's ``recipe`` attribute) into one, once, at
  the edge; everything below takes the object;
* :mod:`~flamia_verify.recipes.bounds`: the rounding model of each operand (:class:`OperandModel`)
  and the rigorous a-priori elementwise bound of attention under it;
* :mod:`~flamia_verify.recipes.noise_model`: the recipe's expected (RMS) error on given inputs;
* :mod:`~flamia_verify.recipes.accumulator`: the E4M3 tensor-core accumulator's constants.
"""

from flamia_verify.recipes.operands import OPERANDS_REACHING, Gemm, Operand, describe_operands
from flamia_verify.recipes.recipe import RECIPES, Recipe, get_recipe

__all__ = ["Gemm", "OPERANDS_REACHING", "Operand", "RECIPES", "Recipe", "describe_operands", "get_recipe"]

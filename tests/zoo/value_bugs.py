"""Planted bugs that only realistic values show: on Gaussian inputs they stay inside the recipe, on the
inputs of a trained model (outlier channels, massive-activation tokens, rotary q and k: the
``realistic`` base packing of every suite) they do not.

Each kernel carries ``recipe``, ``catches`` (the checks of the quick suite that must report ``fail``
on it) and ``quiet`` (checks that must pass: those its bug cannot reach, and the value checks it
passes on Gaussian inputs, ``gaussian_quiet``).

    strided_tensor_amax  the per-tensor FP8 kernel (``fp8-tensor``, FlashAttention-3-style current
                         scaling) with each tensor's amax taken over every 8th element (every 8th
                         channel of a (tokens, heads, head_dim) tensor: a reduction pass saved by
                         sampling). Over Gaussian values the sampled amax is within a few percent of
                         the true one (a few elements saturate at most); a channel of large values
                         outside the sample (an outlier channel, a massive-activation token's
                         channel, the strong rotary pairs) is cut to the sample's amax.

Command-line specs too: ``flamia-verify check --kernel tests/zoo/value_bugs.py:strided_tensor_amax
--recipe fp8``.
"""

from __future__ import annotations

from flamia_verify.mutation import Edit, Mutant, mutant_kernel

__all__ = ["VALUE_BUGS", "STRIDE"]

#: the stride of the sampled amax (elements of the flattened tensor: channels 0, 8, 16, ...)
STRIDE = 8

#: the checks fp8-tensor fails by design (its one tensor-wide amax sees the future and the other
#: documents: tests/test_properties_zoo.py) and so does every kernel built on it
FP8_TENSOR_LEAKS = ("causal", "isolation", "consistency.conservation_forward")

strided_tensor_amax = mutant_kernel(
    Mutant(
        "zoo.strided_tensor_amax",
        "zoo",
        f"per-tensor amax over every {STRIDE}th element",
        (
            Edit(
                "quantize_operand",
                "amax = x.abs().amax() if x.numel() else x.new_zeros(())",
                f"amax = x.flatten()[::{STRIDE}].abs().amax() if x.numel() else x.new_zeros(())",
            ),
        ),
        base="fp8-tensor",
    )
)
strided_tensor_amax.recipe = "fp8"
strided_tensor_amax.catches = (
    "error.out",
    "error.dq",
    "error.dk",
    "error.dv",
    "bound.out",
    "consistency.homogeneity",
    "special.outlier_channels",
)
#: the value checks it passes when every case of the quick suite is Gaussian (as fp8-tensor does)
strided_tensor_amax.gaussian_quiet = (
    "error.out",
    "error.dq",
    "error.dk",
    "error.dv",
    "bound.out",
    "bound.grad",
    "consistency.homogeneity",
)
strided_tensor_amax.quiet = ("bound.grad", "determinism", "special.attention_sink")
strided_tensor_amax.__doc__ = (
    f"fp8-tensor (per-tensor FP8 current scaling) whose amax is taken over every {STRIDE}th element of each tensor"
)

#: every planted kernel of this file, by name
VALUE_BUGS = {"strided_tensor_amax": strided_tensor_amax}

"""Planted bugs that only realistic values show: on Gaussian inputs they stay inside the recipe, on the
inputs of a trained model (outlier channels, massive-activation tokens, rotary q and k: the
``realistic`` base packing of every suite) they do not.

Each is a record of the known-bad registry (tags ``zoo``, ``value``), and its kernel carries
``recipe``, ``catches`` (the checks of the quick suite that must report ``fail``
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

from flamia_verify.known_bad import KNOWN_BAD, KnownBad
from flamia_verify.known_bad.edits import Edit, Mutant, SourceEdit

__all__ = ["VALUE_BUGS", "STRIDE", "RECORDS", "strided_tensor_amax"]

#: the stride of the sampled amax (elements of the flattened tensor: channels 0, 8, 16, ...)
STRIDE = 8

#: the checks fp8-tensor fails by design (its one tensor-wide amax sees the future and the other
#: documents: tests/test_properties_zoo.py) and so does every kernel built on it
FP8_TENSOR_LEAKS = ("causal", "isolation", "consistency.conservation_forward")

RECORDS = KNOWN_BAD.register(
    KnownBad(
        "strided_tensor_amax",
        "values",
        f"fp8-tensor (per-tensor FP8 current scaling) whose amax is taken over every {STRIDE}th element of each tensor",
        SourceEdit(
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
        ),
        base="fp8-tensor",
        recipe="fp8",
        catches=(
            "error.out",
            "error.dq",
            "error.dk",
            "error.dv",
            "bound.out",
            "consistency.homogeneity",
            "special.outlier_channels",
        ),
        quiet=("bound.grad", "determinism", "special.attention_sink"),
        tags=("zoo", "value"),
        #: the value checks it passes when every case of the quick suite is Gaussian (as fp8-tensor does)
        attrs=(
            (
                "gaussian_quiet",
                ("error.out", "error.dq", "error.dk", "error.dv", "bound.out", "bound.grad", "consistency.homogeneity"),
            ),
        ),
    ),
    origin=__file__,
)
strided_tensor_amax = RECORDS[0].kernel()

#: every planted kernel of this file, by name
VALUE_BUGS = {"strided_tensor_amax": strided_tensor_amax}

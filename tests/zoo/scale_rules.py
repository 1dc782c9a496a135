"""MX kernels whose E8M0 scale exponent follows a wrong rule: the FLAMIA emulation (MXFP8, MXFP8 with
FLOOR scales, or the MX parts of NVFP4) with the exponent function of the block quantizer replaced
while the kernel runs (forward and backward). Every other step is the recipe's: blocks, E4M3
elements, RNE, saturation, the E8M0 clamp to [-127, 127].

With ``amax = m 2^E``, m in [1, 2), the recipes' rules are RCEIL ``E - 8 + (m > 1.75)`` and FLOOR
``E - 8``. The wrong ones, as exponents of the same amax:

    ceil_log2         ceil(log2 amax) - 8 = E - 8 + (m > 1)         (FLOOR's rule with ceil)
    round_log2        round(log2 amax) - 8 = E - 8 + (m > sqrt 2)
    round_quotient    round(log2(amax / 448)) = E - 8 - (m < 1.75 / sqrt 2)
    floor_quotient    floor(log2(amax / 448)) = E - 9 + (m >= 1.75)  (RCEIL's rule with floor)
    floor_plus_one    floor(log2(amax / 448)) + 1 = E - 8 + (m >= 1.75): RCEIL but at amax = 448 2^k
    ceil_minus_one    ceil(log2 amax) - 1 - 8 = E - 9 + (m > 1): FLOOR but at amax = 2^k
    floor             FLOOR where the recipe says RCEIL
    rceil             RCEIL where the recipe says FLOOR
    quotient_ftz      RCEIL from the fp32 quotient amax / 448, flushed to 0 (scale byte 0) where the
                      quotient is subnormal (amax < 448 2^-126): one exponent too small there

``WRONG`` maps a kernel name to the kernel; each is a record of the known-bad registry
(``wrong_rule.<base>.<rule>``, tags ``zoo``, ``scale-rule``: it must fail ``bound.rounding``) built
on the correct built-in it is a variation of, and carries ``recipe``, ``rule`` (the wrong rule's
name) and ``base`` (that built-in). These are test kernels: the patch changes
``flamia_verify.formats.blocks`` for every caller while a kernel runs (single-threaded tests only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from unittest import mock

import torch

from flamia_verify.formats import blocks
from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.known_bad import KNOWN_BAD, KnownBad, patched_emulation

__all__ = ["EXPONENT_RULES", "WRONG_FOR", "WRONG", "RECORDS", "wrong_rule_kernel"]

_SQRT2 = math.sqrt(2.0)


def _split(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, E) with amax = m 2^E, m in [1, 2) (float64 m; E int32); amax > 0."""
    mantissa, e = torch.frexp(amax.double())
    return 2.0 * mantissa, (e - 1).to(torch.int32)


def _rule(body: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
    """An exponent function with ``mx_scale_exponent``'s signature from ``body(m, E, amax)`` (E4M3
    elements: emax 8); amax == 0 gives -128 as in the original."""

    def exponent(amax: torch.Tensor, elem, rule) -> torch.Tensor:
        m, e = _split(amax)
        out = body(m, e, amax).to(torch.int32)
        return torch.where(amax == 0, torch.full_like(out, -128), out)

    return exponent


def _i(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32)


def _quotient_ftz(m: torch.Tensor, e: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    q = amax.float() / 448.0
    rceil = e - 8 + _i(m > 1.75)
    return torch.where(q < 2.0**-126, torch.full_like(rceil, -128), rceil)


#: wrong exponent rules, each ``f(amax, elem, rule) -> int32 exponent`` (E4M3 elements)
EXPONENT_RULES: dict[str, Callable] = {
    "ceil_log2": _rule(lambda m, e, a: e - 8 + _i(m > 1)),
    "round_log2": _rule(lambda m, e, a: e - 8 + _i(m > _SQRT2)),
    "round_quotient": _rule(lambda m, e, a: e - 8 - _i(m < 1.75 / _SQRT2)),
    "floor_quotient": _rule(lambda m, e, a: e - 9 + _i(m >= 1.75)),
    "floor_plus_one": _rule(lambda m, e, a: e - 8 + _i(m >= 1.75)),
    "ceil_minus_one": _rule(lambda m, e, a: e - 9 + _i(m > 1)),
    "floor": _rule(lambda m, e, a: e - 8),
    "rceil": _rule(lambda m, e, a: e - 8 + _i(m > 1.75)),
    "quotient_ftz": _rule(_quotient_ftz),
}

#: the wrong rules of each recipe's scale rule (a rule equal to the recipe's own is left out)
WRONG_FOR: dict[str, tuple[str, ...]] = {
    "rceil": (
        "ceil_log2",
        "round_log2",
        "round_quotient",
        "floor_quotient",
        "floor_plus_one",
        "floor",
        "quotient_ftz",
    ),
    "floor": ("ceil_log2", "round_log2", "round_quotient", "ceil_minus_one", "rceil"),
}


class _WrongRule:
    """A build: the base's design with every MX block scale exponent by the wrong ``rule`` (the block
    quantizer's exponent function patched while each pass runs)."""

    def __init__(self, rule: str):
        self.rule = rule

    def __call__(self, base):
        def within(info):
            return mock.patch.object(blocks, "mx_scale_exponent", EXPONENT_RULES[self.rule])

        kernel = patched_emulation(base.design, forward=within, backward=within)
        kernel.__name__ = f"{base.design.name}_{self.rule}".replace("-", "_")
        return kernel


def _record(base: str, rule: str) -> KnownBad:
    return KnownBad(
        f"wrong_rule.{base}.{rule}",
        "rounding",
        f"{base} (emulation) with the MX scale exponent by the wrong rule {rule}",
        _WrongRule(rule),
        base=base,
        recipe=DESIGNS[base].recipe.name,
        catches=("bound.rounding",),
        tags=("zoo", "scale-rule"),
        attrs=(("rule", rule), ("base", base)),
    )


_BASES = {"flamia-mxfp8": "rceil", "flamia-mxfp8-floor": "floor", "flamia-nvfp4": "rceil"}

RECORDS = KNOWN_BAD.register(
    *(_record(base, rule) for base, own in _BASES.items() for rule in WRONG_FOR[own]), origin=__file__
)


def wrong_rule_kernel(base: str, rule: str):
    """The emulated built-in ``base`` with every MX block scale exponent by the wrong ``rule``."""
    return KNOWN_BAD.kernel(f"wrong_rule.{base}.{rule}")


WRONG: dict[str, Callable] = {
    f"{base}:{rule}": wrong_rule_kernel(base, rule) for base, own in _BASES.items() for rule in WRONG_FOR[own]
}

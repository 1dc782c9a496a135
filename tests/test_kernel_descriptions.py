"""Each built-in kernel's description names the scale rule its design actually uses."""

from __future__ import annotations

import re

import pytest

from flamia_verify.formats import ScaleRule
from flamia_verify.kernels import builtin_kernels
from flamia_verify.kernels.designs import DESIGNS, scale_rules


def _named_rules(text: str) -> set[str]:
    return {rule.name for rule in ScaleRule if re.search(rf"\b{rule.name}\b", text)}


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_description_names_exactly_the_design_s_scale_rules(name):
    design = DESIGNS[name]
    described = builtin_kernels()[name].description
    assert described == design.description
    assert _named_rules(described) == {rule.name for rule in scale_rules(design)}, described


def test_the_floor_variant_says_floor():
    assert scale_rules(DESIGNS["flamia-mxfp8-floor"]) == (ScaleRule.FLOOR,)
    assert "FLOOR" in DESIGNS["flamia-mxfp8-floor"].description
    assert "RCEIL" not in DESIGNS["flamia-mxfp8-floor"].description


def test_every_builtin_has_a_description():
    assert all(k.description for k in builtin_kernels().values())

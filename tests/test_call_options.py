"""The call options (properties/call_options.py) are the one description of how a call may hand its inputs
over: the case validation, interface.arguments, the coverage model and the harness all read them, so an
option's values, coverage rows, probe calls and judgement agree everywhere."""

from __future__ import annotations

import pytest
import torch

from flamia_verify.errors import ConfigError
from flamia_verify.properties.call_options import (
    OPTIONS,
    Judged,
    Stage,
    check_call,
    cu_laid_out,
    laid_out_like,
    option,
)
from flamia_verify.properties.cases import Case
from flamia_verify.properties.checks.common.cases import argument_cases
from flamia_verify.properties.checks.interface.arguments import _argument_jobs
from flamia_verify.properties.coverage import MODEL, features


def test_every_option_has_a_default_first_and_distinct_coverage_rows():
    keys = [o.key for o in OPTIONS]
    assert len(set(keys)) == len(keys)
    for opt in OPTIONS:
        assert Case((4,)).call_option(opt.key) == opt.default
        covered = [v.coverage for v in opt.values]
        assert len(set(covered)) == len(covered), opt.key
        for v in opt.values:  # each value is a row of the coverage model, under the option's dimension
            if not opt.in_coverage:
                assert not any(r.dimension == opt.dimension for r in MODEL), opt.key
                continue
            assert any(r.dimension == opt.dimension and r.value == v.coverage for r in MODEL), (opt.key, v)


def test_bitwise_and_flow_options_name_their_metric_and_words():
    for opt in OPTIONS:
        if opt.judged is not Judged.BOUND:
            assert opt.metric.endswith("_mismatches") and opt.words.startswith("with "), opt.key
        if opt.refused is not None:
            assert opt.refused_metric.startswith("refused_"), opt.key


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ((("layot", "fused"),), "unknown call option 'layot'; known: layout,"),
        ((("layout", "diagonal"),), "call option layout must be one of contiguous, fused, transposed, offset"),
        ((("max_seqlen_pad", -1),), "must be a non-negative integer or a pair"),
        ((("max_seqlen_pad", True),), "must be a non-negative integer or a pair"),
        ((("layout", "fused"), ("backward", "twice")), "call option backward=twice needs the contiguous layout"),
        ((("layout", "offset"), ("grad", "q")), "call option grad=q needs the contiguous layout, not offset"),
    ],
)
def test_a_bad_call_is_a_config_error_naming_the_option(call, message):
    with pytest.raises(ConfigError, match=None) as err:
        check_call(call)
    assert message in str(err.value)


def test_a_case_reads_its_options_and_features_name_them():
    case = Case((5, 3), call=(("layout", "transposed"), ("max_seqlen_pad", (5, 12)), ("autocast", "on")))
    assert case.call_option("layout") == "transposed" and case.call_option("grad") == "all"
    from flamia_verify.properties.cases import make_inputs

    got = features(make_inputs(case, "cpu"))
    assert {"layout=transposed", "max_seqlen=above", "autocast=on", "requires_grad=all"} <= got
    assert not any(f.startswith("loss=") for f in got)  # not in the coverage model


def test_interface_arguments_calls_every_probe_value_of_every_option_on_its_share_of_packings():
    class Ctx:
        has_backward = True

        def case(self, lens_q, lens_k=None, *, seed_offset=0, **kw):
            return Case(tuple(lens_q), None if lens_k is None else tuple(lens_k), seed=seed_offset, **kw)

    bases = argument_cases(Ctx())
    jobs = _argument_jobs(Ctx(), bases)
    for opt in OPTIONS:
        calls = [(b, dict(c)[opt.key]) for b, c in jobs if opt.key in dict(c)]
        n = len(bases) if opt.bases is None else min(opt.bases, len(bases))
        assert len(calls) == n * len(opt.probe_values()), opt.key
    Ctx.has_backward = False  # a forward-only kernel gets none of the backward's options
    keys = {k for _, c in _argument_jobs(Ctx(), bases) for k, _ in c}
    assert keys == {o.key for o in OPTIONS if not o.needs_backward and o.probe_values()}


def test_the_layouts_hand_over_the_same_values():
    x = torch.randn(6, 3, 4)
    for layout in option("layout").names:
        y = laid_out_like(x, layout)
        assert torch.equal(y, x)
        plain = y.is_contiguous() and y.storage_offset() == 0
        assert plain == (layout == "contiguous"), layout
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    strided = cu_laid_out(cu, "strided")
    assert torch.equal(strided, cu) and strided.stride() == (2,) and strided.storage_offset() == 1


def test_a_misspelt_option_value_is_refused_not_read_as_another_call():
    """Case.calls validates the value it asks about: "nnoe" is no value of scale_arg, and a check
    asking whether a call passes no scale with it would otherwise silently read "no"."""
    case = Case((16,), heads=2, heads_k=2, causal=True, seed=0, call=(("scale_arg", "none"),))
    assert case.calls("scale_arg", "none") and not case.calls("scale_arg", "value")
    with pytest.raises(ConfigError, match="call option scale_arg must be one of"):
        case.calls("scale_arg", "nnoe")
    with pytest.raises(ConfigError, match="unknown call option 'scale_argument'"):
        case.calls("scale_argument", "none")


def test_a_stage_is_no_string():
    """Stage is a plain enum: its members equal no string (mypy's strict equality flags the comparison),
    and they print as the words the reports write."""
    assert Stage.BACKWARD != "backward" and str(Stage.BACKWARD) == "backward"
    assert {str(s) for s in Stage} == {"forward", "backward", "call"}

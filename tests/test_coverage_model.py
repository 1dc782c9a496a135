"""The coverage model against what the checks do, and each new check against a kernel with its bug.

The model (flamia_verify/properties/coverage.py) declares, for every value of every input dimension,
the checks that exercise it; a standard run with a recording harness must show each declared check
making a call with that value, and every row exercised by at least one check of the standard suite.
Every invariance names checks that exist and run in the standard suite.
"""

from __future__ import annotations

import pytest
import torch
from zoo.convention_bugs import CONVENTION_BUGS
from zoo.correct import sdpa_bf16

from flamia_verify.cli import main
from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.emulation import make_kernel
from flamia_verify.properties import list_checks, run_checks
from flamia_verify.properties.cases import Case, make_inputs
from flamia_verify.properties.checks.interface.arguments import FP16_RANGE
from flamia_verify.properties.coverage import INVARIANCES, MODEL, features, observe
from flamia_verify.properties.harness import KernelHarness

NEW_CHECKS = [
    "interface.arguments",
    "interface.arguments_bitwise",
    "interface.lse",
    "isolation.heads",
    "isolation.heads_bitwise",
    "isolation.layout",
    "isolation.layout_bitwise",
    "isolation.nonfinite",
    "special.nonfinite",
    "special.degenerate",
    "bound.shapes",
]


@pytest.fixture(scope="session")  # session: kept while the worker runs other modules between its tests
def observed():
    return observe(make_kernel(DESIGNS["bf16"]), suite="standard", recipe="bf16")


@pytest.mark.xdist_group("coverage-observed")  # one worker computes the observed standard suite once
def test_every_row_is_exercised_by_its_declared_checks_in_standard(observed):
    standard = {s.name for s in list_checks("standard")}
    for row in MODEL:
        assert set(row.checks) <= standard, f"{row.feature}: {set(row.checks) - standard} not in standard"
        missing = [c for c in row.checks if row.feature not in observed.get(c, set())]
        assert not missing, f"{row.feature} declared for {missing}, which made no call with it"
        assert any(row.feature in f for f in observed.values())


@pytest.mark.xdist_group("coverage-observed")
def test_every_feature_a_call_can_have_is_a_row(observed):
    rows = {r.feature for r in MODEL}
    seen = set().union(*observed.values())
    assert seen <= rows, f"features without a row of the model: {sorted(seen - rows)}"


def test_every_invariance_is_stated_by_a_standard_check():
    standard = {s.name for s in list_checks("standard")}
    for row in INVARIANCES:
        assert row.checks and set(row.checks) <= standard, row


def test_features_read_the_call():
    c = Case(
        (0, 33, 0, 1, 0),
        (0, 40, 0, 1, 0),
        heads=6,
        heads_k=2,
        headdim=96,
        call=(("layout", "fused"), ("max_seqlen_pad", 3)),
    )
    f = features(make_inputs(c))
    assert {"layout=fused", "max_seqlen=above", "gqa_group=3", "headdim=96", "empty_document=start"} <= f
    assert {
        "empty_document=middle",
        "empty_document=end",
        "document_length=1",
        "lengths=lq<lk",
        "document_length=block_edge",
    } <= f
    assert "heads=odd" not in f and "tokens=>=4096" not in f and "requires_grad=all" in f
    assert "tokens=no_query" not in f and "tokens=no_query" in features(make_inputs(Case((0, 0), (3, 0))))
    assert "requires_grad=kv" in features(make_inputs(Case((5,), call=(("grad", "kv"),))))


@pytest.mark.parametrize("layout", ["fused", "transposed", "offset"])
@pytest.mark.parametrize("lk", [None, (50, 3)])
def test_strided_layouts_pass_the_same_values_and_gradients(layout, lk):
    h = KernelHarness(make_kernel(DESIGNS["flamia-mxfp8"]))
    base = Case((40, 7), lk, heads=6, heads_k=2, seed=3)
    a = h.call(make_inputs(base))
    inp = make_inputs(base.with_(call=(("layout", layout),)))
    b = h.call(inp)
    assert not inp.case.call_option("layout") == "contiguous"
    for t in ("out", "dq", "dk", "dv"):
        assert torch.equal(getattr(a, t), getattr(b, t)), t
    assert not h.modifications


def test_strided_cu_seqlens_are_views_of_the_same_values():
    seen = []

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, causal=False):
        seen.append((cu_q.is_contiguous(), cu_k.is_contiguous(), cu_q.storage_offset(), cu_q.tolist(), cu_k.tolist()))
        return make_kernel(DESIGNS["flamia-mxfp8"])(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal
        )

    h = KernelHarness(spy)
    base = Case((40, 0, 7), (50, 3, 7), heads=6, heads_k=2, seed=3)
    a = h.call(make_inputs(base))
    inp = make_inputs(base.with_(call=(("cu_layout", "strided"),)))
    b = h.call(inp)
    assert seen[0] == (True, True, 0, [0, 40, 40, 47], [0, 50, 53, 60])
    assert seen[1] == (False, False, 1, [0, 40, 40, 47], [0, 50, 53, 60])
    assert "cu_seqlens=strided" in features(inp) and "cu_seqlens=contiguous" in features(make_inputs(base))
    for t in ("out", "dq", "dk", "dv"):
        assert torch.equal(getattr(a, t), getattr(b, t)), t
    assert not h.modifications


def test_fp16_range_feature_reads_the_values():
    base = Case((37, 0, 64, 90), heads=6, heads_k=2, dtype="fp16")
    assert "values=fp16_range" not in features(make_inputs(base))
    near = make_inputs(base.with_(overrides=FP16_RANGE))
    assert "values=fp16_range" in features(near)
    assert float(near.v.abs().max()) < 4096 and "values=fp16_range" not in features(
        make_inputs(base.with_(overrides=FP16_RANGE, dtype="bf16"))
    )


@pytest.mark.parametrize("name", sorted(CONVENTION_BUGS))
def test_each_new_check_fails_on_a_kernel_with_its_bug(name):
    kernel = CONVENTION_BUGS[name]
    report = run_checks(kernel, suite="quick", only=list(kernel.catches))
    (res,) = report.checks
    assert res.status == "fail", f"{name}: {res.name} {res.status}: {res.message}"


@pytest.mark.parametrize("kernel", ["flamia-mxfp8", "flamia-nvfp4", "fp8", "bf16", "sdpa"])
def test_correct_kernels_pass_the_new_checks(kernel):
    fn = sdpa_bf16 if kernel == "sdpa" else make_kernel(DESIGNS[kernel])
    recipe = "bf16" if kernel == "sdpa" else DESIGNS[kernel].recipe
    report = run_checks(fn, recipe=recipe, suite="quick", only=NEW_CHECKS)
    bad = [(c.name, c.message) for c in report.checks if c.status not in ("pass", "skip")]
    assert not bad, bad


def test_per_tensor_scaling_fails_head_and_batch_invariance():
    # per-tensor scales move within the fp8 recipe's bound: the layout dependence is a reproducibility
    # finding (its cross-document leak gates through isolation.neighbours)
    report = run_checks(
        "fp8-tensor", suite="quick", only=["isolation.heads", "isolation.layout_bitwise"]
    )  # scales across heads: a value flow
    assert [c.status for c in report.checks] == ["fail", "fail"]


def test_list_coverage_prints_both_tables(capsys):
    assert main(["list", "--coverage"]) == 0
    out = capsys.readouterr().out
    assert "layout" in out and "transposed" in out and "head_independence" in out and "interface.arguments" in out


def test_a_correct_lse_in_the_padded_layout_passes():
    from flamia_verify.reference import attention_forward

    def padded_lse(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, causal=False):
        s = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out = sdpa_bf16(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=s, causal=causal)
        _, lse = attention_forward(
            q.detach().double(), k.detach().double(), v.detach().double(), cu_q, cu_k, softmax_scale=s, causal=causal
        )
        cq = cu_q.tolist()
        padded = torch.full((len(cq) - 1, q.shape[1], max_q), float("inf"))
        for b in range(len(cq) - 1):
            padded[b, :, : cq[b + 1] - cq[b]] = lse[cq[b] : cq[b + 1]].T.float()
        return out, padded

    report = run_checks(padded_lse, recipe="bf16", suite="quick", only=["interface.lse"])
    assert report.checks[0].status == "pass", report.checks[0].message


def test_a_correct_lse_in_the_graph_passes_with_its_gradients():
    from zoo.convention_bugs import differentiable_lse

    def with_lse(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, causal=False):
        s = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out = sdpa_bf16(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=s, causal=causal)
        return out, differentiable_lse(q, k, cu_q, cu_k, s, causal)

    (res,) = run_checks(with_lse, recipe="bf16", suite="quick", only=["interface.lse"]).checks
    assert res.status == "pass" and "of a loss on the log-sum-exp within the error model (4 tensors)" in res.message

"""The pieces under the checks: cases, the comparison engine, the bound model, the rounding-noise
model, the consistency constructions and the harness."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flamia_verify.errors import ConfigError
from flamia_verify.formats import E4M3, mx_fake_quantize
from flamia_verify.kernels import builtin_kernels
from flamia_verify.properties.cases import DISTRIBUTIONS, Case, e4m3_grid, make_inputs
from flamia_verify.properties.checks.consistency.identities import constant_value_inputs, one_hot_inputs
from flamia_verify.properties.compare import compare_bitwise, compare_within
from flamia_verify.properties.harness import KernelCallError, KernelHarness
from flamia_verify.recipes.bounds import OperandModel, attention_bounds
from flamia_verify.recipes.noise_model import predicted_errors
from flamia_verify.recipes.operands import Operand
from flamia_verify.recipes.recipe import get_recipe
from flamia_verify.reference import attention_backward, attention_forward

KERNELS = builtin_kernels()


def _ref(inp):
    c = inp.case
    out, lse = attention_forward(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, softmax_scale=c.scale, causal=c.causal)
    grads = attention_backward(
        inp.do, inp.q, inp.k, inp.v, out, lse, inp.cu_q, inp.cu_k, softmax_scale=c.scale, causal=c.causal
    )
    return out, grads


def _run(kernel, inp):
    q, k, v = (t.clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
    c = inp.case
    out = kernel(q, k, v, inp.cu_q, inp.cu_k, inp.max_q, inp.max_k, softmax_scale=c.scale, causal=c.causal)
    out.backward(inp.do)
    return out.detach(), q.grad, k.grad, v.grad


# ---------------------------------------------------------------------------------------------- cases


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_cases_are_deterministic_and_round_trip_through_json(dist):
    case = Case(
        (5, 0, 33),
        (7, 2, 33),
        heads=4,
        heads_k=2,
        distribution=dist,
        seed=9,
        overrides=(("scale_v", 2.0), ("zero_k", (0, 3))),
    )
    again = Case.from_dict(json.loads(json.dumps(case.to_dict())))
    assert again == case
    a, b = make_inputs(case), make_inputs(again)
    for name in ("q", "k", "v", "do"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.q.shape == (38, 4, 64) and a.k.shape == (42, 2, 64) and a.q.dtype == torch.bfloat16
    assert a.cu_q.tolist() == [0, 5, 5, 38] and a.cu_k.tolist() == [0, 7, 9, 42]
    assert torch.isfinite(a.q).all() and torch.isfinite(a.v).all()
    assert bool((a.k[:3] == 0).all())


def test_case_validation_names_the_problem():
    with pytest.raises(ConfigError, match="must list the same documents"):
        Case((1, 2), (1,))
    with pytest.raises(ConfigError, match="multiple of heads_k"):
        Case((4,), heads=3, heads_k=2)
    with pytest.raises(ConfigError, match="unknown distribution 'cauchy'"):
        Case((4,), distribution="cauchy")
    with pytest.raises(ConfigError, match="unknown case field"):
        Case.from_dict({"lens_q": [1], "colour": "red"})
    with pytest.raises(ConfigError, match="unknown override"):
        make_inputs(Case((4,), overrides=(("warp_q", 1),)))


def test_one_hot_key_case_has_integer_log2_scores_and_one_key_per_dq_channel():
    """bound's one-hot-key case: every key a distinct unit vector within its document, integer
    queries, softmax_scale ln 2 (scores q.k * ln 2 * log2(e) are the integers q.k)."""
    from types import SimpleNamespace

    from flamia_verify.properties.checks.bound.tensors import LN2, one_hot_keys_case

    ctx = SimpleNamespace(
        settings=SimpleNamespace(headdim=64),
        case=lambda lens, **kw: Case(tuple(lens), seed=kw.pop("seed_offset"), **kw),
    )
    case = one_hot_keys_case(ctx)
    assert case.softmax_scale == LN2 and max(case.lens_k) <= 64
    inp = make_inputs(case)
    k, q = inp.k.double(), inp.q.double()
    assert bool((k.abs().sum(-1) == 1).all()) and bool((k.abs().amax(-1) == 1).all())
    cu = inp.cu_k.tolist()
    for a, b in zip(cu[:-1], cu[1:]):  # distinct unit vectors inside a document, per head
        for h in range(k.shape[1]):
            assert len(set(k[a:b, h].argmax(-1).tolist())) == b - a
    assert torch.equal(q, torch.round(q)) and float(q.abs().max()) >= 2
    assert torch.equal(e4m3_grid(inp.v.float()), inp.v.float()) and torch.equal(
        e4m3_grid(inp.do.float()), inp.do.float()
    )


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mx_operand_model_covers_blocks_at_e8m0s_smallest_scale(rule):
    """Blocks with amax below 448 * 2^-127 keep the scale 2^-127: their elements move by up to 2^-137
    whatever the amax. The model's alpha covers that; without it (u and eta alone) it does not for
    elements below 2^-133 (E4M3 subnormals under that scale: fp32 inputs, computed P and dS)."""
    from flamia_verify.formats import ScaleRule

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 256, generator=g, dtype=torch.float64) * 2.0**-136).float()
    xq = mx_fake_quantize(x, axis=-1, block_size=32, rule=ScaleRule[rule.upper()])
    err = (xq.double() - x.double()).abs()
    line = x.abs().double().amax(-1, keepdim=True)
    recipe = "mxfp8" if rule == "rceil" else "mxfp8-floor"
    for model in (
        get_recipe(recipe).bound_model(torch.float32)[Operand.V_HD],
        get_recipe("fp8").bound_model(torch.float32)[Operand.V_HD],
    ):
        rho = model.rho(x.abs().double(), line, float(line.max()))
        assert bool((err <= rho).all()), f"{recipe}: {int((err > rho).sum())} elements outside the model"
        bare = OperandModel(model.u, model.eta, model.eta_g, model.exact_sig)
        assert bool((err > bare.rho(x.abs().double(), line, float(line.max()))).any())


def test_e4m3_grid_values_survive_every_mx_quantization():
    x = torch.randn(4, 96, 64) * 3
    g = e4m3_grid(x)
    assert torch.equal(g.to(torch.bfloat16).float(), g)
    for axis in (0, 1, 2):
        for rule in ("RCEIL", "FLOOR"):
            from flamia_verify.formats import ScaleRule

            q = mx_fake_quantize(g, axis=axis, block_size=32, elem=E4M3, rule=ScaleRule[rule])
            assert torch.equal(q, g), (axis, rule)


# ---------------------------------------------------------------------------------- comparison engine


def test_compare_bitwise_reports_like_numpy_testing():
    a = torch.zeros(4, 2, 3)
    b = a.clone()
    b[2, 1, 0] = 5.0
    b[3, 0, 2] = 2.0**-149  # the smallest subnormal differs from 0 bitwise (while -0.0 reads as +0.0)
    m = compare_bitwise(b, a, what="out", cu_seqlens=[0, 2, 4])
    assert m.mismatched == 2 and m.total == 24
    assert "Mismatched elements: 2 / 24" in m.summary()
    assert m.worst["token"] == 2 and m.worst["head"] == 1 and m.worst["channel"] == 0
    assert m.worst["document"] == 1 and m.worst["position"] == 0
    assert m.worst["actual"] == 5.0 and m.worst["expected"] == 0.0
    assert json.loads(json.dumps(m.to_dict()))["mismatched"] == 2
    nan = a.clone()
    nan[0] = float("nan")
    m = compare_bitwise(nan, a, what="out")
    assert m.nonfinite == 6 and "non-finite" in m.summary()
    assert compare_bitwise(nan, nan.clone()).ok  # the same NaN bits are equal
    region = torch.zeros(4, 1, 1, dtype=torch.bool)
    region[:2] = True
    assert compare_bitwise(b, a, region=region).ok


def test_compare_within_elementwise_tolerance():
    ref = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    x = torch.tensor([1.1, 2.0, float("inf")])
    m = compare_within(x, ref, torch.tensor([0.2, 0.0, 1.0], dtype=torch.float64))
    assert m.mismatched == 1 and m.nonfinite == 1 and m.first[0]["index"] == [2]
    m = compare_within(x[:2], ref[:2], 0.05)
    assert m.mismatched == 1 and m.worst["tolerance"] == 0.05


# ----------------------------------------------------------------------------------------- the bound


CASES = [
    Case((64, 130, 62), heads=2, heads_k=1, seed=1),
    Case((50, 1, 77), (64, 3, 40), distribution="shifted", seed=2),
    Case((33, 96), causal=False, distribution="heavy_tail", seed=3),
    Case((96,), distribution="sink", seed=4),
    Case((96,), distribution="peaked", overrides=(("grid_q", True), ("grid_k", True)), seed=5),
    Case((1, 0, 1, 5, 0, 1, 3), (1, 3, 0, 2, 0, 1, 9), heads=2, heads_k=1, seed=6),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.distribution + str(c.seed))
@pytest.mark.parametrize(
    "name", ["bf16", "fp8", "fp8-tensor", "flamia-mxfp8", "flamia-mxfp8-floor", "flamia-nvfp4", "mxfp8-naive"]
)
def test_bound_is_never_violated_by_kernels_of_the_recipe(name, case):
    """Rigorous: every built-in kernel (leaky ones too: the bound is about formats, not leaks) stays
    inside the bound of the recipe it declares, element by element, forward and backward."""
    inp = make_inputs(case)
    out, grads = _ref(inp)
    kern = KERNELS[name]
    B = attention_bounds(
        inp.q,
        inp.k,
        inp.v,
        inp.do,
        inp.cu_q.tolist(),
        inp.cu_k.tolist(),
        scale=case.scale,
        causal=case.causal,
        model=get_recipe(kern.recipe).bound_model(torch.bfloat16),
        ref_out=out,
        ref_grads=grads,
    )
    got = _run(kern, inp)
    for t, x, r, b in zip(("out", "dq", "dk", "dv"), got, (out,) + grads, (B.out, B.dq, B.dk, B.dv)):
        m = compare_within(x, r, b, what=t)
        assert m.ok, f"{name} {t}: {m.summary()}"


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8"])
def test_the_bound_of_sign_flipped_queries_and_scale_is_the_bound(recipe):
    """-q with -softmax_scale is the same attention (dQ changes sign): the same elementwise bounds."""
    case = Case((40, 0, 25), (33, 0, 25), heads=4, heads_k=2, causal=True, seed=8)
    inp = make_inputs(case)
    model = get_recipe(recipe).bound_model(torch.bfloat16)
    bounds = []
    for sign in (1.0, -1.0):
        q = inp.q * sign
        out, lse = attention_forward(q, inp.k, inp.v, inp.cu_q, inp.cu_k, softmax_scale=sign * case.scale, causal=True)
        grads = attention_backward(
            inp.do, q, inp.k, inp.v, out, lse, inp.cu_q, inp.cu_k, softmax_scale=sign * case.scale, causal=True
        )
        cu_q, cu_k = inp.cu_q.tolist(), inp.cu_k.tolist()
        B = attention_bounds(
            q, inp.k, inp.v, inp.do, cu_q, cu_k, scale=sign * case.scale, causal=True, model=model,
            ref_out=out, ref_grads=grads,
        )  # fmt: skip
        bounds.append(B)
    for t in ("out", "dq", "dk", "dv"):
        a, b = getattr(bounds[0], t), getattr(bounds[1], t)
        assert bool((a > 0).any()) and torch.allclose(a, b, rtol=1e-12, atol=0), t


def test_bound_is_tight_where_rounding_is_the_only_error():
    """With q, k on the exact grid and one-hot attention the bound is a few unit roundoffs of V:
    the kernel uses a sizeable part of it (the bound is not vacuous)."""
    case = Case(
        (96,), distribution="shifted", overrides=(("scale_q", 16.0), ("grid_q", True), ("grid_k", True)), seed=7
    )
    inp = make_inputs(case)
    out, grads = _ref(inp)
    B = attention_bounds(
        inp.q,
        inp.k,
        inp.v,
        None,
        inp.cu_q.tolist(),
        inp.cu_k.tolist(),
        scale=case.scale,
        causal=True,
        model=get_recipe("mxfp8").bound_model(torch.bfloat16),
        ref_out=out,
    )
    rel = (B.out / out.abs().clamp_min(1e-12)).median()
    assert float(rel) < 0.25  # about 3 u = 0.19 of |O|
    x = _run(KERNELS["flamia-mxfp8"], inp)[0]
    tight = ((x.double() - out).abs() / B.out).max()
    assert 0.1 < float(tight) <= 1.0


def test_exact_grid_operands_get_no_rounding_allowance():
    model = OperandModel(2.0**-4, 2.0**-17, 0.0, 1.875)
    x = torch.tensor([1.0, 1.125, 1.1, 1.875, 2.0**-20, 0.0], dtype=torch.float64)
    rho = model.rho(x, torch.tensor(2.0, dtype=torch.float64), 2.0)
    assert rho[0] == 0 and rho[1] == 0 and rho[3] == 0
    assert rho[2] > 0  # 1.1 is not on the grid
    assert rho[4] > 0  # too far below the line maximum to stay a normal E4M3 number
    floor = OperandModel(2.0**-3, 2.0**-17, 0.0, 1.75)
    assert floor.rho(torch.tensor([1.875], dtype=torch.float64), 1.875, 1.875)[0] > 0  # 480 saturates under FLOOR


# ----------------------------------------------------------------------------- the noise model


def test_noise_model_matches_the_first_order_formula_on_gaussian_inputs():
    inp = make_inputs(Case((128,), causal=False, seed=8))
    out, grads = _ref(inp)

    class R:
        pass

    ref = R()
    ref.out, (ref.dq, ref.dk, ref.dv) = out, grads
    pred = predicted_errors(inp, ref, get_recipe("mxfp8").bound_model(torch.bfloat16), draws=4)
    # O: q, k, P, v each at u = 2^-4 -> about sqrt(4/3) u at unit amplification
    assert 0.5 * math.sqrt(4 / 3) * 2**-4 < pred["out"] < 2 * math.sqrt(4 / 3) * 2**-4
    assert all(v > 0 for v in pred.values())
    bf = predicted_errors(inp, ref, get_recipe("bf16").bound_model(torch.bfloat16), draws=4)
    assert bf["out"] < pred["out"] / 8


# ------------------------------------------------------------------------- consistency inputs


def test_constant_value_inputs_make_a_consistent_backward_vanish():
    case = Case((96,), heads=2, heads_k=1, seed=9)
    inp = constant_value_inputs(case, sink=True, device="cpu")
    assert bool((inp.v == inp.v[:1]).all())
    assert bool(((inp.do.double() * inp.v[0].double().repeat_interleave(2, 0)).sum(-1) > 0).all())
    out, dq, dk, dv = _run(KERNELS["flamia-mxfp8"], inp)
    assert torch.equal(out, inp.v[:1].repeat_interleave(2, 1).expand_as(out))
    assert float(dq.abs().max()) == 0.0 and float(dk.abs().max()) == 0.0
    out, dq, _, _ = _run(KERNELS["mxfp8-naive"], inp)
    assert not torch.equal(out, inp.v[:1].repeat_interleave(2, 1).expand_as(out))
    assert float(dq.abs().max()) > 0


def test_one_hot_inputs_expose_the_weights():
    case = Case((40,), heads=2, heads_k=2, seed=10)
    inp = one_hot_inputs(case, "cpu")
    out, _, _, dv = _run(KERNELS["bf16"], inp)
    W = out[:, :, :40].float()
    assert torch.allclose(W.sum(-1), torch.ones(40, 2), atol=2**-6)
    assert torch.all(W.permute(1, 0, 2).triu(1) == 0)  # causal: no weight above the diagonal
    Bw = dv[:, :, :40].float().permute(1, 2, 0)
    assert torch.allclose(Bw, W.permute(1, 0, 2), rtol=2**-6, atol=2**-9)


# ----------------------------------------------------------------------------------- the harness


def test_harness_wraps_kernel_failures_with_the_case():
    def boom(q, *a, **k):
        raise ValueError("bad tile\nsecond line")

    case = Case((4,))
    with pytest.raises(KernelCallError) as info:
        KernelHarness(boom).call(make_inputs(case))
    assert info.value.summary == "ValueError: bad tile" and info.value.case == case
    with pytest.raises(KernelCallError, match="did not return within"):
        import time

        KernelHarness(lambda *a, **k: time.sleep(5), timeout_s=0.2).call(make_inputs(case), backward=False)


def test_bitwise_comparison_reads_negative_zero_as_zero_and_nothing_else():
    """A correct kernel's exact zero may take either sign from data it may ignore (a GEMM's blocking);
    the fuzzer found the bf16 kernel's dQ of a row with no visible key flipping zero signs when later
    queries changed. Every other bit must still match."""
    import torch

    from flamia_verify.properties import fuzz, replay_case
    from flamia_verify.properties.compare import compare_bitwise

    a = torch.tensor([0.0, -0.0, 1.0, float("nan"), 2.0**-149])
    b = torch.tensor([-0.0, 0.0, 1.0, float("nan"), 2.0**-148])
    m = compare_bitwise(a, b)
    assert m.mismatched == 1 and bool(m.mask[4])  # only the subnormal that really differs
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        assert compare_bitwise(a[:4].to(dt), b[:4].to(dt)).mismatched == 0
    # the case the fuzzer shrank to: one 31-query document over a single key, t = 0 (its dQ rows with
    # no visible key flip 30 zero signs when the later query changes: causal fails if -0.0 != +0.0)
    shrunk = {"lens_q": [31], "lens_k": [1], "heads": 1, "property": "causal", "t": 0, "perturbation": "huge"}
    replayed = replay_case("bf16", shrunk)
    assert replayed.status == "pass", replayed.message
    result = fuzz("bf16", examples=100, seed=0)
    assert result.passed, result.message


def test_every_recipe_models_every_operand_once():
    from flamia_verify.kernels.designs import DESIGNS
    from flamia_verify.kernels.triton.config import FUSED_OPERANDS
    from flamia_verify.recipes.recipe import RECIPES

    assert all(tuple(design.quants) == tuple(Operand) for design in DESIGNS.values())
    assert set(FUSED_OPERANDS) == set(Operand) - {Operand.P}
    for recipe in RECIPES.values():
        model = recipe.bound_model(torch.bfloat16)
        assert tuple(model.operands) == tuple(Operand)
        assert model.recipe == recipe.name
    with pytest.raises(ValueError, match="DST"):
        type(model)("partial", {op: OperandModel() for op in Operand if op is not Operand.DST}, u_out=0.0)

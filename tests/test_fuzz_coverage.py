"""What the fuzzer reaches (head_dim 128, long documents, GQA with 1 < heads_k < heads, Lq != Lk,
dK/dV causality), how it treats an output without grad_fn, what --replay prints, and the standard
suite's bounded fuzz pass (isolation.fuzz): reproducible, failing planted causal/isolation bugs,
passing every correct built-in."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample
from zoo import fuzz_bugs as FB
from zoo import kernels as Z
from zoo import targeted as T
from zoo.correct import sdpa_bf16

from flamia_verify.cli import main
from flamia_verify.properties import fuzz, list_checks, replay_case, run_checks
from flamia_verify.properties.cases import Case
from flamia_verify.properties.engine import RunSpec, build_context
from flamia_verify.properties.search import evaluate_example
from flamia_verify.properties.strategies import LONG_MAX_HEADS, attention_cases


def _draw(strategy, n: int, seed: int = 0) -> list:
    seen = []
    cfg = settings(
        max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck), phases=(Phase.generate,)
    )
    try:
        find(strategy, lambda x: seen.append(x) and False, settings=cfg, random=random.Random(seed))
    except NoSuchExample:
        pass
    return seen


def test_cases_reach_headdim_128_long_documents_mid_gqa_and_unequal_kv():
    cases = _draw(attention_cases(max_tokens=256, long_tokens=1024), 300)
    long = [c for c in cases if max(c.lens_q + c.lens_k) > 256]
    assert sum(c.headdim == 128 for c in cases) >= 20  # one draw in 13 (HEADDIMS): 23 expected
    assert len(long) >= 5, "no document longer than 256 tokens drawn"
    assert len(long) <= 0.25 * len(cases), "long documents must stay rare"
    assert all(c.heads <= LONG_MAX_HEADS for c in long), "a long case keeps few heads"
    assert max(max(c.lens_q + c.lens_k) for c in long) <= 1024 + 40
    assert any(1 < c.heads_k < c.heads for c in cases), "GQA with 1 < heads_k < heads"
    assert sum(c.lens_q != c.lens_k for c in cases) >= 30
    assert any(c.lens_q != c.lens_k for c in long) and any(c.causal for c in long)
    # without long_tokens nothing exceeds max_tokens
    short = _draw(attention_cases(max_tokens=200), 100)
    assert all(sum(c.lens_q) <= 200 and sum(c.lens_k) <= 200 for c in short)


def _ctx(kernel):

    return build_context(RunSpec.resolve(kernel))


def test_fuzz_checks_dk_dv_causality():
    """dkdv_leak's out and dQ are causal; only dK, dV of later keys see earlier queries."""
    case = Case((96,), heads=2, heads_k=1, headdim=64, causal=True, seed=3)
    bad = evaluate_example(_ctx(FB.dkdv_leak), case, document=0, t=40, perturbation="huge")
    assert bad is not None and bad.prop == "causal" and bad.detail["tensor"] in ("dk", "dv"), bad
    assert evaluate_example(_ctx("flamia-mxfp8"), case, document=0, t=40, perturbation="huge") is None
    res = fuzz(FB.dkdv_leak, examples=30, seed=0)
    assert not res.passed and res.reproducer["property"] == "causal", res.message
    assert res.report.check("causal.fuzz").status == "fail"
    assert replay_case(FB.dkdv_leak, res.reproducer).status == "fail"
    assert replay_case("flamia-mxfp8", res.reproducer).status == "pass"


def test_an_output_without_grad_fn_is_reported_not_raised():
    empty = Case((0, 0), (0, 0), heads=1, headdim=32, causal=True, seed=0)
    # nothing to differentiate: the zero gradients are right
    assert evaluate_example(_ctx(FB.zeros_when_empty), empty, document=0, t=0, perturbation="huge") is None
    res = fuzz(FB.zeros_when_empty, examples=60, seed=0)
    assert res.passed, res.message
    rep = replay_case(FB.zeros_when_empty, {**empty.to_dict(), "property": "bound"})
    assert rep.status == "pass", rep.message
    # a detached output where the reference has gradients: a finding under interface.fuzz
    lost = Case((3, 2), (0, 2), heads=1, headdim=32, causal=True, seed=0)
    f = evaluate_example(_ctx(FB.detached_when_gap), lost, document=1, t=0, perturbation="huge")
    assert f is not None and f.prop == "crash" and "no grad_fn" in f.message, f
    res = fuzz(FB.detached_when_gap, examples=30, seed=0)
    assert not res.passed and res.reproducer["property"] == "crash", res.message
    assert res.report.check("interface.fuzz").status == "fail"
    assert replay_case(FB.detached_when_gap, res.reproducer).status == "fail"


def test_fuzz_cli_with_an_ungradable_empty_batch_exits_cleanly(capsys, tmp_path):
    spec = "tests/zoo/fuzz_bugs.py:zeros_when_empty"
    case = tmp_path / "case.json"
    case.write_text(
        json.dumps({"lens_q": [0, 0], "lens_k": [0, 0], "heads": 1, "headdim": 32, "causal": True, "property": "bound"})
    )
    assert main(["fuzz", "--kernel", spec, "--replay", str(case), "--out", str(tmp_path / "r"), "--device", "cpu"]) == 0
    assert main(["fuzz", "--kernel", spec, "--examples", "60", "--out", str(tmp_path / "f"), "--device", "cpu"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_replay_prints_its_recipe_and_report_paths(capsys, tmp_path):
    kernel = tmp_path / "k.py"  # a user's kernel that declares no recipe
    kernel.write_text(
        "from flamia_verify.kernels import load_kernel\n_f = load_kernel('flamia-mxfp8').fn\n"
        "def attn(*a, **kw):\n    return _f(*a, **kw)\n"
    )
    case = tmp_path / "case.json"
    case.write_text(
        json.dumps(
            {
                "lens_q": [40],
                "heads": 2,
                "heads_k": 1,
                "headdim": 32,
                "causal": True,
                "property": "causal",
                "t": 5,
                "recipe": "mxfp8",
            }
        )
    )
    out = tmp_path / "out"
    code = main(["fuzz", "--kernel", f"{kernel}:attn", "--replay", str(case), "--out", str(out), "--device", "cpu"])
    text = capsys.readouterr().out
    assert code == 0
    assert "recipe mxfp8" in text and "recipe ?" not in text, text
    for name in ("report.json", "report.md", "report.html", "junit.xml"):
        assert str(out / name) in text, text
    assert json.loads((out / "report.json").read_text())["recipe"] == "mxfp8"
    capsys.readouterr()
    code = main(
        [
            "fuzz",
            "--kernel",
            f"{kernel}:attn",
            "--recipe",
            "bf16",
            "--replay",
            str(case),
            "--out",
            str(out),
            "--device",
            "cpu",
        ]
    )
    assert "recipe bf16" in capsys.readouterr().out  # --recipe overrides the reproducer's


# -- isolation.fuzz: the bounded fuzz pass of the standard suite ------------------------------


def test_fuzz_pass_runs_in_standard_and_full_not_quick():
    assert "isolation.fuzz" in {s.name for s in list_checks("standard")}
    assert "isolation.fuzz" in {s.name for s in list_checks("full")}
    assert "isolation.fuzz" not in {s.name for s in list_checks("quick")}


def _pass(kernel, seed=0):
    return run_checks(kernel, suite="standard", only=["isolation.fuzz"], seed=seed).check("isolation.fuzz")


_PLANTED = {
    "packed_tiles_skip_head": T.packed_tiles_skip_head,
    "v_scale_leak": Z.v_scale_leak,
    "backward_leak": Z.backward_leak,
    "document_leak": Z.document_leak,
    "dkdv_leak": FB.dkdv_leak,
}


@pytest.mark.parametrize("name", sorted(_PLANTED))
def test_fuzz_pass_fails_planted_causal_and_isolation_bugs(name):
    kernel = _PLANTED[name]
    res = _pass(kernel)
    assert res.status == "fail", res.message
    wc = res.worst_case
    assert wc["property"] in ("causal", "isolation", "bound", "finite", "crash") and wc["check"].endswith(".fuzz")
    assert wc["search"]["seed"] == 0 and wc["search"]["examples"] == 16 and wc["lens_q"] is not None
    assert res.metrics["failing_examples"] >= 1 and wc["property"] in res.message
    # the worst case is a reproducer: it replays to the same failure, and passes on the correct kernel
    case = json.loads(json.dumps(wc))
    assert replay_case(kernel, case).status == "fail"
    assert replay_case("flamia-mxfp8" if kernel.recipe == "mxfp8" else "bf16", case).status == "pass"


@pytest.mark.parametrize(
    "kernel",
    ["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4", sdpa_bf16],
    ids=lambda k: k if isinstance(k, str) else k.__name__,
)
def test_fuzz_pass_passes_correct_kernels(kernel):
    res = _pass(kernel)
    assert res.status == "pass", res.message
    assert res.metrics["failing_examples"] == 0 and res.metrics["examples_requested"] == 16
    assert res.metrics["examples_drawn"] >= 16 and res.metrics["examples_shrinking"] == 0


def test_standard_only_checks_have_planted_bugs_here():
    """The quick-suite audit cannot select standard-only checks; each has its kernel in FB.STANDARD,
    and the kernels of FB.STANDARD are among those asserted to fail above."""
    standard_only = {s.name for s in list_checks("full")} - {s.name for s in list_checks("quick")}
    assert standard_only <= set(FB.STANDARD), sorted(standard_only - set(FB.STANDARD))
    assert all(k in _PLANTED.values() for k in FB.STANDARD.values())


def test_fuzz_pass_is_reproducible_from_the_seed():
    a, b = _pass(Z.document_leak, seed=5), _pass(Z.document_leak, seed=5)
    assert a.status == b.status == "fail"
    assert a.worst_case == b.worst_case and a.metrics == b.metrics
    ok1, ok2 = _pass("bf16", seed=7), _pass("bf16", seed=7)
    assert ok1.metrics == ok2.metrics and ok1.message == ok2.message


def test_fuzz_fails_a_kernel_whose_backward_raises_unless_declared_forward_only(tmp_path, capsys):
    """The fuzzer used to fall back to the forward silently when the backward raised: a broken kernel
    then passed. Undeclared, it fails interface.backward (exit 1); declared, the report says that
    gradients were not checked."""
    from zoo.gate_bugs import backward_raises

    res = fuzz(backward_raises, recipe="mxfp8", examples=3, seed=0)
    assert not res.passed
    check = res.report.check("interface.backward")
    assert check.status == "fail" and "misaligned address" in check.message and "--forward-only" in check.message
    declared = fuzz(backward_raises, recipe="mxfp8", examples=3, seed=0, forward_only=True)
    assert declared.passed and declared.report.check("interface.backward").status == "skip"
    assert "gradients were not checked" in declared.report.check("interface.backward").message
    spec = "tests/zoo/gate_bugs.py:backward_raises"
    assert main(["fuzz", "--kernel", spec, "--recipe", "mxfp8", "--examples", "3", "--out", str(tmp_path / "a")]) == 1
    assert (
        main(
            [
                "fuzz",
                "--kernel",
                spec,
                "--recipe",
                "mxfp8",
                "--examples",
                "3",
                "--forward-only",
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )


def test_every_fuzz_property_that_failed_on_some_example_reads_fail():
    """The search shrinks only its first failure; a property that failed on other examples used to
    read PASS ("no failure") beside failing_examples > 0."""
    # seed 3: a search in which two properties fail (causal 10 examples, isolation 2 while shrinking)
    res = fuzz("mxfp8-naive", examples=5, seed=3)
    assert not res.passed
    for check in res.report.checks:
        if "failing_examples" in check.metrics:
            failed = check.metrics["failing_examples"] > 0 or bool(check.worst_case)
            assert (check.status == "fail") == failed, (check.name, check.status, check.metrics, check.message)
            if failed and not check.worst_case:
                assert "not shrunk" in check.message
    assert sum(c.status == "fail" for c in res.report.checks) >= 2  # more than the shrunk property


def test_cases_draw_the_whole_model_of_shapes_and_calls():
    """The fuzzer's cases reach every GQA group, head_dim and way of passing the tensors of the
    coverage model, and shrink toward contiguous tensors with the scale passed."""
    from flamia_verify.properties.strategies import GQA_RATIOS, HEADDIMS

    # 500: 13 head dims and 10 value distributions to reach (400 drew no group of 7 once they grew)
    cases = _draw(attention_cases(max_tokens=256, long_tokens=1024), 500)
    assert {c.heads // c.heads_k for c in cases} == set(GQA_RATIOS)
    assert {c.headdim for c in cases} == set(HEADDIMS)
    layouts = {c.call_option("layout") for c in cases}
    assert layouts == {"contiguous", "fused", "transposed", "offset"}
    assert any(c.call_option("scale_arg") == "none" for c in cases)
    assert any(c.call_option("max_seqlen_pad") for c in cases)
    assert all(c.softmax_scale == c.headdim**-0.5 for c in cases if c.call_option("scale_arg") == "none")

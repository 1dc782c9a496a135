"""The value checks see realistic shapes: unequal query and key lengths per document, GQA with
1 < heads_k < heads, rows of 512 keys, several key tiles, and the dS format itself.

Every planted bug of ``zoo/realistic_bugs.py`` must fail the quick suite in the checks it names
(and pass the checks its bug cannot reach); each is bitwise the correct kernel on the shapes the
checks used before (so only the widened cases can catch it); and the correct kernels (built-ins
bf16, fp8, flamia-mxfp8, flamia-nvfp4 and torch SDPA from zoo/correct.py) pass the widened checks
over two seeds.
"""

from __future__ import annotations

import pytest
import torch
from zoo import realistic_bugs as R
from zoo.correct import sdpa_bf16
from zoo.verdicts import assert_caught_and_quiet

from flamia_verify.kernels.designs import FLAMIA_MXFP8
from flamia_verify.kernels.emulation import make_kernel
from flamia_verify.properties import run_checks
from flamia_verify.properties.cases import Case, make_inputs
from flamia_verify.properties.harness import KernelHarness


@pytest.mark.parametrize("name", sorted(R.REALISTIC))
def test_realistic_bug_fails_the_quick_suite_where_it_should(name):
    kernel = R.REALISTIC[name]
    report = run_checks(kernel, suite="quick", only=list(kernel.catches + kernel.quiet))
    assert_caught_and_quiet(name, kernel, report)


# Each bug is invisible on the shapes the checks used before: the kernel is bitwise the correct one
# (cu_seqlens_q == cu_seqlens_k, heads_k = 1, rows of at most 130 keys: the old quick base packings).
_OLD_SHAPES = [
    Case((64, 130, 62), heads=2, heads_k=1, seed=5),
    Case((45, 13, 30), heads=2, heads_k=1, seed=6),
    Case((96,), heads=2, heads_k=2, causal=False, seed=7),
]


# consistency.weights read documents of at most 64 keys before
_OLD_WEIGHT_SHAPES = [
    Case((64,), heads=2, heads_k=2, seed=5),
    Case((40,), (64,), heads=2, heads_k=2, seed=6),
    Case((32, 64), heads=2, heads_k=2, causal=False, seed=7),
]


@pytest.mark.parametrize("name", sorted(set(R.REALISTIC) - {"ds_e5m2", "dst_e5m2"}))
def test_realistic_bug_is_bitwise_correct_on_the_old_shapes(name):
    bug, good = KernelHarness(R.REALISTIC[name]), KernelHarness(make_kernel(FLAMIA_MXFP8))
    for case in _OLD_WEIGHT_SHAPES if name.startswith("bwd_tile") else _OLD_SHAPES:
        inp = make_inputs(case)
        a, b = bug.call(inp, backward=True), good.call(inp, backward=True)
        for t in ("out", "dq", "dk", "dv"):
            assert torch.equal(getattr(a, t), getattr(b, t)), f"{name} differs on {case.describe()} ({t})"


def test_e5m2_shows_in_the_share_of_ds_entries_above_the_unit_roundoff():
    """On the exact-weight cases the share of dS (dS^T) entries whose relative error exceeds E4M3's
    unit roundoff 2^-4 separates the formats: E5M2 rounds about 1 - 1/(2 ln 2) = 28 % of log-uniform
    values by more than 2^-4 (its own bound is 2^-3); a correct E4M3 kernel has under 1 % there
    (rounding of D and the output)."""
    for kernel, expect in (
        (R.ds_e5m2, ("high", "high")),
        (R.dst_e5m2, ("low", "high")),
        ("flamia-mxfp8", ("low", "low")),
    ):
        res = run_checks(kernel, suite="quick", only=["bound.grad"]).check("bound.grad")
        for key, level in zip(("share_above_u_ds", "share_above_u_dst"), expect):
            share = res.metrics[key]
            assert (share > 0.2) if level == "high" else (share < 0.02), f"{kernel}: {key} = {share}"


_CORRECT = {
    "bf16": "bf16",
    "fp8": "fp8",
    "flamia-mxfp8": "flamia-mxfp8",
    "flamia-nvfp4": "flamia-nvfp4",
    "sdpa_bf16": sdpa_bf16,
}
_WIDENED = sorted({c for k in R.REALISTIC.values() for c in k.catches} | {"isolation.nan"})


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(_CORRECT))
def test_correct_kernels_pass_the_widened_checks(name, seed):
    report = run_checks(_CORRECT[name], suite="quick", only=_WIDENED, seed=seed)
    loud = [f"{c.name}: {c.status}: {c.message}" for c in report.checks if c.status != "pass"]
    assert not loud, f"{name} (seed {seed}):\n" + "\n".join(loud)
    assert {c.name for c in report.checks} >= set(_WIDENED) - {"error"}

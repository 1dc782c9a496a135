"""The causal family sees every position class a block-scaled kernel can get wrong.

The planted bugs of ``zoo/causal_bugs.py`` each leak (or hide) one position class: a diagonal
fallback off by one or two positions on one of the four sequence-blocked GEMM operands, a top-left
mask for one sign of Lk - Lq, a head_dim-128 code path without the fallback, a backward mask one key
too far. The quick suite's causal checks must fail on each, pass on every correct kernel, and the
former quick settings (five fixed positions of one square document at head_dim 64) are shown to
miss the position-class bugs, so the widening is what catches them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from zoo.causal_bugs import CAUSAL_BUGS
from zoo.correct import sdpa_bf16

from flamia_verify import settings as S
from flamia_verify.properties import run_checks
from flamia_verify.properties.checks.causal import masking as causal_checks
from flamia_verify.properties.checks.causal.masking import _causal_cases, _diagonal_rows, _positions
from flamia_verify.properties.perturb import doc_bounds as _doc_bounds

CAUSAL = ["causal.forward", "causal.dq", "causal.dk_dv", "causal.nan", "causal.diagonal"]

#: caught by the former quick settings too (any t shows a backward mask one key too far)
SEEN_BEFORE = {"backward_mask_plus1"}


@pytest.mark.parametrize("name", sorted(CAUSAL_BUGS))
def test_position_class_bug_fails_the_quick_causal_checks(name):
    kernel = CAUSAL_BUGS[name]
    report = run_checks(kernel, suite="quick", only=list(kernel.catches))
    for check in kernel.catches:
        res = report.check(check)
        assert res.status == "fail", f"{name} ({kernel.where}): {check} says {res.status}: {res.message}"
        assert res.message and res.worst_case, f"{name}: {check} failed without saying why or where"


@pytest.mark.parametrize("name", sorted(set(CAUSAL_BUGS) - SEEN_BEFORE))
def test_the_former_quick_settings_miss_it(name, monkeypatch):
    """One square document at head_dim 64, t in 0, 5, 31, 40, 63, and the four checks the family had:
    none of these bugs shows."""
    narrow = replace(
        S._BY_NAME["quick"],
        causal_neighbours=False,
        causal_headdims=(64,),
        causal_residues=(),
        causal_positions=(0, 5, 31, 40, 63),
    )
    monkeypatch.setitem(S._BY_NAME, "quick", narrow)
    monkeypatch.setattr(causal_checks, "_long_positions", lambda ctx, case: [])  # nor the long document
    monkeypatch.setattr(causal_checks, "DECODE_NEIGHBOUR", 0)  # nor a neighbour of another offset
    report = run_checks(CAUSAL_BUGS[name], suite="quick", only=[c for c in CAUSAL if c != "causal.diagonal"])
    loud = [f"{c.name}: {c.message}" for c in report.checks if c.status != "pass"]
    assert not loud, f"{name} was already caught by the former settings: {loud}"


@pytest.mark.parametrize("kernel", ["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4", "sdpa_bf16"])
def test_correct_kernels_pass_the_causal_family(kernel):
    fn = sdpa_bf16 if kernel == "sdpa_bf16" else kernel  # built-ins by name, through the registry
    report = run_checks(fn, suite="quick", only=["causal"])
    names = {c.name for c in report.checks}
    assert set(CAUSAL) <= names, sorted(names)
    loud = [f"{c.name}: {c.status}: {c.message}" for c in report.checks if c.status != "pass"]
    assert not loud, f"{kernel}:\n" + "\n".join(loud)


# ---------------------------------------------------------------------------------------------
# what the quick suite probes (no kernel runs)
# ---------------------------------------------------------------------------------------------


class _Ctx:
    """The two things _causal_cases and _positions read from a check context."""

    def __init__(self, suite):
        from flamia_verify.properties.context import CheckContext

        self.settings = S.suite_settings(suite)
        self.seed = 0
        self.case = lambda *a, **kw: CheckContext.case(self, *a, **kw)
        self.dtype_str = "bf16"


def _geometry(suite="quick"):
    ctx = _Ctx(suite)
    out = []
    for case, b in _causal_cases(ctx):
        q0, q1, k0, k1 = _doc_bounds(case, b)
        out.append((ctx, case, b, q0, q1 - q0, k0, k1 - k0))
    return out


def test_quick_covers_both_signs_of_the_offset_a_packed_document_and_every_base_head_dim():
    geo = _geometry("quick")
    offsets = {lk - lq for _, _, _, _, lq, _, lk in geo}
    assert {0, 17, -17} <= offsets
    assert any(q0 % 32 and k0 % 32 for _, _, _, q0, _, k0, _ in geo), "no document starts off the 32-grid"
    assert {case.headdim for _, case, *_ in geo} == {64, 128}
    assert {case.headdim for _, case, *_ in _geometry("full")} == {64, 128, 256}
    assert any(case.heads_k < case.heads for _, case, *_ in geo), "no GQA document"


def _boundaries(length: int, start: int) -> set[int]:
    """Block boundaries of a document axis: multiples of 32 from its start, its end, and multiples
    of 32 of the packed axis it sits in."""
    return set(range(32, length, 32)) | {length} | {m - start for m in range(32, start + length, 32) if m > start}


@pytest.mark.parametrize("direction", ["future", "past"])
def test_every_residue_around_every_block_boundary_is_probed(direction):
    for ctx, case, b, q0, lq, k0, lk in _geometry("quick"):
        off = lk - lq
        probed = _positions(ctx, case, b, direction)
        ts = {t for t, _ in probed}
        lo, hi = (0, lq - 2) if direction == "future" else (1, lq - 1)
        want = {n + r for n in _boundaries(lq, q0) for r in (-2, -1, 0, 1)}  # the query grid: t
        want |= {n + r - off for n in _boundaries(lk, k0) for r in (-2, -1, 0, 1)}  # the key grid: t + offset
        want |= {t for t in (0, 5, 40)}  # t = 0 and inside blocks
        want = {t for t in want if lo <= t <= hi}
        assert want <= ts, f"{case.describe()} ({direction}): missing {sorted(want - ts)}"
        assert all(kinds == ("huge", "tiny") for t, kinds in probed if t in (0, 5, 40)), probed
        if off < 0:
            assert {-off - 1, -off} <= ts, "the last row without a key and the first with one"


def test_the_diagonal_is_probed_in_every_document():
    for ctx, case, b, q0, lq, k0, lk in _geometry("quick"):
        rows = _diagonal_rows(ctx, case, b)
        assert rows and all(0 <= t + lk - lq < lk for t in rows), case.describe()

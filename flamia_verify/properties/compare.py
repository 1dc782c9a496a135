"""One comparison engine with thin front ends, in the manner of numpy.testing's assert_array_compare.

Every comparison returns a :class:`Mismatch`: how many elements were compared and how many break
the rule, the non-finite elements, the first few offending positions with both values, the worst
position, and the largest absolute and relative differences among the violations (relative only
where the reference is not 0; the violations at a zero reference are counted apart, with their
largest absolute difference). Positions are named (token, head, channel) and, when the packing is
known, (document, position in document).

Front ends:

* :func:`compare_bitwise` -- bit patterns must match (so +0 and -0 differ, and a NaN that appears
  where there was a number is a mismatch; the same NaN bits on both sides are equal);
* :func:`compare_within` -- ``|actual - expected| <= tolerance`` elementwise (a tensor or a number);
  a non-finite actual value next to a finite expected one always violates;
* :func:`compare_beyond_noise` -- bitwise for a kernel that repeats itself bit for bit; for one that
  does not (a backward that accumulates with atomics), an element counts as changed when it moved by
  more than :data:`NOISE_FACTOR` times the largest difference between two runs of the same inputs
  (:func:`run_to_run_noise`), or changed between finite and not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flamia_verify.results import json_number

__all__ = [
    "Mismatch",
    "compare_bitwise",
    "compare_within",
    "compare_beyond_noise",
    "run_to_run_noise",
    "noise_tolerance",
    "last_unit",
    "ulp",
    "locate",
    "FIRST_FEW",
    "NOISE_FACTOR",
]

#: offending positions listed in full (numpy.testing prints a few; so do we)
FIRST_FEW = 5

#: how many times a kernel's own run-to-run difference a perturbation may move an element of a tensor
#: that is not bitwise repeatable before the move counts as information flow: two runs sample the
#: spread of the summation orders (measured: an atomics-style dK/dV of 16-query tiles in a random
#: order differs by at most 1 bf16 unit in the last place between two calls, by 2 units in other
#: pairs), and a leak through a shared scale or a masked maximum moves elements by a rounding of the
#: recipe's format, 2^-4 relative for FP8 and more: orders of magnitude above it
NOISE_FACTOR = 4.0

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns for bitwise comparison, with -0.0 read as +0.0.

    The sign of an exact zero carries no value, and a correct kernel's zero can take either sign
    from data it is allowed to ignore: a row that sees no key gets dQ = 0 * K through a GEMM whose
    blocking decides which zeros come out negative (measured: the bf16 emulation's dQ row of a query
    with no visible key flips the sign of half its zeros when later queries change). Every other bit
    pattern, NaN payloads included, must match.
    """
    t = t.detach().contiguous()
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = torch.where(t == 0, torch.zeros_like(t), t)
    view = _INT_VIEW.get(t.dtype)
    return t.view(view) if view is not None else t


def locate(flat_index: int, shape: tuple[int, ...], cu_seqlens: list[int] | None = None) -> dict[str, Any]:
    """Named coordinates of a flat index into a (tokens, heads, channels) tensor."""
    idx = []
    rem = int(flat_index)
    for size in reversed(shape):
        idx.append(rem % size if size else 0)
        rem = rem // size if size else 0
    idx.reverse()
    where: dict[str, Any] = {"index": idx}
    if len(shape) == 3:
        where.update(token=idx[0], head=idx[1], channel=idx[2])
        if cu_seqlens is not None:
            for b in range(len(cu_seqlens) - 1):
                if cu_seqlens[b] <= idx[0] < cu_seqlens[b + 1]:
                    where.update(document=b, position=idx[0] - cu_seqlens[b])
                    break
    return where


@dataclass
class Mismatch:
    """What a comparison found (see the module docstring)."""

    what: str
    rule: str
    total: int
    mismatched: int = 0
    nonfinite: int = 0  # positions where actual is NaN/Inf and expected is finite
    max_abs_diff: float = 0.0
    #: among the violations where the reference is not 0; None when it is 0 at every one
    max_rel_diff: float | None = 0.0
    #: violations where the reference is 0 (no relative difference there), and their largest |actual|
    zero_reference: int = 0
    max_abs_diff_zero_reference: float = 0.0
    first: list[dict] = field(default_factory=list)
    worst: dict | None = None
    mask: torch.Tensor | None = None  # bool, True where the rule breaks (same shape as the inputs)
    #: what the expected side is, in the summary's words: the float64 reference, or the kernel's own
    #: base run (bitwise comparisons: the unperturbed run, the plain call, the first of repeated runs)
    against: str = "the reference"

    @property
    def ok(self) -> bool:
        return self.mismatched == 0

    @property
    def fraction(self) -> float:
        return self.mismatched / self.total if self.total else 0.0

    def summary(self) -> str:
        if self.ok:
            return f"{self.what}: {self.total} elements {self.rule}"
        text = (
            f"{self.what}: Mismatched elements: {self.mismatched} / {self.total} ({100 * self.fraction:.3g}%)"
            f", max abs diff {self.max_abs_diff:.4g}"
        )
        if self.max_rel_diff is not None:
            text += f", max rel diff {self.max_rel_diff:.4g}"
        if self.zero_reference == self.mismatched:
            text += f" ({self.against} is 0 at every mismatch: no relative difference)"
        elif self.zero_reference:
            text += (
                f" ({self.zero_reference} where {self.against} is 0: max abs diff there "
                f"{self.max_abs_diff_zero_reference:.4g})"
            )
        if self.nonfinite:
            text += f", {self.nonfinite} non-finite where {self.against} is finite"
        if self.worst is not None:
            w = self.worst
            pos = f"token {w.get('token')}, head {w.get('head')}, channel {w.get('channel')}"
            if "document" in w:
                pos += f" (document {w['document']}, position {w['position']})"
            text += f"; worst at {pos}: {w['actual']!r} here vs {w['expected']!r} in {self.against}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "rule": self.rule,
            "mismatched": self.mismatched,
            "total": self.total,
            "mismatch_percent": 100 * self.fraction,
            "nonfinite": self.nonfinite,
            "max_abs_diff": json_number(self.max_abs_diff),
            "max_rel_diff": None if self.max_rel_diff is None else json_number(self.max_rel_diff),
            "zero_reference": self.zero_reference,
            "max_abs_diff_zero_reference": json_number(self.max_abs_diff_zero_reference),
            "first": self.first,
            "worst": self.worst,
        }


def _finish(
    what, rule, actual, expected, bad, cu, extra: torch.Tensor | None = None, against: str = "the reference"
) -> Mismatch:
    total = actual.numel()
    n_bad = int(bad.sum())
    m = Mismatch(what, rule, total, n_bad, mask=bad, against=against)
    if n_bad == 0:
        return m
    a64 = actual.detach().double()
    e64 = expected.detach().double()
    diff = (a64 - e64).abs()
    nonfinite = bad & ~torch.isfinite(a64) & torch.isfinite(e64)
    m.nonfinite = int(nonfinite.sum())
    d_bad = torch.where(bad, diff, torch.zeros_like(diff))
    d_bad = torch.nan_to_num(d_bad, nan=float("inf"))
    m.max_abs_diff = float(d_bad.max())
    # relative to a reference of 0 there is no relative difference (dividing by the smallest normal
    # printed 1e+307): those violations are counted, with their absolute difference, apart
    at_zero = bad & (e64 == 0)
    m.zero_reference = int(at_zero.sum())
    if m.zero_reference:
        m.max_abs_diff_zero_reference = float(torch.where(at_zero, d_bad, torch.zeros_like(d_bad)).max())
    relative = bad & ~at_zero
    if m.zero_reference == n_bad:
        m.max_rel_diff = None
    else:
        rel = d_bad / torch.where(relative, e64.abs(), torch.ones_like(e64))
        m.max_rel_diff = float(torch.where(relative, rel, torch.zeros_like(rel)).max())
    flat_bad = torch.nonzero(bad.reshape(-1)).flatten()
    shape = tuple(actual.shape)
    for i in flat_bad[:FIRST_FEW].tolist():
        entry = locate(i, shape, cu)
        entry.update(actual=json_number(a64.reshape(-1)[i]), expected=json_number(e64.reshape(-1)[i]))
        if extra is not None:
            entry["tolerance"] = json_number(extra.reshape(-1)[i])
        m.first.append(entry)
    score = d_bad if extra is None else d_bad / extra.clamp_min(torch.finfo(torch.float64).tiny)
    worst_i = int(torch.argmax(torch.nan_to_num(score.reshape(-1), nan=float("inf"))))
    w = locate(worst_i, shape, cu)
    w.update(
        actual=json_number(a64.reshape(-1)[worst_i]),
        expected=json_number(e64.reshape(-1)[worst_i]),
        abs_diff=json_number(diff.reshape(-1)[worst_i]),
    )
    if extra is not None:
        w["tolerance"] = json_number(extra.reshape(-1)[worst_i])
    m.worst = w
    return m


def compare_bitwise(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str = "tensor",
    region: torch.Tensor | None = None,
    cu_seqlens: list[int] | None = None,
    against: str = "the base run",
) -> Mismatch:
    """Bit patterns must match wherever ``region`` (bool, broadcastable) is True (everywhere if None);
    ``against`` names the expected side in the summary (a run of the kernel itself, by default)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        m = Mismatch(
            what, "bitwise equal", max(actual.numel(), expected.numel()), max(actual.numel(), 1), against=against
        )
        m.first = [
            {"shape_or_dtype": f"{tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} {expected.dtype}"}
        ]
        return m
    bad = _bits(actual) != _bits(expected)
    if region is not None:
        bad = bad & region.to(bad.device)
    m = _finish(what, "bitwise equal", actual, expected, bad, cu_seqlens, against=against)
    if region is not None:
        m.total = int(region.expand_as(bad).sum())
    return m


def compare_within(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerance: torch.Tensor | float,
    *,
    what: str = "tensor",
    rule: str = "within tolerance",
    cu_seqlens: list[int] | None = None,
    against: str = "the reference",
) -> Mismatch:
    """``|actual - expected| <= tolerance`` elementwise; non-finite actual next to finite expected fails."""
    a64, e64 = actual.detach().double(), expected.detach().double().to(actual.device)
    tol = tolerance if isinstance(tolerance, torch.Tensor) else torch.full_like(e64, float(tolerance))
    tol = tol.double().to(a64.device).expand_as(e64)
    diff = (a64 - e64).abs()
    bad = ~(diff <= tol)  # NaN differences violate
    both_nan = torch.isnan(a64) & torch.isnan(e64)
    bad = bad & ~both_nan
    return _finish(what, rule, a64, e64, bad, cu_seqlens, extra=tol, against=against)


def last_unit(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of every element of ``x`` in its own dtype, at most (eps |x|), in
    float64."""
    eps = torch.finfo(x.dtype).eps if x.is_floating_point() else 0.0
    return x.detach().double().abs() * eps


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at every element's magnitude (one unit in the last place: 2^-7 at 1
    in bf16), the subnormal spacing at 0 and below the smallest normal, in float64."""
    fi = torch.finfo(x.dtype)
    a = x.detach().double().abs()
    _, e = torch.frexp(a)
    spacing = torch.ldexp(torch.full_like(a, fi.eps), e - 1)
    smallest = fi.smallest_normal * fi.eps
    return torch.where(a < fi.smallest_normal, torch.full_like(a, smallest), spacing.clamp_min(smallest))


def run_to_run_noise(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """For each tensor of two runs of the same inputs: None where the two agree bit for bit (a
    repeatable kernel), else the largest |difference| between their finite elements beyond one unit
    in the last place (a sum rounded the other way in its last step moves an element by one unit; a
    sum taken in another order can move a small result of large terms by more, in absolute terms the
    size of the terms' rounding)."""
    noise: dict[str, float | None] = {}
    for name, a in first.items():
        b = second.get(name)
        if b is None or a.shape != b.shape:
            continue
        if bool((_bits(a) == _bits(b)).all()):
            noise[name] = None
            continue
        a64, b64 = a.detach().double(), b.detach().double().to(a.device)
        finite = torch.isfinite(a64) & torch.isfinite(b64)
        excess = ((a64 - b64).abs() - ulp(a)).clamp_min(0.0)
        excess = torch.where(finite, excess, torch.zeros_like(excess))
        noise[name] = float(excess.max()) if excess.numel() else 0.0
    return noise


def noise_tolerance(expected: torch.Tensor, noise: float | None) -> torch.Tensor | None:
    """What a perturbation may move each element of a tensor whose run-to-run ``noise`` is given (see
    :func:`run_to_run_noise`): None (bitwise) for a repeatable tensor, else two units in the last place
    (each of the two runs may have rounded its last step the other way) plus :data:`NOISE_FACTOR`
    times the noise beyond one unit."""
    if noise is None:
        return None
    return 2 * ulp(expected) + NOISE_FACTOR * noise


def compare_beyond_noise(
    actual: torch.Tensor,
    expected: torch.Tensor,
    noise: float | None,
    *,
    what: str = "tensor",
    region: torch.Tensor | None = None,
    cu_seqlens: list[int] | None = None,
    against: str = "the unperturbed run",
) -> Mismatch:
    """:func:`compare_bitwise` where ``noise`` is None (a repeatable kernel); otherwise an element
    counts when its bits differ and it moved by more than :func:`noise_tolerance`, or is finite on
    one side only (NaN on both sides is equal)."""
    tol = noise_tolerance(expected, noise)
    if tol is None or actual.shape != expected.shape or actual.dtype != expected.dtype:
        return compare_bitwise(actual, expected, what=what, region=region, cu_seqlens=cu_seqlens, against=against)
    a64, e64 = actual.detach().double(), expected.detach().double().to(actual.device)
    tol = tol.to(a64.device)
    finite = torch.isfinite(a64) & torch.isfinite(e64)
    moved = torch.where(finite, (a64 - e64).abs() > tol, torch.isfinite(a64) != torch.isfinite(e64))
    bad = (_bits(actual) != _bits(expected)) & moved
    if region is not None:
        bad = bad & region.to(bad.device)
    rule = (
        f"bitwise equal, or within two units in the last place + {NOISE_FACTOR:g} x the kernel's run-to-run "
        f"difference beyond it ({noise:.3g}): the kernel does not repeat itself bitwise"
    )
    m = _finish(what, rule, actual, expected, bad, cu_seqlens, extra=tol, against=against)
    if region is not None:
        m.total = int(region.expand_as(bad).sum())
    return m

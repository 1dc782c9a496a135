"""What a running check sees: the kernel, its recipe, the suite, and caches shared between checks.

Checks ask the context for cases, inputs, kernel runs, the float64 reference and the BF16
baseline; each is computed once per case and shared (error, bound, bias and the gradient/forward
ratio all read the same base runs). ``ctx.progress(f)`` reports how far the current check is.
``ctx.result`` and ``ctx.skip`` build the check's result; a pass/fail verdict from its metrics,
thresholds and findings is :func:`flamia_verify.properties.checks.common.verdict.verdict`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.emulation import make_kernel
from flamia_verify.properties.case_cache import CASE_CACHE
from flamia_verify.properties.cases import Case, Inputs, make_inputs
from flamia_verify.properties.harness import BackwardSupport, KernelHarness, KernelOutputs
from flamia_verify.properties.registry import CheckSpec
from flamia_verify.recipes import Recipe
from flamia_verify.recipes.bounds import RecipeBoundModel
from flamia_verify.reference import attention_backward, attention_forward
from flamia_verify.results import CheckResult
from flamia_verify.settings import Packing, SuiteSettings, dtype_name

__all__ = ["CheckContext", "RefOutputs"]


@dataclass
class RefOutputs:
    """Float64 reference results of one case (lse in natural-log units)."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"out": self.out, "dq": self.dq, "dk": self.dk, "dv": self.dv}


@dataclass
class CheckContext:
    kernel_name: str
    recipe: Recipe
    harness: KernelHarness
    settings: SuiteSettings
    seed: int
    device: str
    dtype: torch.dtype
    backward: BackwardSupport
    thresholds: dict[str, dict]
    options: dict[str, dict]
    spec: CheckSpec | None = None
    on_fraction: Callable[[float], None] | None = None
    _inputs: dict = field(default_factory=dict)
    _runs: dict = field(default_factory=dict)
    _refs: dict = field(default_factory=dict)
    _baseline: dict = field(default_factory=dict)
    _baseline_fn: Any = None
    _memo: dict = field(default_factory=dict)
    #: the captured calls of a run with a capture (cases.captured_cases), else empty
    captured: tuple = ()

    # -- per-check views ---------------------------------------------------------------------

    @property
    def th(self) -> dict:
        return self.thresholds.get(self.spec.name, {}) if self.spec else {}

    @property
    def opt(self) -> dict:
        return self.options.get(self.spec.name, {}) if self.spec else {}

    @property
    def has_backward(self) -> bool:
        return self.backward.available

    @property
    def bound_model(self) -> RecipeBoundModel:
        """The rounding model of the recipe's operands for this run's input dtype."""
        return self.recipe.bound_model(self.dtype)

    def progress(self, fraction: float) -> None:
        if self.on_fraction is not None:
            self.on_fraction(min(1.0, max(0.0, float(fraction))))

    # -- cases ---------------------------------------------------------------------------------

    @property
    def dtype_str(self) -> str:
        return dtype_name(self.dtype)

    def case(self, lens_q, lens_k=None, *, seed_offset: int = 0, **kw) -> Case:
        kw.setdefault("heads", self.settings.heads)
        kw.setdefault("headdim", self.settings.headdim)
        return Case(
            tuple(lens_q),
            None if lens_k is None else tuple(lens_k),  # type: ignore[arg-type]  # None: Case fills it in
            seed=self.seed + seed_offset,
            dtype=self.dtype_str,
            **kw,
        )

    def from_packing(self, p: Packing, seed_offset: int) -> Case:
        return Case(
            p.lens_q,
            p.lens_k,  # type: ignore[arg-type]  # None: Case fills it in
            heads=p.heads,
            heads_k=p.heads_k,  # type: ignore[arg-type]  # None: Case fills it in
            headdim=p.headdim,
            causal=p.causal,
            distribution=p.distribution,
            seed=self.seed + seed_offset,
            dtype=self.dtype_str,
            softmax_scale=p.softmax_scale,
            overrides=self._do_scale(p.do_log2),
        )

    def _do_scale(self, log2: int) -> tuple:
        """The override that scales dO by 2^log2, clamped to the dtype's range: at least 2^4 times
        its smallest normal (fp16: 2^-10), at most 2^-8 times its largest value.

        The floor keeps dO's typical entries normal; a share of the gradients falls below the
        dtype's normal range (fp16, dO x 2^-10: about 30% of dV, dQ, dK elements on the small-dO
        packing), which the bound model covers with its absolute floor (fp16: 2^-25). It is also low
        enough for fp16 that dS = P (dP - D), with dP ~ |dO| |V| sqrt(d), falls below E4M3's
        smallest normal 2^-6: a kernel that casts dS to E4M3 without a scale loses it there, as it
        does with the 2^-20 of bf16 inputs (docs/checks.md, "What the audit found")."""
        if not log2:
            return ()
        fi = torch.finfo(self.dtype)
        lo = max(-100, int(math.ceil(math.log2(fi.tiny))) + 4)
        hi = min(100, int(math.floor(math.log2(fi.max))) - 8)
        return (("scale_do", 2.0 ** min(hi, max(lo, int(log2)))),)

    def base_cases(self) -> list[Case]:
        """The suite's base packings, each with ``seeds`` seeds (distinct per packing); in a run on a
        capture, the captured calls (the checks that judge base cases judge them)."""
        if self.captured:
            return list(self.captured)
        cases = []
        for s in range(self.settings.seeds):
            for i, p in enumerate(self.settings.base):
                cases.append(self.from_packing(p, 1000 * s + i))
        return cases

    # -- tensors and runs ----------------------------------------------------------------------

    def inputs(self, case: Case) -> Inputs:
        """The tensors of a case (cached); a case that differs only in how it is passed (``call``)
        shares the tensors of the plain case."""
        if case not in self._inputs:
            plain = _plain(case)
            if plain != case:
                self._inputs[case] = replace(self.inputs(plain), case=case)
            else:
                self._inputs[case] = self.across_runs(("inputs", case), lambda: make_inputs(case, self.device))
        return self._inputs[case]

    def run(self, what: Case | Inputs, *, backward: bool | None = None, cache: bool = True, do=None) -> KernelOutputs:
        """The kernel on a case (cached) or on explicit inputs (never cached)."""
        want_bwd = self.has_backward if backward is None else (backward and self.has_backward)
        if isinstance(what, Case):
            key = (what, want_bwd)
            if cache and key in self._runs:
                return self._runs[key]
            if cache and not want_bwd and (what, True) in self._runs:
                return self._runs[(what, True)]
            res = self.harness.call(self.inputs(what), backward=want_bwd, do=do)
            if cache:
                self._runs[key] = res
            return res
        return self.harness.call(what, backward=want_bwd, do=do)

    def reference(self, what: Case | Inputs) -> RefOutputs:
        if isinstance(what, Case):
            plain = _plain(what)  # how the tensors are passed does not change the exact result
            if plain not in self._refs:
                self._refs[plain] = self.across_runs(("reference", plain), lambda: self.reference(self.inputs(plain)))
            return self._refs[plain]
        inp = what
        c = inp.case
        out, lse = attention_forward(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, softmax_scale=c.scale, causal=c.causal)
        dq, dk, dv = attention_backward(
            inp.do, inp.q, inp.k, inp.v, out, lse, inp.cu_q, inp.cu_k, softmax_scale=c.scale, causal=c.causal
        )
        return RefOutputs(out, lse, dq, dk, dv)

    def baseline(self, case: Case) -> KernelOutputs:
        """The built-in BF16 kernel (FlashAttention-2 numerics) on the same inputs."""
        if case not in self._baseline:
            if self._baseline_fn is None:
                self._baseline_fn = KernelHarness(make_kernel(DESIGNS["bf16"]))
            self._baseline[case] = self._baseline_fn.call(self.inputs(case), backward=True)
        return self._baseline[case]

    def memo(self, key, compute: Callable[[], Any]):
        """A value shared between checks (e.g. perturbed runs read by two causal checks)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def across_runs(self, key: tuple, compute: Callable[[], Any], *, model: Any = None):
        """A value that depends on the case in ``key`` alone (and on ``model``, a recipe's rounding
        model, when given), never on the kernel: kept across the runs of this process
        (:mod:`~flamia_verify.properties.case_cache`), except for captured cases."""
        if any(isinstance(k, Case) and k.capture for k in key):
            return compute()
        full = key + (str(self.device), repr(model) if model is not None else None)
        return CASE_CACHE.get(full, compute)

    # -- results -------------------------------------------------------------------------------

    def result(
        self,
        status: str,
        metrics: dict | None = None,
        *,
        message: str = "",
        worst_case: dict | None = None,
        details: dict | None = None,
        thresholds: dict | None = None,
    ) -> CheckResult:
        th = self.th if thresholds is None else thresholds
        return CheckResult(
            name=self.spec.name,  # type: ignore[union-attr]  # run_one sets the spec
            family=self.spec.family,  # type: ignore[union-attr]
            status=status,
            metrics={k: _clean(v) for k, v in (metrics or {}).items()},
            thresholds={k: v for k, v in th.items()},
            worst_case=worst_case or {},
            message=message,
            details=details or {},
            verdict=self.spec.verdict,  # type: ignore[union-attr]
        )

    def skip(self, reason: str) -> CheckResult:
        return self.result("skip", {}, message=reason)


def _plain(case: Case) -> Case:
    """The case with its tensors passed the default way (contiguous, the scale, the true maxima)."""
    return replace(case, call=()) if case.call else case


def _clean(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v

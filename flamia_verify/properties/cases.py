"""Test cases: a packing, shapes, a value distribution and a seed, and the tensors they stand for.

A :class:`Case` is plain data (JSON-able through :meth:`Case.to_dict`), so every finding carries
what reproduces it: ``make_inputs(Case.from_dict(worst_case["case"]))`` rebuilds the exact tensors
(generated on the CPU from the seed, then moved to the device, so a case is the same everywhere).

    lens_q = (3, 0, 5), lens_k = (3, 2, 5)      cu_seqlens_q = [0, 3, 3, 8]
                                                cu_seqlens_k = [0, 3, 5, 10]
    q: (8, heads, headdim)                      k, v: (10, heads_k, headdim)

Value distributions (``DISTRIBUTIONS``) model what training feeds a kernel:

    gaussian     q, k, v, dO ~ N(0, 1)
    shifted      N(0.5, 1): values with a common sign, so a systematic (biased) error shows in means
    heavy_tail   Student t with 3 degrees of freedom (rare large values within a block)
    outliers     N(0, 1) with two channels of k and v scaled by 100 (LLM outlier channels)
    sink         the first key of every document is aligned with every query: it takes most of the
                 probability, the other keys sit a median 8.5 (2 to 14) below it in score, where E4M3
                 flushes or keeps them depending on the scaling; its value row is small, the others
                 ~ N(0.5, 1)
    low_rank     q and k of rank 2 plus N(0, 0.01) noise (peaked, correlated attention)
    peaked       q scaled by 4: scores spread over many units, rows close to one-hot
    late_max     recency: every row's scores rise along the keys of its document, by a median
                 LATE_RISE (12) natural-log units from the first key to the last, so each row's
                 largest score lies at its last keys (the last key tile), its running maximum grows
                 tile after tile (an online softmax must rescale late, and by more than a lazy
                 rescale's threshold)
    late_sink    the sink of ``sink`` at key 3 Lk / 4 of every document instead of its first key (a
                 register or summary token placed late): the rows that see it find their maximum in a
                 late key tile, a jump of a median 12 log2 units over the keys before it
    head_spread  N(0, 1) with the last kv head's v and the last query head's dO x HEAD_SPREAD (100):
                 heads of very different magnitudes in one tensor (a scale shared across heads, or
                 taken from another head, is wrong by that factor)

Realistic families, calibrated on the attention inputs of train-parity's model (the constants below
name the statistic each reproduces; docs/checks.md, "Realistic input families"):

    rotary       q and k of a rotary model: a content vector per head shared by every token plus the
                 token's own, channel pairs weighted as the model weighs them (the high frequencies
                 carry most of the norm), rotated by the position within the document: scores depend
                 on the distance between query and key
    massive      massive-activation tokens: the first key of every document and a delimiter-like key
                 carry two channels of magnitude 100-150 (MASSIVE_FACTOR) in v (and / sqrt(d) in k)
    heavy_do     dO whose rows (tokens) are scaled by |z|^1.2, z ~ N(0, 1): rows near 0 and a few
                 several times the median, entry kurtosis about 10, as a training step's upstream
                 gradient
    realistic    all of them at once, with v's channel RMS spread as the model's (rotary q and k,
                 v channels x exp(0.3 z), massive tokens, heavy-tailed dO)
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from flamia_verify.errors import ConfigError
from flamia_verify.formats import E4M3, round_to_format
from flamia_verify.properties.acc_probe import ACC_DIM, ACC_LEN, accumulation_probe
from flamia_verify.properties.call_options import GRADS_OF, check_call, max_seqlen_pads, option, option_value
from flamia_verify.properties.mx_probes import PROBE_DIM, PROBE_LEN, probe_tensors
from flamia_verify.settings import DTYPES

__all__ = [
    "GRADS_OF",
    "Case",
    "Inputs",
    "DISTRIBUTIONS",
    "make_inputs",
    "make_tensors",
    "CAPTURED",
    "captured_cases",
    "captured_call",
    "capture_environment",
    "cu_from_lens",
    "e4m3_grid",
    "RESIDUE_HEADDIMS",
    "long_document",
    "dimension_cases",
]

DISTRIBUTIONS = (
    "gaussian",
    "shifted",
    "heavy_tail",
    "outliers",
    "sink",
    "low_rank",
    "peaked",
    "late_max",
    "late_sink",
    "head_spread",
    "rotary",
    "massive",
    "heavy_do",
    "realistic",
)

# outlier channels are this many times larger than the rest (the "outlier channels (x100)")
OUTLIER_FACTOR = 100.0
# the sink key is this many times sqrt(headdim) along the mean query direction (score gaps to the other
# keys of median 8.5, measured over seeds); its value row is scaled by SINK_VALUE
SINK_STRENGTH = 2.5
SINK_VALUE = 0.05
#: late_max: the median rise of a row's scores from its document's first key to its last (natural-log
#: units: the last keys weigh e^12 ~ 1.6e5 times the first; 17 log2 units, past a lazy rescale's
#: threshold of 8 within two tiles); the queries share the direction the keys drift along, at
#: LATE_QUERY times its unit length (so that the rise varies from row to row: q . u ~ N(3, 1))
LATE_RISE = 12.0
LATE_QUERY = 3.0
#: head_spread: one head's magnitude over the others' (v of the last kv head, dO of the last query head)
HEAD_SPREAD = 100.0

# The realistic families (rotary, massive, heavy_do and all of them at once in realistic) reproduce the
# statistics of the attention inputs of train-parity's `tiny` model after 150 and 400 optimizer steps
# (benchmarks/realistic_stats.py; the measured values: docs/checks.md, "Realistic input families"), but
# massive, which that model does not show.
#: rotary: the model's RoPE base (training/model.py)
ROTARY_BASE = 10000.0
#: rotary: the share of q's and k's squared norm in each quarter of the rotary pairs, highest frequencies
#: first (measured, both layers after 150 and 400 steps: q 0.42-0.59, 0.24-0.43, 0.08-0.10, 0.06-0.08;
#: k 0.36-0.50, 0.22-0.46, 0.09-0.17, 0.07-0.12): the model's heads are positional, the high
#: frequencies carry the norm, not the low ones
ROTARY_SHARES = (0.47, 0.35, 0.10, 0.08)
#: rotary: the share of each head's q (k) energy in one content vector every token shares (the rest is
#: the token's own), which makes the scores a function of the distance i - j: the distance explains
#: 0.15-0.18 of the scores' variance (measured: 0.07-0.41 over layers and steps), the largest channel
#: RMS is 2.5-3.0 times the median (measured 2.0-2.9), the entries' kurtosis 4.1-4.6 (measured 3.0-4.6)
ROTARY_SHARED = 0.6
#: realistic: v's channels scaled by exp(CHANNEL_SIGMA z), z ~ N(0, 1) per kv head and channel: the
#: largest channel RMS over the median 2.0-2.2 (measured: v 1.8-2.5)
CHANNEL_SIGMA = 0.3
#: massive: channels of the massive-activation tokens and their least magnitude in v (k: / sqrt(headdim);
#: up to 1.5 times it).
#: Not calibrated: the tiny model has no such tokens (the largest token norm of k and v is 1.3-2.1
#: times the median, as for Gaussian values); the magnitude is that of the outlier channels, the
#: scale at which LLMs show them (the `small` model's capture on a GPU is pending)
MASSIVE_CHANNELS = 2
MASSIVE_FACTOR = 100.0
#: heavy_do: dO's rows scaled by |z|^HEAVY_DO_POWER, z ~ N(0, 1): row norms over their median at the
#: 90th and 99th percentile and the largest of 1000 about 2.9, 5.2 and 7.9 (measured 2.4-2.8, 4.0-5.2,
#: 5.3-7.9); entry kurtosis 3 E|z|^4.8 / (E|z|^2.4)^2 = 11.8 (measured 7.4-10.0)
HEAVY_DO_POWER = 1.2


@dataclass(frozen=True)
class Case:
    """One call of a kernel: packing, shapes, distribution, seed.

    ``lens_k`` defaults to ``lens_q``; ``heads_k`` to ``heads``; ``softmax_scale`` to headdim^-0.5
    (filled in, so that a case equals its JSON round trip).
    ``overrides`` names structured edits applied after sampling (see :func:`make_tensors`).
    ``call`` says how the tensors are handed to the kernel (see :mod:`flamia_verify.properties.call_options`): the same values
    in strided views, ``softmax_scale=None`` for the default scale, ``max_seqlen_*`` above the true
    maximum. Empty (the default): contiguous tensors, the scale passed, the true maxima.
    """

    lens_q: tuple[int, ...]
    # None (the default) is filled in by __post_init__: the attributes always hold the type declared
    lens_k: tuple[int, ...] = None  # type: ignore[assignment]
    heads: int = 2
    heads_k: int = None  # type: ignore[assignment]
    headdim: int = 64
    causal: bool = True
    distribution: str = "gaussian"
    seed: int = 0
    dtype: str = "bf16"
    softmax_scale: float | None = None
    overrides: tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    call: tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    #: a recorded call's tensors instead of sampled ones: "CAPTURE_DIR#INDEX" (distribution "captured";
    #: see :func:`captured_cases`)
    capture: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lens_q", tuple(int(x) for x in self.lens_q))
        lk = self.lens_q if self.lens_k is None else tuple(int(x) for x in self.lens_k)
        object.__setattr__(self, "lens_k", lk)
        if self.heads_k is None:
            object.__setattr__(self, "heads_k", self.heads)
        if len(self.lens_q) != len(self.lens_k):
            raise ConfigError(f"lens_q {self.lens_q} and lens_k {self.lens_k} must list the same documents")
        if any(x < 0 for x in self.lens_q + self.lens_k):
            raise ConfigError(f"document lengths must be >= 0, got {self.lens_q} / {self.lens_k}")
        if self.heads < 1 or self.heads_k < 1 or self.heads % self.heads_k:
            raise ConfigError(f"heads ({self.heads}) must be a positive multiple of heads_k ({self.heads_k})")
        if self.capture and self.distribution != CAPTURED:
            raise ConfigError(f"a captured case has the distribution {CAPTURED!r}, not {self.distribution!r}")
        if self.distribution not in DISTRIBUTIONS and not self.capture:
            raise ConfigError(f"unknown distribution {self.distribution!r}; choose one of: {', '.join(DISTRIBUTIONS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
        object.__setattr__(self, "overrides", tuple((str(k), _frozen(v)) for k, v in self.overrides))
        object.__setattr__(self, "call", check_call(tuple((str(k), _frozen(v)) for k, v in self.call)))
        if self.softmax_scale is None:
            object.__setattr__(self, "softmax_scale", self.headdim**-0.5)
        else:
            object.__setattr__(self, "softmax_scale", float(self.softmax_scale))
        if self.calls("upstream", "broadcast") and ("const_do", True) not in self.overrides:
            raise ConfigError("call option upstream=broadcast needs equal rows of dO: add the override const_do")
        if self.calls("scale_arg", "none") and self.softmax_scale != self.headdim**-0.5:
            raise ConfigError(
                f"call option scale_arg=none passes softmax_scale=None, which means headdim^-0.5; the case's "
                f"softmax_scale is {self.softmax_scale:g}"
            )

    @property
    def scale(self) -> float:
        return self.headdim**-0.5 if self.softmax_scale is None else float(self.softmax_scale)

    @property
    def total_q(self) -> int:
        return sum(self.lens_q)

    @property
    def total_k(self) -> int:
        return sum(self.lens_k)

    def with_(self, **changes) -> Case:
        if "headdim" in changes and "softmax_scale" not in changes:
            changes["softmax_scale"] = None  # the default follows the new headdim
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lens_q"], d["lens_k"] = list(self.lens_q), list(self.lens_k)
        d["overrides"] = [[k, list(v) if isinstance(v, tuple) else v] for k, v in self.overrides]
        d["call"] = [[k, v] for k, v in self.call]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown case field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "lens_q" not in data:
            raise ConfigError("a case needs lens_q (the query length of every document)")
        d = dict(data)
        d["overrides"] = tuple(tuple(x) for x in d.get("overrides", ()))
        d["call"] = tuple(tuple(x) for x in d.get("call", ()))
        return cls(**d)

    def describe(self) -> str:
        if self.capture:
            path, _, index = self.capture.rpartition("#")
            return f"captured call {index} of {path} ({self._shape()})"
        return self._shape()

    def _shape(self) -> str:
        lk = "" if self.lens_k == self.lens_q else f" lens_k={list(self.lens_k)}"
        sc = "" if self.softmax_scale == self.headdim**-0.5 else f" softmax_scale={self.softmax_scale:.4g}"
        call = "".join(f" {k}={v}" for k, v in self.call)
        return (
            f"lens_q={list(self.lens_q)}{lk} heads={self.heads}/{self.heads_k} d={self.headdim}{sc} "
            f"{'causal' if self.causal else 'full'} {self.distribution} seed={self.seed} {self.dtype}{call}"
        )

    def call_option(self, key: str) -> Any:
        """The value of the call option ``key`` (call_options.OPTIONS) in this case: its own, or the default."""
        return option_value(self.call, key)

    def calls(self, key: str, value: Any) -> bool:
        """Whether this case's call hands its inputs over with ``value`` of option ``key``. A value the
        option does not have is a ConfigError: a misspelt value must not read as "not this call"."""
        option(key).validate(value)
        return option_value(self.call, key) == value


def _frozen(v):
    """Lists (from JSON) back to tuples, so that a case is hashable and equal to its round trip."""
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


def cu_from_lens(lens, device=None) -> torch.Tensor:
    vals = [0]
    for x in lens:
        vals.append(vals[-1] + int(x))
    return torch.tensor(vals, dtype=torch.int32, device=device)


@dataclass
class Inputs:
    """The tensors of one call; ``do`` is the upstream gradient used for the backward."""

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    @property
    def max_q(self) -> int:
        """max_seqlen_q as the call passes it: the true maximum plus the case's ``max_seqlen_pad``."""
        return max(self.case.lens_q, default=0) + max_seqlen_pads(self.case)[0]

    @property
    def max_k(self) -> int:
        """max_seqlen_k as the call passes it: the true maximum plus the case's ``max_seqlen_pad``."""
        return max(self.case.lens_k, default=0) + max_seqlen_pads(self.case)[1]

    def replace(self, **tensors) -> Inputs:
        return replace(self, **tensors)

    def clone(self) -> Inputs:
        return replace(self, q=self.q.clone(), k=self.k.clone(), v=self.v.clone(), do=self.do.clone())


def _sample(case: Case, g: torch.Generator):
    """float32 q, k, v, dO on the CPU following the case's distribution."""
    tq, tk, h, hk, d = case.total_q, case.total_k, case.heads, case.heads_k, case.headdim

    def randn(n, heads):
        return torch.randn(n, heads, d, generator=g)

    dist = case.distribution
    if dist == "heavy_tail":
        # Student t, 3 degrees of freedom: N / sqrt(chi2_3 / 3), scaled to unit variance (var = 3)
        def draw(n, heads):
            z = randn(n, heads)
            chi2 = sum(randn(n, heads) ** 2 for _ in range(3))
            return z / torch.sqrt(chi2 / 3).clamp_min(1e-3) / math.sqrt(3.0)

        return draw(tq, h), draw(tk, hk), draw(tk, hk), draw(tq, h)
    q, k, v, do = randn(tq, h), randn(tk, hk), randn(tk, hk), randn(tq, h)
    if dist == "shifted":
        q, k, v, do = q + 0.5, k + 0.5, v + 0.5, do + 0.5
    elif dist == "outliers":
        ch = torch.randperm(d, generator=g)[:2]
        k[:, :, ch] *= OUTLIER_FACTOR / math.sqrt(d)  # keep scores finite-ish: the channel dominates S
        v[:, :, ch] *= OUTLIER_FACTOR
    elif dist == "low_rank":
        r = 2
        a = torch.randn(tq, h, r, generator=g)
        b = torch.randn(tk, hk, r, generator=g)
        basis_q = torch.randn(h, r, d, generator=g)
        basis_k = basis_q.view(hk, h // hk, r, d)[:, 0]
        q = torch.einsum("thr,hrd->thd", a, basis_q) + 0.1 * q
        k = torch.einsum("thr,hrd->thd", b, basis_k) + 0.1 * k
    elif dist == "peaked":
        q = q * 4.0
    elif dist in ("sink", "late_sink"):
        group = h // hk
        start = 0
        for lk in case.lens_k:
            if lk:
                at = start + (3 * lk // 4 if dist == "late_sink" else 0)
                mean_q = q.view(tq, hk, group, d).mean(dim=(0, 2))  # (hk, d)
                direction = mean_q / mean_q.norm(dim=-1, keepdim=True).clamp_min(1e-6)
                k[at] = direction * SINK_STRENGTH * math.sqrt(d)
                v[start : start + lk] += 0.5
                v[at] *= SINK_VALUE
            start += lk
        q = q + 0.5 * q.mean(dim=0, keepdim=True).sign()  # every query shares a direction with the sink
    elif dist == "late_max":
        group = h // hk
        u = torch.randn(hk, d, generator=g)
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (hk, d): the drift of each kv head's keys
        # q . u ~ N(LATE_QUERY, 1); score rise over a document = scale * (q . u) * ramp_end
        q = q + LATE_QUERY * u.repeat_interleave(group, dim=0)
        ramp_end = LATE_RISE * math.sqrt(d) / LATE_QUERY
        start = 0
        for lk in case.lens_k:
            if lk:
                frac = torch.arange(lk, dtype=torch.float32) / max(lk - 1, 1)  # 0 at the first key, 1 at the last
                k[start : start + lk] += (ramp_end * frac)[:, None, None] * u
            start += lk
    elif dist == "head_spread":
        if hk > 1:
            v[:, hk - 1] *= HEAD_SPREAD
        if h > 1:
            do[:, h - 1] *= HEAD_SPREAD
    elif dist == "rotary":
        q, k = _rotary(case, g, q, k)
    elif dist == "massive":
        k, v = _massive(case, g, k, v)
    elif dist == "heavy_do":
        do = _heavy_do(g, do)
    elif dist == "realistic":
        q, k = _rotary(case, g, q, k)
        v = v * torch.exp(CHANNEL_SIGMA * torch.randn(hk, d, generator=g))
        k, v = _massive(case, g, k, v)
        do = _heavy_do(g, do)
    return q, k, v, do


def _positions(lens_q, lens_k) -> tuple[torch.Tensor, torch.Tensor]:
    """The position of every query and key within its document, the queries bottom-right aligned
    (query i of a document of lq queries and lk keys sits at key position i + lk - lq)."""
    pq = [torch.arange(lq) + (lk - lq) for lq, lk in zip(lens_q, lens_k)]
    pk = [torch.arange(lk) for lk in lens_k]
    empty = torch.zeros(0, dtype=torch.long)
    return torch.cat(pq) if pq else empty, torch.cat(pk) if pk else empty


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by the positions (T,) as the train-parity model does it (pairs (i, i + D/2),
    frequency ROTARY_BASE^(-i / (D/2)); an odd last channel is left as it is)."""
    half = x.shape[-1] // 2
    if half == 0 or x.shape[0] == 0:
        return x
    inv = ROTARY_BASE ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = x.clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x1 * sin + x2 * cos
    return out


def _pair_amplitudes(d: int) -> torch.Tensor:
    """(d,) the amplitude of every channel of :func:`_rotary`: pair (i, i + D/2) in quarter b of the
    pairs (highest frequencies first) gets sqrt(ROTARY_SHARES[b] / pairs in b x D/2), so the quarters
    hold ROTARY_SHARES of the squared norm and the mean squared amplitude is 1."""
    half = d // 2
    amp = torch.ones(d)
    if half == 0:
        return amp
    quarter = torch.clamp(torch.arange(half) * len(ROTARY_SHARES) // half, max=len(ROTARY_SHARES) - 1)
    shares = torch.tensor(ROTARY_SHARES)
    counts = torch.bincount(quarter, minlength=len(ROTARY_SHARES)).float()
    present = shares * (counts > 0)
    per_pair = (present / present.sum() / counts.clamp_min(1))[quarter] * half
    amp[:half] = per_pair.sqrt()
    amp[half : 2 * half] = per_pair.sqrt()
    return amp


def _rotary(case: Case, g: torch.Generator, q: torch.Tensor, k: torch.Tensor):
    """q and k as a rotary model's: per head a shared content vector (ROTARY_SHARED of the energy) plus
    each token's own, channel pairs weighted by ROTARY_SHARES, rotated by the token's position within
    its document. Scores then depend on the distance between query and key."""
    d = case.headdim
    amp = _pair_amplitudes(d)
    mu_q = torch.randn(case.heads, d, generator=g)
    mu_k = torch.randn(case.heads_k, d, generator=g)
    a, b = math.sqrt(ROTARY_SHARED), math.sqrt(1.0 - ROTARY_SHARED)
    pq, pk = _positions(case.lens_q, case.lens_k)
    q = _rope((a * mu_q + b * q) * amp, pq)
    k = _rope((a * mu_k + b * k) * amp, pk)
    return q, k


def _massive(case: Case, g: torch.Generator, k: torch.Tensor, v: torch.Tensor):
    """Massive-activation tokens: the first key of every document and one delimiter-like key drawn in
    it carry MASSIVE_CHANNELS channels (the same ones for the whole tensor, each with its own sign) of
    magnitude m in v and m / sqrt(d) in k (scores stay finite-ish), m uniform in [MASSIVE_FACTOR,
    1.5 MASSIVE_FACTOR) per token, head and channel (no one value a per-tensor scale maps exactly)."""
    d, hk = case.headdim, case.heads_k
    ch = torch.randperm(d, generator=g)[: min(MASSIVE_CHANNELS, d)]
    sign = torch.randint(0, 2, (len(ch),), generator=g).float() * 2 - 1
    start = 0
    k, v = k.clone(), v.clone()
    for lk in case.lens_k:
        if lk:
            delim = int(torch.randint(1, lk, (1,), generator=g)) if lk > 1 else 0
            for at in sorted({start, start + delim}):
                m = MASSIVE_FACTOR * (1.0 + 0.5 * torch.rand(hk, len(ch), generator=g))
                v[at, :, ch] = sign * m
                k[at, :, ch] = sign * m / math.sqrt(d)
        start += lk
    return k, v


def _heavy_do(g: torch.Generator, do: torch.Tensor) -> torch.Tensor:
    """dO with every token's row (all heads) scaled by |z|^HEAVY_DO_POWER, z ~ N(0, 1): rows near 0 (well
    predicted tokens) and a few rows several times the median (badly predicted ones)."""
    return do * torch.randn(do.shape[0], 1, 1, generator=g).abs() ** HEAVY_DO_POWER


def make_tensors(case: Case):
    """(q, k, v, dO) in the case's dtype on the CPU, deterministic in the case (a captured case: the
    recorded tensors; dO drawn from the case's seed where the call recorded none)."""
    g = torch.Generator().manual_seed(int(case.seed) & 0xFFFF_FFFF_FFFF)
    q, k, v, do = _captured(case, g) if case.capture else _sample(case, g)
    dtype = DTYPES[case.dtype]
    tensors = {"q": q, "k": k, "v": v, "do": do}
    for key, value in case.overrides:
        _apply_override(tensors, key, value, case)
    return tuple(tensors[n].to(dtype) for n in ("q", "k", "v", "do"))


def e4m3_grid(x: torch.Tensor) -> torch.Tensor:
    """x rounded to E4M3 values whose significand is at most 1.75 (1.110b).

    Such values are exact under every power-of-two block scale that keeps the block maximum in
    range (MX RCEIL and FLOOR, FLAMIA's P blocks, per-row and per-tile scales): multiplying by a power
    of two keeps the 3-bit significand, and FLOOR's scaled maximum (< 448) never saturates. A GEMM
    operand made of them is not changed by any MXFP8 quantization of the recipes.
    """
    y = round_to_format(x.float(), E4M3, saturate=True)
    mant, exp = torch.frexp(y)  # y = mant * 2^exp, |mant| in [0.5, 1)
    mant = torch.where(mant.abs() > 0.875, torch.sign(mant) * 0.875, mant)
    return torch.ldexp(mant, exp)


def _require_probe_shape(case: Case, what: str, length: int, dim: int) -> None:
    """A probe replaces every tensor: the case must have its one document of ``length`` queries and
    keys, one head and head_dim ``dim``."""
    if (case.total_q, case.total_k, case.heads, case.heads_k, case.headdim) != (length, length, 1, 1, dim):
        raise ConfigError(
            f"{what} needs {length} queries and keys, one head and head_dim {dim}; the case has {case.describe()}"
        )


def _apply_override(tensors: dict, key: str, value, case: Case) -> None:
    """Structured edits: ``scale_<t>`` multiplies tensor t; ``headscale_<t>`` (value ``(h, c)``)
    multiplies head h of t by c; ``shift_<t>`` adds a value to it; ``zero_<t>`` zeroes rows [a, b) of t;
    ``const_<t>`` sets every row of t to its first row; ``rowconst_<t>`` sets every channel of a row of t
    to that row's first channel; ``fill_<t>`` sets rows [a, b) to a value;
    ``grid_<t>`` rounds t to the MX-exact E4M3 grid (:func:`e4m3_grid`); ``int_<t>`` rounds t to
    integers; ``onehot_<t>`` makes row r of t ``value`` times the unit vector e_(r mod headdim)
    (distinct within every document of at most headdim rows); ``negscore_q`` makes every score deeply
    negative (about -value * scale * headdim); ``probe`` (value ``"site:variant"``) replaces all
    four tensors by the MX rounding probe of :mod:`flamia_verify.properties.mx_probes`, drawn from
    the case's seed (its shapes must be the probe's: 64 tokens, one head, head_dim 64); ``accprobe``
    by the accumulation probe of :mod:`flamia_verify.properties.acc_probe` (the same shapes)."""
    if key == "accprobe":
        _require_probe_shape(case, "the accumulation probe", ACC_LEN, ACC_DIM)
        tensors.update(accumulation_probe(case.seed, str(value)))
        return
    if key == "probe":
        _require_probe_shape(case, "a rounding probe", PROBE_LEN, PROBE_DIM)
        inputs, _ = probe_tensors(str(value), case.seed)
        tensors.update({n: x.float() for n, x in inputs.items()})
        return
    kind, _, name = key.partition("_")
    if name not in tensors:
        raise ConfigError(f"override {key!r} names no tensor (q, k, v, do)")
    t = tensors[name]
    if kind == "scale":
        tensors[name] = t * float(value)
    elif kind == "zero":
        a, b = value
        t[int(a) : int(b)] = 0
    elif kind == "const":
        t[:] = t[:1].clone()
    elif kind == "rowconst":
        tensors[name] = t[..., :1].expand(t.shape).clone()
    elif kind == "negscore":
        # keys close to the all-ones vector, queries close to -value times it: every score of a row is
        # about -value * scale * headdim (deeply negative) with a spread of a few units
        lam = float(value)
        tensors["k"] = 1.0 + 0.05 * tensors["k"]
        tensors["q"] = -lam * (1.0 + 0.05 * tensors["q"])
    elif kind == "grid":
        tensors[name] = e4m3_grid(t)
    elif kind == "int":
        tensors[name] = torch.round(t)
    elif kind == "onehot":
        rows, d = t.shape[0], t.shape[-1]
        one = torch.zeros_like(t)
        one[torch.arange(rows), :, torch.arange(rows) % d] = float(value)
        tensors[name] = one
    elif kind == "fill":
        a, b, x = value
        t[int(a) : int(b)] = float(x)
    elif kind == "shift":
        tensors[name] = t + float(value)
    elif kind == "headscale":
        head, factor = value
        if not 0 <= int(head) < t.shape[1]:
            raise ConfigError(f"override {key!r}: head {head} is not one of the {t.shape[1]} heads of {name}")
        t[:, int(head)] *= float(factor)
    else:
        raise ConfigError(
            f"unknown override {key!r}; use scale_, headscale_, shift_, zero_, const_, rowconst_, fill_, grid_, int_ "
            "or onehot_ with q, k, v or do, or probe, accprobe"
        )


def make_inputs(case: Case, device: str | torch.device = "cpu") -> Inputs:
    q, k, v, do = make_tensors(case)
    return Inputs(
        case,
        q.to(device),
        k.to(device),
        v.to(device),
        do.to(device),
        cu_from_lens(case.lens_q, device),
        cu_from_lens(case.lens_k, device),
    )


# ----------------------------------------------------------------------------------------------
# captured calls: the tensors a real model produced (flamia_verify.capture), as cases
# ----------------------------------------------------------------------------------------------

#: the distribution of a captured case
CAPTURED = "captured"


@functools.lru_cache(maxsize=4)
def _load(path: str):
    from flamia_verify.capture import load_capture

    return load_capture(path)


def _call_of(case: Case):
    path, _, index = case.capture.rpartition("#")
    for call in _load(path).calls:
        if call.index == int(index):
            return call
    raise ConfigError(f"{path} has no call {index}")


def _captured(case: Case, g: torch.Generator):
    call = _call_of(case)
    do = call.dout if call.dout is not None else torch.randn(call.q.shape, generator=g)
    return call.q.float(), call.k.float(), call.v.float(), do.float()


def captured_cases(path) -> list[Case]:
    """One case per call of the capture at ``path`` (validated by
    :func:`flamia_verify.capture.load_capture`: a bad capture raises CaptureError), in call order:
    its packing, heads, head_dim, causal flag, dtype, softmax_scale and max_seqlen (above the true
    maxima: the ``max_seqlen_pad`` call option) as recorded, seed = the call's index (it draws dO
    where the call recorded none)."""
    from flamia_verify.errors import CaptureError

    where = str(path)
    capture = _load(where)
    cases = []
    for call in capture.calls:
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(call.q.dtype)
        if dtype is None or dtype not in DTYPES:
            raise CaptureError(
                f"{capture.path / call.file}: q is {call.q.dtype}; checks run on bf16, fp16 or fp32 inputs"
            )
        lens_q = tuple(int(x) for x in call.cu_seqlens_q.diff().tolist())
        lens_k = tuple(int(x) for x in call.cu_seqlens_k.diff().tolist())
        pads = (call.max_seqlen_q - max(lens_q, default=0), call.max_seqlen_k - max(lens_k, default=0))
        cases.append(
            Case(
                lens_q,
                lens_k,
                heads=int(call.q.shape[1]),
                heads_k=int(call.k.shape[1]),
                headdim=int(call.q.shape[2]),
                causal=bool(call.causal),
                distribution=CAPTURED,
                seed=int(call.index),
                dtype=dtype,
                softmax_scale=call.softmax_scale,
                call=(("max_seqlen_pad", pads),) if any(pads) else (),
                capture=f"{where}#{call.index}",
            )
        )
    return cases


def capture_environment(path) -> dict[str, Any]:
    """What a report records of the capture it ran on: its path, SHA-256, model and number of calls."""
    capture = _load(str(path))
    return {
        "inputs": str(path),
        "capture_sha256": capture.sha256,
        "capture_model": capture.model,
        "captured_calls": len(capture.calls),
    }


def captured_call(case: Case) -> dict[str, Any]:
    """Where a captured case came from: call index, layer, step, and whether dO was recorded."""
    call = _call_of(case)
    return {"call": call.index, "layer": call.layer, "step": call.step, "dout_recorded": call.dout is not None}


# ----------------------------------------------------------------------------------------------
# the dimension cases: what the suites' base packings (settings.py) do not draw
# ----------------------------------------------------------------------------------------------

#: head_dims that are not multiples of 16: a tensor core's k-step (16 channels) ends inside the row,
#: and so does an MX block of the head_dim GEMMs (32); 8 and 24 are shorter than one block, 100 not
#: even a multiple of 8 (a vector load of 8 channels straddles the row's end); 72 is a production
#: vision tower's (SigLIP's 1152 = 16 x 72)
RESIDUE_HEADDIMS = (8, 24, 40, 72, 88, 100)

#: keys of the long document of the dimension cases per suite on the CPU: past 2048 keys per row in
#: the quick suite, past 4096 in the others (split-K and long-row paths switch on at such lengths)
LONG_KEYS = {"quick": 2080, "standard": 4160, "full": 4160}
#: its queries, bottom-right aligned (the last keys' rows, as a chunk of queries against a long key
#: cache): every row sees between LONG_KEYS - LONG_QUERIES + 1 and LONG_KEYS keys, at a cost of
#: LONG_QUERIES rows
LONG_QUERIES = {"quick": 64, "standard": 128, "full": 128}
#: on a GPU (fused kernels, where the tiles, splits and atomics engage on long rows): past 8192 keys
GPU_LONG_KEYS = 8320
GPU_LONG_QUERIES = 512


def long_document(suite: str, device: str | torch.device) -> tuple[int, int]:
    """(queries, keys) of the long causal document of :func:`dimension_cases` for ``suite`` on ``device``."""
    if str(device).startswith("cuda"):
        return GPU_LONG_QUERIES, GPU_LONG_KEYS
    name = suite if suite in LONG_KEYS else "standard"
    return LONG_QUERIES[name], LONG_KEYS[name]


def dimension_cases(
    suite: str, *, seed: int, dtype: str = "bf16", device: str | torch.device = "cpu", long: bool = True
) -> list[Case]:
    """The cases of the input dimensions the suites' base packings do not draw, one seed each (the
    error family runs them beside the base cases, the bound family too, consistency.homogeneity
    all but the long one):

    * head_dims not multiples of 16 (:data:`RESIDUE_HEADDIMS`): 72 and 40 in the quick suite, all six
      in the others;
    * where each row's maximum lies: scores rising along the keys (``late_max``) and a sink late in
      the document (``late_sink``), causal and not, rows of two and three 64-key tiles;
    * heads of different magnitudes (``head_spread``: one kv head's V and one query head's dO x 100);
    * in the standard and full suites, the realistic families one at a time (``rotary``, ``massive``,
      ``heavy_do``; every suite's base packings hold them together as ``realistic``);
    * with ``long``: one causal document of :func:`long_document` keys (2080 quick, 4160 standard on the
      CPU; 8320 on a GPU), every row past 2048 (4096, 8192) keys but the first few.

    ``seed`` is the run's seed (each case adds its own offset)."""
    quick = suite == "quick"

    def case(offset: int, lens_q, lens_k=None, **kw) -> Case:
        keys = None if lens_k is None else tuple(lens_k)
        return Case(tuple(lens_q), keys, seed=seed + offset, dtype=dtype, **kw)  # type: ignore[arg-type]  # None: filled in

    cases = [
        case(5001, (77, 130), heads=4, heads_k=2, headdim=72, causal=False, distribution="late_max"),
        case(5002, (130, 45), (130, 60), heads=2, heads_k=1, headdim=40, causal=True, distribution="late_sink"),
        case(5003, (64, 96), heads=4, heads_k=2, headdim=64, causal=True, distribution="head_spread"),
    ]
    if not quick:
        cases += [
            case(5004, (100, 33), heads=3, heads_k=1, headdim=24, causal=True, distribution="late_max"),
            case(
                5005, (50, 7, 40), (64, 7, 40), heads=2, heads_k=2, headdim=88, causal=False, distribution="late_sink"
            ),
            case(5006, (45, 70), heads=6, heads_k=3, headdim=100, causal=True, distribution="head_spread"),
            case(5007, (96, 17), heads=2, heads_k=1, headdim=8, causal=True, distribution="late_max"),
            # the realistic families one at a time (the base packings hold them together: realistic)
            case(5011, (80, 47), heads=4, heads_k=2, headdim=64, causal=True, distribution="rotary"),
            case(5012, (64, 70), (64, 100), heads=2, heads_k=1, headdim=128, causal=True, distribution="massive"),
            case(5013, (70, 58), heads=2, heads_k=2, headdim=64, causal=False, distribution="heavy_do"),
        ]
    if long:
        lq, lk = long_document(suite, device)
        cases.append(case(5009, (lq,), (lk,), heads=2, heads_k=1, headdim=64, causal=True, distribution="late_max"))
    return cases

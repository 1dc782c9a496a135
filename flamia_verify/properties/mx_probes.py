"""Probe inputs on which an MXFP8 recipe's rounding of one GEMM operand is known in closed form.

The MX recipes fix everything about an operand's rounding: E4M3 elements, 32-element blocks along the
GEMM's contraction axis (restarting at the document start), an E8M0 scale from the block's amax
(RCEIL or FLOOR), round to nearest even. A block whose largest element is 256 B (B a power of two)
gets the scale B under both rules (RCEIL: 2^ceil(log2(256/448)) = 1; FLOOR: 2^(8 - 8) = 1), and then:

* ``grid`` probes m 2^-9 B (m in 1, 5, 9, 13: E4M3's subnormals and lowest normal binade, below
  2^-13 of the block maximum) are represented exactly; so are they under any smaller scale (a block
  whose amax is smaller). Under a scale one exponent too large they lose their last bit (m -> m - 1:
  m = 1 mod 4 rounds down to even); with E5M2 elements 9 and 13 lose theirs (a tie, rounded to even).
* ``step`` probes (g - 2^k/32) B with g = sig 2^k, sig in 1.25, 1.5, 1.75, lie a quarter of a step
  below the E4M3 value g B: round to nearest gives g B under any power-of-two scale that keeps them
  normal (the relative grid of E4M3's normal binades is the same at every scale); rounding toward
  zero gives (g - 2^k/8) B.

Each probe case makes one *site* (the operand of one GEMM) carry such probes, arranges that the
block maxima contribute nothing to what is observed (a +256 B / -256 B pair whose products cancel,
or a channel the other operand of the GEMM zeroes), and makes every other rounding that reaches the
observed outputs exact (roundings of other operands may move values whose products are 0, or whose
signs are balanced so that they cancel exactly): scores are
all 0 (Q and K in disjoint channels, or one of them 0), so the weights are exactly uniform (1/64)
whatever the design rounds P to; V, dO and dS are made of +-1 and powers of two, or are exact probes.
A kernel that rounds as its recipe says then computes exactly the attention of the *rounded* inputs
(:func:`probe_tensors` returns both), up to fp32 accumulation and the rounding of its outputs; a
kernel whose block scale, rounding direction or element format differs from the recipe's moves the
observed outputs by a whole unit of the probes.

    site     probes in                      observed   the block maxima
    qk       Q rows and K rows (head_dim)   out        in a channel the other operand zeroes
    v_seq    V columns (keys)               out        a cancelling pair (uniform weights)
    dp       dO rows and V rows (head_dim)  dq, dk     in a channel the other operand zeroes
    do_seq   dO columns (queries)           dv         a cancelling pair
    ds       dS rows (keys), from V         dq         a pair that K weighs equally
    k_seq    K columns (keys)               dq         a pair that dS weighs equally
    dst      dS^T columns (queries), from dO dk        a pair that Q weighs equally
    q_seq    Q columns (queries)            dk         a pair that dS^T weighs equally

One document of 64 queries and keys (two 32-blocks on every axis), one head, head_dim 64, not causal,
softmax_scale 1/8 (a power of two, so that a design that folds it into Q before rounding rounds the
same values).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flamia_verify.errors import ConfigError
from flamia_verify.formats import E4M3, ScaleRule, mx_fake_quantize
from flamia_verify.recipes.operands import Operand, describe_operands

__all__ = [
    "SITE_OPERANDS",
    "SITES",
    "STEP_SITES",
    "SITE_WHAT",
    "VARIANT_WHAT",
    "Probe",
    "PROBES",
    "probe_tensors",
    "PROBE_LEN",
    "PROBE_DIM",
    "PROBE_SCALE",
    "parse_probe",
    "SCALE_SITES",
    "SCALE_PROBES",
    "SCALE_SIG",
    "SCALE_GRID_M",
    "TINY_AMAX",
    "scale_probes",
]

PROBE_LEN = 64
PROBE_DIM = 64
PROBE_SCALE = 0.125
BLOCK = 32
BIG = 256.0  # the block maximum: scale 1 under RCEIL and FLOOR
UNIT = 2.0**-9  # E4M3's smallest subnormal at scale 1
GRID_M = (1, 5, 9, 13)
# a + b - c = 0 and, after a doubled scale, 4n+1 -> 4n, 2 -> 2, 4n+3 -> 4n+4: the sum moves by -2 units
TRIPLES = ((9, 2, 11), (13, 2, 15))
STEP_SIG = (1.25, 1.5, 1.75)

#: the GEMM operands a site's probes sit in
SITE_OPERANDS = {
    "qk": (Operand.Q_HD, Operand.K_HD),
    "v_seq": (Operand.V_SEQ,),
    "dp": (Operand.DO_HD, Operand.V_HD),
    "do_seq": (Operand.DO_SEQ,),
    "ds": (Operand.DS,),
    "k_seq": (Operand.K_SEQ,),
    "dst": (Operand.DST,),
    "q_seq": (Operand.Q_SEQ,),
}
SITES = tuple(SITE_OPERANDS)
#: sites with step probes: the input operands (the computed dS is not an input a probe can be put into)
STEP_SITES = tuple(s for s, ops in SITE_OPERANDS.items() if not any(op.computed for op in ops))
OBSERVED = {
    "qk": ("out",),
    "v_seq": ("out",),
    "dp": ("dq", "dk"),
    "do_seq": ("dv",),
    "ds": ("dq",),
    "k_seq": ("dq",),
    "dst": ("dk",),
    "q_seq": ("dk",),
}
SITE_WHAT = {site: describe_operands(ops) for site, ops in SITE_OPERANDS.items()}
VARIANT_WHAT = {
    "grid": "probes on E4M3's lowest binades (a block scale one exponent too large or a coarser element "
    "format loses them)",
    "step": "probes a quarter step below an E4M3 value (rounding toward zero, not to nearest, loses them)",
    "scale": "block maxima on both sides of every boundary of the RCEIL and FLOOR scale rules and of "
    "their wrong twins, beside probes on the grid of the smallest scale any of them picks (a block "
    "scale other than the recipe's rounds them differently)",
    "tiny": "block maxima near the bottom of E8M0's range, where amax / 448 is an fp32 subnormal "
    "(a scale one exponent too small saturates them)",
}

#: the sites of the scale-rule probes: the operands blocked along the sequence that are inputs
SCALE_SITES = ("v_seq", "do_seq", "k_seq", "q_seq")
#: block-maximum significands m (amax = m 2^E, m in [1, 2)) on both sides of every boundary where an
#: exponent rule changes its mind: 1 (FLOOR, ceil(log2 amax)), sqrt 2 (round(log2 amax)),
#: 1.75 / sqrt 2 (round(log2(amax / 448))), 1.75 (RCEIL, floor(log2(amax / 448)): amax = 448 2^k
#: exactly and one BF16 ulp either side); 2 - 2^-7 is one ulp below the next power of two. Every one
#: has at most 8 significant bits (exact in BF16 and FP16).
SCALE_SIG = (1.0, 1.0 + 2.0**-7, 1.234375, 1.2421875, 1.4140625, 1.421875, 1.7421875, 1.75, 1.7578125, 2.0 - 2.0**-7)
#: grid probes m 2^-9 X_lo beside a block maximum m_A 2^E, X_lo = 2^(E - 9) the smallest scale any rule
#: considered picks: exact under X_lo; under 2 X_lo the odd m lose a unit (RNE: 1 -> 0, 5 -> 4, ...);
#: under 4 X_lo m = 2 mod 4 lose two more (2 -> 0, 10 -> 8). Every change lowers the sum.
SCALE_GRID_M = (1, 2, 5, 9, 10, 13)
#: block maxima of the tiny probe (BF16 only: below FP16's range): amax / 448 is an fp32 subnormal for
#: all but the last. RCEIL picks 2^-126 for the first three (2^-127 is one too small: the maximum, above
#: 448 2^-127, saturates to 224 2^-126, where RNE gives 384, 256 (a tie) and 320 times 2^-126),
#: 2^-127 for the next two (the bottom of E8M0: amax = 448 2^-127 exactly, and one whose exponent
#: -128 is clamped), 2^-125 for the last; FLOOR picks 2^(floor(log2 amax) - 8), clamped for the fifth.
TINY_AMAX = (1.5 * 2.0**-118, 1.9375 * 2.0**-119, 1.25 * 2.0**-118, 1.75 * 2.0**-119, 1.5 * 2.0**-120, 1.5 * 2.0**-117)
#: the exponents E of the scale probes' block maxima (grid unit 2^(E - 18) >= 2^-12, maximum < 2^11:
#: exact in FP16)
SCALE_EXP = (6, 10)


@dataclass(frozen=True)
class Probe:
    site: str
    variant: str  # "grid", "step", "scale" or "tiny"

    @property
    def observed(self) -> tuple[str, ...]:
        return OBSERVED[self.site]

    @property
    def needs_backward(self) -> bool:
        return any(t != "out" for t in self.observed)

    @property
    def tag(self) -> str:
        return f"{self.site}:{self.variant}"

    def describe(self) -> str:
        return f"{SITE_WHAT[self.site]}, {VARIANT_WHAT[self.variant]}"


PROBES = tuple(Probe(s, "grid") for s in SITES) + tuple(Probe(s, "step") for s in STEP_SITES)
#: the scale-rule probes (:func:`scale_probes` picks those an input dtype can carry)
SCALE_PROBES = tuple(Probe(s, "scale") for s in SCALE_SITES) + (Probe("v_seq", "tiny"),)


def scale_probes(dtype: torch.dtype) -> tuple[Probe, ...]:
    """The scale-rule probes whose inputs ``dtype`` represents exactly (``tiny`` needs BF16's or
    fp32's exponent range)."""
    return tuple(p for p in SCALE_PROBES if p.variant != "tiny" or dtype != torch.float16)


def parse_probe(tag: str) -> Probe:
    site, _, variant = str(tag).partition(":")
    ok = site in SITES and (
        variant == "grid"
        or (variant == "step" and site in STEP_SITES)
        or (variant == "scale" and site in SCALE_SITES)
        or (variant == "tiny" and site == "v_seq")
    )
    if not ok:
        raise ConfigError(
            f"unknown rounding probe {tag!r}; sites {', '.join(SITES)} with :grid, "
            f"{', '.join(STEP_SITES)} also with :step, {', '.join(SCALE_SITES)} with :scale, v_seq with :tiny"
        )
    return Probe(site, variant)


class _Rng:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)

    def choice(self, options, n: int) -> list:
        idx = torch.randint(len(options), (n,), generator=self.g).tolist()
        return [options[i] for i in idx]

    def signs(self, n: int) -> torch.Tensor:
        return torch.randint(2, (n,), generator=self.g).to(torch.float64) * 2 - 1

    def balanced(self, n: int) -> torch.Tensor:
        """n signs, half +1 and half -1, in a random order."""
        s = torch.ones(n, dtype=torch.float64)
        s[n // 2 :] = -1
        return s[torch.randperm(n, generator=self.g)]

    def perm(self, n: int) -> list[int]:
        return torch.randperm(n, generator=self.g).tolist()

    def power(self, lo: int, hi: int) -> float:
        return 2.0 ** int(torch.randint(lo, hi + 1, (1,), generator=self.g))


def _probes(rng: _Rng, n: int, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """n positive probe magnitudes (input, rounded by the recipe) in units of the block's scale."""
    if variant == "grid":
        x = torch.tensor([m * UNIT for m in rng.choice(GRID_M, n)], dtype=torch.float64)
        return x, x.clone()
    sig = torch.tensor(rng.choice(STEP_SIG, n), dtype=torch.float64)
    k = torch.tensor(rng.choice(range(6), n), dtype=torch.float64)
    g = sig * torch.exp2(k)
    return g - torch.exp2(k) / 32, g


def _pair_positions(rng: _Rng, weights: torch.Tensor | None) -> list[tuple[int, int]]:
    """Two positions per 32-block for the +BIG / -BIG pair; with ``weights``, two positions of equal
    weight (so that the pair's products cancel in a sum weighted by them)."""
    pairs = []
    for b0 in range(0, PROBE_LEN, BLOCK):
        order = [b0 + i for i in rng.perm(BLOCK)]
        p0 = order[0]
        if weights is None:
            p1 = order[1]
        else:
            p1 = next(p for p in order[1:] if weights[p] == weights[p0])
        pairs.append((p0, p1))
    return pairs


def _seq_column(rng: _Rng, variant: str, weights: torch.Tensor | None, scale: float):
    """One column along the sequence: a +-BIG pair per block, probes elsewhere whose products with
    ``weights`` (default 1) are all positive. Returns (input, rounded) (L,) float64."""
    x = torch.zeros(PROBE_LEN, dtype=torch.float64)
    pairs = _pair_positions(rng, weights)
    taken = {p for pr in pairs for p in pr}
    rest = [p for p in range(PROBE_LEN) if p not in taken]
    mag, rnd = _probes(rng, len(rest), variant)
    w = torch.ones(PROBE_LEN, dtype=torch.float64) if weights is None else weights
    r = torch.zeros_like(x)
    for p0, p1 in pairs:
        x[p0], x[p1] = BIG, -BIG
        r[p0], r[p1] = BIG, -BIG
    idx = torch.tensor(rest)
    x[idx] = mag * w[idx]
    r[idx] = rnd * w[idx]
    return x * scale, r * scale


def _scale_column(rng: _Rng, weights: torch.Tensor | None, index: int) -> torch.Tensor:
    """One column along the sequence for the scale probe: per 32-block a +A / -A pair (equal weights:
    their products cancel whatever A rounds to), A = m 2^E with m = ``SCALE_SIG[index % 10]`` and E
    random, the same in both blocks (so that a scale per 64 positions or per column picks the block
    scale: the probe is about the rule, not the block length); the other 30 positions of a block hold
    grid probes m' 2^(E - 18), m' from :data:`SCALE_GRID_M`, signed so that their products with
    ``weights`` are positive. Returns the (L,) float64 input (the rounding depends on the rule)."""
    x = torch.zeros(PROBE_LEN, dtype=torch.float64)
    w = torch.ones(PROBE_LEN, dtype=torch.float64) if weights is None else weights
    pairs = _pair_positions(rng, weights)
    e = int(torch.randint(SCALE_EXP[0], SCALE_EXP[1] + 1, (1,), generator=rng.g))
    a = SCALE_SIG[index % len(SCALE_SIG)] * 2.0**e
    for b, (p0, p1) in enumerate(pairs):
        x[p0], x[p1] = a, -a
        rest = [p for p in range(b * BLOCK, (b + 1) * BLOCK) if p not in (p0, p1)]
        m = torch.tensor(rng.choice(SCALE_GRID_M, len(rest)), dtype=torch.float64)
        idx = torch.tensor(rest)
        x[idx] = m * 2.0 ** (e - 18) * w[idx]
    return x


def _tiny_column(rng: _Rng, index: int) -> torch.Tensor:
    """One column along the sequence for the tiny probe: one element per 32-block, of magnitude
    ``TINY_AMAX[index % 6]`` in both blocks and a random sign (nothing cancels it: its rounding is what
    O sees)."""
    x = torch.zeros(PROBE_LEN, dtype=torch.float64)
    for b in range(PROBE_LEN // BLOCK):
        pos = b * BLOCK + rng.perm(BLOCK)[0]
        x[pos] = float(rng.signs(1)[0]) * TINY_AMAX[index % len(TINY_AMAX)]
    return x


def _head_rows(
    rng: _Rng, variant: str, first: int, signs: torch.Tensor, scale_exp: tuple[int, int], *, fixed: bool = False
):
    """Rows whose head_dim block [first, first + 32) holds BIG in channel ``first`` and, in the next
    channels, probes a, b, c (grid) or x, g (step) that the pattern (+1, +1, -1) / (+1, -1) sends to
    0 once rounded; row i has the sign ``signs[i]`` and a random power-of-two scale (``fixed``: one
    scale and one set of probes for every row, so that rows of opposite sign sum to 0). Returns
    (input, rounded, pattern)."""
    n = signs.numel()
    x = torch.zeros(n, PROBE_DIM, dtype=torch.float64)
    r = torch.zeros_like(x)
    common = (rng.power(*scale_exp), rng.choice(TRIPLES, 1)[0], _probes(rng, 1, "step"))
    for i in range(n):
        power, triple, (mag, rnd) = (
            common if fixed else (rng.power(*scale_exp), rng.choice(TRIPLES, 1)[0], _probes(rng, 1, "step"))
        )
        s = float(signs[i]) * power
        x[i, first] = r[i, first] = BIG * s
        if variant == "grid":
            vals = torch.tensor(triple, dtype=torch.float64) * UNIT * s
            x[i, first + 1 : first + 4] = vals
            r[i, first + 1 : first + 4] = vals
        else:
            x[i, first + 1], x[i, first + 2] = mag[0] * s, rnd[0] * s
            r[i, first + 1], r[i, first + 2] = rnd[0] * s, rnd[0] * s
    pattern = torch.zeros(PROBE_DIM, dtype=torch.float64)
    if variant == "grid":
        pattern[first + 1 : first + 4] = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    else:
        pattern[first + 1 : first + 3] = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return x, r, pattern


def probe_tensors(
    probe: Probe | str, seed: int, rule: ScaleRule = ScaleRule.RCEIL
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(inputs, rounded): q, k, v, do as float64 (64, 1, 64) tensors, and the same with every probe
    replaced by the value the recipe's rounding gives it. Every value is exact in BF16, and but for the
    ``tiny`` probe's in FP16. The grid and step probes round alike under both scale rules; the scale
    and tiny probes are rounded by ``rule`` (the recipe's; the inputs do not depend on it).
    Fresh copies of a cached draw (the construction loops in Python; a suite asks for each twice)."""
    p = parse_probe(probe) if isinstance(probe, str) else probe
    if p.variant not in ("scale", "tiny"):
        rule = ScaleRule.RCEIL
    inputs, rounded = _probe_tensors(p, int(seed), rule)
    return {n: x.clone() for n, x in inputs.items()}, {n: x.clone() for n, x in rounded.items()}


#: the tensor each scale-probe site puts its columns in (blocked along the sequence, axis 0)
SCALE_TENSOR = {"v_seq": "v", "do_seq": "do", "k_seq": "k", "q_seq": "q"}


@functools.lru_cache(maxsize=256)
def _probe_tensors(p: Probe, seed: int, rule: ScaleRule):
    variant_key = ("grid", "step", "scale", "tiny").index(p.variant)
    rng = _Rng(seed * 1009 + SITES.index(p.site) * 31 + variant_key)
    if p.variant in ("scale", "tiny"):
        return _scale_tensors(rng, p, rule)
    L, D = PROBE_LEN, PROBE_DIM
    z = lambda: torch.zeros(L, D, dtype=torch.float64)  # noqa: E731
    t = {n: z() for n in ("q", "k", "v", "do")}
    r = {n: z() for n in ("q", "k", "v", "do")}
    site, variant = p.site, p.variant

    if site in ("qk", "dp"):
        # left operand rows carry probes in block [0, 32), right operand rows in block [32, 64);
        # the other side multiplies them by a signed pattern, so that S (dP) is 0 once rounded
        left, right = ("q", "k") if site == "qk" else ("do", "v")
        # qk: the kernel rounds P to E4M3 (relative steps of 2^-4 and more), which hides a small score
        # error; block scales 2^4..2^6 and a pattern of +-32 make a lost unit move the scores by 1/4
        # to 1 (natural units, softmax_scale 1/8 included), several P steps
        exps, kappa = ((4, 6), 32.0) if site == "qk" else ((0, 4), 1.0)
        eps_r, eps_l = kappa * rng.balanced(L), kappa * rng.balanced(L)
        xl, rl, pat_r = _head_rows(rng, variant, 0, rng.signs(L), exps)
        # dp: V's rows also make O; one scale, one set of probes and balanced signs keep O = 0 (so
        # that D = rowsum(dO * O) is 0 exactly, whatever the kernel rounds O to)
        xr, rr, pat_l = _head_rows(rng, variant, 32, rng.balanced(L), exps, fixed=site == "dp")
        t[left] = xl + eps_l[:, None] * pat_l[None, :]
        r[left] = rl + eps_l[:, None] * pat_l[None, :]
        t[right] = xr + eps_r[:, None] * pat_r[None, :]
        r[right] = rr + eps_r[:, None] * pat_r[None, :]
        if site == "qk":
            # V reads the row signs of both sides: a rounding that leaves S != 0 tilts the weights
            # towards one sign and O (exactly 0 when rounded right) moves
            t["v"][:, 0] = r["v"][:, 0] = torch.sign(eps_r)
            t["v"][:, 1] = r["v"][:, 1] = torch.sign(xr[:, 32])
        else:
            # Q and K in disjoint channels (scores 0); dQ reads dP against K, dK against Q
            t["k"][:, 40] = r["k"][:, 40] = torch.sign(eps_r)
            t["k"][:, 41] = r["k"][:, 41] = torch.sign(xr[:, 32])
            t["q"][:, 8] = r["q"][:, 8] = torch.sign(xl[:, 0])
            t["q"][:, 9] = r["q"][:, 9] = torch.sign(eps_l)
    elif site in ("v_seq", "do_seq"):
        name = "v" if site == "v_seq" else "do"
        for c in range(D):
            s = float(rng.signs(1)[0]) * rng.power(-2, 2)
            x, rr = _seq_column(rng, variant, None, s)
            t[name][:, c], r[name][:, c] = x, rr
    elif site in ("k_seq", "q_seq"):
        # V = eps e_0 (mean 0: O = 0, D = 0) and dO = d e_0 give dS_ij = d_i eps_j / 64 exactly
        eps, d = rng.balanced(L), rng.balanced(L)
        for n, vals in (("v", eps), ("do", d)):
            t[n][:, 0] = r[n][:, 0] = vals
        name, weights = ("k", eps) if site == "k_seq" else ("q", d)
        for c in range(D):
            s = float(rng.signs(1)[0]) * rng.power(-2, 2)
            x, rr = _seq_column(rng, variant, weights, s)
            t[name][:, c], r[name][:, c] = x, rr
    elif site == "ds":
        # V's channel 0 is w: a +-BIG pair and +- pairs of probes per block (sum 0: O = 0, D = 0);
        # dO = d e_0, so dS_ij = d_i w_j / 64 carries w's probes along keys; K = sign(w) tau, the
        # pair weighed equally, so that dQ = s d_i tau sum |probes| / 64
        w, kw = _paired_probes(rng)
        d, tau = rng.balanced(L), rng.signs(D)
        t["v"][:, 0] = r["v"][:, 0] = w
        t["do"][:, 0] = r["do"][:, 0] = d
        t["k"] = r["k"] = kw[:, None] * tau[None, :]
    elif site == "dst":
        # dO's channel 0 is z (a +-BIG pair and probes per block); V = eps e_0 (mean 0), so
        # dS_ij = z_i eps_j / 64 carries z's probes along queries; Q = sign(z) tau, the pair weighed
        # equally
        z_col, qw = _paired_probes(rng, zero_sum=False)
        eps, tau = rng.balanced(L), rng.signs(D)
        t["do"][:, 0] = r["do"][:, 0] = z_col
        t["v"][:, 0] = r["v"][:, 0] = eps
        t["q"] = r["q"] = qw[:, None] * tau[None, :]
    out = {n: v[:, None, :].clone() for n, v in t.items()}
    rounded = {n: v[:, None, :].clone() for n, v in r.items()}
    return out, rounded


def _scale_tensors(rng: _Rng, p: Probe, rule: ScaleRule):
    """The scale and tiny probes: the columns of one sequence-blocked input (:func:`_scale_column`,
    :func:`_tiny_column`), observed as in the grid probe of the same site (uniform weights; for
    k_seq / q_seq, V = eps e_0 and dO = d e_0 make dS_ij = d_i eps_j / 64). The rounded copy is that
    input quantized along the sequence by ``rule`` (E4M3, 32-blocks, RNE); the other inputs are +-1
    or 0, exact under any power-of-two scale the rule gives them."""
    L, D = PROBE_LEN, PROBE_DIM
    t = {n: torch.zeros(L, D, dtype=torch.float64) for n in ("q", "k", "v", "do")}
    weights = None
    if p.site in ("k_seq", "q_seq"):
        eps, d = rng.balanced(L), rng.balanced(L)
        t["v"][:, 0], t["do"][:, 0] = eps, d
        weights = eps if p.site == "k_seq" else d
    name = SCALE_TENSOR[p.site]
    for c in range(D):
        if p.variant == "tiny":
            t[name][:, c] = _tiny_column(rng, c)
        else:
            t[name][:, c] = _scale_column(rng, weights, c)
    r = {n: v.clone() for n, v in t.items()}
    r[name] = mx_fake_quantize(t[name], axis=0, block_size=BLOCK, elem=E4M3, rule=rule).to(torch.float64)
    return {n: v[:, None, :].clone() for n, v in t.items()}, {n: v[:, None, :].clone() for n, v in r.items()}


def _paired_probes(rng: _Rng, zero_sum: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A column of grid probes with a +-BIG pair per block (for a computed operand), and the weights
    that read it: +1 on the pair, sign(probe) elsewhere. ``zero_sum``: the probes come in +- pairs
    of one magnitude (the column sums to 0)."""
    col = torch.zeros(PROBE_LEN, dtype=torch.float64)
    pairs = _pair_positions(rng, None)
    taken = {p for pr in pairs for p in pr}
    rest = [p for p in range(PROBE_LEN) if p not in taken]
    for p0, p1 in pairs:
        col[p0], col[p1] = BIG, -BIG
    mag, _ = _probes(rng, len(rest), "grid")
    if zero_sum:
        signs = torch.tensor([1.0, -1.0] * (len(rest) // 2), dtype=torch.float64)
        mag = mag.view(-1, 2)[:, :1].expand(-1, 2).reshape(-1)
    else:
        signs = rng.signs(len(rest))
    order = torch.tensor(rest)[torch.tensor(rng.perm(len(rest)))]
    col[order] = mag * signs
    weights = torch.sign(col)
    for p0, p1 in pairs:
        weights[p0] = weights[p1] = 1.0
    return col, weights

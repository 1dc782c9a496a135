"""Rigorous a-priori elementwise error bounds of attention under a recipe's number formats.

Given the exact inputs (the kernel's bf16/fp16 tensors, read exactly in float64), the bound says how
far *any* kernel that follows the recipe may land from the exact result, element by element:

    |O_kernel - O_ref| <= B_O        |dQ_kernel - dQ_ref| <= B_dQ     (and dK, dV)

No statistics: every rounding is taken at its worst. The derivation is in docs/checks.md
("bound"); the code follows it step by step and names each quantity the same way.

Operand rounding model (:class:`OperandModel`). A GEMM operand x, rounded with a block scale
whose layout the checker does not know, obeys

    |x^ - x| <= u |x| + eta * a_line + eta_g * a_tensor + alpha

u: the element format's unit roundoff (saturation folded in where a scale rule saturates);
eta: the largest absolute rounding error of a subnormal (or flushed) element relative to its
block's amax; a_line: the amax of the whole line along the GEMM's contraction axis (it contains
every block of that line, whatever the layout: rigorous for any block size or alignment);
eta_g, a_tensor: the same for a scale shared by the whole tensor (per-tensor FP8 scaling, NVFP4's
fp32 global scale); alpha: the absolute underflow floor of a format without a scale (half its
smallest subnormal: FP16 2^-25, BF16 2^-134), for operands rounded to the input dtype. The outputs
are rounded to the input dtype with the same floor (u_out |x| + alpha_out).

Admitted formats (:class:`Admission`): a recipe may let a correct kernel hold some operands in a
second format that is wider than the nominal one in one respect; the BF16 recipe admits FP16
probabilities (P, P^T), finer than BF16 in the normal range but with an absolute floor of 2^-25
below 2^-14 (docs/checks.md, "FP16 probabilities in a BF16 recipe"). The model's operand models are
the union of both; ``RecipeBoundModel.nominal()`` is the model without the admission, which the
checks use only to count and name the elements that the admission alone accepts.

Forward (per document, head; exact S = s Q K^T, a = exp(S - m), A = a / L, L = sum_j a_ij):

    Delta_ij = s (rho_Q |K|^T + |Q| rho_K^T + rho_Q rho_K^T)_ij + s gamma_D (|Q|+rho_Q)(|K|+rho_K)^T_ij
               + fp32 exponent arithmetic                          (bound on |S^ - S|)
    tau_i    = (eta_P + eta_gP + alpha_P) e^{max_j Delta_ij}       (absolute rounding of P, row-max units)
    N_ij in [a e^{-Delta}(1-u_P) - tau, a e^{Delta}(1+u_P) + tau]  (numerator: rounded P)
    D_i  in [sum a e^{-Delta}(1-u_P) - n tau, sum a e^{Delta}(1+u_P) + n tau] (either normalizer)
    E_ij = max(N_hi/D_lo - A, A - max(N_lo, 0)/D_hi)               (bound on |A_kernel - A|)
    B_O  = E |V| + (A + E) rho_V + gamma_n (A + E)(|V| + rho_V) + u_out (|O| + B_O) + alpha_out

gamma_n is the GEMM accumulator's (``RecipeBoundModel.gamma``): fp32's n u32 / (1 - n u32), or a
sliced accumulator's (Hopper's E4M3 tensor cores, the ``fp8-mma`` recipe); the row sum l and D are
elementwise fp32 sums in every recipe.

Backward (FlashAttention-2 structure: recompute P from S and the saved log-sum-exp, dP = dO V^T,
D = rowsum(dO * O_kernel), dS = P (dP - D)); the rebuilt weights obey the same E:

    G_ij  = Delta^P_ij + Delta^D_i                                 (bound on |(dP - D)^ - (dP - D)|)
    Sig_ij = E (|g| + G) + A G                                     (bound on |dS^ - dS|, g = dP - D)
    B_dV  = sum_i [E |dO| + rho_PT (|dO| + rho_dO) + (A + E) rho_dO]   + gamma, u_out terms
    B_dQ  = s sum_j [(Sig + rho_dS)(|K| + rho_K) + |dS| rho_K]          + gamma, u_out terms
    B_dK  = s sum_i [(Sig + rho_dST)(|Q| + rho_Q) + |dS| rho_Q]         + gamma, u_out terms
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from flamia_verify.formats.constants import E4M3_MAX, E4M3_MIN_NORMAL
from flamia_verify.recipes.operands import Operand

__all__ = [
    "EXACT",
    "OperandModel",
    "RecipeBoundModel",
    "exact_operands_model",
    "Admission",
    "fp16_probabilities",
    "attention_bounds",
    "input_rounding",
    "output_rounding",
    "U32",
    "E4M3_ETA",
    "E2M1_ETA",
    "NVFP4_GLOBAL_ETA",
    "NVFP4_ALPHA",
    "E4M3_UNSCALED_ETA",
    "ALPHA_E8M0",
    "U_BF16",
    "ALPHA_BF16",
    "U_FP16",
    "ALPHA_FP16",
    "FP16_MIN_NORMAL",
    "U_E4M3",
    "U_E4M3_FLOOR",
    "U_E2M1",
]

U32 = 2.0**-24  # fp32 unit roundoff
# E4M3: half the smallest subnormal (2^-9 / 2) relative to a block maximum mapped to >= 2^7 = 128.
# MX RCEIL maps the amax into (224, 448]; FLAMIA's power-of-two P blocks into (128, 256]; a per-tensor
# fp32 scale amax/448 to 448. 2^-10 / 2^7 = 2^-17 covers all of them.
E4M3_ETA = 2.0**-17
# E4M3 without a scale, on values <= 1 (FlashAttention-3-style P): everything below 2^-10 may vanish.
E4M3_UNSCALED_ETA = 2.0**-10
# E2M1 with a UE4M3 block scale: the block amax maps into [6 / (1 + 2^-4), 6 / (1 - 2^-4)] (the scale is
# rounded to E4M3), the subnormal step is 0.5, so an element may move by 0.25 / (6 / (1 + 2^-4)) of the amax.
E2M1_ETA = 0.25 * (1 + 2.0**-4) / 6.0
# A UE4M3 block scale below E4M3's smallest normal (2^-6) only happens when the block amax is below
# 2^-6 / 448 of the global amax; such a block may lose everything, at most that much.
NVFP4_GLOBAL_ETA = E4M3_MIN_NORMAL / E4M3_MAX
# NVFP4's global scale has a floor of 2^-126 (formats.blocks, step 2): a row whose amax is below
# 2688 * 2^-126 gets smaller block scales than its amax asks for and may flush; no element of it moves
# by more than twice that amax
NVFP4_ALPHA = 2 * 2688.0 * 2.0**-126
# fp32 exponent arithmetic (scale * log2(e) in fp32, exp2, log2 of the sum): a few ulps of |S| + |m| + 1
EXP_SLACK = 2.0**-20
# E8M0's smallest scale 2^-127 times half of E4M3's smallest subnormal 2^-9: a block whose amax is below
# 448 * 2^-127 keeps that scale (the clamp), so its elements may move by this much, whatever the amax
ALPHA_E8M0 = 2.0**-137
# bf16 rounding of fp32 inputs in a BF16 GEMM: unit roundoff, and half the smallest subnormal 2^-133
U_BF16 = 2.0**-8
ALPHA_BF16 = 2.0**-134
# FP16 rounding without a scale: unit roundoff; below the smallest normal 2^-14 (6.1e-5) the spacing is the
# smallest subnormal 2^-24, so RNE moves an element by at most half of it, 2^-25 (3.0e-8), whatever its size
U_FP16 = 2.0**-11
ALPHA_FP16 = 2.0**-25
FP16_MIN_NORMAL = 2.0**-14
# relative fp32 rounding of the elementwise steps (products, the difference dP - D, the division by l)
REL32 = 8 * U32

U_E4M3 = 2.0**-4
U_E4M3_FLOOR = 2.0**-3  # saturation under FLOOR moves the largest elements by at most 1/8 (480 -> 448 at worst)
U_E2M1 = 2.0**-2


@dataclass(frozen=True)
class OperandModel:
    """|x^ - x| <= u |x| + eta * a_line + eta_g * a_tensor + alpha (see the module docstring).

    ``alpha``: absolute error floor of an unscaled format's underflow (half its smallest subnormal);
    RNE on FP16 has |x^ - x| <= 2^-11 |x| in the normal range and <= 2^-25 below 2^-14, so
    u |x| + 2^-25 bounds both. An element that is exactly representable gets rho = 0 regardless.

    ``exact_sig``: for power-of-two block scales (MX), an input element whose significand has at
    most 3 fraction bits and is at most ``exact_sig`` (1.875 under RCEIL, 1.75 under FLOOR, where
    1.875 x 2^8 = 480 saturates) and which lies within 2^-13 of its line maximum is represented
    exactly: multiplying by a power of two keeps the significand, and x / X >= 224 x / a >= 2^-6
    keeps it a normal E4M3 number. Such elements get rho = 0. None: no such guarantee (fp32 scales,
    NVFP4, computed operands).
    """

    u: float = 0.0
    eta: float = 0.0
    eta_g: float = 0.0
    exact_sig: float | None = None
    alpha: float = 0.0
    #: the recipe fixes this operand's rounding completely (MXFP8: E4M3 elements, 32-blocks along the
    #: contraction axis, an E8M0 scale by the recipe's rule, RNE), so that inputs can be built on which
    #: it is known in closed form (:mod:`flamia_verify.properties.mx_probes`)
    mx_block: bool = False

    def rho(
        self, x_abs: torch.Tensor, line_max: torch.Tensor | float, tensor_max: torch.Tensor | float
    ) -> torch.Tensor:
        r = self.u * x_abs
        if self.eta:
            r = r + self.eta * line_max
        if self.eta_g:
            r = r + self.eta_g * tensor_max
        if self.alpha:
            r = r + self.alpha
        if self.exact_sig is not None:
            mant, _ = torch.frexp(x_abs)  # x = mant * 2^e, mant in [0.5, 1)
            sig = 2 * mant
            sig8 = sig * 8
            on_grid = (sig8 == torch.floor(sig8)) & (sig <= self.exact_sig)
            # x / X >= 2^-6 also when the scale X is clamped at 2^-127: x >= 2^-133
            near_max = (x_abs >= line_max * 2.0**-13) & (x_abs >= 2.0**-133)
            r = torch.where(on_grid & near_max & (x_abs > 0), 0.0, r)
        return r

    def describe(self) -> str:
        text = f"u={self.u:.3g}, eta={self.eta:.3g}, eta_g={self.eta_g:.3g}"
        return text + (f", alpha={self.alpha:.3g}" if self.alpha else "")


EXACT = OperandModel()


@dataclass(frozen=True)
class Admission:
    """A second format that a correct kernel of a recipe may use for some operands, wider than the
    nominal format in one respect (FP16 probabilities in the BF16 recipe: an absolute underflow floor
    that BF16 does not have). The recipe's model already contains it (its operand models cover both
    formats); ``nominal`` holds the nominal format's models of the same operands, so that a check can
    count the elements that only the admission accepts and name it in the report.

    ``what``: the admission in a user's words, ``nominal_name`` the nominal format's, ``floor``: its absolute error per operand element (in
    the operand's own units: P <= 1), ``unit``: the size below which an element loses relative
    precision (FP16's smallest normal)."""

    what: str
    nominal: Mapping[Operand, OperandModel]
    #: the nominal format in a user's words ("all-BF16")
    nominal_name: str = "nominal"
    floor: float = 0.0
    unit: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "nominal", MappingProxyType(dict(self.nominal)))


def fp16_probabilities(nominal: OperandModel) -> tuple[OperandModel, Admission | None]:
    """The BF16 recipe's model of the probability operands P and P^T, which a correct kernel may hold
    in BF16 (``nominal``) or in FP16: (the model that covers both, the admission; None when FP16 adds
    nothing, e.g. on FP16 inputs where ``nominal`` is FP16 already).

    P and P^T are dimensionless and bounded by 1 (P = exp(S^ - running max) <= 1 in the forward,
    A = exp(S - lse) <= 1 in the backward), so FP16's underflow floor 2^-25 is a fixed fraction of
    their natural unit whatever the magnitudes of q, k, v and dO: |fl16(p) - p| <= 2^-11 p + 2^-25 <=
    u_nominal p + 2^-25 for u_nominal >= 2^-11. dS has no such unit (it scales with dO), so an
    unscaled FP16 dS is not admitted: it would flush every gradient of a small dO."""
    u = max(nominal.u, U_FP16)
    alpha = max(nominal.alpha, ALPHA_FP16)
    if u == nominal.u and alpha == nominal.alpha:
        return nominal, None
    wide = replace(nominal, u=u, alpha=alpha)
    what = "P and P^T held in FP16 (probabilities below its normal range 6.1e-5 keep an absolute precision of 3.0e-8)"
    ops = {Operand.P: nominal, Operand.PT: nominal}
    return wide, Admission(what, ops, nominal_name="all-BF16", floor=ALPHA_FP16, unit=FP16_MIN_NORMAL)


@dataclass(frozen=True)
class RecipeBoundModel:
    """The rounding model of every GEMM operand of a recipe, for one input dtype.

    ``operands``: an :class:`OperandModel` for every :class:`~flamia_verify.recipes.operands.Operand`
    (P's ``eta_g`` is relative to the row maximum of P); ``model[Operand.V_SEQ]`` reads one."""

    recipe: str
    operands: Mapping[Operand, OperandModel]
    u_out: float  # rounding of the outputs to the input dtype
    alpha_out: float = 0.0  # absolute floor of that rounding (half the input dtype's smallest subnormal)
    #: the GEMMs' accumulator: 0 for fp32 accumulation; else the contraction runs in slices of this
    #: many products, each summed with a relative error of at most ``u_slice`` of its sum of
    #: |products| and rounded to fp32, the slices added in fp32 (Hopper's E4M3 tensor cores)
    acc_slice: int = 0
    u_slice: float = 0.0
    #: second formats the recipe admits for some operands (:class:`Admission`), already in ``operands``
    admissions: tuple[Admission, ...] = ()
    #: fp32 arithmetic may flush to zero: every fp32 operand and result below this (FP32_MIN_NORMAL,
    #: 2^-126) may become 0, an absolute error below it per operand element and per operation (the
    #: FTZ/DAZ mode of GPU kernels; docs/checks.md, "Flush to zero"); 0: gradual underflow only
    ftz: float = 0.0

    def __post_init__(self):
        missing = [op.name for op in Operand if op not in self.operands]
        if missing:
            raise ValueError(f"{self.recipe}: no operand model for {', '.join(missing)}")
        object.__setattr__(self, "operands", MappingProxyType({op: self.operands[op] for op in Operand}))

    def __getitem__(self, op: Operand) -> OperandModel:
        return self.operands[op]

    def with_operands(self, changes: Mapping[Operand, OperandModel], **fields) -> RecipeBoundModel:
        """The model with the operand models in ``changes`` (and the other ``fields``) replaced; an
        admission of a replaced operand no longer describes the model and is dropped."""
        kept = tuple(a for a in self.admissions if not set(a.nominal) & set(changes))
        fields.setdefault("admissions", kept)
        return replace(self, operands={**self.operands, **changes}, **fields)

    def nominal(self) -> RecipeBoundModel:
        """The model without its admissions: every operand in the recipe's nominal format."""
        changes: dict[Operand, OperandModel] = {}
        for a in self.admissions:
            changes.update(a.nominal)
        return self.with_operands(changes, admissions=())

    def gamma(self, n: int) -> float:
        """The relative error of an n-long dot product's accumulation, against the sum of |products|:
        gamma_n of fp32, or for a sliced accumulator (1 + u_slice)(1 + u32)(1 + gamma_m) - 1 with
        m = ceil(n / acc_slice) slices added in fp32."""
        if not self.acc_slice:
            return _gamma(n)
        m = -(-n // self.acc_slice)
        return (1 + self.u_slice) * (1 + U32) * (1 + _gamma(m)) - 1

    def describe(self) -> dict[str, str]:
        return {op.key: model.describe() for op, model in self.operands.items()}


def exact_operands_model(model: RecipeBoundModel) -> RecipeBoundModel:
    """``model`` with every operand rounding the identity: what is left is fp32 accumulation, the fp32
    exponent arithmetic and the rounding of the outputs (to the input dtype). The bound of a kernel
    run on inputs that its roundings leave unchanged, read against the attention of those inputs."""
    return model.with_operands({op: EXACT for op in Operand}, recipe=f"{model.recipe} (operands exact)")


def _unit_roundoff(dtype: torch.dtype) -> float:
    """Round to nearest: half the spacing at 1 (bf16 2^-8, fp16 2^-11, fp32 2^-24, fp64 2^-53)."""
    return torch.finfo(dtype).eps / 2


def _underflow_floor(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of ``dtype`` (smallest normal x eps): RNE's absolute error bound
    below the normal range (bf16 2^-134, fp16 2^-25, fp32 2^-150; 0 for float64, where it underflows)."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps / 2


def input_rounding(dtype: torch.dtype) -> OperandModel:
    """Rounding to the input dtype without a scale (the computed operands P, P^T, dS, dS^T of a
    BF16/FP16 GEMM): FP16's underflow below 2^-14 is an absolute error of up to 2^-25 per element
    (docs/checks.md, "Underflow of FP16 operands")."""
    return OperandModel(_unit_roundoff(dtype), alpha=_underflow_floor(dtype))


def output_rounding(dtype: torch.dtype) -> tuple[float, float]:
    """(u_out, alpha_out): the rounding of the outputs to the input dtype."""
    return _unit_roundoff(dtype), _underflow_floor(dtype)


def _gamma(n: int) -> float:
    nu = n * U32
    return nu / (1 - nu) if nu < 1 else math.inf


@dataclass
class BoundResult:
    out: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    #: bound on the natural-log log-sum-exp of each row, (total_q, H); inf where a row sees no key
    lse: torch.Tensor | None = None


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0, 2)  # (L, H, D) -> (H, L, D)


def attention_bounds(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor | None,
    cu_q: list[int],
    cu_k: list[int],
    *,
    scale: float,
    causal: bool,
    model: RecipeBoundModel,
    ref_out: torch.Tensor,
    ref_grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> BoundResult:
    """Elementwise bounds B_O (and B_dQ, B_dK, B_dV when ``do`` and ``ref_grads`` are given).

    q: (total_q, H, D); k, v: (total_k, Hk, D); do: (total_q, H, D); all read exactly in float64.
    ref_out: float64 reference output; ref_grads: float64 (dq, dk, dv). Returns float64 bounds of
    the shapes of out, dq, dk, dv.
    """
    dev = ref_out.device
    f64 = torch.float64
    q64, k64, v64 = (t.detach().to(dev, f64) for t in (q, k, v))
    H, Hk, Dh = q64.shape[1], k64.shape[1], q64.shape[2]
    group = H // Hk
    mag = abs(scale)  # the sizes of the score terms: a negative scale flips the scores' sign, not their size
    # tensor-wide maxima (for per-tensor scales)
    tmax = {n: float(t.abs().max()) if t.numel() else 0.0 for n, t in (("q", q64), ("k", k64), ("v", v64))}
    # sequence-direction line maxima: per (head, channel) over every token of the packed tensor
    colmax_k = k64.abs().amax(dim=0) if k64.shape[0] else torch.zeros(Hk, Dh, dtype=f64, device=dev)
    colmax_v = v64.abs().amax(dim=0) if v64.shape[0] else torch.zeros(Hk, Dh, dtype=f64, device=dev)
    colmax_q = q64.abs().amax(dim=0) if q64.shape[0] else torch.zeros(H, Dh, dtype=f64, device=dev)
    want_grads = do is not None and ref_grads is not None
    if want_grads:
        do64 = do.detach().to(dev, f64)  # type: ignore[union-attr]  # want_grads: do is set
        tmax["do"] = float(do64.abs().max()) if do64.numel() else 0.0
        colmax_do = do64.abs().amax(dim=0) if do64.shape[0] else torch.zeros(H, Dh, dtype=f64, device=dev)
    m = model
    f = m.ftz  # flush to zero: each input element and each fp32 result may move by less than f
    B_out = torch.zeros_like(ref_out, dtype=f64)
    B_lse = torch.full(ref_out.shape[:2], math.inf, dtype=f64, device=dev)
    B_dq: torch.Tensor = torch.zeros_like(q64) if want_grads else None  # type: ignore[assignment]
    B_dk: torch.Tensor = torch.zeros((k64.shape[0], H, Dh), dtype=f64, device=dev) if want_grads else None  # type: ignore[assignment]
    B_dv: torch.Tensor = torch.zeros((k64.shape[0], H, Dh), dtype=f64, device=dev) if want_grads else None  # type: ignore[assignment]
    docs = []
    # pass 1: forward bound per document (and the pieces the backward needs)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        Q = _heads_first(q64[q0:q1])  # (H, lq, D)
        K = _heads_first(k64[k0:k1]).repeat_interleave(group, dim=0)  # (H, lk, D)
        V = _heads_first(v64[k0:k1]).repeat_interleave(group, dim=0)
        aQ, aK, aV = Q.abs(), K.abs(), V.abs()
        rQ = m[Operand.Q_HD].rho(aQ, aQ.amax(-1, keepdim=True), tmax["q"])
        rK = m[Operand.K_HD].rho(aK, aK.amax(-1, keepdim=True), tmax["k"])
        cvk = colmax_v.repeat_interleave(group, dim=0)[:, None, :]  # (H, 1, D)
        rV = m[Operand.V_SEQ].rho(aV, cvk, tmax["v"])
        rQ, rK, rV = rQ + f, rK + f, rV + f
        i = torch.arange(lq, device=dev)[:, None]
        j = torch.arange(lk, device=dev)[None, :]
        vis = (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool, device=dev)
        vis = vis.expand(H, lq, lk)
        S = scale * torch.matmul(Q, K.transpose(1, 2))
        S = torch.where(vis, S, -math.inf)
        row_has = vis.any(-1)  # (H, lq)
        mrow = S.amax(-1, keepdim=True)
        mrow = torch.where(torch.isfinite(mrow), mrow, 0.0)
        a = torch.where(vis, torch.exp(S - mrow), 0.0)
        L = a.sum(-1, keepdim=True)
        A = a / torch.where(L > 0, L, torch.ones_like(L))
        Sabs = torch.where(vis, S.abs(), 0.0)
        delta = mag * (
            torch.matmul(rQ, aK.transpose(1, 2))
            + torch.matmul(aQ, rK.transpose(1, 2))
            + torch.matmul(rQ, rK.transpose(1, 2))
        )
        # (H, lq, lk) sums accumulate in place (delta, like dPerr below, is a fresh tensor)
        delta += mag * m.gamma(Dh) * torch.matmul(aQ + rQ, (aK + rK).transpose(1, 2))
        delta += EXP_SLACK * (1 + Sabs + mrow.abs())
        delta += f
        delta = torch.where(vis, delta, 0.0)
        dmax = delta.amax(-1, keepdim=True)
        # alpha_P is absolute in the kernel's units of P = exp(S^ - running max) <= 1 (FlashAttention
        # rounds the unnormalized P): at most alpha_P of the row maximum, like eta_gP
        mP = m[Operand.P]
        tau = (mP.eta + mP.eta_g + mP.alpha + f) * torch.exp(dmax)
        n_vis = vis.sum(-1, keepdim=True).to(f64)
        up, ep, em = mP.u + REL32, torch.exp(delta), torch.exp(-delta)
        a_ep, a_em = a * ep, a * em  # shared by the numerator's and the normalizer's bounds
        N_hi = torch.where(vis, a_ep * (1 + up) + tau, 0.0)
        N_lo = torch.where(vis, (a_em * (1 - up) - tau).clamp_min(0), 0.0)
        gn = _gamma(lk)
        D_hi = (a_ep.sum(-1, keepdim=True) * (1 + up) + n_vis * tau) * (1 + gn)
        D_lo = (a_em.sum(-1, keepdim=True) * (1 - up) - n_vis * tau) * (1 - gn)
        A_hi = torch.where(D_lo > 0, N_hi / D_lo.clamp_min(1e-300), 1 + up)
        A_hi = torch.minimum(A_hi, A_hi.new_tensor(1 + up + tau.amax().item()))
        A_lo = N_lo / D_hi
        # lse = m + log(normalizer): the kernel's normalizer (of the scores it computed, rounded P or
        # not) lies in [D_lo, D_hi] in units of exp(m), the exact one is L
        Bl = torch.maximum(torch.log(D_hi / L.clamp_min(1e-300)), torch.log(L / D_lo.clamp_min(1e-300)))
        Bl = torch.where(D_lo > 0, Bl, math.inf) + REL32 * (1 + mrow.abs())
        B_lse[q0:q1] = torch.where(row_has, Bl[..., 0], math.inf).T
        E = torch.where(vis, torch.maximum(A_hi - A, A - A_lo).clamp_min(0), 0.0)
        AE = A + E
        Bo = torch.matmul(E, aV) + torch.matmul(AE, rV) + m.gamma(lk) * torch.matmul(AE, aV + rV)
        Bo = Bo * (1 + REL32) + 2 * f  # the normalized result and the output, flushed
        Oref = _heads_first(ref_out[q0:q1].to(f64))
        Bo = Bo + m.u_out * (Oref.abs() + Bo) + m.alpha_out
        Bo = torch.where(row_has[..., None], Bo, 0.0)
        B_out[q0:q1] = Bo.permute(1, 0, 2)
        docs.append((b, q0, q1, k0, k1, Q, K, V, aQ, aK, aV, rQ, rK, vis, A, E, AE, Bo, Oref))
    if not want_grads:
        return BoundResult(B_out, lse=B_lse)

    dq_ref, dk_ref, dv_ref = (t.to(dev, f64) for t in ref_grads)  # type: ignore[union-attr]
    # pass 2: dS pieces per document, then the global dS maximum (for per-tensor dS scales)
    pieces = []
    ms_max = 0.0
    for b, q0, q1, k0, k1, Q, K, V, aQ, aK, aV, rQ, rK, vis, A, E, AE, Bo, Oref in docs:
        dO = _heads_first(do64[q0:q1])
        adO = dO.abs()
        rdO = m[Operand.DO_HD].rho(adO, adO.amax(-1, keepdim=True), tmax["do"]) + f
        rVh = m[Operand.V_HD].rho(aV, aV.amax(-1, keepdim=True), tmax["v"]) + f
        dP = torch.matmul(dO, V.transpose(1, 2))
        Dref = (dO * Oref).sum(-1, keepdim=True)
        g = dP - Dref
        dPerr = (
            torch.matmul(rdO, aV.transpose(1, 2))
            + torch.matmul(adO, rVh.transpose(1, 2))
            + torch.matmul(rdO, rVh.transpose(1, 2))
        )
        dPerr += m.gamma(Q.shape[-1]) * torch.matmul(adO + rdO, (aV + rVh).transpose(1, 2))
        aO = Oref.abs()
        Derr = (adO * Bo).sum(-1, keepdim=True) + (rdO * (aO + Bo)).sum(-1, keepdim=True)
        Derr = Derr + _gamma(Q.shape[-1]) * ((adO + rdO) * (aO + Bo)).sum(-1, keepdim=True)
        G = dPerr + Derr + REL32 * (dP.abs() + Dref.abs()) + 2 * f
        dS = A * g
        gG = g.abs() + G
        Sig = E * gG + A * G + REL32 * AE * gG + 2 * f
        Sig = torch.where(vis, Sig, 0.0)
        adS = dS.abs()
        M = adS + Sig
        ms_max = max(ms_max, float(M.max()) if M.numel() else 0.0)
        pieces.append((dO, adO, g, dS, adS, Sig, M))
    for doc, (dO, adO, g, dS, adS, Sig, M) in zip(docs, pieces):
        (b, q0, q1, k0, k1, Q, K, V, aQ, aK, aV, rQ, rK, vis, A, E, AE, Bo, Oref) = doc
        lq, lk = Q.shape[1], K.shape[1]
        # dV = P^T dO: P^T blocked along queries (line = column of P), dO along queries
        cdo = colmax_do[:, None, :]
        rdOs = m[Operand.DO_SEQ].rho(adO, cdo, tmax["do"]) + f
        rPT = m[Operand.PT].rho(AE, AE.amax(dim=1, keepdim=True), 1.0 + float(E.max()) if E.numel() else 1.0)
        rPT = torch.where(vis, rPT + f, 0.0)
        Bdv = (
            torch.matmul(E.transpose(1, 2), adO)
            + torch.matmul(rPT.transpose(1, 2), adO + rdOs)
            + torch.matmul(AE.transpose(1, 2), rdOs)
        )
        Bdv = (Bdv + m.gamma(lq) * torch.matmul((AE + rPT).transpose(1, 2), adO + rdOs)) * (1 + REL32) + f
        # dQ = s dS K: dS blocked along keys (line = row of dS), K along keys
        ck = colmax_k.repeat_interleave(K.shape[0] // colmax_k.shape[0], dim=0)[:, None, :]
        rKs = m[Operand.K_SEQ].rho(aK, ck, tmax["k"]) + f
        rdS = m[Operand.DS].rho(M, M.amax(-1, keepdim=True), ms_max)
        rdS = torch.where(vis, rdS + f, 0.0)
        T = Sig + rdS
        Bdq = mag * (torch.matmul(T, aK + rKs) + torch.matmul(adS, rKs))
        Bdq = (Bdq + mag * m.gamma(lk) * torch.matmul(M + rdS, aK + rKs)) * (1 + REL32) + 2 * f
        # dK = s dS^T Q: dS^T blocked along queries (line = column of dS), Q along queries
        cq = colmax_q[:, None, :]
        rQs = m[Operand.Q_SEQ].rho(aQ, cq, tmax["q"]) + f
        rdST = m[Operand.DST].rho(M, M.amax(dim=1, keepdim=True), ms_max)
        rdST = torch.where(vis, rdST + f, 0.0)
        TT = Sig + rdST
        Bdk = mag * (torch.matmul(TT.transpose(1, 2), aQ + rQs) + torch.matmul(adS.transpose(1, 2), rQs))
        Bdk = (Bdk + mag * m.gamma(lq) * torch.matmul((M + rdST).transpose(1, 2), aQ + rQs)) * (1 + REL32)
        Bdk = Bdk + 2 * f
        B_dq[q0:q1] = Bdq.permute(1, 0, 2)
        B_dk[k0:k1] = Bdk.permute(1, 0, 2)
        B_dv[k0:k1] = Bdv.permute(1, 0, 2)
    # GQA: the kernel returns dK, dV summed over the query heads that share a kv head
    total_k = k64.shape[0]
    B_dk = B_dk.view(total_k, Hk, group, Dh).sum(2)
    B_dv = B_dv.view(total_k, Hk, group, Dh).sum(2)
    u = m.u_out
    a = m.alpha_out  # type: ignore[assignment]  # a float here, a tensor above
    B_dq = B_dq + u * (dq_ref.abs() + B_dq) + a
    B_dk = B_dk + u * (dk_ref.abs() + B_dk) + a
    B_dv = B_dv + u * (dv_ref.abs() + B_dv) + a
    return BoundResult(B_out, B_dq, B_dk, B_dv, lse=B_lse)

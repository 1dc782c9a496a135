"""consistency: does the backward differentiate the forward that ran?

On random N(0, 1) inputs the output-level identities (sum_j dK_j = 0, sum_j dV_j = sum_i dO_i) are
dominated by the rounding of the last GEMM's operands: relative residuals of 0.038 for a consistent
MXFP8 kernel and 0.046 for a mismatched one cannot be told apart. The checks below use inputs that
make a consistent kernel's residual vanish (or be bounded rigorously) while a mismatch stays
first-order (docs/checks.md "consistency" derives each):

    consistency.conservation_forward   V = c in every row (c = +-a, one magnitude on the E4M3 grid:
        exact under every scale any recipe admits): O_i = sum_j A~_ij c = sigma_i c, so O = c iff the
        forward's weights sum to one.
        A kernel that normalizes rounded P by the unrounded sum has sigma_i != 1 by up to u_P.
        Keys: one background key shared by all but the first key (a sink), so every background
        probability of a row rounds the same way and the errors add up instead of cancelling.
        threshold |O - c| / |c| <= 2 u_in + u_in^2 (the BF16 baseline's worst case: P rounded to
        the input dtype, fp32 row sum, |sigma - 1| <= u_in, then O rounded)
    consistency.shift_invariance       same inputs, dO = +-b 2^k_i with the signs of c (exact as V is),
        plus a constant key channel kappa where every query is 0 (a shift of all keys that leaves S
        unchanged) and a constant query channel where every key is 0. Then the exact
        dS_ij = A_ij dO_i . (c - O_i) vanishes for a consistent kernel, and
            dQ_i[d0]      = s kappa (sum_j A_ij) dO_i . (c - O_i)  reads each row's residual
            sum_j dK_j[d1] = s kappa_q sum_i (...)                 is the shift-invariance identity
        normalized by s |kappa| dO_i . c; threshold as above.
    consistency.conservation_backward  sum_j dV_j = sum_i dO_i on the base cases, normalized by
        the rigorous rounding budget of the dV GEMM (P^T and dO rounding); threshold 1.
    consistency.weights                V_j = e_j and dO_i = e_i (one-hot, exact everywhere): the
        forward's weights appear in O (O_ij = A~_ij) and the backward's in dV (dV_ji = A^_ij,
        rounded once as the P^T operand). Elementwise |dV_ji - O_ij| <= u_PT/(1-u_PT)|dV_ji| +
        (u_out/(1-u_out) + u_in)|O_ij| + eta_PT colmax + eta_g + alpha (FP16 underflow of P, P^T
        and O: 2^-25 each; P and P^T also under the BF16 recipe, which admits FP16 probabilities,
        the weights only that accepts counted as ``admitted_elements``): threshold 1. q x 4 spreads the
        scores, so a backward that rebuilds P from other operands differs by e^{dS} - 1 >> u.
    consistency.grad_forward_ratio     the gradient's normalized error (error family: error over the
        rounding model's prediction on the same inputs) over the forward's: a backward that does not
        differentiate the forward errs more than its formats explain while the forward does not.
        threshold 2^2 = 4 (each normalized error may sit anywhere in the model's factor-2 band; a
        forward below the band's lower edge 1/2, e.g. an fp32 output, counts as 1/2).
"""

from __future__ import annotations

import math

import torch

from flamia_verify.properties.cases import Case, Inputs, cu_from_lens, e4m3_grid, make_tensors
from flamia_verify.properties.checks.common.error_model import normalized_error
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.metrics import rel_rmse
from flamia_verify.properties.registry import register
from flamia_verify.properties.tolerances import ERROR_MODEL_FACTOR, conservation_tolerance
from flamia_verify.recipes.operands import Operand
from flamia_verify.settings import DTYPES

__all__ = ["constant_value_inputs", "one_hot_inputs"]

KEY_CHANNEL = 0  # the constant key channel (queries are 0 there)
QUERY_CHANNEL = 1  # the constant query channel (keys are 0 there)
KAPPA = 2.0  # both constants (E4M3-exact)


def constant_value_inputs(case: Case, *, sink: bool, device) -> Inputs:
    """V = c (per head and channel: one magnitude a on the E4M3 grid, a in [1/2, 2], random signs), dO
    = b 2^k_i with c's signs (b on the grid, k_i in {-1, 0, 1} per token); with ``sink``: every key of a
    document but the first equals one background key.

    One magnitude is what makes V and dO exact under every scale a recipe admits: any amax-based scale,
    fp32 (amax/448) or a power of two, per tensor, row, channel, head or block, maps +-a to +-448 times a
    power of two (the fp32 scale's own rounding aside, 2^-24), on the E4M3 and E2M1 grids alike. With
    magnitudes that differ from channel to channel, an fp32 scale of the whole tensor or row rounds V
    by up to E4M3's half step (1/16), which the fp8 recipe allows and a conservation check must not
    read as lost probability."""
    q, k, v, do = (t.float() for t in make_tensors(case))
    g = torch.Generator().manual_seed(case.seed * 7919 + 17)
    H, Hk, D = case.heads, case.heads_k, case.headdim
    a = e4m3_grid(torch.rand((), generator=g) * 1.5 + 0.5)
    c = a * torch.where(torch.randn(Hk, D, generator=g) < 0, -1.0, 1.0)
    v = c.expand(case.total_k, Hk, D).clone()
    c_q = c.repeat_interleave(H // Hk, dim=0)  # (H, D), the value each query head reads
    b = e4m3_grid(torch.rand((), generator=g) * 1.5 + 0.5)
    powers = 2.0 ** torch.randint(-1, 2, (case.total_q, 1, 1), generator=g).float()
    do = b * powers * torch.sign(c_q)
    q = q * 2.0
    if sink:
        start = 0
        for lk in case.lens_k:
            if lk > 1:
                k[start + 1 : start + lk] = k[start + 1]
                k[start] = k[start + 1] + torch.randn(Hk, D, generator=g)
            start += lk
    q[:, :, KEY_CHANNEL] = 0.0
    k[:, :, KEY_CHANNEL] = KAPPA
    q[:, :, QUERY_CHANNEL] = KAPPA
    k[:, :, QUERY_CHANNEL] = 0.0
    dt = DTYPES[case.dtype]
    return Inputs(
        case,
        *(t.to(dt).to(device) for t in (q, k, v, do)),
        cu_from_lens(case.lens_q, device),  # type: ignore[call-arg]
        cu_from_lens(case.lens_k, device),
    )


def _conservation_cases(ctx):
    return [
        (ctx.case((96,), heads=2, heads_k=1, causal=True, seed_offset=31), True),
        (ctx.case((40, 96), heads=2, heads_k=2, causal=False, seed_offset=32), True),
        (ctx.case((64, 130, 62), heads=2, heads_k=1, causal=True, seed_offset=33), False),
    ]


def _conservation_runs(ctx):
    def compute():
        runs = []
        cases = _conservation_cases(ctx)
        for n, (case, sink) in enumerate(cases):
            inp = constant_value_inputs(case, sink=sink, device=ctx.device)
            runs.append((case, sink, inp, ctx.run(inp)))
            ctx.progress((n + 1) / len(cases))
        return runs

    return ctx.memo(("conservation", ctx.has_backward), compute)


def _missing(res, names) -> str:
    return ", ".join(n for n in names if getattr(res, n) is None)


def _missing_gradient(ctx, names: str):
    """A gradient the identity needs is missing (interface.backward fails such a kernel): skip."""
    return ctx.skip(f"the kernel returned no {names}; this identity needs it (interface.backward reports it)")


def _visible_rows(case: Case) -> torch.Tensor:
    """(total_q,) bool: query rows that see at least one key."""
    rows = []
    for lq, lk in zip(case.lens_q, case.lens_k):
        i = torch.arange(lq)
        rows.append((i + (lk - lq) >= 0) & torch.tensor(lk > 0) if case.causal else torch.full((lq,), lk > 0))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)


@register(
    "consistency.conservation_forward",
    "probability conservation in the forward: with V = c in every row, O must equal c (the forward's "
    "weights sum to one; rounded P normalized by an unrounded sum does not)",
    defaults=lambda recipe, dtype: {"max_rel_dev": conservation_tolerance(dtype)},
    adjustable=("max_rel_dev",),
    cost=1.0,
)
def conservation_forward(ctx):
    worst, worst_rec = 0.0, None
    for case, sink, inp, res in _conservation_runs(ctx):
        c = inp.v[0].double().repeat_interleave(case.heads // case.heads_k, dim=0)  # (H, D)
        rows = _visible_rows(case).to(res.out.device)
        dev = (res.out.double() - c).abs() / c.abs()
        dev = torch.nan_to_num(dev, nan=math.inf)[rows]
        if dev.numel() and float(dev.max()) > worst:
            worst = float(dev.max())
            flat = int(dev.argmax())
            tok = int(torch.nonzero(rows).flatten()[flat // (case.heads * case.headdim)])
            h = (flat // case.headdim) % case.heads
            d = flat % case.headdim
            worst_rec = case_record(
                case,
                construction="V = c per head and channel" + (", sink keys" if sink else ""),
                token=tok,
                head=h,
                channel=d,
                kernel=float(res.out[tok, h, d]),
                expected=float(c[h, d]),
                rel_dev=worst,
            )
    return verdict(
        ctx,
        {"max_rel_dev": worst},
        ok_message=f"O = V exactly enough with V constant (max deviation {worst:.3g})",
        worst_case=worst_rec or {},
    )


@register(
    "consistency.shift_invariance",
    "softmax shift invariance: sum_j dK_j = 0 and dQ unchanged by a shift of all keys, read exactly on "
    "inputs where a consistent kernel's dS vanishes (V constant, a constant key and query channel)",
    defaults=lambda recipe, dtype: {
        "dq_key_shift": conservation_tolerance(dtype),
        "dk_sum": conservation_tolerance(dtype),
    },
    adjustable=("dq_key_shift", "dk_sum"),
    needs_backward=True,
    cost=0.5,
)
def shift_invariance(ctx):
    worst_q, worst_k, rec = 0.0, 0.0, None
    for case, sink, inp, res in _conservation_runs(ctx):
        missing = _missing(res, ("dq", "dk"))
        if missing:
            return _missing_gradient(ctx, missing)
        s = case.scale
        H, Hk = case.heads, case.heads_k
        c = inp.v[0].double().repeat_interleave(H // Hk, dim=0)
        doc = (inp.do.double() * c).sum(-1)  # (Tq, H), positive by construction
        rows = _visible_rows(case).to(res.out.device)
        rq = (res.dq[:, :, KEY_CHANNEL].double().abs() / (s * KAPPA * doc))[rows]
        rq = torch.nan_to_num(rq, nan=math.inf)
        if rq.numel() and float(rq.max()) > worst_q:
            worst_q = float(rq.max())
            rec = case_record(
                case,
                identity="dQ_i[key channel] = 0",
                construction="V constant, constant key channel",
                value=float(rq.max()),
            )
        cu_q, cu_k = inp.cu_q.tolist(), inp.cu_k.tolist()
        for b in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            if q1 == q0 or k1 == k0:
                continue
            dks = res.dk[k0:k1, :, QUERY_CHANNEL].double().sum(0)  # (Hk,)
            norm = (s * KAPPA * doc[q0:q1][rows[q0:q1]]).view(-1, Hk, H // Hk).sum((0, 2))
            r = (dks.abs() / norm.clamp_min(1e-300)).max()
            r = float(torch.nan_to_num(r, nan=math.inf))
            if r > worst_k:
                worst_k = r
                if worst_k > worst_q:
                    rec = case_record(case, identity="sum_j dK_j = 0", document=b, value=r)
    metrics = {"dq_key_shift": worst_q, "dk_sum": worst_k}
    return verdict(
        ctx, metrics, ok_message=f"residuals dQ {worst_q:.3g}, sum dK {worst_k:.3g} (relative)", worst_case=rec or {}
    )


def _doc_weights(inp: Inputs, ref_lse: torch.Tensor, b: int):
    """Exact float64 attention weights A (H, lq, lk) of document b."""
    c = inp.case
    cu_q, cu_k = inp.cu_q.tolist(), inp.cu_k.tolist()
    q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
    g = c.heads // c.heads_k
    Q = inp.q[q0:q1].double().permute(1, 0, 2)
    K = inp.k[k0:k1].double().permute(1, 0, 2).repeat_interleave(g, dim=0)
    S = c.scale * Q @ K.transpose(1, 2)
    lq, lk = q1 - q0, k1 - k0
    i = torch.arange(lq, device=S.device)[:, None]
    j = torch.arange(lk, device=S.device)[None, :]
    vis = (j <= i + (lk - lq)) if c.causal else torch.ones(lq, lk, dtype=torch.bool, device=S.device)
    lse = ref_lse[q0:q1].double().T[..., None]
    A = torch.where(
        vis & torch.isfinite(lse),
        torch.exp(S - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))),
        torch.zeros_like(S),
    )
    return A, (q0, q1, k0, k1)


@register(
    "consistency.conservation_backward",
    "probability conservation in the backward: sum_j dV_j = sum_i dO_i per document, head and channel, "
    "within the rigorous rounding budget of the dV GEMM",
    defaults=lambda recipe, dtype: {"budget_ratio": 1.0},
    adjustable=("budget_ratio",),
    needs_backward=True,
    cost=0.5,
)
def conservation_backward(ctx):
    model = ctx.bound_model
    m_pt, m_do = model[Operand.PT], model[Operand.DO_SEQ]
    worst, rec = 0.0, None
    cases = ctx.base_cases()
    for n, case in enumerate(cases):
        inp, res, ref = ctx.inputs(case), ctx.run(case), ctx.reference(case)
        if res.dv is None:
            return _missing_gradient(ctx, "dv")
        g = case.heads // case.heads_k
        do_all = inp.do.double()
        do_tmax = float(do_all.abs().max()) if do_all.numel() else 0.0
        colmax_do = do_all.abs().amax(0) if do_all.shape[0] else None
        for b in range(len(case.lens_q)):
            if case.lens_q[b] == 0 or case.lens_k[b] == 0:
                continue
            A, (q0, q1, k0, k1) = _doc_weights(inp, ref.lse, b)  # (H, lq, lk)
            dO = do_all[q0:q1].permute(1, 0, 2)  # (H, lq, D)
            rows = A.sum(-1) > 0  # (H, lq)
            lhs = res.dv[k0:k1].double().sum(0)  # (Hk, D)
            rhs = (dO * rows[..., None]).sum(1).view(case.heads_k, g, -1).sum(1)  # (Hk, D)
            resid = (lhs - rhs).abs()
            adO = dO.abs()
            rdo = m_do.rho(adO, colmax_do[:, None, :], do_tmax)  # type: ignore[index]  # set: a document has rows
            # per row: sum_j rho_PT(i, j) <= u_pt sum_j A + eta_pt sum_j colmax_j(A) + lk eta_g (+ u_in mismatch)
            colmax = A.amax(1, keepdim=True)  # (H, 1, lk)
            per_row = (m_pt.u + model.u_out) * A.sum(-1) + m_pt.eta * colmax.sum(-1)
            per_row = per_row + A.shape[-1] * (m_pt.eta_g + m_pt.alpha)  # alpha: P^T underflow per element
            gam = (max(A.shape[1], A.shape[2]) + 2) * 2.0**-24
            budget = ((adO + rdo) * (per_row[..., None] + gam)).sum(1) + (rdo * (1 + m_pt.u)).sum(1)
            # each of the lk dV elements is rounded to the output dtype: u_out relative, alpha_out absolute
            budget = budget.view(case.heads_k, g, -1).sum(1) + model.u_out * (lhs.abs() + rhs.abs())
            budget = budget + (k1 - k0) * model.alpha_out
            ratio = torch.nan_to_num(resid / budget.clamp_min(1e-300), nan=math.inf)
            r = float(ratio.max())
            if r > worst:
                worst = r
                hk, d = divmod(int(ratio.argmax()), ratio.shape[1])
                rec = case_record(
                    case,
                    identity="sum_j dV_j = sum_i dO_i",
                    document=b,
                    kv_head=hk,
                    channel=d,
                    sum_dv=float(lhs[hk, d]),
                    sum_do=float(rhs[hk, d]),
                    budget=float(budget[hk, d]),
                )
        ctx.progress((n + 1) / len(cases))
    return verdict(
        ctx,
        {"budget_ratio": worst},
        ok_message=f"sum dV - sum dO within {worst:.3g} of the rounding budget",
        worst_case=rec or {},
    )


def one_hot_inputs(case: Case, device, window: int | None = None) -> Inputs:
    """V_j = e_j (keys), dO_i = e_i (queries) within each document; q x 4 (spread scores).

    ``window`` w (documents longer than headdim D): only keys and queries w D .. (w + 1) D - 1 of each
    document are one-hot (V_j = e_(j - w D), dO_i = e_(i - w D)), the others 0. P and the P^T operand
    do not depend on V or dO, so the windows of one document read one set of weights between them."""
    q, k, _, _ = (t.float() for t in make_tensors(case))
    H, Hk, D = case.heads, case.heads_k, case.headdim
    v = torch.zeros(case.total_k, Hk, D)
    do = torch.zeros(case.total_q, H, D)
    lo = 0 if window is None else window * D

    def place(x, lens):
        start = 0
        for n in lens:
            pos = torch.arange(lo, min(n, lo + D) if window is not None else n)
            x[start + pos, :, pos - lo] = 1.0
            start += n

    place(v, case.lens_k)
    place(do, case.lens_q)
    dt = DTYPES[case.dtype]
    return Inputs(
        case,
        *((t.to(dt).to(device)) for t in (q * 4.0, k, v, do)),
        cu_from_lens(case.lens_q, device),  # type: ignore[call-arg]
        cu_from_lens(case.lens_k, device),
    )


def _weight_tables(ctx, case: Case):
    """Forward weights W (H, i, j) read from O and backward weights B (H, i, j) read from dV, per
    document: [(b, W, B)], or None when the kernel returns no dV. Documents longer than headdim are
    read in windows of headdim keys and queries, one run per window."""
    D = case.headdim
    n_win = max(1, -(-max(case.lens_q + case.lens_k) // D))
    windows = [None] if n_win == 1 else list(range(n_win))
    cu_q, cu_k = cu_from_lens(case.lens_q).tolist(), cu_from_lens(case.lens_k).tolist()
    W = [torch.zeros(case.heads, lq, lk, dtype=torch.float64) for lq, lk in zip(case.lens_q, case.lens_k)]
    B = [torch.zeros(case.heads, lq, lk, dtype=torch.float64) for lq, lk in zip(case.lens_q, case.lens_k)]
    for w in windows:
        inp = one_hot_inputs(case, ctx.device, window=w)
        res = ctx.run(inp)
        if res.dv is None:
            return None
        lo = 0 if w is None else w * D
        for b in range(len(case.lens_q)):
            q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            lq, lk = q1 - q0, k1 - k0
            if lq == 0 or lk == 0:
                continue
            hi_k, hi_q = (lk, lq) if w is None else (min(lk, lo + D), min(lq, lo + D))
            if hi_k > lo:  # O_i[c] = forward weight of key lo + c
                W[b][:, :, lo:hi_k] = res.out[q0:q1, :, : hi_k - lo].double().cpu().permute(1, 0, 2)
            if hi_q > lo:  # dV_j[c] = backward weight of query lo + c
                B[b][:, lo:hi_q, :] = res.dv[k0:k1, :, : hi_q - lo].double().cpu().permute(1, 2, 0)
    return [(b, W[b], B[b]) for b in range(len(case.lens_q)) if case.lens_q[b] and case.lens_k[b]]


@register(
    "consistency.weights",
    "the backward rebuilds the forward's attention weights: read the forward's from O (one-hot V) and "
    "the backward's from dV (one-hot dO), elementwise within the rounding of P^T",
    defaults=lambda recipe, dtype: {"weight_mismatch": 1.0},
    adjustable=("weight_mismatch",),
    needs_backward=True,
    cost=0.5,
)
def weights(ctx):
    D = ctx.settings.headdim
    L = min(64, D)
    # one document of several key tiles (4 x headdim keys: 256 at headdim 64) read window by window,
    # so that a backward that rebuilds P per 64- or 128-key tile cannot hide inside one tile
    L_long = 4 * D
    cases = [
        ctx.case((L,), heads=2, heads_k=2, causal=True, seed_offset=41),
        ctx.case((L - 24,), (L,), heads=2, heads_k=2, causal=True, seed_offset=42),
        ctx.case((L // 2, L), heads=2, heads_k=2, causal=False, seed_offset=43),
        ctx.case((L_long,), heads=2, heads_k=2, causal=True, seed_offset=44),
    ]
    model = ctx.bound_model
    # the recipe's nominal model, for counting the elements that only an admitted format accepts
    nominal = model.nominal() if model.admissions else None
    admitted, admitted_max, admitted_pairs = 0, 0.0, 0
    worst, rec = 0.0, None
    for n, case in enumerate(cases):
        tables = _weight_tables(ctx, case)
        if tables is None:
            return _missing_gradient(ctx, "dv")
        for b, W, B in tables:
            lq, lk = W.shape[1], W.shape[2]
            tol = _weight_tolerance(model, W, B)
            ratio = torch.where((B - W).abs() == 0, torch.zeros_like(W), (B - W).abs() / tol.clamp_min(1e-300))
            ratio = torch.nan_to_num(ratio, nan=math.inf)
            if nominal is not None:
                diff = (B - W).abs()
                adm = (ratio <= 1) & (diff > _weight_tolerance(nominal, W, B))
                if bool(adm.any()):
                    admitted += int(adm.sum())
                    admitted_pairs += int(adm.any(1).sum())  # (head, key) columns
                    admitted_max = max(admitted_max, float(diff[adm].max()))
            r = float(ratio.max())
            if r > worst:
                worst = r
                h, rem = divmod(int(ratio.argmax()), lq * lk)
                i, j = divmod(rem, lk)
                rec = case_record(
                    case,
                    construction="V_j = e_j, dO_i = e_i, q x 4"
                    + (
                        f" (read in windows of {case.headdim} keys and queries)"
                        if max(case.lens_k) > case.headdim
                        else ""
                    ),
                    document=b,
                    head=h,
                    query=i,
                    key=j,
                    forward_weight=float(W[h, i, j]),
                    backward_weight=float(B[h, i, j]),
                    tolerance=float(tol[h, i, j]),
                )
        ctx.progress((n + 1) / len(cases))
    metrics = {"weight_mismatch": worst}
    msg = f"backward weights match the forward's within {worst:.3g} of the P^T rounding"
    if nominal is not None:
        metrics["admitted_elements"] = admitted
        metrics["admitted_max_abs"] = admitted_max
        if admitted:
            what = " and ".join(a.what for a in model.admissions)
            msg += (
                f"; admitted {what}: {admitted} weights of {admitted_pairs} keys differ by up to "
                f"{admitted_max:.2g} (the weights are <= 1), outside the "
                f"{'/'.join(a.nominal_name for a in model.admissions)} tolerance, inside this one"
            )
    return verdict(ctx, metrics, ok_message=msg, worst_case=rec or {})


def _weight_tolerance(model, W: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The elementwise tolerance of |B - W| (backward weights B from dV, forward weights W from O) under
    ``model`` (the module docstring; docs/checks.md, "consistency.weights")."""
    m_pt = model[Operand.PT]
    u_pt, eta, eta_g, u_out = m_pt.u, m_pt.eta, m_pt.eta_g, model.u_out
    # absolute underflow floors (FP16: 2^-25 each): P^T in the backward, then the forward's P
    # (unnormalized, <= 1, divided by l >= 1) and O's rounding to the output dtype
    alpha = m_pt.alpha / (1 - u_pt) + model[Operand.P].alpha + model.alpha_out / (1 - u_out)
    # and dV's own rounding to the output dtype: a P^T element below FP16's normal range (2^-14; the
    # long document's small weights reach it) need not be an FP16 number, so dV moves it by up to
    # half the smallest subnormal (2^-25; 2^-134 for BF16)
    alpha = alpha + model.alpha_out
    colmax = B.abs().amax(1, keepdim=True)
    tol = (u_pt / (1 - u_pt)) * B.abs() + (u_out / (1 - u_out) + u_out) * W.abs()
    return tol + (eta * colmax + eta_g) / (1 - u_pt) + alpha + 2.0**-20 * (W.abs() + B.abs())


@register(
    "consistency.grad_forward_ratio",
    "gradient error over forward error, relative to what the recipe's RMS model predicts, compared with "
    "the BF16 baseline's same ratio",
    defaults=lambda recipe, dtype: {"normalized_ratio": ERROR_MODEL_FACTOR**2},
    adjustable=("normalized_ratio",),
    needs_backward=True,
    cost=0.2,
)
def grad_forward_ratio(ctx):
    worst, rec, rows = 0.0, None, []
    for case in ctx.base_cases():
        res, ref, base = ctx.run(case), ctx.reference(case), ctx.baseline(case)
        e_out, b_out = rel_rmse(res.out, ref.out), rel_rmse(base.out, ref.out)
        n_out = normalized_error(ctx, case, "out", e_out)
        # A forward more accurate than the model explains (a wider output dtype than q's, an exact
        # forward) says nothing against the backward: its normalized error counts at no less than
        # the lower edge 1/ERROR_MODEL_FACTOR of the model's band. Dividing by the raw value made a
        # correct kernel with an fp32 output fail by 10^4, and skipped an exact forward altogether.
        n_fwd = max(n_out, 1.0 / ERROR_MODEL_FACTOR)
        for t in ("dq", "dk", "dv"):
            if getattr(res, t) is None:
                continue
            e_t, b_t = rel_rmse(getattr(res, t), getattr(ref, t)), rel_rmse(getattr(base, t), getattr(ref, t))
            n_t = normalized_error(ctx, case, t, e_t)
            r = n_t / n_fwd
            rows.append({"case": case.describe(), "tensor": t, "normalized_ratio": r})
            if r > worst:
                worst = r
                rec = case_record(
                    case,
                    tensor=t,
                    kernel_grad_error=e_t,
                    kernel_out_error=e_out,
                    bf16_grad_error=b_t,
                    bf16_out_error=b_out,
                    normalized_grad_error=n_t,
                    normalized_out_error=n_out,
                )
    return verdict(
        ctx,
        {"normalized_ratio": worst},
        ok_message=f"gradient/forward error ratio {worst:.3g}x the model's",
        worst_case=rec or {},
        details={"per_case": rows},
    )

"""causal: no output or gradient may depend, by a single bit, on a position it must not see.

With causal attention (bottom-right aligned, offset = Lk - Lq), query i sees key j iff
j <= i + offset. So, inside one document:

    out_i, dQ_i  depend only on q_i, dO_i and keys j <= i + offset
    dK_j, dV_j   depend only on keys j and queries i >= j - offset

The checks replace everything a protected element must not see with adversarial values and
require the protected elements to be *bitwise* unchanged:

    causal.forward  q, k, v, dO after position t -> out[<= t]       (huge: x 1e4, tiny: x 1e-4)
    causal.dq       the same perturbations          -> dQ[<= t]
    causal.dk_dv    q and dO before position t      -> dK[>= t + offset], dV[>= t + offset]
    causal.nan      NaN in q and dO after t         -> out[<= t], dQ[<= t] unchanged and finite
    causal.diagonal the pair (query t, key t + offset) alone changed -> out_t, dQ_t (or dK, dV of
                    that key) change, and nothing on the other side of the diagonal does; rows that
                    see no key output 0 with 0 dQ (a mask that stops short leaks nothing: only this
                    check sees it)

Huge values change every block maximum they share a scale with (a V block of 32 positions that
straddles the diagonal, a per-tensor amax); tiny ones lower a maximum the future held.

Where. A block-scaled kernel gets causality wrong at one class of positions, so the checks perturb
documents of both offset signs (Lq < Lk, Lq > Lk), one packed off the 32-grid, one per head_dim of
the suite, at ``causal_positions`` and at every residue in ``causal_residues`` around every
``causal_block`` boundary of the query axis (t) and of the key axis (t + offset).

NaN placement. A FlashAttention-style kernel multiplies masked probabilities (exact zeros) with
masked V and dO rows inside its diagonal tile, and 0 * NaN = NaN; so NaN in a masked V or dO row
poisons every correct kernel, and so does NaN in a masked key for dQ (dS_ij = 0 times K_j). NaN in
later *queries* and later *upstream gradients* never enters a correct kernel's GEMM for an earlier
row: rows of S, dP and D are row-local. Those are the NaN poisons a correct kernel must survive; a
tensor-wide amax, or sequence blocks of Q rebuilt in the backward, turn them into leaks.
NaN in masked keys (forward only) is survived by kernels that mask scores with ``where``, but not
by torch's CPU SDPA (it adds the mask: NaN + -inf = NaN); it is measured and reported, and made a
requirement by the option ``require_nan_keys``.

    leakage map (causal.forward, t = 40):  row = t, column = query position, colour = changed elements
        positions 0..40 must be 0; positions > 40 are free to change (not drawn)
"""

from __future__ import annotations

import torch

from flamia_verify.properties.cases import Case, Inputs, cu_from_lens, long_document
from flamia_verify.properties.checks.common.noise import run_noise
from flamia_verify.properties.checks.common.verdict import case_record, verdict
from flamia_verify.properties.compare import compare_beyond_noise, compare_within, last_unit
from flamia_verify.properties.perturb import ADVERSARIAL, doc_bounds, future_inputs, perturb_rows
from flamia_verify.properties.registry import register

__all__: list[str] = []


def _causal_cases(ctx) -> list[tuple[Case, int]]:
    """(case, target document) pairs.

    Always one document of ``causal_len`` tokens (GQA 2:1) at every head_dim of ``causal_headdims``
    (a kernel may run another code path per head_dim). With ``causal_neighbours`` also: Lq < Lk
    (offset +17) and Lq > Lk (offset -17: the first 17 query rows see no key), so that the key grid
    and the query grid of the document differ, and the document packed between neighbours of 37
    and 20 tokens (it starts off the 32-grid of the pack).

    Every pack ends with a short document of :data:`DECODE_NEIGHBOUR` queries against
    ``DECODE_EXTRA`` keys more than the pack's longest key document: its Lk - Lq differs from the
    target's, and so does the pack's max_seqlen_k - max_seqlen_q (the target's offset plus
    ``DECODE_EXTRA``): a kernel that takes one causal offset per batch from the max_seqlens instead
    of each document's Lk - Lq moves the target's diagonal, and these checks see it."""
    s = ctx.settings
    L = s.causal_len
    dims = list(dict.fromkeys(s.causal_headdims)) or [ctx.settings.headdim]

    def case(lens_q, lens_k=None, **kw) -> Case:
        lens_k = lens_q if lens_k is None else lens_k
        if DECODE_NEIGHBOUR:
            lens_q, lens_k = (*lens_q, DECODE_NEIGHBOUR), (*lens_k, max(lens_k) + DECODE_EXTRA)
        return ctx.case(lens_q, lens_k, causal=True, **kw)

    out = [(case((L,), heads=2, heads_k=1, headdim=dims[0], seed_offset=11), 0)]
    if s.causal_neighbours:
        out.append((case((L - 17,), (L,), heads=2, heads_k=2, headdim=dims[0], seed_offset=12), 0))
        out.append((case((L,), (L - 17,), heads=2, heads_k=1, headdim=dims[0], seed_offset=14), 0))
        out.append((case((37, L, 20), heads=2, heads_k=1, headdim=dims[0], seed_offset=13), 1))
    for n, d in enumerate(dims[1:]):
        out.append((case((L,), heads=2, heads_k=1, headdim=d, seed_offset=16 + n), 0))
    return out


#: the queries of the short last document of every causal pack (:func:`_causal_cases`), and how many
#: keys it has beyond the pack's longest key document
DECODE_NEIGHBOUR = 9
DECODE_EXTRA = 29


def _long_case(ctx) -> Case:
    """The long document of the dimension cases (:func:`~flamia_verify.properties.cases.long_document`:
    64 queries against 2080 keys in the quick suite, 128 against 4160 in the others, 512 against 8320 on
    a GPU; bottom-right aligned, every row past 2016, 4032, 7808 keys), GQA 2:1, head_dim 64."""
    lq, lk = long_document(ctx.settings.name, ctx.device)
    return ctx.case((lq,), (lk,), heads=2, heads_k=1, headdim=64, causal=True, seed_offset=19)


def _long_positions(ctx, case: Case) -> list[tuple[int, tuple[str, ...]]]:
    """(t, perturbations) of the long document: the rows around the one whose last visible key is the
    first past the largest power of two below its key count (2048, 4096, 8192: where long-row paths
    switch on), a row 8 past it (its 32-key block straddles the diagonal), and the last row that has a
    later one. Only a few rows: every perturbation is a run of the whole long document."""
    lq, lk = case.lens_q[0], case.lens_k[0]
    off = lk - lq
    edge = 1 << (lk - 1).bit_length() - 1  # the largest power of two below lk
    tb = edge - off  # the row whose last visible key is key `edge`
    ts = {tb - 1: ("huge",), tb: tuple(ADVERSARIAL), tb + 8: ("huge",), lq - 2: ("huge",)}
    return sorted((t, kinds) for t, kinds in ts.items() if 0 <= t <= lq - 2)


def _last_unit_note(metrics: dict) -> str:
    n = metrics.get("long_last_unit_changes", 0)
    if not n:
        return ""
    return f" ({n} elements of the long document moved by one unit in the last place: another summation order)"


def _grid_points(length: int, start: int, block: int, residues) -> set[int]:
    """Positions of a document axis (``length`` tokens, first token at packed position ``start``)
    at ``residues`` from every block boundary: multiples of ``block`` from the document start
    (blocks that restart at documents), the document end, and, for a document that starts off
    the grid, multiples of ``block`` of the packed axis."""
    if block <= 0 or length <= 0:
        return set()
    bounds = set(range(block, length, block)) | {length}
    if start % block:
        bounds |= set(range((start // block + 1) * block - start, length, block))
    return {p + r for p in bounds for r in residues if 0 <= p + r < length}


def _positions(ctx, case: Case, b: int, direction: str = "future") -> list[tuple[int, tuple[str, ...]]]:
    """(t, perturbations) probed in document b.

    ``causal_positions`` (t = 0, positions inside blocks) take every adversarial kind. Every block
    boundary of the query axis (t) and of the key axis (t + offset) adds its ``causal_residues``
    (block ends and starts), and a document with rows that see no key adds the last such row and
    the first row that sees one; these take the huge values, which move every scale the replaced
    positions share (tiny values only move a maximum the replaced positions held).
    ``direction``: "future" (t < Lq - 1: something after t to replace) or "past" (t >= 1)."""
    s = ctx.settings
    q0, q1, k0, k1 = doc_bounds(case, b)
    lq, lk = q1 - q0, k1 - k0
    off = lk - lq
    lo, hi = (0, lq - 2) if direction == "future" else (1, lq - 1)
    extra = {t for t in s.causal_positions if lo <= t <= hi}
    grid = _grid_points(lq, q0, s.causal_block, s.causal_residues)
    grid |= {p - off for p in _grid_points(lk, k0, s.causal_block, s.causal_residues)}
    if off < 0:
        grid |= {-off - 1, -off}
    grid = {t for t in grid if lo <= t <= hi} - extra
    jobs = [(t, tuple(ADVERSARIAL)) for t in extra] + [(t, ("huge",)) for t in grid]
    return sorted(jobs)


def _nan_positions(ctx, case: Case, b: int) -> list[int]:
    """Positions t of causal.nan: ``causal_positions`` and, where the first query rows see no key
    (Lq > Lk), the last of them and the first row that sees a key (rows that output 0 stay 0)."""
    q0, q1, k0, k1 = doc_bounds(case, b)
    lq, off = q1 - q0, (k1 - k0) - (q1 - q0)
    ts = set(ctx.settings.causal_positions) | ({-off - 1, -off} if off < 0 else set())
    return sorted(t for t in ts if 0 <= t < lq - 1)


def _future_runs(ctx):
    """Base and perturbed runs shared by causal.forward and causal.dq."""

    def compute():
        runs = []
        cases = _causal_cases(ctx)
        jobs = [(c, b, t, kind) for c, b in cases for t, kinds in _positions(ctx, c, b, "future") for kind in kinds]
        long = _long_case(ctx)
        jobs += [(long, 0, t, kind) for t, kinds in _long_positions(ctx, long) for kind in kinds]
        for n, (case, b, t, kind) in enumerate(jobs):
            base = ctx.run(case)
            inp = future_inputs(ctx.inputs(case), b, t, kind, seed=case.seed * 1009 + t)
            runs.append((case, b, t, kind, base, ctx.run(inp)))
            ctx.progress((n + 1) / len(jobs))
        return runs

    return ctx.memo(("causal-future", ctx.has_backward), compute)


def _leak_report(ctx, runs, tensor: str, direction: str, what: str):
    """Compare ``tensor`` on the protected rows of every run; build metrics, worst case, heatmaps.

    Bitwise, except on the long document (:func:`_long_case`), where a protected element may move by
    one unit in its last place: rows of thousands of keys are summed in another order from call to
    call by split-K and atomics kernels (reproducibility, which determinism.repeat asks; measured: a
    dQ summed over key tiles in a random order past 1024 keys changes 1 of 8064 protected elements
    by one unit between two calls), while a leak through a shared scale or a maximum over masked
    keys moves them by a rounding of the recipe's format or more. Those last-unit changes are counted
    (``long_last_unit_changes``), not failed."""
    long = _long_case(ctx)
    last_units = 0
    leaked_elements = 0
    leaking = 0
    first = None
    maps: dict = {}
    for case, b, t, kind, base, new in runs:
        q0, q1, k0, k1 = doc_bounds(case, b)
        off = (k1 - k0) - (q1 - q0)
        x_new, x_base = getattr(new, tensor), getattr(base, tensor)
        if x_new is None or x_base is None:
            continue
        if direction == "future":  # rows of queries at or before t
            lo, hi = q0, q0 + t + 1
        else:  # keys at or after t + offset
            lo, hi = max(k0, k0 + t + off), k1
        region = torch.zeros(x_new.shape[0], dtype=torch.bool, device=x_new.device)
        region[lo:hi] = True
        cu = cu_from_lens(case.lens_q if tensor in ("out", "dq") else case.lens_k).tolist()
        noise = _noise(ctx, case, base).get(tensor)
        m = compare_beyond_noise(x_new, x_base, noise, what=f"{what}", region=region[:, None, None], cu_seqlens=cu)
        if case == long and not m.ok:  # the last unit may move (another summation order)
            bits = m.mismatched
            m = compare_within(
                torch.where(region[:, None, None], x_new.double(), x_base.double()),
                x_base.double(),
                last_unit(x_base),
                what=f"{what} (beyond one unit in the last place)",
                rule="within one unit in the last place",
                cu_seqlens=cu,
                against="the unperturbed run",
            )
            m.total = int(region[:, None, None].expand_as(x_base).sum())
            last_units += bits - m.mismatched
        changed = m.mask.flatten(1).sum(dim=1) if m.mask is not None else torch.zeros(x_new.shape[0])
        key = (case, b, kind)
        doc_start = q0 if tensor in ("out", "dq") else k0
        doc_len = (q1 - q0) if tensor in ("out", "dq") else (k1 - k0)
        maps.setdefault(key, []).append((t, changed[doc_start : doc_start + doc_len].cpu().tolist()))
        if not m.ok:
            leaked_elements += m.mismatched
            leaking += 1
            if first is None:
                first = case_record(
                    case,
                    tensor=tensor,
                    document=b,
                    t=t,
                    perturbation=kind,
                    perturbed="q, k, v, dO after t" if direction == "future" else "q, dO before t",
                    protected=f"{tensor} rows [{lo - doc_start}, {hi - doc_start}) of document {b}",
                    mismatch=m.to_dict(),
                    summary=m.summary(),
                )
    heatmaps = []
    for (case, b, kind), rows in maps.items():
        heatmaps.append(
            {
                "title": f"{tensor} leakage map, {kind} perturbation ({case.describe()}, document {b})",
                "x_label": "position in document",
                "y_label": "perturbation position t",
                "z_label": "changed elements (protected positions)",
                "z": [r for _, r in rows],
                "y": [f"t={t}" for t, _ in rows],
            }
        )
    metrics = {
        "leaked_elements": leaked_elements,
        "leaking_perturbations": leaking,
        "perturbations": len(runs),
        "long_last_unit_changes": last_units,
    }
    return metrics, first, heatmaps


@register(
    "causal.forward",
    "out at or before position t is bitwise unchanged when q, k, v, dO after t are replaced by huge "
    "or tiny values (shared V scales, per-tensor amax)",
    defaults=lambda recipe, dtype: {"leaked_elements": 0},
    cost=3.0,
)
def forward(ctx):
    runs = _future_runs(ctx)
    metrics, first, maps = _leak_report(ctx, runs, "out", "future", "out at/before t")
    return verdict(
        ctx,
        metrics,
        ok_message=f"out at/before t bitwise unchanged under {len(runs)} future perturbations"
        + _last_unit_note(metrics),
        first=first,
        details={"heatmaps": maps},
    )


@register(
    "causal.dq",
    "dQ at or before position t is bitwise unchanged when q, k, v, dO after t change (sequence "
    "blocks of K in dQ = dS K)",
    defaults=lambda recipe, dtype: {"leaked_elements": 0},
    needs_backward=True,
    cost=0.5,
)
def dq(ctx):
    runs = _future_runs(ctx)
    metrics, first, maps = _leak_report(ctx, runs, "dq", "future", "dq at/before t")
    return verdict(
        ctx,
        metrics,
        ok_message=f"dQ at/before t bitwise unchanged under {len(runs)} future perturbations"
        + _last_unit_note(metrics),
        first=first,
        details={"heatmaps": maps},
    )


@register(
    "causal.dk_dv",
    "dK and dV at or after key t + offset are bitwise unchanged when q and dO before t change "
    "(sequence blocks of Q in dK = dS^T Q and dO in dV = P^T dO)",
    defaults=lambda recipe, dtype: {"leaked_elements": 0},
    needs_backward=True,
    cost=3.0,
)
def dk_dv(ctx):
    cases = _causal_cases(ctx)
    jobs = [(c, b, t, kind) for c, b in cases for t, kinds in _positions(ctx, c, b, "past") for kind in kinds]
    long = _long_case(ctx)  # one row of the long document: the first past the power of two
    jobs += [(long, 0, t, "huge") for t, kinds in _long_positions(ctx, long)[1:2]]
    runs = []
    for n, (case, b, t, kind) in enumerate(jobs):
        inp = ctx.inputs(case)
        q0, q1, _, _ = doc_bounds(case, b)
        g = torch.Generator().manual_seed(case.seed * 2003 + t)
        new = inp.replace(
            q=perturb_rows(inp.q, slice(q0, q0 + t), kind, g), do=perturb_rows(inp.do, slice(q0, q0 + t), kind, g)
        )
        runs.append((case, b, t, kind, ctx.run(case), ctx.run(new)))
        ctx.progress((n + 1) / len(jobs))
    m_k, first_k, maps_k = _leak_report(ctx, runs, "dk", "past", "dk at/after t")
    m_v, first_v, maps_v = _leak_report(ctx, runs, "dv", "past", "dv at/after t")
    metrics = {
        "leaked_elements": m_k["leaked_elements"] + m_v["leaked_elements"],
        "leaked_dk": m_k["leaked_elements"],
        "leaked_dv": m_v["leaked_elements"],
        "leaking_perturbations": max(m_k["leaking_perturbations"], m_v["leaking_perturbations"]),
        "perturbations": len(runs),
    }
    first = first_k or first_v
    return verdict(
        ctx,
        metrics,
        ok_message=f"dK, dV at/after t bitwise unchanged under {len(runs)} perturbations of earlier queries",
        first=first,
        details={"heatmaps": maps_k + maps_v},
    )


@register(
    "causal.nan",
    "NaN in q and dO after position t leaves out and dQ at or before t bitwise unchanged and finite "
    "(NaN in masked keys is measured; required with the option require_nan_keys)",
    defaults=lambda recipe, dtype: {"leaked_elements": 0, "nonfinite": 0},
    options={"require_nan_keys": False},
    cost=1.5,
)
def nan(ctx):
    jobs = [(c, b, t) for c, b in _causal_cases(ctx) for t in _nan_positions(ctx, c, b)]
    runs, key_runs = [], []
    for n, (case, b, t) in enumerate(jobs):
        base = ctx.run(case)
        inp = future_inputs(ctx.inputs(case), b, t, "nan", seed=0, tensors=("q", "do"))
        runs.append((case, b, t, "nan", base, ctx.run(inp)))
        kin = future_inputs(ctx.inputs(case), b, t, "nan", seed=0, tensors=("k",))
        key_runs.append((case, b, t, "nan-keys", base, ctx.run(kin, backward=False)))
        ctx.progress((n + 1) / len(jobs))
    m_out, first_out, maps_out = _leak_report(ctx, runs, "out", "future", "out at/before t (NaN q, dO after t)")
    m_dq, first_dq, maps_dq = _leak_report(ctx, runs, "dq", "future", "dq at/before t (NaN q, dO after t)")
    m_key, first_key, _ = _leak_report(ctx, key_runs, "out", "future", "out at/before t (NaN keys after t)")
    nonfinite = 0
    for case_, b_, t, _, base, new in runs:
        q0 = doc_bounds(case_, b_)[0]
        for name in ("out", "dq"):
            x = getattr(new, name)
            if x is not None:
                nonfinite += int((~torch.isfinite(x[q0 : q0 + t + 1])).sum())
    metrics = {
        "leaked_elements": m_out["leaked_elements"] + m_dq["leaked_elements"],
        "nonfinite": nonfinite,
        "nan_keys_leaked_elements": m_key["leaked_elements"],
        "perturbations": len(runs),
    }
    extra = []
    first = first_out or first_dq
    if first:
        extra.append(first["summary"])
    if ctx.opt.get("require_nan_keys") and first_key:
        extra.append("NaN in masked keys reached earlier outputs: " + first_key["summary"])
        first = first or first_key
    msg = f"out, dQ at/before t unchanged and finite with NaN in later q and dO ({len(runs)} positions)"
    if m_key["leaked_elements"]:
        msg += f"; NaN in masked keys changed {m_key['leaked_elements']} earlier outputs (not required)"
    return verdict(
        ctx,
        metrics,
        ok_message=msg,
        worst_case=first or first_key or {},
        details={"heatmaps": maps_out + maps_dq},
        failures=extra,
    )


# ----------------------------------------------------------------------------------------------
# causal.diagonal: the visible region ends exactly at the diagonal (neither later nor earlier)
# ----------------------------------------------------------------------------------------------


def _diagonal_rows(ctx, case: Case, b: int) -> list[int]:
    """Query rows t probed by causal.diagonal: ``causal_positions`` whose diagonal key t + offset
    exists, and the first row that sees a key when Lq > Lk."""
    q0, q1, k0, k1 = doc_bounds(case, b)
    lq, lk = q1 - q0, k1 - k0
    off = lk - lq
    ts = set(ctx.settings.causal_positions) | ({-off} if off < 0 else set())
    return sorted(t for t in ts if 0 <= t < lq and 0 <= t + off < lk)


def _aligned(x: torch.Tensor, target: torch.Tensor, scale: float) -> torch.Tensor:
    """A multiple of x (float64, (D,)) whose score against x is ``target``: scale * (c x) . x = target."""
    nrm = float(x @ x)
    return x if nrm == 0.0 else x * (float(target) / (scale * nrm))


def _diagonal_probe(inp: Inputs, b: int, t: int, which: str, seed: int) -> Inputs:
    """Inputs whose only change is at the diagonal pair (query t, key d = t + offset) of document b.

    ``which="key"``: key d is turned towards query t (its score equals the row's largest score
    over the keys t sees, per kv head, through that head's first query head), value d is replaced
    by huge values: out_t and dQ_t must change, rows before t (which do not see key d) must not.
    ``which="query"``: query t is turned towards key d the same way (per query head) and dO_t is
    replaced by huge values: dK_d and dV_d must change, keys after d (which query t does not see)
    must not. The probed probability is of the order of 1/2 by construction, so a correct kernel's
    change is far above any rounding, in every format."""
    case = inp.case
    q0, q1, k0, k1 = doc_bounds(case, b)
    d = t + (k1 - k0) - (q1 - q0)
    groups = case.heads // case.heads_k
    g = torch.Generator().manual_seed(seed)
    q, k = inp.q.double(), inp.k.double()
    seen = k[k0 : k0 + d + 1]  # keys query t sees: (d + 1, Hk, D)
    if which == "key":
        new_k = inp.k.clone()
        for hk in range(case.heads_k):
            qt = q[q0 + t, hk * groups]
            s = (seen[:, hk] @ qt) * case.scale
            new_k[k0 + d, hk] = _aligned(qt, s.max(), case.scale).to(inp.k.dtype).to(inp.k.device)
        return inp.replace(k=new_k, v=perturb_rows(inp.v, slice(k0 + d, k0 + d + 1), "huge", g))
    new_q = inp.q.clone()
    for h in range(case.heads):
        kd = k[k0 + d, h // groups]
        s = (seen[:, h // groups] @ q[q0 + t, h]) * case.scale
        new_q[q0 + t, h] = _aligned(kd, s.max(), case.scale).to(inp.q.dtype).to(inp.q.device)
    return inp.replace(q=new_q, do=perturb_rows(inp.do, slice(q0 + t, q0 + t + 1), "huge", g))


def _noise(ctx, case: Case, base) -> dict[str, float | None]:
    """The kernel's run-to-run noise on ``case`` (``base`` its cached run): None everywhere for a
    kernel that repeats itself bitwise, where the causal checks stay bitwise."""
    return run_noise(ctx, ("case", case), base, lambda: ctx.run(case, cache=False))


def _rows_changed(new: torch.Tensor, base: torch.Tensor, lo: int, hi: int, noise: float | None = None) -> int:
    """Elements of rows [lo, hi) whose bits differ (-0.0 read as +0.0) and, for a tensor that is not
    bitwise repeatable, that moved beyond its run-to-run ``noise``."""
    if hi <= lo:
        return 0
    region = torch.zeros(new.shape[0], dtype=torch.bool, device=new.device)
    region[lo:hi] = True
    return compare_beyond_noise(new, base, noise, region=region[:, None, None]).mismatched


@register(
    "causal.diagonal",
    "the visible region ends exactly at the diagonal: out and dQ of query t change when only key "
    "t + offset (the last key it sees) changes, and earlier rows do not; dK and dV of key d change "
    "when only query d - offset (the first query that sees it) changes, and later keys do not; "
    "query rows that see no key (Lq > Lk) output 0 with 0 dQ",
    defaults=lambda recipe, dtype: {"missed": 0, "leaked_elements": 0, "nonzero_unseen": 0},
    cost=1.0,
)
def diagonal(ctx):
    cases = _causal_cases(ctx)
    jobs = [
        (c, b, t, which)
        for c, b in cases
        for t in _diagonal_rows(ctx, c, b)
        for which in ("key", "query")
        if which == "key" or ctx.has_backward
    ]
    missed, leaked, unseen, first, findings = 0, 0, 0, None, []
    for case, b in cases:  # rows that see no key: out 0, dQ 0 (bitwise, -0.0 read as +0.0)
        q0, q1, k0, k1 = doc_bounds(case, b)
        n0 = max(0, (q1 - q0) - (k1 - k0))
        base = ctx.run(case)
        for name in ("out", "dq"):
            x = getattr(base, name)
            if x is None or n0 == 0:
                continue
            bad = int((x[q0 : q0 + n0] != 0).sum())  # NaN counts as non-zero
            if bad:
                unseen += bad
                findings.append(
                    case_record(
                        case,
                        document=b,
                        tensor=name,
                        problem=f"{bad} elements of {name} rows [0, {n0}) that see no key are not 0",
                        summary=f"{name} of query rows that see no key is not 0 ({bad} elements)",
                    )
                )
    for n, (case, b, t, which) in enumerate(jobs):
        q0, q1, k0, k1 = doc_bounds(case, b)
        d = t + (k1 - k0) - (q1 - q0)
        base = ctx.run(case)
        new = ctx.run(_diagonal_probe(ctx.inputs(case), b, t, which, seed=case.seed * 3001 + t))
        # a row that sees one key (d = 0) has P = 1 there, so dS = P (dP - D) = 0: its dQ and that
        # key's dK do not depend on the pair, exactly; only out and dV are required to move
        if which == "key":
            must = [("out", q0 + t)] + ([("dq", q0 + t)] if d > 0 else [])
            fixed = [(name, q0, q0 + t) for name in ("out", "dq")]
            what = f"key {d} (the last key query {t} sees) turned towards query {t}, value {d} huge"
        else:
            must = ([("dk", k0 + d)] if d > 0 else []) + [("dv", k0 + d)]
            fixed = [(name, k0 + d + 1, k1) for name in ("dk", "dv")]
            what = f"query {t} (the first query that sees key {d}) turned towards key {d}, dO {t} huge"
        for name, row in must:
            x_new, x_base = getattr(new, name), getattr(base, name)
            if x_new is None or x_base is None:
                continue
            if _rows_changed(x_new, x_base, row, row + 1, _noise(ctx, case, base).get(name)) == 0:
                missed += 1
                pos = t if name in ("out", "dq") else d
                findings.append(
                    case_record(
                        case,
                        document=b,
                        t=t,
                        probe=what,
                        tensor=name,
                        summary=f"{name} at position {pos} did not change: {what}",
                    )
                )
        for name, lo, hi in fixed:
            x_new, x_base = getattr(new, name), getattr(base, name)
            if x_new is None or x_base is None:
                continue
            c = _rows_changed(x_new, x_base, lo, hi, _noise(ctx, case, base).get(name))
            if c:
                leaked += c
                side = f"rows before {t}" if name in ("out", "dq") else f"keys after {d}"
                findings.append(
                    case_record(
                        case,
                        document=b,
                        t=t,
                        probe=what,
                        tensor=name,
                        summary=f"{c} elements of {name} at {side} changed: {what}",
                    )
                )
        ctx.progress((n + 1) / len(jobs))
    first = findings[0] if findings else None
    metrics = {"missed": missed, "leaked_elements": leaked, "nonzero_unseen": unseen, "probes": len(jobs)}
    return verdict(
        ctx,
        metrics,
        ok_message=f"every one of {len(jobs)} diagonal probes reached its diagonal position and nothing past it; "
        "rows that see no key output 0",
        first=first,
    )

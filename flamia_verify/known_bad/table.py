"""The source-edit family: systematic one-line bugs of the FLAMIA MXFP8 emulation, and correct alternatives.

Every entry is generated from a small list of *sites* (the places in
:mod:`flamia_verify.kernels.emulation` where an index, a boundary, a layout, a format or an order is
decided) crossed with the ways each is commonly got wrong:

    family         site(s)                                         variants
    mask           causal mask, forward / backward                  diagonal off by k = +-1, +-2; top-left
    fallback       diagonal fallback of V, dO, Q, K blocks           block seen whole k = +1, +2 keys early;
                   (which block a row sees whole)                    the shared test off by 1, 2
    blocks         document start of V, dO, K, Q blocks              cu_seqlens off by k; absolute grid;
                                                                     block size 31/33 in the quantizer only
    cu             cu_seqlens per operand and document loop          cu_seqlens_q <-> cu_seqlens_k
    heads          K/V head expansion per GEMM, dK/dV group sum      repeat instead of repeat_interleave
    format         each GEMM operand (9 roundings)                   NVFP4, E5M2 instead of E4M3
    rounding       each GEMM operand                                 truncation, scale exponent -1 / +1
    normalisation  P in forward and backward                         no rescale after 256 keys; backward P
                                                                     per 128-key tile; l from unrounded P;
                                                                     P elements one binade too high
    reduction      GEMM summation order                              random per call (long rows, one path)
    inplace        inputs per code path                              K, Q, V written in place
    accumulator    the GEMMs' sums (fp8 and fp8-mma designs)         E4M3 tensor cores under an fp32
                                                                     claim; bf16 slice sums under the
                                                                     tensor-core claim; fp32 under it

``correct=True`` rows are alternative designs that are right (softmax scale folded into Q before
rounding, D = rowsum(P * dP), more of the diagonal in input precision, another fixed summation
order, fp32 sums where the recipe allows the E4M3 tensor cores' narrower ones): the checks must
pass on them (false alarms).

Every entry is registered in the known-bad registry (:data:`flamia_verify.known_bad.KNOWN_BAD`) under
its name, tagged ``mutant`` and ``source-edit``; ``flamia-verify mutate`` reads it there.
"""

from __future__ import annotations

from flamia_verify.kernels.designs import FP8_MMA
from flamia_verify.kernels.quant_spec import Quant
from flamia_verify.known_bad.edits import Edit, Mutant, SourceEdit
from flamia_verify.known_bad.record import KNOWN_BAD, KnownBad
from flamia_verify.recipes.operands import Operand, describe_operands

__all__ = [
    "MUTANTS",
    "BUGS",
    "CORRECT",
    "FAMILIES",
    "RECORDS",
    "VARIANT_KIND_EDITS",
    "by_name",
    "ci_sample",
    "record_of",
]


# ------------------------------------------------------------------------------------------------
# sites
# ------------------------------------------------------------------------------------------------

_VIS = "visible(q1 - q0, k1 - k0, causal, q.device)"

# (path name, scope, the call that quantizes the operand along the sequence, the cu it uses, the
# fallback call that guards its diagonal block, suffix (rows see a suffix: transposed masks))
_SEQ_PATHS = (
    (
        "V",
        "forward_pass",
        "v_seq = seq_quantize(vf, design.quant(Operand.V_SEQ), design, cu_k, dtype)",
        "cu_k",
        "cu_q",
        "fallback_mask(design, design.quant(Operand.V_SEQ), vis, causal)",
        False,
    ),
    (
        "dO",
        "backward_pass",
        "do_seq = seq_quantize(dof, design.quant(Operand.DO_SEQ), design, cu_q, dtype)",
        "cu_q",
        "cu_k",
        "fallback_mask(design, design.quant(Operand.DO_SEQ), vis.T, causal)",
        True,
    ),
    (
        "K",
        "backward_pass",
        "k_seq = seq_quantize(kf, design.quant(Operand.K_SEQ), design, cu_k, dtype)",
        "cu_k",
        "cu_q",
        "fallback_mask(design, design.quant(Operand.K_SEQ), vis, causal)",
        False,
    ),
    (
        "Q",
        "backward_pass",
        "q_seq = seq_quantize(qf, design.quant(Operand.Q_SEQ), design, cu_q, dtype)",
        "cu_q",
        "cu_k",
        "fallback_mask(design, design.quant(Operand.Q_SEQ), vis.T, causal)",
        True,
    ),
)

# the operand roundings a mutant changes, by the name its mutants carry (``format.<name>-<variant>``):
# the operands rounded alike change together (Q and K in S, dO and V in dP); P has none (its rounding
# only sets the block size of FLAMIA's pow2 blocks)
_ROUNDINGS: tuple[tuple[str, tuple[Operand, ...]], ...] = (
    ("qk", (Operand.Q_HD, Operand.K_HD)),
    ("v_seq", (Operand.V_SEQ,)),
    ("dp_quant", (Operand.DO_HD, Operand.V_HD)),
    ("pt_quant", (Operand.PT,)),
    ("do_seq", (Operand.DO_SEQ,)),
    ("ds_quant", (Operand.DS,)),
    ("k_seq", (Operand.K_SEQ,)),
    ("dst_quant", (Operand.DST,)),
    ("q_seq", (Operand.Q_SEQ,)),
)

#: the edits that let a design name the operand kinds "mx-<variant>" (e5m2, truncate, scale_down,
#: scale_up): they dispatch to operators.mx_variant, and the diagonal fallback keeps guarding them
VARIANT_KIND_EDITS = (
    Edit(
        "quantize_operand",
        "    if kind is QuantKind.NVFP4:",
        '    if kind.startswith("mx-"):\n        return _mut.mx_variant(x, quant, axis, cu_seqlens, kind[3:])\n'
        "    if kind is QuantKind.NVFP4:",
    ),
    Edit(
        "fallback_mask",
        "quant.kind in (QuantKind.MX, QuantKind.NVFP4)",
        '(quant.kind.startswith("mx") or quant.kind is QuantKind.NVFP4)',
    ),
)


def _k(k: int) -> str:
    return f"{k:+d}"


def _mask() -> list[Mutant]:
    out = []
    for scope, path in (("forward_pass", "forward"), ("backward_pass", "backward")):
        for k in (1, 2, -1, -2):
            out.append(
                Mutant(
                    f"mask.{path}{_k(k)}",
                    "mask",
                    f"the {path} causal mask's diagonal moved by {k} key(s) "
                    f"{'(a query sees the future)' if k > 0 else '(a query misses its own past)'}",
                    (Edit(scope, _VIS, f"_mut.visible_shift(q1 - q0, k1 - k0, causal, q.device, {k})"),),
                )
            )
        out.append(
            Mutant(
                f"mask.{path}-top-left",
                "mask",
                f"the {path} causal mask aligned top-left (j <= i) instead of bottom-right when Lq != Lk",
                (Edit(scope, _VIS, "_mut.visible_top_left(q1 - q0, k1 - k0, causal, q.device)"),),
            )
        )
    return out


def _fallback() -> list[Mutant]:
    out = []
    for name, scope, _, _, _, call, suffix in _SEQ_PATHS:
        for k in (1, 2, -1):
            vis = "vis.T" if suffix else "vis"
            shifted = f"_mut.shift_vis({vis}, {k}{', suffix=True' if suffix else ''})"
            edit = Edit(scope, call, call.replace(f", {vis}, causal)", f", {shifted}, causal)"))
            if k > 0:
                out.append(
                    Mutant(
                        f"fallback.{name}{_k(k)}",
                        "fallback",
                        f"the {name} block on the causal diagonal is taken as seen whole when {k} of its "
                        f"position(s) are still masked (shared scale over the future)",
                        (edit,),
                    )
                )
            else:
                out.append(
                    Mutant(
                        f"fallback.{name}{_k(k)}",
                        "fallback",
                        f"the {name} block that ends on the diagonal also runs in input precision (more of "
                        "the diagonal exact: a correct, slower design)",
                        (edit,),
                        correct=True,
                    )
                )
    for k in (1, 2):
        out.append(
            Mutant(
                f"fallback.shared-test{_k(k)}",
                "fallback",
                f"the test 'row sees the block whole' off by {k} in the helper every path shares",
                (
                    Edit(
                        "full_block_mask", "return (counts == sizes)[:, blk]", f"return (counts + {k} >= sizes)[:, blk]"
                    ),
                ),
            )
        )
    return out


def _blocks() -> list[Mutant]:
    out = []
    for name, scope, call, cu, _, _, _ in _SEQ_PATHS:
        shifts = (1, -1, 2, -2) if name == "V" else (1, -1)
        for k in shifts:
            out.append(
                Mutant(
                    f"blocks.{name}-start{_k(k)}",
                    "blocks",
                    f"{name}'s sequence blocks restart {abs(k)} position(s) {'after' if k > 0 else 'before'} "
                    "each document start (a block spans two documents)",
                    (Edit(scope, call, call.replace(f", {cu}, dtype)", f", _mut.shift_cu({cu}, {k}), dtype)")),),
                )
            )
        out.append(
            Mutant(
                f"blocks.{name}-absolute-grid",
                "blocks",
                f"{name}'s sequence blocks on the pack's absolute 32-grid, not restarted at document starts",
                (Edit(scope, call, call.replace(f", {cu}, dtype)", ", None, dtype)")),),
            )
        )
        for k in (1, -1) if name == "V" else (1,):
            field = call.split(", ")[1]
            out.append(
                Mutant(
                    f"blocks.{name}-size{_k(k)}",
                    "blocks",
                    f"{name} quantized in {32 + k}-position blocks while the diagonal fallback assumes 32",
                    (Edit(scope, call, call.replace(field, f"_mut.resized({field}, {k})")),),
                )
            )
    return out


def _cu() -> list[Mutant]:
    out = []
    for name, scope, call, cu, other, _, _ in _SEQ_PATHS:
        out.append(
            Mutant(
                f"cu.{name}-blocks-from-{other}",
                "cu",
                f"{name}'s sequence blocks restart at {other.replace('cu_', 'cu_seqlens_')} instead of "
                f"{cu.replace('cu_', 'cu_seqlens_')}",
                (Edit(scope, call, call.replace(f", {cu}, dtype)", f", {other}, dtype)")),),
            )
        )
    for scope, path in (("forward_pass", "forward"), ("backward_pass", "backward")):
        out.append(
            Mutant(
                f"cu.{path}-keys-from-cu_q",
                "cu",
                f"the {path} reads each document's keys at cu_seqlens_q (right only when Lq == Lk everywhere)",
                (Edit(scope, "_documents(cu_q, cu_k)", "_documents(cu_q, cu_q)"),),
            )
        )
    return out


def _heads() -> list[Mutant]:
    sites = (
        ("scores", "_scores", "_expand_kv(k_hd, groups)", "K in S = QK^T (forward and recompute)"),
        ("pv", "forward_pass", "_expand_kv(v_seq[k0:k1], groups)", "V in O = PV"),
        (
            "pv-diagonal",
            "forward_pass",
            "_expand_kv(_round_input(vf[k0:k1], dtype), groups)",
            "V of the diagonal block (the input-precision path only)",
        ),
        ("dp", "backward_pass", "_expand_kv(v_hd[k0:k1], groups)", "V in dP = dO V^T"),
        ("dq", "backward_pass", "_expand_kv(k_seq[k0:k1], groups)", "K in dQ = dS K"),
        (
            "dq-diagonal",
            "backward_pass",
            "_expand_kv(_round_input(kf[k0:k1], dtype), groups)",
            "K of the diagonal block in dQ (the input-precision path only)",
        ),
    )
    out = [
        Mutant(
            f"heads.{n}-repeat",
            "heads",
            f"GQA heads of {what} expanded with repeat, not repeat_interleave",
            (Edit(scope, old, old.replace("_expand_kv(", "_mut.expand_repeat(")),),
        )
        for n, scope, old, what in sites
    ]
    for t, shape in (("dk", "k"), ("dv", "v")):
        old = f"{t} = {t}.view({shape}.shape[0], Hk, groups, {shape}.shape[2]).sum(dim=2)"
        out.append(
            Mutant(
                f"heads.{t}-group-sum",
                "heads",
                f"{t.upper()} summed over the query heads of a group in the tiled (repeat) order",
                (Edit("backward_pass", old, f"{t} = _mut.reduce_groups_swapped({t}, Hk, groups)"),),
            )
        )
    out.append(
        Mutant(
            "heads.dk-group-sum-reversed",
            "heads",
            "dK summed over a group's query heads in reverse order (another fixed fp32 order: correct)",
            (
                Edit(
                    "backward_pass",
                    "dk = dk.view(k.shape[0], Hk, groups, k.shape[2]).sum(dim=2)",
                    "dk = dk.view(k.shape[0], Hk, groups, k.shape[2]).flip(2).sum(dim=2)",
                ),
            ),
            correct=True,
        )
    )
    return out


def _operand_mutants(family: str, variants: dict[str, tuple[Quant, str]]) -> list[Mutant]:
    out = []
    for name, ops in _ROUNDINGS:
        for tag, (quant, what) in variants.items():
            out.append(
                Mutant(
                    f"{family}.{name}-{tag}",
                    family,
                    f"{describe_operands(ops)}: {what}",
                    VARIANT_KIND_EDITS,
                    tuple((op, quant) for op in ops),
                )
            )
    return out


def _normalisation() -> list[Mutant]:
    return [
        Mutant(
            "normalisation.no-rescale-after-256",
            "normalisation",
            "the online softmax stops rescaling after 256 keys: later row maxima do not rescale earlier keys",
            (
                Edit(
                    "probabilities",
                    "exp = mb[..., ids] - P_POW2_OFFSET - m[..., None]",
                    "exp = mb[..., ids] - P_POW2_OFFSET - _mut.running_max_without_rescale(mb, ids, m, 256 // block)",
                ),
            ),
        ),
        Mutant(
            "normalisation.backward-tile-lse",
            "normalisation",
            "the backward rebuilds P of each 128-key tile against the running normalizer of that tile",
            (
                Edit(
                    "recomputed_probabilities",
                    "- P_POW2_OFFSET - lse_safe[..., None])",
                    "- P_POW2_OFFSET - _mut.tile_lse(s2, lse_safe, 128))",
                ),
            ),
        ),
        Mutant(
            "normalisation.l-from-unrounded-p",
            "normalisation",
            "the row sum l is taken over the unrounded probabilities, not the P that multiplies V",
            (
                Edit(
                    "probabilities",
                    "l = p_used.sum(dim=-1)\n        return p_used, l, m",
                    "l = torch.exp2(torch.where(vis, s2 - m[..., None], s2.new_full((), -math.inf))).sum(dim=-1)\n"
                    "        return p_used, l, m",
                ),
            ),
        ),
        Mutant(
            "normalisation.p-offset+1",
            "normalisation",
            "P's block maximum mapped one binade too high (2^9 > 448): the largest probabilities saturate",
            (Edit("", "P_POW2_OFFSET = 8", "P_POW2_OFFSET = 9"),),
        ),
        Mutant(
            "normalisation.delta-from-p-dp",
            "normalisation",
            "D = rowsum(P * dP) instead of rowsum(dO * O) (equal in exact arithmetic: correct)",
            (
                Edit(
                    "backward_pass",
                    "ds = a * (dp - delta[q0:q1].T[..., None])",
                    "ds = a * (dp - (a * dp).sum(dim=-1, keepdim=True))",
                ),
            ),
            correct=True,
        ),
        Mutant(
            "normalisation.scale-folded-into-q",
            "normalisation",
            "softmax_scale multiplied into Q before Q is rounded (scores then need no scale: correct)",
            (
                Edit(
                    "forward_pass",
                    "q_hd = quantize_operand(qf, design.quant(Operand.Q_HD), -1, input_dtype=dtype)",
                    "q_hd = quantize_operand(qf * scale, design.quant(Operand.Q_HD), -1, input_dtype=dtype)",
                ),
                Edit("forward_pass", "qk_scale = _log2_scale(scale)", "qk_scale = _log2_scale(1.0)"),
                Edit(
                    "backward_pass",
                    "q_hd = quantize_operand(qf, design.quant(Operand.Q_HD), -1, input_dtype=dtype)",
                    "q_hd = quantize_operand(qf * scale, design.quant(Operand.Q_HD), -1, input_dtype=dtype)",
                ),
                Edit("backward_pass", "qk_scale = _log2_scale(scale)", "qk_scale = _log2_scale(1.0)"),
            ),
            correct=True,
        ),
    ]


def _reduction() -> list[Mutant]:
    both = "return gemm_q(a_full, b_q) + gemm(a_part, b_hp)"
    return [
        Mutant(
            "reduction.long-rows-random-order",
            "reduction",
            "GEMMs over more than 256 positions sum their 16-wide slices in a random order (split-K atomics)",
            (
                Edit("gemm_seq", "return gemm_q(a, b_q)", "return _mut.shuffled_matmul(a, b_q, min_len=256)"),
                Edit(
                    "gemm_seq",
                    both,
                    "return _mut.shuffled_matmul(a_full, b_q, min_len=256) + _mut.shuffled_matmul(a_part, b_hp, min_len=256)",
                ),
            ),
        ),
        Mutant(
            "reduction.non-causal-random-order",
            "reduction",
            "only the non-causal path sums its GEMM slices in a random order",
            (Edit("gemm_seq", "return gemm_q(a, b_q)", "return _mut.shuffled_matmul(a, b_q)"),),
        ),
        Mutant(
            "reduction.causal-random-order",
            "reduction",
            "only the causal path (diagonal split) sums its GEMM slices in a random order",
            (Edit("gemm_seq", both, "return _mut.shuffled_matmul(a_full, b_q) + gemm(a_part, b_hp)"),),
        ),
        Mutant(
            "reduction.reversed-order",
            "reduction",
            "every sequence GEMM sums its slices in reverse (another fixed order: correct)",
            (
                Edit("gemm_seq", "return gemm_q(a, b_q)", "return _mut.reversed_matmul(a, b_q)"),
                Edit("gemm_seq", both, "return _mut.reversed_matmul(a_full, b_q) + _mut.reversed_matmul(a_part, b_hp)"),
            ),
            correct=True,
        ),
    ]


def _inplace() -> list[Mutant]:
    fwd = "qf, kf, vf = q.float(), k.float(), v.float()\n"
    bwd = "qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.to(dtype).float()\n"
    return [
        Mutant(
            "inplace.k-causal",
            "inplace",
            "the causal forward subtracts K's mean from the caller's K in place",
            (Edit("forward_pass", fwd, fwd + "    if causal:\n        _mut.write_in_place(k)\n"),),
        ),
        Mutant(
            "inplace.k-non-causal",
            "inplace",
            "the non-causal forward subtracts K's mean in place",
            (Edit("forward_pass", fwd, fwd + "    if not causal:\n        _mut.write_in_place(k)\n"),),
        ),
        Mutant(
            "inplace.v-gqa",
            "inplace",
            "the forward with GQA (groups > 1) centres V in place",
            (Edit("forward_pass", fwd, fwd + "    if groups > 1:\n        _mut.write_in_place(v)\n"),),
        ),
        Mutant(
            "inplace.q-backward",
            "inplace",
            "the backward centres the saved Q (the caller's tensor) in place",
            (Edit("backward_pass", bwd, bwd + "    _mut.write_in_place(q)\n"),),
        ),
    ]


def _accumulator() -> list[Mutant]:
    tensor_cores = FP8_MMA.mma  # the GEMMs fp8-mma runs on the E4M3 tensor cores
    return [
        Mutant(
            "accumulator.mma-under-fp8",
            "accumulator",
            "fp8 with S and O = PV on the E4M3 tensor cores (about 13 bits per 32-slice) under the fp8 "
            "recipe's fp32 sums",
            design=(("mma", tensor_cores),),
            base="fp8",
        ),
        Mutant(
            "accumulator.bf16-slices-under-mma",
            "accumulator",
            "fp8-mma whose tensor-core GEMMs round every 32-slice and the running sum to bf16",
            (
                Edit(
                    "mma_gemm",
                    "acc = _mma_slice(rows[..., :MMA_SLICE], b[..., :MMA_SLICE, :]).float()",
                    "acc = _mma_slice(rows[..., :MMA_SLICE], b[..., :MMA_SLICE, :]).float().bfloat16().float()",
                ),
                Edit(
                    "mma_gemm",
                    "acc = acc + _mma_slice(rows[..., s0 : s0 + MMA_SLICE], b[..., s0 : s0 + MMA_SLICE, :]).float()",
                    "acc = (acc + _mma_slice(rows[..., s0 : s0 + MMA_SLICE], b[..., s0 : s0 + MMA_SLICE, :]).float())"
                    ".bfloat16().float()",
                ),
            ),
            base="fp8-mma",
        ),
        Mutant(
            "accumulator.fp32-under-mma",
            "accumulator",
            "fp8-mma computed with fp32 sums everywhere (more accurate than its recipe allows: correct)",
            design=(("mma", frozenset()),),
            base="fp8-mma",
            correct=True,
        ),
    ]


def _build() -> tuple[Mutant, ...]:
    mutants = (
        _mask()
        + _fallback()
        + _blocks()
        + _cu()
        + _heads()
        + _operand_mutants(
            "format",
            {
                "nvfp4": (Quant("nvfp4", 16), "NVFP4 (E2M1, 16-blocks) under an MXFP8 claim"),
                "e5m2": (Quant("mx-e5m2"), "E5M2 elements under an E4M3 claim"),
            },
        )
        + _operand_mutants(
            "rounding",
            {
                "truncate": (Quant("mx-truncate"), "elements rounded toward zero, not to nearest"),
                "scale-1": (Quant("mx-scale_down"), "block scale one exponent too small (saturates)"),
                "scale+1": (Quant("mx-scale_up"), "block scale one exponent too large (a bit lost)"),
            },
        )
        + _normalisation()
        + _reduction()
        + _inplace()
        + _accumulator()
    )
    names = [m.name for m in mutants]
    dup = sorted({n for n in names if names.count(n) > 1})
    assert not dup, f"duplicate mutant names: {dup}"
    return tuple(mutants)


MUTANTS: tuple[Mutant, ...] = _build()
BUGS = tuple(m for m in MUTANTS if not m.correct)
CORRECT = tuple(m for m in MUTANTS if m.correct)
FAMILIES = tuple(dict.fromkeys(m.family for m in MUTANTS))
_BY_NAME = {m.name: m for m in MUTANTS}


#: what the test suite holds some entries to (the zoo reads them under its own names): the checks
#: that must fail on the entry (``catches``), those its bug cannot reach (``quiet``), where it lives
_CLAIMS: dict[str, dict] = {
    # the zoo's ds_nvfp4 (tests/zoo/targeted.py): a coarser operand than the recipe claims; error.dq moves
    # by a factor the model's band allows (1.0x); bound's one-hot-key case reads dS's rounding directly
    "format.ds_quant-nvfp4": dict(
        catches=("bound.grad",),
        quiet=("error.out", "error.dk", "error.dv", "bound.out", "causal", "isolation"),
    ),
    # the zoo's dst_e5m2 (tests/zoo/realistic_bugs.py)
    "format.dst_quant-e5m2": dict(
        catches=("bound.grad",),
        quiet=("causal", "isolation", "determinism", "error.out", "bound.out", "consistency.conservation_forward"),
    ),
    # the zoo's fp8_on_e4m3_tensor_cores (tests/zoo/targeted.py): on random inputs the tensor cores' cut
    # stays far inside E4M3's rounding of the operands, which every other bound must allow
    "accumulator.mma-under-fp8": dict(
        catches=("bound.accumulation",),
        quiet=("error", "bound.out", "bound.grad", "consistency", "causal", "isolation", "interface"),
    ),
    # the zoo's backward_mask_plus1 (tests/zoo/causal_bugs.py)
    "mask.backward+1": dict(catches=("causal.dq", "causal.dk_dv", "causal.diagonal"), where="backward only"),
}


def _record(m: Mutant) -> KnownBad:
    return KnownBad(
        m.name,
        m.family,
        m.why,
        SourceEdit(m),
        base=m.base,
        tags=("mutant", "source-edit"),
        correct=m.correct,
        **_CLAIMS.get(m.name, {}),
    )


#: the table's entries as known-bad records, in table order (registered in KNOWN_BAD)
RECORDS: tuple[KnownBad, ...] = KNOWN_BAD.register(*(_record(m) for m in MUTANTS), origin=__name__)
assert set(_CLAIMS) <= set(_BY_NAME), sorted(set(_CLAIMS) - set(_BY_NAME))


def record_of(mutant: Mutant) -> KnownBad:
    """The registered record of a table entry."""
    return KNOWN_BAD.get(mutant.name)


def by_name(name: str) -> Mutant:
    from flamia_verify.errors import ConfigError

    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown mutant {name!r}; `flamia-verify mutate --list` shows them") from None


def ci_sample(n: int = 24) -> tuple[Mutant, ...]:
    """A fixed, spread sample of the bugs: every family in proportion, the same on every machine
    (every k-th bug of the table in order, k = len(BUGS) // n)."""
    step = max(1, len(BUGS) // n)
    return BUGS[::step][:n]

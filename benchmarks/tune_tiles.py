"""Tile sweep of the fused kernels on a GPU: forward, dK/dV and dQ timed separately per tile config.

    python benchmarks/tune_tiles.py --kernels bf16 flamia-mxfp8 --seqlen 8192 --causal true
    python benchmarks/tune_tiles.py --kernels fp8 flamia-nvfp4     # the designs not yet swept

Each candidate's output is compared with the default configuration's (max abs difference over
out, dq, dk, dv): a configuration that changes results beyond fp32 reassociation is reported, so
a fast but wrong pipelining shows up here before it becomes a default. Writes a Markdown table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.triton.attention import fused_backward, fused_forward
from flamia_verify.kernels.triton.config import TileConfig, config_for, tile_multiples, tiles

# candidates for every design, (BM, BN, warps, stages[, split]); each kernel keeps those that are
# multiples of its blocks (the fp8 design's 128-row blocks leave only 128-key / 128-query tiles along
# those axes); "split" runs the dK/dV kernel as two launches (dV, then dK) with one accumulator each
FWD = [
    (128, 64, 8, 3),
    (128, 32, 4, 3),
    (128, 32, 8, 3),
    (128, 32, 4, 4),
    (64, 32, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 4, 2),
    (64, 128, 8, 3),
]
DKDV = [
    (32, 128, 8, 2),
    (32, 64, 4, 3),
    (64, 128, 8, 2),
    (32, 128, 8, 3),
    (32, 128, 4, 2),
    (64, 64, 4, 3),
    (128, 128, 8, 1),
    (128, 128, 4, 1),
    (128, 128, 8, 2),
    (128, 128, 8, 1, True),
    (128, 128, 4, 1, True),
    (128, 128, 8, 2, True),
]
DQ = [
    (128, 32, 4, 1),
    (128, 32, 4, 3),
    (128, 64, 8, 2),
    (64, 32, 4, 3),
    (128, 32, 8, 2),
    (64, 64, 4, 3),
    (64, 128, 8, 1),
    (32, 128, 4, 2),
    (64, 128, 4, 2),
    (128, 128, 8, 1),
    (64, 128, 8, 2),
]


def _ms(fn, rep):
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def sweep(
    name: str,
    seqlen: int,
    tokens: int,
    heads: int,
    dim: int,
    causal: bool,
    rep: int,
    phases=("fwd", "dkdv", "dq"),
    only=None,
):
    cfg = config_for(DESIGNS[name])
    base = tiles(cfg, dim, interpret=False)
    batch = tokens // seqlen
    total = batch * seqlen
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device="cuda")
    sc = dim**-0.5
    out, lse = fused_forward(cfg, q, k, v, cu, cu, seqlen, seqlen, sc, causal)
    ref_bwd = fused_backward(cfg, q, k, v, out, lse, do, cu, cu, seqlen, seqlen, sc, causal)
    rows = []

    mult = tile_multiples(cfg)
    for phase, cands in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
        if phase not in phases:
            continue
        if only is not None:  # --tiles: the default and the given candidates of this phase
            cands = [tuple(base[phase].__dict__.values())] + [c for p_, c in only if p_ == phase]
        for c in cands:
            t = TileConfig(*c)
            if c[0] % mult[phase][0] or c[1] % mult[phase][1]:  # a tile must hold whole blocks
                continue
            row = {"kernel": name, "phase": phase, "tile": c, "default": t == base[phase]}
            try:
                if phase == "fwd":
                    o2, _ = fused_forward(cfg, q, k, v, cu, cu, seqlen, seqlen, sc, causal, tile=t)
                    row["maxdiff"] = float((o2.float() - out.float()).abs().max())
                    row["ms"] = _ms(
                        lambda: fused_forward(cfg, q, k, v, cu, cu, seqlen, seqlen, sc, causal, tile=t),  # noqa: B023 (_ms calls it at once)
                        rep,
                    )
                else:
                    kw = {"tile_dkdv": t} if phase == "dkdv" else {"tile_dq": t}
                    got = fused_backward(cfg, q, k, v, out, lse, do, cu, cu, seqlen, seqlen, sc, causal, **kw)
                    idx = (1, 2) if phase == "dkdv" else (0,)
                    row["maxdiff"] = max(float((got[i].float() - ref_bwd[i].float()).abs().max()) for i in idx)
                    row["ms"] = _ms(
                        lambda: fused_backward(cfg, q, k, v, out, lse, do, cu, cu, seqlen, seqlen, sc, causal, **kw),  # noqa: B023 (_ms calls it at once)
                        rep,
                    )
            except Exception as exc:  # out of resources etc.
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            print(row, flush=True)
            rows.append(row)
    return rows


def _parse_tiles(specs):
    if not specs:
        return None
    out = []
    for spec in specs:
        phase, _, nums = spec.partition(":")
        vals = nums.split(",")
        out.append(
            (
                phase,
                tuple(int(v) for v in vals[:4])
                + ((vals[4].lower() in ("1", "true", "split"),) if len(vals) > 4 else ()),
            )
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["bf16", "flamia-mxfp8"])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", choices=["true", "false"], default="true")
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--phases", nargs="+", choices=["fwd", "dkdv", "dq"], default=["fwd", "dkdv", "dq"])
    ap.add_argument(
        "--tiles",
        nargs="+",
        metavar="PHASE:BM,BN,WARPS,STAGES[,split]",
        help="time only these candidates (and each phase's default), e.g. dkdv:128,32,4,3",
    )
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    lines = [
        f"{torch.cuda.get_device_name()}, triton {triton.__version__}, S = {args.seqlen}, "
        f"causal = {args.causal}; bwd phases time the whole backward with one kernel's tiles changed",
        "",
        "| kernel | phase | (BM, BN, warps, stages[, split]) | default | ms | max diff vs default | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.kernels:
        for r in sweep(
            name,
            args.seqlen,
            args.tokens,
            args.heads,
            args.head_dim,
            args.causal == "true",
            args.rep_ms,
            args.phases,
            _parse_tiles(args.tiles),
        ):
            lines.append(
                f"| {r['kernel']} | {r['phase']} | {r['tile']} | {'yes' if r['default'] else ''} | "
                f"{r.get('ms', float('nan')):.2f} | {r.get('maxdiff', float('nan')):.3g} | "
                f"{r.get('error', '')} |"
            )
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Attention speed table: the fused Triton kernels beside torch SDPA (cuDNN, FlashAttention-2).

    python benchmarks/bench_attention.py                      # the full table (H200: a few minutes)
    python benchmarks/bench_attention.py --seqlens 8192 --kernels bf16 flamia-mxfp8 --causal true

B * S = 32K tokens, H = 16, D = 128, bf16, S in {2K, 8K, 16K}, causal and not; forward, backward
and forward+backward TFLOP/s and the forward+backward ratio to the fastest BF16 SDPA backend.
Writes the Markdown table to stdout (and --json FILE, --md FILE). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from flamia_verify.bench import bench_table, format_table
from flamia_verify.results import jsonable

DEFAULT_KERNELS = ["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=DEFAULT_KERNELS)
    ap.add_argument("--seqlens", nargs="+", type=int, default=[2048, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    causal = {"both": (True, False), "true": (True,), "false": (False,)}[args.causal]
    rows = bench_table(
        args.kernels,
        seqlens=args.seqlens,
        tokens=args.tokens,
        heads=args.heads,
        head_dim=args.head_dim,
        causal=causal,
        rep_ms=args.rep_ms,
    )
    import triton

    header = (
        f"{datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, B*S = {args.tokens}, H = {args.heads}, D = {args.head_dim}, bf16"
    )
    table = format_table(rows)
    print(header)
    print(table)
    if args.md:
        args.md.write_text(header + "\n\n" + table + "\n")
    if args.json:
        # strict JSON, non-finite numbers as "nan"/"inf" strings (as report.json and `flamia-verify bench`)
        args.json.write_text(
            json.dumps(jsonable({"header": header, "rows": rows}), indent=1, allow_nan=False, default=str)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Attention speed table: the fused Triton kernels beside torch SDPA (cuDNN, FlashAttention-2).

    python benchmarks/bench_attention.py                      # the full table (H200: a few minutes)
    python benchmarks/bench_attention.py --seqlens 8192 --kernels bf16 flamia-mxfp8 --causal true
    python benchmarks/bench_attention.py --preset fa4 --rep-ms 50 --md fa4.md --json fa4.json

``--preset fa4``: FlashAttention-4 BF16 (``fa4``) beside cuDNN BF16 and FlashAttention-2 (the SDPA
baselines), our designs and ``cudnn-fp8``, and FA4's FP8 forward (``fa4-fp8``, delayed scaling) beside
cuDNN FP8's forward, at S = 8K and 16K, causal and not (needs flash-attn-4 on the path:
benchmarks/fa4_install.sh, and nvidia-cudnn-frontend for cudnn-fp8; benchmarks/fa4_gpu.sh bench runs
it). A kernel that is not available here (fa4-fp8 on Hopper: FA4's FP8 forward is Blackwell-only)
gets one row with the reason and the table goes on.

B * S = 32K tokens, H = 16, D = 128, bf16, S in {2K, 8K, 16K}, causal and not; forward, backward
and forward+backward TFLOP/s and the forward+backward ratio to the fastest BF16 SDPA backend.
Writes the Markdown table to stdout (and --json FILE, --md FILE). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import torch

from flamia_verify.bench import COLUMNS, bench_table, format_table, resolve_kernel
from flamia_verify.errors import KernelLoadError
from flamia_verify.results import jsonable

DEFAULT_KERNELS = ["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4"]
#: the kernels and sequence lengths of each --preset
PRESETS = {"fa4": (["fa4", *DEFAULT_KERNELS, "cudnn-fp8", "fa4-fp8"], [8192, 16384])}


def resolve_available(names: list[str]) -> tuple[list, list[dict]]:
    """The kernels that load here (resolved once), and one error row per kernel that does not."""
    kernels, missing = [], []
    for name in names:
        try:
            kernels.append(resolve_kernel(name))
        except KernelLoadError as exc:
            row = {key: math.nan for key in COLUMNS} | {"kernel": name, "seqlen": "-", "batch": "-", "causal": "-"}
            missing.append(row | {"error": f"not available: {str(exc).splitlines()[0]}"})
    return kernels, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a preset's kernels and sequence lengths")
    ap.add_argument("--kernels", nargs="+")
    ap.add_argument("--seqlens", nargs="+", type=int)
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    preset_kernels, preset_seqlens = PRESETS.get(args.preset, (DEFAULT_KERNELS, [2048, 8192, 16384]))
    kernels, missing = resolve_available(args.kernels or preset_kernels)
    causal = {"both": (True, False), "true": (True,), "false": (False,)}[args.causal]
    rows = bench_table(
        kernels,
        seqlens=args.seqlens or preset_seqlens,
        tokens=args.tokens,
        heads=args.heads,
        head_dim=args.head_dim,
        causal=causal,
        rep_ms=args.rep_ms,
    )
    rows += missing
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

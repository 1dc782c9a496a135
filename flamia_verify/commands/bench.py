"""``flamia-verify bench``: the speed of kernels beside torch SDPA (needs CUDA)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flamia_verify.commands.common import EXIT_PASS, console
from flamia_verify.errors import ConfigError, UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="speed of kernels beside torch SDPA (needs CUDA)")
    b.add_argument(
        "--kernel",
        nargs="+",
        default=None,
        help="built-in names (their fused kernels) or module:function / file.py:function specs",
    )
    b.add_argument("--device", choices=("cuda",), default="cuda", help="the GPU to time on (only cuda)")
    b.add_argument(
        "--seqlens",
        nargs="+",
        type=int,
        default=[2048, 8192, 16384],
        help="tokens per document S; each row packs B = 32768 // S documents",
    )
    b.add_argument(
        "--causal",
        choices=("both", "true", "false"),
        default="both",
        help="time causal attention, non-causal, or both (default both)",
    )
    b.add_argument("--rep-ms", type=int, default=100, help="timing budget per measurement (triton do_bench)")
    b.add_argument("--md", help="also write the table as Markdown to this file")
    b.add_argument("--json", help="also write the rows as JSON to this file")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("bench measures GPU speed and needs a CUDA device; none is available here")
    if any(n <= 0 for n in args.seqlens) or args.rep_ms <= 0:
        raise UsageError("--seqlens and --rep-ms take positive numbers")
    for path in (args.md, args.json):  # a bad output path ends the command before minutes of timing
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"cannot write {path!r}: its directory does not exist")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from flamia_verify.bench import bench_table, format_table, resolve_kernel
    from flamia_verify.reports.terminal import print_table
    from flamia_verify.results import jsonable

    # each spec is loaded once, here: one that does not load ends the command before any timing (exit 3)
    kernels = [resolve_kernel(spec) for spec in (args.kernel or ["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4"])]
    cons = console()
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} measurements"),
        TimeElapsedColumn(),
        console=cons,
        transient=True,
        disable=not cons.is_terminal,
    )
    task = progress.add_task("bench", total=1)
    causal = {"both": (True, False), "true": (True,), "false": (False,)}[args.causal]
    with progress:
        rows = bench_table(
            kernels,
            device=args.device,
            seqlens=tuple(args.seqlens),
            causal=causal,
            rep_ms=args.rep_ms,
            progress=lambda done, total, label: progress.update(task, description=label, completed=done, total=total),
        )
    print_table(
        cons,
        "attention speed (TFLOP/s; ratio: to the fastest BF16 SDPA baseline, ratio_bf16: to the fused bf16 kernel)",
        [str(col) for col in (rows[0] if rows else [])],
        [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows],
    )
    tokens = sorted({r["batch"] * r["seqlen"] for r in rows})
    header = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B*S = "
        f"{' or '.join(map(str, tokens))} tokens, H = 16, D = 128, bf16"
    )
    if args.md:
        Path(args.md).write_text(header + "\n\n" + format_table(rows) + "\n")
    if args.json:
        # strict JSON, non-finite numbers as "nan"/"inf" strings, as in report.json
        Path(args.json).write_text(
            json.dumps(jsonable({"header": header, "rows": rows}), indent=1, allow_nan=False, default=str)
        )
    return EXIT_PASS

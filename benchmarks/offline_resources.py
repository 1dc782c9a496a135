"""Registers, stack (spills) and instruction mix of the fused kernels for an H200, compiled without a GPU.

    python benchmarks/offline_resources.py [--designs fp8 fp8-mma] [--kernels fwd dkdv dq]
                                           [--sass] [--causal 1]

Triton compiles for a named target without a device. This script does it in two steps:

1. **Capture** (a child process under ``TRITON_INTERPRET=1``): one small forward+backward per
   design runs on the CPU with ``attention._launch`` replaced by a recorder, so every fused kernel
   launch is written down as it would be made (argument types, integer values, constexprs) and
   skipped. The launch is then turned into the GPU's: ``INTERPRET=False`` and the GPU tiles of
   ``config.tiles(..., interpret=False)`` (the interpreter's tiles differ).
2. **Compile** each captured launch for sm_90a (Hopper) as a launch on contiguous bf16 tensors
   would specialize it: pointers and the specialized integers divisible by 16, integers equal to 1
   as constants, the ``do_not_specialize`` ones left alone. The hardware E4M3 conversion is switched
   on as on the H200 (``quant.NATIVE_E4M3``). The cubin's resources come from the ``cuobjdump`` that
   Triton ships: registers per thread and the stack frame in bytes, where spilled registers go.
   ``--sass`` also counts the kernel's instructions by class (tensor-core MMAs, conversions,
   special-function, fp32 arithmetic, local-memory spill traffic) and lists its loops with their
   length in instructions and its ratio of issue slots to tensor-core cycles ("issue/tensor": above
   1, the loop's instructions take longer to issue than its MMAs take to run, so trimming
   instructions speeds it up; below 1, the tensor cores or latencies bound it). A static count of
   the code, not of executed instructions. The sweeps over key or query tiles are the long loops
   (masked tiles first or last, the full tiles between).

It compiles the kernels of the installed package (``pip install -e .``; a variant of the source is
a change to a checkout, or experiments/fp8_mma_variants.py's way of patching a copy). The SASS is read
by :mod:`flamia_verify.sass`. Use the device's Triton version for numbers that match the GPU (3.6.0
on the H200 machine), for instance in a virtual environment of its own with the package installed:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 -e .
    /tmp/t36/bin/python benchmarks/offline_resources.py --designs bf16 fp8 --kernels fwd dkdv dq --sass

Measured so (2026-12-02, Triton 3.6.0): the forward's stack was 56 bytes for fp8, 872 for fp8-mma,
392 for fp8-mma without the promotion every 32; on the H200 the same kernels reported 4, 162 and 106
spilled registers and ran 3.35, 8.30 and 6.60 ms (benchmarks/LOG.md, "fp8-mma"). A proxy for
spills and instruction counts, not a timing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from flamia_verify.sass import parse_loops, parse_sass, sass_classes

KERNELS = {"fwd": "_attn_fwd", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}


# ----------------------------------------------------------------------------------------------
# step 1: capture the launches (child process, interpreter)
# ----------------------------------------------------------------------------------------------


def _arg_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return {
            torch.bfloat16: "*bf16",
            torch.float16: "*fp16",
            torch.float32: "*fp32",
            torch.int32: "*i32",
            torch.int64: "*i64",
            torch.uint8: "*u8",
        }.get(value.dtype) or ("*fp8e4nv" if "float8" in str(value.dtype) else f"*{value.dtype}")
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


def capture(designs: list[str], head_dim: int, causal: bool) -> list[dict]:
    """Every fused kernel launch of one small forward+backward per design, as the GPU would make it."""
    import torch

    from flamia_verify.kernels.designs import DESIGNS
    from flamia_verify.kernels.triton import attention
    from flamia_verify.kernels.triton.config import config_for, tiles

    launches: list[dict] = []
    phase = {kernel: name for name, kernel in KERNELS.items()}

    def record(kernel, grid, tile, *args, **constexprs):
        name = kernel.fn.__name__
        gpu_tile = tiles(current["cfg"], head_dim, interpret=False)[phase[name]]
        constexprs = dict(constexprs, INTERPRET=False, BLOCK_M=gpu_tile.block_m, BLOCK_N=gpu_tile.block_n)
        parts = [None]
        if "PART" in constexprs:  # the dK/dV launches as the GPU tile makes them (one, or dV then dK)
            if constexprs["PART"] == 2 or (constexprs["PART"] == 1 and not gpu_tile.split):
                return tile.num_stages  # recorded with the first launch
            parts = [1, 2] if gpu_tile.split else [0]
        for part in parts:
            if part is not None:
                constexprs = dict(constexprs, PART=part, TWO_PASS=current["cfg"].two_pass_dkdv(part))
            launches.append(
                {
                    "design": current["design"],
                    "kernel": name,
                    "phase": phase[name],
                    "tile": [gpu_tile.block_m, gpu_tile.block_n, gpu_tile.num_warps, gpu_tile.num_stages],
                    "types": [_arg_type(a) for a in args],
                    "ints": [a if isinstance(a, int) and not isinstance(a, bool) else None for a in args],
                    "constexprs": constexprs,
                }
            )
        return tile.num_stages

    attention._launch = record
    current: dict = {}
    torch.manual_seed(0)
    for design in designs:
        cfg = config_for(DESIGNS[design])
        current.update(design=design, cfg=cfg)
        n, h = 256, 2
        q, k, v, do = (torch.randn(n, h, head_dim, dtype=torch.bfloat16) for _ in range(4))
        cu = torch.tensor([0, 128, n], dtype=torch.int32)
        out, lse2 = attention.fused_forward(cfg, q, k, v, cu, cu, 128, 128, head_dim**-0.5, causal)
        attention.fused_backward(cfg, q, k, v, out, lse2, do, cu, cu, 128, 128, head_dim**-0.5, causal)
    return launches


# ----------------------------------------------------------------------------------------------
# step 2: compile for sm_90a and read the cubin
# ----------------------------------------------------------------------------------------------


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([str(tool), *flags, path], capture_output=True, text=True, check=True).stdout


def res_usage(cubin: bytes) -> dict[str, int]:
    out = _cuobjdump(cubin, "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"no resource line in cuobjdump's output: {out[-300:]}")
    return dict(zip(("registers", "stack_bytes", "static_shared", "local"), map(int, m.groups())))


def compile_launch(module, launch: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(module, launch["kernel"])
    names = fn.arg_names
    constexprs = launch["constexprs"]
    unspecialized = {names[i] if isinstance(i, int) else i for i in (fn.do_not_specialize or ())}
    positional = [n for n in names if n not in constexprs]
    signature: dict[str, str] = {}
    const_values: dict = {}
    attrs: dict = {}
    for i, n in enumerate(positional):
        t, value = launch["types"][i], launch["ints"][i]
        if t == "i32" and value == 1 and n not in unspecialized:
            signature[n] = "constexpr"
            const_values[(names.index(n),)] = 1
            continue
        signature[n] = t
        if t.startswith("*") or (t == "i32" and n not in unspecialized and value is not None and value % 16 == 0):
            attrs[(names.index(n),)] = [["tt.divisibility", 16]]
    for n, v in constexprs.items():
        signature[n] = "constexpr"
        const_values[(names.index(n),)] = v
    src = ASTSource(fn=fn, signature={n: signature[n] for n in names}, constexprs=const_values, attrs=attrs)
    *_, warps, stages = launch["tile"]
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", nargs="+", default=["fp8", "fp8-mma"])
    ap.add_argument("--kernels", nargs="+", default=["fwd"], choices=sorted(KERNELS))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", type=int, default=1, choices=(0, 1))
    ap.add_argument("--sass", action="store_true", help="also count the SASS instructions by class")
    ap.add_argument("--top", type=int, default=0, help="also list the N most frequent SASS opcodes")
    ap.add_argument("--capture", action="store_true", help=argparse.SUPPRESS)  # step 1, in the child
    args = ap.parse_args()
    if args.capture:
        json.dump(capture(args.designs, args.head_dim, bool(args.causal)), sys.stdout)
        return 0
    child = subprocess.run(
        [sys.executable, __file__, "--capture", "--designs", *args.designs, "--head-dim", str(args.head_dim)]
        + ["--causal", str(args.causal)],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
    )
    if child.returncode:
        sys.stderr.write(child.stderr)
        return child.returncode
    launches = [x for x in json.loads(child.stdout) if x["phase"] in args.kernels]

    import triton

    from flamia_verify.kernels.triton import attention, quant

    # the H200's default (the hardware conversion); the interpreter's capture above had it off
    quant.NATIVE_E4M3 = triton.language.constexpr(True)
    module = attention  # it imports every kernel it launches
    print(f"triton {triton.__version__}, sm_90a, head_dim {args.head_dim}, causal {bool(args.causal)}, bf16")
    for launch in launches:
        compiled = compile_launch(module, launch)
        r = res_usage(compiled.asm["cubin"])
        part = launch["constexprs"].get("PART")
        label = launch["phase"] + ("" if not part else {1: " (dV)", 2: " (dK)"}[part])
        bm, bn, warps, stages = launch["tile"]
        line = (
            f"{launch['design']:>14} {label:<10} {bm:>3} x {bn:<3} {warps} warps {stages} stages: "
            f"{r['registers']} registers, {r['stack_bytes']} bytes of stack"
        )
        if args.sass or args.top:
            sass = _cuobjdump(compiled.asm["cubin"], "-sass")
            ops = [op for _, op, _ in parse_sass(sass)]
            line += "\n    " + " ".join(f"{k}={v}" for k, v in sorted(sass_classes(ops).items()))
            loops = parse_loops(sass)
            line += "\n    loops: " + "; ".join(
                f"{x['length']} instructions, {x['mma']} MMA, {x['mufu']} MUFU, "
                f"issue/tensor {x['issue_per_tensor']:.2f}"
                for x in loops
            )
            if args.top:
                top = collections.Counter(ops).most_common(args.top)
                line += "\n    top: " + " ".join(f"{k}={v}" for k, v in top)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

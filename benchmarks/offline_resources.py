"""Registers and stack (spills) of the fused forward kernel for an H200, compiled without a GPU.

    python benchmarks/offline_resources.py [--designs fp8 fp8-mma] [--source attention.py] [--seqlen-hint 8192]

Triton compiles for a named target without a device: this builds ``_attn_fwd`` for sm_90a (Hopper)
with each design's constexprs and default forward tile, as a launch on contiguous bf16 tensors would
specialize it (pointers and strides divisible by 16), and reads the cubin's resources with the
``cuobjdump`` that Triton ships: registers per thread and the stack frame in bytes, which is where
spilled registers go. ``--source`` compiles another copy of ``attention.py`` (a variant under study).

Use the device's Triton version for numbers that match the GPU (3.6.0 on the H200 machine):

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    PYTHONPATH=.:/tmp/t36/lib/python3.11/site-packages:.venv/lib/python3.11/site-packages \\
        /tmp/t36/bin/python benchmarks/offline_resources.py

Measured so (2026-12-02, Triton 3.6.0): fp8 56 bytes of stack, fp8-mma 872, fp8-mma without the
promotion every 32 392; on the H200 the same kernels reported 4, 162 and 106 spilled registers and
ran 3.35, 8.30 and 6.60 ms (benchmarks/RESULTS.md, "fp8-mma"). A proxy for spills, not a timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flamia_verify.kernels.designs import DESIGNS  # noqa: E402
from flamia_verify.kernels.triton.config import config_for, tiles  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
#: the integer arguments that the kernel does not specialize (lengths) keep no divisibility hint
UNSPECIALIZED = ("stride_lh", "stride_vtd", "GROUPS")


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"attention_offline_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def res_usage(cubin: bytes) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(cubin)
        out = subprocess.run([str(CUOBJDUMP), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"no resource line in cuobjdump's output: {out[-300:]}")
    return dict(zip(("registers", "stack_bytes", "static_shared", "local"), map(int, m.groups())))


def forward_resources(module, design: str, head_dim: int = 128) -> dict:
    cfg = config_for(DESIGNS[design])
    tile = tiles(cfg, head_dim, interpret=False)["fwd"]
    fn = module._attn_fwd
    code = "*fp8e4nv" if cfg.mma8 else "*bf16"
    types = {
        "Q": code,
        "K": "*bf16",
        "V": "*bf16",
        "Vop": "*bf16",
        "Out": "*bf16",
        "Lse2": "*fp32",
        "CuQ": "*i32",
        "CuK": "*i32",
        "Qsc": "*fp32",
        "Kc": "*fp8e4nv" if cfg.mma8 else "*fp32",
        "Ksc": "*fp32",
        "VcT": "*fp8e4nv" if cfg.mma8 else "*fp32",
        "Vsc": "*fp32",
        "VBlk": "*i32",
        "qk_scale": "fp32",
    }
    constexprs = dict(
        HEAD_DIM=head_dim,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        CAUSAL=True,
        V_KIND=cfg.v_seq[0],
        V_BLOCK=max(cfg.v_seq[1], 1),
        P_POW2=cfg.p_pow2,
        P_BLOCK=cfg.p_block,
        FALLBACK=cfg.fallback,
        MMA8=cfg.mma8,
        IS_FP16=False,
        INTERPRET=False,
    )
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if signature[n].startswith("*") or (n.startswith("stride") and n not in UNSPECIALIZED)
    }
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    )
    return {"design": design, "tile": tile, **res_usage(compiled.asm["cubin"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", nargs="+", default=["fp8", "fp8-mma"])
    ap.add_argument("--source", type=Path, default=ROOT / "flamia_verify/kernels/triton/attention.py")
    args = ap.parse_args()
    module = load(args.source)
    print(f"triton {triton.__version__}, sm_90a, _attn_fwd, head_dim 128, causal, bf16")
    for design in args.designs:
        r = forward_resources(module, design)
        t = r["tile"]
        print(
            f"{design}: tile {t.block_m} x {t.block_n}, {t.num_warps} warps, {t.num_stages} stages: "
            f"{r['registers']} registers, {r['stack_bytes']} bytes of stack"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the fused fp8-mma kernels lose their time: timing variants of the kernel source (CUDA only).

    python benchmarks/fp8_mma_variants.py [--seqlen 8192] [--md OUT.md]

Each variant is the kernel module with a few source lines replaced (written to a temporary file and
imported as a module of its own, so the installed kernels stay as they are); several change the
numbers and exist only to time what a stage costs, the way a profiler would. For each: forward and
backward milliseconds (fp8-mma design, causal, B*S = 32K, H = 16, D = 128) and the registers and
spills of every compiled kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from flamia_verify.kernels.designs import DESIGNS  # noqa: E402
from flamia_verify.kernels.triton.config import config_for  # noqa: E402

SRC = (ROOT / "flamia_verify/kernels/triton/attention.py").read_text()
DOT8 = "return tl.dot(a.to(tl.float8e4nv), b.to(tl.float8e4nv), max_num_imprecise_acc=32)"
VARIANTS = {
    "as built": [],
    "no promotion every 32 (one fp32 add per dot)": [(DOT8, "return tl.dot(a.to(tl.float8e4nv), b.to(tl.float8e4nv))")],
    "PV without its scales (timing only)": [
        ("acc = acc + _dot8(elem, tl.trans(vt), INTERPRET) * sc", "acc = acc + _dot8(elem, tl.trans(vt), INTERPRET)")
    ],
    "S without its scales (timing only)": [
        (
            "s = _dot8(q_op, tl.trans(kc), INTERPRET) * (q_sc[:, None] * k_sc[None, :])",
            "s = _dot8(q_op, tl.trans(kc), INTERPRET)",
        )
    ],
    "PV scales as two broadcasts": [
        (
            "acc = acc + _dot8(elem, tl.trans(vt), INTERPRET) * sc",
            "acc = acc + (_dot8(elem, tl.trans(vt), INTERPRET) * v_sc[None, :]) * p_sc[:, None]",
        )
    ],
    "PV on bf16 tensor cores from the codes (timing only)": [
        (
            "acc = acc + _dot8(elem, tl.trans(vt), INTERPRET) * sc",
            "acc = acc + tl.dot(elem.to(tl.bfloat16), tl.trans(vt).to(tl.bfloat16)) * sc",
        )
    ],
    "S on bf16 tensor cores from the codes (timing only)": [
        (
            "s = _dot8(q_op, tl.trans(kc), INTERPRET) * (q_sc[:, None] * k_sc[None, :])",
            "s = tl.dot(q_op.to(tl.bfloat16), tl.trans(kc).to(tl.bfloat16)) * (q_sc[:, None] * k_sc[None, :])",
        )
    ],
}


def load_variant(name: str, edits, tmp: Path):
    src = SRC
    for old, new in edits:
        if src.count(old) < 1:
            raise ValueError(f"{name}: {old!r} not in the source")
        src = src.replace(old, new)
    path = tmp / f"attention_variant_{abs(hash(name))}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument(
        "--designs", nargs="+", default=["fp8-mma", "fp8"], help="variants on the first, 'as built' on the rest"
    )
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    S, tokens, H, D = args.seqlen, 32768, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(tokens, H, D, device="cuda", generator=g).bfloat16() for _ in range(4))
    cu = torch.arange(0, tokens + 1, S, device="cuda", dtype=torch.int32)
    lines = [
        f"{torch.cuda.get_device_name()}, triton {triton.__version__}, S = {S}, causal, B*S = {tokens}, H = {H}, D = {D}",
        "",
        "| design | variant | fwd ms | bwd ms | kernels: registers / spills |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(args.designs[0], n, e) for n, e in VARIANTS.items()] + [(d, "as built", []) for d in args.designs[1:]]
        for design, name, edits in jobs:
            cfg = config_for(DESIGNS[design])
            try:
                mod = load_variant(name, edits, Path(tmp))
                out, lse = mod.fused_forward(cfg, q, k, v, cu, cu, S, S, D**-0.5, True)
                fwd = triton.testing.do_bench(
                    lambda m=mod, c=cfg: m.fused_forward(c, q, k, v, cu, cu, S, S, D**-0.5, True),
                    warmup=20,
                    rep=100,
                    return_mode="median",
                )
                bwd = triton.testing.do_bench(
                    lambda m=mod, c=cfg, o=out, lse=lse: m.fused_backward(
                        c, q, k, v, o, lse, do, cu, cu, S, S, D**-0.5, True
                    ),
                    warmup=20,
                    rep=100,
                    return_mode="median",
                )
                res = "; ".join(
                    f"{r['kernel'].replace('_attn_', '')} {r['n_regs']}/{r['n_spills']}" for r in mod.kernel_resources()
                )
                line = f"| {design} | {name} | {fwd:.2f} | {bwd:.2f} | {res} |"
            except Exception as exc:  # report and go on with the next variant
                line = f"| {design} | {name} | error | | {str(exc).splitlines()[0][:150]} |"
            print(line, flush=True)
            lines.append(line)
    if args.md:
        args.md.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

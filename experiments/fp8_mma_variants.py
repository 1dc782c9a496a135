"""Where the fused fp8-mma kernels lose their time: timing variants of the kernel source (CUDA only).

    python experiments/fp8_mma_variants.py [--seqlen 8192] [--md OUT.md]
    python experiments/fp8_mma_variants.py --check        # no GPU: every edit applies and imports

Each variant is a copy of the installed ``flamia_verify.kernels.triton`` package with a few source
lines replaced (``VARIANTS``: file, old text, new text), written to a temporary directory and
imported as a package of its own, so the installed kernels stay as they are. Several variants
change the numbers and exist only to time what a stage costs, the way a profiler would. For each:
forward and backward milliseconds (fp8-mma design, causal, B*S = 32K, H = 16, D = 128) and the
registers and spills of every compiled kernel.

An edit whose old text is not in its file is an error: the kernels have changed and the variant
must be written again (``--check`` says which).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import sys
import tempfile
from pathlib import Path

import flamia_verify.kernels.triton as installed
from flamia_verify.kernels.designs import DESIGNS

PACKAGE = installed.__name__  # flamia_verify.kernels.triton
SOURCE = Path(installed.__file__).parent

DOT8 = "return tl.dot(a.to(tl.float8e4nv), b.to(tl.float8e4nv), max_num_imprecise_acc=32)"
S_FWD = "s = _dot8(q_op, tl.trans(kc), INTERPRET) * (q_sc[:, None] * k_sc[None, :])"
PV_FWD = "acc = acc + _dot8(elem, tl.trans(vt), INTERPRET) * sc"

#: name -> [(file in flamia_verify/kernels/triton, old text, new text)]; "as built" changes nothing
VARIANTS: dict[str, list[tuple[str, str, str]]] = {
    "as built": [],
    "no promotion every 32 (one fp32 add per dot)": [
        ("tile_ops.py", DOT8, "return tl.dot(a.to(tl.float8e4nv), b.to(tl.float8e4nv))")
    ],
    "PV without its scales (timing only)": [("forward.py", PV_FWD, "acc = acc + _dot8(elem, tl.trans(vt), INTERPRET)")],
    "S without its scales (timing only)": [("forward.py", S_FWD, "s = _dot8(q_op, tl.trans(kc), INTERPRET)")],
    "PV scales as two broadcasts": [
        (
            "forward.py",
            PV_FWD,
            "acc = acc + (_dot8(elem, tl.trans(vt), INTERPRET) * v_sc[None, :]) * p_sc[:, None]",
        )
    ],
    "PV on bf16 tensor cores from the codes (timing only)": [
        ("forward.py", PV_FWD, "acc = acc + tl.dot(elem.to(tl.bfloat16), tl.trans(vt).to(tl.bfloat16)) * sc")
    ],
    "S on bf16 tensor cores from the codes (timing only)": [
        (
            "forward.py",
            S_FWD,
            "s = tl.dot(q_op.to(tl.bfloat16), tl.trans(kc).to(tl.bfloat16)) * (q_sc[:, None] * k_sc[None, :])",
        )
    ],
}

_count = itertools.count()


def variant_sources(name: str, edits) -> dict[str, str]:
    """The package's modules (file name -> text) with ``edits`` applied and its own imports renamed
    to a fresh package name; ValueError when an edit's old text is not in its file."""
    files = {p.name: p.read_text() for p in sorted(SOURCE.glob("*.py")) if p.name != "__init__.py"}
    for file, old, new in edits:
        if file not in files:
            raise ValueError(f"{name}: no {file} in {SOURCE}")
        if old not in files[file]:
            raise ValueError(f"{name}: {old!r} is not in {file}")
        files[file] = files[file].replace(old, new)
    return files


def load_variant(name: str, edits, tmp: Path):
    """Import the variant as a package of its own (an empty ``__init__``: none of the installed
    package's dispatch) and return its ``attention`` module."""
    package = f"fp8_mma_variant_{next(_count)}"
    where = tmp / package
    where.mkdir()
    (where / "__init__.py").write_text("")
    for file, text in variant_sources(name, edits).items():
        (where / file).write_text(
            text.replace(PACKAGE + ".", package + ".").replace(f"from {PACKAGE} import", f"from {package} import")
        )
    spec = importlib.util.spec_from_file_location(
        package, where / "__init__.py", submodule_search_locations=[str(where)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.attention")


def check() -> int:
    """Every variant's edits apply to the current source and the variant package imports."""
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, edits in VARIANTS.items():
            try:
                mod = load_variant(name, edits, Path(tmp))
                assert mod.fused_forward.__module__.startswith("fp8_mma_variant_")
                print(f"ok    {name}")
            except Exception as exc:  # report every variant
                bad += 1
                print(f"FAIL  {name}: {exc}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument(
        "--designs", nargs="+", default=["fp8-mma", "fp8"], help="variants on the first, 'as built' on the rest"
    )
    ap.add_argument("--md", type=Path)
    ap.add_argument("--check", action="store_true", help="only apply and import every variant (no GPU needed)")
    args = ap.parse_args()
    if args.check:
        return check()
    import torch
    import triton

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
            try:
                mod = load_variant(name, edits, Path(tmp))
                cfg = mod.config_for(DESIGNS[design])
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

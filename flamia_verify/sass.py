"""Reading of a ``cuobjdump -sass`` listing: the instructions, their classes, and the loops with their
ratio of issue slots to tensor-core cycles (what benchmarks/offline_resources.py prints for the fused
kernels compiled for sm_90a without a GPU).

A static count of the code, not of executed instructions. "issue/tensor" is a loop's instruction
count over one warpgroup's MMA cycles per trip (m * n * k of every HGMMA at 2048 multiply-adds per
cycle and multiprocessor, QGMMA at 4096: the dense rates of the H100/H200 datasheet). Each warp issues
the loop once per trip on one of four schedulers and each warpgroup of four warps keeps the tensor
cores busy for those cycles, so above 1 the loop's instructions take longer to issue than its MMAs
take to run.
"""

from __future__ import annotations

import collections
import re

__all__ = ["TENSOR_RATE", "CLASSES", "parse_sass", "parse_loops", "sass_classes"]

#: dense multiply-adds per cycle of one H100/H200 multiprocessor: BF16/FP16 (HGMMA) and E4M3 (QGMMA),
#: the datasheet's 989 and 1979 TFLOP/s at 132 SMs and 1.83 GHz
TENSOR_RATE = {"HGMMA": 2048, "QGMMA": 4096}
#: instruction classes of ``sass_classes`` (SASS opcode prefixes); the rest are counted as "other"
CLASSES = {
    "mma": ("HGMMA", "HMMA", "QGMMA", "WARPGROUP"),
    "cvt": ("F2FP", "F2F", "I2F", "F2I", "FRND"),
    "mufu": ("MUFU",),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK"),
    "int": ("IMAD", "IADD3", "LOP3", "SHF", "ISETP", "IMNMX", "LEA", "SEL", "PRMT", "SHL", "SHR"),
    "spill": ("LDL", "STL"),
    "shared": ("LDS", "STS", "LDSM", "STSM"),
    "global": ("LDG", "STG", "LDGSTS", "UTMALDG", "RED", "ATOM"),
    "sync": ("BAR", "SYNCS", "WARPSYNC", "DEPBAR"),
    "shfl": ("SHFL",),
}


def parse_sass(sass: str) -> list[tuple[int, str, str]]:
    """The instructions of a ``cuobjdump -sass`` listing in program order: (address, opcode without
    its modifiers (``FFMA.FTZ`` is ``FFMA``), the rest of the instruction)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);", line)
        if m is not None:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return ins


def parse_loops(sass: str, min_len: int = 150) -> list[dict[str, float]]:
    """The listing's loops (a backward branch and the code it jumps back over) of at least ``min_len``
    instructions, in program order: their length, how many tensor-core MMAs (HGMMA, QGMMA) and
    special-function instructions (MUFU) one trip runs, and issue slots over MMA cycles
    (``issue_per_tensor``, inf for a loop without MMAs). A full-tile sweep issues its loop's length
    once per tile and warp, which is what an instruction-bound kernel spends its time on."""
    ins = parse_sass(sass)
    loops: list[dict[str, float]] = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target is None or int(target.group(1), 16) >= addr:
            continue
        body = [(o, r) for a, o, r in ins if int(target.group(1), 16) <= a <= addr]
        if len(body) < min_len:
            continue
        tensor = 0.0  # one warpgroup's tensor-core cycles per trip: m * n * k per instruction / rate
        for o, r in body:
            shape = re.match(r"\.(\d+)x(\d+)x(\d+)", r) if o in TENSOR_RATE else None
            if shape is not None:
                m, n, k = map(int, shape.groups())
                tensor += m * n * k / TENSOR_RATE[o]
        ops = [o for o, _ in body]
        loops.append(
            {
                "length": len(ops),
                "mma": ops.count("HGMMA") + ops.count("QGMMA"),
                "mufu": ops.count("MUFU"),
                # issue slots / tensor cycles: each warp issues the loop once per trip on one of 4
                # schedulers, each warpgroup (4 warps) keeps the tensor cores busy for `tensor` cycles
                "issue_per_tensor": len(ops) / tensor if tensor else float("inf"),
            }
        )
    return loops


def sass_classes(ops: list[str]) -> dict[str, int]:
    """Static instruction counts by :data:`CLASSES` (and ``total``)."""
    counts: collections.Counter[str] = collections.Counter()
    for op in ops:
        counts[next((c for c, prefixes in CLASSES.items() if op.startswith(prefixes)), "other")] += 1
    counts["total"] = len(ops)
    return dict(counts)

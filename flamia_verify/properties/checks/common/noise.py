"""The kernel's run-to-run noise, which the information-flow checks (causal, isolation, the interleaved
calls of interface.arguments, consistency.homogeneity, the captured calls) judge beyond: None (judge
bitwise) for a tensor the kernel repeats bit for bit, else the largest difference between two runs of
the same inputs.
"""

from __future__ import annotations

from flamia_verify.properties.checks.common.pack import LAYOUT_HEADS, layout_base_run, layout_docs, pack_docs
from flamia_verify.properties.compare import run_to_run_noise
from flamia_verify.properties.harness import KernelCallError, KernelOutputs

__all__ = ["run_noise", "unrepeatable_tensors"]


def unrepeatable_tensors(ctx) -> frozenset[str]:
    """The tensors in which the kernel does not repeat itself bitwise, seen on the suite's pack (dozens
    of documents, one longer than every tile: where split-K and atomics engage) run twice; empty for a
    repeatable kernel, and when the kernel cannot run the pack (the checks that need it say why)."""

    def compute() -> frozenset[str]:
        docs = layout_docs(ctx)
        try:
            first = layout_base_run(ctx, docs, True)
            again = ctx.run(pack_docs(ctx, docs, heads=LAYOUT_HEADS[0], heads_k=LAYOUT_HEADS[1], causal=True))
        except KernelCallError:
            return frozenset()
        return frozenset(t for t, n in run_to_run_noise(first.tensors(), again.tensors()).items() if n is not None)

    return ctx.memo(("unrepeatable tensors",), compute)


def run_noise(ctx, key, base: KernelOutputs, rerun) -> dict[str, float | None]:
    """The kernel's run-to-run noise on the inputs of ``base`` (``rerun()``: a second run of them),
    per tensor: None (judge bitwise) where the kernel repeats itself bitwise; for a tensor that
    :func:`unrepeatable_tensors` names, at least 0 (two units in the last place may move) even where
    these two runs happened to agree. Computed once per ``key``."""
    noise = ctx.memo(("run-to-run noise", key), lambda: run_to_run_noise(base.tensors(), rerun().tensors()))
    unrepeatable = unrepeatable_tensors(ctx)
    return {t: (0.0 if n is None and t in unrepeatable else n) for t, n in noise.items()}

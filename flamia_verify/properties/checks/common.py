"""Helpers shared by the check modules: tensors by name, grad availability, worst-case records."""

from __future__ import annotations

import torch

from flamia_verify.kernels.bounds import BoundResult, RecipeBoundModel, attention_bounds
from flamia_verify.properties.cases import Case, Inputs
from flamia_verify.properties.harness import KernelOutputs
from flamia_verify.results import json_number

__all__ = ["TENSORS", "GRADS", "tensors_of", "case_record", "worst_element", "bounds_of"]

TENSORS = ("out", "dq", "dk", "dv")
GRADS = ("dq", "dk", "dv")


def tensors_of(res: KernelOutputs, names=TENSORS) -> dict[str, torch.Tensor]:
    d = res.tensors()
    return {n: d[n] for n in names if n in d}


def case_record(case: Case, **extra) -> dict:
    """What reproduces a case: the case itself (seed, packing, shapes, distribution) plus extras."""
    rec = {"case": case.to_dict(), "cu_seqlens_q": _cu(case.lens_q), "cu_seqlens_k": _cu(case.lens_k)}
    rec.update(extra)
    return rec


def _cu(lens) -> list[int]:
    out = [0]
    for x in lens:
        out.append(out[-1] + x)
    return out


def worst_element(
    x: torch.Tensor, ref: torch.Tensor, case: Case, tensor: str, *, baseline: torch.Tensor | None = None
) -> dict:
    """Location of the largest absolute error with the kernel's and the reference's values."""
    x64, r64 = x.detach().double().to(ref.device), ref.detach().double()
    if r64.numel() == 0:
        return {}
    err = (x64 - r64).abs()
    err = torch.nan_to_num(err, nan=float("inf"))
    flat = int(torch.argmax(err.reshape(-1)))
    shape = tuple(r64.shape)
    idx = []
    rem = flat
    for size in reversed(shape):
        idx.append(rem % size)
        rem //= size
    idx.reverse()
    cu = _cu(case.lens_q if tensor in ("out", "dq") else case.lens_k)
    doc = next((b for b in range(len(cu) - 1) if cu[b] <= idx[0] < cu[b + 1]), None)
    rec = {
        "tensor": tensor,
        "token": idx[0],
        "head": idx[1],
        "channel": idx[2],
        "document": doc,
        "position": idx[0] - cu[doc] if doc is not None else None,
        "kernel": json_number(x64.reshape(-1)[flat]),
        "reference": json_number(r64.reshape(-1)[flat]),
        "abs_error": json_number(err.reshape(-1)[flat]),
    }
    if baseline is not None:
        rec["bf16"] = json_number(baseline.detach().double().reshape(-1)[flat])
    return rec


def bounds_of(
    inp: Inputs, ref, *, scale: float, causal: bool, model: RecipeBoundModel, grads: bool = True
) -> BoundResult:
    """The elementwise bounds of O (and of the gradients, with ``grads``) on inputs ``inp`` whose
    float64 reference is ``ref`` (out, dq, dk, dv), under ``model``."""
    return attention_bounds(
        inp.q,
        inp.k,
        inp.v,
        inp.do if grads else None,
        inp.cu_q.tolist(),
        inp.cu_k.tolist(),
        scale=scale,
        causal=causal,
        model=model,
        ref_out=ref.out,
        ref_grads=(ref.dq, ref.dk, ref.dv) if grads else None,
    )

"""Perturbations of a pack's documents, shared by the causal and isolation checks and the fuzzer's
search (:mod:`flamia_verify.properties.search`): where a document lies in the pack, its rows replaced by
adversarial values, everything after a position replaced (what a causal output must not see), every
other document replaced (what an isolated document must not see).

It sits below the search and the checks, so that both can use it.
"""

from __future__ import annotations

import torch

from flamia_verify.properties.cases import Case, Inputs

__all__ = ["ADVERSARIAL", "doc_bounds", "future_inputs", "perturb_rows", "replace_others"]


#: adversarial replacement magnitudes (relative to N(0, 1) inputs): huge values move every block
#: maximum they touch; tiny ones remove a maximum the replaced positions held
ADVERSARIAL = {"huge": 1.0e4, "tiny": 1.0e-4}


def perturb_rows(x: torch.Tensor, rows: slice, kind: str, gen: torch.Generator) -> torch.Tensor:
    """A copy of x whose ``rows`` hold adversarial values (``huge``, ``tiny`` or ``nan``)."""
    y = x.clone()
    n = y[rows].shape
    if kind == "nan":
        y[rows] = float("nan")
    else:
        y[rows] = (torch.randn(n, generator=gen) * ADVERSARIAL[kind]).to(y.dtype).to(y.device)
    return y


def doc_bounds(case: Case, b: int):
    """(q0, q1, k0, k1): where document b's queries and keys lie in the pack."""
    q0 = sum(case.lens_q[:b])
    k0 = sum(case.lens_k[:b])
    return q0, q0 + case.lens_q[b], k0, k0 + case.lens_k[b]


def future_inputs(inp: Inputs, b: int, t: int, kind: str, seed: int, tensors=("q", "k", "v", "do")) -> Inputs:
    """Replace queries/dO after query t and keys/values after key t + offset (document b only)."""
    case = inp.case
    q0, q1, k0, k1 = doc_bounds(case, b)
    off = (k1 - k0) - (q1 - q0)
    g = torch.Generator().manual_seed(seed)
    new = {}
    for name in ("q", "k", "v", "do"):
        x = getattr(inp, name)
        if name in tensors:
            rows = slice(q0 + t + 1, q1) if name in ("q", "do") else slice(max(k0, k0 + t + off + 1), k1)
            x = perturb_rows(x, rows, kind, g)
        new[name] = x
    return inp.replace(**new)


def replace_others(inp: Inputs, b: int, kind: str, seed: int) -> Inputs:
    """Every document but b replaced by huge / tiny random values or NaN."""
    case = inp.case
    q0, q1, k0, k1 = doc_bounds(case, b)
    g = torch.Generator().manual_seed(seed)
    new = {}
    for name in ("q", "k", "v", "do"):
        x = getattr(inp, name).clone()
        lo, hi = (q0, q1) if name in ("q", "do") else (k0, k1)
        mask = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        mask[lo:hi] = False
        if kind == "nan":
            fill = torch.full(x.shape, float("nan"))
        else:
            fill = torch.randn(x.shape, generator=g) * (1e4 if kind == "huge" else 1e-4)
        x[mask] = fill.to(x.dtype).to(x.device)[mask]
        new[name] = x
    return inp.replace(**new)

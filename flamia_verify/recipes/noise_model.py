"""The recipe's expected error on given inputs: float64 attention with modelled rounding noise.

The first-order model of rounding to nearest: every rounded GEMM operand x becomes x (1 + e) with e
independent and uniform on [-u, u] (RMS u / sqrt(3)), u the unit roundoff the recipe gives that
operand (its :meth:`~flamia_verify.recipes.recipe.Recipe.bound_model`; 0 for operands a recipe keeps exact).
Running the FlashAttention forward and backward in float64 with that noise on the *same inputs* as
the kernel gives the error a correct kernel of the recipe should show there, amplification by large
scores, heavy tails or low rank included:

    forward   S = s (Q~)(K~)^T, P = exp(S - m), P~; O = P~ V~ / sum(P~)
    backward  the forward's P~ / l rebuilt (a consistent kernel), dP = dO~ V~^T, D = rowsum(dO O),
              dS = A (dP - D), dV = (A^T)~ dO~, dQ = s dS~ K~, dK = s (dS^T)~ Q~
    outputs   O, dQ, dK, dV rounded to the input dtype (noise of its unit roundoff); D is computed
              from the rounded O, as FlashAttention does

``predicted_errors`` returns the relative RMSE of O, dQ, dK, dV against the exact float64 result,
averaged over ``draws`` noise draws (deterministic in ``seed``).
"""

from __future__ import annotations

import math

import torch

from flamia_verify.recipes.bounds import RecipeBoundModel
from flamia_verify.recipes.operands import Operand

__all__ = ["predicted_errors"]


def _noisy(x: torch.Tensor, u: float, g: torch.Generator) -> torch.Tensor:
    if u == 0:
        return x
    e = (torch.rand(x.shape, generator=g, dtype=torch.float64) * 2 - 1).to(x.device) * u
    return x * (1 + e)


def _one_draw(q, k, v, do, cu_q, cu_k, scale, causal, m: RecipeBoundModel, g):
    H, Hk, D = q.shape[1], k.shape[1], q.shape[2]
    grp = H // Hk
    out = torch.zeros_like(q)
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape[0], H, D, dtype=q.dtype, device=q.device)
    dv = torch.zeros(k.shape[0], H, D, dtype=q.dtype, device=q.device)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        Q = q[q0:q1].permute(1, 0, 2)
        K = k[k0:k1].permute(1, 0, 2).repeat_interleave(grp, dim=0)
        V = v[k0:k1].permute(1, 0, 2).repeat_interleave(grp, dim=0)
        dO = do[q0:q1].permute(1, 0, 2)
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        vis = (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        Qn, Kn = _noisy(Q, m[Operand.Q_HD].u, g), _noisy(K, m[Operand.K_HD].u, g)
        S = scale * Qn @ Kn.transpose(1, 2)
        S = torch.where(vis, S, torch.full_like(S, -math.inf))
        mx = S.amax(-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        P = torch.where(vis, torch.exp(S - mx), torch.zeros_like(S))
        Pn = _noisy(P, m[Operand.P].u, g)
        L = Pn.sum(-1, keepdim=True)
        A = torch.where(L > 0, Pn / torch.where(L > 0, L, torch.ones_like(L)), torch.zeros_like(Pn))
        O = _noisy(A @ _noisy(V, m[Operand.V_SEQ].u, g), m.u_out, g)  # the output as the caller holds it
        dP = _noisy(dO, m[Operand.DO_HD].u, g) @ _noisy(V, m[Operand.V_HD].u, g).transpose(1, 2)
        Dl = (dO * O).sum(-1, keepdim=True)  # D from that output, as FlashAttention computes it
        dS = A * (dP - Dl)
        out[q0:q1] = O.permute(1, 0, 2)
        dv[k0:k1] = (_noisy(A, m[Operand.PT].u, g).transpose(1, 2) @ _noisy(dO, m[Operand.DO_SEQ].u, g)).permute(
            1, 0, 2
        )
        dq[q0:q1] = (scale * _noisy(dS, m[Operand.DS].u, g) @ _noisy(K, m[Operand.K_SEQ].u, g)).permute(1, 0, 2)
        dk[k0:k1] = (
            scale * _noisy(dS, m[Operand.DST].u, g).transpose(1, 2) @ _noisy(Q, m[Operand.Q_SEQ].u, g)
        ).permute(1, 0, 2)
    dk = dk.view(k.shape[0], Hk, grp, D).sum(2)
    dv = dv.view(k.shape[0], Hk, grp, D).sum(2)
    # the kernel returns its gradients in the input dtype (O is already rounded)
    return (out,) + tuple(_noisy(t, m.u_out, g) for t in (dq, dk, dv))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(x - ref))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def predicted_errors(inputs, ref, model: RecipeBoundModel, *, draws: int = 2, seed: int = 0) -> dict[str, float]:
    """Relative RMSE of O, dQ, dK, dV that the rounding model predicts on these inputs.

    inputs: :class:`~flamia_verify.properties.cases.Inputs`; ref: the float64 reference outputs
    (``out, dq, dk, dv`` attributes). Returns ``{"out": ..., "dq": ..., "dk": ..., "dv": ...}``.
    """
    c = inputs.case
    dev = ref.out.device
    q, k, v, do = (t.detach().to(dev, torch.float64) for t in (inputs.q, inputs.k, inputs.v, inputs.do))
    cu_q, cu_k = inputs.cu_q.tolist(), inputs.cu_k.tolist()
    g = torch.Generator().manual_seed(seed)
    acc = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    for _ in range(draws):
        res = _one_draw(q, k, v, do, cu_q, cu_k, c.scale, c.causal, model, g)
        for name, x in zip(acc, res):
            acc[name] += _rel(x, getattr(ref, name).to(torch.float64)) ** 2
    return {name: math.sqrt(val / draws) for name, val in acc.items()}

"""The GEMM operands of attention: one name for each, with its GEMM and its contraction axis.

    forward    S  = Q K^T      Q_HD, K_HD      along head_dim (the backward's S recompute too)
               O  = P V        P, V_SEQ        along keys
    backward   dP = dO V^T     DO_HD, V_HD     along head_dim
               dV = P^T dO     PT, DO_SEQ      along queries
               dQ = dS K       DS, K_SEQ       along keys
               dK = dS^T Q     DST, Q_SEQ      along queries

In every GEMM the first operand is the left one. The right operands of the four sequence GEMMs
(V_SEQ, DO_SEQ, K_SEQ, Q_SEQ) are blocked along the sequence: there one shared scale covers several
positions, which is where causal and cross-document leakage come from. P, PT, DS and DST are
computed inside the kernel; the others are its inputs q, k, v and dO.

Every vocabulary of operands (a design's roundings, the fused kernels' switches, the bound model)
is keyed by :class:`Operand`. This module imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

__all__ = ["Gemm", "Operand", "OPERANDS_REACHING", "describe_operands"]


class Gemm(Enum):
    """The six GEMMs of attention, by the tensor they compute (value: the equation)."""

    S = "S = QK^T"
    O = "O = PV"
    DP = "dP = dO V^T"
    DV = "dV = P^T dO"
    DQ = "dQ = dS K"
    DK = "dK = dS^T Q"

    @property
    def equation(self) -> str:
        return self.value


class Operand(Enum):
    """One operand of one GEMM: ``symbol`` (as the equations write it), ``gemm``, ``axis`` (the
    contraction axis its blocks run along: ``head_dim``, ``keys`` or ``queries``) and ``side``
    (``left`` or ``right`` in the GEMM)."""

    Q_HD = ("Q", Gemm.S, "head_dim", "left")
    K_HD = ("K", Gemm.S, "head_dim", "right")
    P = ("P", Gemm.O, "keys", "left")
    V_SEQ = ("V", Gemm.O, "keys", "right")
    DO_HD = ("dO", Gemm.DP, "head_dim", "left")
    V_HD = ("V", Gemm.DP, "head_dim", "right")
    PT = ("P^T", Gemm.DV, "queries", "left")
    DO_SEQ = ("dO", Gemm.DV, "queries", "right")
    DS = ("dS", Gemm.DQ, "keys", "left")
    K_SEQ = ("K", Gemm.DQ, "keys", "right")
    DST = ("dS^T", Gemm.DK, "queries", "left")
    Q_SEQ = ("Q", Gemm.DK, "queries", "right")

    def __init__(self, symbol: str, gemm: Gemm, axis: str, side: str):
        self.symbol = symbol
        self.gemm = gemm
        self.axis = axis
        self.side = side

    @property
    def key(self) -> str:
        """The operand's name in metrics and descriptions (``q_hd``, ``v_seq``, ``pt``, ...)."""
        return self.name.lower()

    @property
    def computed(self) -> bool:
        """Whether the kernel computes the operand (P, P^T, dS, dS^T) rather than reading an input."""
        return self in (Operand.P, Operand.PT, Operand.DS, Operand.DST)

    @property
    def what(self) -> str:
        """``"V in O = PV"``."""
        return f"{self.symbol} in {self.gemm.equation}"


def describe_operands(ops: Iterable[Operand]) -> str:
    """``"Q, K in S = QK^T"``: operands of one GEMM, named together."""
    ops = tuple(ops)
    gemms = {op.gemm for op in ops}
    if len(gemms) != 1:
        raise ValueError(f"operands of different GEMMs: {[op.name for op in ops]}")
    return f"{', '.join(op.symbol for op in ops)} in {ops[0].gemm.equation}"


#: the operands whose rounding reaches each output tensor (through the forward, the recompute of
#: P, dP and dS, and the output's own GEMM)
OPERANDS_REACHING: dict[str, tuple[Operand, ...]] = {
    "out": (Operand.Q_HD, Operand.K_HD, Operand.P, Operand.V_SEQ),
    "dv": (Operand.Q_HD, Operand.K_HD, Operand.PT, Operand.DO_SEQ),
    "dq": (Operand.Q_HD, Operand.K_HD, Operand.P, Operand.DO_HD, Operand.V_HD, Operand.DS, Operand.K_SEQ),
    "dk": (Operand.Q_HD, Operand.K_HD, Operand.P, Operand.DO_HD, Operand.V_HD, Operand.DST, Operand.Q_SEQ),
}

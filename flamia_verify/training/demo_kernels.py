"""train-parity's planted kernels under their older name: they are records of the known-bad registry
now, built in :mod:`flamia_verify.known_bad.demos` (``--kernel flamia_verify.known_bad.demos:future_leak``
is the same kernel as ``--kernel flamia_verify.training.demo_kernels:future_leak``)."""

from flamia_verify.known_bad.demos import LADDER_NOISE, LADDER_TEMPERATURE, future_leak, ladder, next_token_leak

__all__ = ["future_leak", "next_token_leak", "ladder", "LADDER_NOISE", "LADDER_TEMPERATURE"]

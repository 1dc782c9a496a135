"""Placeholder: replaced below."""
from dataclasses import dataclass
__all__ = ["FuzzResult", "fuzz", "replay_case"]
@dataclass
class FuzzResult:
    pass
def fuzz(*a, **k):
    raise NotImplementedError
def replay_case(*a, **k):
    raise NotImplementedError

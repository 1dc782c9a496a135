"""benchmarks/offline_resources.py's reading of a SASS listing (the compile step needs Triton 3.6's
sm_90a toolchain and is run by hand; its parsing is plain text and tested here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "offline_resources.py"
_SPEC = importlib.util.spec_from_file_location("offline_resources", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
offline = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(offline)

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ; /* 0x01e0 */
        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR8], R88 ; /* 0x01e0 */
        /*0030*/                   MUFU.EX2 R2, R3 ;                       /* 0x0000000300027308 */
        /*0040*/               @P0 BRA 0x10 ;                              /* 0x000000dc00a03947 */
        /*0050*/                   BRA 0x60 ;                              /* 0x000000dc00a03947 */
        /*0060*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_a_backward_branch_is_a_loop_with_its_mma_cycles():
    (loop,) = offline.parse_loops(LISTING, min_len=1)  # the forward BRA 0x60 is no loop
    assert loop["length"] == 4 and loop["mma"] == 2 and loop["mufu"] == 1
    cycles = 64 * 128 * 16 / 2048 + 64 * 128 * 32 / 4096  # BF16 and E4M3 dense rates: 64 + 64
    assert loop["issue_per_tensor"] == pytest.approx(4 / cycles)


def test_short_loops_are_left_out_and_a_loop_without_mma_has_no_ratio():
    assert offline.parse_loops(LISTING, min_len=5) == []
    plain = "\n".join(line for line in LISTING.splitlines() if "GMMA" not in line)
    (loop,) = offline.parse_loops(plain, min_len=1)
    assert loop["mma"] == 0 and loop["issue_per_tensor"] == float("inf")
